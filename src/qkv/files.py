"""Atomic file writes: the bytes go to a temporary sibling, which is flushed to disk and then
renamed over the target, so a reader sees the old file or the new one, never half of one.

What is here: :func:`write_atomic`. What is not here: directories written atomically (model
directories, ``checkpoint.py``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (a temporary sibling, fsync, rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
