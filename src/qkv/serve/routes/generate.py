"""``POST /v1/generate``: a language model's continuation of a prompt, as ``qkv generate --prompt``
prints it; with ``"stream": true`` as Server-Sent Events, piece by piece as it is made.

Where it is decoded: a prompt that fits the window with its continuation is decoded by continuous
batching (``serve/continuous.py``, the decoding the OpenAI routes share): greedy or drawn, streamed
or whole, it joins its model's running batch at the next step and leaves it when it ends (a seeded
one has a decoding of its own, so that its seed reproduces it). The rest are decoded directly,
each request alone on the model thread through the library's job function, because a running
batch of single rows cannot hold them: a beam or constraints (``beam_size`` > 1, ``prefix``,
``ban``, ``require``: ``bundle.generations``, a search over hypotheses with its scorers), and a
continuation that slides past the window (``bundle.continued``: a slide reads the window again
from position 0, which a shared KV cache cannot). Either way the answer is what ``qkv generate``
gives for the same request.

What is not here: the scheduling (``continuous.py``), the work (``jobs.py``, ``completions.py``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from qkv.serve import jobs
from qkv.serve import schemas as s
from qkv.serve.answering import answered, batch_key
from qkv.serve.batching import Job
from qkv.serve.completions import Ask, Picking
from qkv.serve.continuous import Ticket
from qkv.serve.errors import error_body
from qkv.serve.models import Served
from qkv.serve.service import Service, Shared
from qkv.serve.validation import validate_generate

router = APIRouter(tags=["generate"])


@router.post("/v1/generate", response_model=s.GenerateResponse, responses=s.ERRORS)
async def generate(req: s.GenerateRequest, request: Request, svc: Shared):
    """Continue a prompt with a decoder-only model; with ``"stream": true`` as Server-Sent
    Events: ``token`` events ({"text"}) as the text grows, then ``done`` ({"text", "tokens"}).
    Constraints (not streamed): ``prefix`` (the continuation starts with it), ``ban`` (words
    never written), ``require`` (words it contains; ``beam_size`` 2 or more)."""
    served = svc.pick(req.model, "generate")
    prompt = validate_generate(req, served, svc.settings)
    options = {"temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "sampling": req.sampling()}
    searched = req.constrained() or req.beam_size > 1
    if searched or not jobs.fits_without_sliding(served, prompt, req.max_new_tokens):
        return await decoded_alone(svc, served, req, request, options)  # the direct path (see the module)
    ask = Ask(tuple(prompt or [served.vocab.source.bos_id]), req.max_new_tokens)  # an empty prompt: BEGIN
    picking = Picking(jobs.sampling_of(options, seed=req.seed))
    key = batch_key(served, picking, batching=svc.settings.batching)
    if req.stream:
        return continuous_stream(svc, req, request, Ticket(served, [ask], picking, key))
    (answer,) = await answered(svc, req, served, [ask], picking, key, endpoint="generate")
    return s.GenerateResponse(model=served.name, text=answer.text, tokens=answer.tokens)


async def decoded_alone(svc: Service, served: Served, req: s.GenerateRequest, request: Request, options: dict):
    """A request that continuous batching cannot decode (see the module), decoded alone on the
    model thread: with a beam or constraints by ``bundle.generations`` (the prompt cut to the
    window, never slid; never streamed: ``validate_generate``), else by ``bundle.continued``."""
    if req.stream:
        return sliding_stream(svc, served, req, request, options)
    if req.constrained() or req.beam_size > 1:
        settings = {"beam_size": req.beam_size, **req.constraints()}
        run = partial(jobs.generate_batch, served, max_new_tokens=req.max_new_tokens, options=options, seed=req.seed)
        job = Job(partial(run, **settings), [req.prompt])
    else:

        def slid(prompts: list[str]) -> list[tuple[str, int]]:
            return [jobs.continue_alone(served, prompts[0], req.max_new_tokens, seed=req.seed, options=options)]

        job = Job(slid, [req.prompt])
    start = time.perf_counter()
    ((text, n),) = await svc.run(job, req)
    svc.count_tokens("generate", n, time.perf_counter() - start)
    return s.GenerateResponse(model=served.name, text=text, tokens=n)


def event(name: str, data: dict) -> str:
    """One Server-Sent Event."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def continuous_stream(svc: Service, req: s.GenerateRequest, request: Request, ticket: Ticket):
    """The continuation as Server-Sent Events, decoded in its model's running batch: the
    ticket joins it at the next step and leaves when the client does."""
    free = svc.take_slot()
    svc.scheduler.submit(ticket)
    (reader,) = ticket.readers

    async def pull() -> str | None:
        item = await ticket.pieces.get()
        if isinstance(item, BaseException):
            raise item
        return None if item is None else item[0][0]

    def close() -> None:
        ticket.gone = True  # its row leaves the batch at the next step

    return sse(svc, req, request, pull, lambda: reader.tokens, close, free)


def sliding_stream(svc: Service, served: Served, req: s.GenerateRequest, request: Request, options: dict):
    """The continuation of a prompt that slides past the window, as Server-Sent Events: each
    step runs alone on the model thread, between other jobs (``bundle.continued``)."""
    pieces, made = jobs.continuation_pieces(served, req.prompt, req.max_new_tokens, seed=req.seed, options=options)
    free = svc.take_slot()

    def close() -> None:
        svc.batcher.thread.submit(pieces.close)  # on the model thread, after any step in flight

    return sse(svc, req, request, partial(svc.batcher.call, next, pieces, None), lambda: made[0], close, free)


def sse(
    svc: Service,
    req: s.GenerateRequest,
    request: Request,
    pull: Callable[[], Awaitable[str | None]],
    tokens: Callable[[], int],
    close: Callable[[], None],
    free: Callable[[], None],
):
    """Server-Sent Events of the pieces ``pull`` gives (None: the end; '' none yet), then
    ``done`` with their text and ``tokens()``; an ``error`` event past the request's timeout.
    The slot (``free``) is held until the stream ends, the client leaves or the timeout passes;
    ``close`` stops the decoding, once."""
    timeout = svc.timeout_of(req)
    loop = asyncio.get_running_loop()
    closed = [False]

    def release() -> None:
        if not closed[0]:
            closed[0] = True
            close()
        free()

    async def events():
        deadline = loop.time() + timeout
        start, text, ended = time.perf_counter(), [], False
        try:
            while not await request.is_disconnected():
                left = deadline - loop.time()
                try:
                    if left <= 0:
                        raise asyncio.TimeoutError
                    piece = await asyncio.wait_for(pull(), left)
                except asyncio.TimeoutError:
                    ended = True
                    svc.metrics.refused.labels("timeout").inc()
                    yield event("error", error_body(504, "timeout", f"the stream took over {timeout:g} s"))
                    return
                if piece is None:
                    ended = True
                    svc.count_tokens("generate", tokens(), time.perf_counter() - start)
                    yield event("done", {"text": "".join(text), "tokens": tokens()})
                    return
                if piece:
                    text.append(piece)
                    yield event("token", {"text": piece})
        finally:
            if not ended:  # the client left (seen here, or as a failed send that closed the stream)
                svc.metrics.refused.labels("disconnected").inc()
            release()

    return FreeingStream(events(), release)  # a stream never started stops its decoding as well


class FreeingStream(StreamingResponse):
    """Server-Sent Events that free their request's slot when they end, however they end (the
    stream's own end, an error, a client gone before the first byte)."""

    def __init__(self, content, free: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.free = free

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.free()
