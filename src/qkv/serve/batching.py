"""Dynamic batching: requests that arrive within a few milliseconds share one forward pass.

What is here: :class:`Slots` (how many requests the server holds at once: waiting, running or
streaming; one more is refused with :class:`Busy`, which the app answers with 429 and
Retry-After) and :class:`Batcher`, which runs every piece of model work on one thread (the
model thread; PyTorch uses the cores inside each operation) and merges jobs:

  * a job has a ``key``; jobs with the same key (the same model, endpoint and decoding
    options) can be computed as one: their inputs are concatenated, ``run`` is called once
    and each job gets its own slice of the results;
  * the first job waiting picks its companions: every waiting job with its key, then those
    that arrive until ``wait_s`` after it arrived, as long as the batch's ``cost`` (source
    tokens x beam) stays within ``max_cost``; a job that waited longer does not wait again;
  * a job whose caller stopped waiting (a timeout, a client gone) before its batch started is
    skipped; one already running is finished and its result dropped. A caller waits for its
    own job only as long as its own timeout, never for the batch before it to finish.

With ``enabled=False`` every job runs alone (the benchmark's baseline).

It batches the endpoints whose work is one call over a fixed batch (translations, embeddings,
labels, transcriptions) and runs the generations that continuous batching cannot hold (a beam,
constraints, a continuation that slides past the window, an encoder-decoder's chat), each alone;
every other generation is decoded by continuous batching (``continuous.py``), whose steps run
on this batcher's model thread too (:meth:`Batcher.call`).

What is not here: what a job computes (``jobs.py``), HTTP (``app.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any


class Busy(Exception):
    """Every slot is taken; ``retry_after`` is a guess, in whole seconds, of when one frees."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is busy; retry in {retry_after} s")
        self.retry_after = retry_after


class Slots:
    """At most ``limit`` requests held at once (counted from admission to the response's end)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0
        self.seconds = 1.0  # a running mean of how long a request holds its slot

    def take(self) -> float:
        """Take a slot or raise :class:`Busy`; returns the time it was taken (for :meth:`free`)."""
        if self.active >= self.limit:
            raise Busy(max(1, math.ceil(self.seconds)))
        self.active += 1
        return time.monotonic()

    def free(self, taken: float) -> None:
        self.active -= 1
        self.seconds = 0.9 * self.seconds + 0.1 * (time.monotonic() - taken)


@dataclass(eq=False)
class Job:
    """A piece of model work: ``run(inputs)`` returns one result per input. Jobs whose ``key``
    is equal (and not None) may be run as one call over their inputs joined. ``cost`` is what
    the job adds to a batch's budget."""

    run: Callable[[list], list]
    inputs: list
    key: Hashable | None = None
    cost: int = 1
    arrived: float = field(default_factory=time.monotonic)
    future: asyncio.Future | None = None


@dataclass
class BatchStats:
    """What the last batch was: how many jobs and inputs, and how long it took."""

    jobs: int
    inputs: int
    seconds: float


class Batcher:
    """Runs :class:`Job` s on the model thread, batching jobs of one key (see the module)."""

    def __init__(
        self,
        *,
        enabled: bool = True,
        wait_s: float = 0.005,
        max_cost: int = 8192,
        on_batch: Callable[[BatchStats, list[Job]], None] | None = None,
    ) -> None:
        self.enabled, self.wait_s, self.max_cost = enabled, wait_s, max_cost
        self.on_batch = on_batch
        self.thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="qkv-model")
        self.waiting: list[Job] = []
        self._arrived: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        self._arrived = asyncio.Event()
        self._loop_task = asyncio.get_running_loop().create_task(self._loop(), name="qkv-batcher")

    async def stop(self) -> None:
        """Stop taking jobs; the one running finishes (the model thread is shut down after it)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        for job in self.waiting:
            if job.future is not None and not job.future.done():
                job.future.cancel()
        self.waiting.clear()
        await asyncio.get_running_loop().run_in_executor(None, self.thread.shutdown)

    # ------------------------------------------------------------------ use

    async def submit(self, job: Job, *, timeout: float) -> list:
        """Queue ``job`` and wait for its results, at most ``timeout`` seconds
        (``TimeoutError`` then; the job is dropped)."""
        if self._loop_task is None:
            self.start()  # an app run without its lifespan (a test transport) starts it here
        job.future = asyncio.get_running_loop().create_future()
        self.waiting.append(job)
        assert self._arrived is not None
        self._arrived.set()
        try:
            return await asyncio.wait_for(job.future, timeout)
        finally:
            if not job.future.done():
                job.future.cancel()  # the loop skips it, or drops its result
            if job in self.waiting:
                self.waiting.remove(job)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the model thread, between batches (a streamed token, say)."""
        return await asyncio.get_running_loop().run_in_executor(self.thread, fn, *args)

    # ------------------------------------------------------------------ the loop

    def _companions(self, first: Job, batch: list[Job], cost: int) -> int:
        """Move waiting jobs of ``first``'s key into ``batch`` while the budget allows."""
        for job in list(self.waiting):
            if job.key != first.key or (job.future is not None and job.future.done()):
                continue
            if cost + job.cost > self.max_cost:
                break
            self.waiting.remove(job)
            batch.append(job)
            cost += job.cost
        return cost

    async def _loop(self) -> None:
        assert self._arrived is not None
        while True:
            while not self.waiting:
                self._arrived.clear()
                await self._arrived.wait()
            first = self.waiting.pop(0)
            if first.future is None or first.future.done():
                continue  # its caller stopped waiting
            batch, cost = [first], first.cost
            if self.enabled and first.key is not None:
                until = first.arrived + self.wait_s
                while True:
                    cost = self._companions(first, batch, cost)
                    left = until - time.monotonic()
                    if cost >= self.max_cost or left <= 0:
                        break
                    self._arrived.clear()
                    try:
                        await asyncio.wait_for(self._arrived.wait(), left)
                    except asyncio.TimeoutError:
                        cost = self._companions(first, batch, cost)
                        break
            await self._run(batch)

    async def _run(self, batch: list[Job]) -> None:
        batch = [job for job in batch if job.future is not None and not job.future.done()]
        if not batch:
            return
        inputs = [x for job in batch for x in job.inputs]
        start = time.perf_counter()
        try:
            results = await self.call(batch[0].run, inputs)
        except Exception as e:  # each caller gets the error (a bug is still a 500 there)
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(e)
            return
        if self.on_batch is not None:
            self.on_batch(BatchStats(len(batch), len(inputs), time.perf_counter() - start), batch)
        k = 0
        for job in batch:
            part, k = results[k : k + len(job.inputs)], k + len(job.inputs)
            if not job.future.done():
                job.future.set_result(part)
