"""``/v1/audio/stream``: speech recognised while it is spoken, over a WebSocket.

The client opens ``ws://HOST/v1/audio/stream?model=NAME&language=CODE&timing=aligned`` (all
optional: ``model`` and ``language`` as ``/v1/audio/transcriptions`` takes them; ``timing``:
"aligned", word times by the model's alignment where it has one (each step's decoding aligns its
words with the encoder output it has read, ``decoder_of(words=True)``: the times ``qkv transcribe
--word-timestamps`` gives for the same buffer), or "estimated", none sought, a cheaper step; with
API keys, the same ``Authorization: Bearer KEY``
header, or, from a browser, which cannot set it, the key among the subprotocols it offers:
``qkv.bearer.`` and the key in base64url, beside ``qkv``, the one the server answers with;
401 before the handshake without a key it knows), then sends

  * binary messages: 16 kHz mono audio, 16-bit signed little-endian samples (``s16le``), any
    number of samples each, at most ``stream_max_message_bytes``;
  * a text message ``{"type": "end"}`` when the audio is over.

The server answers JSON text messages: ``{"type": "final", "text", "start", "end", "words",
"timing"}`` for words it has committed (never taken back: the finals joined by spaces are the
transcript, in order; ``start`` and ``end`` in seconds of the stream; ``words``: each word's
``{"word", "start", "end"}``; ``timing``: "aligned" where an imported Whisper's alignment heads
timed every word, else "estimated", the segments' times shared out by characters) and
``{"type": "partial", "text"}`` for its present guess beyond them; after ``end``, the last
finals, then it closes (1000). The policy is local agreement (``qkv.speech_streaming``): every
second of new audio the buffer is decoded again on the model thread (between other requests'
batches, so the event loop and the other requests go on).

Refusals are ``{"type": "error", "error": {"code", "type", "message"}}`` and a close: 1003 for
data the server cannot read (an odd number of bytes, a text that is not the end message);
1008 for a limit (a message over ``stream_max_message_bytes``, more than
``stream_max_buffered_seconds`` of audio waiting to be decoded, nothing received for
``stream_idle_seconds``) or a bad model, language or timing; 1013 when every slot is taken; 1011 when
a step fails or takes longer than the server's timeout. The stream holds one slot while open.

What is not here: the policy (``qkv.speech_streaming``), the key check (``middleware.Gate``,
``access.protocol_key``).
"""

from __future__ import annotations

import asyncio
import json
import logging

import numpy as np
import torch
from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from qkv.serve.access import PROTOCOL
from qkv.serve.errors import ApiError, error_body
from qkv.serve.models import Served
from qkv.serve.service import Service
from qkv.serve.validation import checked_language
from qkv.speech_streaming import SpeechStream, Update, decoder_of

router = APIRouter(tags=["audio"])
PATH = "/v1/audio/stream"
RATE = 16_000  # what the client sends: 16 kHz mono s16le
LOG = logging.getLogger("qkv.serve")
UNREADABLE, LIMIT, FAILED, BUSY = 1003, 1008, 1011, 1013  # RFC 6455 section 7.4.1 close codes; 1013: IANA's


class Refused(Exception):
    """Why a stream ends early: the close code, and the error's status, type and sentence."""

    def __init__(self, close: int, code: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.close, self.code, self.kind, self.message = close, code, kind, message


class Inbox:
    """Audio received and not yet given to the stream, and whether the client has said ``end``."""

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []
        self.samples = 0
        self.ended = False  # the client said end (or left)
        self.gone = False  # the client left
        self.arrived = asyncio.Event()

    def take(self) -> torch.Tensor:
        """Everything waiting, as one waveform (Y,) in [-1, 1]."""
        joined = np.concatenate(self.chunks) if self.chunks else np.zeros(0, "<i2")
        self.chunks, self.samples = [], 0
        self.arrived.clear()
        return torch.from_numpy(joined.astype(np.float32) / 32768.0)  # (Y,)


def samples_of(data: bytes, limit: int) -> np.ndarray:
    """A binary message's samples (s16le), or :class:`Refused` for one too large or of an odd size."""
    if len(data) > limit:
        raise Refused(LIMIT, 413, "too_large", f"a message of {len(data)} bytes; the server takes at most {limit}")
    if len(data) % 2:
        raise Refused(UNREADABLE, 400, "invalid_audio", f"{len(data)} bytes: 16-bit samples come in pairs of bytes")
    return np.frombuffer(data, dtype="<i2")


def is_end(text: str) -> bool:
    """Whether a text message is ``{"type": "end"}``; any other text is :class:`Refused`."""
    try:
        message = json.loads(text)
    except ValueError:
        message = None
    if isinstance(message, dict) and message.get("type") == "end":
        return True
    raise Refused(UNREADABLE, 400, "invalid_message", 'a text message is {"type": "end"}; audio goes in binary ones')


async def receive_into(ws: WebSocket, inbox: Inbox, svc: Service) -> None:
    """Fill ``inbox`` until the client says ``end`` or leaves; :class:`Refused` past a limit."""
    settings = svc.settings
    most = round(settings.stream_max_buffered_seconds * RATE)
    while True:
        try:
            message = await asyncio.wait_for(ws.receive(), settings.stream_idle_seconds)
        except asyncio.TimeoutError:
            raise Refused(LIMIT, 408, "idle", f"nothing received for {settings.stream_idle_seconds:g} s") from None
        if message["type"] == "websocket.disconnect":
            inbox.gone = True
            break
        if message.get("bytes") is not None:
            inbox.chunks.append(samples_of(message["bytes"], settings.stream_max_message_bytes))
            inbox.samples += inbox.chunks[-1].size
            if inbox.samples > most:
                waiting = inbox.samples / RATE
                raise Refused(
                    LIMIT, 429, "too_fast", f"{waiting:.1f} s of audio wait to be decoded; at most {most / RATE:g}"
                )
        elif is_end(message.get("text") or ""):
            break
        inbox.arrived.set()
    inbox.ended = True
    inbox.arrived.set()


def opened(ws: WebSocket, svc: Service) -> tuple[Served, str | None]:
    """The model the query names (``model``: as the transcriptions route picks it) and its
    ``language``; :class:`Refused` (1008) for either that cannot be."""
    try:
        served = svc.pick(ws.query_params.get("model"), "audio/transcriptions")
        language = checked_language(ws.query_params.get("language"), served, "transcribe")
    except ApiError as e:
        raise Refused(LIMIT, e.code, e.kind, e.message) from None
    if served.bundle.sample_rate != RATE:
        hears = f"model {served.name} hears {served.bundle.sample_rate} Hz audio; the stream carries {RATE} Hz"
        raise Refused(LIMIT, 422, "wrong_model", hears)
    return served, language


def aligning(ws: WebSocket) -> bool:
    """Whether the query's ``timing`` asks for word times by the model's alignment ("aligned",
    the default: where the model has one; a decoder pass more a step, the encoder output shared)
    or for estimates ("estimated": no alignment pass, a cheaper step); :class:`Refused` (1008)
    for any other."""
    timing = ws.query_params.get("timing", "aligned")
    if timing not in ("aligned", "estimated"):
        raise Refused(LIMIT, 400, "invalid_request", f"timing {timing[:40]!r}: 'aligned' or 'estimated'")
    return timing == "aligned"


@router.websocket(PATH)
async def stream(ws: WebSocket) -> None:
    """Partial and final transcripts of 16 kHz s16le audio sent as it is spoken (see the module)."""
    svc: Service = ws.app.state.service
    await ws.accept(subprotocol=PROTOCOL if PROTOCOL in ws.scope.get("subprotocols", ()) else None)
    free = None
    try:
        served, language = opened(ws, svc)
        words = aligning(ws)
        try:
            free = svc.take_slot()
        except ApiError as e:
            raise Refused(BUSY, e.code, e.kind, e.message) from None
        speech = SpeechStream(decoder_of(served.bundle, language=language, words=words), sample_rate=RATE)
        await transcribe(ws, svc, speech)
        await closed(ws, 1000)
    except Refused as e:
        svc.metrics.refused.labels(e.kind).inc()
        await say(ws, {"type": "error", **error_body(e.code, e.kind, e.message)})
        await closed(ws, e.close)
    except WebSocketDisconnect:
        svc.metrics.refused.labels("disconnected").inc()
    finally:
        if free is not None:
            free()


async def transcribe(ws: WebSocket, svc: Service, speech: SpeechStream) -> None:
    """Decode as audio arrives, a step per ``min_chunk`` seconds (on the model thread), and send
    what each step commits and guesses; at the end, what is left, committed whole."""
    inbox = Inbox()
    receiving = asyncio.create_task(receive_into(ws, inbox, svc))
    enough = round(speech.options.min_chunk * RATE)
    try:
        while True:
            if receiving.done():
                receiving.result()  # raises what stopped it: a limit passed, a frame it cannot read
            if inbox.gone:
                return
            if inbox.samples + speech.fresh < enough and not inbox.ended:
                waiter = asyncio.ensure_future(inbox.arrived.wait())
                await asyncio.wait({receiving, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                continue
            chunk, ended = inbox.take(), inbox.ended
            update = await step(svc, speech, chunk, ended)
            await send_update(ws, update, ended)
            if ended:
                return
    finally:
        receiving.cancel()


async def step(svc: Service, speech: SpeechStream, chunk: torch.Tensor, ended: bool) -> Update:
    """One step of the policy on the model thread, within the server's timeout (1011 beyond)."""

    def run() -> Update:
        speech.insert(chunk)
        return speech.finish() if ended else speech.step()

    try:
        return await asyncio.wait_for(svc.batcher.call(run), svc.settings.timeout_s)
    except asyncio.TimeoutError:
        raise Refused(FAILED, 504, "timeout", f"a step took over {svc.settings.timeout_s:g} s") from None
    except Exception as e:  # a bug: logged, and the stream ends as a 500 (the server goes on)
        LOG.error("%s: %s", PATH, type(e).__name__, exc_info=e)
        raise Refused(FAILED, 500, "internal_error", "the server failed on this stream; its log says why") from None


async def send_update(ws: WebSocket, update: Update, ended: bool) -> None:
    """A step's final (if it committed words) and, unless the stream is over, its partial."""
    if update.committed:
        await ws.send_json(final_message(update))
    if not ended:
        await ws.send_json({"type": "partial", "text": update.partial_text})


def final_message(update: Update) -> dict:
    """A step's committed words as a ``final`` message: their text, times and each word's."""
    words = update.committed
    return {
        "type": "final",
        "text": update.text,
        "start": round(words[0].start, 3),
        "end": round(words[-1].end, 3),
        "words": [{"word": w.text, "start": round(w.start, 3), "end": round(w.end, 3)} for w in words],
        "timing": "aligned" if all(w.aligned for w in words) else "estimated",
    }


async def say(ws: WebSocket, message: dict) -> None:
    """Send ``message`` if the client is still there."""
    if ws.application_state == WebSocketState.CONNECTED and ws.client_state == WebSocketState.CONNECTED:
        try:
            await ws.send_json(message)
        except (WebSocketDisconnect, RuntimeError):
            pass


async def closed(ws: WebSocket, code: int) -> None:
    """Close with ``code`` if not closed already."""
    if ws.application_state == WebSocketState.CONNECTED:
        try:
            await ws.close(code)
        except (WebSocketDisconnect, RuntimeError):  # the client left first
            pass
