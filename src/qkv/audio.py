"""Audio front-end for speech recognition: audio files in, log-mel feature frames out.

What is here:
  * reading WAV / FLAC / OGG at any sample rate with ``soundfile``, mixing to mono and
    resampling with ``soxr`` (:func:`load_audio`, :func:`load_many`), in blocks checked as they
    are read (:data:`BLOCK_FRAMES`); a file that cannot be
    read, holds no samples, is silent or is too long is refused with a one-line
    :class:`~qkv.errors.UserError` naming it, and a batch either stops at the first bad file
    or (``skip_bad=True``) names every bad one and goes on with the rest;
  * :class:`FeatureConfig`, the frozen settings of the features (saved as a plain dict in a
    model directory's ``config.json``), and :func:`features` / :func:`batch_features`, which
    those settings fully determine. Two kinds:
      - ``"logmel"``: natural-log mel power spectrogram (25 ms Hann window, 10 ms hop, 80 mel
        bins at 16 kHz by default), equal to ``librosa.feature.melspectrogram`` with
        ``center=True, pad_mode="constant"`` followed by ``log``;
      - ``"whisper"``: Whisper's log-mel (Radford et al., 2022): 30 s padding/trimming,
        ``log10``, clipping at max − 8, then ``(x + 4) / 4``, equal to
        ``transformers.WhisperFeatureExtractor``;
  * the Slaney mel scale and filterbank (:func:`hz_to_mel`, :func:`mel_to_hz`,
    :func:`mel_filterbank`), written here in torch (no torchaudio);
  * utterance mean/variance normalisation over valid frames (:func:`cmvn`), SpecAugment for
    training (:func:`spec_augment`, reproducible through a ``torch.Generator``), and padding
    of feature sequences into a batch with its boolean ``valid`` mask (:func:`pad_features`;
    True = a real frame, qkv's one mask convention: True = may attend).

Everything is a pure function: no parameters, no ``nn.Module``, nothing happens at import.

What is not here: models that consume the features (a convolutional subsampler, an encoder),
CTC or other speech losses, tokenizers, data sets and their manifests, features read a window
at a time from a file (``audio_stream.py``), voice-activity detection (``vad.py``), dithering, pre-emphasis, MFCCs.

References: Slaney (1998), Auditory Toolbox v2, Interval Research tech. report 1998-010 (mel
scale and filter normalisation); Park et al. (2019), SpecAugment, arXiv:1904.08779; Radford et
al. (2022), Robust Speech Recognition via Large-Scale Weak Supervision (Whisper), arXiv:2212.04356.

Shapes use the legend of ``attention.py``: B batch, Y samples of a mono waveform, T frames,
M mel bins (n_mels), E STFT frequency bins (n_fft // 2 + 1).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from qkv.errors import UserError

SAMPLE_RATE = 16_000  # what speech models are trained at; load_audio resamples to it by default
KINDS = ("logmel", "whisper")
LOG_FLOOR = 1e-10  # mel power is clamped to this before the log (Whisper's floor)


# ---------------------------------------------------------------------------------------------
# Reading audio files
# ---------------------------------------------------------------------------------------------


class _BadFile(Exception):
    """Why one file was refused (the reason only; the caller prefixes the path)."""


def load_audio(
    path: str | Path,
    *,
    sample_rate: int = SAMPLE_RATE,
    max_seconds: float | None = 60.0,
    silence_db: float = -80.0,
) -> Tensor:
    """Read one audio file as a mono float32 waveform at ``sample_rate``: shape (Y,).

    Any format and rate ``soundfile`` reads (WAV, FLAC, OGG/Vorbis, ...); channels are averaged,
    then the signal is resampled with ``soxr`` (its default high quality). Refused with
    ``UserError("<path>: <what is wrong>")``: a missing or unreadable file, one with no samples,
    one longer than ``max_seconds`` (None: no limit), one with non-finite samples, and a silent
    one, whose peak after mixing is at or below ``silence_db`` dB full scale (−80 dBFS: a few
    16-bit steps; an all-zero file always counts as silent).
    """
    try:
        return _load(Path(path), sample_rate, max_seconds, silence_db)
    except _BadFile as bad:
        raise UserError(f"{path}: {bad}") from None


def load_many(
    paths: Iterable[str | Path],
    *,
    sample_rate: int = SAMPLE_RATE,
    max_seconds: float | None = 60.0,
    silence_db: float = -80.0,
    skip_bad: bool = False,
) -> tuple[list[tuple[Path, Tensor]], list[tuple[Path, str]]]:
    """Read many files as :func:`load_audio` does: ``(good, bad)``.

    ``good`` holds ``(path, waveform (Y,))`` in input order. Without ``skip_bad`` the first bad
    file raises its UserError (``bad`` is then always empty); with it, every bad file is
    listed in ``bad`` as ``(path, reason)`` and the rest are read, so a batch job can name all
    of them at once and go on only when asked to.
    """
    good: list[tuple[Path, Tensor]] = []
    bad: list[tuple[Path, str]] = []
    for p in paths:
        path = Path(p)
        try:
            good.append((path, _load(path, sample_rate, max_seconds, silence_db)))
        except _BadFile as reason:
            if not skip_bad:
                raise UserError(f"{path}: {reason}") from None
            bad.append((path, str(reason)))
    return good, bad


# A file is read this many frames at a time, each block checked as it comes: a file that is too
# long, holds a NaN or is silent is refused having held one block, not the whole file.
BLOCK_FRAMES = 1 << 16
# The mono blocks of one pass are kept up to this many bytes (about 8 minutes at 16 kHz); a longer
# file that passes the checks is read a second time into one array of its length.
KEEP_BYTES = 32 * 2**20


def _exists(path: Path) -> None:
    """A ``_BadFile`` unless ``path`` is a file with bytes in it."""
    if not path.exists():
        raise _BadFile("no such file")
    if not path.is_file():
        raise _BadFile("not a file")
    if path.stat().st_size == 0:
        raise _BadFile("empty file (0 bytes)")


def _load(path: Path, sample_rate: int, max_seconds: float | None, silence_db: float) -> Tensor:
    import soxr

    _exists(path)
    mono, rate = _read_mono(path, max_seconds, silence_db)  # (Y,) at the file's rate
    if rate != sample_rate:
        mono = soxr.resample(mono, rate, sample_rate)  # (Y',) float32
    return torch.from_numpy(np.ascontiguousarray(mono, dtype=np.float32))


def check_audio(path: str | Path, *, max_seconds: float | None = None, silence_db: float = -80.0) -> tuple[int, int]:
    """Check one audio file as :func:`load_audio` does, keeping none of its samples: its frames
    (as counted, at its own rate) and its rate; the same one-line ``UserError`` for a bad file.
    Memory: one block (:data:`BLOCK_FRAMES`), whatever the file's length."""
    try:
        return _check(Path(path), max_seconds, silence_db)
    except _BadFile as bad:
        raise UserError(f"{path}: {bad}") from None


def check_many(
    paths: Iterable[str | Path], *, max_seconds: float | None = None, silence_db: float = -80.0
) -> tuple[list[tuple[Path, int, int]], list[tuple[Path, str]]]:
    """:func:`check_audio` of many files, never raising: ``(good, bad)``, good as ``(path,
    frames, rate)`` in input order, bad as ``(path, reason)``."""
    good: list[tuple[Path, int, int]] = []
    bad: list[tuple[Path, str]] = []
    for p in paths:
        try:
            good.append((Path(p), *_check(Path(p), max_seconds, silence_db)))
        except _BadFile as reason:
            bad.append((Path(p), str(reason)))
    return good, bad


def _check(path: Path, max_seconds: float | None, silence_db: float) -> tuple[int, int]:
    import soundfile

    _exists(path)
    try:
        with soundfile.SoundFile(str(path)) as f:
            rate = f.samplerate
            if f.frames == 0 or rate <= 0:
                raise _BadFile("no audio in it (0 samples)")
            _check_length(f.frames, rate, max_seconds)
            _, count, peak = _scan(f, rate, max_seconds, keep=False)
    except soundfile.SoundFileError as err:
        reason = getattr(err, "error_string", "") or str(err)
        raise _BadFile(f"not readable as audio ({reason.rstrip('.')})") from None
    if count == 0:
        raise _BadFile("no audio in it (0 samples)")
    _check_silence(peak, silence_db)
    return count, rate


def _read_mono(path: Path, max_seconds: float | None, silence_db: float) -> tuple[np.ndarray, int]:
    """The file's samples mixed to mono (Y,), and its rate: read in blocks of
    :data:`BLOCK_FRAMES`, each checked (length against ``max_seconds`` as counted, not only as
    the header says; finite samples) as it is read; silence (peak at or below ``silence_db``)
    once all are. Memory: the blocks up to :data:`KEEP_BYTES`, else one array of the length."""
    import soundfile  # imported on use: reading audio is the only thing that needs libsndfile

    try:
        with soundfile.SoundFile(str(path)) as f:
            rate = f.samplerate
            if f.frames == 0 or rate <= 0:
                raise _BadFile("no audio in it (0 samples)")
            _check_length(f.frames, rate, max_seconds)  # the header's word, before reading any
            kept, count, peak = _scan(f, rate, max_seconds)
            if count == 0:
                raise _BadFile("no audio in it (0 samples)")
            _check_silence(peak, silence_db)
            return (np.concatenate(kept) if kept is not None else _reread(f, count)), rate
    except soundfile.SoundFileError as err:
        reason = getattr(err, "error_string", "") or str(err)
        raise _BadFile(f"not readable as audio ({reason.rstrip('.')})") from None


def _scan(f, rate: int, max_seconds: float | None, *, keep: bool = True) -> tuple[list[np.ndarray] | None, int, float]:
    """One pass over an open file's mono blocks, each checked as it comes (its length as counted,
    since a header may understate; finite samples): the blocks while they stay within
    :data:`KEEP_BYTES` (else None), the samples counted, and their peak magnitude."""
    kept: list[np.ndarray] | None = [] if keep else None
    count, peak = 0, 0.0
    for block in mono_blocks(f):
        count += len(block)
        _check_length(count, rate, max_seconds)
        if not np.isfinite(block).all():
            raise _BadFile("holds non-finite samples (NaN or infinity)")
        peak = max(peak, float(np.abs(block).max()))
        if kept is not None:
            kept.append(block)
            kept = kept if count * 4 <= KEEP_BYTES else None  # float32: 4 bytes a sample
    return kept, count, peak


def _reread(f, count: int) -> np.ndarray:
    """An open file's ``count`` mono samples, read again from its start into one array (Y,)."""
    f.seek(0)
    whole = np.empty(count, dtype=np.float32)  # (Y,)
    at = 0
    for block in mono_blocks(f):
        n = min(len(block), count - at)
        whole[at : at + n] = block[:n]
        at += n
    return whole[:at]


def mono_blocks(f) -> Iterable[np.ndarray]:
    """An open ``soundfile.SoundFile``'s samples from where it stands, as mono float32 blocks
    (channels averaged), until the data ends (whatever its header said)."""
    while True:
        block = f.read(BLOCK_FRAMES, dtype="float32", always_2d=True)  # (n, channels)
        if len(block) == 0:
            return
        yield block.mean(axis=1, dtype=np.float32) if block.shape[1] > 1 else block[:, 0]


def _check_length(frames: int, rate: int, max_seconds: float | None) -> None:
    seconds = frames / rate
    if max_seconds is not None and seconds > max_seconds:
        raise _BadFile(f"{seconds:.1f} s long, over the limit of {max_seconds:g} s")


def _check_silence(peak: float, silence_db: float) -> None:
    if peak <= 10.0 ** (silence_db / 20.0):
        level = "every sample is zero" if peak == 0.0 else f"peak {20 * math.log10(peak):.1f} dBFS"
        raise _BadFile(f"silent ({level})")


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FeatureConfig:
    """Everything that determines the features of a waveform.

    Attributes:
        kind: ``"logmel"`` (natural log of the mel power spectrogram) or ``"whisper"``
            (Whisper's scaled log10 mel over a fixed ``chunk_seconds`` window).
        sample_rate: the rate waveforms must have (Hz); :func:`load_audio` resamples to it.
        n_mels: mel bins (M): 80, or 128 for Whisper large-v3.
        n_fft: FFT size; E = n_fft // 2 + 1 frequency bins.
        win_length: Hann window length (≤ n_fft; centred in the FFT frame when shorter).
        hop_length: samples between frame starts.
        f_min, f_max: the band the mel filters cover (Hz); f_max None = sample_rate / 2.
        normalize: utterance mean/variance normalisation (:func:`cmvn`) of every mel bin.
        chunk_seconds: Whisper only: every waveform is zero-padded or trimmed to this length.
        floor: logmel only: the mel power is clamped to this before the log. 1e-10 (Whisper's
            floor) keeps everything; a synthesis model's targets do better with 1e-6 (60 dB
            under a full-scale tone): espeak-ng's digital silence otherwise puts a seventh of
            all values at ln 1e-10 ≈ −23, a cliff the frame loss spends itself on, far below
            anything audible (Whisper's features fix theirs at 1e-10 and refuse another).

    At 16 kHz the defaults are a 25 ms window and a 10 ms hop. :meth:`to_dict` writes every
    field, so a saved config never depends on these defaults.
    """

    kind: str = "logmel"
    sample_rate: int = SAMPLE_RATE
    n_mels: int = 80
    n_fft: int = 400
    win_length: int = 400
    hop_length: int = 160
    f_min: float = 0.0
    f_max: float | None = None
    normalize: bool = False
    chunk_seconds: float = 30.0
    floor: float = LOG_FLOOR

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in ("sample_rate", "n_mels", "n_fft", "win_length", "hop_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        for name in ("f_min", "f_max", "chunk_seconds", "floor"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.floor is None or not 0 < self.floor < 1:
            raise ValueError(f"floor must be a mel power between 0 and 1, got {self.floor!r}")
        if self.win_length > self.n_fft:
            raise ValueError(f"win_length {self.win_length} is longer than n_fft {self.n_fft}")
        top = self.sample_rate / 2 if self.f_max is None else self.f_max
        if not 0 <= self.f_min < top <= self.sample_rate / 2:
            raise ValueError(f"need 0 <= f_min < f_max <= sample_rate / 2, got f_min={self.f_min}, f_max={top}")
        if self.kind == "whisper":
            if self.floor != LOG_FLOOR:
                raise ValueError(f"whisper features fix their floor at {LOG_FLOOR:g}, got floor {self.floor!r}")
            if self.win_length != self.n_fft:
                raise ValueError("whisper features need win_length == n_fft")
            if not self.chunk_seconds > 0 or self.chunk_seconds * self.sample_rate < self.n_fft:
                raise ValueError(f"chunk_seconds {self.chunk_seconds} is too short for one frame")

    @staticmethod
    def of(value: FeatureConfig | dict) -> FeatureConfig:
        """``value`` itself, or the config its dict (as a model's ``config.json`` holds it)
        describes; a ValueError naming unknown settings or another type (a model config's
        ``features`` field is read through here)."""
        if isinstance(value, dict):
            known = {f.name for f in dataclasses.fields(FeatureConfig)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(
                    f"features: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
                )
            return FeatureConfig(**value)
        if not isinstance(value, FeatureConfig):
            raise ValueError(f"features must be a FeatureConfig or its dict, got {type(value).__name__}")
        return value

    @staticmethod
    def whisper(n_mels: int = 80) -> FeatureConfig:
        """Whisper's settings: 16 kHz, n_fft 400, hop 160, 30 s chunks; 80 mel bins (128 for large-v3)."""
        return FeatureConfig(kind="whisper", n_mels=n_mels, n_fft=400, win_length=400, hop_length=160)

    @property
    def n_freqs(self) -> int:
        """E: the STFT's frequency bins."""
        return self.n_fft // 2 + 1

    def frames(self, samples: int) -> int:
        """T: how many frames :func:`features` gives for a waveform of ``samples`` samples."""
        if self.kind == "whisper":
            return round(self.chunk_seconds * self.sample_rate) // self.hop_length
        return 1 + samples // self.hop_length

    def to_dict(self) -> dict:
        """Every field as plain JSON values."""
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(data: dict) -> FeatureConfig:
        """The config a :meth:`to_dict` dict describes; UserError for unknown keys or bad values.

        Missing keys take the defaults (a hand-written recipe may give only what it changes).
        """
        if not isinstance(data, dict):
            raise UserError(f"feature config: expected a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(FeatureConfig)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise UserError(f"feature config: unknown setting(s) {', '.join(unknown)}")
        try:
            return FeatureConfig(**data)
        except ValueError as err:
            raise UserError(f"feature config: {err}") from None


# ---------------------------------------------------------------------------------------------
# The mel scale and filterbank (Slaney, 1998, Auditory Toolbox; librosa's htk=False, norm="slaney")
# ---------------------------------------------------------------------------------------------

_MEL_BREAK_HZ = 1000.0  # linear below, logarithmic above
_MEL_HZ_PER_MEL = 200.0 / 3  # linear part: mel = f / (200/3), so 1 kHz is 15 mel
_MEL_BREAK = _MEL_BREAK_HZ / _MEL_HZ_PER_MEL  # 15 mel
_MEL_LOG_STEP = math.log(6.4) / 27.0  # log part: 27 mel per factor 6.4 in frequency


def hz_to_mel(hz: Tensor) -> Tensor:
    """Slaney's mel scale: m = f / (200/3) below 1 kHz, m = 15 + ln(f / 1000) / (ln 6.4 / 27) above."""
    linear = hz / _MEL_HZ_PER_MEL
    log = _MEL_BREAK + torch.log(hz.clamp(min=_MEL_BREAK_HZ) / _MEL_BREAK_HZ) / _MEL_LOG_STEP
    return torch.where(hz >= _MEL_BREAK_HZ, log, linear)


def mel_to_hz(mel: Tensor) -> Tensor:
    """The inverse of :func:`hz_to_mel`."""
    linear = mel * _MEL_HZ_PER_MEL
    log = _MEL_BREAK_HZ * torch.exp(_MEL_LOG_STEP * (mel.clamp(min=_MEL_BREAK) - _MEL_BREAK))
    return torch.where(mel >= _MEL_BREAK, log, linear)


def mel_filterbank(
    n_mels: int, n_fft: int, sample_rate: int, *, f_min: float = 0.0, f_max: float | None = None
) -> Tensor:
    """Slaney-normalised triangular mel filters: (E, M) float32, power spectrum @ filters = mel.

    M + 2 points equally spaced on the mel scale between f_min and f_max give M triangles:
    filter m rises linearly from point m to point m+1 and falls to zero at point m+2, sampled
    at the FFT bin frequencies k·sr/n_fft. Each triangle is then scaled by 2 / (f_{m+2} − f_m)
    so that every filter has the same area ("slaney" normalisation, constant energy per band).
    Computed in float64, as librosa and transformers compute theirs, then cast.
    """
    f_max = sample_rate / 2 if f_max is None else f_max
    edges = torch.tensor([f_min, f_max], dtype=torch.float64)
    lo, hi = hz_to_mel(edges).tolist()
    points = mel_to_hz(torch.linspace(lo, hi, n_mels + 2, dtype=torch.float64))  # (M+2,) Hz
    bins = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)  # (E,) Hz
    widths = points.diff()  # (M+1,)
    offsets = points[None, :] - bins[:, None]  # (E, M+2): point minus bin frequency
    rising = -offsets[:, :-2] / widths[:-1]  # (E, M): (f - f_m) / (f_{m+1} - f_m)
    falling = offsets[:, 2:] / widths[1:]  # (E, M): (f_{m+2} - f) / (f_{m+2} - f_{m+1})
    weights = torch.minimum(rising, falling).clamp(min=0.0)  # (E, M)
    weights = weights * (2.0 / (points[2:] - points[:-2]))  # Slaney area normalisation
    return weights.to(torch.float32)


@functools.lru_cache(maxsize=16)
def _cached_filterbank(n_mels: int, n_fft: int, sample_rate: int, f_min: float, f_max: float | None) -> Tensor:
    return mel_filterbank(n_mels, n_fft, sample_rate, f_min=f_min, f_max=f_max)  # (E, M); never written to


@functools.lru_cache(maxsize=16)
def analysis_window(win_length: int) -> Tensor:
    """The STFT's window: the periodic Hann, librosa's "hann" (win_length,). Cached: never written to."""
    return torch.hann_window(win_length, periodic=True)


# ---------------------------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------------------------


def features(waveform: Tensor | np.ndarray, config: FeatureConfig) -> Tensor:
    """The features of one mono waveform (Y,) at ``config.sample_rate``: (T, M) float32.

    T = 1 + Y // hop_length for ``"logmel"``; chunk_seconds · sample_rate // hop_length
    (3,000) for ``"whisper"``. The same as row 0 of :func:`batch_features` on a batch of one.
    """
    x = _as_waveform(waveform)  # (Y,)
    feats = _compute(x[None], config)[0]  # (T, M)
    return cmvn(feats) if config.normalize else feats


def batch_features(waveforms: Sequence[Tensor | np.ndarray], config: FeatureConfig) -> tuple[Tensor, Tensor]:
    """The features of several waveforms in one STFT: ``(feats (B, T, M), valid (B, T))``.

    Row b's first ``valid[b].sum()`` frames are :func:`features` of waveform b (the log-mel
    STFT pads with zeros, so the batch's zero padding changes no real frame); padding frames
    are 0. Whisper features all have the same length and every frame is valid.
    """
    if not waveforms:
        raise ValueError("batch_features needs at least one waveform")
    xs = [_as_waveform(w) for w in waveforms]  # each (N_b,)
    device = xs[0].device
    if config.kind == "whisper":
        feats = _compute(torch.nn.utils.rnn.pad_sequence(xs, batch_first=True), config)  # (B, T, M)
        valid = torch.ones(feats.shape[:2], dtype=torch.bool, device=device)  # (B, T)
        return (cmvn(feats) if config.normalize else feats), valid
    feats = _compute(torch.nn.utils.rnn.pad_sequence(xs, batch_first=True), config)  # (B, T, M)
    frames = torch.tensor([config.frames(x.numel()) for x in xs], device=device)  # (B,)
    valid = torch.arange(feats.shape[1], device=device)[None, :] < frames[:, None]  # (B, T)
    if config.normalize:
        return cmvn(feats, valid), valid  # cmvn zeroes padding frames
    return feats.masked_fill_(~valid[..., None], 0.0), valid


def _compute(batch: Tensor, c: FeatureConfig) -> Tensor:
    """Features of zero-padded waveforms, before normalisation: (B, Y) -> (B, T, M)."""
    if c.kind == "whisper":
        n = round(c.chunk_seconds * c.sample_rate)  # every waveform is zero-padded or trimmed to the chunk
        batch = torch.nn.functional.pad(batch[:, :n], (0, max(0, n - batch.shape[1])))  # (B, n)
        return _whisper(batch, c)
    return _logmel(batch, c)


def _as_waveform(waveform: Tensor | np.ndarray) -> Tensor:
    x = torch.as_tensor(waveform)
    if x.dim() != 1:
        raise ValueError(f"expected a mono waveform of shape (N,), got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError("the waveform has no samples")
    return x.to(torch.float32)


def centred_stft(batch: Tensor, c: FeatureConfig, *, pad_mode: str = "constant") -> Tensor:
    """The centred STFT of the features and of :mod:`qkv.vocoder`: (B, Y) -> (B, E, T) complex.

    Frame t is centred on sample t·hop: the signal is padded by n_fft // 2 on both sides first
    (here rather than by ``torch.stft(center=True)``, whose zero padding is several times slower
    than the transform itself on CPU); "constant" pads with zeros, librosa's default.
    """
    window = analysis_window(c.win_length).to(batch.device)  # (win_length,)
    half = c.n_fft // 2
    padded = torch.nn.functional.pad(batch[:, None], (half, half), mode=pad_mode)[:, 0]  # (B, Y + 2·half)
    return torch.stft(  # (B, E, T)
        padded,
        c.n_fft,
        hop_length=c.hop_length,
        win_length=c.win_length,
        window=window,
        center=False,
        return_complex=True,
    )


def _filters(c: FeatureConfig, device: torch.device) -> Tensor:
    """The mel filters (E, M) on ``device``."""
    return _cached_filterbank(c.n_mels, c.n_fft, c.sample_rate, float(c.f_min), c.f_max).to(device)


def _power(spec: Tensor) -> Tensor:
    """|X|² = re² + im², frames first: (B, E, T) complex -> (B, T, E).

    torch.stft lays its output out frame by frame, so the transposed view is the contiguous
    one; squaring the parts is several times faster than ``abs() ** 2`` (no square root).
    """
    frames = spec.transpose(1, 2)  # (B, T, E)
    return frames.real.square() + frames.imag.square()


def _logmel(batch: Tensor, c: FeatureConfig) -> Tensor:
    """ln(mel power) with zero padding at both ends, as librosa's default: (B, Y) -> (B, T, M)."""
    power = _power(centred_stft(batch, c))  # (B, T, E)
    fb = _filters(c, batch.device)  # (E, M)
    mel = (power.reshape(-1, power.shape[-1]) @ fb).view(*power.shape[:2], -1)  # (B, T, M): one GEMM
    return mel.clamp_(min=c.floor).log_()


def _whisper(batch: Tensor, c: FeatureConfig) -> Tensor:
    """Whisper's log-mel (Radford et al., 2022, section 2.2; openai/whisper audio.py): (B, Y) -> (B, T, M).

    Reflect-padded centred STFT, the last frame dropped (T = Y // hop), log10 of the mel power
    floored at 1e-10, each utterance clipped to at most 8 below its maximum (a dynamic range of
    80 dB), then scaled by (x + 4) / 4 to lie roughly in [-1, 1].
    """
    frames = batch.shape[1] // c.hop_length  # T
    heard = _heard(batch, c)
    spec = centred_stft(batch[:, :heard], c, pad_mode="reflect")[..., :frames]  # (B, E, T'), T' ≤ T
    mel = _power(spec) @ _filters(c, batch.device)  # (B, T', M)
    mel = torch.nn.functional.pad(mel, (0, 0, 0, frames - mel.shape[1]))  # (B, T, M): the silent frames' zeros
    log = mel.clamp(min=LOG_FLOOR).log10()
    peak = log.amax(dim=(1, 2), keepdim=True)  # (B, 1, 1)
    log = torch.maximum(log, peak - 8.0)
    return (log + 4.0) / 4.0


def _heard(batch: Tensor, c: FeatureConfig) -> int:
    """How many of the samples of ``batch`` the frames that read any non-zero sample need.

    Whisper pads every input to 30 s with zeros, so a 1-s file's frames are nearly all of zeros
    alone: their power is exactly 0 (the FFT of zeros), so :func:`_whisper` computes the STFT of
    the first samples only and gives the rest 0 power, skipping 29/30 of a 1-s file's STFT (the
    reflect padding of the shortened signal's end reflects zeros too: ``n_fft`` zeros are kept
    after the last non-zero sample, more than the ``n_fft // 2`` it reflects). The same frames as
    the whole STFT's up to float rounding (tested).

    Shapes: batch (B, Y) -> an int ≤ Y.
    """
    loud = batch.ne(0).any(dim=0).nonzero()  # (P, 1) the samples non-zero in some row
    last = int(loud[-1]) if loud.numel() else -1
    hop = c.hop_length
    return min(batch.shape[1], -(-(last + 1 + c.n_fft) // hop) * hop)  # a whole number of hops


def whisper_log_mel(waveform: Tensor | np.ndarray, config: FeatureConfig, *, pad_seconds: float = 0.0) -> Tensor:
    """Whisper's log-mel of a whole waveform of any length (Y,), not cut to the chunk, after
    ``pad_seconds`` of zeros appended (openai/whisper's ``transcribe`` appends one chunk, so the
    last window's frames read zeros rather than a reflection): (Y' // hop, M) float32, Y' the
    padded length. The STFT runs a chunk of frames at a time (its memory is one chunk's), the
    clip to 8 below the maximum over the whole waveform, as Whisper's.

    Shapes: (Y,) -> (T, M).
    """
    if config.kind != "whisper":
        raise ValueError(f"whisper_log_mel computes Whisper's features, not {config.kind!r}")
    x = _as_waveform(waveform)  # (Y,)
    x = torch.nn.functional.pad(x, (0, round(pad_seconds * config.sample_rate)))  # (Y',)
    half, hop = config.n_fft // 2, config.hop_length
    padded = torch.nn.functional.pad(x[None, None], (half, half), mode="reflect")[0, 0]  # (Y' + 2·half,)
    frames, step = x.numel() // hop, max(1, round(config.chunk_seconds * config.sample_rate) // hop)
    pieces = []
    for first in range(0, frames, step):  # frame t reads samples [t·hop, t·hop + n_fft) of the padded signal
        last = min(frames, first + step)
        pieces.append(log10_mel(padded[first * hop : (last - 1) * hop + config.n_fft], config))  # (t, M)
    log = torch.cat(pieces)  # (T, M)
    return whisper_scaled(log, log.max())


def log10_mel(piece: Tensor, config: FeatureConfig) -> Tensor:
    """log10 of the mel power, floored at 1e-10, of the frames of an already padded stretch of
    samples (frame t reads ``piece[t·hop : t·hop + n_fft]``; no centring here): (Y,) -> (t, M),
    t = 1 + (Y − n_fft) // hop. What :func:`whisper_log_mel` computes a chunk at a time."""
    window = analysis_window(config.win_length)
    fb = _cached_filterbank(config.n_mels, config.n_fft, config.sample_rate, float(config.f_min), config.f_max)
    hop = config.hop_length
    spec = torch.stft(piece, config.n_fft, hop, config.win_length, window, center=False, return_complex=True)
    return (_power(spec[None])[0] @ fb).clamp_(min=LOG_FLOOR).log10_()  # (t, M)


def whisper_scaled(log: Tensor, peak: Tensor) -> Tensor:
    """Whisper's scaling of log10 mel frames (T, M) given the maximum over the whole waveform
    (``peak``, a 0-d tensor): clipped to at most 8 below it, then (x + 4) / 4."""
    return (torch.maximum(log, peak - 8.0) + 4.0) / 4.0


# ---------------------------------------------------------------------------------------------
# Normalisation, augmentation, batching
# ---------------------------------------------------------------------------------------------


def cmvn(feats: Tensor, valid: Tensor | None = None, *, eps: float = 1e-5) -> Tensor:
    """Utterance mean/variance normalisation of every mel bin over the valid frames.

    x' = (x − μ) / sqrt(σ² + eps), with μ and σ² (population variance) of each bin over the
    utterance's valid frames only, so padding never shifts them; padding frames come out 0.
    ``feats`` is (T, M) or (B, T, M); ``valid`` (T,) or (B, T), None = every frame.
    """
    single = feats.dim() == 2
    x = feats[None] if single else feats  # (B, T, M)
    if valid is None:
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)  # (B, T)
    else:
        mask = valid[None] if single else valid  # (B, T)
    w = mask[..., None].to(x.dtype)  # (B, T, 1)
    count = w.sum(1, keepdim=True).clamp(min=1.0)  # (B, 1, 1)
    mean = (x * w).sum(1, keepdim=True) / count  # (B, 1, M)
    var = ((x - mean).square() * w).sum(1, keepdim=True) / count  # (B, 1, M)
    out = ((x - mean) * torch.rsqrt(var + eps)) * w  # (B, T, M)
    return out[0] if single else out


def spec_augment(
    feats: Tensor,
    generator: torch.Generator,
    *,
    valid: Tensor | None = None,
    freq_masks: int = 2,
    freq_width: int = 27,
    time_masks: int = 2,
    time_width: int = 100,
    time_ratio: float = 1.0,
    time_warp: int = 0,
    value: float = 0.0,
) -> Tensor:
    """SpecAugment (Park et al., 2019, section 2), for training only; returns a new tensor.

    For each utterance (row) independently, over its T_b valid frames:
      * time warping (off unless ``time_warp`` = ω > 0): a point c drawn from [ω, T_b − ω) moves
        to c + w, w drawn from [−ω, ω]; frames on either side are stretched linearly to follow;
      * ``freq_masks`` frequency masks: width f drawn from [0, ``freq_width``], start f0 from
        [0, M − f]; bins [f0, f0 + f) are set to ``value``;
      * ``time_masks`` time masks: width t drawn from [0, min(``time_width``, ⌊p·T_b⌋)]
        (p = ``time_ratio``), start t0 from [0, T_b − t]; frames [t0, t0 + t) are set to ``value``.
    The defaults are the paper's LibriSpeech "LD" policy without warping (``freq_width`` 27,
    ``freq_masks`` 2, ``time_width`` 100, ``time_ratio`` 1.0, ``time_masks`` 2; the paper's F,
    m_F, T, p, m_T). ``value`` 0 is the mean of normalised features (section 2).
    Padding frames are left as they are. Every draw comes from ``generator`` (a CPU
    generator), so the same generator state gives the same masks.

    Shapes: feats (T, M) or (B, T, M); valid (T,) or (B, T), None = every frame.
    """
    single = feats.dim() == 2
    x = (feats[None] if single else feats).clone()  # (B, T, M)
    b_size, t_size, m_size = x.shape
    if valid is None:
        lengths = [t_size] * b_size
    else:
        lengths = (valid[None] if single else valid).sum(-1).tolist()

    def draw(low: int, high: int) -> int:  # uniform integer in [low, high]
        return int(torch.randint(low, high + 1, (), generator=generator))

    for b, length in enumerate(lengths):
        if time_warp > 0 and length > 2 * time_warp + 1:
            x[b, :length] = _time_warp(
                x[b, :length], draw(time_warp, length - time_warp - 1), draw(-time_warp, time_warp)
            )
        for _ in range(freq_masks):
            f = draw(0, min(freq_width, m_size))
            f0 = draw(0, m_size - f)
            x[b, :length, f0 : f0 + f] = value
        bound = min(time_width, math.floor(time_ratio * length))
        for _ in range(time_masks):
            t = draw(0, max(bound, 0))
            t0 = draw(0, length - t)
            x[b, t0 : t0 + t, :] = value
    return x[0] if single else x


def _time_warp(x: Tensor, centre: int, shift: int) -> Tensor:
    """Move frame ``centre`` to ``centre + shift``, stretching both sides linearly: (T, M) -> (T, M)."""
    length = x.shape[0]
    target = min(max(centre + shift, 1), length - 2)
    t = torch.arange(length, dtype=torch.float64)  # (T,) output frames
    source = torch.where(  # (T,): where each output frame reads from
        t <= target,
        t * (centre / target),
        centre + (t - target) * ((length - 1 - centre) / (length - 1 - target)),
    )
    lo = source.floor().long().clamp(max=length - 1)  # (T,)
    hi = (lo + 1).clamp(max=length - 1)  # (T,)
    frac = (source - lo).to(x.device, x.dtype)[:, None]  # (T, 1)
    lo, hi = lo.to(x.device), hi.to(x.device)
    return x[lo] * (1 - frac) + x[hi] * frac  # linear interpolation between neighbouring frames


def pad_features(feats: Sequence[Tensor], value: float = 0.0) -> tuple[Tensor, Tensor]:
    """Pad (T_b, M) feature tensors into ``(padded (B, T, M), valid (B, T))``.

    ``valid`` is True at real frames (qkv's mask convention: True = may attend); the lengths
    are ``valid.sum(1)``. T is the longest T_b.
    """
    if not feats:
        raise ValueError("pad_features needs at least one feature tensor")
    m_size = feats[0].shape[-1]
    if any(f.dim() != 2 or f.shape[-1] != m_size for f in feats):
        raise ValueError(f"every feature tensor must be (T, {m_size}), got {[tuple(f.shape) for f in feats]}")
    t_size = max(f.shape[0] for f in feats)
    padded = feats[0].new_full((len(feats), t_size, m_size), value)  # (B, T, M)
    valid = torch.zeros(len(feats), t_size, dtype=torch.bool, device=feats[0].device)  # (B, T)
    for b, f in enumerate(feats):
        padded[b, : f.shape[0]] = f
        valid[b, : f.shape[0]] = True
    return padded, valid
