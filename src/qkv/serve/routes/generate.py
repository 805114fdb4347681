"""``POST /v1/generate``: a language model's continuation of a prompt, as ``qkv generate --prompt``
prints it; with ``"stream": true`` as Server-Sent Events, piece by piece as it is made."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from qkv.serve import jobs
from qkv.serve import schemas as s
from qkv.serve.batching import Job
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
    if req.stream:
        return stream_generation(svc, served, req, request, options)
    start = time.perf_counter()
    ((text, n),) = await svc.run(generation_job(served, req, prompt, options), req)
    svc.count_tokens("generate", n, time.perf_counter() - start)
    return s.GenerateResponse(model=served.name, text=text, tokens=n)


def generation_job(served: Served, req: s.GenerateRequest, prompt: list[int], options: dict) -> Job:
    """The job of a whole (not streamed) generation: one that may share a forward pass where it
    can (a prompt that is not blank and fits the window with its continuation; greedy, or
    sampling without a seed), else one decoded alone, as the stream would make it."""
    if req.constrained() or req.beam_size > 1:
        return searched_job(served, req, prompt, options)
    batchable = not options["sampling"] or req.seed is None
    if batchable and prompt and req.prompt.strip() and jobs.fits_without_sliding(served, prompt, req.max_new_tokens):
        return Job(
            partial(jobs.generate_batch, served, max_new_tokens=req.max_new_tokens, options=options),
            [req.prompt],
            key=("generate", served.name, req.max_new_tokens, *options.values()),
            cost=len(prompt),
        )

    def alone(prompts: list[str]) -> list[tuple[str, int]]:
        return [jobs.continue_alone(served, prompts[0], req.max_new_tokens, seed=req.seed, options=options)]

    return Job(alone, [req.prompt])


def searched_job(served: Served, req: s.GenerateRequest, prompt: list[int], options: dict) -> Job:
    """The job of a generation with constraints or a beam (``bundle.generations``, as ``qkv
    generate`` with them: the prompt cut to the window, never slid): batched with requests of the
    same settings, but a seeded one, whose draws are its own."""
    settings = {"beam_size": req.beam_size, **req.constraints()}
    run = partial(jobs.generate_batch, served, max_new_tokens=req.max_new_tokens, options=options, **settings)
    if options["sampling"] and req.seed is not None:
        return Job(partial(run, seed=req.seed), [req.prompt], cost=len(prompt))
    key = ("generate", served.name, req.max_new_tokens, *options.values(), *settings.values())
    return Job(run, [req.prompt], key=key, cost=len(prompt) * req.beam_size)


def event(name: str, data: dict) -> str:
    """One Server-Sent Event."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def stream_generation(svc: Service, served: Served, req: s.GenerateRequest, request: Request, options: dict):
    """The continuation as Server-Sent Events; each step runs on the model thread between
    batches; the slot is held until the stream ends, the client leaves or the timeout passes."""
    pieces, made = jobs.continuation_pieces(served, req.prompt, req.max_new_tokens, seed=req.seed, options=options)
    free = svc.take_slot()
    timeout = svc.timeout_of(req)
    loop = asyncio.get_running_loop()

    async def events():
        deadline = loop.time() + timeout
        start, text, ended = time.perf_counter(), [], False
        try:
            while not await request.is_disconnected():
                left = deadline - loop.time()
                try:
                    if left <= 0:
                        raise asyncio.TimeoutError
                    piece = await asyncio.wait_for(svc.batcher.call(next, pieces, None), left)
                except asyncio.TimeoutError:
                    ended = True
                    svc.metrics.refused.labels("timeout").inc()
                    yield event("error", error_body(504, "timeout", f"the stream took over {timeout:g} s"))
                    return
                if piece is None:
                    ended = True
                    svc.count_tokens("generate", made[0], time.perf_counter() - start)
                    yield event("done", {"text": "".join(text), "tokens": made[0]})
                    return
                text.append(piece)
                yield event("token", {"text": piece})
        finally:
            if not ended:  # the client left (seen here, or as a failed send that closed the stream)
                svc.metrics.refused.labels("disconnected").inc()
            svc.batcher.thread.submit(pieces.close)  # on the model thread, after any step in flight
            free()

    return FreeingStream(events(), free)


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
