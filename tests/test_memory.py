"""Tests of the allocator choice (``qkv.memory``): each runs in a child process of its own, as
the ``qkv`` command does, so the test process keeps its allocator."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qkv.memory import tcmalloc_path

# The child reports what it runs on after choose_allocator(), and echoes its stdin, which the
# restart must leave unread.
CHILD = """
import os, sys
from qkv.memory import choose_allocator
chosen = choose_allocator()
maps = open("/proc/self/maps").read()
print(chosen, "tcmalloc" in maps, os.getpid(), sys.stdin.read().strip(), sep="|")
"""


def child(*, stdin: str, **env: str) -> tuple[str, bool, int, str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "QKV_MALLOC", "QKV_MALLOC_EXEC")}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env={**environment, **env},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(stdin, timeout=60)
    assert proc.returncode == 0, err
    chosen, loaded, pid, echoed = out.rstrip("\n").split("|")
    assert int(pid) == proc.pid, "the restart must keep the process (exec, not a child)"
    return chosen, loaded == "True", int(pid), echoed.strip()


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD and /proc are Linux's")
def test_restarts_on_tcmalloc_keeping_pid_and_stdin():
    if tcmalloc_path() is None:
        pytest.skip("libtcmalloc_minimal.so.4 is not installed (scripts/setup.sh installs it)")
    chosen, loaded, _, echoed = child(stdin="hello\n")
    assert chosen == "tcmalloc" and loaded
    assert echoed == "hello"


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD and /proc are Linux's")
def test_default_keeps_the_c_library_allocator():
    chosen, loaded, _, echoed = child(stdin="x", QKV_MALLOC="default")
    assert chosen == "default" and not loaded
    assert echoed == "x"


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
def test_glibc_is_tuned_when_tcmalloc_is_not_loaded():
    # The guard says "already restarted", so the child stays on glibc and tunes it instead.
    chosen, loaded, _, _ = child(stdin="", QKV_MALLOC_EXEC="1")
    assert chosen.startswith("glibc (tuned") and not loaded
