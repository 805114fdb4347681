"""The vocoder of text-to-speech: log-mel frames in, a waveform out, and the WAV file it goes to.

What is here:
  * :class:`Vocoder`, the one interface a vocoder implements: ``sample_rate`` and a call from
    log-mel frames (the ``"logmel"`` kind of :class:`~qkv.audio.FeatureConfig`, un-normalised,
    as a TTS model predicts them) to waveforms. A trained neural vocoder will implement the
    same two members and replace :class:`GriffinLim` without its callers changing;
  * :func:`mel_to_linear`: log-mel -> linear STFT magnitude through the pseudo-inverse of the
    Slaney filterbank, negative powers clamped to zero;
  * :func:`griffin_lim`: the fast Griffin-Lim algorithm (Perraudin, Balazs & Søndergaard, 2013)
    as ``librosa.griffinlim`` implements it, in torch, with the STFT of :mod:`qkv.audio`
    (periodic Hann window, centred frames, zero padding of n_fft // 2 at both ends);
  * :class:`GriffinLim`, the two put together behind :class:`Vocoder` (seeded, so the same
    frames always give the same samples);
  * :func:`write_wav`: a 16-bit PCM WAV at 16 kHz or 22.05 kHz, resampled with ``soxr`` when
    the waveform's rate differs, scaled down (never up) when its peak passes full scale,
    written atomically.

Everything is a pure function or a frozen dataclass: no parameters, nothing at import.

What is not here: a neural vocoder (WaveNet, HiFi-GAN, ...), the TTS model that predicts the
frames (``models/tts.py``), CMVN-normalised features (not invertible: the statistics are gone),
Whisper features, reading audio (``audio.py``), playing audio, pictures (``plots.py``:
:func:`~qkv.plots.mel_comparison`).

References: Griffin & Lim (1984), Signal estimation from modified short-time Fourier transform,
IEEE Trans. ASSP 32(2); Perraudin, Balazs & Søndergaard (2013), A fast Griffin-Lim algorithm,
IEEE WASPAA, doi:10.1109/WASPAA.2013.6701851; librosa's ``feature.inverse.mel_to_audio``
(McFee et al., librosa 0.11).

Shapes use the legend of ``attention.py``: B batch, T frames, M mel bins, E STFT frequency bins
(n_fft // 2 + 1), Y samples.
"""

from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from qkv.audio import FeatureConfig, analysis_window, centred_stft, mel_filterbank
from qkv.errors import UserError
from qkv.files import write_atomic

WAV_RATES = (16_000, 22_050)  # the rates write_wav writes
PINV_RTOL = 1e-3  # singular values below this fraction of the largest are dropped by the pseudo-inverse


@runtime_checkable
class Vocoder(Protocol):
    """Log-mel frames -> waveform: what every vocoder offers (Griffin-Lim now, a neural one later).

    ``sample_rate`` is the rate of the samples it returns (Hz). The call maps log-mel frames,
    natural log of the mel power spectrogram as :func:`qkv.audio.features` computes it
    (``kind="logmel"``, ``normalize=False``), to float32 waveforms.

    Shapes: log_mel (T, M) -> (Y,); (B, T, M) -> (B, Y).
    """

    @property
    def sample_rate(self) -> int: ...  # a read-only member: a frozen dataclass field or a property

    def __call__(self, log_mel: Tensor) -> Tensor: ...


# ---------------------------------------------------------------------------------------------
# Mel -> linear magnitude
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _pinv_filterbank(n_mels: int, n_fft: int, sample_rate: int, f_min: float, f_max: float | None) -> Tensor:
    """The pseudo-inverse of audio.py's filterbank: (M, E) float32, mel @ pinv ≈ power.

    Computed in float64 from the float32 filters the features use. Directions with a singular
    value below PINV_RTOL of the largest are dropped: at 80 mels and n_fft 400 (16 kHz) the
    lowest filters share their few FFT bins, the filterbank has rank 78 of 80, and an exact
    inverse would multiply those directions by ~10⁷.
    """
    fb = mel_filterbank(n_mels, n_fft, sample_rate, f_min=f_min, f_max=f_max).to(torch.float64)  # (E, M)
    return torch.linalg.pinv(fb, rtol=PINV_RTOL).to(torch.float32)  # (M, E); never written to


def mel_to_linear(log_mel: Tensor, config: FeatureConfig) -> Tensor:
    """Linear STFT magnitude |X| from log-mel frames: (..., T, M) -> (..., T, E) float32, ≥ 0.

    mel power = exp(log_mel); linear power = mel power · F⁺ (F: the (E, M) Slaney filterbank of
    ``config``, F⁺ its pseudo-inverse, the least-squares solution of power · F = mel of least
    norm), clamped at 0; magnitude = sqrt(power). librosa's ``mel_to_stft`` solves the same
    least-squares problem under the constraint power ≥ 0 (NNLS, iterative); the pseudo-inverse
    and a clamp are one matrix product, and where the filters are well conditioned and the
    solution is positive the two agree.

    Shapes: log_mel (..., T, M) -> (..., T, E).
    """
    c = config
    if log_mel.shape[-1] != c.n_mels:
        raise UserError(f"the vocoder expects {c.n_mels} mel bins, got frames of shape {tuple(log_mel.shape)}")
    pinv = _pinv_filterbank(c.n_mels, c.n_fft, c.sample_rate, float(c.f_min), c.f_max).to(log_mel.device)  # (M, E)
    mel = log_mel.to(torch.float32).exp()  # (..., T, M) mel power
    power = (mel.reshape(-1, c.n_mels) @ pinv).view(*mel.shape[:-1], -1)  # (..., T, E): one GEMM
    return power.clamp_(min=0.0).sqrt_()


# ---------------------------------------------------------------------------------------------
# Griffin-Lim
# ---------------------------------------------------------------------------------------------


def _istft(spec: Tensor, c: FeatureConfig, window: Tensor, length: int) -> Tensor:
    """The least-squares inverse of :func:`~qkv.audio.centred_stft` (zero-padded; Griffin & Lim,
    1984: overlap-add of the windowed frames divided by the summed squared window): (B, E, T)
    complex -> (B, Y)."""
    return torch.istft(
        spec, c.n_fft, hop_length=c.hop_length, win_length=c.win_length, window=window, center=True, length=length
    )


def griffin_lim(
    magnitude: Tensor,
    config: FeatureConfig,
    *,
    iterations: int = 32,
    momentum: float = 0.99,
    generator: torch.Generator | None = None,
    length: int | None = None,
) -> Tensor:
    """A waveform whose STFT magnitude is close to ``magnitude``, by fast Griffin-Lim.

    The STFT is audio.py's (``config``'s n_fft, win_length, hop_length, periodic Hann window,
    centred frames with zero padding). Starting from the phase drawn uniformly from ``generator``
    (a CPU generator; None: zero phase, librosa's ``init=None``), each of ``iterations`` steps
    (Perraudin et al., 2013, the fast Griffin-Lim algorithm, as ``librosa.griffinlim`` writes it):
        x = iSTFT(c_{n-1}),  t_n = STFT(x)                      (projection onto consistent spectrograms)
        c_n = |S| · phase(t_n − α/(1+α) · t_{n-1})               (momentum α; projection onto |S|)
    The paper's t_n + α(t_n − t_{n-1}) is (1+α) times the same value, so the phase is the same.
    α = 0 is the original Griffin-Lim (Griffin & Lim, 1984). The waveform is iSTFT(c) after the
    last step, float32.

    ``length``: samples to return; None = what the frames imply, (T − 1)·hop_length (the
    iterations always use that length, so that the STFT gives back T frames; the last inverse
    is cut or zero-padded to ``length``).

    Shapes: magnitude (T, E) -> (Y,); (B, T, E) -> (B, Y).
    """
    c = config
    if magnitude.dim() not in (2, 3) or magnitude.shape[-1] != c.n_freqs:
        raise ValueError(f"magnitude must be (T, {c.n_freqs}) or (B, T, {c.n_freqs}), got {tuple(magnitude.shape)}")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
        raise ValueError(f"iterations must be a non-negative integer, got {iterations!r}")
    if not 0.0 <= momentum:
        raise ValueError(f"momentum must be ≥ 0, got {momentum!r}")
    single = magnitude.dim() == 2
    target = (magnitude[None] if single else magnitude).to(torch.float32).transpose(1, 2)  # (B, E, T)
    frames_length = (target.shape[-1] - 1) * c.hop_length  # Y whose STFT has exactly the T frames
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length <= 0):
        raise ValueError(f"length must be a positive integer or None, got {length!r}")
    window = analysis_window(c.win_length).to(target.device)  # (win_length,)
    if generator is None:
        angles = torch.ones_like(target, dtype=torch.complex64)  # (B, E, T): zero phase
    else:
        turns = torch.rand(target.shape, generator=generator, dtype=torch.float64)  # (B, E, T) on the CPU
        angles = torch.polar(torch.ones_like(turns), 2 * math.pi * turns).to(target.device, torch.complex64)
    tiny = torch.finfo(torch.float32).tiny  # librosa's eps: keeps a zero bin from dividing by zero
    blend = momentum / (1.0 + momentum)
    angles = angles * target  # (B, E, T): c_0
    previous: Tensor | None = None
    for _ in range(iterations):
        rebuilt = centred_stft(_istft(angles, c, window, frames_length), c)  # (B, E, T): t_n
        angles = rebuilt if previous is None else rebuilt - blend * previous
        angles = angles / (angles.abs() + tiny) * target  # c_n: the phase of t_n, the magnitude of S
        previous = rebuilt
    waveform = _istft(angles, c, window, frames_length if length is None else length)  # (B, Y)
    return waveform[0] if single else waveform


@dataclass(frozen=True)
class GriffinLim:
    """The Griffin-Lim vocoder: :func:`mel_to_linear` then :func:`griffin_lim` (implements :class:`Vocoder`).

    Attributes:
        config: the features the frames are: ``kind="logmel"``, ``normalize=False`` (the
            model's :class:`~qkv.audio.FeatureConfig`). CMVN-normalised or Whisper features
            are refused: their scale and offset cannot be undone.
        iterations: Griffin-Lim steps (32: librosa's default, and the issue's).
        momentum: α of the fast algorithm (0.99: librosa's default; 0: the original one).
        seed: the initial phase is drawn from ``torch.Generator().manual_seed(seed)`` on every
            call, so the same frames give the same samples.

    Shapes: log_mel (T, M) -> (Y,); (B, T, M) -> (B, Y); Y = (T − 1)·hop_length.
    """

    config: FeatureConfig
    iterations: int = 32
    momentum: float = 0.99
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.config, FeatureConfig):
            raise UserError(f"the Griffin-Lim vocoder needs a FeatureConfig, got {type(self.config).__name__}")
        if self.config.kind != "logmel":
            raise UserError(
                f"the Griffin-Lim vocoder inverts log-mel features (kind logmel), not {self.config.kind!r}: "
                "their scaling and clipping cannot be undone"
            )
        if self.config.normalize:
            raise UserError(
                "the Griffin-Lim vocoder needs un-normalised log-mels (normalize false): "
                "CMVN removes each utterance's mean and variance, which cannot be recovered"
            )
        if isinstance(self.iterations, bool) or not isinstance(self.iterations, int) or self.iterations < 0:
            raise UserError(f"Griffin-Lim iterations must be a non-negative integer, got {self.iterations!r}")
        if isinstance(self.momentum, bool) or not isinstance(self.momentum, (int, float)) or not self.momentum >= 0:
            raise UserError(f"Griffin-Lim momentum must be a number ≥ 0, got {self.momentum!r}")

    @property
    def sample_rate(self) -> int:
        """The rate of the samples returned: the features' rate (Hz)."""
        return self.config.sample_rate

    def __call__(self, log_mel: Tensor) -> Tensor:
        """Waveforms of log-mel frames: (T, M) -> (Y,), (B, T, M) -> (B, Y) float32."""
        if log_mel.dim() not in (2, 3):
            raise UserError(f"the vocoder expects frames of shape (T, M) or (B, T, M), got {tuple(log_mel.shape)}")
        if log_mel.shape[-2] < 2:
            raise UserError(f"the vocoder needs at least 2 frames, got {log_mel.shape[-2]}")
        if not bool(torch.isfinite(log_mel).all()):
            raise UserError("the vocoder's log-mel frames hold non-finite values (NaN or infinity)")
        magnitude = mel_to_linear(log_mel, self.config)  # (..., T, E)
        generator = torch.Generator().manual_seed(self.seed)
        return griffin_lim(
            magnitude, self.config, iterations=self.iterations, momentum=self.momentum, generator=generator
        )


# ---------------------------------------------------------------------------------------------
# WAV files
# ---------------------------------------------------------------------------------------------


def write_wav(path: str | Path, waveform: Tensor | np.ndarray, sample_rate: int, *, rate: int | None = None) -> Path:
    """Write a mono waveform at ``sample_rate`` Hz as a 16-bit PCM WAV at ``rate`` Hz: ``path``.

    ``rate`` is 16,000 or 22,050 (:data:`WAV_RATES`); None = ``sample_rate``, which must then be
    one of them. A waveform at another rate is resampled with ``soxr`` (its default high
    quality). When the peak passes full scale (|x| > 1, after resampling) the whole waveform is
    scaled down to peak 1, so nothing clips; a quieter one is left as it is, never scaled up.
    The file is written whole or not at all (a temporary sibling renamed into place,
    :func:`qkv.files.write_atomic`); missing parent folders are made. An empty waveform, one
    with non-finite samples, one that is not (Y,), or a bad rate is a one-line UserError.

    Shapes: waveform (Y,) at sample_rate; the file holds ⌊Y · rate / sample_rate + ½⌋ samples (soxr's count).
    """
    import soundfile  # imported on use: only writing and reading audio need libsndfile
    import soxr

    path = Path(path)
    out_rate = sample_rate if rate is None else rate
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate <= 0:
        raise UserError(f"cannot write {path}: the sample rate must be a positive integer, got {sample_rate!r}")
    if isinstance(out_rate, bool) or not isinstance(out_rate, int) or out_rate not in WAV_RATES:
        raise UserError(
            f"cannot write {path}: WAV files are written at {' or '.join(map(str, WAV_RATES))} Hz, not {out_rate!r}"
        )
    x = waveform.detach().cpu().numpy() if isinstance(waveform, Tensor) else np.asarray(waveform)
    if x.ndim != 1:
        raise UserError(f"cannot write {path}: expected a mono waveform of shape (N,), got shape {x.shape}")
    if x.size == 0:
        raise UserError(f"cannot write {path}: the waveform has no samples")
    if not np.issubdtype(x.dtype, np.number) or np.iscomplexobj(x):
        raise UserError(f"cannot write {path}: the waveform must hold real numbers, got {x.dtype}")
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise UserError(f"cannot write {path}: the waveform holds non-finite samples (NaN or infinity)")
    if out_rate != sample_rate:
        x = soxr.resample(x, sample_rate, out_rate)  # (Y',) float32
    peak = float(np.abs(x).max(initial=0.0))
    if peak > 1.0:
        x = x / peak  # down to full scale; a quieter waveform keeps its level
    pcm = np.round(x * 32767.0).astype(np.int16)  # (Y',): |x| ≤ 1, so within int16
    data = io.BytesIO()
    soundfile.write(data, pcm, out_rate, format="WAV", subtype="PCM_16")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data.getvalue())
    return path
