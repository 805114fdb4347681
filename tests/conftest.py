"""What many test files share: :func:`one_thread`, torch on one thread for a whole test module.

A file that wants it says ``pytestmark = pytest.mark.usefixtures("one_thread")`` (or a test or
fixture names it); applied to every file are numba's optimisation level and, when pytest-xdist
runs the files in parallel (``bash scripts/test.sh``: ``-n auto --dist loadfile``), how many
workers there are, the cores shared out between them, and which files start first (below).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# librosa (the reference of test_audio.py and test_vocoder.py) compiles some twenty numba kernels
# when librosa.util is first imported, whichever test does that: on a fresh venv (CI's clean clone;
# numba caches them in site-packages after) 35-38 CPU-seconds of LLVM, 24-30 unoptimised (a
# contended 2-core machine). The tests run those kernels on a few kilobytes, if at all, and without
# fastmath LLVM's optimiser may not reorder float arithmetic: the results are the same.
os.environ.setdefault("NUMBA_OPT", "0")

MAX_WORKERS = 2  # CI has 2 cores; the timing-sensitive tests are checked beside one busy neighbour, not more


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: one worker per core, at most two; none (the files run here, as plain pytest runs
    them) when the arguments name one file or fewer, since xdist's --dist loadfile gives a
    file's tests to one worker (its module fixtures are built once) and a second would only idle.
    (xdist's own count is psutil's physical cores: 1 on a 2-vCPU machine.) Its variable
    PYTEST_XDIST_AUTO_NUM_WORKERS, where set, decides instead (xdist reads it)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    files = {str(arg).split("::")[0] for arg in config.args}
    if len(files) <= 1 and all(f.endswith(".py") for f in files):
        return 0
    return max(1, min(MAX_WORKERS, _cores()))


def pytest_configure(config: pytest.Config) -> None:
    """In an xdist worker: torch's threads (and a child process's, through OMP_NUM_THREADS) are
    this worker's share of the cores. Two workers of two threads each on 2 cores leave OpenMP's
    spinning threads waiting on each other (see :func:`one_thread`: tens of times slower)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        threads = max(1, _cores() // int(workers))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


# The files that take longest go first, longest first, so that the two workers end together
# instead of one of them alone on a long file at the end (a file's seconds of one worker, a
# contended 2-core machine, 2026-12-07: docs 484, distributed 439, resume 325, translation 216,
# readme 187, onnx 180, fuzz_api 86; no other file over 62; test_gguf and test_chat_templates
# add 201 and 102 where the real SmolLM2 is installed). test_audio.py before test_vocoder.py:
# the first to import librosa compiles its numba kernels into site-packages' cache (a clean
# venv: ~30 CPU-seconds), and the second then loads them instead of compiling them again.
FIRST = [
    "test_docs.py",
    "test_distributed.py",
    "test_resume.py",
    "test_translation.py",
    "test_gguf.py",
    "test_readme.py",
    "test_onnx.py",
    "test_chat_templates.py",
    "test_fuzz_api.py",
    "test_audio.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files named in FIRST go first, in its order; the rest keep pytest's (stable sort)."""
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.path).name, len(rank)))


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread for the module, then as it was: a tiny model's ops gain
    nothing from two, and on a shared 2-core machine OpenMP's waiting threads made them many times
    slower (a training fixture of test_speech_model.py 50 times: 118 s against 2 s; the tiny
    Whisper's decoding in test_serve_audio.py 30 times; the server's steps in
    test_serve_constraints.py a hundred times), in the server's model thread and in the library's
    decoding it is compared with alike (module-scoped, so that a module's fixtures are built on
    one thread too)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
