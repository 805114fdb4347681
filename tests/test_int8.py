"""int8 linear layers (``--int8``, qkv.int8): the explicit product is a per-channel quantize →
matmul → dequantize computed by hand; with a few rows the int8-weight kernel equals it up to
bfloat16 rounding, with one row or many the int8 kernel (activations quantized per row, outlier
features in float) within half a quantization step per activation, and the row count picks the
path on both sides of each threshold (huge products: bfloat16, or float32's exact product where
the CPU has no bfloat16 arithmetic); the copy replaces every linear layer, the encoder's
included, and keeps the vocabulary projection in bfloat16, or in float32 without bfloat16
arithmetic; a speech model's copy keeps its decoder in bfloat16 and the vocabulary's near-ties in
float32 (or its decoder float32 with float16 weights at one row, and its vocabulary float16,
near-ties float32) (found block by block as a whole comparison finds them; the argmax is
float32's where bfloat16 alone flips it). Slow: on the real
Whisper tiny.en, int8 transcripts equal float32's on at least 95% of FSDD test files (greedy)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from qkv.audio import FeatureConfig
from qkv.decoding_copies import VOCABULARY_MANY_ROWS, for_decoding, int8_linears
from qkv.int8 import (
    ACTIVATION_LEVELS,
    BF16_PRODUCT_ERROR,
    FP16_SUBNORMAL_ERROR,
    HUGE_ROWS,
    MANY_ROWS,
    OUTLIER,
    Bf16Linear,
    Bf32Linear,
    ByRows,
    Fp16Linear,
    Int8Linear,
    NearTiesInFloat,
    fp16_product_error,
    int8_linear,
    near_ties,
    quantize_channels,
)
from qkv.layers import WideLinear, packable
from qkv.models.speech import SpeechConfig, SpeechEncoderDecoder

WHISPER = Path("/tmp/whisper-tiny.en")


def _linear(k: int, n: int, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n)
    with torch.no_grad():
        linear.weight[0] *= 50.0  # one loud row: per-channel scales keep the others fine
    return linear


def _bf16_bound(x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
    """What bfloat16 activations (8 significant bits) and a bfloat16 product may cost each output:
    a few relative units of 2⁻⁸ of Σ|x||w|. Shapes: x (M, K) -> (M, N)."""
    dequantized = layer.q.float() * layer.scale[:, None]  # (N, K)
    return 4 * 2**-8 * (x.abs() @ dequantized.abs().T) + 1e-6  # (M, N)


def _int8_bound(x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
    """What int8 activations on one scale per row may cost each output: half a step of the row's
    grid (its range, at most 2 max|row|, over ACTIVATION_LEVELS steps) on every input, times Σ|w|,
    plus float rounding. Shapes: x (M, K) -> (M, N)."""
    dequantized = layer.q.float() * layer.scale[:, None]  # (N, K)
    half_step = x.abs().amax(dim=1, keepdim=True) / ACTIVATION_LEVELS  # (M, 1)
    return half_step * dequantized.abs().sum(dim=1) * 1.01 + 1e-5  # (M, N)


def test_int8_linear_is_a_per_channel_quantize_matmul_dequantize() -> None:
    """Each output row gets its own scale max|row|/127; the product is x @ (q * scale)ᵀ + b."""
    linear = _linear(7, 13, seed=0)
    x = torch.randn(2, 7)
    w = linear.weight.detach()
    scale = torch.stack([row.abs().max() / 127 for row in w])  # (13,) by hand, row by row
    q = torch.stack([torch.round(row / s) for row, s in zip(w, scale, strict=True)])  # (13, 7)
    expected = x @ (q * scale[:, None]).T + linear.bias.detach()  # (2, 13)
    got_q, got_scale = quantize_channels(w)
    assert got_q.dtype == torch.int8 and torch.equal(got_q.float(), q)
    assert torch.allclose(got_scale, scale)
    assert torch.allclose(int8_linear(x, got_q, got_scale, linear.bias), expected, atol=1e-5)
    layer = Int8Linear(linear)  # K = 7: no int8-weight kernel; a few rows take the explicit product
    assert layer.path(x) == "explicit" and torch.allclose(layer(x), expected, atol=1e-5)
    # per channel: the quiet rows lose far less than the loud row's scale would cost them
    error = (q * scale[:, None] - w).abs()[1:].max()
    assert error <= scale[1:].max() / 2 + 1e-7 and error < scale[0] / 4


@pytest.mark.parametrize(
    ("k", "rows"),
    [(32, 1), (7, 1), (32, 2), (32, MANY_ROWS - 1), (32, MANY_ROWS), (7, 41), (32, HUGE_ROWS - 1), (32, HUGE_ROWS)],
)
def test_fast_paths_equal_the_explicit_product(k: int, rows: int) -> None:
    """Few rows and huge products: bfloat16 activations, within bfloat16 rounding. One row and many
    rows: int8 activations with a scale per row, within half a quantization step per activation;
    the rows are of very different sizes, so one scale for the whole tensor would break the quiet
    rows' bound."""
    layer = Int8Linear(_linear(k, 13, seed=rows), bf16=True)
    x = torch.randn(rows, k) * torch.logspace(-3, 2, rows)[:, None]  # (rows, K): quiet and loud rows
    reference = int8_linear(x, layer.q, layer.scale, layer.bias)  # (rows, 13)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 13)
    many = MANY_ROWS <= rows < HUGE_ROWS
    path = "int8 row" if rows == 1 else "int8 GEMM" if many else "bf16 GEMM" if rows >= HUGE_ROWS else "weight-only"
    assert layer.path(x) == path
    bound = _int8_bound(x, layer) if path.startswith("int8") else _bf16_bound(x, layer)
    assert ((got - reference).abs() <= bound).all()
    assert torch.allclose(layer(x[None]), got[None])  # (1, rows, K): the rows of any shape count


def test_huge_products_without_bfloat16_are_the_float32_product() -> None:
    """Where bfloat16 is emulated (``bf16=False``), from HUGE_ROWS rows on the product is
    int8_linear's float32 one itself; below, the paths are as with bfloat16."""
    layer, bf16 = Int8Linear(_linear(32, 13, seed=6), bf16=False), Int8Linear(_linear(32, 13, seed=6), bf16=True)
    for rows in (1, 2, MANY_ROWS, HUGE_ROWS - 1, HUGE_ROWS, HUGE_ROWS + 7):
        x = torch.randn(rows, 32)
        want = "explicit" if rows >= HUGE_ROWS else bf16.path(x)
        assert layer.path(x) == want and bf16.path(x) != "explicit"
    x = torch.randn(HUGE_ROWS + 7, 32)
    assert torch.equal(layer(x), int8_linear(x, layer.q, layer.scale, layer.bias))


def test_the_row_count_picks_the_path_on_both_sides_of_the_thresholds() -> None:
    """Every row is one outlier feature and many features just under half a step of the row's int8
    grid, signed as output 1's weights: int8 activations round them all to zero, which costs
    output 1 their whole sum; bfloat16 ones keep them. From 2 to MANY_ROWS - 1 rows and from
    HUGE_ROWS on the output is within bfloat16 rounding of the explicit product; with one row and
    from MANY_ROWS to HUGE_ROWS - 1 it is not (within the int8 bound)."""
    layer = Int8Linear(_linear(32, 13, seed=1), bf16=True)
    x = torch.empty(HUGE_ROWS, 32)
    x[:, 0] = 1.0
    x[:, 1:] = 0.9 / (2 * ACTIVATION_LEVELS) * layer.q[1, 1:].float().sign()  # (M, K - 1)
    for rows in (1, 2, MANY_ROWS - 1, MANY_ROWS, HUGE_ROWS - 1, HUGE_ROWS):
        part = x[:rows]
        error = (layer(part) - int8_linear(part, layer.q, layer.scale, layer.bias)).abs()  # (rows, 13)
        int8 = rows == 1 or MANY_ROWS <= rows < HUGE_ROWS
        assert bool((error <= _bf16_bound(part, layer)).all()) == (not int8)
        assert (error <= _int8_bound(part, layer)).all()


@pytest.mark.parametrize("rows", [1, MANY_ROWS])
def test_outlier_features_are_multiplied_in_float(rows: int) -> None:
    """In the int8 kernels, a feature beyond OUTLIER in any row leaves the quantized product: the
    row's other features keep the precision of their own scale, as if the outlier were not there."""
    layer = Int8Linear(_linear(32, 13, seed=5))
    x = torch.randn(1, rows, 32) * 0.1
    x[0, 0, 3] = 50 * OUTLIER  # (1, M, K): one outlier in one row
    x[0, -1, 7] = -2 * OUTLIER  # and a negative one
    quiet = x.clone()
    quiet[..., [3, 7]] = 0.0
    error = (layer(x) - int8_linear(x, layer.q, layer.scale, layer.bias)).abs()  # (1, M, 13)
    assert layer.path(x) == ("int8 row" if rows == 1 else "int8 GEMM")
    assert error.shape == (1, rows, 13) and (error[0] <= _int8_bound(quiet[0], layer)).all()


@pytest.mark.parametrize("shape", [(1, 32), (1, 1, 32)])
def test_one_row_in_float16_is_the_float_product_within_float16_rounding(shape: tuple[int, ...]) -> None:
    """``row16`` (a text decoder's layers): one row takes the float weights in float16 and the
    activations as they are, outliers included, so it is within float16's rounding of the float
    layer (fp16_product_error of Σ|x||w|), and within the weights' int8 rounding (half a step of
    each channel's scale per input) of the explicit int8 product; more rows take the paths they
    take without it, with the same outputs."""
    linear = _linear(32, 13, seed=7)
    layer, plain = Int8Linear(linear, row16=True), Int8Linear(linear)
    x = torch.randn(shape) * 0.5
    x[..., 3] = 50 * OUTLIER  # an outlier feature: no activation is quantized, so it costs the others nothing
    assert layer.path(x) == "fp16 row" and plain.path(x) == "int8 row"
    got = layer(x)
    with torch.no_grad():
        magnitude = x.abs() @ linear.weight.abs().T  # (..., 13) Σ|x||w|
        error = (got - linear(x)).abs()
    assert got.shape == (*shape[:-1], 13) and (error <= fp16_product_error(32) * magnitude + 1e-6).all()
    explicit = int8_linear(x, layer.q, layer.scale, layer.bias)
    weights_bound = x.abs().sum(-1, keepdim=True) * layer.scale / 2  # (..., 13) Σ|x| · half a step
    assert ((got - explicit).abs() <= weights_bound + fp16_product_error(32) * magnitude + 1e-6).all()
    assert torch.equal(copy.deepcopy(layer)(x), got)
    for rows in (2, MANY_ROWS, HUGE_ROWS):  # steps of several hypotheses: (rows, K) or (rows, 1, K)
        for more in (torch.randn(rows, 32), torch.randn(rows, 1, 32)):
            assert layer.path(more) == plain.path(more) and torch.equal(layer(more), plain(more))


@pytest.mark.parametrize("shape", [(1, 2, 32), (3, MANY_ROWS + 1, 32), (1, HUGE_ROWS, 32)])
def test_a_prompt_in_float16_is_the_float_product_within_float16_rounding(shape: tuple[int, ...]) -> None:
    """``row16``: several positions of a sequence (a prompt, x (B, T, K) with T > 1) take the
    float16 weights too, within fp16_product_error of Σ|x||w| of the float layer."""
    linear = _linear(32, 13, seed=11)
    layer = Int8Linear(linear, row16=True)
    x = torch.randn(shape)
    x[..., 0, 3] = 50 * OUTLIER
    assert layer.path(x) == "fp16 GEMM"
    with torch.no_grad():
        bound = fp16_product_error(32) * (x.abs() @ linear.weight.abs().T) + 1e-6  # (B, T, 13)
        assert ((layer(x) - linear(x)).abs() <= bound).all()


def test_only_a_decoders_int8_layers_keep_float16_rows() -> None:
    """int8_linears gives a decoder's layers (one row per hypothesis and step) their float16 copy
    and not an encoder's (whole inputs: many rows)."""
    copy_ = int8_linears(for_decoding(_tiny_speech_model()), bf16=False)
    encoder = [m for m in copy_.encoder.modules() if isinstance(m, Int8Linear)]
    decoder = [m for m in copy_.decoder.modules() if isinstance(m, Int8Linear)]
    assert encoder and decoder
    assert all(m.row16 is None for m in encoder) and all(m.row16 is not None for m in decoder)


def test_weights_beyond_float16_keep_the_int8_row() -> None:
    """A weight float16 cannot hold (|w| > 65504): no float16 copy, the one-row path stays int8."""
    linear = _linear(32, 13, seed=8)
    with torch.no_grad():
        linear.weight[2, 5] = 1e5
    layer = Int8Linear(linear, row16=True)
    assert layer.row16 is None and layer.path(torch.randn(1, 32)) == "int8 row"


def test_an_int8_layer_copies_and_keeps_its_outputs() -> None:
    """Copies of a model (an ensemble's members, a decoding copy) carry the packed weights."""
    layer = Int8Linear(_linear(32, 13, seed=2))
    x = torch.randn(MANY_ROWS + 3, 32)
    assert torch.equal(copy.deepcopy(layer)(x), layer(x))


def test_bf16_output_projection_is_close_to_float32() -> None:
    linear = _linear(32, 13, seed=4)
    x = torch.randn(5, 32)
    bf16 = Bf16Linear(linear)
    assert torch.allclose(bf16(x), linear(x), rtol=2**-6, atol=2e-2 * linear(x).abs().max().item())


def test_int8_copy_quantizes_the_encoder_and_keeps_the_output_in_bf16() -> None:
    torch.manual_seed(3)
    config = SpeechConfig(
        vocab_size=11,
        features=FeatureConfig(n_mels=7),
        d_model=16,
        n_heads=2,
        d_ff=32,
        n_encoder_layers=1,
        n_decoder_layers=1,
        dropout=0.0,
    )
    model = SpeechEncoderDecoder(config).eval()
    from qkv.layers import PackedLinear  # the same bf16 product, packed once where oneDNN runs bf16

    quantized = int8_linears(for_decoding(model), bf16=True)
    output = quantized.output  # float16 with float32 near-ties at one row, packed bfloat16 from two
    assert isinstance(output, ByRows) and isinstance(output.many, Bf16Linear | PackedLinear)
    assert isinstance(output.one, NearTiesInFloat) and isinstance(output.one.fast, Fp16Linear)
    assert any(isinstance(m, Int8Linear) for m in quantized.encoder.modules())
    assert not any(type(m) is nn.Linear for m in quantized.modules())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the original is untouched


def _tiny_speech_model() -> SpeechEncoderDecoder:
    """A random speech encoder-decoder of one layer each (seed 3), in eval mode."""
    torch.manual_seed(3)
    config = SpeechConfig(
        vocab_size=11, features=FeatureConfig(n_mels=7), d_model=16, n_heads=2, d_ff=32,
        n_encoder_layers=1, n_decoder_layers=1, dropout=0.0,
    )  # fmt: skip
    return SpeechEncoderDecoder(config).eval()


def test_int8_copy_without_bfloat16_keeps_the_output_in_float32() -> None:
    """``bf16=False`` (a CPU that emulates bfloat16): the vocabulary projection is float32 from
    :data:`VOCABULARY_MANY_ROWS` rows, its logits the float32 model's up to summation order; the
    other linear layers int8, whose huge products are float32 too."""
    model = _tiny_speech_model()
    quantized = int8_linears(for_decoding(model), bf16=False)
    layers = [m for m in quantized.modules() if isinstance(m, Int8Linear)]
    assert layers and not any(m.huge_bf16 for m in layers)
    assert not any(isinstance(m, Bf16Linear) for m in quantized.modules())
    h = torch.randn(VOCABULARY_MANY_ROWS, 16)
    assert torch.allclose(quantized.output(h), model.output(h), atol=1e-5)
    for few in (h[:1], h[:5]):  # fewer rows: float16 weights, the argmax float32's
        assert torch.equal(quantized.output(few).argmax(-1), model.output(few).argmax(-1))


@pytest.mark.parametrize("block", [5, 64])
def test_near_ties_are_those_a_whole_comparison_finds(block: int) -> None:
    """Block by block (a last block shorter than the others included) gives the same indices as
    comparing every logit with its row's largest minus twice the bound."""
    torch.manual_seed(5)
    logits = torch.randn(7, 131)  # 131 = 26 blocks of 5 and 1, or 2 of 64 and 3
    logits[3, 130] = 9.0  # the largest in the last, short block
    bound = torch.rand(7) * 0.8
    floor = logits.amax(dim=1) - 2 * bound  # (7,)
    expected = (logits >= floor[:, None]).nonzero(as_tuple=True)
    rows, columns = near_ties(logits, bound, block=block)
    assert torch.equal(rows, expected[0]) and torch.equal(columns, expected[1])
    assert rows.numel() > 7  # some rows hold more than their largest


def _tied_rows(k: int, n: int) -> tuple[nn.Linear, torch.Tensor]:
    """A layer whose rows 2 and 11 are equal in bfloat16 but not in float32 (row 11 larger by a
    factor 1 + 2⁻¹², under bfloat16's half step), and an input aligned with them: float32's
    argmax is 11, bfloat16's a tie that goes to 2. Shapes: x (3, 2, K)."""
    torch.manual_seed(6)
    linear = nn.Linear(k, n)
    with torch.no_grad():
        row = torch.randn(k).to(torch.bfloat16).float() * 4  # exact in bfloat16
        linear.weight[2], linear.weight[11] = row, row * (1 + 2**-12)
        linear.bias.zero_()
    return linear, row.expand(3, 2, k) / row.norm()


def test_near_ties_in_float_keep_float32_argmax_where_bfloat16_flips_it() -> None:
    linear, x = _tied_rows(37, 29)
    exact = linear(x)  # (3, 2, N)
    assert torch.equal(Bf16Linear(linear)(x).argmax(dim=-1), torch.full((3, 2), 2))  # the flip this fixes
    near = NearTiesInFloat(linear, Bf16Linear(linear))
    got = near(x)
    assert got.shape == exact.shape and torch.equal(got.argmax(dim=-1), exact.argmax(dim=-1))
    assert torch.equal(exact.argmax(dim=-1), torch.full((3, 2), 11))
    assert torch.allclose(got[..., [2, 11]], exact[..., [2, 11]], rtol=1e-6, atol=1e-6)  # near-ties: float32
    bound = BF16_PRODUCT_ERROR * x.norm(dim=-1, keepdim=True) * linear.weight.norm(dim=1).max()
    assert bool(((got - exact).abs() <= bound).all())  # the rest: bfloat16's error at most


def test_near_ties_in_float_with_a_bias_and_random_rows_match_float32_argmax() -> None:
    """Random inputs and a bias: the argmax is float32's on every row (the tested bound holds)."""
    torch.manual_seed(7)
    linear = nn.Linear(23, 53)
    x = torch.randn(41, 23)
    near = NearTiesInFloat(linear, Bf16Linear(linear))
    assert torch.equal(near(x).argmax(dim=-1), linear(x).argmax(dim=-1))


@pytest.mark.parametrize("shape", [(1, 37), (3, 1, 37), (2, 5, 37), (4, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_fp16_product_is_within_its_bound_of_float32(shape: tuple[int, ...], bias: bool) -> None:
    """fbgemm's float16-weight product: float32 activations and sums, each weight rounded to
    float16 (a loud row, a row of subnormal float16 weights): within fp16_product_error of
    Σ|x||w| plus the subnormals' absolute error, one row or many, K not a multiple of 16 too."""
    torch.manual_seed(8)
    k = shape[-1]
    linear = nn.Linear(k, 31, bias=bias)
    with torch.no_grad():
        linear.weight[0] *= 300.0  # loud
        linear.weight[1] = torch.rand(k) * 2**-16  # subnormal in float16
    x = torch.randn(shape) * 4
    got, exact = Fp16Linear(linear)(x), linear(x)
    bound = fp16_product_error(k) * (x.abs() @ linear.weight.abs().T) + FP16_SUBNORMAL_ERROR * x.abs().sum(-1, True)
    assert got.shape == exact.shape and got.dtype == torch.float32
    assert bool(((got - exact).abs() <= bound + 1e-6).all())
    assert not torch.equal(got, exact)  # the weights were rounded: this is not float32 as it is
    assert Fp16Linear(linear)(x.to(torch.bfloat16)).dtype == torch.bfloat16  # the input's dtype back


def test_fp16_near_ties_in_float_keep_float32_argmax_where_float16_flips_it() -> None:
    """Rows 2 and 11 equal in float16 but not in float32 (factor 1 + 2⁻¹³, under float16's half
    step): float16 alone gives the tie to 2, the near-ties in float32 give float32's 11; random
    rows with a bias keep float32's argmax on every row."""
    torch.manual_seed(6)
    k = 37
    linear = nn.Linear(k, 29)
    with torch.no_grad():
        row = torch.randn(k).half().float() * 4  # exact in float16
        linear.weight[2], linear.weight[11] = row, row * (1 + 2**-13)
        linear.bias.zero_()
    x = row.expand(3, 2, k) / row.norm()
    assert torch.equal(Fp16Linear(linear)(x).argmax(dim=-1), torch.full((3, 2), 2))  # the flip this fixes
    near = NearTiesInFloat(linear, Fp16Linear(linear), error=fp16_product_error(k), absolute=FP16_SUBNORMAL_ERROR)
    exact = linear(x)
    got = near(x)
    assert torch.equal(exact.argmax(dim=-1), torch.full((3, 2), 11)) and torch.equal(
        got.argmax(dim=-1), exact.argmax(-1)
    )
    assert torch.allclose(got[..., [2, 11]], exact[..., [2, 11]], rtol=1e-6, atol=1e-6)  # near-ties: float32
    torch.manual_seed(7)
    linear = nn.Linear(23, 53)
    x = torch.randn(41, 23)
    near = NearTiesInFloat(linear, Fp16Linear(linear), error=fp16_product_error(23), absolute=FP16_SUBNORMAL_ERROR)
    assert torch.equal(near(x).argmax(dim=-1), linear(x).argmax(dim=-1))


def test_text_int8_copy_without_bf16_arithmetic_has_a_float16_vocabulary_with_float32_argmax(monkeypatch) -> None:
    """Without bfloat16 arithmetic (as on AVX2-only CPUs), a text model's int8 copy holds its
    vocabulary projection up to 15 rows in float16 under float32 near-ties and from 16 rows in
    float32 (one copy: packed where oneDNN runs), and greedy decoding (one row a step, then three,
    then 17) picks the tokens that the same copy with a float32 vocabulary projection picks; with
    bfloat16 arithmetic, packed bfloat16 from two rows."""
    import qkv.layers
    from qkv.decoding import greedy
    from qkv.layers import PackedLinear, WideLinear
    from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig

    torch.manual_seed(3)
    config = DecoderOnlyConfig(vocab_size=97, d_model=18, n_heads=3, d_ff=11, n_layers=2, dropout=0.0, max_len=40)
    model = for_decoding(DecoderOnly(config).eval())
    object.__setattr__(model.config, "eos_id", None)  # exactly the tokens asked for
    if qkv.layers.packable():
        assert isinstance(int8_linears(model, bf16=True).output.many, PackedLinear)
    monkeypatch.setattr(qkv.layers, "packable", lambda dtype=torch.bfloat16: False)  # as on AVX2-only CPUs
    copy_ = int8_linears(model, bf16=False)
    many = PackedLinear if qkv.layers.packable(torch.float32) else nn.Linear  # 97 > 18: as _float_layer keeps it
    assert isinstance(copy_.output, ByRows) and copy_.output.rows == VOCABULARY_MANY_ROWS
    assert isinstance(copy_.output.many, WideLinear if many is nn.Linear else many)
    assert isinstance(copy_.output.one, NearTiesInFloat) and isinstance(copy_.output.one.fast, Fp16Linear)
    reference = copy.deepcopy(copy_)
    reference.output = model.output  # float32 logits, the rest the same int8 layers
    seventeen = [[2 + i, 3 * i % 97, 5] for i in range(VOCABULARY_MANY_ROWS + 1)]
    for prompts in ([[5, 7, 11]], [[5, 7, 11], [2, 3, 13], [17, 19, 23]], seventeen):
        with torch.no_grad():
            assert greedy(copy_, prompts, max_new_tokens=9) == greedy(reference, prompts, max_new_tokens=9)


def test_by_rows_sends_one_row_to_one_copy_and_more_to_the_other() -> None:
    linear = _linear(32, 13, seed=9)
    one = NearTiesInFloat(linear, Fp16Linear(linear), error=fp16_product_error(32), absolute=FP16_SUBNORMAL_ERROR)
    layer = ByRows(one, Bf16Linear(linear))
    for shape in [(1, 32), (1, 1, 32)]:
        x = torch.randn(shape)
        assert torch.equal(layer(x), one(x))
    for shape in [(2, 32), (1, 3, 32), (4, 1, 32)]:
        x = torch.randn(shape)
        assert torch.equal(layer(x), layer.many(x))
    layer = ByRows(one, Bf16Linear(linear), rows=5)  # fewer than 5 rows to ``one``
    for shape, to in [((4, 32), one), ((2, 2, 32), one), ((5, 32), layer.many), ((1, 7, 32), layer.many)]:
        x = torch.randn(shape)
        assert torch.equal(layer(x), to(x))


def test_speech_int8_copy_keeps_the_decoder_in_bf16_and_near_ties_in_float() -> None:
    """``float_decoder`` with bfloat16 arithmetic: the encoder float32 weights with bfloat16
    products (no int8 layer anywhere), the decoder bfloat16, the vocabulary projection's argmax
    float32's; the decoding step's logits match the float32 model's argmax."""
    model = _tiny_speech_model()
    copy_ = int8_linears(for_decoding(model), float_decoder=True, bf16=True)
    assert isinstance(copy_.output, NearTiesInFloat)
    assert any(isinstance(m, Bf32Linear) for m in copy_.encoder.modules())
    assert not any(isinstance(m, Bf32Linear) for m in copy_.decoder.modules())
    assert not any(isinstance(m, Int8Linear | nn.Linear) for m in copy_.modules())
    h = torch.randn(5, 16)
    assert torch.equal(copy_.output(h).argmax(dim=-1), model.output(h).argmax(dim=-1))


def test_speech_int8_copy_without_bfloat16_is_float32_but_its_one_row_products() -> None:
    """``float_decoder`` on a CPU without bfloat16 arithmetic: every layer float32 (the encoder's as
    the float32 copy holds them: int8 weights there cost Whisper's words and, dequantized for each
    of its 1,500-row products, bought no time), so the encoder's outputs are float32's; but one row
    (a batch-1 decoding step, which reads every weight once) takes float16 weights: the decoder's
    layers fbgemm's float16 kernel (float32 activations and sums), from two rows on the float32
    copy's own layers (the same outputs); the vocabulary projection a text model's (float16 weights
    with their near-ties in float32 below :data:`VOCABULARY_MANY_ROWS` rows): each row's argmax is
    float32's and every logit within float16's rounding of it, at one row, a few and many."""
    model = _tiny_speech_model()
    float_ = int8_linears(for_decoding(model), float_decoder=True, bf16=False)
    fp32 = for_decoding(model, wide=True)  # what qkv.load gives float32 decoding on the CPU
    assert not any(isinstance(m, Int8Linear | Bf16Linear | Bf32Linear) for m in float_.modules())
    theirs = dict(fp32.named_modules())
    rows = {n: m for n, m in float_.named_modules() if isinstance(m, ByRows) and not n.startswith("output")}
    # cross-attention's Wk and Wv read the encoder output (many rows): packed for them where oneDNN runs
    cross_kv = 0 if packable(torch.float32) else 2
    assert len(rows) == 6 + cross_kv and all(n.startswith("decoder.") for n in rows)  # Q/K/V, O, cross Q, O, W1, W2
    assert all(isinstance(m.one, Fp16Linear) and type(m.many) is type(theirs[n]) for n, m in rows.items())
    outside = [(n, type(m)) for n, m in float_.named_modules() if not n.startswith(("output", *rows))]
    assert outside == [(n, type(m)) for n, m in fp32.named_modules() if not n.startswith(("output", *rows))]
    with torch.no_grad():
        for name, layer in rows.items():
            linear, k = theirs[name], layer.one.in_features
            one, three = torch.randn(1, k) * 4, torch.randn(1, 3, k)
            assert torch.equal(layer(one), layer.one(one)) and torch.equal(layer(three), linear(three))
            weight = linear.weight_t.T if isinstance(linear, WideLinear) else linear.weight  # (N, K)
            bound = fp16_product_error(k) * (one.abs() @ weight.abs().T) + FP16_SUBNORMAL_ERROR * one.abs().sum()
            assert bool(((layer(one) - linear(one)).abs() <= bound + 1e-6).all())
    output = float_.output
    assert isinstance(output, ByRows) and output.rows == VOCABULARY_MANY_ROWS
    assert isinstance(output.one, NearTiesInFloat) and isinstance(output.one.fast, Fp16Linear)
    features, valid = torch.randn(2, 19, 7), torch.tensor([[True] * 19, [True] * 11 + [False] * 8])
    with torch.no_grad():
        (ours, ours_valid), (theirs, theirs_valid) = float_.encode(features, valid), fp32.encode(features, valid)
        assert torch.equal(ours_valid, theirs_valid) and torch.equal(ours, theirs)
        assert torch.allclose(ours, model.encode(features, valid)[0], atol=1e-5)
        for rows in (1, 5, VOCABULARY_MANY_ROWS + 1):
            h = torch.randn(rows, 16)
            assert torch.equal(output(h).argmax(dim=-1), model.output(h).argmax(dim=-1))
            torch.testing.assert_close(output(h), model.output(h), atol=16 * fp16_product_error(16), rtol=0)


def test_speech_decoder_weights_beyond_float16_keep_float32_at_one_row() -> None:
    """A decoder layer with a weight beyond float16's range keeps its float32 layer for every row
    (fbgemm's packing would saturate it); the others still take float16 weights at one row."""
    model = _tiny_speech_model()
    with torch.no_grad():
        model.decoder.blocks[0].ffn.w_2.weight[0, 0] = 1e5
    float_ = int8_linears(for_decoding(model), float_decoder=True, bf16=False)
    assert type(float_.decoder.blocks[0].ffn.w_2) is nn.Linear
    assert isinstance(float_.decoder.blocks[0].ffn.w_1, ByRows)


@pytest.mark.parametrize("native", [True, False])
def test_speech_int8_layers_follow_the_cpus_bfloat16_arithmetic(monkeypatch, native: bool) -> None:
    """``bf16=None`` (what ``qkv.load(int8=True)`` passes): the encoder's products in bfloat16 with
    float32 outputs where the CPU multiplies bfloat16 (``native_bf16``), float32 where it does not."""
    import qkv.int8

    monkeypatch.setattr(qkv.int8, "native_bf16", lambda: native)
    copy_ = int8_linears(for_decoding(_tiny_speech_model()), float_decoder=True)
    from qkv.layers import PackedLinear

    encoder = [m for m in copy_.encoder.modules() if isinstance(m, nn.Linear | WideLinear | Bf32Linear | PackedLinear)]
    fp32 = PackedLinear if packable(torch.float32) else nn.Linear | WideLinear  # as the float32 copy holds them
    assert encoder and all(isinstance(m, Bf32Linear if native else fp32) for m in encoder)
    assert not any(isinstance(m, Int8Linear) for m in copy_.modules())
    assert isinstance(copy_.output, NearTiesInFloat if native else ByRows)  # without: float16 near-ties at one row


@pytest.mark.parametrize("shape", [(3, 37), (2, 5, 37), (HUGE_ROWS + 3, 37)])
@pytest.mark.parametrize("bias", [True, False])
def test_bf32_product_is_within_bfloat16_rounding_of_float32(shape: tuple[int, ...], bias: bool) -> None:
    """Bf32Linear: float32 out, within a bfloat16 product's bound of ``F.linear`` (exactly it where
    oneDNN runs no bfloat16), and the process-wide matmul mode as it was after the call."""
    torch.manual_seed(len(shape) + bias)
    linear = nn.Linear(37, 29, bias=bias)
    layer = Bf32Linear(linear)
    x = torch.randn(shape)
    before = torch.backends.mkldnn.matmul.fp32_precision
    with torch.no_grad():
        got, want = layer(x), linear(x)
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    assert got.dtype == torch.float32 and got.shape == want.shape
    bound = BF16_PRODUCT_ERROR * x.norm(dim=-1, keepdim=True) * linear.weight.norm(dim=1)  # (..., N)
    assert bool(((got - want).abs() <= bound).all())
    if not packable():  # PyTorch runs the mode only where oneDNN has bfloat16
        assert torch.equal(got, want)


@pytest.mark.slow
def test_whisper_tiny_int8_keeps_the_float32_words(tmp_path) -> None:
    """The real Whisper tiny.en: greedy int8 transcripts equal float32's on ≥ 95% of 20 FSDD test
    files. Needs `bash bench/fetch_whisper_tiny.sh` and the corpus in $QKV_DATA/fsdd."""
    data = Path(os.environ.get("QKV_DATA", "/work/shared/data")) / "fsdd"
    if not (WHISPER / "model.safetensors").is_file() or not (data / "recordings").is_dir():
        pytest.skip("needs /tmp/whisper-tiny.en (bash bench/fetch_whisper_tiny.sh) and FSDD in $QKV_DATA/fsdd")
    import qkv
    from qkv.hf.convert import import_hf
    from qkv.speech_corpora import fsdd_digits

    import_hf(WHISPER, tmp_path / "whisper")
    files = [u.path for u in fsdd_digits(data)["test"][:20]]
    fp32 = qkv.load(tmp_path / "whisper").transcribe(files, beam_size=1)
    int8 = qkv.load(tmp_path / "whisper", int8=True).transcribe(files, beam_size=1)
    assert sum(a == b for a, b in zip(fp32, int8, strict=True)) >= 19
