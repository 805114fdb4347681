"""Requests answered by continuous batching (``continuous.Scheduler``), as every route that
generates text with a language model waits for them: ``/v1/generate``, ``/v1/chat``,
``/v1/chat/completions`` and ``/v1/completions``.

What is here: :func:`batch_key` (the decoding a request joins: one per model; a seeded request,
or any with batching off, has one of its own), :func:`answered` (a request's whole answers, a slot
held meanwhile) and :func:`next_step` (its next step's pieces, within its deadline: what a
stream waits on).

What is not here: the scheduling and the step loop (``continuous.py``, ``qkv.decoding.continuous``),
the prompts and how tokens become text (``completions.py``), the HTTP shapes (``routes/``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable

from qkv.serve import schemas as s
from qkv.serve.completions import Answer, Ask, Picking
from qkv.serve.continuous import Step, Ticket
from qkv.serve.errors import ApiError
from qkv.serve.models import Served
from qkv.serve.service import Service


def batch_key(served: Served, picking: Picking, *, batching: bool) -> Hashable | None:
    """The decoding a request joins: its model's, shared by every route and every sampling
    option (each request picks its own tokens); None (a decoding of its own) for a seeded draw,
    so that its seed reproduces it to the last bit, or with batching off."""
    seeded = picking.sampling is not None and picking.sampling.seed is not None
    return None if seeded or not batching else ("continuous", served.name)


async def answered(
    svc: Service, req: s.Request, served: Served, asks: list[Ask], picking: Picking, key, *, endpoint: str
) -> list[Answer]:
    """The asks' whole answers, decoded in the scheduler's running batch (a slot held
    meanwhile; 504 past the request's timeout); their tokens counted for ``endpoint``."""
    free, timeout = svc.take_slot(), svc.timeout_of(req)
    start, deadline = time.perf_counter(), asyncio.get_running_loop().time() + timeout
    ticket = Ticket(served, asks, picking, key)
    try:
        svc.scheduler.submit(ticket)
        while await next_step(svc, ticket, deadline, timeout) is not None:
            pass
    finally:
        ticket.gone = True  # a request that timed out leaves its batch at the next step
        free()
    svc.count_tokens(endpoint, sum(r.tokens for r in ticket.readers), time.perf_counter() - start)
    return [Answer(r.text, r.tokens, r.finish_reason or "length") for r in ticket.readers]


async def next_step(svc: Service, ticket: Ticket, deadline: float, timeout: float) -> Step | None:
    """The ticket's next step (None once its answers have ended); 504 past the deadline."""
    try:
        item = await asyncio.wait_for(ticket.pieces.get(), max(0.0, deadline - asyncio.get_running_loop().time()))
    except asyncio.TimeoutError:
        svc.metrics.refused.labels("timeout").inc()
        raise ApiError(504, "timeout", f"no answer within {timeout:g} s") from None
    if isinstance(item, BaseException):
        raise item
    return item
