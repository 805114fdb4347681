"""Audio of any length read a block at a time, and Whisper's log-mel of it a window at a time,
in memory that does not grow with the audio's length.

What is here: :class:`AudioSource` (one input's mono samples at the model's rate, read from
its start in blocks as often as asked: a file, checked once as ``audio.load_audio`` checks it
and resampled block by block with soxr's streaming resampler, or a waveform in memory), and
:class:`WhisperFrames` (``audio.whisper_log_mel`` of a source, frame for frame the same,
computed a chunk of frames at a time: a first pass for the maximum that Whisper's clipping
reads over the whole file, then the chunks a window needs, as windows are asked for in order).

What is not here: the features themselves (``audio.py``: :func:`~qkv.audio.log10_mel` is the
one computation both share), the windows' decoding (``longform.py``), voice activity (``vad.py``).

Memory: a file block (``audio.BLOCK_FRAMES``), the samples of the chunks in use (two chunks of
30 s) and their frames, whatever the length: an hour of 16 kHz audio is 230 MB as float32
samples and 115 MB as 80-bin frames, neither of which is ever held.

Shapes use the legend of ``attention.py``: Y samples, T frames, M mel bins.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from qkv.audio import BLOCK_FRAMES, FeatureConfig, check_audio, log10_mel, mono_blocks, whisper_scaled


@dataclass(frozen=True)
class AudioSource:
    """One input's mono float32 samples at ``sample_rate``, read from the start a block at a time.

    Build one with :meth:`of_file` (the file checked once, nothing kept) or :meth:`of_wave`.
    Attributes: ``path`` (None for a waveform), ``wave`` (None for a file), ``sample_rate``,
    and the file's own ``file_rate`` and ``file_frames`` (as counted).
    """

    path: Path | None
    wave: Tensor | None
    sample_rate: int
    file_rate: int = 0
    file_frames: int = 0

    @staticmethod
    def of_file(
        path: str | Path, sample_rate: int, *, max_seconds: float | None = None, silence_db: float = -80.0
    ) -> AudioSource:
        """A file, checked as ``audio.load_audio`` checks it (a ``UserError`` naming it if bad)."""
        frames, rate = check_audio(path, max_seconds=max_seconds, silence_db=silence_db)
        return AudioSource(Path(path), None, sample_rate, rate, frames)

    @staticmethod
    def of_wave(wave: Tensor | np.ndarray, sample_rate: int) -> AudioSource:
        """A mono waveform (Y,) already at ``sample_rate``."""
        x = torch.as_tensor(wave, dtype=torch.float32)
        if x.dim() != 1:
            raise ValueError(f"expected a mono waveform of shape (Y,), got shape {tuple(x.shape)}")
        return AudioSource(None, x, sample_rate)

    def blocks(self) -> Iterator[np.ndarray]:
        """The samples from the start, as float32 blocks (a file: ``audio.BLOCK_FRAMES`` of its
        frames at a time, resampled as they come)."""
        if self.wave is not None:
            x = self.wave.numpy()
            for first in range(0, len(x), BLOCK_FRAMES):
                yield x[first : first + BLOCK_FRAMES]
            return
        import soundfile
        import soxr

        with soundfile.SoundFile(str(self.path)) as f:
            if f.samplerate == self.sample_rate:
                yield from mono_blocks(f)
                return
            resampler = soxr.ResampleStream(f.samplerate, self.sample_rate, 1, dtype="float32")
            for block in mono_blocks(f):
                yield resampler.resample_chunk(np.ascontiguousarray(block))
            yield resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True)

    @functools.cached_property
    def samples(self) -> int:
        """Y: the samples at ``sample_rate`` (a resampled file: counted in one pass, once)."""
        if self.wave is not None:
            return self.wave.numel()
        if self.file_rate == self.sample_rate:
            return self.file_frames
        return sum(len(b) for b in self.blocks())

    @property
    def seconds(self) -> float:
        """The duration: a file's frames at its own rate (no pass over it), a waveform's samples."""
        return self.file_frames / self.file_rate if self.wave is None else self.samples / self.sample_rate

    def head(self, n: int) -> Tensor:
        """The first ``n`` samples (all of them, if fewer): (min(n, Y),)."""
        taken, count = [], 0
        for block in self.blocks():
            taken.append(block[: n - count])
            count += len(taken[-1])
            if count >= n:
                break
        return torch.from_numpy(np.concatenate(taken).astype(np.float32, copy=False)) if taken else torch.zeros(0)

    def whole(self) -> Tensor:
        """Every sample: (Y,). For a short input; a long one is read by :class:`WhisperFrames`."""
        return self.wave if self.wave is not None else self.head(1 << 62)


class _Samples:
    """x' (a source's samples, then ``pad`` zeros) read forwards: ``get(a, b)`` is x'[a:b], with
    x' reflected at both ends where [a, b) runs past them (as a reflect-padded STFT reads it),
    for any ``a`` not before what :meth:`drop` let go."""

    def __init__(self, blocks: Iterator[np.ndarray], pad: int) -> None:
        self.blocks, self.pad = blocks, pad
        self.buffer, self.base = np.zeros(0, dtype=np.float32), 0
        self.total: int | None = None  # len(x'), once the source's end is read

    def fill(self, b: int) -> None:
        """Read until x'[:b] is in (or x' ends)."""
        pieces = [self.buffer]
        end = self.base + len(self.buffer)
        while self.total is None and end < b:
            block = next(self.blocks, None)
            if block is None:
                pieces.append(np.zeros(self.pad, dtype=np.float32))
                self.total = end + self.pad
            else:
                pieces.append(np.asarray(block, dtype=np.float32))
            end += len(pieces[-1])
        if len(pieces) > 1:
            self.buffer = np.concatenate(pieces)

    def get(self, a: int, b: int) -> Tensor:
        """x'[a:b] (b − a,), reflected past either end."""
        self.fill(b)
        lo, hi = max(a, 0), b if self.total is None else min(b, self.total)
        piece = torch.from_numpy(self.buffer[lo - self.base : hi - self.base])  # (hi − lo,)
        if lo == a and hi == b:
            return piece
        return torch.nn.functional.pad(piece[None, None], (lo - a, b - hi), mode="reflect")[0, 0]

    def drop(self, a: int) -> None:
        """Let go of x'[:a]."""
        if a > self.base:
            self.buffer = self.buffer[a - self.base :].copy()
            self.base = a


class WhisperFrames:
    """``audio.whisper_log_mel(wave, config, pad_seconds=...)`` of a source, computed a chunk of
    frames at a time in the same chunks (so equal to it bit for bit), never all at once.

    ``frames`` (T) and ``peak`` (the maximum of the log10 mel over every frame, which Whisper's
    clipping reads) come from a first pass over the source; :meth:`window` then reads the
    frames a window needs, from a second pass that goes back to the start only when a window
    starts before the one before it.

    Shapes: window -> (count, M).
    """

    def __init__(self, source: AudioSource, config: FeatureConfig, *, pad_seconds: float = 0.0) -> None:
        if config.kind != "whisper":
            raise ValueError(f"WhisperFrames computes Whisper's features, not {config.kind!r}")
        self.source, self.config = source, config
        self.pad = round(pad_seconds * config.sample_rate)
        self.step = max(1, round(config.chunk_seconds * config.sample_rate) // config.hop_length)  # frames a chunk
        reader, peak, k = _Samples(source.blocks(), self.pad), None, 0
        while (log := self._chunk(reader, k)) is not None:
            peak = log.max() if peak is None else torch.maximum(peak, log.max())
            reader.drop(self._start(k + 1))
            k += 1
        if peak is None:
            raise ValueError("the waveform has no frames")
        self.frames, self.peak = reader.total // config.hop_length, peak
        self._reader: _Samples | None = None
        self._chunks: dict[int, Tensor] = {}

    def _start(self, k: int) -> int:
        """Where chunk k's samples start in x' (its first frame's centre, less half a window)."""
        return max(0, k * self.step * self.config.hop_length - self.config.n_fft // 2)

    def _chunk(self, reader: _Samples, k: int) -> Tensor | None:
        """Chunk k's log10 mel frames (t, M), as ``whisper_log_mel`` computes them; None past the end."""
        hop, n_fft, half = self.config.hop_length, self.config.n_fft, self.config.n_fft // 2
        first = k * self.step
        reader.fill(max((first + self.step - 1) * hop + n_fft - half, (first + self.step) * hop))
        frames = None if reader.total is None else reader.total // hop  # known once x' has ended
        if frames is not None and first >= frames:
            return None
        last = first + self.step if frames is None else min(frames, first + self.step)
        return log10_mel(reader.get(first * hop - half, (last - 1) * hop + n_fft - half), self.config)  # (t, M)

    def window(self, first: int, count: int) -> Tensor:
        """Frames [first, first + count) of the features (count, M), scaled as Whisper's are."""
        if first < 0 or count <= 0 or first + count > self.frames:
            raise ValueError(f"frames [{first}, {first + count}) are not within the {self.frames} frames")
        k0, k1 = first // self.step, (first + count - 1) // self.step
        if self._reader is None or self._start(k0) < self._reader.base:  # a window before the last: read again
            self._reader, self._chunks = _Samples(self.source.blocks(), self.pad), {}
        for k in range(k0, k1 + 1):
            if k not in self._chunks:
                self._chunks[k] = self._chunk(self._reader, k)
        log = torch.cat([self._chunks[k] for k in range(k0, k1 + 1)])  # (chunks · step, M)
        self._chunks = {k: v for k, v in self._chunks.items() if k >= k0}
        self._reader.drop(self._start(k0))
        offset = first - k0 * self.step
        return whisper_scaled(log[offset : offset + count], self.peak)  # (count, M)
