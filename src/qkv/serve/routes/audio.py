"""OpenAI's audio endpoints: ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``
(a speech model: an uploaded file in, its text out, as ``qkv transcribe``) and ``POST
/v1/audio/speech`` (a TTS model or an imported Piper voice: text in, audio out, as ``qkv
speak``), so that the ``openai`` Python client works against ``qkv serve``.

The uploads are multipart forms (OpenAI's fields); their bodies may be as large as
``--max-upload-mb`` (``middleware.BodyLimit``), the rest of the API's stay small. Transcripts
of requests that arrive together are decoded as one batch; speech is made one request at a
time (the same text always gives the same audio, which a shared batch's draws would not).
"""

from __future__ import annotations

import math
import time
from functools import partial
from typing import Annotated

from fastapi import APIRouter, Form, UploadFile
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from torch import Tensor

from qkv.serve import audio
from qkv.serve import schemas as s
from qkv.serve.batching import Job
from qkv.serve.errors import ApiError, described
from qkv.serve.models import SPEECH_ENDPOINTS, Served
from qkv.serve.service import Service, Shared
from qkv.serve.validation import detects_each_window, validate_speech, validate_transcription, whisper_decoding

router = APIRouter(tags=["audio"])
UploadForm = Annotated[s.TranscriptionForm, Form(media_type="multipart/form-data")]  # Form's default: urlencoded
UPLOADS = ("/v1/audio/transcriptions", "/v1/audio/translations")  # the paths that take large bodies
FRAMES_PER_SECOND = 50  # a batch's cost of a second of audio: Whisper's encoder positions
TEXT_FORMS = {"text": "text/plain", "srt": "text/plain", "vtt": "text/vtt"}
HEARD = {
    200: {
        "description": "json and verbose_json: JSON; text, srt, vtt: text",
        "content": {"application/json": {}, "text/plain": {}, "text/vtt": {}},
    },
    400: {"model": s.ErrorResponse, "description": "the file is not audio the server can read"},
    **s.ERRORS,
}
SPOKEN = {200: {"description": "the audio", "content": {m: {} for m in audio.MEDIA.values()}}, **s.ERRORS}


@router.post("/v1/audio/transcriptions", response_class=Response, responses=HEARD)
async def transcriptions(form: UploadForm, svc: Shared):
    """The words of an uploaded audio file, in its language (as ``qkv transcribe``)."""
    return await heard(form, svc, "transcribe")


@router.post("/v1/audio/translations", response_class=Response, responses=HEARD)
async def translations(form: UploadForm, svc: Shared):
    """An uploaded audio file's speech in English text (a multilingual Whisper's translate
    task, or a model of qkv's own trained for speech translation)."""
    return await heard(form, svc, "translate")


async def uploaded(file: UploadFile, served: Served, svc: Service) -> Tensor:
    """An upload's waveform at the served model's rate: 413 over the size limit, else as
    ``audio.heard`` reads it (a 4xx naming the file when it cannot be read or is too long)."""
    data = await file.read()
    if len(data) > svc.settings.max_upload_bytes:
        limit = svc.settings.max_upload_bytes
        raise ApiError(413, "too_large", f"the file is {len(data)} bytes; the server takes at most {limit}")
    name = described(file.filename or "(unnamed)")
    return await run_in_threadpool(audio.heard, data, name, served, svc.settings)  # (Y,)


async def heard(form: s.TranscriptionForm, svc: Service, task: str) -> Response:
    """What ``task`` ("transcribe" or "translate") makes of the upload, in its response format."""
    served = svc.pick(form.model, SPEECH_ENDPOINTS[task])
    language = validate_transcription(form, served, task)
    prompt, temperatures = whisper_decoding(form, served)
    wave = await uploaded(form.file, served, svc)
    seconds = wave.numel() / served.bundle.sample_rate
    timed = form.response_format in ("srt", "vtt", "verbose_json")  # segments with their times
    constraints = form.constraints()
    words = "word" in (form.timestamp_granularities or [])
    multilingual = detects_each_window(form, served, svc.settings)
    decoding = {"words": words, "prompt": prompt, "temperatures": temperatures, "multilingual": multilingual}
    job = Job(
        partial(audio.transcribe, served, task=task, language=language, timestamps=timed, **decoding, **constraints),
        [wave],
        key=("audio", served.name, task, language, timed, *decoding.values(), *constraints.values()),
        cost=math.ceil(seconds * FRAMES_PER_SECOND) * served.bundle.decode.beam_size,
    )
    start = time.perf_counter()
    (found,) = await svc.run(job, s.Request())
    svc.count_tokens(SPEECH_ENDPOINTS[task], len(found.ids), time.perf_counter() - start)
    return answer(
        found, form.response_format, task, segments="segment" in (form.timestamp_granularities or ["segment"])
    )


def answer(found: audio.Heard, form: str, task: str, *, segments: bool = True) -> Response:
    """A transcript as OpenAI's ``response_format`` writes it."""
    if form == "json":
        return JSONResponse(s.Transcription(text=found.text).model_dump())
    if form == "verbose_json":
        return JSONResponse(audio.verbose(found, task=task, segments=segments))
    text = found.text if form == "text" else audio.subtitles(audio.segments_of(found), form)
    return Response(text, media_type=f"{TEXT_FORMS[form]}; charset=utf-8")


@router.post("/v1/audio/speech", response_class=Response, responses=SPOKEN)
async def speech(req: s.SpeechRequest, svc: Shared):
    """``input`` spoken by a TTS model or a Piper voice (as ``qkv speak``): WAV, FLAC or raw PCM."""
    served = svc.pick(req.model, "audio/speech")
    speaker = validate_speech(req, served, svc.settings)
    job = Job(
        partial(audio.speak, served, speaker=speaker, speed=req.speed, form=req.response_format),
        [req.input],
        cost=len(req.input),
    )
    ((data, cut),) = await svc.run(job, req)
    rate = audio.PCM_RATE if req.response_format == "pcm" else served.bundle.sample_rate
    headers = {"X-Sample-Rate": str(rate), "X-Sentences-Cut": str(cut)}  # cut: ran into the model's window
    return Response(data, media_type=audio.MEDIA[req.response_format], headers=headers)
