"""Building a corpus's utterances in parallel: how many workers (:func:`worker_count`, default one
per core this process may use), running every job on a pool with a progress line
(:func:`run_all`), the checks of the settings every builder takes (:func:`check_seed`,
:func:`check_count`) and the tests' hook that stops a build midway (:func:`stall`).

Each utterance's random choices come from a generator seeded with (seed, split, index), so the
bytes do not depend on the number of workers.

What is not here: what the jobs do (``fsdd.py``, ``espeak.py``), where the results go
(``cache.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, as_completed

from qkv.errors import UserError
from qkv.progress import progress

STALL_ENV = "QKV_SPEECH_STALL_AT"  # tests only: a build stops (sleeps) at this utterance index, to be killed


def worker_count(workers: int | None) -> int:
    """``workers`` checked, or (None) one per core this process may run on."""
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise UserError(f"workers must be a positive integer, got {workers!r}")
        return workers
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))  # the cores this process may run on
    return os.cpu_count() or 1


def run_all(jobs: Sequence[tuple], work: Callable, executor: Executor | None, *, desc: str) -> list:
    """``work(*job)`` for every job, on ``executor`` (None: here, one by one), with progress; the
    results in the jobs' order."""
    results: list = [None] * len(jobs)
    bar = progress(len(jobs), desc=desc, unit="utterance")
    try:
        if executor is None:
            for i, job in enumerate(jobs):
                results[i] = work(*job)
                bar.update(1)
        else:
            futures = {executor.submit(work, *job): i for i, job in enumerate(jobs)}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                bar.update(1)
    finally:
        bar.close()
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
    return results


def stall(index: int) -> None:
    """Tests only: stop for good at utterance ``$QKV_SPEECH_STALL_AT`` so the build can be killed midway."""
    at = os.environ.get(STALL_ENV)
    if at and index >= int(at):
        time.sleep(3600)


def check_seed(seed: int) -> None:
    """A UserError unless ``seed`` is a non-negative integer."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UserError(f"seed must be a non-negative integer, got {seed!r}")


def check_count(name: str, value: int, *, allow_zero: bool = False) -> None:
    """A UserError naming ``name`` unless ``value`` is a positive (or, ``allow_zero``, non-negative) integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise UserError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} integer, got {value!r}")
