"""Position-wise layers: feed-forward networks, norms, token embeddings and absolute positions.

What is here: :func:`dropout` and :class:`Dropout` (inverted dropout with a cheap mask),
:class:`FeedForward` (ReLU, GELU, tanh-approximated GELU, SiLU, SwiGLU, GEGLU; ``fuse_gate`` stacks a
gated one's two input matrices into one product for decoding),
:func:`make_norm` (LayerNorm or RMSNorm), :func:`sinusoidal_encoding` (sines and cosines
interleaved, or in two halves) and :class:`InputEmbedding`, which turns token ids
into the vectors a stack reads (token embedding, optional √D scaling, absolute positional
information, dropout), :class:`WideLinear`, a decoding copy of a widening ``nn.Linear`` whose
weight is stored input-major for the CPU's matrix-vector kernels, and :class:`PackedLinear`, a
bfloat16 (or float32) decoding copy whose weight is held in oneDNN's packed layout, with the
feed-forward's activation computed inside its product where asked.

What is not here: relative position schemes that act inside attention (RoPE, ALiBi live in
``attention.py``), blocks (``blocks.py``). Shapes use the legend of ``attention.py``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu_tanh")
GATED = ("swiglu", "geglu_tanh")  # the activations with a third (gate) matrix
# The activations oneDNN computes inside a product (PackedLinear's post-ops): name -> (attr, algorithm).
POST_OPS = {"relu": ("relu", ""), "gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh")}
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("sinusoidal", "sinusoidal_halves", "learned", "rope", "alibi", "none")


# Dropout draws its mask from 16 random bits per element: one 64-bit draw covers four elements.
_LEVELS = 1 << 16


def keep_mask(
    shape: torch.Size | tuple[int, ...], p: float, *, device: torch.device | str = "cpu"
) -> tuple[Tensor, float]:
    """A boolean mask, True with probability 1 - p', and the scale 1 / (1 - p') that makes
    ``x * mask * scale`` an unbiased estimate of x.

    p' is p rounded to a multiple of 2⁻¹⁶ (0.2 becomes 0.199997); the scale uses p' itself,
    so the expectation is exact. Why not ``torch.bernoulli``: it costs one float draw per
    element; one 64-bit draw here makes four 16-bit lanes, and the mask of a (64, 256, 384)
    activation takes about a fifth of ``F.dropout``'s time (2 cores, torch 2.13). The draws come
    from torch's default generator of ``device``, as ``F.dropout``'s do, so ``torch.manual_seed``
    covers them, and on the CPU so does the RNG state that ``--resume`` restores.

    Shapes:
        returns a mask of ``shape`` and a Python float.
    """
    if not 0.0 <= p < 1.0 - 0.5 / _LEVELS:
        raise ValueError(f"keep_mask needs 0 <= p < 1 - 2^-17, got {p}")
    n = math.prod(shape)
    dropped = round(p * _LEVELS)  # lanes in [-2¹⁵, -2¹⁵ + dropped) are dropped
    words = torch.randint(-(2**63), 2**63 - 1, ((n + 3) // 4,), dtype=torch.int64, device=device)  # (ceil(n/4),)
    lanes = words.view(torch.int16)[:n].view(shape)  # (*shape): four 16-bit lanes per word
    return lanes >= dropped - _LEVELS // 2, _LEVELS / (_LEVELS - dropped)


def check_p(p: float) -> float:
    """``p`` itself if it is a dropout probability (0 <= p <= 1), else ValueError: checked
    where a module is built, so a bad value fails then, not at the first training step."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout must be in [0, 1], got {p}")
    return p


def dropout(x: Tensor, p: float, *, training: bool = True) -> Tensor:
    """Inverted dropout (Srivastava et al., 2014; the scaling of Vaswani et al., section 5.4):
    each element is zeroed with probability p' (p to 16 bits, see :func:`keep_mask`) and the
    rest scaled by 1/(1 - p'), so nothing changes at evaluation. The gradient flows through
    the same mask. (The explicit attention path uses it on A'; the fused kernel draws its own.)

    Shapes:
        x: any; returns x's shape and dtype.
    """
    check_p(p)
    if not training or p == 0.0:
        return x
    if round(p * _LEVELS) >= _LEVELS:  # p' = 1: every element dropped
        return x * 0.0
    keep, scale = keep_mask(x.shape, p, device=x.device)
    # x * keep saves only the boolean mask for the backward pass; scaling in place saves nothing.
    return (x * keep).mul_(scale)


class Dropout(nn.Module):
    """:func:`dropout` as a module: active in training mode, the identity in eval mode."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = check_p(p)

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, training=self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class FeedForward(nn.Module):
    """Position-wise feed-forward network, FFN(x) = W2·act(W1·x) (Vaswani et al., eq. 2).

    act is ReLU, GELU (exact, with erf), ``"gelu_tanh"`` (GELU's tanh approximation,
    Hendrycks & Gimpel, 2016, section 2, as GPT-2 uses) or SiLU (also called swish).
    ``activation="swiglu"`` is the gated form W2·(silu(W1·x) ⊙ W3·x) (Shazeer, 2020,
    "GLU Variants Improve Transformer", eq. 6), ``"geglu_tanh"`` the same with the tanh GELU
    in place of SiLU (GEGLU, ibid. eq. 5, as Gemma computes it).

    Shapes:
        x: (B, T, D); returns (B, T, D); the hidden layer is (B, T, F).
    """

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "relu", bias: bool = True) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        self.w_1 = nn.Linear(d_model, d_ff, bias=bias)
        self.w_2 = nn.Linear(d_ff, d_model, bias=bias)
        self.w_3 = nn.Linear(d_model, d_ff, bias=bias) if activation in GATED else None
        self.w_13: nn.Linear | None = None  # [W1; W3] stacked, after fuse_gate (decoding)
        self.activated = False  # w_1 computes act(W1·x) itself, after pack_first (decoding)

    def fuse_gate(self) -> None:
        """Stack W1 and W3 of a gated FFN into one projection ``w_13`` (they are removed): one
        matrix product per call instead of two. A decoding step is bound by per-call overhead, not
        arithmetic (docs/speed.md), so this is a decoding fast path, like
        :meth:`~qkv.attention.MultiHeadAttention.fuse_qkv`; the outputs are the same up to float
        rounding (tested). Int8 weights have one scale per output row, so quantizing the stacked
        matrix gives the rows the two would get. Nothing to do for an ungated FFN.
        """
        if self.w_13 is not None or self.w_3 is None:
            return
        if not (type(self.w_1) is nn.Linear and type(self.w_3) is nn.Linear):
            raise ValueError("fuse_gate needs float nn.Linear projections: fuse before quantizing (int8_linears)")
        w_1, w_3 = self.w_1, self.w_3
        with torch.no_grad():
            fused = nn.Linear(w_1.in_features, 2 * w_1.out_features, bias=w_1.bias is not None)
            fused = fused.to(device=w_1.weight.device, dtype=w_1.weight.dtype)
            fused.weight.copy_(torch.cat([w_1.weight, w_3.weight]))  # (2F, D)
            if w_1.bias is not None:
                fused.bias.copy_(torch.cat([w_1.bias, w_3.bias]))  # (2F,)
        self.w_1 = self.w_3 = None  # what forward reads: the stacked product
        self.w_13 = fused

    def pack_first(self, rows: int) -> None:
        """W1 and the activation as one product: ``w_1`` becomes a float32 :class:`PackedLinear`
        that applies the activation inside the product (oneDNN's post-op), so the hidden layer
        is written once instead of written, read and written again (the activation's own pass
        over (B, T, F): Whisper tiny.en's encoder spent about 5% of its time in it). A decoding
        fast path for products of many rows (an encoder's; ``rows``, the packing's hint); the same
        outputs up to float rounding (tested). Ungated activations only (:data:`POST_OPS`).
        """
        if self.activation not in POST_OPS or type(self.w_1) is not nn.Linear:
            raise ValueError(f"pack_first needs an ungated float nn.Linear W1 ({', '.join(POST_OPS)})")
        self.w_1 = PackedLinear(self.w_1, dtype=torch.float32, rows=rows, activation=self.activation)
        self.activated = True

    def forward(self, x: Tensor) -> Tensor:
        if self.w_13 is not None:
            h, gate = self.w_13(x).chunk(2, dim=-1)  # (B, T, F) each
        else:
            h, gate = self.w_1(x), None if self.w_3 is None else self.w_3(x)  # (B, T, F)
        return self.w_2(h if self.activated else self._activated(h, gate))  # (B, T, D)

    def _activated(self, h: Tensor, gate: Tensor | None) -> Tensor:
        """act(h), times ``gate`` (W3·x) for the gated activations. Shapes: (B, T, F) -> (B, T, F)."""
        if self.activation == "swiglu":
            return F.silu(h) * gate
        if self.activation == "geglu_tanh":
            return F.gelu(h, approximate="tanh") * gate
        if self.activation == "gelu":
            return F.gelu(h)
        if self.activation == "gelu_tanh":
            return F.gelu(h, approximate="tanh")
        if self.activation == "silu":
            return F.silu(h)
        return F.relu(h)


def make_norm(kind: str, d_model: int, *, eps: float = 1e-5) -> nn.Module:
    """LayerNorm (Ba et al., 2016) or RMSNorm (Zhang & Sennrich, 2019) over the last axis.

    Shapes: (..., D) -> (..., D).
    """
    if kind == "layernorm":
        return nn.LayerNorm(d_model, eps=eps)
    if kind == "rmsnorm":
        return nn.RMSNorm(d_model, eps=eps)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")


def rms_norm_row(x: Tensor, weight: Tensor | None, eps: Tensor) -> Tensor:
    """RMSNorm of one row, x / √(mean(x²) + ε) · w (Zhang & Sennrich, 2019, eq. 4), in four
    operators: mean(x²) + ε as one product x·xᵀ/D + ε (``addmm``), its inverse square root in
    place, and two elementwise products. aten's kernel (``torch._fused_rms_norm``) runs about nine
    on the CPU (powers, a sum, a division, casts); a decoding step calls two norms a layer between
    products that evict what each operator touches, so every operator counts. Equal to
    ``nn.RMSNorm`` up to float rounding (the sum of squares is a dot product, tested).

    Shapes: x (..., D) holding one row; eps (1, 1), ε in x's dtype; returns (..., D).
    """
    row = x.reshape(1, x.shape[-1])  # (1, D)
    scale = torch.addmm(eps, row, row.mT, alpha=1 / row.shape[1]).rsqrt_()  # (1, 1): 1/√(mean(x²) + ε)
    y = x * scale  # (..., D)
    return y if weight is None else y.mul_(weight)


class FusedRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` for decoding: the same weight and the same outputs from aten's kernel called
    directly (``torch._fused_rms_norm``, what ``nn.RMSNorm`` reaches through ``F.rms_norm`` and
    ``torch.rms_norm``), bit for bit (tested), and from :func:`rms_norm_row` for one float32 row
    (a batch-1 decoding step), up to float rounding (tested). A one-row decoding step is bound by
    the calls it makes, not by arithmetic, and SmolLM2-135M's step calls 61 norms: on (1, 1, 576)
    the direct call took about half the CPU time of ``nn.RMSNorm`` (about 25 against 50 µs, torch
    2.13, one thread, under contention, 2026-12-07), and :func:`rms_norm_row` two thirds of the
    direct call's (10.1 against 15.4 µs on (1, 576), medians, one thread, under contention,
    2026-12-07). Inside a SmolLM2-135M step, where the products between norms evict what they
    touch, the same process alternating the two a step at a time: float32 copy 81.6 against 91.2 µs
    a norm, the int8 copy (fbgemm's products, not MKL's) no different (92 against 92 µs). A
    decoding copy (``decoding_copies.for_decoding``); a norm with ``eps=None``, and
    every norm while a graph is traced (``torch.compile``, ``torch.export``: neither traces the
    direct call), keep ``nn.RMSNorm``'s forward.

    Shapes: (..., D) -> (..., D).
    """

    def __init__(self, norm: nn.RMSNorm) -> None:
        super().__init__(norm.normalized_shape, eps=norm.eps, elementwise_affine=norm.weight is not None)
        self.weight = norm.weight  # the norm's own parameter (None without elementwise_affine)
        self.shape = list(norm.normalized_shape)
        # ε as the (1, 1) summand of rms_norm_row's product; not saved (the state dict stays the norm's)
        eps_row = torch.full((1, 1), norm.eps or 0.0, device=self.weight.device if self.weight is not None else None)
        self.register_buffer("eps_row", eps_row, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.eps is None or torch.compiler.is_compiling() or exporting():
            return super().forward(x)
        if self._one_row(x):  # a batch-1 decoding step
            return rms_norm_row(x, self.weight, self.eps_row)  # (..., D)
        return torch._fused_rms_norm(x, self.shape, self.weight, self.eps)[0]  # (..., D)

    def _one_row(self, x: Tensor) -> bool:
        """Whether ``x`` is one float32 row (of at least two dimensions, as a decoding step's are)
        that :func:`rms_norm_row` normalizes."""
        return x.dtype == torch.float32 == self.eps_row.dtype and x.dim() > 1 and x.numel() == x.shape[-1]


def exporting() -> bool:
    """Whether the model is being traced for export (``torch.export``, which the ONNX exporter
    runs, or TorchScript's tracer). A graph cannot branch on a tensor's values: code that skips
    work by looking at them (a mask that is all True) takes the branch that is right for any
    values, and checks that would raise are left to the graph's caller."""
    return torch.compiler.is_exporting() or torch.jit.is_tracing()


def sinusoidal_encoding(positions: Tensor, d_model: int, *, halves: bool = False) -> Tensor:
    """Sinusoidal positional encoding (Vaswani et al., 2017, section 3.5).

    PE(pos, 2i) = sin(pos / 10000^(2i/D)) and PE(pos, 2i+1) = cos(pos / 10000^(2i/D)),
    computed from the positions themselves, so any length works. With ``halves`` the same
    sines fill the first ceil(D/2) dimensions and the cosines the rest, not interleaved
    (the layout of Marian and tensor2tensor; ``positions="sinusoidal_halves"``).

    Shapes:
        positions: (B, T) or (T,) integers; returns (B, T, D) or (T, D) float32.
    """
    i = torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float32)
    angles = positions.to(torch.float32)[..., None] * torch.exp(-math.log(10000.0) * i / d_model)  # (B, T, D/2)
    if halves:
        return torch.cat([torch.sin(angles), torch.cos(angles[..., : d_model // 2])], dim=-1)  # (B, T, D)
    pe = torch.zeros(*positions.shape, d_model, device=positions.device)  # (B, T, D)
    pe[..., 0::2] = torch.sin(angles)
    pe[..., 1::2] = torch.cos(angles[..., : d_model // 2])
    return pe


class InputEmbedding(nn.Module):
    """Token ids to input vectors: embedding, √D scaling, absolute positions, dropout.

    ``"sinusoidal"`` and ``"sinusoidal_halves"`` are the two layouts of :func:`sinusoidal_encoding`;
    ``positions`` in ``("rope", "alibi", "none")`` add nothing here (RoPE and ALiBi act
    inside attention). ``"learned"`` needs ``max_len``; ``"sinusoidal"`` works at any
    length. Scaling by √D follows Vaswani et al., section 3.4.

    Shapes:
        tokens: (B, T) integers; positions: (B, T) or (T,); returns (B, T, D).
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        *,
        positions: str = "sinusoidal",
        max_len: int = 512,
        scale: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
        self.token = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.token.weight, std=d_model**-0.5 if scale else 0.02)
        self.position = nn.Embedding(max_len, d_model) if positions == "learned" else None
        if self.position is not None:
            nn.init.normal_(self.position.weight, std=0.02)
        self.kind, self.max_len = positions, max_len
        self.scale = math.sqrt(d_model) if scale else 1.0
        self.dropout = Dropout(dropout)

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        x = self.token(tokens)  # (B, T, D)
        if self.scale != 1.0:  # GPT-2 and BERT do not scale: spare the copy (forward and backward)
            x = x * self.scale  # (B, T, D)
        if self.kind in ("sinusoidal", "sinusoidal_halves"):
            halves = self.kind == "sinusoidal_halves"
            x = x + sinusoidal_encoding(positions, x.shape[-1], halves=halves).to(x.dtype)
        elif self.position is not None:
            if not exporting() and int(positions.max()) >= self.max_len:  # a graph cannot raise
                raise ValueError(f"position {int(positions.max())} is beyond max_len={self.max_len}")
            x = x + self.position(positions)  # (B, T, D)
        return self.dropout(x)


class WideLinear(nn.Module):
    """``nn.Linear`` for decoding, its weight stored transposed and contiguous: Wᵀ (K, N) instead
    of W (N, K), so ``x @ Wᵀ`` streams the weight row by row. For a layer that widens (N > K:
    stacked Q/K/V, the feed-forward's first matrices, the vocabulary projection) PyTorch's CPU
    product of one row with the (N, K) layout reads memory at about 10 GB/s here, against 17-19
    GB/s with this one (AMD EPYC, 2 threads, fp32: 1536 x 512 took 350 us against 193 us, 8000 x
    512 1.82 ms against 0.80 ms); for a narrowing layer the (N, K) layout is the faster one, so
    only widening layers get this copy (``decoding_copies.for_decoding`` with ``wide``). Same outputs up to
    float rounding (tested). Inference only.

    From :data:`PACKED_MIN_ROWS` rows (batched decoding, beam search) the product goes to a second
    copy of the weight in oneDNN's packed layout (:class:`PackedLinear`, where :func:`packable`),
    faster there: one thread, same-process A/B under contention, 512 -> 8,000 took 1.8 against
    3.8 ms at 4 rows, 5.4 against 6.9 ms at 32; 512 -> 2,048 0.39 against 0.68 ms at 4 rows, 1.2
    against 1.4 ms at 32 (at 2 rows the two were even). The weight is then held twice.

    Why twice: no one layout kept both speeds (2026-12-07, one thread, CPU time per call,
    same-process A/B under contention, each weight streamed from memory). At one row the packed
    copy alone took 1.6 to 1.9 times the transposed one's time (576 -> 3,072 1.33 against 0.70 ms,
    576 -> 49,152 15.5 against 8.6, 512 -> 8,000 2.24 against 1.25, 384 -> 51,864 12.6 against
    6.7), and ``F.linear`` on the plain (N, K) weight about as long (1.30, 15.8, 2.36 and 15.8 ms);
    at 2 rows the transposed copy was as fast or faster (1.08 against 1.31 ms, 15.4 against 15.7,
    2.15 against 2.74); from 4 rows its product (MKL's GEMM) took 1.5 to 5 times the packed one's
    (576 -> 49,152 52.8 against 19.6 ms at 4 rows, 67.8 against 37.7 at 32; 512 -> 8,000 5.1
    against 3.3 ms at 4 rows, 10.9 against 7.4 at 32). A tied vocabulary
    projection's embedding reads its rows from this layer's transposed copy
    (``decoding_copies._widened``), so that weight is held twice, not three times.

    Shapes: x (..., K) -> (..., N).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_t", linear.weight.detach().t().contiguous())  # (K, N)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias)  # (N,) or None
        packs = packable(linear.weight.dtype) and linear.weight.device.type == "cpu"
        self.many = PackedLinear(linear, dtype=linear.weight.dtype, rows=32) if packs else None

    def forward(self, x: Tensor) -> Tensor:
        if self.many is not None and x.numel() >= PACKED_MIN_ROWS * self.in_features:
            return self.many(x)  # (..., N)
        if self.bias is None:  # one operator (a transposed view and F.linear are two; a step has 60 such layers)
            return x @ self.weight_t  # (..., N)
        # F.linear of the transposed view is one product of x with Wᵀ (K, N), the bias added inside
        # it: a separate add would read and write the whole output again, which for an encoder's
        # 1,500 rows costs a tenth of the layer (Whisper tiny.en, 2026-12-07).
        return F.linear(x, self.weight_t.t(), self.bias)  # (..., N)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight stored (K, N)"


PACKED_MIN_ROWS = 4  # rows from which WideLinear's product goes to its packed copy


def packable(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this PyTorch build and CPU run oneDNN's linear kernels in ``dtype`` (what
    :class:`PackedLinear` calls): oneDNN present, and for bfloat16 a CPU with bf16 support."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _pack(weight: Tensor, rows: int = 1) -> Tensor:
    """``weight`` reordered once into oneDNN's blocked layout for products of about ``rows`` rows
    (an opaque mkldnn tensor). Shapes: (N, K) -> (N, K)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


class PackedLinear(nn.Module):
    """``nn.Linear`` for decoding on the CPU with its weight in bfloat16, reordered once into
    oneDNN's packed layout. ``F.linear`` on a bfloat16 weight gives the same bits through oneDNN
    but, as far as measured, reorders the weight on every call: a one-row decoding step then reads
    each weight twice and writes it once. Packed once, the base translation model's bf16 greedy
    step took a quarter less CPU time (AMD EPYC, same-process A/B under contention; docs/speed.md).
    Activations are cast to bfloat16 and the output back to the input's dtype, as
    :class:`qkv.int8.Bf16Linear`; outputs equal ``F.linear`` in bfloat16 up to the kernel's order
    of summation (tested). CPU only (see :func:`packable`), inference only; a copy
    (``copy.deepcopy``, pickling) packs again.

    In float32 (``dtype``) it serves the products of many rows (an encoder's, cross-attention's
    keys and values: ``decoding_copies.for_decoding``), packed for about ``rows`` rows: oneDNN adds
    the bias inside the product, where ``F.linear`` copies it into the output first and multiplies
    into it (a pass over the output), and applies ``activation`` (one of :data:`POST_OPS`; None:
    none) there too, as :meth:`FeedForward.pack_first` asks.

    Shapes: x (..., K) -> (..., N).
    """

    def __init__(
        self, linear: nn.Linear, *, dtype: torch.dtype = torch.bfloat16, rows: int = 1, activation: str | None = None
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.rows = rows
        self.packed = _pack(linear.weight.detach().to(dtype), rows)  # (N, K), oneDNN's layout: not a buffer
        self.dtype = dtype
        bias = None if linear.bias is None else linear.bias.detach().to(dtype).clone()
        self.register_buffer("bias", bias)  # (N,) or None
        self.activation = activation
        self.post = POST_OPS[activation] if activation is not None else ("none", "")  # oneDNN's (attr, algorithm)

    def forward(self, x: Tensor) -> Tensor:
        attr, algorithm = self.post
        if x.dtype == self.dtype:
            # The --bf16 copy's activations are bfloat16 already: its 37 products a step (base
            # translation model) would otherwise add 74 calls of ``to`` that copy nothing, a
            # quarter of the step's ~300 top-level operator calls (issue 49).
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, attr, [], algorithm)  # (..., N)
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, self.bias, attr, [], algorithm)
        return y.to(x.dtype)  # (..., N)

    def __getstate__(self) -> dict:
        # An opaque mkldnn tensor has no storage to copy: copies hold the plain weight and pack again.
        return self.__dict__ | {"packed": self.packed.to_dense()}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state | {"packed": _pack(state["packed"], state.get("rows", 1))})

    def extra_repr(self) -> str:
        then = f", then {self.activation}" if self.activation is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.packed.dtype} packed (oneDNN)"
            f"{then}"
        )
