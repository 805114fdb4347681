"""The transcribing job: :func:`transcriptions` (each input's :class:`Transcript`, decoded as one
:class:`TranscriptionOptions` says: the search and constraints every speech model takes, an
imported Whisper's :class:`WhisperOptions` and a model of qkv's own's :class:`OwnModelOptions`;
audio files or waveforms decoded in batches, an imported Whisper's long or timed input window by window
(:func:`long_transcript`) or in batches of speech chunks (``batched``), a long input to a model
of qkv's own piece by piece, cut by voice activity), :func:`read_audio` (files as the model
reads them, good and bad), an imported Whisper's rules, alignment heads and long-form ids
(:func:`whisper_rules`, :func:`checked_heads`, :func:`whisper_tokens`), and words timed by a CTC
head (:func:`ctc_timed_words`); :data:`LM_WEIGHT`, the shallow-fusion weight.

What is not here: the speech decoders (``qkv.tasks.asr``'s ``transcribe``), Whisper's long-form
decoding (``qkv.longform``, ``qkv.longform_batched``), voice activity (``qkv.vad``), the word timings
(``qkv.word_timing``), the constraints (``constraints.py``), streamed recognition
(``qkv.speech_streaming``), the long-form settings themselves (``longform.LongForm``, ``vad.Vad``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from qkv.audio import check_many, features
from qkv.audio_stream import AudioSource
from qkv.bundle.constraints import Constraints, constraints
from qkv.bundle.defaults import Audio
from qkv.decoding import Scorer
from qkv.errors import OptionError, UserError
from qkv.hf.whisper import most_likely_languages
from qkv.loading import load_fusion_lm
from qkv.longform import LongForm, MelWindows, WhisperTokens, transcribe_long
from qkv.longform_batched import transcribe_batched
from qkv.subtitles import Segment
from qkv.tasks.asr import Transcription, too_short, transcribe
from qkv.vad import Vad, piece_waves, speech_pieces
from qkv.word_timing import UNSPACED, ctc_timed

if TYPE_CHECKING:
    from qkv.bundle.core import Bundle


LM_WEIGHT = 0.3  # ESPnet's usual shallow-fusion weight; bench/asr.py --lm-weight measures others


@dataclass(frozen=True)
class Transcript:
    """One input's transcription: its text (stripped), its token ids, the language it was
    decoded as (an imported multilingual Whisper's, given or detected; else None), the seconds
    its features took, its share of its batch's decoding seconds, and its segments (with their
    times: an imported Whisper's by its timestamps, else one for the whole input)."""

    text: str
    ids: list[int]
    language: str | None
    feature_seconds: float
    decode_seconds: float
    segments: tuple[Segment, ...] = ()


def read_audio(
    bundle: Bundle, paths: Sequence[str | Path], *, max_seconds: float | None = None
) -> tuple[list[tuple[Path, AudioSource]], list[tuple[Path, str]]]:
    """Audio files as the speech model reads them, ``(good, bad)``: each good file as a source
    (``audio_stream.AudioSource``: checked, none of its samples kept; read again, a block at a
    time, when transcribed), in order; each bad one with why, never raised
    (``audio.check_many``): unreadable, longer than ``max_seconds`` (None: any length for an
    imported Whisper, which reads long audio a window at a time, and for other models, which
    read it piece by piece, cut by voice activity), or too short for the model's front-end."""
    bundle.require("transcribe")
    config = bundle.features
    checked, bad = check_many(paths, max_seconds=max_seconds)
    good = [(path, AudioSource(path, None, config.sample_rate, rate, frames)) for path, frames, rate in checked]
    short = [too_short(bundle.model, config.frames(round(s.seconds * config.sample_rate))) for _, s in good]
    bad += [
        (path, f"{1000 * source.seconds:.0f} ms is too short for this model")
        for (path, source), cut in zip(good, short, strict=True)
        if cut
    ]
    return [g for g, cut in zip(good, short, strict=True) if not cut], bad


def _heads(
    bundle: Bundle, audio: Sequence[Audio], vad: Vad
) -> tuple[list[AudioSource], list[Tensor | None], list[Tensor | None], list[float]]:
    """Each input's source, its head (a Whisper's first chunk and a sample more, or the whole
    short input; None for an input of qkv's own model read piece by piece, longer than
    ``vad.max_seconds``), the head's features (T, M) and the seconds spent reading them."""
    sources, waves, feats, seconds = [], [], [], []
    for i, item in enumerate(audio):
        sources.append(_source(bundle, item, i))
        began = time.perf_counter()
        cut = bundle.whisper is None and sources[-1].seconds > vad.max_seconds  # read piece by piece
        waves.append(None if cut else _head(bundle, sources[-1]))  # a Whisper's first chunk and a sample more
        feats.append(None if cut else features(waves[-1], bundle.features))  # (T, M): a Whisper's first chunk
        seconds.append(time.perf_counter() - began)
    return sources, waves, feats, seconds


@dataclass(frozen=True)
class WhisperOptions:
    """An imported Whisper's own options for :func:`transcriptions`: openai/whisper's
    ``DecodingOptions``' ``language`` and ``task``, its ``transcribe``'s long-form settings and
    faster-whisper's batched mode. A model of qkv's own refuses ``language``, ``task``,
    ``batched`` and ``LongForm.multilingual`` (one line each) and reads no input in windows.

    Attributes:
        language: the start tokens' language; None: a multilingual model detects each input's
            own, as Whisper does (an English-only one needs none).
        task: "transcribe" or "translate" (None: "transcribe").
        timestamps: every input read window by window, its segments timed by the timestamps
            (without: only an input longer than the 30-s chunk is).
        long_form: how windows are read (``longform.LongForm``; None: Whisper's defaults).
        batched: N: an input read in windows is read as faster-whisper's batched mode reads it
            instead (``longform_batched.py``): its speech in chunks of at most 30 s, N decoded at
            once, none after the previous text; None: window by window, each after the previous
            text (Whisper's way).
    """

    language: str | None = None
    task: str | None = None
    timestamps: bool = False
    long_form: LongForm | None = None
    batched: int | None = None


@dataclass(frozen=True)
class OwnModelOptions:
    """A speech model of qkv's own's options for :func:`transcriptions`: its CTC head, joint with
    the decoder's beam search (the CTC prefix score, ESPnet's hybrid decoding) or alone.

    Attributes:
        ctc_weight: the CTC prefix score's weight (0: none); None: the recipe's (:attr:`Bundle.decode`).
        ctc_only: the CTC head's best path alone, no decoder.
    """

    ctc_weight: float | None = None
    ctc_only: bool = False


@dataclass(frozen=True)
class TranscriptionOptions:
    """How :func:`transcriptions` decodes, in one value as openai/whisper's ``DecodingOptions``:
    the search and the constraints every speech model takes, then each family's own options.
    Options that cannot go together are refused in one line when it runs.

    Attributes:
        beam_size: beam search's width (1: greedy); None: the recipe's (:attr:`Bundle.decode`),
            but 1 for an imported Whisper, which decodes greedily as Whisper and transformers do.
        length_penalty: None: the recipe's.
        lm: a language model directory of the same tokens, fused into the beam search.
        lm_weight: ``lm``'s weight (None: :data:`LM_WEIGHT`); only with ``lm``.
        prefix: the text every transcript starts with (:func:`constraints`; after an imported
            Whisper's start tokens; a transcript's tokens and text start with it).
        ban: words no transcript holds (:func:`constraints`).
        require: words every transcript holds (:func:`constraints`; not joint with the CTC
            prefix score). Neither ``prefix`` nor ``require`` with ``own.ctc_only``, nor for an
            input read in pieces or windows.
        batch_size: inputs (or pieces of a long input) decoded at once.
        vad: how voice activity cuts long audio (None: :class:`~qkv.vad.Vad`'s defaults): a
            model of qkv's own's input longer than ``vad.max_seconds``, an imported Whisper's
            ``whisper.batched`` chunks.
        whisper: an imported Whisper's own options.
        own: a speech model of qkv's own's options.
    """

    beam_size: int | None = None
    length_penalty: float | None = None
    lm: str | Path | None = None
    lm_weight: float | None = None
    prefix: str | None = None
    ban: Sequence[str] = ()
    require: Sequence[str] = ()
    batch_size: int = 32
    vad: Vad | None = None
    whisper: WhisperOptions = WhisperOptions()
    own: OwnModelOptions = OwnModelOptions()


def transcriptions(
    bundle: Bundle,
    audio: Sequence[Audio],
    options: TranscriptionOptions | None = None,
    *,
    on_batch: Callable[[int], None] | None = None,
    on_seconds: Callable[[float], None] | None = None,
) -> list[Transcript]:
    """Each input's transcript, in order: audio files (read at the model's rate) or mono
    waveforms (N,) at :attr:`Bundle.sample_rate`, decoded as ``options`` say (None: the
    defaults of :class:`TranscriptionOptions`).

    An imported Whisper reads an input longer than its chunk (30 s), or any input with
    ``whisper.timestamps``, in windows as openai/whisper's ``transcribe`` does (``longform.py``:
    greedy with temperature fallback, each window after the previous text; ``on_seconds(s)``
    after each window, with the seconds of audio read): its segments carry the timestamps'
    times. With ``whisper.batched`` (N), it reads such an input as faster-whisper's batched mode
    does instead (``longform_batched.py``): its speech, found by ``vad``, in chunks of at most
    30 s decoded N at a time, none after the previous text, with timestamps only with
    ``whisper.timestamps`` (without: a segment a chunk, as faster-whisper's
    ``without_timestamps``). A model of qkv's own reads an input longer than ``vad.max_seconds``
    (30 s by default) piece by piece, cut where voice activity stops (``vad.py``), each piece a
    segment with its times. Other inputs are decoded in batches, each one segment from 0 to its
    end. Files are read a block at a time: memory does not grow with their length.

    An imported Whisper decodes with its checkpoint's suppressed tokens (:func:`whisper_rules`),
    as transformers' ``generate`` does, from the tokens of ``whisper.language`` and
    ``whisper.task``, a multilingual one without a language from each input's own language,
    detected as Whisper does. ``on_batch(n)`` after every n inputs decoded (a progress bar).
    """
    bundle.require("transcribe")
    o = options or TranscriptionOptions()
    vad = o.vad or Vad()
    search = _search(bundle, o, len(audio))
    sources, waves, feats, seconds = _heads(bundle, audio, vad)
    starts, languages = _start_tokens(bundle, feats, language=o.whisper.language, task=o.whisper.task or "transcribe")
    found: list[Transcript | None] = [None] * len(feats)
    windowed = [i for i, w in enumerate(waves) if w is not None and _windowed(bundle, w, o.whisper.timestamps)]
    voiced = [i for i, w in enumerate(waves) if w is None]
    _check_pieced(vad, bool(windowed), bool(voiced), o)
    for i in windowed:
        began = time.perf_counter()
        segments = _windowed_segments(bundle, sources[i], starts[i], search.steer.scorers, o.whisper, vad, on_seconds)
        found[i] = _of_segments(segments, "", languages[i], seconds[i], began, on_batch)
    for i in voiced:
        began = time.perf_counter()
        segments = _voiced(bundle, sources[i], vad, lambda rows: search(rows, None, None, None), o.batch_size)
        found[i] = _of_segments(segments, " ", None, seconds[i], began, on_batch)
    groups: dict[tuple[int, ...] | None, list[int]] = {}
    for i, start in enumerate(starts):
        if found[i] is None:
            groups.setdefault(start, []).append(i)
    for start, rows in groups.items():
        heard = search([feats[i] for i in rows], start, search.required(rows), on_batch)
        for i, h in zip(rows, heard, strict=True):
            found[i] = search.whole(h, languages[i], seconds[i], waves[i].numel() / bundle.sample_rate)
    return [t for t in found if t is not None]


@dataclass(frozen=True)
class _Search:
    """:func:`transcriptions`' decoding of inputs read whole, or in pieces cut by voice activity
    (``tasks.asr.transcribe``), with its settings resolved (unset: the recipe's), its
    constraints and its fused language model (None: none)."""

    bundle: Bundle
    options: TranscriptionOptions
    beam_size: int
    ctc_weight: float
    steer: Constraints
    lm: object | None

    def __call__(
        self, rows: list[Tensor], start: tuple[int, ...] | None, required, on_batch: Callable[[int], None] | None
    ) -> list[Transcription]:
        """The transcriptions of ``rows`` (features (T, M) each), after the start tokens
        ``start`` (None: BEGIN alone), each with its ``required`` terms (None: none)."""
        b, o = self.bundle, self.options
        return transcribe(
            b.model,
            b.vocab.target,
            rows,
            beam_size=self.beam_size,
            ctc_weight=self.ctc_weight,
            ctc_only=o.own.ctc_only,
            length_penalty=b.decode.length_penalty if o.length_penalty is None else o.length_penalty,
            batch_size=o.batch_size,
            prefix=_started_with(b, start, self.steer.shown),
            on_batch=on_batch,
            lm=self.lm,
            lm_weight=LM_WEIGHT if o.lm_weight is None else o.lm_weight,
            scorers=[*whisper_rules(b), *self.steer.scorers],
            required=required,
        )

    def required(self, rows: list[int]) -> list | None:
        """The required terms of inputs ``rows`` (None: none is required)."""
        return None if self.steer.required is None else [self.steer.required[i] for i in rows]

    def whole(self, h: Transcription, language: str | None, read_seconds: float, seconds: float) -> Transcript:
        """An input's transcript from its transcription ``h`` (of the whole input, ``seconds``
        long): the prefix's tokens first, one segment from 0 to its end."""
        ids = [*self.steer.shown, *h.ids]
        text = self.bundle.vocab.target.decode(ids) if self.steer.shown else h.text
        whole = Segment(0.0, seconds, text.strip(), tuple(ids))
        return Transcript(text.strip(), ids, language, read_seconds, h.seconds, (whole,))


def _search(bundle: Bundle, o: TranscriptionOptions, n: int) -> _Search:
    """The decoding of :func:`transcriptions`' ``n`` inputs, its options checked (those that
    cannot go together refused in one line) and its language model loaded."""
    d = bundle.decode
    # An imported Whisper decodes greedily unless told otherwise, as Whisper and transformers do.
    beam = (d.beam_size if bundle.whisper is None else 1) if o.beam_size is None else o.beam_size
    ctc = d.ctc_weight if o.own.ctc_weight is None else o.own.ctc_weight
    _check_transcription_options(bundle, o, ctc)
    _check_batched(bundle, o.whisper)
    _check_multilingual(bundle, o.whisper)
    steer = constraints(bundle, [None] * n, prefix=o.prefix, ban=o.ban, require=o.require, beam_size=beam)
    return _Search(bundle, o, beam, ctc, steer, None if o.lm is None else _fusion_lm(bundle, o.lm))


def _windowed_segments(
    bundle: Bundle, source, start, scorers, w: WhisperOptions, vad: Vad, on_seconds: Callable[[float], None] | None
) -> list[Segment]:
    """An input's segments read window by window, each after the previous text (Whisper's way,
    ``longform.py``), or with ``w.batched`` (N) in voice-activity chunks decoded N at a time
    (faster-whisper's batched mode, ``longform_batched.py``)."""
    if w.batched is None:
        return long_transcript(bundle, source, start, w.long_form, scorers, on_seconds)
    ids = whisper_tokens(bundle, start, scorers, timestamps=w.timestamps)
    return transcribe_batched(
        bundle.model, bundle.vocab.target, source, bundle.features, ids, w.long_form or LongForm(),
        batch_size=w.batched, vad=vad, on_seconds=on_seconds,
    )  # fmt: skip


def _fusion_lm(bundle: Bundle, lm: str | Path):
    """The language model of directory ``lm``, loaded for shallow fusion with ``bundle``'s model."""
    bf16 = bundle.precision == "bf16"
    return load_fusion_lm(str(lm), bundle.vocab.target, model=bundle.model, bf16=bf16, device=bundle.device)


def _check_transcription_options(bundle: Bundle, o: TranscriptionOptions, ctc_weight: float) -> None:
    """:func:`transcriptions`' options that cannot go together, refused in one line (``ctc_weight``:
    ``o.own.ctc_weight``, resolved)."""
    if o.lm_weight is not None and o.lm is None:
        raise OptionError("lm_weight weighs the language model of lm; name one", "lm_weight", "lm")
    if bundle.whisper is None and (o.whisper.language is not None or o.whisper.task is not None):
        raise OptionError("language and task apply to imported Whisper models only", "language", "task")
    given = (("prefix", o.prefix is not None), ("ban", o.ban), ("require", o.require))
    named = [name for name, yes in given if yes]
    if o.own.ctc_only and named:
        raise OptionError(f"ctc_only decodes with the CTC head alone: no {' or '.join(named)}", "ctc_only", *named)
    if o.require and ctc_weight > 0:
        raise OptionError("require is searched for by the decoder alone: give ctc_weight 0", "require", "ctc_weight")


def _check_multilingual(bundle: Bundle, w: WhisperOptions) -> None:
    """``LongForm.multilingual`` (each window's language detected) only for a multilingual Whisper,
    and without ``language``: refused in one line."""
    if w.long_form is None or not w.long_form.multilingual:
        return
    if bundle.whisper is None or not bundle.whisper.multilingual:
        raise OptionError("multilingual detects each window's language: for a multilingual Whisper", "multilingual")
    if w.language is not None:
        raise OptionError("multilingual detects each window's language: give no language", "multilingual", "language")


def _check_batched(bundle: Bundle, w: WhisperOptions) -> None:
    """``batched`` (chunks at a time, at least 1) is for an imported Whisper, whose chunks are
    each decoded in the input's language: no ``LongForm.multilingual``; refused in one line."""
    if w.batched is None:
        return
    if w.batched < 1:
        raise OptionError(f"batched is the chunks decoded at once: 1 or more, not {w.batched}", "batched")
    if bundle.whisper is None:
        raise OptionError("batched reads long audio as an imported Whisper's chunks: for a Whisper", "batched")
    if w.long_form is not None and w.long_form.multilingual:
        raise OptionError(
            "batched decodes every chunk in the input's language: no multilingual", "batched", "multilingual"
        )


def _check_pieced(vad: Vad, windowed: bool, voiced: bool, o: TranscriptionOptions) -> None:
    """Inputs read in pieces (an imported Whisper's windows, or pieces cut by voice activity)
    take no per-transcript constraint, and a Whisper's windows no beam: refused in one line."""
    if voiced and (o.prefix is not None or o.require):
        raise OptionError(
            f"inputs longer than {vad.max_seconds:g} s are transcribed piece by piece, cut by voice activity: "
            "no prefix or require there",
            "prefix",
            "require",
        )
    if windowed and (o.beam_size not in (None, 1) or o.prefix is not None or o.require):
        raise OptionError(
            "an imported Whisper reads long audio (or gives timestamps) greedily, window by window: "
            "no beam_size, prefix or require there",
            "beam_size",
            "prefix",
            "require",
        )


def _of_segments(
    segments: list[Segment],
    joiner: str,
    language: str | None,
    read_seconds: float,
    began: float,
    on_batch: Callable[[int], None] | None,
) -> Transcript:
    """One input's transcript from the segments it was read in (its text: theirs joined by
    ``joiner``, stripped; ``began``: when its decoding started), reported as one input done."""
    ids = [t for s in segments for t in s.tokens]
    text = joiner.join(s.text for s in segments).strip()
    found = Transcript(text, ids, language, read_seconds, time.perf_counter() - began, tuple(segments))
    if on_batch is not None:
        on_batch(1)
    return found


def _voiced(
    bundle: Bundle, source: AudioSource, vad: Vad, decode: Callable[[list[Tensor]], list], batch_size: int
) -> list[Segment]:
    """A long input to a model of qkv's own, cut by voice activity (``vad.speech_pieces``): each
    piece decoded (``decode``: features -> transcriptions, ``batch_size`` pieces at a time, read
    as they come), a segment each with its times; pieces heard as nothing are left out."""
    rate, segments, batch = bundle.sample_rate, [], []
    pieces = piece_waves(source, speech_pieces(source, vad))
    for piece in itertools.chain(pieces, [None]):
        batch += [] if piece is None else [piece]
        if batch and (piece is None or len(batch) == batch_size):
            heard = decode([features(wave, bundle.features) for _, _, wave in batch])
            for (start, end, _), h in zip(batch, heard, strict=True):
                if h.text.strip():
                    segments.append(Segment(start / rate, end / rate, h.text.strip(), tuple(h.ids)))
            batch = []
    return segments


def _windowed(bundle: Bundle, wave: Tensor, timestamps: bool) -> bool:
    """Whether an imported Whisper reads an input window by window (longer than its chunk, or
    timed), given ``wave``, its :func:`_head`; never for other models."""
    if bundle.whisper is None:
        return False
    return timestamps or wave.numel() > bundle.features.chunk_seconds * bundle.sample_rate


def long_transcript(
    bundle: Bundle,
    wave: Tensor | AudioSource | MelWindows,
    start: tuple[int, ...],
    options: LongForm | None,
    bans: Sequence[Scorer] = (),
    on_seconds: Callable[[float], None] | None = None,
) -> list[Segment]:
    """An imported Whisper's segments of ``wave`` (``longform.transcribe_long``) from the start
    tokens ``start`` (<|notimestamps|> left out), with its rules and ``bans``."""
    ids = whisper_tokens(bundle, start, bans)
    return transcribe_long(
        bundle.model, bundle.vocab.target, wave, bundle.features, ids, options or LongForm(), on_seconds
    )


def whisper_tokens(
    bundle: Bundle, start: tuple[int, ...], bans: Sequence[Scorer] = (), *, timestamps: bool = True
) -> WhisperTokens:
    """The ids an imported Whisper's long-form decoding needs (``longform.WhisperTokens``), from
    the start tokens ``start`` (<|notimestamps|> left out), with its rules (the timestamp rules
    included) and ``bans``; without ``timestamps``, the start tokens end with <|notimestamps|> and
    the rules are the rest (text alone: a batched chunk is then one segment)."""
    settings, tokenizer = bundle.whisper, bundle.vocab.target
    if settings.no_timestamps_id is None:
        raise UserError(
            f"{bundle.path}: the model has no <|notimestamps|> token, so no timestamps to read long audio by"
        )
    token = tokenizer.backend.token_to_id
    start = tuple(t for t in start if t != settings.no_timestamps_id)
    return WhisperTokens(
        start=start if timestamps else (*start, settings.no_timestamps_id),
        previous=token("<|startofprev|>"),
        no_speech=token("<|nospeech|>") if token("<|nospeech|>") is not None else token("<|nocaptions|>"),
        timestamp_begin=settings.no_timestamps_id + 1,
        eos=bundle.model.config.eos_id,
        rules=(*whisper_rules(bundle, timestamps=timestamps), *bans),
        alignment_heads=checked_heads(bundle),
        spaced=not any(settings.languages.get(code) in start for code in UNSPACED),
        languages=tuple(settings.languages.items()) if settings.multilingual else (),
    )


def ctc_timed_words(bundle: Bundle, item: Audio, i: int, found: Transcript) -> Transcript:
    """``found`` (one segment, the whole input) with its words timed by the CTC head (forced
    alignment, ``word_timing.ctc_timed``); none where the head cannot read them. The input is
    one the model reads whole (at most its window), so its samples are gathered whole here."""
    wave = torch.from_numpy(np.concatenate([np.zeros(0, np.float32), *_source(bundle, item, i).blocks()]))  # (Y,)
    feats = features(wave, bundle.features)  # (T, M)
    texts = bundle.vocab.target.token_texts()
    words = ctc_timed(bundle.model, feats, found.ids, texts)
    segments = tuple(replace(s, words=words) for s in found.segments[:1])
    return replace(found, segments=segments)


def longest_prompt(bundle: Bundle) -> int:
    """The most tokens an imported Whisper's initial prompt may have: a window's prompt is at
    most half the decoder's window, <|startofprev|> included (``longform.decode_window``, as
    openai/whisper's ``DecodingTask``, which cuts a longer one from its start)."""
    return bundle.model.config.max_len // 2 - 1


def initial_prompt(bundle: Bundle, text: str) -> tuple[int, ...]:
    """``text`` as an imported Whisper's initial prompt (``LongForm.initial_prompt``): its tokens
    after a space, as openai/whisper's ``transcribe`` encodes ``--initial_prompt``; refused in one
    line for another model or over :func:`longest_prompt` tokens."""
    if bundle.whisper is None:
        raise OptionError("initial_prompt is for an imported Whisper", "initial_prompt")
    ids = tuple(bundle.vocab.target.encode(" " + text.strip()))
    if len(ids) > longest_prompt(bundle):
        raise OptionError(
            f"initial_prompt is {len(ids)} tokens; the model reads at most {longest_prompt(bundle)}", "initial_prompt"
        )
    return ids


def checked_heads(bundle: Bundle) -> tuple[tuple[int, int], ...]:
    """An imported Whisper's alignment heads, each one the decoder has (else a UserError)."""
    c = bundle.model.config
    wrong = [pair for pair in bundle.whisper.alignment_heads if pair[0] >= c.n_decoder_layers or pair[1] >= c.n_heads]
    if wrong:
        raise UserError(
            f"{bundle.path}: alignment head(s) {wrong} not in the decoder ({c.n_decoder_layers} layers of {c.n_heads})"
        )
    return bundle.whisper.alignment_heads


def whisper_rules(bundle: Bundle, *, timestamps: bool = False) -> list[Scorer]:
    """An imported Whisper's decoding rules (suppressed tokens; with ``timestamps``, the timestamp
    rules) as scorers, as transformers' ``generate`` applies them; none for other models."""
    if bundle.whisper is None:
        return []
    return bundle.whisper.scorers(eos=bundle.model.config.eos_id, timestamps=timestamps)


def _started_with(bundle: Bundle, start: tuple[int, ...] | None, shown: list[int]) -> list[int] | None:
    """The decoder's forced first tokens: the start tokens (None: BEGIN alone), then the prefix's."""
    if not shown:
        return None if start is None else list(start)
    return [*(start or [bundle.model.config.bos_id]), *shown]


def _source(bundle: Bundle, item: Audio, i: int) -> AudioSource:
    """Input ``i``: a file (checked, any length, read at the model's rate when used), a mono
    waveform as given, or a source as it is."""
    config = bundle.features
    if isinstance(item, AudioSource):
        return item
    if isinstance(item, str | Path):
        return AudioSource.of_file(item, config.sample_rate)
    wave = torch.as_tensor(item, dtype=torch.float32)
    if wave.ndim != 1:
        raise UserError(f"input {i + 1}: a waveform is one channel of samples (N,), not {tuple(wave.shape)}")
    return AudioSource.of_wave(wave, config.sample_rate)


def _head(bundle: Bundle, source: AudioSource) -> Tensor:
    """What is read of an input before decoding: an imported Whisper's first chunk and one sample
    more (its features read the chunk; a longer input is read window by window from its source),
    else the whole input."""
    if bundle.whisper is None:
        return source.whole()
    return source.head(round(bundle.features.chunk_seconds * bundle.sample_rate) + 1)


def _start_tokens(
    bundle: Bundle, feats: list[Tensor], *, language: str | None, task: str
) -> tuple[list[tuple[int, ...] | None], list[str | None]]:
    """Each input's forced start tokens and language: None and None for a model of qkv's own
    (BEGIN alone); an imported Whisper's for ``language`` and ``task``, or, for a multilingual
    one without ``language``, for each input's own language, detected 16 inputs at a time."""
    settings, n = bundle.whisper, len(feats)
    if settings is None:
        return [None] * n, [None] * n
    where, start = bundle.path / "config.json", bundle.model.config.bos_id

    def prefix(code: str | None) -> tuple[int, ...]:
        return tuple(settings.prefix(start, language=code, task=task, timestamps=False, where=where))

    if language is not None or not settings.multilingual:
        return [prefix(language)] * n, [language] * n
    dtype = next(bundle.model.parameters()).dtype
    codes = [
        code
        for i in range(0, n, 16)
        for code in most_likely_languages(bundle.model, [f.to(dtype) for f in feats[i : i + 16]], settings, where=where)
    ]
    return [prefix(code) for code in codes], codes
