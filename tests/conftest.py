"""What many test files share: :func:`one_thread`, torch on one thread for a whole test module.

A file that wants it says ``pytestmark = pytest.mark.usefixtures("one_thread")`` (or a test or
fixture names it); the one thing applied to every file is numba's optimisation level (below).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# librosa (the reference of test_audio.py and test_vocoder.py) compiles some twenty numba kernels
# when librosa.util is first imported, whichever test does that: on a fresh venv (CI's clean clone;
# numba caches them in site-packages after) 35-38 CPU-seconds of LLVM, 24-30 unoptimised (a
# contended 2-core machine). The tests run those kernels on a few kilobytes, if at all, and without
# fastmath LLVM's optimiser may not reorder float arithmetic: the results are the same.
os.environ.setdefault("NUMBA_OPT", "0")


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
