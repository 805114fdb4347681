"""Losses between two waveforms measured on their spectra: what a vocoder's output is trained to match.

What is here:
  * :func:`stft_magnitude`: |STFT| of a batch of waveforms (Hann window, centred frames), floored
    so that its logarithm and its gradient stay finite in silence;
  * :func:`spectral_convergence` and :func:`log_stft_magnitude_loss`: Parallel WaveGAN's two
    terms (Yamamoto et al., 2020, eq. 6 and 7);
  * :func:`multi_resolution_stft_loss`: their sum averaged over several (FFT size, hop, window)
    resolutions (ibid., eq. 5 and 8), :data:`STFT_RESOLUTIONS` the paper's three;
  * :func:`mel_l1_loss`: HiFi-GAN's mel-spectrogram loss (Kong et al., 2020, eq. 3), the mean
    |log-mel difference|, :class:`MelLossConfig` its analysis.

Both losses are 0 for identical waveforms and positive otherwise; neither has parameters, so a
gradient through them reaches only what made the waveforms.

What is not here: the vocoder and what it is trained on (``models/mel_vocoder.py``,
``tasks/vocoder.py``), the features a model reads (``audio.py``), adversarial losses.

Shapes: B batch, Y samples, E frequency bins, F frames, M mel bins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.audio import mel_filterbank

# (FFT size, hop, window) of Parallel WaveGAN's multi-resolution loss (Yamamoto et al., 2020, section 4.1)
STFT_RESOLUTIONS: tuple[tuple[int, int, int], ...] = ((1024, 120, 600), (2048, 240, 1200), (512, 50, 240))
MAGNITUDE_FLOOR = 1e-7  # of the power, before its square root: the reference implementation's clamp


def stft_magnitude(wave: Tensor, n_fft: int, hop: int, window: int) -> Tensor:
    """|STFT| of each row, a Hann window of ``window`` samples zero-padded to ``n_fft``, frames
    centred (reflect-padded; shorter waves zero-padded to allow it), the power floored at
    :data:`MAGNITUDE_FLOOR`. Shapes: wave (B, Y) -> (B, E, F), E = n_fft // 2 + 1."""
    if wave.shape[-1] <= n_fft // 2:  # reflection needs more samples than the padding
        wave = torch.nn.functional.pad(wave, (0, n_fft // 2 + 1 - wave.shape[-1]))
    hann = torch.hann_window(window, dtype=wave.dtype, device=wave.device)
    spec = torch.stft(wave, n_fft, hop, window, hann, center=True, pad_mode="reflect", return_complex=True)
    return (spec.real**2 + spec.imag**2).clamp(min=MAGNITUDE_FLOOR).sqrt()  # (B, E, F)


def spectral_convergence(predicted: Tensor, target: Tensor) -> Tensor:
    """‖|S| − |Ŝ|‖_F / ‖|S|‖_F (Yamamoto et al., 2020, eq. 6): the error relative to the
    target's energy, so loud frames dominate. Shapes: (B, E, F), (B, E, F) -> scalar."""
    return torch.linalg.vector_norm(target - predicted) / torch.linalg.vector_norm(target)


def log_stft_magnitude_loss(predicted: Tensor, target: Tensor) -> Tensor:
    """(1/N) ‖log|S| − log|Ŝ|‖_1 (ibid., eq. 7): every bin's ratio alike, so quiet detail
    counts as much as loud. Shapes: (B, E, F), (B, E, F) -> scalar."""
    return (target.log() - predicted.log()).abs().mean()


def multi_resolution_stft_loss(
    predicted: Tensor, target: Tensor, resolutions: tuple[tuple[int, int, int], ...] = STFT_RESOLUTIONS
) -> Tensor:
    """Spectral convergence plus log magnitude, averaged over ``resolutions`` (ibid., eq. 5 and
    8): several analyses so that no one time-frequency trade-off is fitted at the others'
    expense. Shapes: predicted (B, Y), target (B, Y) -> scalar."""
    if predicted.shape != target.shape:
        raise ValueError(f"the waveforms differ in shape: {tuple(predicted.shape)} and {tuple(target.shape)}")
    total = predicted.new_zeros(())
    for n_fft, hop, window in resolutions:
        got, want = stft_magnitude(predicted, n_fft, hop, window), stft_magnitude(target, n_fft, hop, window)
        total = total + spectral_convergence(got, want) + log_stft_magnitude_loss(got, want)
    return total / len(resolutions)


@dataclass(frozen=True)
class MelLossConfig:
    """HiFi-GAN's analysis for its 22,050 Hz voices (Kong et al., 2020, its config_v1): 80 mels
    up to 8 kHz from a 1024-point FFT, hop 256."""

    sample_rate: int = 22_050
    n_fft: int = 1024
    hop: int = 256
    n_mels: int = 80
    f_max: float = 8_000.0


def mel_l1_loss(predicted: Tensor, target: Tensor, c: MelLossConfig) -> Tensor:
    """Mean |log-mel(target) − log-mel(predicted)| (Kong et al., 2020, eq. 3): the error a
    listener's frequency resolution weights, up to ``c.f_max``. Shapes: (B, Y), (B, Y) -> scalar."""
    if predicted.shape != target.shape:
        raise ValueError(f"the waveforms differ in shape: {tuple(predicted.shape)} and {tuple(target.shape)}")
    bank = mel_filterbank(c.n_mels, c.n_fft, c.sample_rate, f_max=c.f_max).to(predicted)  # (E, M)

    def log_mel(wave: Tensor) -> Tensor:
        magnitude = stft_magnitude(wave, c.n_fft, c.hop, c.n_fft)  # (B, E, F)
        return (magnitude.transpose(1, 2) @ bank).clamp(min=1e-5).log()  # (B, F, M)

    return (log_mel(target) - log_mel(predicted)).abs().mean()
