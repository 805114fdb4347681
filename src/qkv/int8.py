"""int8 linear layers for decoding on CPUs (``--int8``): :func:`quantize_channels` (symmetric
int8 weights, one scale per output channel), :func:`int8_linear` (the explicit product: dequantize,
then multiply), :class:`Int8Linear` (the module, with PyTorch's int8 kernels as its fast paths),
:class:`Bf16Linear` (a linear layer kept in bfloat16), :class:`Bf32Linear` (float32 weights,
bfloat16 products with float32 outputs: a speech encoder's), :class:`Fp16Linear` (one kept in
float16, fbgemm's kernel) and :class:`NearTiesInFloat` (the vocabulary projection: every logit from one of
those, those that could be the largest recomputed in float32).

Four fast paths, chosen by the number of rows at call time (:data:`MANY_ROWS`, :data:`HUGE_ROWS`):

* one row (a decoding step at batch 1, the chatbot's and ``qkv translate``'s common case): fbgemm's
  int8 × int8 kernel (``torch.ops.quantized.linear_dynamic``, the bias packed with the weights) in
  one call, the row quantized on its own range by the kernel, and outlier features (|x| >
  :data:`OUTLIER`) multiplied in float32 apart (LLM.int8()). Measured on SmolLM2-135M (one
  thread, the machine under contention): about a sixth less CPU time a step than the weight-only
  kernel, its logits about a third further from float32's (RMS), its top-1 as often float32's
  (docs/speed.md, "int8 at batch 1"). A text decoder's layers (``row16``: what
  ``decoding_copies.int8_linears`` gives them) take their float weights in float16 at one row
  instead (fbgemm's float16 kernel, as :class:`Fp16Linear`): no activation is quantized, so an
  outlier feature (SmolLM2's reach |x| ≈ 50) coarsens nothing, and the call is one operator with
  no outlier check. Per call on SmolLM2-135M's shapes (one thread, CPU time, the machine under
  contention, 2026-12-07; weights warm in cache): 79 against the int8 row's 99 us at 576 → 960,
  58 against 84 at 576 → 576, 140 against 169 at 576 → 3,072, 97 against 115 at 1,536 → 576,
  and the int8 row's outlier path cost about 200 us more (a sixth of its calls). The price is
  memory: the float16 copy besides the int8 weights, three bytes a weight instead of one.
* 2 to 15 rows (a decoding step of a few hypotheses): weight-only int8, ``torch._weight_int8pack_mm``
  (bfloat16 activations, the int8 weights read as they are). The activations are not quantized,
  so an outlier feature in the residual stream (Whisper has large ones) cannot coarsen the other
  features of its token (Dettmers et al., 2022, LLM.int8()).
* many rows (a decoding step of a batch or a beam search): an int8 × int8 GEMM
  (fbgemm's dynamic-quantization kernel, ``torch.ops.quantized.linear_dynamic``: int32
  accumulation) with the activations quantized on the fly, each row on its own scale (per-token
  scales, as Dettmers et al., 2022, section 3.1, and Xiao et al., 2023, SmoothQuant, do): every
  row is divided by its max |x| before the kernel quantizes the whole tensor and multiplied back
  after, so one row's outlier coarsens no other row. The weights' bytes are read once for all rows
  and the arithmetic is integer: with many rows this is what bounds the step.
* huge products (a text encoder's frames, a prompt: once per input): a bfloat16 GEMM on the
  weights dequantized for the call, float activations again (int8 ones lost Whisper's words
  there); on a CPU without bfloat16 arithmetic (:func:`native_bf16`) the float32 product itself
  (:func:`int8_linear`), as bfloat16 is emulated there at several times float32's cost. A speech
  encoder has no int8 layer now (its int8 weights cost Whisper's words even so, and bought no time
  in products this size): :class:`Bf32Linear` or float32 (``decoding_copies.int8_linears``).

Why bfloat16 for the output projection, with its near-ties in float32: its logits decide every
token, and int8 rows flip near ties (measured on Whisper tiny.en in docs/speed.md); bfloat16 ones
still flip Whisper's final "4." against "4" on a few files in a hundred (docs/speech.md), so the few
logits within bfloat16's error bound of the row's largest are recomputed in float32, and the argmax
is float32's. On a CPU without bfloat16 arithmetic the copy keeps its float layers in float32
(exact logits, and faster there than emulated bfloat16). A text model's output projection at one
row (a batch-1 step) is float16 (:class:`Fp16Linear`, half float32's bytes, fbgemm's kernel) with
its near-ties in float32 too; int8 rows with int8 activations were no candidate: the activations
entering SmolLM2's vocabulary projection reach |x| ≈ 50 (norm ≈ 50), so half an activation step's
error bound covered every logit. The copying of a model is in ``decoding_copies.int8_linears``.

What is not here: which layers a model gets (``decoding_copies``); PyTorch's per-tensor dynamic
quantization as a whole-model pass (what ``--int8`` used before: 7-bit activations on one scale per
call lost Whisper's words).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.layers import packable

INT8_MAX = 127  # symmetric: [-127, 127], so -x quantizes to -q
FAST_MULTIPLE = 16  # torch._weight_int8pack_mm's CPU kernel needs in_features % 16 == 0 (others crash)
# From this many rows on, the int8 x int8 GEMM beats the int8-weight kernel (per call, 1 thread: 89 against
# 205 us at 8 x 512 x 1536, 58 against 78 at 8 x 512 x 512; it wins from 2 to 5 rows, depending on the shape).
# Taken at 16, not 8: int8 activations cost a language model's agreement with fp32 (SmolLM2, 8 prompts x 32
# tokens: 52.0% weight-only, 44.5% with int8 activations at 8 rows), and a chat server's steps hold a few
# rows; a batch of 32 and a beam of 5 over 8 inputs (40 rows) still take the GEMM.
MANY_ROWS = 16
# From this many rows on (an encoder's frames, a prompt: once per input, not once per token), a bfloat16
# GEMM on the weights dequantized for the call: float activations again, which keep Whisper's words
# (int8 activations in its encoder's 1,500-row products lost some: tests/test_int8.py's slow test).
HUGE_ROWS = 256


def _vnni() -> bool:
    """Whether the CPU multiplies uint8 by int8 into int32 without an int16 step (AVX512-VNNI,
    AVX-VNNI, AMX): then activations may use all 8 bits; otherwise fbgemm's kernels can saturate
    the int16 pair sums, and its "reduce range" (7 bits) avoids that."""
    have = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return any(have.get(flag) for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX, what oneDNN's bfloat16
    kernels need: :func:`qkv.layers.packable`). Without it oneDNN and PyTorch emulate bfloat16, and
    a product in bfloat16 costs several times float32's: on an AMD EPYC with AVX2 alone (torch 2.13,
    one thread, under contention, 2026-12-07) 1,024 x 512 x 2,048 took 296 ms against 48 ms, the
    vocabulary projection of 32 rows (32 x 512 x 8,000) 30.2 ms against 6.3 ms (weight transposed)."""
    return packable(torch.bfloat16)


# An activation beyond this is an outlier feature (LLM.int8()'s threshold, Dettmers et al., 2022, section 3.2):
# its column is multiplied in float32 rather than quantized with the rest of its row.
OUTLIER = 6.0

# The levels a row of activations is quantized to in the many-rows path: the kernel maps the
# tensor's [min, max] (about [-1, 1] once each row is divided by its max |x|) onto them.
ACTIVATION_LEVELS = 255 if _vnni() else 127


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
    """The explicit product: ``x @ (q * scale)ᵀ + bias`` in float32 (the reference for the fast paths).

    Shapes: x (..., K), q (N, K), scale (N,), bias (N,) -> (..., N).
    """
    return F.linear(x.float(), q.float() * scale[:, None], bias)  # (..., N)


def packed_weights(q: Tensor, scale: Tensor, bias: Tensor | None = None):
    """``q`` with its per-channel ``scale`` (and ``bias``, which the kernel adds to every row) in
    fbgemm's packed layout, for ``torch.ops.quantized.linear_dynamic``.

    Shapes: q (N, K) int8, scale (N,), bias (N,) or None."""
    zeros = torch.zeros(q.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch 2.13 warns that quantized tensors will move to torchao
        warnings.simplefilter("ignore", UserWarning)
        weight = torch._make_per_channel_quantized_tensor(q, scale.double(), zeros, 0)  # (N, K) qint8
    return torch.ops.quantized.linear_prepack(weight, bias)


# fbgemm's int8 GEMM called as its one overload (as :data:`_FP16_PRODUCT`): the packet would check its
# arguments in Python first, on every call of every many-rows step.
_INT8_PRODUCT = torch.ops.quantized.linear_dynamic.default


class Int8Linear(nn.Module):
    """An ``nn.Linear`` with int8 weights (per-output-channel scales).

    On the CPU, one row and from :data:`MANY_ROWS` to :data:`HUGE_ROWS` rows run fbgemm's int8
    GEMM with each row's activations quantized on its own scale: equal to :func:`int8_linear`
    within half a quantization step per activation, |error| ≤ max|row| / :data:`ACTIVATION_LEVELS`
    × Σ|w| (tested). With ``row16`` (a text decoder's layers) one row instead multiplies the float
    weights kept in float16 (fbgemm's float16 kernel, float activations): within
    :func:`fp16_product_error` of ``linear`` and so within half a weight step per input of
    :func:`int8_linear`, Σ|x| · scale / 2 more (tested); so does a prompt (x (B, T, K) with T > 1,
    once per input: the keys and values it caches are read by every step after), which there took
    less CPU time than the explicit product (256 rows, one thread, contended: 5.1 against 10.2 ms at
    576 → 960, 17.2 against 20.7 at 576 → 3,072, 8.6 against 12.3 at 1,536 → 576). Steps of
    several hypotheses (x (B, 1, K)) keep the int8 paths. Weights beyond float16's range keep the
    int8 ones everywhere. Other calls keep float activations: 2 to 15 rows ``torch._weight_int8pack_mm`` where
    ``in_features`` is a multiple of 16, more rows a bfloat16 GEMM on the weights dequantized for
    the call (both equal to :func:`int8_linear` up to bfloat16 rounding, tested), else
    :func:`int8_linear` itself. ``bf16``: whether huge products run in bfloat16 (None: where
    the CPU has bfloat16 arithmetic, :func:`native_bf16`); if not, they are :func:`int8_linear`'s
    float32 product. Inference only.

    Shapes: x (..., K) -> (..., N).
    """

    def __init__(self, linear: nn.Linear, *, bf16: bool | None = None, row16: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.huge_bf16 = native_bf16() if bf16 is None else bf16
        # one row: the float weights in float16 (fbgemm's kernel), where asked and where they fit float16
        self.row16 = _packed_fp16(linear) if row16 and fp16_fits(linear.weight) else None
        q, scale = quantize_channels(linear.weight)
        self.register_buffer("q", q)  # (N, K) int8
        self.register_buffer("scale", scale)  # (N,)
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16))  # (N,) what the kernel takes
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)  # (N,) or None
        self.packed = packed_weights(q, scale, bias)  # fbgemm's copy of (q, scale, bias), for one row and many

    def path(self, x: Tensor) -> str:
        """Which product ``x`` takes on the CPU: one row (a decoding step at batch 1) "fp16 row"
        (``row16``: the float16 weights) or "int8 row" (int8 activations on the row's own range,
        outliers apart); with ``row16``, several positions of a sequence (x (B, T, K), T > 1: a
        prompt) "fp16 GEMM"; from :data:`MANY_ROWS` to
        :data:`HUGE_ROWS` rows (a decoding step of many hypotheses) "int8 GEMM" (int8 activations,
        one scale per row); from :data:`HUGE_ROWS` on, "bf16 GEMM" (the weights dequantized for the
        call), or "explicit" where bfloat16 is not this layer's (``huge_bf16``); other rows
        "weight-only" (the int8-weight kernel) where ``in_features`` allows, else "explicit"."""
        rows = x.numel() // max(self.in_features, 1)
        if x.device.type != "cpu":
            return "explicit"
        if rows == 1:
            return "int8 row" if self.row16 is None else "fp16 row"
        if self.row16 is not None and x.dim() >= 3 and x.shape[-2] > 1:  # (B, T, K): T positions of a prompt
            return "fp16 GEMM"
        if rows >= MANY_ROWS:
            return "int8 GEMM" if rows < HUGE_ROWS else "bf16 GEMM" if self.huge_bf16 else "explicit"
        return "weight-only" if self.in_features % FAST_MULTIPLE == 0 else "explicit"

    def forward(self, x: Tensor) -> Tensor:
        if self.row16 is not None and x.numel() == self.in_features and x.device.type == "cpu":
            return fp16_product(x, self.row16)  # "fp16 row" (path) without choosing: a batch-1 step's every call
        path = self.path(x)
        if path in ("fp16 row", "fp16 GEMM"):  # float activations, nothing quantized: one call where x is float32
            return fp16_product(x, self.row16)  # (..., N)
        if path == "int8 row":  # batch-1 decoding: no dtype round trip where x is float32 already (each call counts)
            return self._one_row(x) if x.dtype == torch.float32 else self._one_row(x.float()).to(x.dtype)
        if path == "explicit":
            return int8_linear(x, self.q, self.scale, self.bias).to(x.dtype)
        rows = x.reshape(-1, self.in_features)  # (M, K)
        if path == "int8 GEMM":
            y = self._int8_gemm(rows.float())  # (M, N)
        else:
            if path == "weight-only":
                y = torch._weight_int8pack_mm(rows.to(torch.bfloat16), self.q, self.scale_bf16)  # (M, N)
            else:
                y = F.linear(rows.to(torch.bfloat16), self.q.to(torch.bfloat16) * self.scale_bf16[:, None])  # (M, N)
            y = y.float() if self.bias is None else self.bias + y  # (M, N) float32: one op, y promoted exactly
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # (..., N)

    def _one_row(self, x: Tensor) -> Tensor:
        """One row through fbgemm's kernel as it is: the kernel quantizes the row on the row's own
        range (per-token scales, as :meth:`_int8_gemm` gets by dividing rows) and adds the packed
        bias, one call. Outlier features (|x| > :data:`OUTLIER`: a third of SmolLM2's stacked Q/K/V
        calls, a quarter of its down projection's, one to a few features each) are left out of it
        and multiplied in float32 (LLM.int8(), section 3.2). Shapes: x (..., K) one row -> (..., N)."""
        reduce_range = ACTIVATION_LEVELS < 255
        if float(torch.linalg.vector_norm(x, float("inf"))) <= OUTLIER:  # max |x|: one reduction
            return torch.ops.quantized.linear_dynamic(x, self.packed, reduce_range)  # (..., N)
        row = x.reshape(1, self.in_features)  # (1, K)
        loud = (row.abs() > OUTLIER).nonzero()[:, 1]  # (L,) outlier features
        exact = F.linear(row[:, loud], self.q.index_select(1, loud).float())  # (1, N) before the channels' scales
        y = torch.ops.quantized.linear_dynamic(row.index_fill(1, loud, 0.0), self.packed, reduce_range)  # (1, N)
        return torch.addcmul(y, exact, self.scale).reshape(*x.shape[:-1], self.out_features)  # (..., N)

    def _int8_gemm(self, rows: Tensor) -> Tensor:
        """fbgemm's GEMM with the activations quantized per row: each row divided by its max |x|
        (the kernel then quantizes the tensor, now about [-1, 1], on one scale) and multiplied
        back after. Input features with an outlier (|x| > :data:`OUTLIER` in any row) are left out
        of it and multiplied in float32 (Dettmers et al., 2022, LLM.int8(), section 3.2), so they
        coarsen no other feature. The kernel's output is this call's own, so the rows are scaled
        back in it, in place, with the same arithmetic: no (M, N) tensor is made beside it (per
        call at 32 rows, 6 layers in turn, one thread, CPU time, contended, 2026-12-07: 732 against
        712 us at 512 → 1,536, 1,070 against 1,028 at 512 → 2,048, alike at 512 → 512).
        Shapes: rows (M, K) -> (M, N)."""
        magnitude = rows.abs()  # (M, K)
        size = magnitude.amax(dim=1, keepdim=True)  # (M, 1)
        exact = None
        if float(size.max()) > OUTLIER:  # rare after a norm: the common step pays one reduction for it
            loud = (magnitude > OUTLIER).any(dim=0).nonzero().squeeze(1)  # (L,) outlier features
            exact = rows[:, loud] @ (self.q[:, loud].float() * self.scale[:, None]).T  # (M, N)
            rows = rows.index_fill(1, loud, 0.0)  # (M, K)
            size = rows.abs().amax(dim=1, keepdim=True)  # (M, 1)
        size.clamp_min_(torch.finfo(torch.float32).tiny)  # (M, 1), this call's own
        y = _INT8_PRODUCT(rows / size, self.packed, ACTIVATION_LEVELS < 255)  # (M, N) + bias
        # the kernel added the bias to each divided row: (y - b) * size + b is the product of the row as it was
        if self.bias is None:
            y.mul_(size)  # (M, N)
        else:
            torch.addcmul(self.bias, y.sub_(self.bias), size, out=y)  # (M, N), the same arithmetic in place
        return y if exact is None else y.add_(exact)

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


class Bf32Linear(nn.Module):
    """An ``nn.Linear`` kept in float32 whose product, on a CPU with bfloat16 arithmetic
    (:func:`native_bf16`: where int8 copies make one), runs in oneDNN's "bf32" mode: the kernel
    rounds the activations and the weights to bfloat16 and sums and returns float32
    (``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``, set for the call and put back).
    So an encoder's 1,500-row products get bfloat16's speed without the rounding of every output
    to bfloat16 that ``F.linear`` in bfloat16 (and :class:`Bf16Linear`, :class:`PackedLinear`)
    returns: on Whisper tiny.en's encoder, emulated, products of bfloat16 inputs with float32
    outputs kept float32's words and those rounded to bfloat16 did not (docs/speech.md, "int8").
    Where PyTorch does not run the mode (no bf16 support in oneDNN) the product is ``F.linear``'s
    in float32. The mode is process-wide while the call runs: float32 products on other threads
    at that moment take it too (qkv serve runs its model on one thread).

    Shapes: x (..., K) -> (..., N).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().float().clone())  # (N, K)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)  # (N,) or None

    def forward(self, x: Tensor) -> Tensor:
        matmul = torch.backends.mkldnn.matmul
        before = matmul.fp32_precision
        matmul.fp32_precision = "bf16"
        try:
            return F.linear(x.float(), self.weight, self.bias).to(x.dtype)  # (..., N)
        finally:
            matmul.fp32_precision = before

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float32 weights, bf16 products"


FP16_MAX = 65504.0  # float16's largest finite value


def fp16_fits(weight: Tensor) -> bool:
    """Whether every weight is finite in float16 (fbgemm's packing saturates larger ones)."""
    return bool(weight.detach().abs().max() <= FP16_MAX)


def fp16_product_error(in_features: int) -> float:
    """A float16-weight product's error, relative to Σ|x||w| (at most ‖x‖·‖w‖, Cauchy–Schwarz), for
    :class:`Fp16Linear`: each weight rounded to float16 (2⁻¹¹ relative where normal; the subnormal
    part is :data:`FP16_SUBNORMAL_ERROR`), float32 activations kept as they are, products summed in
    float32 over ``in_features`` terms (at most K·2⁻²⁴ of Σ|x||ŵ|, doubled to cover ŵ's rounding and
    the kernel's order of summation)."""
    return 2**-11 + in_features * 2**-23


# Half float16's subnormal spacing (2⁻²⁴): the absolute error of a weight below 2⁻¹⁴ rounded to float16.
FP16_SUBNORMAL_ERROR = 2**-25


def _packed_fp16(linear: nn.Linear):
    """``linear``'s weight in float16 and its bias in float32, in fbgemm's packed layout for
    ``torch.ops.quantized.linear_dynamic_fp16``. Shapes: weight (N, K), bias (N,) or None."""
    bias = None if linear.bias is None else linear.bias.detach().float()
    with warnings.catch_warnings():  # torch 2.13 warns that quantized kernels will move to torchao
        warnings.simplefilter("ignore", UserWarning)
        return torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)


def fp16_product(x: Tensor, packed) -> Tensor:
    """``x`` times float16 weights packed by fbgemm (:func:`_packed_fp16`), float32 sums, in
    ``x``'s dtype. Shapes: x (..., K) -> (..., N)."""
    if x.dtype == torch.float32:  # the int8 copy's activations: no dtype round trip (each call counts)
        return _FP16_PRODUCT(x, packed)  # (..., N)
    return _FP16_PRODUCT(x.float(), packed).to(x.dtype)  # (..., N)


# The kernel's one overload, called as such: calling the op by its name first checks its arguments
# in Python for the overload to take (``OpOverloadPacket``), several µs of a batch-1 step's 121 calls.
_FP16_PRODUCT = torch.ops.quantized.linear_dynamic_fp16.default


class Fp16Linear(nn.Module):
    """An ``nn.Linear`` whose weight is kept in float16 in fbgemm's packed layout
    (``torch.ops.quantized.linear_dynamic_fp16``): float32 activations, weights widened to float32
    in registers, float32 sums and bias. The vocabulary projection of ``--int8`` text models, under
    :class:`NearTiesInFloat` (where oneDNN runs bfloat16, at one row only:
    ``decoding_copies._vocabulary`` says why). Outputs are within :func:`fp16_product_error` of
    float32 (tested). Inference only; weights must fit float16 (:func:`fp16_fits`).

    Shapes: x (..., K) -> (..., N).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if not fp16_fits(linear.weight):
            raise ValueError("Fp16Linear: a weight is beyond float16's range")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = _packed_fp16(linear)

    def forward(self, x: Tensor) -> Tensor:
        return fp16_product(x, self.packed)  # (..., N)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float16 weights (fbgemm)"


class ByRows(nn.Module):
    """Fewer than ``rows`` rows (default: one row, a decoding step at batch 1) to ``one``, more
    to ``many``: two copies of one layer, each where its kernel is the faster (the vocabulary
    projection of ``--int8``: float16 weights at one row, bfloat16 packed ones from two where
    oneDNN runs bfloat16; without it float16 ones up to 15 rows, float32 packed ones from 16:
    ``decoding_copies._vocabulary``; a speech decoder's layers without bfloat16 arithmetic: float16
    weights at one row, float32 from two, ``decoding_copies._decoder_layer``). Both must compute
    the same product (each within its own rounding). Shapes: x (..., K) -> (..., N)."""

    def __init__(self, one: nn.Module, many: nn.Module, *, rows: int = 2) -> None:
        super().__init__()
        self.one, self.many = one, many
        self.rows = rows

    def forward(self, x: Tensor) -> Tensor:
        return self.one(x) if x.numel() < self.rows * x.shape[-1] else self.many(x)  # (..., N)

    def extra_repr(self) -> str:
        return f"one below {self.rows} rows, many from it"


# A bfloat16 product's error, relative to ‖x‖·‖w‖ (Cauchy–Schwarz: at least Σ|x||w|): the activations
# and the weights each rounded to bfloat16 (2⁻⁹ relative each), the output rounded once more (2⁻⁹ of
# |y| ≤ Σ|x||w|), sums in float32 (K·2⁻²⁴ relative, K in the thousands at most): 2⁻⁷ covers them all.
BF16_PRODUCT_ERROR = 2**-7
NEAR_TIE_BLOCK = 64  # columns per block when looking for near-ties (a vector register's worth a few times)


def near_ties(logits: Tensor, bound: Tensor, *, block: int = NEAR_TIE_BLOCK) -> tuple[Tensor, Tensor]:
    """The (row, column) indices, row-major, of the logits that could be their row's largest once
    each is exact: those at least the row's largest minus ``2 * bound``, when each is off by at
    most ``bound``. Found a ``block`` of columns at a time (each block's largest first: a pass the
    CPU vectorizes), so the full (M, N) comparison is never made, as ``nonzero`` over it costs
    more than the bfloat16 product it corrects.

    Shapes: logits (M, N), bound (M,) -> rows (C,), columns (C,).
    """
    m, n = logits.shape
    whole = n - n % block
    tops = logits[:, :whole].reshape(m, whole // block, block).amax(dim=2)  # (M, N // block)
    if whole < n:
        tops = torch.cat([tops, logits[:, whole:].amax(dim=1, keepdim=True)], dim=1)  # (M, ceil(N / block))
    floor = tops.amax(dim=1) - 2 * bound  # (M,) the row's largest, from its blocks' largest
    r, b = (tops >= floor[:, None]).nonzero(as_tuple=True)  # (P,), (P,) the blocks holding near-ties
    columns = b[:, None] * block + torch.arange(block)  # (P, block)
    inside = columns < n
    columns = columns.clamp(max=n - 1)
    keep = inside & (logits[r[:, None], columns] >= floor[r, None])  # (P, block)
    return r[:, None].expand_as(columns)[keep], columns[keep]  # (C,), (C,)


class NearTiesInFloat(nn.Module):
    """The vocabulary projection of ``--int8``: every logit from ``fast`` (a bfloat16 product:
    :class:`Bf16Linear` or a packed one; or a float16-weight one, :class:`Fp16Linear`), then those
    that could be their row's largest (:func:`near_ties`, within the bound ``error`` · (‖x‖ · max‖w‖
    + max|b|) of it, ``error`` the fast product's relative error: :data:`BF16_PRODUCT_ERROR` or
    :func:`fp16_product_error`; ``absolute``, a weight's absolute error where the relative one does
    not hold, :data:`FP16_SUBNORMAL_ERROR`) recomputed in float32 from ``linear``'s own weight (a
    tied embedding's rows: no copy). So each row's argmax is float32's (proof: the float32 argmax is
    within the bound of the fast product's largest, and every logit left from the fast product is
    below it), the near-ties are exact and the other logits are within the fast product's rounding
    of float32 (tested). Inference only.

    Shapes: x (..., K) -> (..., N).
    """

    def __init__(
        self, linear: nn.Linear, fast: nn.Module, *, error: float = BF16_PRODUCT_ERROR, absolute: float = 0.0
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fast = fast
        self.weight = linear.weight  # (N, K) float32, shared (a tied embedding keeps its rows)
        self.bias = linear.bias  # (N,) or None
        self.error = error
        # A weight's absolute error (float16's subnormals) adds at most absolute · Σ|x| ≤ absolute · √K · ‖x‖:
        # folded into max‖w‖ so that the bound stays error · (‖x‖ · reach + max|b|).
        reach = linear.weight.detach().float().norm(dim=1).max() + absolute * self.in_features**0.5 / error
        bias = 0.0 if linear.bias is None else float(linear.bias.detach().abs().max())
        self.register_buffer("reach", torch.stack([reach, torch.tensor(bias)]))  # (2,) max‖w‖ (+), max|b|

    def forward(self, x: Tensor) -> Tensor:
        logits = self.fast(x).float().reshape(-1, self.out_features)  # (M, N)
        rows = x.reshape(-1, self.in_features).float()  # (M, K)
        bound = self.error * (rows.norm(dim=1) * self.reach[0] + self.reach[1])  # (M,)
        r, t = near_ties(logits, bound)  # (C,), (C,)
        exact = (rows[r] * self.weight[t].float()).sum(dim=1)  # (C,)
        exact = exact if self.bias is None else exact + self.bias[t].float()
        logits.index_put_((r, t), exact)  # (M, N): the fast product's own output, written in place
        return logits.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # (..., N)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, near-ties in float32"
