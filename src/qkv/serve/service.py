"""What every route shares: the served models, the limits, the metrics, the slots, the batcher
(fixed batches: translations, embeddings, labels, speech; and the generations decoded alone) and
the scheduler of continuous batching (every other generation: ``/v1/generate``, ``/v1/chat``,
OpenAI's routes).

What is here: :class:`Service` (one per app: :meth:`~Service.pick` the model a request names,
:meth:`~Service.run` a job on the model thread within a slot and the request's timeout,
:meth:`~Service.take_slot` for a stream that holds one, token counts for the metrics) and
:data:`Shared`, the FastAPI dependency by which a route receives it (``app.state.service``).

What is not here: the routes (``routes/``), what they check (``validation.py``), what the jobs
compute (``jobs.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, Request

from qkv.serve import schemas as s
from qkv.serve.batching import Batcher, BatchStats, Busy, Job, Slots
from qkv.serve.continuous import Scheduler
from qkv.serve.errors import ApiError, described
from qkv.serve.metrics import Metrics
from qkv.serve.models import Served
from qkv.serve.settings import Settings


class Service:
    """The state behind the routes of one app (see the module)."""

    def __init__(self, models: dict[str, Served], settings: Settings) -> None:
        self.models, self.settings = models, settings
        self.metrics = Metrics()
        self.slots = Slots(settings.max_active)
        self.batcher = Batcher(
            enabled=settings.batching,
            wait_s=settings.batch_wait_ms / 1000,
            max_cost=settings.max_batch_tokens,
            on_batch=self._counted,
        )
        self.scheduler = Scheduler(
            self.batcher,
            wait_s=settings.batch_wait_ms / 1000 if settings.batching else 0.0,
            max_tokens=settings.max_batch_tokens,
            on_join=self._joined,
        )

    def _counted(self, stats: BatchStats, jobs: list[Job]) -> None:
        self.metrics.batch_requests.observe(stats.jobs)
        self.metrics.batch_inputs.observe(stats.inputs)

    def _joined(self, requests: int, rows: int) -> None:
        self.metrics.batch_requests.observe(requests)
        self.metrics.batch_inputs.observe(rows)

    def pick(self, name: str | None, endpoint: str) -> Served:
        """The model a request names, or the one model that answers ``endpoint``."""
        if name is not None:
            if name not in self.models:
                raise ApiError(404, "unknown_model", f"no model named {described(name)}; GET /v1/models lists them")
            served = self.models[name]
            if endpoint not in served.endpoints:
                answers = ", ".join(f"/v1/{e}" for e in served.endpoints)
                raise ApiError(
                    422,
                    "wrong_model",
                    f"model {name!r} ({served.kind}) does not answer /v1/{endpoint}; it answers {answers}",
                )
            return served
        able = [m for m in self.models.values() if endpoint in m.endpoints]
        if len(able) == 1:
            return able[0]
        if not able:
            raise ApiError(422, "wrong_model", f"no model served here answers /v1/{endpoint}")
        names = ", ".join(m.name for m in able)
        raise ApiError(422, "model_required", f"several models answer /v1/{endpoint} ({names}); name one in 'model'")

    def timeout_of(self, req: s.Request) -> float:
        """The request's own timeout, at most the server's."""
        return min(req.timeout or self.settings.timeout_s, self.settings.timeout_s)

    def take_slot(self) -> Callable[[], None]:
        """A slot for one request, or 429; returns what frees it (once, however often called)."""
        try:
            taken = self.slots.take()
        except Busy as e:
            self.metrics.refused.labels("busy").inc()
            raise ApiError(429, "busy", str(e), headers={"Retry-After": str(e.retry_after)}) from None
        self.metrics.active.set(self.slots.active)
        freed = [False]

        def free() -> None:
            if not freed[0]:
                freed[0] = True
                self.slots.free(taken)
                self.metrics.active.set(self.slots.active)

        return free

    async def run(self, job: Job, req: s.Request) -> list:
        """``job``'s results, within a slot and the request's timeout (504 beyond)."""
        free = self.take_slot()
        try:
            timeout = self.timeout_of(req)
            try:
                return await self.batcher.submit(job, timeout=timeout)
            except asyncio.TimeoutError:
                self.metrics.refused.labels("timeout").inc()
                raise ApiError(504, "timeout", f"no answer within {timeout:g} s") from None
        finally:
            free()

    def count_tokens(self, endpoint: str, n: int, seconds: float) -> None:
        self.metrics.tokens.labels(endpoint).inc(n)
        if seconds > 0:
            self.metrics.tokens_per_second.set(n / seconds)


def service(request: Request) -> Service:
    """The app's :class:`Service` (a FastAPI dependency)."""
    return request.app.state.service


Shared = Annotated[Service, Depends(service)]
