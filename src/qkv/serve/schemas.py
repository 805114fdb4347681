"""The API's request and response bodies (pydantic), as the OpenAPI page at ``/docs`` shows them.

Field limits that do not depend on the server's settings are checked here (a 422 naming the
field): every number finite, every integer within what the code holds (a seed within 64 bits,
as ``torch.Generator.manual_seed`` takes it; the others within 32), every text Unicode (a lone
surrogate, which JSON's ``\ud800`` can carry, is not), a model's name short. The settings'
limits (longest text, most new tokens, widest beam, most texts per request) are checked by the
routes against ``Settings`` (``validation.py``), with the same kind of answer; the body's size
bounds every list and text before either.

What is not here: the endpoints (``app.py``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import File, UploadFile
from pydantic import BaseModel, ConfigDict, Field, field_validator

INT32 = 2**31 - 1  # the largest count (beam, tokens, top-k) a request may name: what a tensor's size holds
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes (qkv's --seed, too)


Texts = str | list[str]


def unicode_text(value: object) -> object:
    """``value`` (a field's) if every text in it is Unicode, which UTF-8 can write: JSON's
    ``"\\ud800"`` is a lone surrogate, which is not."""
    texts = value if isinstance(value, list) else [value]
    for text in texts:
        if isinstance(text, str) and not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("holds a lone surrogate (\\ud800 to \\udfff), which is not Unicode text") from None
    return value


class Request(BaseModel):
    """What every request may say: which model (by the name ``GET /v1/models`` lists; may be
    left out when one model serves the endpoint) and how long to wait at most."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = Field(None, max_length=255, description="a model name from GET /v1/models")
    timeout: float | None = Field(
        None, gt=0, description="seconds to wait for the answer at most (default and cap: the server's timeout)"
    )

    _unicode = field_validator("*")(unicode_text)


class Sampling(BaseModel):
    """Sampling options: any of them means sampling (as in ``qkv generate``)."""

    model_config = ConfigDict(allow_inf_nan=False)

    sample: bool = Field(False, description="sample instead of greedy decoding")
    temperature: float | None = Field(None, ge=1e-3, description="sampling temperature (default 1)")
    top_k: int | None = Field(None, ge=1, le=INT32, description="sample among the k most likely tokens")
    top_p: float | None = Field(None, gt=0, le=1, description="sample from the smallest set with this probability")
    seed: int | None = Field(
        None, ge=SEED_MIN, le=SEED_MAX, description="sampling seed, -2**63 to 2**64 - 1 (a reproducible output)"
    )

    def sampling(self) -> bool:
        return self.sample or any(v is not None for v in (self.temperature, self.top_k, self.top_p, self.seed))


MAX_PREFIX_CHARS = 500  # a forced prefix's characters at most (the library also caps its tokens at half the window)
MAX_WORDS = 16  # banned or required words in one request at most
MAX_WORD_CHARS = 100  # characters of one banned or required word at most
MAX_TERMS = 64  # (source, target) term pairs in one translation request at most: a small glossary
Word = Annotated[str, Field(min_length=1, max_length=MAX_WORD_CHARS)]


def some_text(words: list[str] | None) -> list[str] | None:
    """``words`` if none of them is blank (the library would refuse one later, after the queue)."""
    if words and any(not w.strip() for w in words):
        raise ValueError("give words, not a blank one")
    return words


class Constrained(BaseModel):
    """Constraints every output obeys, as ``qkv translate`` / ``generate`` / ``transcribe`` take them
    (``bundle.constraints``; docs/serving.md, "Constraints"). None given: the output is unchanged."""

    prefix: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_PREFIX_CHARS,
        description="every output starts with this text, written as part of the output (the model goes on from it)",
    )
    ban: list[Word] = Field(
        [], max_length=MAX_WORDS, description="words never written, however the tokens would spell them"
    )
    require: list[Word] = Field(
        [], max_length=MAX_WORDS, description="words every output contains (lexically constrained beam search)"
    )

    _words = field_validator("ban", "require")(some_text)

    def constraints(self) -> dict:
        """The constraints as the library's keyword arguments (hashable: a batching key holds them)."""
        return {"prefix": self.prefix, "ban": tuple(self.ban), "require": tuple(self.require)}

    def constrained(self) -> bool:
        return self.prefix is not None or bool(self.ban) or bool(self.require)


def some_terms(pairs: list[tuple[str, str]] | None) -> list[tuple[str, str]] | None:
    """``pairs`` if no source or target is blank (as ``qkv translate --terms`` refuses a blank field)."""
    if pairs and any(not w.strip() for pair in pairs for w in pair):
        raise ValueError("give a source and a target word, not a blank one")
    return pairs


class TranslateRequest(Request, Constrained):
    text: Texts = Field(description="a sentence, or a list of sentences translated together")
    terms: list[tuple[Word, Word]] = Field(
        [],
        max_length=MAX_TERMS,
        description="terminology: [source, target] pairs; the target is required of each sentence that holds "
        "the source as a word (as qkv translate --terms; beam_size 2 or more)",
    )
    beam_size: int = Field(5, ge=1, le=INT32, description="beam width (1: greedy)")
    nbest: int = Field(1, ge=1, le=INT32, description="outputs per sentence, best first, each with its score")
    length_penalty: float = Field(1.0, ge=0, le=10, description="score = log p / length^penalty")
    max_len_a: float = Field(1.5, ge=0, le=10, description="outputs have at most a*S + b tokens (S: source tokens)")
    max_len_b: int = Field(10, ge=0, le=1000, description="see max_len_a")

    _terms = field_validator("terms")(some_terms)

    def constraints(self) -> dict:
        """The constraints as ``bundle.translations`` takes them, the terms too (hashable: a
        batching key holds them)."""
        return {**super().constraints(), "terms": tuple((source, target) for source, target in self.terms)}

    def constrained(self) -> bool:
        return super().constrained() or bool(self.terms)


class Scored(BaseModel):
    text: str
    score: float = Field(description="log p / length^penalty (an empty input: 0)")


class TranslateResponse(BaseModel):
    model: str
    translations: list[list[Scored]] = Field(description="per sentence, its nbest outputs, best first")


class GenerateRequest(Request, Sampling, Constrained):
    prompt: str = Field(description="the text to continue (empty: from BEGIN)")
    max_new_tokens: int = Field(64, ge=1, le=INT32, description="longest continuation")
    beam_size: int = Field(1, ge=1, le=INT32, description="beam width (1: greedy; require needs 2 or more)")
    stream: bool = Field(False, description="send the text as Server-Sent Events as it is made")


class GenerateResponse(BaseModel):
    model: str
    text: str = Field(description="the continuation (the prompt not included)")
    tokens: int = Field(description="new tokens made")


class ChatRequest(Request, Sampling):
    messages: list[str] = Field(min_length=1, description="the dialogue so far, oldest turn first; the last is yours")
    separator: str = Field(" __eou__ ", max_length=32, description="the text that ends a turn")
    max_new_tokens: int = Field(60, ge=1, le=INT32, description="longest reply")
    beam_size: int = Field(4, ge=1, le=INT32, description="an encoder-decoder's beam width (when not sampling)")


class ChatResponse(BaseModel):
    model: str
    reply: str


class EmbedRequest(Request):
    text: Texts
    pooling: Literal["mean", "cls", "max", "mean_sqrt_len"] | None = Field(
        None, description="how token vectors become one (default: as the model records, else mean)"
    )
    normalize: bool | None = Field(None, description="unit-length vectors (default: as the model records)")


class EmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    settings: str = Field(description="the pooling, normalization and window used, and where each came from")


class ClassifyRequest(Request):
    text: Texts


class ClassifyResponse(BaseModel):
    model: str
    labels: list[str]


class AttentionRequest(Request):
    text: str = Field(description="the source (encoder-decoder), prompt (decoder-only) or text (encoder-only)")
    output: str | None = Field(
        None, description="the output to read (teacher-forced); default: the model's own, decoded now"
    )
    beam_size: int = Field(1, ge=1, le=INT32, description="beam width of the decoding (encoder-decoder)")
    length_penalty: float = Field(1.0, ge=0, le=10)
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        le=INT32,
        description="longest output decoded (default: qkv translate's 1.5 S + 10; a language model: 32)",
    )
    trace: bool = Field(False, description="also the beam search's trace (encoder-decoder)")


class TracedHypothesis(BaseModel):
    tokens: list[str]
    text: str
    score: float
    parent: int | None = Field(description="the live hypothesis of the step before that this one extends")


class TraceStepModel(BaseModel):
    step: int
    live: list[TracedHypothesis]
    ended: list[TracedHypothesis]
    dropped: list[TracedHypothesis]
    capped: bool = Field(description="the step where outputs reached their longest: the live ones ended here")


class Trace(BaseModel):
    beam_size: int
    steps: list[TraceStepModel]
    hypotheses: list[TracedHypothesis]


class AttentionResponse(BaseModel):
    model: str
    kind: str
    output: str = Field(description="the output read (decoded text)")
    source_tokens: list[str] = Field(description="what the encoder read (columns of encoder and cross maps)")
    target_tokens: list[str] = Field(description="what the decoder read, position by position (decoder columns)")
    predicted_tokens: list[str] = Field(description="what each decoder position wrote (decoder rows)")
    layers: int
    heads: int
    encoder: list[list[list[list[float]]]] | None = Field(description="encoder self-attention [layer][head][row][col]")
    decoder: list[list[list[list[float]]]] | None = Field(description="decoder masked self-attention")
    cross: list[list[list[list[float]]]] | None = Field(description="decoder cross-attention to the source")
    trace: Trace | None = None


class ModelInfo(BaseModel):
    name: str
    kind: str
    endpoints: list[str]
    window: int | None = Field(description="the window in tokens (a Piper voice has none)")
    layers: dict[str, int]
    heads: int
    labels: list[str] | None = None
    task: str | None = Field(None, description="what it was trained for (its recipe's task), or None (an import)")
    example: str = Field(description="an input it can read, for a placeholder: a sentence in its source language")


class OpenAIModel(BaseModel):
    """A served model as OpenAI's ``GET /v1/models`` lists it (the ``openai`` client's ``models.list()``)."""

    id: str = Field(description="its name")
    object: Literal["model"] = "model"
    created: int = Field(description="when its directory was written (Unix seconds)")
    owned_by: str = "qkv"


class ModelsResponse(BaseModel):
    models: list[ModelInfo]
    object: Literal["list"] = "list"
    data: list[OpenAIModel] = Field(description="the same models, in OpenAI's shape")


class Health(BaseModel):
    status: str
    models: int
    active: int = Field(description="requests held now (waiting, running or streaming)")
    waiting: int = Field(description="model jobs waiting for the model thread, and generations for their batch")


class ErrorBody(BaseModel):
    code: int
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody


ERRORS = {
    code: {"model": ErrorResponse} for code in (401, 404, 413, 422, 429, 504)
}  # the answers a model route may give


class TranscriptionForm(Constrained):
    """``/v1/audio/transcriptions`` and ``/v1/audio/translations``: a multipart form, as OpenAI's,
    and qkv's constraints (``ban`` and ``require``: the field repeated, a word each)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    file: UploadFile = File(description="the audio: WAV, FLAC, OGG or MP3")

    model: str | None = Field(None, max_length=255, description="a model name from GET /v1/models")
    language: str | None = Field(
        None, max_length=32, description="the audio's language (an imported multilingual Whisper; default: detected)"
    )
    prompt: str | None = Field(
        None,
        max_length=2000,
        description="an imported Whisper's initial prompt (as qkv transcribe --initial-prompt): spellings, names, "
        "style; at most half the decoder's window in tokens",
    )
    response_format: Literal["json", "text", "srt", "vtt", "verbose_json"] = Field(
        "json", description="json: {text}; text; srt or vtt subtitles; verbose_json: with duration and segments"
    )
    temperature: float = Field(
        0.0,
        ge=0,
        le=1,
        description="0: Whisper's temperature fallback (greedy, then 0.2 ... 1.0 where a window looks wrong); "
        "above 0 (an imported Whisper): each window sampled at it, the likeliest of 5 draws kept",
    )
    timestamp_granularities: list[Literal["segment", "word"]] | None = Field(
        None, alias="timestamp_granularities[]", description="with verbose_json: segment, word (an imported Whisper's)"
    )
    multilingual: bool | None = Field(
        None,
        description="qkv's, beyond OpenAI's: a multilingual Whisper given no language detects each 30 s window's "
        "language, each verbose_json segment saying its own (faster-whisper's multilingual); false: the first "
        "window's alone (OpenAI's); default: the server's --multilingual",
    )

    _unicode = field_validator("model", "language", "prompt", "prefix", "ban", "require")(unicode_text)


class Transcription(BaseModel):
    text: str


class SpeechRequest(Request):
    """``/v1/audio/speech``: text in, audio out, as OpenAI's."""

    input: str = Field(description="the text to speak")
    voice: str | None = Field(
        None, max_length=255, description="a speaker of the model (one that has several); else 'default'"
    )
    response_format: Literal["wav", "flac", "pcm"] = Field(
        "wav", description="wav or flac at the model's rate; pcm: raw 16-bit little-endian samples at 24 kHz"
    )
    speed: float = Field(1.0, ge=0.25, le=4.0, description="pace (a Piper voice; qkv's own TTS speaks at 1)")
