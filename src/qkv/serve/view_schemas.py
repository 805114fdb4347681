"""The bodies of the page's view routes (``routes/views.py``): a transcript segment's attention
over its spectrogram, a text's speech with its attention, a chat answer token's attention.

What is not here: the routes, the work (``views.py``); the rest of the API's bodies (``schemas.py``,
``openai_schemas.py``).
"""

from __future__ import annotations

from fastapi import File, UploadFile
from pydantic import BaseModel, ConfigDict, Field, field_validator

from qkv.serve import schemas as s
from qkv.serve.openai_schemas import Message

MAX_SEGMENT_TOKENS = 448  # Whisper's longest decoding; a segment's tokens are fewer
DAY = 86_400.0  # seconds: a bound on a segment's times that no upload reaches


class HeardViewForm(BaseModel):
    """``/v1/audio/attention``: the uploaded audio, a stretch of it and the segment's tokens
    (multipart, as the transcription routes take their file)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    file: UploadFile = File(description="the audio: WAV, FLAC, OGG or MP3")
    model: str | None = Field(None, max_length=255, description="a model name from GET /v1/models")
    start: float = Field(0.0, ge=0, le=DAY, description="the segment's start, seconds")
    end: float = Field(gt=0, le=DAY, description="the segment's end, seconds")
    tokens: str = Field(
        max_length=8 * MAX_SEGMENT_TOKENS,
        pattern=r"^\d+(,\d+)*$",
        description="the segment's token ids as verbose_json gives them, joined by commas",
    )
    language: str | None = Field(None, max_length=32, description="the transcript's language (a multilingual Whisper)")

    _unicode = field_validator("model", "language")(s.unicode_text)

    def ids(self) -> list[int]:
        return [int(t) for t in self.tokens.split(",")]


class HeardView(BaseModel):
    model: str
    start: float = Field(description="the stretch read, seconds")
    end: float
    tokens: list[str] = Field(description="the segment's tokens (rows of cross)")
    mel: list[list[float]] = Field(description="the log-mel the model reads, [frame][mel bin], low bins first")
    frame_seconds: float = Field(description="seconds between frames of mel")
    column_seconds: float = Field(description="seconds of audio per column of cross (an encoder position)")
    cross: list[list[list[list[float]]]] = Field(description="[layer][head][token][encoder position]")
    layers: int
    heads: int


class SpokenView(BaseModel):
    model: str
    tokens: list[list[str]] = Field(description="each sentence's symbols as the model reads them")
    mel: list[list[float]] = Field(description="the speech's log-mel, [frame][mel bin], low bins first")
    frame_seconds: float
    seconds: float = Field(description="the speech's length")
    steps: list[list[int]] | None = Field(description="each decoder step's frames [first, end) (qkv's TTS)")
    cross: list[list[list[list[float]]]] | None = Field(
        description="[layer][head][decoder step][symbol], sentence after sentence (qkv's TTS)"
    )
    alignment: list[list[int]] | None = Field(description="each phoneme's frames [first, end) (a Piper voice)")
    layers: int
    heads: int


class ChatViewRequest(s.Request):
    """``/v1/chat/attention``: a conversation, the answer to it, and which answer token."""

    messages: list[Message] = Field(min_length=1)
    answer: str = Field(description="the assistant's answer, as /v1/chat/completions gave it")
    token: int | None = Field(None, ge=0, le=s.INT32, description="which of the answer's tokens (default: the last)")


class ChatView(BaseModel):
    model: str
    tokens: list[str] = Field(description="the conversation as the model reads it, then the answer")
    answer_start: int = Field(description="where the answer's tokens begin in tokens")
    token: int
    row: int = Field(description="the position that wrote the token (it reads tokens[: row + 1])")
    weights: list[list[list[float]]] = Field(description="[layer][head][position], positions 0 to row")
    layers: int
    heads: int
