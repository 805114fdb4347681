"""The FastAPI application: endpoints, limits, errors, metrics and the page.

What is here: :func:`create_app`, which takes the served models (``models.load_served``) and
the :class:`~qkv.serve.settings.Settings` (every limit) and returns the ASGI app:

    GET  /                 the page (static/index.html, app.js, style.css; no CDN, no build)
    GET  /health           {"status": "ok", ...}
    GET  /metrics          Prometheus text format (metrics.py)
    GET  /v1/models        the served models: kind, endpoints, window, layers, heads, labels
    POST /v1/translate     encoder-decoder: beam search, n-best with scores, length penalty
    POST /v1/generate      decoder-only: greedy or sampling; Server-Sent Events with "stream": true
    POST /v1/chat          a dialogue in, the next turn out
    POST /v1/embed         encoder-only: sentence vectors
    POST /v1/classify      encoder-only with a classifier: a label per text
    POST /v1/attention     every attention map of one input (the explicit path), and the beam
                           search's trace when asked
    GET  /docs             the OpenAPI page (FastAPI's; /openapi.json is the schema)

Every error is JSON, ``{"error": {"code", "type", "message"}}``: a body too large 413; a bad
field, a text too long, too many texts, too many new tokens or too wide a beam 422; an unknown
model 404; every slot taken 429 with Retry-After; no answer within the timeout 504. A
streamed generation that fails after its first event ends with an ``error`` event instead.

What is not here: the work itself (``models.py``), batching (``batching.py``), the command
(``qkv.cli.serve``), which binds the socket and runs uvicorn.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from functools import partial
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from qkv.serve import models as work
from qkv.serve import schemas as s
from qkv.serve.batching import Batcher, BatchStats, Busy, Job, Slots
from qkv.serve.errors import ApiError, add_handlers, described, error_body
from qkv.serve.metrics import Metrics
from qkv.serve.settings import Settings

ERRORS = {code: {"model": s.ErrorResponse} for code in (404, 413, 422, 429, 504)}
ENDPOINT_PATHS = (
    "/v1/translate",
    "/v1/generate",
    "/v1/chat",
    "/v1/embed",
    "/v1/classify",
    "/v1/attention",
    "/v1/models",
    "/health",
    "/metrics",
    "/",
)
STATIC = {
    "/": ("index.html", "text/html"),
    "/app.js": ("app.js", "text/javascript"),
    "/style.css": ("style.css", "text/css"),
}


class Guard:
    """ASGI middleware around the app: refuses a body over ``max_body_bytes`` (413, read no
    further), and counts every answer (status, latency to its last byte) in the metrics."""

    def __init__(self, app, *, settings: Settings, metrics: Metrics) -> None:
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINT_PATHS else "other"
        start = time.perf_counter()
        status = [500]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            body = await self._body(scope, receive)
            if body is None:
                self.metrics.refused.labels("too_large").inc()
                limit = self.settings.max_body_bytes
                answer = JSONResponse(error_body(413, "too_large", f"the request body is over {limit} bytes"), 413)
                return await answer(scope, receive, sending)
            given = [False]

            async def replay():
                if not given[0]:
                    given[0] = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()  # after the body: http.disconnect when the client leaves

            await self.app(scope, replay, sending)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

    async def _body(self, scope, receive) -> bytes | None:
        """The whole request body, or None when it is over the limit (stated or sent)."""
        limit = self.settings.max_body_bytes
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left: the app sees an empty body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return None
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def create_app(models: dict[str, work.Served], settings: Settings | None = None) -> FastAPI:
    """The ASGI app serving ``models`` (by name) within ``settings``."""
    settings = settings or Settings()
    metrics = Metrics()
    slots = Slots(settings.max_active)

    def counted(stats: BatchStats, jobs: list[Job]) -> None:
        metrics.batch_requests.observe(stats.jobs)
        metrics.batch_inputs.observe(stats.inputs)

    batcher = Batcher(
        enabled=settings.batching,
        wait_s=settings.batch_wait_ms / 1000,
        max_cost=settings.max_batch_tokens,
        on_batch=counted,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        try:
            yield
        finally:
            await batcher.stop()  # after uvicorn has let every request in flight finish

    app = FastAPI(
        title="qkv",
        summary="The Transformer, whole: translate, generate, chat, embed, classify, and every attention map.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings, app.state.metrics, app.state.slots, app.state.batcher = settings, metrics, slots, batcher
    pages = {
        path: (resources.files("qkv.serve").joinpath("static", name).read_bytes(), media)
        for path, (name, media) in STATIC.items()
    }

    add_handlers(app)

    # ------------------------------------------------------------------ shared checks

    def pick(name: str | None, endpoint: str) -> work.Served:
        """The model a request names, or the one model that answers ``endpoint``."""
        if name is not None:
            if name not in models:
                raise ApiError(404, "unknown_model", f"no model named {described(name)}; GET /v1/models lists them")
            served = models[name]
            if endpoint not in served.endpoints:
                answers = ", ".join(f"/v1/{e}" for e in served.endpoints)
                raise ApiError(
                    422,
                    "wrong_model",
                    f"model {name!r} ({served.kind}) does not answer /v1/{endpoint}; it answers {answers}",
                )
            return served
        able = [m for m in models.values() if endpoint in m.endpoints]
        if len(able) == 1:
            return able[0]
        if not able:
            raise ApiError(422, "wrong_model", f"no model served here answers /v1/{endpoint}")
        names = ", ".join(m.name for m in able)
        raise ApiError(422, "model_required", f"several models answer /v1/{endpoint} ({names}); name one in 'model'")

    def check_texts(texts: list[str], *, what: str = "text") -> None:
        if not texts:
            raise ApiError(422, "invalid_request", f"no {what} given")
        if len(texts) > settings.max_texts:
            raise ApiError(422, "too_many", f"{len(texts)} {what}s in one request; at most {settings.max_texts}")
        for i, text in enumerate(texts):
            if len(text) > settings.max_chars:
                where = f"{what} {i}" if len(texts) > 1 else what
                raise ApiError(422, "too_long", f"{where} has {len(text)} characters; at most {settings.max_chars}")

    def check_window(served: work.Served, ids: list[list[int]], *, what: str = "text", room: int = 0) -> None:
        window = served.window - room
        for i, row in enumerate(ids):
            if len(row) > window:
                where = f"{what} {i}" if len(ids) > 1 else what
                raise ApiError(
                    422, "too_long", f"{where} has {len(row)} tokens; model {served.name} reads at most {window}"
                )

    def check_new_tokens(n: int) -> None:
        if n > settings.max_new_tokens:
            raise ApiError(
                422, "too_many", f"max_new_tokens {n} is over the server's limit of {settings.max_new_tokens}"
            )

    def check_beam(beam: int, nbest: int = 1) -> None:
        if beam > settings.max_beam:
            raise ApiError(422, "too_many", f"beam_size {beam} is over the server's limit of {settings.max_beam}")
        if nbest > beam:
            raise ApiError(422, "invalid_request", f"nbest {nbest} needs a beam_size of at least {nbest}")

    def timeout_of(req: s.Request) -> float:
        return min(req.timeout or settings.timeout_s, settings.timeout_s)

    def take_slot():
        """A slot for one request, or 429; returns what frees it (once, however often called)."""
        try:
            taken = slots.take()
        except Busy as e:
            metrics.refused.labels("busy").inc()
            raise ApiError(429, "busy", str(e), headers={"Retry-After": str(e.retry_after)}) from None
        metrics.active.set(slots.active)
        freed = [False]

        def free() -> None:
            if not freed[0]:
                freed[0] = True
                slots.free(taken)
                metrics.active.set(slots.active)

        return free

    async def run(job: Job, req: s.Request, endpoint: str) -> list:
        """``job``'s results, within a slot and the request's timeout."""
        free = take_slot()
        try:
            timeout = timeout_of(req)
            try:
                return await batcher.submit(job, timeout=timeout)
            except asyncio.TimeoutError:
                metrics.refused.labels("timeout").inc()
                raise ApiError(504, "timeout", f"no answer within {timeout:g} s") from None
        finally:
            free()

    def count_tokens(endpoint: str, n: int, seconds: float) -> None:
        metrics.tokens.labels(endpoint).inc(n)
        if seconds > 0:
            metrics.tokens_per_second.set(n / seconds)

    # ------------------------------------------------------------------ the page and the service

    def page(path: str):
        content, media = pages[path]
        return Response(content, media_type=f"{media}; charset=utf-8", headers={"Cache-Control": "no-cache"})

    for path in STATIC:
        app.add_api_route(path, partial(page, path), methods=["GET"], include_in_schema=False)

    @app.get("/health", response_model=s.Health)
    async def health():
        return s.Health(status="ok", models=len(models), active=slots.active, waiting=len(batcher.waiting))

    @app.get("/metrics", include_in_schema=False)
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models", response_model=s.ModelsResponse)
    async def list_models():
        return s.ModelsResponse(
            models=[
                s.ModelInfo(
                    name=m.name,
                    kind=m.kind,
                    endpoints=[f"/v1/{e}" for e in m.endpoints],
                    window=m.window,
                    layers=m.layers(),
                    heads=m.model.config.n_heads,
                    labels=m.labels,
                )
                for m in models.values()
            ]
        )

    # ------------------------------------------------------------------ the model endpoints

    @app.post("/v1/translate", response_model=s.TranslateResponse, responses=ERRORS)
    async def translate(req: s.TranslateRequest):
        """Translate one sentence or several with an encoder-decoder (as ``qkv translate``)."""
        served = pick(req.model, "translate")
        texts = [req.text] if isinstance(req.text, str) else req.text
        check_texts(texts)
        check_beam(req.beam_size, req.nbest)
        ids = served.vocab.source.encode_batch(texts)
        check_window(served, ids)
        options = {
            "beam_size": req.beam_size,
            "nbest": req.nbest,
            "length_penalty": req.length_penalty,
            "max_len_a": req.max_len_a,
            "max_len_b": req.max_len_b,
        }
        job = Job(
            partial(work.translate, served, **options),
            texts,
            key=("translate", served.name, *options.values()),
            cost=sum(max(1, len(row)) for row in ids) * req.beam_size,
        )
        start = time.perf_counter()
        found = await run(job, req, "translate")
        count_tokens("translate", sum(hyps[0][2] for hyps in found if hyps), time.perf_counter() - start)
        return s.TranslateResponse(
            model=served.name,
            translations=[
                [s.Scored(text=t, score=score) for t, score, _ in hyps if score != float("-inf")] for hyps in found
            ],
        )

    @app.post("/v1/generate", response_model=s.GenerateResponse, responses=ERRORS)
    async def generate(req: s.GenerateRequest, request: Request):
        """Continue a prompt with a decoder-only model; with ``"stream": true`` as Server-Sent
        Events: ``token`` events ({"text"}) as the text grows, then ``done`` ({"text", "tokens"})."""
        served = pick(req.model, "generate")
        check_texts([req.prompt], what="prompt")
        check_new_tokens(req.max_new_tokens)
        prompt = served.vocab.source.encode(req.prompt)
        sampling = req.sampling()
        options = {"temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "sampling": sampling}
        if req.stream:
            return stream_generation(served, req, request, prompt, options)
        start = time.perf_counter()
        if work.fits_without_sliding(served, prompt, req.max_new_tokens) and (not sampling or req.seed is None):
            job = Job(
                partial(work.generate_batch, served, max_new_tokens=req.max_new_tokens, options=options),
                [prompt],
                key=("generate", served.name, req.max_new_tokens, *options.values()),
                cost=max(1, len(prompt)),
            )
        else:  # seeded, or sliding past the window: alone, as the stream would make it

            def alone(prompts: list[list[int]]) -> list[tuple[str, int]]:
                return [work.continue_alone(served, prompts[0], req.max_new_tokens, seed=req.seed, options=options)]

            job = Job(alone, [prompt])
        ((text, n),) = await run(job, req, "generate")
        count_tokens("generate", n, time.perf_counter() - start)
        return s.GenerateResponse(model=served.name, text=text, tokens=n)

    def stream_generation(served, req: s.GenerateRequest, request: Request, prompt: list[int], options: dict):
        free = take_slot()
        pieces, made = work.continuation_pieces(served, prompt, req.max_new_tokens, seed=req.seed, options=options)
        timeout = timeout_of(req)
        loop = asyncio.get_running_loop()

        def event(name: str, data: dict) -> str:
            return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        async def events():
            deadline = loop.time() + timeout
            start, text, ended = time.perf_counter(), [], False
            try:
                while not await request.is_disconnected():
                    left = deadline - loop.time()
                    try:
                        if left <= 0:
                            raise asyncio.TimeoutError
                        piece = await asyncio.wait_for(batcher.call(next, pieces, None), left)
                    except asyncio.TimeoutError:
                        ended = True
                        metrics.refused.labels("timeout").inc()
                        yield event("error", error_body(504, "timeout", f"the stream took over {timeout:g} s"))
                        return
                    if piece is None:
                        ended = True
                        count_tokens("generate", made[0], time.perf_counter() - start)
                        yield event("done", {"text": "".join(text), "tokens": made[0]})
                        return
                    text.append(piece)
                    yield event("token", {"text": piece})
            finally:
                if not ended:  # the client left (seen here, or as a failed send that closed the stream)
                    metrics.refused.labels("disconnected").inc()
                batcher.thread.submit(pieces.close)  # on the model thread, after any step in flight
                free()

        return FreeingStream(events(), free, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat", response_model=s.ChatResponse, responses=ERRORS)
    async def chat(req: s.ChatRequest):
        """The next turn of a dialogue (``qkv chat``'s reply: the newest turns that fit the window)."""
        served = pick(req.model, "chat")
        check_texts(req.messages, what="message")
        check_new_tokens(req.max_new_tokens)
        check_beam(req.beam_size)
        options = {"temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "sampling": req.sampling()}
        reply = partial(
            work.chat,
            served,
            separator=req.separator,
            max_new_tokens=req.max_new_tokens,
            beam_size=req.beam_size,
            seed=req.seed,
            options=options,
        )
        (answer,) = await run(Job(reply, [req.messages]), req, "chat")
        return s.ChatResponse(model=served.name, reply=answer)

    @app.post("/v1/embed", response_model=s.EmbedResponse, responses=ERRORS)
    async def embed(req: s.EmbedRequest):
        """Sentence vectors from an encoder-only model (as ``qkv embed``)."""
        served = pick(req.model, "embed")
        texts = [req.text] if isinstance(req.text, str) else req.text
        check_texts(texts)
        ids = served.vocab.source.encode_batch(texts)
        check_window(served, ids, room=2)  # BEGIN and END
        job = Job(
            partial(work.embed, served, pooling=req.pooling, normalize=req.normalize),
            texts,
            key=("embed", served.name, req.pooling, req.normalize),
            cost=sum(len(row) + 2 for row in ids),
        )
        found = await run(job, req, "embed")
        return s.EmbedResponse(model=served.name, embeddings=[v for v, _ in found], settings=found[0][1])

    @app.post("/v1/classify", response_model=s.ClassifyResponse, responses=ERRORS)
    async def classify(req: s.ClassifyRequest):
        """A label per text from an encoder-only classifier (its config.json's label names)."""
        served = pick(req.model, "classify")
        texts = [req.text] if isinstance(req.text, str) else req.text
        check_texts(texts)
        ids = served.vocab.source.encode_batch(texts)
        check_window(served, ids, room=2)
        job = Job(
            partial(work.classify, served), texts, key=("classify", served.name), cost=sum(len(r) + 2 for r in ids)
        )
        return s.ClassifyResponse(model=served.name, labels=await run(job, req, "classify"))

    @app.post("/v1/attention", response_model=s.AttentionResponse, responses=ERRORS)
    async def attention(req: s.AttentionRequest):
        """Every attention map of one input, through the explicit path: an encoder-decoder's
        encoder self-attention, decoder masked self-attention and cross-attention (rows: the
        tokens the decoder writes; columns: what it reads), a decoder-only model's masked
        self-attention, an encoder-only model's self-attention; every layer and head. Without
        ``output`` the model's own output is decoded first (beam search of ``beam_size``, its
        trace with ``"trace": true``)."""
        served = pick(req.model, "attention")
        check_texts([req.text])
        if req.output is not None:
            check_texts([req.output], what="output")
        check_beam(req.beam_size)
        if req.max_new_tokens is not None:
            check_new_tokens(req.max_new_tokens)
        if req.trace and served.kind != "encoder_decoder":
            raise ApiError(
                422, "invalid_request", f"a beam trace needs an encoder-decoder; {served.name} is {served.kind}"
            )
        view = partial(
            work.attention_view,
            served,
            output=req.output,
            beam_size=req.beam_size,
            length_penalty=req.length_penalty,
            max_new_tokens=req.max_new_tokens,
            trace=req.trace,
        )
        try:
            (found,) = await run(Job(view, [req.text]), req, "attention")
        except work.TooLong as e:
            raise ApiError(422, "too_long", str(e)) from None
        return s.AttentionResponse(model=served.name, kind=served.kind, **found)

    app.add_middleware(Guard, settings=settings, metrics=metrics)
    return app


class FreeingStream(StreamingResponse):
    """A streamed response that frees its request's slot when it ends, however it ends (the
    stream's own end, an error, a client gone before the first byte)."""

    def __init__(self, content, free, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.free = free

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.free()
