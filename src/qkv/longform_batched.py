"""Whisper on audio of any length in batches, as faster-whisper's ``BatchedInferencePipeline``.

Voice activity (``vad.py``: the energy detector, or Silero VAD) finds the speech; its pieces are
merged, in order, into chunks of at most one window (30 s) each, the silence between two pieces
of a chunk kept (faster-whisper joins the pieces' samples and maps times back; kept, the silence
is what the model heard between the words, and a chunk's times are its window's plus its start).
The chunks are read ``batch_size`` at a time: their features padded to the window, the encoder
run once on the batch and the decoder once on every row (qkv's decoding engine decodes rows
together: ``decoding.stream``), greedily at the first temperature with Whisper's rules, with
timestamps where ``ids.start`` asks for them (without <|notimestamps|>; with it, text alone and
a segment a chunk, as faster-whisper's batched default ``without_timestamps``). A chunk whose
result needs a fallback (``longform.needs_fallback``) is decoded again alone at the next
temperatures; a chunk found silent (``longform.silent``) is left out. No chunk reads the
previous text (the chunks of a batch are decoded at once, none after another's): each starts
from the start tokens, after ``LongForm.initial_prompt`` if there is one, as faster-whisper's
batched mode does. Segments come from each chunk's timestamps and words from its alignment heads
(``LongForm.word_timestamps``), offset by the chunk's start and kept within it.

What is here: :func:`merged_chunks` (pure), :func:`transcribe_batched` (one source's segments).
What is not here: the sequential windows and the pieces they share (``longform.py``), voice
activity (``vad.py``), the library job that chooses between the two (``bundle/transcription.py``).

Shapes use the legend of ``attention.py``: T frames, M mel bins, N rows, S encoder positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from itertools import islice

import torch
from torch import Tensor

from qkv.audio import FeatureConfig, features
from qkv.audio_stream import AudioSource
from qkv.longform import (
    LongForm,
    WhisperTokens,
    decode_window,
    needs_fallback,
    silent,
    timed_words,
    window_segments,
    with_fallback,
)
from qkv.models.speech import SpeechEncoderDecoder
from qkv.subtitles import Segment
from qkv.tokenization import Tokenizer
from qkv.vad import Vad, piece_waves, speech_pieces


def merged_chunks(pieces: Sequence[tuple[int, int]], longest: int) -> list[tuple[int, int]]:
    """Speech pieces ([start, end) samples, in order, none longer than ``longest``) merged in turn
    into chunks spanning at most ``longest`` samples, the gaps between a chunk's pieces included."""
    chunks: list[tuple[int, int]] = []
    for start, end in pieces:
        if chunks and end - chunks[-1][0] <= longest:
            chunks[-1] = (chunks[-1][0], end)
        else:
            chunks.append((start, end))
    return chunks


def _batches(items: Iterator, size: int) -> Iterator[list]:
    """``items`` in lists of ``size`` (the last one shorter)."""
    while batch := list(islice(items, size)):
        yield batch


@torch.no_grad()
def transcribe_batched(
    model: SpeechEncoderDecoder,
    tokenizer: Tokenizer,
    source: AudioSource,
    config: FeatureConfig,
    ids: WhisperTokens,
    options: LongForm | None = None,
    *,
    batch_size: int = 8,
    vad: Vad | None = None,
    on_seconds: Callable[[float], None] | None = None,
) -> list[Segment]:
    """The segments of one source (see the module docstring), its speech chunks decoded
    ``batch_size`` at a time. ``vad``: how speech is found (its ``max_seconds`` capped at the
    window). Memory: one batch of chunks, whatever the source's length. ``on_seconds(s)`` after
    each batch, with the seconds of audio it moved on by (summing to the source's length).
    ``options`` and ``vad``: None, their defaults.

    Shapes: a source of Y samples -> segments.
    """
    rate, options, vad = source.sample_rate, options or LongForm(), vad or Vad()
    vad = replace(vad, max_seconds=min(vad.max_seconds, config.chunk_seconds))
    chunks = merged_chunks(speech_pieces(source, vad), round(vad.max_seconds * rate))
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(options.seed)
    segments, last_speech, done = [], 0.0, 0.0
    for batch in _batches(piece_waves(source, chunks), batch_size):
        found, last_speech = _batch_segments(model, tokenizer, batch, config, ids, options, generator, last_speech)
        segments += found
        if on_seconds is not None:
            on_seconds(batch[-1][1] / rate - done)
        done = batch[-1][1] / rate
    if on_seconds is not None and source.seconds > done:
        on_seconds(source.seconds - done)
    return segments


def _batch_segments(
    model, tokenizer, batch: list[tuple[int, int, Tensor]], config, ids: WhisperTokens, o: LongForm, generator, last
) -> tuple[list[Segment], float]:
    """One batch of chunks ``(start, end, wave)`` decoded (see the module docstring): their
    segments in order, and where the last timed word ends (``last``: before the batch)."""
    parameter = next(model.parameters())
    windows = torch.stack([features(wave, config) for _, _, wave in batch])  # (N, T, M): each padded to the window
    windows = windows.to(device=parameter.device, dtype=parameter.dtype)  # (N, T, M)
    memory = model.encode(windows)[0]  # (N, S, D): one encoder call for the batch
    first = decode_window(
        model, tokenizer, windows[0], o.initial_prompt, ids, o.temperatures[0], len(batch), generator, memory
    )
    rest = replace(o, temperatures=o.temperatures[1:])
    rate, frame = config.sample_rate, config.hop_length / config.sample_rate
    out = []
    for i, ((start, end, _), d) in enumerate(zip(batch, first, strict=True)):
        if needs_fallback(d, o) and rest.temperatures:  # the chunk alone at the later temperatures, its prompt only
            d, _ = with_fallback(
                model, tokenizer, windows[i], o.initial_prompt, ids, rest, generator, memory[i : i + 1]
            )
        if silent(d, o):
            continue
        offset, duration = start / rate, (end - start) / rate
        found, _ = window_segments(d, offset, duration, ids, tokenizer)
        found = [replace(s, end=min(s.end, offset + duration)) for s in found if s.start < offset + duration]
        if o.word_timestamps and found:
            size = round(duration / frame)  # the chunk's frames, before the padding
            found, last = timed_words(model, tokenizer, (windows[i], memory[i : i + 1]), size, found, offset, last, ids)
        out += found
    return out, last
