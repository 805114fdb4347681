"""The FastAPI application: the routers of every family, over one service, behind the middleware.

What is here: :func:`create_app`, which takes the served models (``models.load_served``) and
the :class:`~qkv.serve.settings.Settings` (every limit) and returns the ASGI app:

    GET  /                 the page (static/index.html, app.js, style.css; no CDN, no build)
    GET  /health           {"status": "ok", ...}
    GET  /metrics          Prometheus text format (metrics.py)
    GET  /v1/models        the served models: kind, endpoints, window, layers, heads, labels (and
                           in OpenAI's shape, "data": id, object, created, owned_by)
    POST /v1/translate     encoder-decoder: beam search, n-best with scores, length penalty
    POST /v1/generate      decoder-only: greedy or sampling; Server-Sent Events with "stream": true
    POST /v1/chat          a dialogue in, the next turn out
    POST /v1/embed         encoder-only: sentence vectors
    POST /v1/classify      encoder-only with a classifier: a label per text
    POST /v1/chat/completions  decoder-only, OpenAI's API: messages through the chat template;
                           streamed as OpenAI's chunks (routes/openai.py)
    POST /v1/completions   decoder-only, OpenAI's API: a prompt's continuation
    POST /v1/attention     every attention map of one input (the explicit path), and the beam
                           search's trace when asked
    POST /v1/audio/transcriptions, /v1/audio/translations
                           OpenAI's: a speech model hears an uploaded file (multipart)
    POST /v1/audio/speech  OpenAI's: a TTS model or a Piper voice speaks a text (WAV, FLAC, PCM)
    POST /v1/audio/attention, /v1/audio/speech/attention, /v1/chat/attention
                           the page's views: a transcript segment's cross-attention over its
                           spectrogram, a text's speech with its attention, a chat answer
                           token's attention over the conversation (routes/views.py)
    WS   /v1/audio/stream  a speech model hears 16 kHz PCM as it is sent: partial and final
                           transcripts (routes/stream.py)
    GET  /docs             the OpenAPI page (FastAPI's; /openapi.json is the schema)

Each family's endpoints are one router of ``routes/``; what they share (the models, the limits,
the metrics, the slots, the batcher) is one :class:`~qkv.serve.service.Service`, in
``app.state.service``. Around them, the middleware (``middleware.py``): a request id and the
access log, CORS when origins are named, the API key and rate limit, the body limit.

Every error is JSON, ``{"error": {"code", "type", "message"}}`` (``errors.py``): no key or a
wrong one 401; a body too large 413 (an audio upload may be ``max_upload_bytes``); audio
that cannot be read 400; a bad field, a text too long, too many texts, too many new
tokens or too wide a beam 422; an unknown model 404; every slot taken, or over the rate limit,
429 with Retry-After; no answer within the timeout 504. A streamed generation that fails after
its first event ends with an ``error`` event instead. The OpenAI-compatible routes answer in
OpenAI's shape, with 400 where the others say 422 (``routes/openai.py``).

What is not here: the routes (``routes/``), the work (``jobs.py``, through ``qkv.bundle``),
batching (``batching.py``), the command (``qkv.cli.serve``), which binds the socket and runs
uvicorn.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from qkv.serve.access import Keys, RateLimiter
from qkv.serve.errors import add_handlers
from qkv.serve.middleware import BodyLimit, Gate, Observe
from qkv.serve.models import Served
from qkv.serve.routes import attention, audio, chat, classify, embed, generate, info, openai, stream, translate, views
from qkv.serve.service import Service
from qkv.serve.settings import Settings

SUMMARY = "The Transformer, whole: translate, generate, chat, embed, classify, and every attention map."


@asynccontextmanager
async def lifespan(app: FastAPI):
    """The batcher's loop (and the scheduler's, from its first request) runs while the app does;
    they stop after uvicorn has let every request in flight finish."""
    batcher = app.state.service.batcher
    batcher.start()
    try:
        yield
    finally:
        await app.state.service.scheduler.stop()
        await batcher.stop()


def create_app(models: dict[str, Served], settings: Settings | None = None) -> FastAPI:
    """The ASGI app serving ``models`` (by name) within ``settings``."""
    settings = settings or Settings()
    service = Service(models, settings)
    app = FastAPI(title="qkv", summary=SUMMARY, version="0.1.0", lifespan=lifespan)
    app.state.service = service
    for family in (info, translate, generate, chat, embed, classify, attention, openai, audio, views, stream):
        app.include_router(family.router)
    add_handlers(app)
    metrics = service.metrics
    # Each add_middleware wraps the ones before: the last added is the outermost.
    app.add_middleware(
        BodyLimit,
        limit=settings.max_body_bytes,
        metrics=metrics,
        uploads=(*audio.UPLOADS, *views.UPLOADS),
        upload_limit=settings.max_upload_bytes,
    )
    limiter = RateLimiter(settings.rate_limit) if settings.rate_limit > 0 else None
    app.add_middleware(Gate, keys=Keys(settings.api_keys), limiter=limiter, metrics=metrics)
    if settings.cors_origins:  # outside the gate: a browser's preflight carries no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
            expose_headers=["X-Request-ID", "Retry-After"],
        )
    app.add_middleware(Observe, metrics=metrics)
    return app
