"""A neural vocoder made of a published voice's generator: log-mel frames → VITS's latent z → waveform.

What is here:
  * :class:`MelVocoderConfig`: the mels it reads (rate, hop, bins, their scale), the latent it
    writes (the generator's frame rate and channels) and the adapter's size;
  * :func:`latent_frames` and :func:`frame_positions`: how many latent frames a run of mel
    frames covers, and where each latent frame's centre falls on the mel frames' time axis
    (100 → 86.13 frames a second for 16 kHz / hop 160 mels and a 22,050 Hz / hop 256 voice);
    :func:`resample_frames`, linear interpolation at those positions;
  * :class:`MelAdapter`: a kernel-5 convolution over the mels, the frame-rate change, a stack
    of gated WaveNet layers (VITS's posterior encoder's shape, ``vits.WaveNet``) and a kernel-1
    projection to z, trained by qkv (``tasks/vocoder.py``);
  * :class:`MelVocoder`: the adapter and a VITS HiFi-GAN generator (``vits.Generator``, Kong et
    al., 2020), together a :class:`~qkv.vocoder.Vocoder` at the generator's rate.

The generator is not trained here: its weights are a published Piper voice's, trained by the
voice's authors with VITS (Kim et al., 2021); qkv learns only the map from its own TTS features
(log-mels) to the latent that generator reads. Mels carry no phase, so the adapter predicts the
latent from which the generator makes a waveform with those mels.

What is not here: training, the pairs it learns from, saving and loading with the voice's
weights (``tasks/vocoder.py``), Griffin-Lim (``vocoder.py``), the VITS voice (``vits.py``).

Shapes use the legend of ``attention.py``: B batch, T mel frames, M mel bins, Z latent frames,
Y samples; channels named by words, as ``vits.py`` does, e.g. (B, latent, Z).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.errors import UserError
from qkv.models.vits import Generator, VitsConfig, WaveNet


@dataclass(frozen=True)
class MelVocoderConfig:
    """What a :class:`MelVocoder` reads and writes, and its adapter's size.

    Attributes:
        n_mels, mel_sample_rate, mel_hop: the log-mels it reads (the TTS model's features:
            ``kind="logmel"``, un-normalised), their bins, audio rate and hop (samples).
        mel_mean, mel_std: the adapter reads (log_mel − mean) / std (the training mels' statistics).
        channels, layers, kernel_size: the adapter's width, WaveNet layers and their kernel.
        generator: the voice's VITS config (its generator's part: the latent's channels, the
            upsampling, the rate); the weights come from the voice file.
    """

    generator: VitsConfig
    n_mels: int = 80
    mel_sample_rate: int = 16_000
    mel_hop: int = 160
    mel_mean: float = 0.0
    mel_std: float = 1.0
    channels: int = 192
    layers: int = 8
    kernel_size: int = 5

    def __post_init__(self) -> None:
        if isinstance(self.generator, dict):  # read from JSON
            object.__setattr__(self, "generator", VitsConfig(**self.generator))
        if self.generator.n_speakers > 1:
            raise ValueError("the mel vocoder speaks with a voice of one speaker")
        if min(self.n_mels, self.mel_sample_rate, self.mel_hop, self.channels, self.layers, self.kernel_size) < 1:
            raise ValueError("n_mels, mel_sample_rate, mel_hop, channels, layers and kernel_size must be positive")
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (same padding), got {self.kernel_size}")
        if not self.mel_std > 0:
            raise ValueError(f"mel_std must be positive, got {self.mel_std}")

    @property
    def sample_rate(self) -> int:
        """The waveform's rate: the generator's (Hz)."""
        return self.generator.sample_rate


def latent_frames(mel_frames: int, c: MelVocoderConfig) -> int:
    """The latent frames whose speech, resampled to the mels' rate, gives ``mel_frames`` centred
    frames: T frames are ⌊samples / hop⌋ + 1, so the speech lasts at least (T − 1)·hop / rate
    seconds and less than T·hop / rate; the fewest whole latent frames that last that long
    (within half a sample, the resampler's rounding), at least 1. Between the two bounds lie
    fewer than one latent frame (86 frames a second against 100), so this is the length of the
    recording the mels came from."""
    seconds = (mel_frames - 1) * c.mel_hop / c.mel_sample_rate - 0.5 / c.mel_sample_rate
    return max(1, math.ceil(seconds * c.sample_rate / c.generator.hop))


def frame_positions(n_latent: int, n_mels: int, c: MelVocoderConfig) -> Tensor:
    """Where each latent frame's centre falls on the mel frames' axis, in (fractional) frames:
    latent frame j covers samples [j·hop_z, (j+1)·hop_z), centred at (j + ½)·hop_z / rate_z
    seconds; mel frame t is centred at t·hop_m / rate_m. Clamped to [0, T − 1].
    Shapes: -> (Z,) float32."""
    ratio = (c.generator.hop / c.sample_rate) * (c.mel_sample_rate / c.mel_hop)  # mel frames per latent frame
    centres = (torch.arange(n_latent, dtype=torch.float64) + 0.5) * ratio
    return centres.clamp(0, n_mels - 1).to(torch.float32)


def resample_frames(x: Tensor, positions: Tensor) -> Tensor:
    """``x`` read at fractional frame ``positions`` by linear interpolation between its two
    neighbouring frames. Shapes: x (B, channels, T); positions (Z,) -> (B, channels, Z)."""
    low = positions.floor().long().clamp(0, x.shape[-1] - 1)  # (Z,)
    high = (low + 1).clamp(max=x.shape[-1] - 1)  # (Z,)
    weight = (positions - low.to(positions.dtype)).to(x.dtype)  # (Z,)
    return x[..., low] * (1 - weight) + x[..., high] * weight  # (B, channels, Z)


class MelAdapter(nn.Module):
    """Log-mels → the generator's latent z: conv, frame-rate change, WaveNet, projection."""

    def __init__(self, c: MelVocoderConfig) -> None:
        super().__init__()
        self.config = c
        self.pre = nn.Conv1d(c.n_mels, c.channels, c.kernel_size, padding=c.kernel_size // 2)
        self.enc = WaveNet(c.channels, c.kernel_size, c.layers, 0)
        self.proj = nn.Conv1d(c.channels, c.generator.inter_channels, 1)

    def forward(self, log_mel: Tensor, n_latent: int | None = None) -> Tensor:
        """The latent of ``log_mel`` (every row of the batch the same length): ``n_latent``
        frames (None: :func:`latent_frames`). Shapes: log_mel (B, T, M) -> (B, latent, Z)."""
        c = self.config
        t = log_mel.shape[1]
        n_latent = latent_frames(t, c) if n_latent is None else n_latent
        x = self.pre(((log_mel - c.mel_mean) / c.mel_std).transpose(1, 2))  # (B, channels, T)
        x = resample_frames(x, frame_positions(n_latent, t, c).to(x.device))  # (B, channels, Z)
        mask = torch.ones(x.shape[0], 1, x.shape[-1], dtype=x.dtype, device=x.device)  # (B, 1, Z)
        return self.proj(self.enc(x, mask))  # (B, latent, Z)


class MelVocoder(nn.Module):
    """A :class:`~qkv.vocoder.Vocoder`: :class:`MelAdapter` then a VITS HiFi-GAN generator.

    Shapes: log_mel (T, M) -> (Y,); (B, T, M) -> (B, Y); Y = Z · hop_z, Z = :func:`latent_frames` (T).
    """

    def __init__(self, config: MelVocoderConfig) -> None:
        super().__init__()
        self.config = config
        self.adapter = MelAdapter(config)
        self.generator = Generator(config.generator)

    @property
    def sample_rate(self) -> int:
        """The rate of the samples returned: the generator's (Hz)."""
        return self.config.sample_rate

    @torch.no_grad()
    def forward(self, log_mel: Tensor) -> Tensor:
        """Waveforms of log-mel frames, float32 in [−1, 1] (the generator's tanh)."""
        if log_mel.dim() not in (2, 3) or log_mel.shape[-1] != self.config.n_mels:
            raise UserError(
                f"the vocoder expects frames of shape (T, {self.config.n_mels}) or (B, T, {self.config.n_mels}), "
                f"got {tuple(log_mel.shape)}"
            )
        if log_mel.shape[-2] < 2:
            raise UserError(f"the vocoder needs at least 2 frames, got {log_mel.shape[-2]}")
        if not bool(torch.isfinite(log_mel).all()):
            raise UserError("the vocoder's log-mel frames hold non-finite values (NaN or infinity)")
        single = log_mel.dim() == 2
        weight = next(self.parameters())
        z = self.adapter(log_mel[None] if single else log_mel)  # (B, latent, Z)
        wave = self.generator(z.to(weight.dtype))[:, 0]  # (B, Z·hop)
        return (wave[0] if single else wave).float()
