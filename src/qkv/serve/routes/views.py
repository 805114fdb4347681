"""The page's views of speech and chat: ``POST /v1/audio/attention`` (a transcript segment's
cross-attention over its spectrogram), ``POST /v1/audio/speech/attention`` (a text's speech:
its spectrogram and attention) and ``POST /v1/chat/attention`` (a chat answer token's attention
over the conversation), and their scripts, ``GET /views.js`` and ``GET /microphone.js`` (the
speech view's AudioWorklet). Each answers for a model that
answers the route it looks into (``audio/transcriptions``, ``audio/speech``,
``chat/completions``); what cannot be drawn is a 422.

What is not here: the work (``views.py``), the bodies (``view_schemas.py``).
"""

from __future__ import annotations

from functools import partial
from typing import Annotated

from fastapi import APIRouter, Form
from fastapi.responses import Response

from qkv.serve import schemas as s
from qkv.serve import view_schemas as v
from qkv.serve.batching import Job
from qkv.serve.errors import ApiError
from qkv.serve.routes.audio import uploaded
from qkv.serve.routes.info import page
from qkv.serve.service import Shared
from qkv.serve.validation import check_texts, checked_language, validate_speech
from qkv.serve.views import Unfit, chat_view, heard_view, spoken_view

router = APIRouter(tags=["views"])
ViewForm = Annotated[v.HeardViewForm, Form(media_type="multipart/form-data")]
UPLOADS = ("/v1/audio/attention",)  # takes an upload as large as the transcription routes'


@router.get("/views.js", include_in_schema=False)
async def script() -> Response:
    """The page's script of these views (``static/views.js``)."""
    return page("views.js", "text/javascript")


@router.get("/microphone.js", include_in_schema=False)
async def microphone() -> Response:
    """The speech view's AudioWorklet: the microphone as 16 kHz s16le (``static/microphone.js``)."""
    return page("microphone.js", "text/javascript")


async def answered(svc, job: Job, req: s.Request) -> dict:
    """``job``'s one result; what the model cannot draw a 422."""
    try:
        (found,) = await svc.run(job, req)
    except Unfit as e:
        raise ApiError(422, "invalid_request", str(e)) from None
    return found


@router.post("/v1/audio/attention", response_model=v.HeardView, responses=s.ERRORS)
async def heard_attention(form: ViewForm, svc: Shared):
    """A transcript segment (its ``tokens`` from ``verbose_json``) over its stretch of the
    upload, ``start`` to ``end`` seconds: the log-mel the model reads there and every decoder
    layer's cross-attention from the steps that wrote the tokens to the encoder positions."""
    served = svc.pick(form.model, "audio/transcriptions")
    language = checked_language(form.language, served, "transcribe")
    if form.end <= form.start:
        raise ApiError(422, "invalid_request", f"end {form.end:g} s is not after start {form.start:g} s")
    wave = await uploaded(form.file, served, svc)
    view = partial(heard_view, served, start=form.start, end=form.end, tokens=form.ids(), language=language)
    found = await answered(svc, Job(view, [wave]), s.Request())
    return v.HeardView(model=served.name, **found)


@router.post("/v1/audio/speech/attention", response_model=v.SpokenView, responses=s.ERRORS)
async def spoken_attention(req: s.SpeechRequest, svc: Shared):
    """``input`` spoken as ``/v1/audio/speech`` speaks it: the speech's log-mel and, for qkv's
    own TTS, every decoder layer's cross-attention (steps against the text's symbols); for a
    Piper voice the frames each phoneme lasts."""
    served = svc.pick(req.model, "audio/speech")
    speaker = validate_speech(req, served, svc.settings)
    view = partial(spoken_view, served, speaker=speaker, speed=req.speed)
    found = await answered(svc, Job(view, [req.input], cost=len(req.input)), req)
    return v.SpokenView(model=served.name, **found)


@router.post("/v1/chat/attention", response_model=v.ChatView, responses=s.ERRORS)
async def chat_attention(req: v.ChatViewRequest, svc: Shared):
    """The conversation read through the model's chat template, the ``answer`` after it, and
    the attention of every layer and head from the step that wrote answer token ``token``."""
    served = svc.pick(req.model, "chat/completions")
    messages = [m.as_dict() for m in req.messages]
    check_texts([m["content"] for m in messages] + [req.answer], svc.settings, what="message")
    found = await answered(svc, Job(partial(chat_view, served), [(messages, req.answer, req.token)]), req)
    return v.ChatView(model=served.name, **found)
