"""Voice activity: where a long recording speaks, cut into pieces a speech model can read.

An energy detector with hysteresis: the level of every 10 ms frame (dB of its mean power) is
compared with the loudest frame's; speech starts where a frame rises above ``on_db`` below
that peak and lasts while frames stay above ``off_db`` (Schmitt-trigger hysteresis: a syllable
that dips between the two does not end the speech). Silences shorter than ``min_silence``
are bridged, then speech shorter than ``min_speech`` (a click) is dropped, and each stretch is
widened by ``pad`` at both ends (not into its neighbour) so that quiet onsets and endings are
kept. A stretch longer than ``max_seconds`` is cut at its quietest frame in the second half of
what fits, again until every piece fits. ``detector="silero"`` asks Silero VAD instead (its
ONNX model from the ``silero-vad`` package, run by onnxruntime, 32 ms at a time, with the
package's own rules for the same settings). Why energy is the default: docs/speech.md, "Long
audio for qkv's own models".

What is here: :class:`Vad` (the settings), the pure steps (:func:`frame_levels`,
:func:`hysteresis`, :func:`runs`, :func:`bridge_and_drop`, :func:`widen`, :func:`split_long`),
and :func:`speech_pieces` with :func:`piece_waves` (their samples), and :func:`silero_pieces`,
each over a source read a block at a time (memory: one block and one number per frame, 1.4 MB
an hour of 10 ms frames). What is not here: transcribing the pieces (``bundle/transcription.py``), reading
audio (``audio_stream.py``).

Shapes: Y samples, F frames (of ``hop`` samples).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from qkv.audio_stream import AudioSource
from qkv.errors import UserError

FLOOR_DB = -100.0  # the level of digital silence (a frame's mean power is floored at 1e-10)
DETECTORS = ("energy", "silero")
SILERO_SAMPLES = 512  # what Silero VAD reads at a time at 16 kHz (32 ms)


@dataclass(frozen=True)
class Vad:
    """How long audio is cut by voice activity for a speech model of qkv's own.

    Attributes:
        detector: ``"energy"`` (this module's) or ``"silero"`` (``pip install silero-vad``).
        threshold: Silero only: speech where its probability is above this.
        on_db: speech starts at a frame this many dB below the loudest frame, or louder.
        off_db: speech goes on while frames stay above this (below ``on_db``: hysteresis).
        min_silence: shorter silences (seconds) are bridged: one piece across them.
        min_speech: shorter speech (seconds) is dropped (after bridging).
        pad: seconds added at each end of a piece (not past its neighbour).
        max_seconds: the longest piece: longer speech is cut at its quietest frame.
        hop_seconds: the frames' length (10 ms).
    """

    detector: str = "energy"
    threshold: float = 0.5
    on_db: float = -35.0
    off_db: float = -45.0
    min_silence: float = 0.3
    min_speech: float = 0.1
    pad: float = 0.1
    max_seconds: float = 30.0
    hop_seconds: float = 0.01

    def __post_init__(self) -> None:
        if self.detector not in DETECTORS:
            raise ValueError(f"detector must be one of {', '.join(DETECTORS)}, got {self.detector!r}")
        if not 0 < self.threshold < 1:
            raise ValueError(f"threshold must be a probability in (0, 1), got {self.threshold!r}")
        if not self.off_db <= self.on_db <= 0:
            raise ValueError(f"need off_db <= on_db <= 0, got on_db={self.on_db}, off_db={self.off_db}")
        for name in ("min_silence", "min_speech", "pad"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)!r}")
        if not self.max_seconds > 2 * self.hop_seconds > 0:
            raise ValueError(f"max_seconds {self.max_seconds} must hold more than two frames")


def frame_levels(wave: np.ndarray, hop: int) -> np.ndarray:
    """The level of every whole frame of ``hop`` samples, 10·log10 of its mean power (floored
    at :data:`FLOOR_DB`): (Y,) -> (Y // hop,)."""
    frames = np.asarray(wave, dtype=np.float64)[: len(wave) // hop * hop].reshape(-1, hop)  # (F, hop)
    return 10 * np.log10(np.maximum(np.mean(frames**2, axis=1), 10 ** (FLOOR_DB / 10)))


def hysteresis(levels: np.ndarray, on: float, off: float) -> np.ndarray:
    """Speech frames (F,) bool: from a frame at or above ``on`` while frames stay at or above ``off``."""
    speaking, out = False, np.zeros(len(levels), dtype=bool)
    for i, level in enumerate(levels.tolist()):
        speaking = level >= on or (speaking and level >= off)
        out[i] = speaking
    return out


def runs(active: np.ndarray) -> list[tuple[int, int]]:
    """The [start, end) frames of each run of True."""
    edges = np.diff(np.concatenate([[0], active.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist(), strict=True))


def bridge_and_drop(stretches: list[tuple[int, int]], min_gap: int, min_length: int) -> list[tuple[int, int]]:
    """Join stretches less than ``min_gap`` frames apart, then drop those shorter than ``min_length``."""
    joined: list[tuple[int, int]] = []
    for start, end in stretches:
        if joined and start - joined[-1][1] < min_gap:
            joined[-1] = (joined[-1][0], end)
        else:
            joined.append((start, end))
    return [(s, e) for s, e in joined if e - s >= min_length]


def widen(stretches: list[tuple[int, int]], pad: int, frames: int) -> list[tuple[int, int]]:
    """Each stretch ``pad`` frames longer at both ends, within [0, frames), never into its
    neighbours (the gap between two is shared at its middle)."""
    out = []
    for i, (start, end) in enumerate(stretches):
        before = 0 if i == 0 else (stretches[i - 1][1] + start + 1) // 2
        after = frames if i == len(stretches) - 1 else (end + stretches[i + 1][0]) // 2
        out.append((max(start - pad, before), min(end + pad, after)))
    return out


def split_long(stretches: list[tuple[int, int]], levels: np.ndarray, longest: int) -> list[tuple[int, int]]:
    """Stretches longer than ``longest`` frames cut at their quietest frame between half of
    ``longest`` and ``longest`` from where the piece starts, until every piece fits."""
    out = []
    for start, end in stretches:
        while end - start > longest:
            lo = start + longest // 2
            cut = lo + int(np.argmin(levels[lo : start + longest]))
            out.append((start, cut))
            start = cut
        out.append((start, end))
    return out


def levels_of(source: AudioSource, hop: int) -> tuple[np.ndarray, int]:
    """:func:`frame_levels` of a source read a block at a time, (Y // hop,), and Y."""
    parts, carry, count = [], np.zeros(0, dtype=np.float32), 0
    for block in source.blocks():
        x = np.concatenate([carry, block])
        whole = len(x) // hop * hop
        parts.append(frame_levels(x[:whole], hop))
        carry, count = x[whole:], count + len(block)
    return (np.concatenate(parts) if parts else np.zeros(0)), count


def speech_pieces(source: AudioSource, vad: Vad = Vad()) -> list[tuple[int, int]]:
    """The pieces of a source to transcribe, as [start, end) samples, in order (see the module
    docstring); none for a silent source."""
    if vad.detector == "silero":
        return silero_pieces(source, vad)
    hop = max(1, round(vad.hop_seconds * source.sample_rate))
    levels, total = levels_of(source, hop)  # (F,), Y
    if not len(levels) or levels.max() <= FLOOR_DB:
        return []
    peak = float(levels.max())
    active = hysteresis(levels, peak + vad.on_db, peak + vad.off_db)

    def frames(seconds: float) -> int:
        return round(seconds / vad.hop_seconds)

    stretches = bridge_and_drop(runs(active), frames(vad.min_silence), frames(vad.min_speech))
    stretches = split_long(widen(stretches, frames(vad.pad), len(levels)), levels, frames(vad.max_seconds))
    return [(s * hop, total if e == len(levels) else e * hop) for s, e in stretches]


def piece_waves(source: AudioSource, pieces: list[tuple[int, int]]) -> Iterator[tuple[int, int, Tensor]]:
    """Each piece's samples, ``(start, end, wave (end − start,))``, in one pass over the source
    (``pieces`` in order, not overlapping, as :func:`speech_pieces` gives them)."""
    buffer, base, todo = np.zeros(0, dtype=np.float32), 0, list(pieces)
    blocks = source.blocks()
    while todo:
        start, end = todo[0]
        if base + len(buffer) < end:
            block = next(blocks, None)
            if block is not None:  # the samples before the piece dropped: at most those held
                drop = min(len(buffer), max(0, start - base))
                buffer, base = np.concatenate([buffer[drop:], block]), base + drop
                continue
        todo.pop(0)
        yield start, end, torch.from_numpy(buffer[start - base : end - base].copy())


def silero_pieces(source: AudioSource, vad: Vad = Vad(detector="silero")) -> list[tuple[int, int]]:
    """Silero VAD's pieces of a 16 kHz source, [start, end) samples: its speech probability of
    every 512 samples (the last zero-padded), read a block at a time as the package's
    ``get_speech_timestamps`` reads a waveform, then the package's own rules
    (``get_speech_timestamps_from_probs``) with ``vad``'s threshold, durations and longest piece."""
    if source.sample_rate != 16000:
        raise UserError(f"Silero VAD reads 16 kHz audio; the model reads {source.sample_rate} Hz (use the energy VAD)")
    from silero_vad import get_speech_timestamps_from_probs

    model = _silero_model()
    model.reset_states()
    probs, carry, count = [], np.zeros(0, dtype=np.float32), 0
    for block in source.blocks():
        x = np.concatenate([carry, block])
        whole = len(x) // SILERO_SAMPLES * SILERO_SAMPLES
        probs += [
            model(torch.from_numpy(x[i : i + SILERO_SAMPLES]), 16000).item() for i in range(0, whole, SILERO_SAMPLES)
        ]
        carry, count = x[whole:], count + len(block)
    if len(carry):
        probs.append(model(torch.from_numpy(np.pad(carry, (0, SILERO_SAMPLES - len(carry)))), 16000).item())
    stamps = get_speech_timestamps_from_probs(
        probs,
        sampling_rate=16000,
        threshold=vad.threshold,
        min_speech_duration_ms=round(1000 * vad.min_speech),
        max_speech_duration_s=vad.max_seconds,
        min_silence_duration_ms=round(1000 * vad.min_silence),
        speech_pad_ms=round(1000 * vad.pad),
        audio_length_samples=count,
    )
    return [(int(s["start"]), int(s["end"])) for s in stamps]


def _silero_model():
    """Silero's ONNX model (``silero_vad.load_silero_vad(onnx=True)``). Importing the package sets
    torch's threads to 1 for the whole process; the caller's setting is put back."""
    threads = torch.get_num_threads()
    try:
        from silero_vad import load_silero_vad
    except ImportError:
        raise UserError("Silero VAD needs its package: pip install silero-vad (or use the energy VAD)") from None
    finally:
        torch.set_num_threads(threads)
    return load_silero_vad(onnx=True)
