"""OpenAI's API for a language model: ``POST /v1/chat/completions`` and ``POST /v1/completions``,
so that the ``openai`` client (and whatever speaks its API) works against ``qkv serve``
unchanged; ``GET /v1/models`` answers in OpenAI's shape too (``info.py``), and ``GET
/v1/models/{model}`` gives one model in it.

A chat's messages are read through the model's chat template (``completions.chat_ask``), a
completion's prompt as ``/v1/generate`` reads it. Requests share their forward passes by
continuous batching (``serve/continuous.py``, with ``/v1/generate``'s and ``/v1/chat``'s): one
that arrives while its model decodes joins the running batch at the next step and leaves it when
its answers end, streamed or whole, of any sampling options (a seeded one is decoded alone, so
that its seed reproduces it); ``n`` answers of one request are rows of one group. With
``"stream": true`` the answer comes as Server-Sent Events in OpenAI's chunk shape, ending with
``data: [DONE]``; its pieces joined are the whole answer's text.

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}`` (``code``: the
HTTP status, as in the rest of the API), and a request the server refuses for what it holds is
400 here (OpenAI's BadRequestError), where the rest of the API answers 422. A stream that fails
after its first chunk ends with a chunk holding the error, as OpenAI's does.

What is not here: the work (``completions.py``), waiting for the scheduler's answers (``answering.py``),
the request shapes (``openai_schemas.py``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from qkv.bundle import Sampling
from qkv.conversation import GenerationDefaults
from qkv.errors import UserError
from qkv.serve import completions as c
from qkv.serve import openai_schemas as o
from qkv.serve import schemas as s
from qkv.serve.answering import answered, batch_key, next_step
from qkv.serve.continuous import Step, Ticket
from qkv.serve.errors import ApiError, ErrorJSON, described, validation_detail, validation_message
from qkv.serve.models import Served
from qkv.serve.routes.generate import FreeingStream
from qkv.serve.routes.info import written
from qkv.serve.service import Service, Shared
from qkv.serve.validation import check_texts

COMPLETION_TOKENS = 16  # /v1/completions' default max_tokens, as OpenAI's


def openai_error(code: int, kind: str, message: str, param: str | None = None, headers=None) -> ErrorJSON:
    return ErrorJSON({"error": {"message": message, "type": kind, "param": param, "code": code}}, code, headers=headers)


class OpenAIRoute(APIRoute):
    """A route whose refusals are OpenAI's: a body that breaks the schema, or asks for more
    than the server allows, 400 naming the field; other codes (404, 429, 504) as they are."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def answer(request: Request):
            try:
                return await handler(request)
            except RequestValidationError as e:
                found = validation_detail(e.errors())
                param = ".".join(str(p) for p in found[0]["loc"]) if found and found[0]["loc"] else None
                return openai_error(400, "invalid_request_error", validation_message(e.errors()), param)
            except ApiError as e:
                return openai_error(400 if e.code == 422 else e.code, e.kind, e.message, headers=e.headers)
            except UserError as e:  # a template's refusal, a conversation that does not fit
                return openai_error(400, "invalid_request_error", str(e))

        return answer


router = APIRouter(tags=["openai"], route_class=OpenAIRoute)


@router.get("/v1/models/{model}", response_model=s.OpenAIModel, responses=o.ERRORS)
async def model_info(model: str, svc: Shared):
    """One served model in OpenAI's shape (the client's ``models.retrieve``); 404 for another name."""
    if model not in svc.models:
        raise ApiError(404, "unknown_model", f"no model named {described(model)}; GET /v1/models lists them")
    return s.OpenAIModel(id=model, created=written(svc.models[model]))


@router.post("/v1/chat/completions", response_model=o.ChatCompletion, responses=o.ERRORS)
async def chat_completions(req: o.ChatCompletionRequest, request: Request, svc: Shared):
    """The assistant's next message after ``messages``, in OpenAI's shape."""
    served = svc.pick(req.model, "chat/completions")
    messages = [m.as_dict() for m in req.messages]
    check_texts([m["content"] for m in messages], svc.settings, what="message")
    wanted = req.max_completion_tokens or req.max_tokens
    max_new = wanted or min(svc.settings.max_new_tokens, served.window // 2)
    picking, key = checked_options(req, served, svc, max_new)
    ask = c.chat_ask(served, messages, max_new_tokens=max_new, stops=req.stops())
    asks, made = [ask] * req.n, Made("chatcmpl", "chat.completion", served.name, chunk="chat.completion.chunk")
    if req.stream:
        return await streamed(svc, req, request, served, asks, made, chat_chunk, picking, key)
    answers = await answered(svc, req, served, asks, picking, key, endpoint="completions")
    choices = [
        o.ChatChoice(index=i, message=o.AssistantMessage(content=a.text), finish_reason=a.finish_reason)
        for i, a in enumerate(answers)
    ]
    return o.ChatCompletion(
        id=made.id, created=made.created, model=served.name, choices=choices, usage=usage(asks[:1], answers)
    )


@router.post("/v1/completions", response_model=o.Completion, responses=o.ERRORS)
async def text_completions(req: o.CompletionRequest, request: Request, svc: Shared):
    """The continuation of each ``prompt`` (``n`` each, in order), in OpenAI's shape."""
    served = svc.pick(req.model, "completions")
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    check_texts(prompts, svc.settings, what="prompt")
    picking, key = checked_options(req, served, svc, req.max_tokens or 1, inputs=len(prompts))
    default, stops = min(COMPLETION_TOKENS, svc.settings.max_new_tokens), req.stops()
    ones = [c.text_ask(served, p, max_new_tokens=req.max_tokens, default=default, stops=stops) for p in prompts]
    asks, made = [a for a in ones for _ in range(req.n)], Made("cmpl", "text_completion", served.name)
    if req.stream:
        return await streamed(svc, req, request, served, asks, made, text_chunk, picking, key)
    answers = await answered(svc, req, served, asks, picking, key, endpoint="completions")
    choices = [o.CompletionChoice(index=i, text=a.text, finish_reason=a.finish_reason) for i, a in enumerate(answers)]
    return o.Completion(
        id=made.id, created=made.created, model=served.name, choices=choices, usage=usage(ones, answers)
    )


def checked_options(req: o.Options, served: Served, svc: Service, max_new: int, *, inputs: int = 1):
    """The request's options within the server's limits and what qkv computes: what makes
    its token picker, and its batch key (None: decoded alone: a seeded draw, or batching off;
    each request picks its own tokens, so other options share a batch)."""
    if max_new > svc.settings.max_new_tokens:
        raise ApiError(
            422, "too_many", f"max_tokens {max_new} is over the server's limit of {svc.settings.max_new_tokens}"
        )
    if inputs * req.n > svc.settings.max_texts:
        raise ApiError(
            422, "too_many", f"{inputs * req.n} answers (n={req.n}) in one request; at most {svc.settings.max_texts}"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise ApiError(422, "invalid_request", f"{name} must be 0: qkv does not apply it")
    if req.logprobs:
        raise ApiError(422, "invalid_request", "logprobs must be false: qkv does not return them here")
    conversation = served.bundle.conversation
    defaults = conversation.defaults if conversation is not None else GenerationDefaults()
    penalty = first_of(req.repetition_penalty, defaults.repetition_penalty, 1.0)
    picking = c.Picking(sampling_of(req, defaults), penalty)
    return picking, batch_key(served, picking, batching=svc.settings.batching)


def sampling_of(req: o.Options, defaults: GenerationDefaults) -> Sampling | None:
    """The draws a request asks for, as ``qkv chat`` picks them: none at temperature 0; else
    each option as given, or as the checkpoint's generation_config.json says (``defaults``);
    none where neither asks to sample."""
    given = (req.temperature, req.top_p, req.top_k, req.min_p)
    if req.temperature == 0 or not (any(v is not None for v in given) or defaults.do_sample):
        return None
    return Sampling(
        temperature=first_of(req.temperature, defaults.temperature, 1.0),
        top_k=first_of(req.top_k, defaults.top_k, None) or None,
        top_p=first_of(req.top_p, defaults.top_p, None),
        seed=req.seed,
        min_p=first_of(req.min_p, defaults.min_p, None) or None,
    )


def first_of(*values):
    """The first value that is not None."""
    return next((v for v in values if v is not None), None)


def usage(asks: list[c.Ask], answers: list[c.Answer]) -> o.Usage:
    """Tokens read (each prompt once, however many answers it has) and written."""
    read, written = sum(len(a.prompt) for a in asks), sum(a.tokens for a in answers)
    return o.Usage(prompt_tokens=read, completion_tokens=written, total_tokens=read + written)


class Made:
    """What every chunk of one answer carries: its id, kind and time."""

    def __init__(self, prefix: str, kind: str, model: str, *, chunk: str | None = None) -> None:
        self.id, self.object, self.model = f"{prefix}-{uuid.uuid4().hex}", kind, model
        self.chunk_object = chunk or kind  # a chat's chunks are "chat.completion.chunk"
        self.created = int(time.time())

    def chunk(self, choices: list[dict], usage: o.Usage | None = None) -> str:
        """One Server-Sent Event of the stream (the last, with ``usage``, has no choices)."""
        body = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model}
        body["choices"] = choices
        if usage is not None:
            body["usage"] = usage.model_dump()
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def chat_chunk(index: int, text: str | None, finish: str | None) -> dict:
    """A chat chunk's choice: the role first (``text`` None, no finish), then pieces, then the end."""
    delta = {"role": "assistant", "content": ""} if text is None and finish is None else {}
    if text:
        delta["content"] = text
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}


def text_chunk(index: int, text: str | None, finish: str | None) -> dict:
    return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}


async def streamed(
    svc: Service, req: o.Options, request: Request, served: Served, asks, made: Made, shape, picking, key
):
    """The answers as Server-Sent Events in OpenAI's chunk shape (``shape`` makes a choice;
    ``picking`` how tokens are picked), decoded in the scheduler's running batch: the stream
    joins it at its next step and leaves when its answers end; the slot is held until the
    stream ends, the client leaves or the timeout passes."""
    free, timeout = svc.take_slot(), svc.timeout_of(req)
    deadline = asyncio.get_running_loop().time() + timeout
    ticket = Ticket(served, asks, picking, key)
    svc.scheduler.submit(ticket)

    def release() -> None:
        ticket.gone = True  # its rows leave the batch at the next step
        free()

    async def events():
        start, told = time.perf_counter(), [False] * len(asks)
        try:
            if shape is chat_chunk:
                yield made.chunk([shape(i, None, None) for i in range(len(asks))])
            while not await request.is_disconnected():
                try:
                    step = await next_step(svc, ticket, deadline, timeout)
                except ApiError as e:
                    yield stream_error(e.code, e.kind, f"the stream took over {timeout:g} s")
                    return
                if step is None:
                    break
                for chunk in step_chunks(step, told, made, shape):
                    yield chunk
            else:
                svc.metrics.refused.labels("disconnected").inc()
                return
            readers = ticket.readers
            svc.count_tokens("completions", sum(r.tokens for r in readers), time.perf_counter() - start)
            if req.stream_options is not None and req.stream_options.include_usage:
                answers = [c.Answer(r.text, r.tokens, r.finish_reason or "length") for r in readers]
                yield made.chunk([], usage(asks[:: req.n], answers))
            yield "data: [DONE]\n\n"
        finally:
            release()

    return FreeingStream(events(), release)  # a stream never started leaves as well


def step_chunks(step: Step, told: list[bool], made: Made, shape):
    """The chunks of one decoding step: each answer's new piece, and its end once it has ended."""
    for i, (piece, finish) in enumerate(step):
        if piece:
            yield made.chunk([shape(i, piece, None)])
        if finish is not None and not told[i]:
            told[i] = True
            yield made.chunk([shape(i, None, finish)])


def stream_error(code: int, kind: str, message: str) -> str:
    """A chunk holding an error: the openai client raises it."""
    return f"data: {json.dumps({'error': {'message': message, 'type': kind, 'param': None, 'code': code}})}\n\n"
