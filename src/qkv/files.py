"""Atomic writes and JSON reading: a file or a whole directory goes to a temporary sibling,
which is flushed to disk and then renamed over the target, so a reader sees the old version or
the new one, never half of one.

What is here: :func:`write_atomic` (one file), :func:`atomic_directory` (a directory: model
directories, ``checkpoint.py``; Hugging Face exports, ``hf.py``), :func:`check_writable` (refuse
an output the process may not write, before the work that makes it), :func:`read_json_object`
(a JSON object, with the file named in every error) and :func:`sha256_file` (a file's digest, for
model directories and the keys of cached corpora). What is not here: what goes into the files.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qkv.errors import UserError

# The errors of a write that the user can fix (room, quota, permissions, a read-only disk):
# they become one line naming the target; the previous version of the target stays whole.
STORAGE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS)


def umask() -> int:
    """The process's file-mode creation mask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def storage_errno(error: BaseException) -> int | None:
    """The errno of a failed write that the user can fix (:data:`STORAGE_ERRORS`), else None:
    an OSError's own, or the ``(os error N)`` that safetensors' errors carry in their text."""
    number = error.errno if isinstance(error, OSError) else None
    if number is None:
        found = re.search(r"\(os error (\d+)\)", str(error))
        number = int(found.group(1)) if found else None
    return number if number in STORAGE_ERRORS else None


def storage_error(path: Path, error: BaseException) -> UserError:
    """One line for a write that failed for want of room or permission."""
    reason = os.strerror(storage_errno(error) or 0) if not isinstance(error, OSError) else error.strerror
    return UserError(f"cannot write {path}: {reason or error}; the previous {path.name}, if any, is intact")


def write_atomic(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (a temporary sibling, fsync, rename).

    The file gets the permissions the umask gives a new file (``mkstemp`` alone would make it
    private, 0600). A full disk, a file-size limit or a permission refused is a UserError
    naming ``path``; the previous ``path`` is left as it was.
    """
    path = Path(path)
    if path.is_dir():  # the final rename would fail after the work (IsADirectoryError)
        raise UserError(f"cannot write {path}: it is a directory; name a file")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as e:  # no room, no permission, a folder that files cannot be made in (/proc)
        if e.errno in STORAGE_ERRORS:
            raise storage_error(path, e) from None
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.errno in STORAGE_ERRORS:
            raise storage_error(path, e) from None
        raise
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Write the directory ``path`` whole or not at all: yields an empty temporary sibling to fill.

    When the block ends normally, every file in the sibling gets the permissions the umask gives
    a new file (as :func:`write_atomic`'s: 0644 and 0755 under the usual 022), is flushed to
    disk, and the sibling replaces ``path`` (whatever directory is there is removed; the caller decides whether it may
    be). Directories cannot be swapped in one rename, so for an instant the previous version
    sits at ``.NAME.old``; if the second rename fails it is put back. When the block raises, the
    sibling is removed and ``path`` is left as it was. The parent directory must exist.
    """
    path = Path(path)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    except OSError as e:
        if e.errno in STORAGE_ERRORS:
            raise storage_error(path, e) from None
        raise
    old = path.with_name(f".{path.name}.old")
    moved = False
    try:
        yield tmp
        mask = umask()
        # One rule for every file: the permissions the umask gives a new file (0644 under the
        # usual 022), whoever wrote it (safetensors writes 0600; mkdtemp makes a directory 0700).
        os.chmod(tmp, 0o777 & ~mask)
        for file in sorted(tmp.rglob("*")):
            if file.is_dir():
                os.chmod(file, 0o777 & ~mask)
            elif file.is_file():
                os.chmod(file, 0o666 & ~mask)
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        _fsync_directory(tmp)
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            moved = True
        os.replace(tmp, path)
        moved = False
        _fsync_directory(path.parent)  # the renames themselves reach the disk
        shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if moved and not path.exists():
            os.replace(old, path)
        if storage_errno(e) is not None:
            raise storage_error(path, e) from None
        raise


def _fsync_directory(path: Path) -> None:
    """Flush a directory's entries to disk where the platform allows it (Windows cannot open a
    directory; there the rename is as durable as the OS makes it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the data files were flushed
    finally:
        os.close(fd)


def check_writable(path: str | Path, *, inside: bool) -> None:
    """Refuse (UserError naming ``path``) an output that the process has no permission to write,
    before any long work: with ``inside``, files will be made inside the directory ``path``;
    without, ``path`` itself will be made or replaced in its parent (``atomic_directory``,
    ``write_atomic``). Either needs the nearest existing directory (of ``path``, or of its
    parent) to be writable; ``mkdir(parents=True)`` makes the rest."""
    path = Path(path)
    existing = path if inside else path.parent
    # os.path.exists, not Path.exists: below a directory that cannot be searched the latter
    # raises PermissionError instead of answering.
    while not os.path.exists(existing) and existing != existing.parent:
        existing = existing.parent
    if not os.path.isdir(existing):
        raise UserError(f"cannot write {path}: {existing} is not a directory; choose another output path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {path}: no permission to write in {existing}; choose another output path")


# What a JSON file qkv reads (config.json, a tokenizer's vocabulary, an index) may weigh: the
# largest real one is a few MiB; a larger one is a mistake, read whole into memory before parsing.
JSON_LIMIT = 256 * 2**20

# stat's file types, for a message that says what a path is instead of a regular file.
_FILE_TYPES = {
    stat.S_ISDIR: "a directory",
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
    stat.S_ISFIFO: "a named pipe",
    stat.S_ISSOCK: "a socket",
}


def file_problem(path: str | Path, *, limit: int | None = None) -> str | None:
    """Why ``path`` cannot be read as a file, in words (None: it can): it is missing, a link to
    nothing, not a regular file (a directory, a device such as ``/dev/zero``, a pipe that would
    block), or larger than ``limit`` bytes. Links are followed. Never opens the file."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return "is a link to nothing" if os.path.islink(path) else "is missing"
    except OSError as e:
        return f"cannot be read: {e.strerror or e}"
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _FILE_TYPES.items() if test(info.st_mode)), "not a file")
        return f"is not a regular file ({kind})"
    if limit is not None and info.st_size > limit:
        return f"is too large ({info.st_size:,} bytes; at most {limit:,} are read)"
    return None


def read_json_object(path: str | Path, *, limit: int = JSON_LIMIT) -> dict:
    """The JSON object in ``path``; a missing, unreadable, irregular (:func:`file_problem`) or
    oversized file (over ``limit`` bytes), invalid JSON or anything but an object is a UserError
    naming the file."""
    path = Path(path)
    problem = file_problem(path, limit=limit)
    if problem is not None:
        raise UserError(f"cannot read {path}: it {problem}")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # invalid JSON, or bytes that are not UTF-8
        raise UserError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:  # arrays or objects nested deeper than Python's stack
        raise UserError(f"{path} is nested too deeply to read as JSON") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} must hold a JSON object")
    return value


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes, in hex, read 1 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
