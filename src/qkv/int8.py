"""Weight-only int8 linear layers for decoding on CPUs (``--int8``): :func:`quantize_channels`
(symmetric int8 weights, one scale per output channel), :func:`int8_linear` (the explicit
product: dequantize, then multiply), :class:`Int8Linear` (the module, with PyTorch's int8-weight
kernel as its fast path) and :class:`Bf16Linear` (the vocabulary projection, kept in bfloat16).

Why weight-only: activations are not quantized, so an outlier feature in the residual stream
(Whisper has large ones) cannot coarsen the other features of its token, as a per-tensor or
per-token activation scale does (Dettmers et al., 2022, LLM.int8()). Why bfloat16 for the output
projection: its logits decide every token, and int8 rows flip near ties (measured on Whisper
tiny.en in docs/speed.md). The copying of a model is in ``decoding_copies.int8_linears``.

What is not here: which layers a model gets (``decoding_copies``), dynamic activation
quantization (PyTorch's fbgemm one is what ``--int8`` used before; it lost words).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

INT8_MAX = 127  # symmetric: [-127, 127], so -x quantizes to -q
FAST_MULTIPLE = 16  # torch._weight_int8pack_mm's CPU kernel needs in_features % 16 == 0 (others crash)
# From this many rows on (an encoder's frames, a prompt), a bfloat16 GEMM on the weights dequantized
# for the call beats the int8-weight kernel, which is tuned for a few rows (bench: 1500 x 384 x 1536
# took 27 ms with it, 10 ms this way, 20 ms in float32); dequantizing costs N * K, the product M * N * K.
MANY_ROWS = 32


def quantize_channels(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8: ``weight ≈ q * scale[:, None]`` with
    ``scale = max |row| / 127`` and ``q = round(weight / scale)``.

    Shapes: weight (N, K) -> q (N, K) int8, scale (N,) float32.
    """
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / INT8_MAX  # (N,)
    q = torch.round(weight / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)  # (N, K)
    return q, scale


def int8_linear(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """The explicit product: ``x @ (q * scale)ᵀ + bias`` in float32 (the reference for the fast path).

    Shapes: x (..., K), q (N, K), scale (N,), bias (N,) -> (..., N).
    """
    return F.linear(x.float(), q.float() * scale[:, None], bias)  # (..., N)


class Int8Linear(nn.Module):
    """An ``nn.Linear`` with int8 weights (per-output-channel scales) and float activations.

    On the CPU, when ``in_features`` is a multiple of 16, it runs ``torch._weight_int8pack_mm``
    (bfloat16 activations, int8 weights read as they are: a quarter of float32's bytes, which is
    what bounds decoding a token at a time), or for :data:`MANY_ROWS` rows and more a bfloat16
    product with the weights dequantized for the call; otherwise :func:`int8_linear`. The two agree up to
    bfloat16 rounding of the input and the product (tested). Inference only.

    Shapes: x (..., K) -> (..., N).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_channels(linear.weight)
        self.register_buffer("q", q)  # (N, K) int8
        self.register_buffer("scale", scale)  # (N,)
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16))  # (N,) what the kernel takes
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)  # (N,) or None

    def fast(self, x: Tensor) -> bool:
        """Whether ``x`` takes the int8-weight kernel (else the explicit product)."""
        return x.device.type == "cpu" and self.in_features % FAST_MULTIPLE == 0

    def forward(self, x: Tensor) -> Tensor:
        if not self.fast(x):
            return int8_linear(x, self.q, self.scale, self.bias).to(x.dtype)
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (M, K)
        if rows.shape[0] >= MANY_ROWS:
            weight = self.q.to(torch.bfloat16) * self.scale_bf16[:, None]  # (N, K)
            y = F.linear(rows, weight).to(x.dtype)  # (M, N)
        else:
            y = torch._weight_int8pack_mm(rows, self.q, self.scale_bf16).to(x.dtype)  # (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)  # (..., N)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


class Bf16Linear(nn.Module):
    """An ``nn.Linear`` whose weight is kept in bfloat16 (8 bits of mantissa, against int8's 7 for
    the row's largest value and fewer for the rest); float32 in and out.

    Shapes: x (..., K) -> (..., N).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16).clone())  # (N, K)
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).clone()
        self.register_buffer("bias", bias)  # (N,) or None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)  # (..., N)
