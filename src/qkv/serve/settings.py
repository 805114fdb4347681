"""The server's limits and who may call it, with their defaults: a module of its own, so that
``qkv``'s parser can show them without importing the server (FastAPI, uvicorn)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Settings:
    """The server's limits and who may call it (``qkv serve`` options of the same names).

    Attributes:
        max_body_bytes: largest request body (413 beyond).
        max_chars: longest text, prompt or turn, in characters (422 beyond); an encoder's input
            must also fit the model's window in tokens.
        max_texts: most texts (or dialogue turns) in one request (422 beyond).
        max_new_tokens: most new tokens a request may ask for (422 beyond).
        max_beam: widest beam (422 beyond).
        max_active: most requests held at once, waiting, running or streaming (429 beyond).
        timeout_s: longest wait for an answer (504 beyond); a request may ask for less.
        batching: merge requests that arrive together into one forward pass.
        batch_wait_ms: how long a request waits for others to join its batch.
        max_batch_tokens: a batch's budget, in source tokens times beam width.
        api_keys: the keys a request must carry as ``Authorization: Bearer KEY`` (every path
            but ``/health``; 401 without one); empty: none needed. Never shown in a repr.
        rate_limit: requests a minute a key (without keys, a client address) may make, in
            bursts of as many (429 with Retry-After beyond); 0: no limit.
        cors_origins: the origins whose pages a browser lets call the API (CORS); empty: none.
        max_upload_bytes: largest audio file uploaded for transcription (413 beyond; the
            body of those two endpoints may be this and a little more for the form's fields).
        max_audio_seconds: longest audio transcribed (422 beyond); an imported Whisper also
            reads at most its chunk (30 s).
        max_speech_chars: longest text spoken by ``/v1/audio/speech`` (422 beyond).
        multilingual: a multilingual Whisper given no language detects each 30-second window's
            language (faster-whisper's ``multilingual``), not the first window's alone: the
            default of a transcription's ``multilingual`` field.
        stream_max_buffered_seconds: most audio a ``/v1/audio/stream`` client may have sent that
            waits to be decoded (sent faster than the model keeps up: an error, close 1008).
        stream_max_message_bytes: largest message a stream takes (an error, close 1008 beyond).
        stream_idle_seconds: a stream that receives nothing for this long is closed (1008).
    """

    max_body_bytes: int = 256 * 1024
    max_chars: int = 2000
    max_texts: int = 64
    max_new_tokens: int = 512
    max_beam: int = 8
    max_active: int = 64
    timeout_s: float = 60.0
    batching: bool = True
    batch_wait_ms: float = 5.0
    max_batch_tokens: int = 8192
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    rate_limit: float = 0.0
    cors_origins: tuple[str, ...] = ()
    max_upload_bytes: int = 25 * 1024 * 1024  # OpenAI's limit for a transcription's file
    max_audio_seconds: float = 60.0
    max_speech_chars: int = 4096  # OpenAI's limit for speech's input
    multilingual: bool = False
    stream_max_buffered_seconds: float = 30.0
    stream_max_message_bytes: int = 256 * 1024  # 8 s of 16 kHz s16le audio
    stream_idle_seconds: float = 30.0
