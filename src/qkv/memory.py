"""Process-wide memory-allocator choice for CPU training and decoding.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc's allocator hands freed
memory back to the kernel (large blocks are ``mmap``-ed and unmapped one by one; the heap top
is trimmed) and its arenas serve PyTorch's worker threads poorly, so a training step, which
frees and re-allocates the same activations every time, pays again and again for fresh pages:
page faults and the kernel zeroing each 4 KiB page. TCMalloc (gperftools) keeps freed memory in
per-size free lists and per-thread caches instead. Measured here (2 cores, torch 2.13,
2026-12-02), training target tokens/s of the same steps:

    qkv train recipes/multi30k_en_de_lc.yaml, first 75 s  glibc 6,335   tcmalloc 10,784  (1.70x)
    bench/mt_speed.py, small size, bf16, qkv             glibc 3,668   tcmalloc  5,259  (1.43x)

``prefer_tcmalloc`` restarts the process (``exec``, same pid, same arguments, stdin untouched)
with ``LD_PRELOAD`` naming ``libtcmalloc_minimal.so.4`` when that library is installed
(Debian/Ubuntu: ``apt-get install libtcmalloc-minimal4``, which ``scripts/setup.sh`` does) and
not loaded yet. Where it is missing, ``tune_malloc`` sets glibc to keep freed blocks up to
32 MiB and never trim the heap: less (1.03x on the recipe above, 1.43x on the synthetic
batches), but something. Either changes nothing but speed and resident size: freed memory
stays with the process until it ends.

The entry points (the ``qkv`` command, ``python -m qkv``, ``bench/`` scripts) call these once
at start; library code never does (no import-time side effects). ``QKV_MALLOC=default`` keeps
the C library's allocator as it is (for A/B measurements).

:func:`available_memory` says how many bytes the process may still take (the kernel's
``MemAvailable``, a cgroup's limit, at most ``$QKV_MAX_MEMORY``), for the checks that refuse
or split work before allocating it (loading a model, batched decoding); :func:`human_bytes`
writes a size for their messages.

What is not here: anything about tensors or devices.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys

from qkv.errors import UserError

TCMALLOC = "libtcmalloc_minimal.so.4"
# Where Debian, Ubuntu and Fedora install it; LD_PRELOAD takes the bare name, but asking the
# dynamic loader's search path costs a process start, so look for the file.
_TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64")
_GUARD = "QKV_MALLOC_EXEC"  # set in the restarted process: never restart twice

# mallopt(3) parameter numbers, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's cap on M_MMAP_THRESHOLD on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX): larger
# blocks are always mmap-ed, whatever is asked.
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 2**31 - 1  # an int, as mallopt takes: in effect, never trim


def allocator() -> str:
    """Which allocator this process runs on: 'tcmalloc', 'glibc' or 'default' (not chosen)."""
    if os.environ.get("QKV_MALLOC", "").lower() == "default":
        return "default"
    return "tcmalloc" if "tcmalloc" in os.environ.get("LD_PRELOAD", "") else "glibc"


def tcmalloc_path() -> str | None:
    """The installed ``libtcmalloc_minimal.so.4``, or None."""
    for folder in _TCMALLOC_DIRS:
        path = os.path.join(folder, TCMALLOC)
        if os.path.exists(path):
            return path
    return None


def prefer_tcmalloc() -> None:
    """Restart this Python process on TCMalloc when it is installed and not loaded; else return.

    Returns (doing nothing) when ``QKV_MALLOC=default`` is set, when anything is preloaded
    already, when this process is already the restarted one, when the library is not
    installed, or when the restart fails. Call it only from a program's entry point (it
    restarts the whole interpreter with its original arguments) and before any input is read.
    """
    # Anything already preloaded (TCMalloc, or the user's jemalloc, mimalloc...) is left alone.
    if allocator() != "glibc" or os.environ.get("LD_PRELOAD") or os.environ.get(_GUARD) or sys.platform != "linux":
        return
    path = tcmalloc_path()
    if path is None:
        return
    env = {**os.environ, "LD_PRELOAD": path, _GUARD: "1"}
    # TCMalloc reports every allocation over 1 GiB on stderr; big logit tensors are routine here.
    env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(2**40))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:  # cannot start Python again here (no executable path, noexec mount): stay
        return


def tune_malloc() -> bool:
    """Where TCMalloc is not loaded, keep freed glibc memory for reuse. Returns whether glibc took it.

    A no-op (False) on TCMalloc, with ``QKV_MALLOC=default``, or where the C library is not
    glibc. Safe to call more than once.
    """
    if allocator() != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; setting either also turns off glibc's dynamic thresholds.
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def choose_allocator() -> str:
    """``prefer_tcmalloc`` then ``tune_malloc``; returns what the process runs on, for logs."""
    prefer_tcmalloc()
    if tune_malloc():
        return "glibc (tuned: freed memory kept)"
    return allocator()


MAX_MEMORY = "QKV_MAX_MEMORY"  # a cap on what the memory checks count as available: bytes, or 512M, 8G
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def available_memory() -> int | None:
    """Bytes the process may still allocate: ``MemAvailable`` of ``/proc/meminfo``, less where
    a cgroup (v2) limits the process to less, at most ``$QKV_MAX_MEMORY`` (e.g. ``8G``); None
    when none of them says (not Linux, and no cap set). A bad ``$QKV_MAX_MEMORY`` is a UserError."""
    known = [n for n in (_meminfo_available(), _cgroup_room(), _cap()) if n is not None]
    return min(known) if known else None


def human_bytes(n: float) -> str:
    """A size for a message: ``1.5 GiB``, ``320 MiB``, ``12 KiB``, ``7 bytes``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} bytes"


def _cap() -> int | None:
    text = os.environ.get(MAX_MEMORY, "").strip()
    if not text:
        return None
    found = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", text, flags=re.IGNORECASE)
    if not found:
        raise UserError(f"{MAX_MEMORY}={text!r}: expected a number of bytes, e.g. 8G, 512M or 1000000")
    return int(float(found.group(1)) * _UNITS[found.group(2).upper()])


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """memory.max less memory.current of this process's cgroup (v2); None without a limit."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            line = next((x for x in f if x.startswith("0::")), None)
        if line is None:
            return None
        folder = os.path.join("/sys/fs/cgroup", line.strip()[3:].lstrip("/"))
        with open(os.path.join(folder, "memory.max"), encoding="ascii") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(folder, "memory.current"), encoding="ascii") as f:
            return max(0, int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        return None
