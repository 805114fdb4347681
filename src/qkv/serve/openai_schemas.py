"""The bodies of the OpenAI-compatible routes, in OpenAI's shapes (as the ``openai`` client sends
and reads them): ``POST /v1/chat/completions``, ``POST /v1/completions`` and the stream chunks
of both.

Every field a request may carry is checked here with its range (a 400 naming it): OpenAI's
(``max_tokens`` or ``max_completion_tokens``, ``temperature`` 0 to 2, ``top_p``, ``stop``: a
text or at most :data:`MAX_STOPS`, ``seed``, ``n``, ``stream`` and ``stream_options``;
``presence_penalty`` and ``frequency_penalty`` only at 0 and ``logprobs`` only false, since
qkv does not compute them; ``user``, taken and not read) and qkv's own, beside them
(``top_k``, ``min_p`` and ``repetition_penalty``, as vLLM names them, and ``timeout`` as every
request has it). A field OpenAI has and qkv does not
(``tools``, ``response_format``, ``logit_bias``, ...) is refused by name, never ignored.

What is not here: the server's limits (``routes/openai.py`` checks them against ``Settings``),
the routes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from qkv.serve.schemas import INT32, SEED_MAX, SEED_MIN, Request, unicode_text

MAX_STOPS = 4  # OpenAI's limit on stop strings
STOP_CHARS = 100  # the longest stop string


class TextPart(BaseModel):
    """A part of a message's content: OpenAI's ``{"type": "text", "text": ...}`` (the one kind qkv reads)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str

    _unicode = field_validator("*")(unicode_text)


class Message(BaseModel):
    """One message of a chat: who says it and what (text, or parts of text joined)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="'developer' is read as 'system', as OpenAI reads it for its newer models"
    )
    content: str | list[TextPart]
    name: str | None = Field(None, max_length=64, description="taken, not read")

    _unicode = field_validator("*")(unicode_text)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def as_dict(self) -> dict[str, str]:
        """The message as a chat template reads it."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(False, description="a last chunk with the usage, and no choices")


class Options(Request):
    """What both routes take beside their input: OpenAI's sampling options, and qkv's."""

    model: str | None = Field(None, max_length=255, description="a model id from GET /v1/models")
    max_tokens: int | None = Field(
        None, ge=1, le=INT32, description="longest answer (default: the server's limit or half the window)"
    )
    temperature: float | None = Field(
        None,
        ge=0,
        le=2,
        description="0: greedy; an option left out is the checkpoint's (generation_config.json); none: greedy",
    )
    top_p: float | None = Field(None, gt=0, le=1, description="sample from the smallest set with this probability")
    top_k: int | None = Field(None, ge=1, le=INT32, description="(qkv) sample among the k most likely tokens")
    min_p: float | None = Field(
        None, ge=0, le=1, description="(qkv) sample among tokens at least this share as likely as the likeliest"
    )
    repetition_penalty: float | None = Field(
        None, ge=0.01, le=10, description="(qkv) CTRL's penalty of the tokens already in the text (1: none)"
    )
    stop: str | list[str] | None = Field(
        None, description=f"text that ends the answer (left out of it): one, or at most {MAX_STOPS}"
    )
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="sampling seed: a reproducible answer")
    n: int = Field(1, ge=1, le=INT32, description="answers to make for each input")
    stream: bool = Field(False, description="send the answer as Server-Sent Events as it is made")
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0, ge=-2, le=2, description="only 0: qkv has no presence penalty")
    frequency_penalty: float = Field(0, ge=-2, le=2, description="only 0: qkv has no frequency penalty")
    logprobs: bool = Field(False, description="only false: qkv does not return log-probabilities here")
    user: str | None = Field(None, max_length=256, description="taken, not read")

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        listed = [value] if isinstance(value, str) else value or []
        if len(listed) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(not s or len(s) > STOP_CHARS for s in listed):
            raise ValueError(f"a stop string has 1 to {STOP_CHARS} characters")
        return value

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatCompletionRequest(Options):
    messages: list[Message] = Field(min_length=1, description="the conversation so far, oldest first")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32, description="max_tokens' newer name")


class CompletionRequest(Options):
    prompt: str | list[str] = Field(description="the text to continue, or a list of them")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class Answer(BaseModel):
    """What both routes answer, in OpenAI's order: an id, what the object is, when, the model, the
    choices and the usage. Each route's answer names its object and its kind of choice (its fields
    keep their places here, so the JSON and its schema read as OpenAI's)."""

    id: str
    object: str
    created: int
    model: str
    choices: list
    usage: Usage


class ChatCompletion(Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class Completion(Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class OpenAIErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: int = Field(description="the HTTP status")


class OpenAIError(BaseModel):
    error: OpenAIErrorBody


ERRORS = {code: {"model": OpenAIError} for code in (400, 401, 404, 413, 429, 504)}
