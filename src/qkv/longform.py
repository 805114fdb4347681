"""Whisper on audio of any length: sequential 30-second windows, as openai/whisper's ``transcribe``.

The file's log-mel (``audio.whisper_log_mel``, with one chunk of zeros appended) is read one
window (a chunk: 3,000 frames) at a time, computed as it is read (``audio_stream.WhisperFrames``:
memory flat in the file's length). Each window is decoded with timestamps, after the
previous windows' tokens as a prompt (<|startofprev|>, at most half the decoder's window), by
greedy search with Whisper's rules (``decoding/whisper_rules.py``); when the result looks wrong,
it is decoded again at the next temperature (temperature fallback, Radford et al., 2022,
section 4.5): its text compresses too well (gzip ratio > 2.4: repetition) or its mean
log-probability per token is below −1, unless the model says "no speech" (probability > 0.6
at <|startoftranscript|>) and is unsure of the text (then the window is silence and skipped).
A draw at temperature > 0 takes the likeliest of ``best_of`` samples. The window's text is cut
into segments at each pair of timestamps; the next window starts at the last timestamp (or
after the window, when the last segment is open). A prompt is dropped after a window decoded
at a temperature above 0.5 (its text is not to be trusted as context). With word timestamps
(``LongForm.word_timestamps``), each window's words are timed by its alignment heads
(``word_timing.py``) and, unless the window ended with a lone timestamp, the next window starts
at the end of its last word, as openai/whisper's ``transcribe`` does. The defaults are
openai/whisper's (:class:`LongForm`).

What is here: :class:`LongForm` (the settings), :class:`WhisperTokens` (the token ids it
needs), :func:`transcribe_long` (one waveform's segments), :func:`decode_window` (one window's
decodings, with what the fallback reads; or several windows', one each), :func:`with_fallback`,
:func:`window_segments` and :func:`timed_words` (a window's result, segments and words), and the
pure parts it is built of: :func:`compression_ratio`, :func:`cut_segments`,
:func:`needs_fallback`. What is not here: the rules (``decoding/whisper_rules.py``), the start
tokens and settings (``hf/whisper.py``), the segments' files (``subtitles.py``), batched
long-form (``longform_batched.py``), the library job (``bundle/transcription.py``).

Shapes use the legend of ``attention.py``: T frames, M mel bins, N rows, V vocabulary.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import Tensor

from qkv.audio import FeatureConfig
from qkv.audio_stream import AudioSource, WhisperFrames
from qkv.decoding import DONE, Scorer, stream
from qkv.decoding.decoders import SpeechEncoderDecoderDecoder
from qkv.models.speech import SpeechEncoderDecoder
from qkv.subtitles import Segment
from qkv.tokenization import Tokenizer
from qkv.word_timing import align_window, fit_words

TOKEN_SECONDS = 0.02  # a timestamp step: two feature frames of 10 ms (the encoder halves the frames)
FRAMES_PER_STAMP = 2


class MelWindows(Protocol):
    """Whisper's features of one input (after a chunk of zeros), read a window at a time:
    ``frames`` (T) and ``window(first, count)``, frames [first, first + count) (count, M).
    ``audio_stream.WhisperFrames`` computes them a chunk at a time, in flat memory."""

    frames: int

    def window(self, first: int, count: int) -> Tensor: ...


@dataclass(frozen=True)
class LongForm:
    """How long audio is decoded; the defaults are openai/whisper's ``transcribe`` (its CLI's
    ``best_of``).

    Attributes:
        temperatures: tried in turn while a window's result needs a fallback (0: greedy).
        compression_ratio_threshold: a text whose gzip ratio is above it repeats itself (None: never).
        logprob_threshold: a mean log-probability per token below it is a failure (None: never).
        no_speech_threshold: a window whose "no speech" probability is above it, and whose mean
            log-probability is below ``logprob_threshold``, is silence: skipped (None: never).
        condition_on_previous_text: the previous windows' tokens are each window's prompt.
        best_of: samples drawn at a temperature above 0, the likeliest kept.
        initial_prompt: token ids read before the first window (Whisper's ``--initial_prompt``).
        seed: the samples' seed.
        word_timestamps: time each segment's words (``Segment.words``; Whisper's
            ``--word_timestamps``).
        multilingual: detect each window's language and decode the window in it (faster-whisper's
            ``multilingual``; openai/whisper detects the language once, on the first window):
            for speech that changes language. Each segment says its window's
            (``Segment.language``); needs ``WhisperTokens.languages``.
    """

    temperatures: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    condition_on_previous_text: bool = True
    best_of: int = 5
    initial_prompt: tuple[int, ...] = ()
    seed: int = 0
    word_timestamps: bool = False
    multilingual: bool = False


@dataclass(frozen=True)
class WhisperTokens:
    """The ids long-form decoding needs: ``start`` (<|startoftranscript|>, and a multilingual
    model's language and task; no <|notimestamps|>), ``previous`` (<|startofprev|>; None: no
    prompts), ``no_speech`` (<|nospeech|> or <|nocaptions|>; None: never silence),
    ``timestamp_begin`` (<|0.00|>, right after <|notimestamps|>), ``eos`` (END), ``rules``:
    Whisper's rules as scorers, the timestamp rules included; for word timestamps,
    ``alignment_heads`` ((layer, head) pairs; empty: the upper half's) and ``spaced`` (the
    language writes spaces between words); ``languages``: a multilingual model's (code, token id)
    pairs, for ``LongForm.multilingual`` (``start`` then holds one of the ids, replaced window by
    window)."""

    start: tuple[int, ...]
    previous: int | None
    no_speech: int | None
    timestamp_begin: int
    eos: int
    rules: tuple[Scorer, ...]
    alignment_heads: tuple[tuple[int, int], ...] = ()
    spaced: bool = True
    languages: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Decoded:
    """One window's decoding: its new tokens (END left out), their mean log-probability (END
    included), its text's compression ratio, the "no speech" probability and the temperature."""

    tokens: list[int]
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    temperature: float


def compression_ratio(text: str) -> float:
    """len(text) / len(zlib(text)) in UTF-8 bytes: high for a text that repeats itself."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def needs_fallback(d: Decoded, o: LongForm) -> bool:
    """Whether a window's result is to be decoded again at the next temperature."""
    failed = (o.compression_ratio_threshold is not None and d.compression_ratio > o.compression_ratio_threshold) or (
        o.logprob_threshold is not None and d.avg_logprob < o.logprob_threshold
    )
    return failed and not silent(d, o)


def silent(d: Decoded, o: LongForm) -> bool:
    """Whether a window is silence: "no speech" likely and the text unsure."""
    return (
        o.no_speech_threshold is not None
        and d.no_speech_prob > o.no_speech_threshold
        and not (o.logprob_threshold is not None and d.avg_logprob > o.logprob_threshold)
    )


def cut_segments(tokens: Sequence[int], timestamp_begin: int) -> tuple[list[tuple[int, int, list[int]]], int | None]:
    """A window's tokens cut at each pair of timestamps: (start step, end step, tokens) per
    segment, times in 20 ms steps from the window's start; and the step the next window starts
    at (None: after this window, whose last segment is open, or which has no pair). Tokens with
    no pair of timestamps are one segment (−1, their last timestamp or −1, tokens): the caller
    times it from the window's start to that timestamp, else to the window's end.
    """
    stamp = [t >= timestamp_begin for t in tokens]
    pairs = [i + 1 for i in range(len(tokens) - 1) if stamp[i] and stamp[i + 1]]
    open_end = len(tokens) >= 2 and stamp[-1] and not stamp[-2]  # the last segment ends, no next start
    if not pairs:
        ends = [t - timestamp_begin for t in tokens if t >= timestamp_begin]
        end = ends[-1] if ends and ends[-1] > 0 else None
        return [(-1, -1 if end is None else end, list(tokens))], None
    cuts, out, first = pairs + ([len(tokens)] if open_end else []), [], 0
    for cut in cuts:
        piece = list(tokens[first:cut])
        out.append((piece[0] - timestamp_begin, piece[-1] - timestamp_begin, piece))
        first = cut
    return out, None if open_end else tokens[first - 1] - timestamp_begin


class _Watching(SpeechEncoderDecoderDecoder):
    """The speech decoder over one window's encoder output ``memory`` (1, S, D), read once
    whatever the temperatures and draws decoded from it (as faster-whisper reuses it), starting
    from ``first`` (<|startofprev|> before a prompt), that keeps the probability of
    ``no_speech`` where it has read <|startoftranscript|> (``sot``)."""

    def __init__(
        self, model: SpeechEncoderDecoder, memory: Tensor, *, first: int, sot: int, no_speech: int | None
    ) -> None:
        super().__init__(model)
        self.memory = memory  # (1, S, D)
        self.bos_id, self.sot, self.no_speech = first, sot, no_speech
        self.no_speech_probs: Tensor | None = None  # (N,)

    def read(self, inputs):
        memory = self.memory.expand(len(inputs), -1, -1)  # (N, S, D): every row the same window
        return memory, torch.ones(memory.shape[:2], dtype=torch.bool, device=memory.device)  # (N, S)

    def start(self, inputs):
        logits, state = super().start(inputs)
        self._watch(self.bos_id, logits)
        return logits, state

    def feed(self, state, tokens: Tensor):
        """The forced tokens (N, L) in one call, or two where <|startoftranscript|> is among them
        (after a prompt): the first ends with it, whose logits give the "no speech" probability."""
        row = tokens[0].tolist()
        if self.sot not in row[:-1]:
            logits, state = super().feed(state, tokens)
            self._watch(row[-1], logits)
            return logits, state
        at = row.index(self.sot) + 1
        logits, state = super().feed(state, tokens[:, :at])  # (N, V)
        self._watch(self.sot, logits)
        return super().feed(state, tokens[:, at:])

    def _watch(self, token: int, logits: Tensor) -> None:
        if token == self.sot and self.no_speech is not None:
            self.no_speech_probs = logits.float().softmax(-1)[:, self.no_speech]  # (N,)


class _Chooser:
    """Greedy (temperature 0) or a draw at ``temperature`` from the scores after Whisper's rules;
    keeps each step's log-probability of the chosen tokens (of the rules' distribution)."""

    def __init__(self, temperature: float, generator: torch.Generator) -> None:
        self.temperature, self.generator, self.logps = temperature, generator, []

    def __call__(self, scores: Tensor) -> Tensor:
        logp = torch.log_softmax(scores.float(), dim=-1)  # (N, V)
        if self.temperature == 0:
            tokens = logp.argmax(-1)  # (N,)
        else:
            tokens = torch.multinomial((logp / self.temperature).softmax(-1), 1, generator=self.generator)[:, 0]
        self.logps.append(logp.gather(1, tokens[:, None])[:, 0].tolist())
        return tokens


@torch.no_grad()
def likeliest_language(model: SpeechEncoderDecoder, window: Tensor, sot: int, languages: Sequence[tuple[str, int]]):
    """The (code, token id) of the language the decoder ranks highest right after
    <|startoftranscript|> (``sot``) for one window of features, as Whisper's ``detect_language``.

    Shapes: window (T, M) -> one (code, id).
    """
    device = next(model.parameters()).device
    memory, valid = model.encode(window[None].to(device))  # (1, S, D), (1, S)
    start = torch.full((1, 1), sot, dtype=torch.long, device=memory.device)  # (1, 1)
    logits = model.decode(start, memory, src_mask=valid).logits[0, -1]  # (V,)
    ids = torch.tensor([i for _, i in languages], device=logits.device)  # (languages,)
    return languages[int(logits[ids].argmax())]


def in_language(ids: WhisperTokens, language: tuple[str, int]) -> WhisperTokens:
    """``ids`` with its start tokens' language token replaced by ``language``'s (code, id)."""
    known = {i for _, i in ids.languages}
    return replace(ids, start=tuple(language[1] if t in known else t for t in ids.start))


def decode_window(
    model: SpeechEncoderDecoder,
    tokenizer: Tokenizer,
    window: Tensor,
    prompt: Sequence[int],
    ids: WhisperTokens,
    temperature: float,
    n: int,
    generator: torch.Generator,
    memory: Tensor | None = None,
) -> list[Decoded]:
    """``n`` decodings of one window of features (T, M) after ``prompt`` at ``temperature``;
    ``memory``: the window's encoder output (1, S, D), when it has been read already, or ``n``
    windows' (n, S, D), each decoded once (``longform_batched.py``; ``window`` then only the first)."""
    half = model.config.max_len // 2
    prefix = list(ids.start)
    if prompt and ids.previous is not None:
        prefix = [ids.previous, *list(prompt)[-(half - 1) :], *prefix]
    if memory is None:
        memory, _ = model.encode(window[None])  # (1, S, D)
    decoder = _Watching(model, memory, first=prefix[0], sot=ids.start[0], no_speech=ids.no_speech)
    choose = _Chooser(temperature, generator)
    cap = min(half, model.config.max_len - len(prefix) + 1)
    steps = stream(decoder, [window] * n, max_new_tokens=cap, choose=choose, prefix=prefix, scorers=ids.rules)
    tokens, sums, ended = [[] for _ in range(n)], [0.0] * n, [False] * n
    for k, chosen in enumerate(steps):
        for i, t in enumerate(chosen.tolist()):
            if t == DONE or ended[i]:
                continue
            sums[i] += choose.logps[k][i]
            ended[i] = t == ids.eos
            if not ended[i]:
                tokens[i].append(t)
    no_speech = decoder.no_speech_probs.tolist() if decoder.no_speech_probs is not None else [0.0] * n
    out = []
    for row, total, silence in zip(tokens, sums, no_speech, strict=True):
        text = tokenizer.decode([t for t in row if t < ids.eos]).strip()
        out.append(Decoded(row, total / (len(row) + 1), compression_ratio(text), silence, temperature))
    return out


def with_fallback(
    model, tokenizer, window: Tensor, prompt, ids: WhisperTokens, o: LongForm, generator, memory: Tensor | None = None
) -> tuple[Decoded, Tensor]:
    """A window decoded at each temperature in turn until its result needs no fallback; and the
    window's encoder output (1, S, D) (``memory``, when it has been read already), which its word
    timing reads too."""
    result = None
    if memory is None:
        memory = model.encode(window[None])[0]  # (1, S, D): read once for every temperature
    for temperature in o.temperatures:
        n = o.best_of if temperature > 0 else 1
        found = decode_window(model, tokenizer, window, prompt, ids, temperature, n, generator, memory)
        result = max(found, key=lambda d: d.avg_logprob * (len(d.tokens) + 1) / max(1, len(d.tokens)))
        if not needs_fallback(result, o):
            break
    return result, memory


@torch.no_grad()
def transcribe_long(
    model: SpeechEncoderDecoder,
    tokenizer: Tokenizer,
    wave: Tensor | AudioSource | MelWindows,
    features: FeatureConfig,
    ids: WhisperTokens,
    options: LongForm = LongForm(),
    on_seconds: Callable[[float], None] | None = None,
) -> list[Segment]:
    """The segments of one input (see the module docstring): a waveform (Y,) at
    ``features.sample_rate``, a source (a file read a block at a time) or its features read a
    window at a time (:class:`MelWindows`, with a chunk of zeros after the audio). Memory: one
    window's, whatever the input's length (a waveform's own aside). ``on_seconds(s)`` after
    each window, with the seconds of audio it moved on by.

    Shapes: wave (Y,) -> segments.
    """
    dtype = next(model.parameters()).dtype
    if isinstance(wave, Tensor):
        wave = AudioSource.of_wave(wave, features.sample_rate)
    mel = WhisperFrames(wave, features, pad_seconds=features.chunk_seconds) if isinstance(wave, AudioSource) else wave
    chunk = round(features.chunk_seconds * features.sample_rate) // features.hop_length  # frames a window
    frame_seconds = features.hop_length / features.sample_rate
    content = mel.frames - chunk
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(options.seed)
    seek, context, reset, segments, last_speech = 0, list(options.initial_prompt), 0, [], 0.0
    while seek < content:
        size = min(chunk, content - seek)
        window = torch.nn.functional.pad(mel.window(seek, size), (0, 0, 0, chunk - size)).to(dtype)  # (chunk, M)
        language = likeliest_language(model, window, ids.start[0], ids.languages) if options.multilingual else None
        here = ids if language is None else in_language(ids, language)
        d, memory = with_fallback(model, tokenizer, window, context[reset:], here, options, generator)
        offset = seek * frame_seconds
        moved = size
        if not silent(d, options):
            found, next_step = window_segments(d, offset, size * frame_seconds, here, tokenizer)
            found = found if language is None else [replace(g, language=language[0]) for g in found]
            if next_step is not None:
                moved = max(1, min(size, next_step * FRAMES_PER_STAMP))
            if options.word_timestamps and found:
                found, last_speech = timed_words(
                    model, tokenizer, (window, memory), size, found, offset, last_speech, here
                )
                moved = _after_words(found, d.tokens, ids, seek, frame_seconds, size) or moved
            segments += found
            context += [t for s in found for t in s.tokens]
        if not options.condition_on_previous_text or d.temperature > 0.5:
            reset = len(context)
        seek += moved
        if on_seconds is not None:
            on_seconds(moved * frame_seconds)
    return segments


def timed_words(
    model, tokenizer: Tokenizer, read: tuple[Tensor, Tensor], size: int, found, offset: float, last_speech, ids
):
    """A window's segments with their words timed (``word_timing``; ``read``: the window's
    features (T, M) and its encoder output (1, S, D), not computed again), and where its speech ends."""
    text = [t for s in found for t in s.tokens if t < ids.eos]
    window, memory = read
    words = align_window(
        model,
        window,
        size,
        ids.start,
        text,
        no_timestamps=ids.timestamp_begin - 1,
        heads=ids.alignment_heads,
        decode=tokenizer.decode,
        spaces=ids.spaced,
        memory=memory,
    )
    return fit_words(found, words, offset, last_speech, ids.eos)


def _after_words(found, tokens: Sequence[int], ids: WhisperTokens, seek: int, frame_seconds: float, size: int):
    """The frames the next window moves on by, timed words: to the last word's end, unless the
    window ended with a lone timestamp (then: after it; None) or has no words."""
    ends = [w.end for s in found for w in s.words]
    single = len(tokens) >= 2 and tokens[-1] >= ids.timestamp_begin > tokens[-2]
    if single or not ends or round(ends[-1] / frame_seconds) <= seek:
        return None
    return max(1, min(size, round(ends[-1] / frame_seconds) - seek))


def window_segments(d: Decoded, offset: float, duration: float, ids: WhisperTokens, tokenizer: Tokenizer):
    """A window's segments (empty or instantaneous ones left out) and where the next starts."""
    pieces, next_step = cut_segments(d.tokens, ids.timestamp_begin)
    found = []
    for start, end, tokens in pieces:
        begin = offset if start < 0 else offset + start * TOKEN_SECONDS
        finish = offset + (duration if end < 0 else end * TOKEN_SECONDS)
        text = tokenizer.decode([t for t in tokens if t < ids.eos])
        if finish > begin and text.strip():
            found.append(
                Segment(
                    begin,
                    finish,
                    text,
                    tuple(tokens),
                    d.temperature,
                    d.avg_logprob,
                    d.compression_ratio,
                    d.no_speech_prob,
                )
            )
    return found, next_step
