"""A request checked against the server's limits and the model's window, before any work.

What is here: one named function per endpoint (:func:`validate_translate`,
:func:`validate_generate`, :func:`validate_chat`, :func:`validate_texts_request` for embed and
classify, :func:`validate_attention`, :func:`validate_transcription` with :func:`checked_language`
for the audio uploads, :func:`validate_speech`), each raising :class:`~qkv.serve.errors.ApiError` (422)
on the first limit broken and returning what the route works on, and the checks they share
(:func:`check_texts`, :func:`check_window`, :func:`check_new_tokens`, :func:`check_beam`).

The schema (``schemas.py``) has already checked every field's type and range; what is checked
here depends on ``Settings`` (longest text, most texts, most new tokens, widest beam) or on the
model (its window in tokens, what its kind can do).

What is not here: the models a request may name (``Service.pick`` in ``service.py``).
"""

from __future__ import annotations

from qkv.bundle.transcription import initial_prompt
from qkv.errors import OptionError
from qkv.serve import schemas as s
from qkv.serve.errors import ApiError, described
from qkv.serve.models import Served
from qkv.serve.settings import Settings


def check_texts(texts: list[str], settings: Settings, *, what: str = "text") -> None:
    """At least one text, at most ``max_texts``, none over ``max_chars`` characters."""
    if not texts:
        raise ApiError(422, "invalid_request", f"no {what} given")
    if len(texts) > settings.max_texts:
        raise ApiError(422, "too_many", f"{len(texts)} {what}s in one request; at most {settings.max_texts}")
    for i, text in enumerate(texts):
        if len(text) > settings.max_chars:
            where = f"{what} {i}" if len(texts) > 1 else what
            raise ApiError(422, "too_long", f"{where} has {len(text)} characters; at most {settings.max_chars}")


def check_window(served: Served, ids: list[list[int]], *, what: str = "text", room: int = 0) -> None:
    """Every row of token ids within the model's window, less ``room`` (an encoder's BEGIN and END)."""
    window = served.window - room
    for i, row in enumerate(ids):
        if len(row) > window:
            where = f"{what} {i}" if len(ids) > 1 else what
            raise ApiError(
                422, "too_long", f"{where} has {len(row)} tokens; model {served.name} reads at most {window}"
            )


def check_new_tokens(n: int, settings: Settings) -> None:
    if n > settings.max_new_tokens:
        raise ApiError(422, "too_many", f"max_new_tokens {n} is over the server's limit of {settings.max_new_tokens}")


def check_beam(beam: int, settings: Settings, nbest: int = 1) -> None:
    if beam > settings.max_beam:
        raise ApiError(422, "too_many", f"beam_size {beam} is over the server's limit of {settings.max_beam}")
    if nbest > beam:
        raise ApiError(422, "invalid_request", f"nbest {nbest} needs a beam_size of at least {nbest}")


def listed(text: str | list[str]) -> list[str]:
    return [text] if isinstance(text, str) else text


def check_required(require: list, beam: int, sampling: bool = False, *, option: str = "require") -> None:
    """Required words (or ``terms``, named by ``option``) only with beam search (lexically
    constrained beam search needs a beam)."""
    if require and (sampling or beam < 2):
        why = "sampling draws each token" if sampling else f"beam_size {beam} is greedy decoding"
        raise ApiError(422, "invalid_request", f"{option} needs beam search (beam_size 2 or more): {why}")


def validate_translate(
    req: s.TranslateRequest, served: Served, settings: Settings
) -> tuple[list[str], list[list[int]]]:
    """The texts of a translation request and their source token ids."""
    texts = listed(req.text)
    check_texts(texts, settings)
    check_beam(req.beam_size, settings, req.nbest)
    check_required(req.require, req.beam_size)
    check_required(req.terms, req.beam_size, option="terms")
    ids = served.vocab.source.encode_batch(texts)
    check_window(served, ids)
    for i, (text, row) in enumerate(zip(texts, ids, strict=True)):
        if text.strip() and row and int(req.max_len_a * len(row)) + req.max_len_b < 1:  # an empty text: empty outputs
            where = f"text {i}" if len(texts) > 1 else "the text"
            raise ApiError(
                422, "invalid_request", f"max_len_a and max_len_b leave {where} no room for a token (a·S + b < 1)"
            )
    return texts, ids


def validate_generate(req: s.GenerateRequest, served: Served, settings: Settings) -> list[int]:
    """The prompt's token ids (a prompt of any length: the continuation slides past the window;
    with constraints or a beam, one that is not blank, cut to the window as ``qkv generate``
    cuts it, and not streamed)."""
    check_texts([req.prompt], settings, what="prompt")
    check_new_tokens(req.max_new_tokens, settings)
    check_beam(req.beam_size, settings)
    if req.beam_size > 1 and req.sampling():
        raise ApiError(
            422, "invalid_request", "beam_size: sampling draws one output; leave beam_size 1 or stop sampling"
        )
    check_required(req.require, req.beam_size, req.sampling())
    searched = req.constrained() or req.beam_size > 1
    if searched and req.stream:
        raise ApiError(422, "invalid_request", "stream: prefix, ban, require and beam_size > 1 need stream false")
    if searched and not req.prompt.strip():
        raise ApiError(422, "invalid_request", "prompt: prefix, ban, require and beam_size > 1 need a prompt")
    return served.vocab.source.encode(req.prompt)


def validate_chat(req: s.ChatRequest, settings: Settings) -> None:
    """A dialogue within the limits (the turns that fit the window are chosen by the library)."""
    check_texts(req.messages, settings, what="message")
    check_new_tokens(req.max_new_tokens, settings)
    check_beam(req.beam_size, settings)


def validate_texts_request(
    req: s.EmbedRequest | s.ClassifyRequest, served: Served, settings: Settings
) -> tuple[list[str], list[list[int]]]:
    """The texts of an encoder's request and their token ids, each with room for BEGIN and END."""
    texts = listed(req.text)
    check_texts(texts, settings)
    ids = served.vocab.source.encode_batch(texts)
    check_window(served, ids, room=2)
    return texts, ids


def validate_attention(req: s.AttentionRequest, served: Served, settings: Settings) -> None:
    """One text (and the output to read) within the limits; a trace only of an encoder-decoder."""
    check_texts([req.text], settings)
    if req.output is not None:
        check_texts([req.output], settings, what="output")
    check_beam(req.beam_size, settings)
    if req.max_new_tokens is not None:
        check_new_tokens(req.max_new_tokens, settings)
    if req.trace and served.kind != "encoder_decoder":
        raise ApiError(422, "invalid_request", f"a beam trace needs an encoder-decoder; {served.name} is {served.kind}")


def validate_transcription(form: s.TranscriptionForm, served: Served, task: str) -> str | None:
    """What of OpenAI's transcription form the model can honour; the language to decode as
    (None: an imported multilingual Whisper detects it; the other models hear one language)."""
    granularities = form.timestamp_granularities or []
    if granularities and form.response_format != "verbose_json":
        raise ApiError(422, "invalid_request", "timestamp_granularities[] needs response_format verbose_json")
    if "word" in granularities and served.bundle.whisper is None:
        raise ApiError(422, "invalid_request", "timestamp_granularities[]: word timestamps need an imported Whisper")
    check_heard_required(form.require, served)
    return checked_language(form.language, served, task)


def whisper_decoding(form: s.TranscriptionForm, served: Served) -> tuple[tuple[int, ...], tuple[float, ...] | None]:
    """The form's ``prompt`` as token ids (empty: none) and ``temperature`` as the temperatures a
    window is decoded at (None: Whisper's fallback schedule, as ``qkv transcribe``; above 0: that
    temperature alone). Both only for an imported Whisper; a prompt of at most
    ``bundle.transcription.longest_prompt`` tokens (422 naming both numbers)."""
    bundle = served.bundle
    if bundle.whisper is None and (form.prompt or form.temperature > 0):
        raise ApiError(
            422, "invalid_request", f"prompt and temperature: model {served.name} is not an imported Whisper"
        )
    if not form.prompt:
        return (), None if form.temperature == 0 else (form.temperature,)
    try:
        ids = initial_prompt(bundle, form.prompt)
    except OptionError as e:
        raise ApiError(422, "invalid_request", e.said({"initial_prompt": "prompt"})) from None
    return ids, None if form.temperature == 0 else (form.temperature,)


def detects_each_window(form: s.TranscriptionForm, served: Served, settings: Settings) -> bool:
    """Whether a multilingual Whisper detects each window's language (``LongForm.multilingual``):
    the form's ``multilingual``, else the server's ``--multilingual`` where it can apply (a
    multilingual Whisper, no language given). Asked for outright, it needs both: a 422 for
    another model, or beside a ``language``."""
    whisper = served.bundle.whisper
    can = whisper is not None and whisper.multilingual
    if form.multilingual is None:
        return settings.multilingual and can and form.language is None
    if form.multilingual and not can:
        raise ApiError(
            422,
            "invalid_request",
            f"multilingual detects each window's language: model {served.name} is not a multilingual Whisper",
        )
    if form.multilingual and form.language is not None:
        raise ApiError(422, "invalid_request", "multilingual detects each window's language: give no language")
    return form.multilingual


def check_heard_required(require: list[str], served: Served) -> None:
    """Required words only of a speech model that decodes with a beam, by its decoder alone (as
    ``bundle.transcriptions`` takes them: an imported Whisper decodes greedily)."""
    bundle = served.bundle
    beam = 1 if bundle.whisper is not None else bundle.decode.beam_size
    if require and beam < 2:
        raise ApiError(422, "invalid_request", f"require: model {served.name} decodes greedily (beam 1)")
    if require and bundle.decode.ctc_weight > 0:
        raise ApiError(422, "invalid_request", f"require: model {served.name} decodes jointly with its CTC head")


def checked_language(language: str | None, served: Served, task: str) -> str | None:
    """``language`` as the model can take it: one it knows (a multilingual Whisper), English
    for an English-only Whisper (whose start tokens name none: None), none for qkv's own."""
    whisper = served.bundle.whisper
    if language is None:
        return None
    if whisper is not None and whisper.multilingual:
        if language not in whisper.languages:
            known = ", ".join(whisper.languages)
            raise ApiError(422, "invalid_request", f"language {described(language)}: model {served.name} knows {known}")
        return language
    if whisper is not None and language == "en":
        return None
    hears = "English" if whisper is not None else "the one language it was trained on"
    raise ApiError(422, "invalid_request", f"language {described(language)}: model {served.name} hears {hears} only")


def validate_speech(req: s.SpeechRequest, served: Served, settings: Settings) -> str | None:
    """A text to speak within ``max_speech_chars``, a voice the model has and a pace it can
    take; the speaker to speak as (None: the model's one voice)."""
    if len(req.input) > settings.max_speech_chars:
        raise ApiError(422, "too_long", f"input has {len(req.input)} characters; at most {settings.max_speech_chars}")
    if not req.input.strip():
        raise ApiError(422, "invalid_request", "input: nothing to say")
    if req.speed != 1.0 and served.kind != "vits":
        raise ApiError(422, "invalid_request", f"speed: model {served.name} (qkv's own TTS) speaks at speed 1 only")
    speakers = served.bundle.speakers
    if speakers and req.voice in speakers:
        return req.voice
    if not speakers and req.voice in (None, "default"):
        return None
    known = ", ".join(speakers) if speakers else "'default' (it has one voice)"
    shown = "(none given)" if req.voice is None else described(req.voice)
    raise ApiError(422, "invalid_request", f"voice {shown}: model {served.name}'s voices are {known}")
