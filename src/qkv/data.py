"""Data files: where the shared corpora live, and reading text with errors that name the line.

What is here: :func:`data_root` (``$QKV_DATA``, else ``../shared/data`` beside the project),
:func:`resolve` (a recipe's data path: as given, or under the data root) and
:func:`read_text` (UTF-8, bad bytes reported as file:line). Corpora are read from there,
never copied into the repository.

What is not here: tokenization (``tokenization.py``), batching (``training.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

from qkv.errors import UserError

_PROJECT = Path(__file__).resolve().parents[2]  # src/qkv/data.py -> the project root


def data_root() -> Path:
    """``$QKV_DATA`` if set, else ``../shared/data`` next to the project (or the working directory)."""
    if os.environ.get("QKV_DATA"):
        return Path(os.environ["QKV_DATA"])
    for base in (Path.cwd(), _PROJECT):
        candidate = base.parent / "shared" / "data"
        if candidate.is_dir():
            return candidate
    return _PROJECT.parent / "shared" / "data"


def resolve(path: str | Path) -> Path:
    """A data path as given if it exists, else relative to :func:`data_root`; UserError if neither."""
    given = Path(path).expanduser()
    if given.is_file():
        return given
    under_root = data_root() / given
    if not given.is_absolute() and under_root.is_file():
        return under_root
    if given.is_dir():
        raise UserError(f"{path} is a directory; give a file")
    raise UserError(f"data file {path} not found (also looked in {under_root}; set QKV_DATA to the data folder)")


def read_text(path: str | Path) -> str:
    """The whole file as text; invalid UTF-8 is a UserError naming the file and line."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not valid UTF-8 ({e.reason})") from None
