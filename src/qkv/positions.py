"""Position maths: how attention learns where its tokens are, by rotating queries and keys (RoPE)
or by a penalty on the scores (ALiBi).

What is here:
  * rotary position embedding (RoPE: Su et al., 2021, "RoFormer") with its scalings past the
    trained window (:class:`RopeScaling`: linear, dynamic NTK, Llama 3.1's, YaRN) and a
    self-attention's settings (:class:`Rope`); its frequencies (:func:`rope_frequencies`) and
    tables (:func:`rope_cos_sin`); the rotation as the textbook writes it (:func:`rope_apply`,
    :func:`rope_rotate`) and in three operators (:func:`rope_apply_rolled`, with the tables of
    :func:`rope_turn`, which a decoder stack computes once for all its layers);
  * ALiBi (Press et al., 2022): the per-head slopes and the distance penalty added to the scores
    (:func:`alibi_slopes`, :func:`alibi_bias`).

What is not here: attention itself, which applies these (``attention.py``, where the shape legend
is), and positions added to the embeddings, sinusoidal or learned (``layers.py``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv import layers

ROPE_SCALINGS = ("linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """How a RoPE model reaches past the window it was pretrained on (the ``rope_scaling`` of a
    Hugging Face config); :func:`rope_frequencies` applies it.

    Attributes:
        kind: "linear" (every frequency divided by ``factor``: Chen et al., 2023, "Extending
            Context Window ... via Positional Interpolation"), "dynamic" (NTK-aware: the base
            grows with the length read, bloc97/emozilla's rule as transformers has it), "llama3"
            (Llama 3.1: low frequencies divided by ``factor``, high ones kept, a smooth ramp
            between) or "yarn" (Peng et al., 2023, "YaRN", eqs. 18-21: a ramp between
            interpolated and extrapolated frequencies, cos and sin scaled by ``attention_factor``).
        factor: the scale s.
        original_max_len: the pretraining window (dynamic: the length from which the base grows).
        low_freq_factor, high_freq_factor: Llama 3.1's wavelength bounds (window / factor).
        beta_fast, beta_slow: YaRN's ramp bounds, in rotations over the window.
        attention_factor: YaRN's scale of cos and sin (None: 0.1·ln(s) + 1, eq. 21).
        truncate: YaRN rounds its ramp's ends to whole dimensions.
    """

    kind: str
    factor: float
    original_max_len: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"rope scaling kind must be one of {ROPE_SCALINGS}, got {self.kind!r}")
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor!r}")
        if self.kind != "linear" and not (isinstance(self.original_max_len, int) and self.original_max_len > 0):
            raise ValueError(f"{self.kind} rope scaling needs original_max_len, a positive integer")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor > 0")

    @classmethod
    def of(cls, value: RopeScaling | dict | None) -> RopeScaling | None:
        """A RopeScaling from itself, the dict config.json holds, or None."""
        return cls(**value) if isinstance(value, dict) else value


@dataclass(frozen=True)
class Rope:
    """A self-attention's RoPE settings: the base of its frequencies (HF's ``rope_theta``) and
    its scaling past the trained window (None: none)."""

    base: float = 10000.0
    scaling: RopeScaling | None = None


def rope_frequencies(
    width: int, *, base: float = 10000.0, scaling: RopeScaling | None = None, length: int = 0, device=None
) -> tuple[Tensor, float]:
    """RoPE's inverse frequencies base^(-2i/K) for heads of ``width`` K, as ``scaling`` changes
    them for a sequence of ``length`` positions (only "dynamic" reads it), and the factor
    by which cos and sin are scaled (YaRN's attention factor; else 1). Each rule is the
    formula of the paper or model named in :class:`RopeScaling`, written as transformers
    computes it, so imported checkpoints rotate exactly as there.

    Shapes: returns (K/2,) float32 and a Python float.
    """
    steps = torch.arange(0, width, 2, device=device, dtype=torch.float32) / width  # (K/2,): 2i/K
    if scaling is None or scaling.kind in ("linear", "llama3"):
        inv_freq = 1.0 / (base**steps)  # (K/2,)
        if scaling is None:
            return inv_freq, 1.0
        if scaling.kind == "linear":  # positions p/s: the same as frequencies / s
            return inv_freq / scaling.factor, 1.0
        return _llama3_frequencies(inv_freq, scaling), 1.0
    if scaling.kind == "dynamic":
        # NTK-aware: base·(s·L/L₀ − (s − 1))^(K/(K−2)) for L = max(length, L₀) positions.
        longest = max(length, scaling.original_max_len)
        grown = base * ((scaling.factor * longest / scaling.original_max_len) - (scaling.factor - 1)) ** (
            width / (width - 2)
        )
        return 1.0 / (grown**steps), 1.0
    return _yarn_frequencies(width, base, scaling, steps)


def _llama3_frequencies(inv_freq: Tensor, scaling: RopeScaling) -> Tensor:
    """Llama 3.1: wavelengths longer than L₀/low_freq_factor divided by s, shorter than
    L₀/high_freq_factor kept, a linear ramp (in L₀/wavelength) between. Shapes: (K/2,) -> (K/2,)."""
    s, low, high, old = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_len
    wavelength = 2 * math.pi / inv_freq  # (K/2,)
    scaled = torch.where(wavelength > old / low, inv_freq / s, inv_freq)
    smooth = (old / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / s + smooth * scaled
    medium = ~(wavelength < old / high) & ~(wavelength > old / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_frequencies(width: int, base: float, scaling: RopeScaling, steps: Tensor) -> tuple[Tensor, float]:
    """YaRN (Peng et al., 2023, section 3.2): dimensions that turn fewer than β_slow times over
    the window are interpolated (frequency / s), more than β_fast times extrapolated (kept), a
    linear ramp between (eq. 18-19); cos and sin scaled by 0.1·ln(s) + 1 (eq. 21) unless given.
    Shapes: steps (K/2,); returns (K/2,) and a Python float."""
    s, window = scaling.factor, scaling.original_max_len
    factor = scaling.attention_factor if scaling.attention_factor is not None else _yarn_mscale(s)

    def dimension(rotations: float) -> float:  # the dimension that turns ``rotations`` times over the window
        return (width * math.log(window / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, width - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(width // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(steps.device)
    extrapolated = 1 - ramp  # (K/2,): 1 keeps the frequency, 0 interpolates it
    frequencies = base**steps  # (K/2,)
    inv_freq = (1.0 / (s * frequencies)) * (1 - extrapolated) + (1.0 / frequencies) * extrapolated
    return inv_freq, factor


def _yarn_mscale(factor: float) -> float:
    """YaRN's attention temperature √(1/t) = 0.1·ln(s) + 1 (eq. 21); 1 without stretching."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def rope_rotate(x: Tensor, positions: Tensor, *, base: float = 10000.0, scaling: RopeScaling | None = None) -> Tensor:
    """Rotary position embedding (Su et al., 2021, "RoFormer", eq. 34), rotate-half layout.

    Pairs (x[i], x[i + K/2]) are rotated by angle pos * base^(-2i/K) (as ``scaling`` changes
    the frequencies), so that the score q·k depends on positions only through their difference.

    Shapes:
        x: (B, H, T, K); positions: (B, T) or (T,) integer positions.
        returns: (B, H, T, K).
    """
    cos, sin = rope_cos_sin(positions, width=x.shape[-1], dtype=x.dtype, device=x.device, base=base, scaling=scaling)
    return rope_apply(x, cos, sin)


def rope_cos_sin(
    positions: Tensor,
    *,
    width: int,
    dtype: torch.dtype,
    device: torch.device,
    base: float = 10000.0,
    scaling: RopeScaling | None = None,
) -> tuple[Tensor, Tensor]:
    """cos and sin of RoPE's angles pos * base^(-2i/K) for heads of ``width`` K, each angle twice
    (rotate-half layout), with the frequencies and factor of :func:`rope_frequencies`. Computed
    once, they rotate queries and keys alike (:func:`rope_apply`).

    Shapes:
        positions: (B, T) or (T,); returns: cos, sin, each (B, 1, T, K) (B = 1 for (T,) positions).
    """
    if scaling is not None and scaling.kind == "dynamic":  # reads how far the positions reach (a host sync)
        length = int(positions.max()) + 1
        inv_freq, factor = rope_frequencies(width, base=base, scaling=scaling, length=length, device=device)
    elif layers.exporting():  # a traced graph computes them (a cached tensor is no graph constant)
        inv_freq, factor = rope_frequencies(width, base=base, scaling=scaling, device=device)
    else:
        inv_freq, factor = _frequencies_once(width, float(base), scaling, torch.device(device))
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (B, T, K/2)
    angles = torch.cat([angles, angles], dim=-1)  # (B, T, K): each angle twice (rotate-half layout)
    if angles.dim() == 2:
        angles = angles[None]  # (1, T, K)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # (B, 1, T, K) each
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


@functools.lru_cache(maxsize=64)
def _frequencies_once(
    width: int, base: float, scaling: RopeScaling | None, device: torch.device
) -> tuple[Tensor, float]:
    """:func:`rope_frequencies` of a kind that does not read the length (all but "dynamic"), computed
    once per settings: a decoding step would otherwise recompute them in every layer (4 small
    operators each, 120 a token in a 30-layer model). Shared: nobody writes to them."""
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable in training too
        return rope_frequencies(width, base=base, scaling=scaling, device=device)


def rope_apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each pair (x[i], x[i + K/2]) by the angles whose ``cos`` and ``sin`` are given
    (:func:`rope_cos_sin`): x·cos + rotate_half(x)·sin.

    Shapes:
        x: (B, H, T, K); cos, sin: (B, 1, T, K). returns: (B, H, T, K).
    """
    k = x.shape[-1]
    x1, x2 = x[..., : k // 2], x[..., k // 2 :]  # (B, H, T, K/2)
    rotated = torch.cat([-x2, x1], dim=-1)  # (B, H, T, K)
    return x * cos + rotated * sin


def rope_turn(
    positions: Tensor,
    *,
    width: int,
    dtype: torch.dtype,
    device: torch.device,
    base: float = 10000.0,
    scaling: RopeScaling | None = None,
) -> tuple[Tensor, Tensor]:
    """RoPE's tables for :func:`rope_apply_rolled`: cos as :func:`rope_cos_sin` gives it, and its
    sin with the sign of the rotation folded in (−sin on the first half, sin on the second). A
    decoder stack computes them once for all its layers (one step of a 30-layer model would
    otherwise compute the same angles 30 times).

    Shapes:
        positions: (B, T) or (T,); returns: cos, signed sin, each (B, 1, T, K).
    """
    cos, sin = rope_cos_sin(positions, width=width, dtype=dtype, device=device, base=base, scaling=scaling)
    half = width // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # (B, 1, T, K) each


def rope_apply_rolled(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """:func:`rope_apply` in three operators instead of seven: rotate_half(x)·sin equals
    roll(x, K/2)·signed_sin, since rolling by half the width swaps the halves and
    :func:`rope_turn` folded the minus sign into the table. The same rotation (tested equal to
    :func:`rope_apply`); a decoding step is bound by its number of operators, not arithmetic.

    Shapes:
        x: (B, H, T, K); cos, signed_sin: (B, 1, T, K). returns: (B, H, T, K).
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)  # (B, H, T, K)


def alibi_slopes(n_heads: int) -> Tensor:
    """Per-head ALiBi slopes (Press et al., 2022, "Train Short, Test Long", section 3).

    For H a power of two the slopes are 2^(-8/H), 2^(-16/H), ...; otherwise the paper's
    rule: the slopes of the next lower power of two, then every other slope of the next
    higher one.

    Shapes:
        returns: (H,) float32.
    """

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        return torch.tensor(power_of_two(n_heads))
    lower = 2 ** math.floor(math.log2(n_heads))
    extra = power_of_two(2 * lower)[0::2][: n_heads - lower]
    return torch.tensor(power_of_two(lower) + extra)


def alibi_bias(n_heads: int, t: int, s: int, *, causal: bool, device: torch.device | None = None) -> Tensor:
    """Linear distance penalty added to attention scores (ALiBi).

    Query i sits at position ``s - t + i``. A causal model sees only keys behind it, so the
    penalty is slope * (j - i) <= 0; a bidirectional encoder uses -slope * |i - j|. Built in
    fp32 (distances above 256 are not exact in bf16); the attention casts it.

    Shapes:
        returns (1, H, T, S) float32.
    """
    slopes = alibi_slopes(n_heads).to(device)  # (H,)
    q_pos = torch.arange(s - t, s, device=device)[:, None]  # (T, 1)
    k_pos = torch.arange(s, device=device)[None, :]  # (1, S)
    distance = (k_pos - q_pos).float()  # (T, S)
    if not causal:
        distance = -distance.abs()
    return slopes[None, :, None, None] * distance[None, None]  # (1, H, T, S)
