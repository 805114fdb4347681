"""VITS (Kim et al., 2021, "Conditional Variational Autoencoder with Adversarial Learning for
End-to-End Text-to-Speech"), inference only: the model behind Piper's voices.

What is here: :class:`VitsConfig` and :class:`Vits`, the path phoneme ids → waveform:

  * the text encoder (``enc_p``): a phoneme embedding scaled by √hidden, Transformer blocks of
    post-norm self-attention with windowed relative positions (Shaw et al., 2018; keys and
    values each get a learnt vector per offset −w..w, shared by the heads) and a feed-forward
    of two kernel-3 convolutions, then a projection to the prior's mean and log-std;
  * the stochastic duration predictor (``dp``, VITS section 2.2.2): noise run backwards through
    a flow of neural rational-quadratic spline couplings (Durkan et al., 2019) conditioned on
    the text, giving log durations;
  * the durations' hard alignment (each phoneme's prior repeated ⌈duration⌉ frames);
  * the normalising flow (``flow``): mean-only affine couplings over WaveNet-style stacks, run
    backwards from a sample of the prior to the latent;
  * the HiFi-GAN generator (``dec``, Kong et al., 2020): transposed convolutions and
    multi-receptive-field residual blocks up to the waveform.

The noise (the duration flow's input and the prior's sample) can be passed in as tensors, so
the model can be compared with another runtime fed the same draws. Submodule names follow the
published VITS code (``enc_p``, ``dp``, ``flow``, ``dec``, ``emb_g``) so a voice's weights keep
their names. Weight normalisation is absent: published exports have it folded in.

What is not here: training (posterior encoder, discriminators, losses, monotonic alignment
search), phonemes and speaking (``piper.py``), reading a Piper ONNX file (``hf/piper.py``).

Shapes use the legend of ``attention.py``: ids (B, S) phoneme ids, S positions; frames T;
channels named by words, e.g. (B, hidden, S); waveform (B, samples).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.onednn_conv import conv_frames, conv_rows, conv_rows_fused, fusable, learn_layouts

LRELU_SLOPE = 0.1  # HiFi-GAN's leaky ReLU slope inside the generator
MASKED = -1e4  # VITS's score for masked keys (a finite fill: a fully masked row stays finite)


@dataclass(frozen=True)
class VitsConfig:
    """A VITS voice (Piper's "medium" and "high" voices differ only in these numbers).

    Attributes:
        n_symbols: phoneme ids the embedding holds.
        hidden: the text encoder's width (also the duration predictor's input).
        inter_channels: the latent's channels (the prior's and the flow's).
        filter_channels: the encoder feed-forward's width.
        n_heads, n_layers, kernel_size: the encoder's heads, blocks and feed-forward kernel.
        window: relative positions −window..window get their own vectors (farther: none).
        dp_filter_channels, dp_kernel_size, dp_flows: the stochastic duration predictor's width,
            kernel and spline couplings; dp_bins, dp_tail_bound: each spline's bins and the
            interval [−bound, bound] outside which it is the identity.
        flow_couplings, flow_layers, flow_kernel_size: the latent flow's couplings and each
            coupling's WaveNet layers and kernel.
        resblock: HiFi-GAN residual block kind, "1" (two convs per dilation) or "2" (one).
        resblock_kernel_sizes, resblock_dilation_sizes: the multi-receptive-field blocks.
        upsample_rates, upsample_kernel_sizes, upsample_initial_channel: the generator's
            transposed convolutions (their product is the hop, samples per frame).
        n_speakers, speaker_channels: voices and their embedding width (1 and 0: one voice).
        sample_rate: the waveform's rate in Hz.
        noise_scale, length_scale, noise_w: the voice's defaults (the prior's noise, duration
            multiplier, the duration predictor's noise).
    """

    n_symbols: int = 256
    hidden: int = 192
    inter_channels: int = 192
    filter_channels: int = 768
    n_heads: int = 2
    n_layers: int = 6
    kernel_size: int = 3
    window: int = 4
    dp_filter_channels: int = 192
    dp_kernel_size: int = 3
    dp_flows: int = 4
    dp_bins: int = 10
    dp_tail_bound: float = 5.0
    flow_couplings: int = 4
    flow_layers: int = 4
    flow_kernel_size: int = 5
    resblock: str = "2"
    resblock_kernel_sizes: tuple[int, ...] = (3, 5, 7)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 2), (2, 6), (3, 12))
    upsample_rates: tuple[int, ...] = (8, 8, 4)
    upsample_kernel_sizes: tuple[int, ...] = (16, 16, 8)
    upsample_initial_channel: int = 256
    n_speakers: int = 1
    speaker_channels: int = 0
    sample_rate: int = 22050
    noise_scale: float = 0.667
    length_scale: float = 1.0
    noise_w: float = 0.8

    def __post_init__(self) -> None:
        # config.json gives lists; the config stays hashable and equal to the one saved
        object.__setattr__(self, "resblock_kernel_sizes", tuple(int(k) for k in self.resblock_kernel_sizes))
        dilations = tuple(tuple(int(d) for d in ds) for ds in self.resblock_dilation_sizes)
        object.__setattr__(self, "resblock_dilation_sizes", dilations)
        object.__setattr__(self, "upsample_rates", tuple(int(r) for r in self.upsample_rates))
        object.__setattr__(self, "upsample_kernel_sizes", tuple(int(k) for k in self.upsample_kernel_sizes))
        if self.resblock not in ("1", "2"):
            raise ValueError(f"resblock must be '1' or '2', not {self.resblock!r}")
        if self.hidden % self.n_heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by n_heads ({self.n_heads})")
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            raise ValueError("resblock_kernel_sizes and resblock_dilation_sizes must have one entry per block")
        if len(self.upsample_rates) != len(self.upsample_kernel_sizes):
            raise ValueError("upsample_rates and upsample_kernel_sizes must have one entry per upsampling")
        if (self.n_speakers > 1) != (self.speaker_channels > 0):
            raise ValueError("a voice of several speakers needs speaker_channels > 0 (and one voice 0)")

    @property
    def hop(self) -> int:
        """Waveform samples per latent frame."""
        return math.prod(self.upsample_rates)


# ----------------------------------------------------------------------------- small maths


def sequence_mask(lengths: Tensor, length: int) -> Tensor:
    """True at the positions within each length. Shapes: lengths (B,) -> (B, 1, length)."""
    return (torch.arange(length, device=lengths.device)[None, :] < lengths[:, None]).unsqueeze(1)


def channel_norm(x: Tensor, gamma: Tensor, beta: Tensor) -> Tensor:
    """Layer norm over the channels of a (B, channels, T) tensor (VITS's LayerNorm, eps 1e-5)."""
    return F.layer_norm(x.transpose(1, -1), gamma.shape, gamma, beta, 1e-5).transpose(1, -1)


def padded_frames(frames: int, multiple: int = 32) -> int:
    """``frames`` rounded up to a multiple of ``multiple``: the lengths the generator's fused path
    runs at (:class:`Generator`). 32 frames: the first 50 test2016 captions at the joe voice's
    scales came to 15 lengths instead of 50, for 5% more frames."""
    return -(-frames // multiple) * multiple


def zero_tail(x: Tensor, valid: int | None) -> Tensor:
    """``x`` with its samples from ``valid`` on set to zero, in place (None: ``x`` as it is).
    Shapes: (B, channels, 1, samples) -> the same."""
    if valid is not None and valid < x.shape[-1]:
        x[..., valid:] = 0
    return x


def same_padding(kernel_size: int, dilation: int = 1) -> int:
    """Padding that keeps a stride-1 convolution's length."""
    return (kernel_size * dilation - dilation) // 2


def relative_index(length: int, window: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """For query i and key j: the offset's vector index j − i + window, clamped, and whether
    |j − i| ≤ window (farther offsets have no vector: Shaw et al., 2018, clip to zero here as
    VITS does). Shapes: both (S, S)."""
    offset = torch.arange(length, device=device)[None, :] - torch.arange(length, device=device)[:, None]
    return (offset + window).clamp(0, 2 * window), offset.abs() <= window


def band_of(scores: Tensor, window: int) -> Tensor:
    """Each query's weights on keys i − window..i + window (0 beyond the ends): the absolute
    (B, H, S, S) weights re-indexed by offset. Shapes: (B, H, S, S) -> (B, H, S, 2·window + 1)."""
    s = scores.shape[-1]
    keys = torch.arange(s, device=scores.device)[:, None] + torch.arange(-window, window + 1, device=scores.device)
    inside = (keys >= 0) & (keys < s)  # (S, 2w+1)
    picked = scores.gather(-1, keys.clamp(0, s - 1).expand(*scores.shape[:2], s, 2 * window + 1))
    return picked * inside


def alignment_path(durations: Tensor, frames: int) -> Tensor:
    """The hard alignment of whole-frame durations: frame t belongs to phoneme s when
    sum(d[:s]) ≤ t < sum(d[:s+1]) (VITS's generate_path). Shapes: durations (B, S) -> (B, S, T)."""
    ends = torch.cumsum(durations, dim=-1)  # (B, S)
    t = torch.arange(frames, device=durations.device, dtype=durations.dtype)
    return ((t[None, None, :] < ends[..., None]) & (t[None, None, :] >= (ends - durations)[..., None])).to(
        durations.dtype
    )  # (B, S, T)


def _bin_edges(unnormalized: Tensor, bound: float, min_size: float) -> tuple[Tensor, Tensor]:
    """A spline's knots along one axis: softmax bin sizes, each at least ``min_size`` of the
    interval, their cumulative edges on [−bound, bound] (ends exact), and the sizes as the
    edges' differences. Shapes: (..., bins) -> edges (..., bins + 1), sizes (..., bins)."""
    bins = unnormalized.shape[-1]
    sizes = min_size + (1 - min_size * bins) * torch.softmax(unnormalized, dim=-1)
    edges = F.pad(torch.cumsum(sizes, dim=-1), (1, 0), value=0.0)
    edges = 2 * bound * edges - bound
    edges = torch.cat(
        [torch.full_like(edges[..., :1], -bound), edges[..., 1:-1], torch.full_like(edges[..., :1], bound)], -1
    )
    return edges, edges[..., 1:] - edges[..., :-1]


def spline_inverse(
    y: Tensor, widths: Tensor, heights: Tensor, derivatives: Tensor, bound: float, minimum: float = 1e-3
) -> Tensor:
    """The inverse of a monotonic rational-quadratic spline on [−bound, bound], the identity
    outside it (linear tails; Durkan et al., 2019, "Neural Spline Flows", eq. 4 solved for x as
    in their appendix A.3). ``widths``, ``heights``: unnormalised bin sizes; ``derivatives``:
    unnormalised inner knots' slopes (the end slopes are 1, to meet the tails).
    Shapes: y (...,); widths, heights (..., bins); derivatives (..., bins − 1) -> (...,)."""
    end = math.log(math.exp(1 - minimum) - 1)  # softplus⁻¹(1 − minimum): end slopes of exactly 1
    derivatives = F.pad(derivatives, (1, 1), value=end)
    slopes = minimum + F.softplus(derivatives)  # (..., bins + 1)
    x_edges, x_sizes = _bin_edges(widths, bound, minimum)
    y_edges, y_sizes = _bin_edges(heights, bound, minimum)
    search = torch.cat([y_edges[..., :-1], y_edges[..., -1:] + 1e-6], -1)  # the last bin holds y = bound
    k = ((y[..., None] >= search).sum(-1, keepdim=True) - 1).clamp(0, widths.shape[-1] - 1)  # (..., 1)

    def at(t: Tensor) -> Tensor:
        return t.gather(-1, k)[..., 0]

    x0, w, y0, h = at(x_edges), at(x_sizes), at(y_edges), at(y_sizes)
    d0, d1, s = at(slopes[..., :-1]), at(slopes[..., 1:]), at(y_sizes / x_sizes)
    # y − y0 = h (s ξ² + d0 ξ(1 − ξ)) / (s + (d0 + d1 − 2s) ξ(1 − ξ)), a quadratic a ξ² + b ξ + c = 0 in ξ
    a = (y - y0) * (d0 + d1 - 2 * s) + h * (s - d0)
    b = h * d0 - (y - y0) * (d0 + d1 - 2 * s)
    c = -s * (y - y0)
    xi = (2 * c) / (-b - torch.sqrt(b * b - 4 * a * c))  # the stable root (ξ in [0, 1])
    inside = (y >= -bound) & (y <= bound)
    return torch.where(inside, xi * w + x0, y)


# ----------------------------------------------------------------------------- text encoder


class RelativeAttention(nn.Module):
    """Multi-head self-attention with windowed relative positions (Shaw et al., 2018), the
    heads sharing one key and one value vector per offset; projections are kernel-1 convs."""

    def __init__(self, channels: int, n_heads: int, window: int) -> None:
        super().__init__()
        self.n_heads, self.window, k = n_heads, window, channels // n_heads
        self.conv_q, self.conv_k, self.conv_v, self.conv_o = (nn.Conv1d(channels, channels, 1) for _ in range(4))
        self.emb_rel_k = nn.Parameter(torch.randn(1, 2 * window + 1, k) * k**-0.5)
        self.emb_rel_v = nn.Parameter(torch.randn(1, 2 * window + 1, k) * k**-0.5)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """Shapes: x (B, hidden, S); mask (B, 1, S, S), True = may attend -> (B, hidden, S)."""
        b, d, s = x.shape
        h, k = self.n_heads, d // self.n_heads
        q = conv_frames(self.conv_q, x).view(b, h, k, s).transpose(2, 3) / math.sqrt(k)  # (B, H, S, K)
        key = conv_frames(self.conv_k, x).view(b, h, k, s).transpose(2, 3)  # (B, H, S, K)
        v = conv_frames(self.conv_v, x).view(b, h, k, s).transpose(2, 3)  # (B, H, S, K)
        index, near = relative_index(s, self.window, x.device)  # (S, S)
        by_offset = q @ self.emb_rel_k[0].transpose(0, 1)  # (B, H, S, 2w+1)
        relative = by_offset.gather(-1, index.expand(b, h, s, s)) * near  # (B, H, S, S)
        scores = (q @ key.transpose(-2, -1) + relative).masked_fill(~mask, MASKED)  # (B, H, S, S)
        weights = torch.softmax(scores, dim=-1)  # (B, H, S, S)
        out = weights @ v + band_of(weights, self.window) @ self.emb_rel_v[0]  # (B, H, S, K)
        # heads joined as (B, S, hidden) in memory: channels-last, as conv_frames reads it
        return conv_frames(self.conv_o, out.transpose(1, 2).reshape(b, s, d).transpose(1, 2))  # (B, hidden, S)


class ConvFeedForward(nn.Module):
    """The encoder's feed-forward: two same-padded convolutions with a ReLU between, padding masked."""

    def __init__(self, channels: int, filter_channels: int, kernel_size: int) -> None:
        super().__init__()
        self.conv_1 = nn.Conv1d(channels, filter_channels, kernel_size, padding=same_padding(kernel_size))
        self.conv_2 = nn.Conv1d(filter_channels, channels, kernel_size, padding=same_padding(kernel_size))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """Shapes: x (B, hidden, S); mask (B, 1, S) -> (B, hidden, S)."""
        x = torch.relu(conv_frames(self.conv_1, x * mask))
        return conv_frames(self.conv_2, x * mask) * mask


class ChannelNorm(nn.Module):
    """Layer norm over the channels of (B, channels, T) (VITS names its parameters gamma, beta)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Tensor) -> Tensor:
        return channel_norm(x, self.gamma, self.beta)


class RelativeEncoder(nn.Module):
    """Post-norm Transformer blocks: x = norm(x + attention(x)); x = norm(x + ffn(x))."""

    def __init__(self, c: VitsConfig) -> None:
        super().__init__()
        n = c.n_layers
        self.attn_layers = nn.ModuleList(RelativeAttention(c.hidden, c.n_heads, c.window) for _ in range(n))
        self.norm_layers_1 = nn.ModuleList(ChannelNorm(c.hidden) for _ in range(n))
        self.ffn_layers = nn.ModuleList(ConvFeedForward(c.hidden, c.filter_channels, c.kernel_size) for _ in range(n))
        self.norm_layers_2 = nn.ModuleList(ChannelNorm(c.hidden) for _ in range(n))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """Shapes: x (B, hidden, S); mask (B, 1, S) -> (B, hidden, S)."""
        pairs = mask.unsqueeze(2) & mask.unsqueeze(-1)  # (B, 1, S, S)
        mask = mask.to(x.dtype)  # multiplied from here on: as 0/1 floats (Vits.latent says why)
        x = x * mask
        for attn, norm_1, ffn, norm_2 in zip(
            self.attn_layers, self.norm_layers_1, self.ffn_layers, self.norm_layers_2, strict=True
        ):
            x = norm_1(x + attn(x, pairs))
            x = norm_2(x + ffn(x, mask))
        return x * mask


class TextEncoder(nn.Module):
    """Phoneme ids to the encoder's states and the prior's mean and log-std per phoneme."""

    def __init__(self, c: VitsConfig) -> None:
        super().__init__()
        self.emb = nn.Embedding(c.n_symbols, c.hidden)
        nn.init.normal_(self.emb.weight, 0.0, c.hidden**-0.5)
        self.encoder = RelativeEncoder(c)
        self.proj = nn.Conv1d(c.hidden, 2 * c.inter_channels, 1)

    def forward(self, ids: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Shapes: ids (B, S); lengths (B,) -> states (B, hidden, S), mean and log-std
        (B, inter_channels, S), mask (B, 1, S) True at phonemes."""
        x = (self.emb(ids) * math.sqrt(self.emb.embedding_dim)).transpose(1, 2)  # (B, hidden, S)
        mask = sequence_mask(lengths, ids.shape[1])
        x = self.encoder(x, mask)
        mean, log_std = (conv_frames(self.proj, x) * mask.to(x.dtype)).chunk(2, dim=1)
        return x, mean, log_std, mask


# ----------------------------------------------------------------------------- durations


class DilatedDepthSeparableConv(nn.Module):
    """VITS's DDSConv: residual layers of a depthwise convolution (dilation kernel^i), norm,
    GELU, a 1×1 convolution, norm, GELU; an optional condition is added to the input."""

    def __init__(self, channels: int, kernel_size: int, n_layers: int) -> None:
        super().__init__()
        dilations = [kernel_size**i for i in range(n_layers)]
        self.convs_sep = nn.ModuleList(
            nn.Conv1d(
                channels, channels, kernel_size, groups=channels, dilation=d, padding=same_padding(kernel_size, d)
            )
            for d in dilations
        )
        self.convs_1x1 = nn.ModuleList(nn.Conv1d(channels, channels, 1) for _ in dilations)
        self.norms_1 = nn.ModuleList(ChannelNorm(channels) for _ in dilations)
        self.norms_2 = nn.ModuleList(ChannelNorm(channels) for _ in dilations)

    def forward(self, x: Tensor, mask: Tensor, condition: Tensor | None = None) -> Tensor:
        """Shapes: x, condition (B, channels, S); mask (B, 1, S) -> (B, channels, S)."""
        if condition is not None:
            x = x + condition
        for sep, pointwise, norm_1, norm_2 in zip(
            self.convs_sep, self.convs_1x1, self.norms_1, self.norms_2, strict=True
        ):
            y = F.gelu(norm_1(conv_frames(sep, x * mask)))
            x = x + F.gelu(norm_2(conv_frames(pointwise, y)))
        return x * mask


class SplineCoupling(nn.Module):
    """VITS's ConvFlow: the second of two channels through a rational-quadratic spline whose
    knots a DDSConv stack reads from the first channel and the text (run backwards here)."""

    def __init__(self, c: VitsConfig) -> None:
        super().__init__()
        f, self.bins, self.bound = c.dp_filter_channels, c.dp_bins, c.dp_tail_bound
        self.pre = nn.Conv1d(1, f, 1)
        self.convs = DilatedDepthSeparableConv(f, c.dp_kernel_size, 3)
        self.proj = nn.Conv1d(f, 3 * c.dp_bins - 1, 1)
        nn.init.zeros_(self.proj.weight)  # starts as the identity (VITS's init)
        nn.init.zeros_(self.proj.bias)

    def inverse(self, z: Tensor, mask: Tensor, text: Tensor) -> Tensor:
        """Shapes: z (B, 2, S); mask (B, 1, S); text (B, dp_filter_channels, S) -> (B, 2, S)."""
        z0, z1 = z[:, :1], z[:, 1:]
        h = conv_frames(self.proj, self.convs(conv_frames(self.pre, z0), mask, text)) * mask  # (B, 3·bins − 1, S)
        h = h.transpose(1, 2)  # (B, S, 3·bins − 1)
        scale = math.sqrt(self.pre.out_channels)  # VITS divides the bin logits by √filter_channels
        widths, heights = h[..., : self.bins] / scale, h[..., self.bins : 2 * self.bins] / scale
        x1 = spline_inverse(z1[:, 0], widths, heights, h[..., 2 * self.bins :], self.bound)  # (B, S)
        return torch.cat([z0, x1[:, None]], dim=1) * mask


class ElementwiseAffine(nn.Module):
    """y = m + e^logs ⊙ x per channel (the duration flow's first step)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.m = nn.Parameter(torch.zeros(channels, 1))
        self.logs = nn.Parameter(torch.zeros(channels, 1))

    def inverse(self, z: Tensor, mask: Tensor) -> Tensor:
        return (z - self.m) * torch.exp(-self.logs) * mask


class StochasticDurationPredictor(nn.Module):
    """Log durations from the text and noise: the noise (B, 2, S) goes backwards through the
    spline couplings (each followed by a channel flip) and the affine step; the first channel
    is log w (VITS eq. 12, inference). As in VITS, the first coupling is left out at inference
    (it only ever sees the unused second channel: its ``flows.1`` is not in published exports)."""

    def __init__(self, c: VitsConfig) -> None:
        super().__init__()
        f = c.dp_filter_channels
        self.pre = nn.Conv1d(c.hidden, f, 1)
        self.convs = DilatedDepthSeparableConv(f, c.dp_kernel_size, 3)
        self.proj = nn.Conv1d(f, f, 1)
        if c.speaker_channels:
            self.cond = nn.Conv1d(c.speaker_channels, f, 1)
        # VITS's layout: flows.0 affine, then (coupling, flip) pairs at 1,2 3,4 ...; flips hold nothing
        self.flows = nn.ModuleDict({"0": ElementwiseAffine(2)})
        for i in range(1, c.dp_flows):
            self.flows[str(2 * i + 1)] = SplineCoupling(c)

    def forward(self, x: Tensor, mask: Tensor, noise: Tensor, speaker: Tensor | None = None) -> Tensor:
        """Shapes: x (B, hidden, S); mask (B, 1, S); noise (B, 2, S), already scaled by noise_w;
        speaker (B, speaker_channels, 1) -> log durations (B, 1, S)."""
        x = conv_frames(self.pre, x)
        if speaker is not None:
            x = x + self.cond(speaker)
        text = conv_frames(self.proj, self.convs(x, mask)) * mask
        z = noise
        for i in reversed(range(1, len(self.flows))):
            z = self.flows[str(2 * i + 1)].inverse(z.flip(1), mask, text)
        z = self.flows["0"].inverse(z.flip(1), mask)
        return z[:, :1]


# ----------------------------------------------------------------------------- latent flow


def gated(x: Tensor) -> Tensor:
    """WaveNet's gate: tanh of the first half of the channels times sigmoid of the second.
    tanh(a) is taken as 2·sigmoid(2a) − 1 (the same function; float error about 1e-7): PyTorch's
    tanh took about 3 times its sigmoid's CPU time on the flow's (1, 192, 300) halves, the gate
    386 -> 231 µs (AVX2, 1 thread, best of 200, contended machine). Out of place: a vocoder's
    WaveNet (``mel_vocoder.py``) is trained through it."""
    a, b = x.chunk(2, dim=1)
    return (torch.sigmoid(a * 2) * 2 - 1) * torch.sigmoid(b)


class WaveNet(nn.Module):
    """VITS's WN: gated dilated convolutions whose outputs are summed as skips (the last layer
    is a skip alone); a speaker condition adds a slice per layer of ``cond_layer``'s output."""

    def __init__(self, channels: int, kernel_size: int, n_layers: int, speaker_channels: int) -> None:
        super().__init__()
        self.channels = channels
        pad = same_padding(kernel_size)
        self.in_layers = nn.ModuleList(
            nn.Conv1d(channels, 2 * channels, kernel_size, padding=pad) for _ in range(n_layers)
        )
        self.res_skip_layers = nn.ModuleList(
            nn.Conv1d(channels, 2 * channels if i < n_layers - 1 else channels, 1) for i in range(n_layers)
        )
        if speaker_channels:
            self.cond_layer = nn.Conv1d(speaker_channels, 2 * channels * n_layers, 1)

    def forward(self, x: Tensor, mask: Tensor, speaker: Tensor | None = None) -> Tensor:
        """Shapes: x (B, channels, T); mask (B, 1, T); speaker (B, speaker_channels, 1) -> (B, channels, T)."""
        c = self.channels
        conditions = self.cond_layer(speaker).split(2 * c, dim=1) if speaker is not None else None
        out = torch.zeros_like(x)
        for i, (conv, res_skip) in enumerate(zip(self.in_layers, self.res_skip_layers, strict=True)):
            h = conv_frames(conv, x, taps=True)  # (B, 2·channels, T)
            h = h if conditions is None else h + conditions[i]
            y = conv_frames(res_skip, gated(h))
            if i < len(self.in_layers) - 1:
                x = (x + y[:, :c]) * mask
                out = out + y[:, c:]
            else:
                out = out + y
        return out * mask


class MeanCoupling(nn.Module):
    """VITS's mean-only ResidualCouplingLayer: the second half of the channels shifted by a
    WaveNet's reading of the first half (backwards: subtracted)."""

    def __init__(self, c: VitsConfig) -> None:
        super().__init__()
        half = c.inter_channels // 2
        self.pre = nn.Conv1d(half, c.hidden, 1)
        self.enc = WaveNet(c.hidden, c.flow_kernel_size, c.flow_layers, c.speaker_channels)
        self.post = nn.Conv1d(c.hidden, half, 1)
        nn.init.zeros_(self.post.weight)  # starts as the identity (VITS's init)
        nn.init.zeros_(self.post.bias)

    def inverse(self, z: Tensor, mask: Tensor, speaker: Tensor | None) -> Tensor:
        """Shapes: z (B, inter_channels, T); mask (B, 1, T) -> (B, inter_channels, T)."""
        z0, z1 = z.chunk(2, dim=1)
        shift = conv_frames(self.post, self.enc(conv_frames(self.pre, z0) * mask, mask, speaker)) * mask
        return torch.cat([z0, (z1 - shift) * mask], dim=1)


class LatentFlow(nn.Module):
    """VITS's ResidualCouplingBlock: (coupling, channel flip) pairs, run backwards from the
    prior's sample to the latent the generator reads (``flows.0``, ``flows.2``, ...)."""

    def __init__(self, c: VitsConfig) -> None:
        super().__init__()
        self.flows = nn.ModuleDict({str(2 * i): MeanCoupling(c) for i in range(c.flow_couplings)})

    def inverse(self, z: Tensor, mask: Tensor, speaker: Tensor | None = None) -> Tensor:
        """Shapes: z (B, inter_channels, T); mask (B, 1, T) -> (B, inter_channels, T)."""
        for key in reversed(list(self.flows)):
            z = self.flows[key].inverse(z.flip(1), mask, speaker)
        return z


# ----------------------------------------------------------------------------- generator


class ResBlock(nn.Module):
    """HiFi-GAN's residual block: per dilation, x += conv(lrelu(x)) ("2"), or
    x += conv₂(lrelu(conv₁(lrelu(x)))) with conv₂ undilated ("1")."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...], two_convs: bool) -> None:
        super().__init__()

        def conv(d: int) -> nn.Conv1d:
            return nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=same_padding(kernel_size, d))

        if two_convs:  # VITS's names: convs1 (dilated) and convs2 (undilated), or convs
            self.convs1 = nn.ModuleList(conv(d) for d in dilations)
            self.convs2 = nn.ModuleList(conv(1) for _ in dilations)
        else:
            self.convs = nn.ModuleList(conv(d) for d in dilations)

    def forward(
        self, x: Tensor, activated: Tensor | None = None, valid: int | None = None, *, fused: bool = False
    ) -> Tensor:
        """The block's output, a fresh tensor (``x`` is left as it is: the other blocks read it).
        ``activated``: lrelu(x) if the caller has it (the blocks of one upsampling share it).
        ``fused``: the generator's fused path (its caller decides, for every block alike).
        ``valid``: on the fused path, the samples past it are padding (:class:`Generator`), kept
        zero between the convolutions (the block's output's are left to the caller).
        Shapes: x, activated (B, channels, 1, samples) channels-last (:func:`conv_rows`) -> the same."""
        pairs = list(
            zip(self.convs1, self.convs2, strict=True) if hasattr(self, "convs1") else ((c, None) for c in self.convs)
        )
        for i, (first, second) in enumerate(pairs):
            y = activated if i == 0 and activated is not None else F.leaky_relu(x, LRELU_SLOPE)
            last = first if second is None else second
            if fused:
                if second is not None:
                    y = zero_tail(conv_rows_fused(first, y, slope=LRELU_SLOPE), valid)
                # the first sum makes the block's own tensor; the later ones go into it
                x = conv_rows_fused(last, y, residual=x, in_place=i > 0)
                x = zero_tail(x, valid) if i < len(pairs) - 1 else x
            else:
                y = y if second is None else F.leaky_relu(conv_rows(first, y), LRELU_SLOPE)
                x = x + conv_rows(last, y)
        return x


class Generator(nn.Module):
    """HiFi-GAN's generator: the latent upsampled by transposed convolutions, each followed by
    the mean of the multi-receptive-field residual blocks, to a tanh waveform."""

    def __init__(self, c: VitsConfig) -> None:
        super().__init__()
        ch = c.upsample_initial_channel
        self.conv_pre = nn.Conv1d(c.inter_channels, ch, 7, padding=3)
        if c.speaker_channels:
            self.cond = nn.Conv1d(c.speaker_channels, ch, 1)
        widths = [ch // 2**i for i in range(len(c.upsample_rates) + 1)]
        self.ups = nn.ModuleList(
            nn.ConvTranspose1d(widths[i], widths[i + 1], k, r, padding=(k - r) // 2)
            for i, (r, k) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes, strict=True))
        )
        self.resblocks = nn.ModuleList(
            ResBlock(w, k, d, c.resblock == "1")
            for w in widths[1:]
            for k, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = nn.Conv1d(widths[-1], 1, 7, padding=3, bias=False)
        self.kernels, self.rates = len(c.resblock_kernel_sizes), c.upsample_rates

    def pads(self) -> bool:
        """Whether the fused path pads the frames: each upsampling's output must be rate × its
        input (HiFi-GAN's: kernel = rate + 2·padding)."""
        return all(up.kernel_size[0] - 2 * up.padding[0] == up.stride[0] for up in self.ups)

    def layout_jobs(self, batch: int, frames: int) -> list[tuple[nn.Conv1d | nn.ConvTranspose1d, tuple[int, ...]]]:
        """Each oneDNN convolution of :meth:`forward` on ``frames`` padded frames and the size
        of its input (B, channels, 1, samples), for :func:`~qkv.onednn_conv.learn_layouts`."""
        jobs = []  # conv_pre is conv_frames' matrix products (onednn_conv.conv_taps): no layout
        for i, (up, rate) in enumerate(zip(self.ups, self.rates, strict=True)):
            jobs.append((up, (batch, up.in_channels, 1, frames)))
            frames *= rate
            for block in self.resblocks[i * self.kernels : (i + 1) * self.kernels]:
                jobs += [(c, (batch, up.out_channels, 1, frames)) for c in block.modules() if isinstance(c, nn.Conv1d)]
        return [*jobs, (self.conv_post, (batch, self.conv_post.in_channels, 1, frames))]

    def forward(self, z: Tensor, speaker: Tensor | None = None) -> Tensor:
        """Shapes: z (B, inter_channels, T); speaker (B, speaker_channels, 1) -> (B, 1, T·hop).

        On the fused path (:func:`fusable`) the frames are padded with zeros to
        :func:`padded_frames` and every convolution's output past the real samples is zeroed
        before the next one reads it, so the real samples are those of the unpadded run (each
        convolution sees zeros past the end, as its own zero padding gives) and the padding is cut
        off the waveform: oneDNN makes (and compiles) a convolution for each new length, work on
        one thread that cost about as much as the generator's own arithmetic for a new
        sentence's length (measured on 2 busy cores), and padded lengths repeat."""
        # oneDNN's fused operators record nothing: the plain path wherever autograd records the
        # weights, and the same path for every block (a block deciding alone, from an input that
        # required grad through conv_pre's weight, took the plain path on padded frames)
        inplace = fusable(z) and not (torch.is_grad_enabled() and self.conv_pre.weight.requires_grad)
        frames = z.shape[-1]
        # padding needs each upsampling's output to be rate × its input (HiFi-GAN's: k = rate + 2·padding)
        padded = inplace and self.pads()
        if padded:
            z = F.pad(z, (0, padded_frames(frames) - frames))
        x = conv_frames(self.conv_pre, z, taps=True)
        if speaker is not None:
            x = x + self.cond(speaker)
        x = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)  # (B, channels, 1, T)
        valid, scale = frames if padded else None, 1.0
        x = zero_tail(x, valid)
        conv = conv_rows_fused if inplace else conv_rows
        for i, (up, rate) in enumerate(zip(self.ups, self.rates, strict=True)):
            valid = valid * rate if padded else None
            x = zero_tail(conv(up, F.leaky_relu(x, LRELU_SLOPE), scale), valid)
            activated = F.leaky_relu(x, LRELU_SLOPE)  # every block's first convolution reads it
            blocks = self.resblocks[i * self.kernels : (i + 1) * self.kernels]
            total = blocks[0](x, activated, valid, fused=inplace)
            for block in blocks[1:]:
                total = total.add_(block(x, activated, valid, fused=True)) if inplace else total + block(x, activated)
            # the blocks' mean: 1/kernels goes into the next convolution's weight instead of a
            # pass over the sum, as lrelu(t / k) = lrelu(t) / k (leaky ReLU is positively homogeneous)
            x, scale = zero_tail(total, valid), 1.0 / self.kernels
        x = F.leaky_relu_(x) if inplace else F.leaky_relu(x)  # PyTorch's default slope (0.01) here, as HiFi-GAN
        x = conv(self.conv_post, x, scale)[:, :, 0]  # (B, 1, samples)
        x = x[..., : frames * math.prod(self.rates)] if padded else x
        return torch.tanh_(x) if inplace else torch.tanh(x)


# ----------------------------------------------------------------------------- the voice


@dataclass(frozen=True)
class Speech:
    """What :meth:`Vits.forward` gives. Shapes: waveform (B, samples), zero past each length;
    lengths (B,) samples; durations (B, S) whole frames per phoneme."""

    waveform: Tensor
    lengths: Tensor
    durations: Tensor


class Vits(nn.Module):
    """A VITS voice at inference: phoneme ids to waveform (the module docstring lists the parts)."""

    def __init__(self, config: VitsConfig) -> None:
        super().__init__()
        self.config = config
        self.enc_p = TextEncoder(config)
        self.dp = StochasticDurationPredictor(config)
        self.flow = LatentFlow(config)
        self.dec = Generator(config)
        if config.n_speakers > 1:
            self.emb_g = nn.Embedding(config.n_speakers, config.speaker_channels)

    @torch.no_grad()
    def forward(
        self,
        ids: Tensor,
        lengths: Tensor,
        *,
        speakers: Tensor | None = None,
        noise_scale: float | None = None,
        length_scale: float | None = None,
        noise_w: float | None = None,
        duration_noise: Tensor | None = None,
        latent_noise: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Speech:
        """Speak a batch of phoneme id sequences (VITS's ``infer``): :meth:`latent`, then the
        generator. The scales default to the voice's; the noise, standard normal, is drawn from
        ``generator`` unless given.

        Shapes: ids (B, S); lengths (B,); speakers (B,) for a voice of several;
        duration_noise (B, 2, S); latent_noise (B, inter_channels, T), T the frames the
        durations give (run once without it to learn T) -> :class:`Speech`.
        """
        z, frames, durations = self.latent(
            ids,
            lengths,
            speakers=speakers,
            noise_scale=noise_scale,
            length_scale=length_scale,
            noise_w=noise_w,
            duration_noise=duration_noise,
            latent_noise=latent_noise,
            generator=generator,
        )
        wave = self.dec(z, self._speaker(speakers))[:, 0]  # (B, T·hop)
        samples = frames * self.config.hop
        keep = torch.arange(wave.shape[-1], device=wave.device)[None, :] < samples[:, None]
        return Speech(waveform=wave * keep, lengths=samples, durations=durations)

    @torch.no_grad()
    def latent(
        self,
        ids: Tensor,
        lengths: Tensor,
        *,
        speakers: Tensor | None = None,
        noise_scale: float | None = None,
        length_scale: float | None = None,
        noise_w: float | None = None,
        duration_noise: Tensor | None = None,
        latent_noise: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """What the generator reads: the latent z (zero past each length), the frames and the
        durations, the noise drawn as :meth:`forward` draws it (so the same ``generator`` seed
        gives the z of the same speech). A neural vocoder's training pairs are made of it.

        Shapes: as :meth:`forward` -> z (B, inter_channels, T), frames (B,), durations (B, S).
        """
        c = self.config
        noise_scale = c.noise_scale if noise_scale is None else noise_scale
        length_scale = c.length_scale if length_scale is None else length_scale
        noise_w = c.noise_w if noise_w is None else noise_w
        states, mean, log_std, mask = self.enc_p(ids, lengths)
        speaker = self._speaker(speakers)
        if duration_noise is None:
            duration_noise = torch.randn(ids.shape[0], 2, ids.shape[1], generator=generator, device=ids.device)
        # the duration predictor and the flow only multiply by their masks: as 0/1 floats, as a
        # boolean one makes each product cast it to a float copy first (PyTorch on the CPU). The
        # same numbers; paired A/B in one process on the 50 bench captions (2 threads, contended):
        # the duration predictor's main-thread CPU -10%, the flow's -4%, the voice's -1.6%
        weights = mask.to(states.dtype)
        log_w = self.dp(states, weights, duration_noise * noise_w, speaker)  # (B, 1, S)
        durations = torch.ceil(torch.exp(log_w) * weights * length_scale)[:, 0]  # (B, S)
        frames = durations.sum(-1).clamp_min(1).long()  # (B,)
        frame_mask = sequence_mask(frames, int(frames.max()))  # (B, 1, T)
        if fusable(states) and self.dec.pads():
            # the generator's length is known now: its convolutions' layouts are learnt on
            # another thread while the flow runs (a new length's cost them about 40 ms of CPU)
            learn_layouts(self.dec.layout_jobs(ids.shape[0], padded_frames(frame_mask.shape[-1])))
        path = alignment_path(durations, frame_mask.shape[-1]) * (mask.transpose(1, 2) & frame_mask)  # (B, S, T)
        prior = (mean @ path, log_std @ path)  # (B, inter_channels, T) each
        z = self._sample(prior, frame_mask, speaker, noise_scale, latent_noise, generator)
        return z, frames, durations

    def _sample(
        self,
        prior: tuple[Tensor, Tensor],
        frame_mask: Tensor,
        speaker: Tensor | None,
        noise_scale: float,
        latent_noise: Tensor | None,
        generator: torch.Generator | None,
    ) -> Tensor:
        """A sample of the prior (mean, log-std per frame) through the flow backwards: the
        generator's input. Shapes: prior (B, inter_channels, T) each; frame_mask (B, 1, T) ->
        (B, inter_channels, T), zero past each length."""
        mean, log_std = prior
        if latent_noise is None:
            latent_noise = torch.randn(mean.shape, generator=generator, device=mean.device)
        elif latent_noise.shape != mean.shape:
            raise ValueError(
                f"latent_noise has shape {tuple(latent_noise.shape)}; these durations need {tuple(mean.shape)}"
            )
        z = mean + latent_noise * torch.exp(log_std) * noise_scale
        weights = frame_mask.to(z.dtype)  # 0/1 floats: Vits.latent says why
        return self.flow.inverse(z, weights, speaker) * weights

    def _speaker(self, speakers: Tensor | None) -> Tensor | None:
        """The speakers' embeddings (B, speaker_channels, 1), for a voice of several (else None)."""
        if self.config.n_speakers <= 1:
            if speakers is not None:
                raise ValueError("this voice has one speaker; give no speakers")
            return None
        if speakers is None:
            raise ValueError(f"this voice has {self.config.n_speakers} speakers; give one per sequence")
        return self.emb_g(speakers)[..., None]
