"""Copies of a model prepared for decoding: :func:`for_decoding` (one stacked Q/K/V product per
self-attention, one stacked W1/W3 product per gated feed-forward, RMSNorm's kernel called
directly; with ``wide``, the widening layers' weights stored transposed for float32 decoding on
CPUs), :func:`packed_linears` (bfloat16
linear layers in oneDNN's packed layout, for ``--bf16`` on CPUs) and :func:`int8_linears`
(int8-weight linear layers, ``qkv.int8``).
Both return a new model (an ensemble: an ensemble of new members) and leave theirs unchanged.

What is not here: the searches that run them (``decoding/``), loading a model directory for
decoding (``loading.py``, which applies them).
"""

from __future__ import annotations

from qkv.decoding import DecodingModel
from qkv.ensemble import Ensemble


def for_decoding(model: DecodingModel, *, wide: bool = False) -> DecodingModel:
    """A copy of ``model`` for decoding (eval mode): every self-attention computes Q, K and V
    with one stacked matrix product (:meth:`~qkv.attention.MultiHeadAttention.fuse_qkv`), which
    saves two calls per layer per token, and every gated feed-forward (SwiGLU, GEGLU) its W1 and
    W3 with one (:meth:`~qkv.layers.FeedForward.fuse_gate`), one call more; every RMSNorm calls
    aten's kernel directly (:class:`qkv.layers.FusedRMSNorm`, the same bits in fewer Python calls).
    Same outputs up to float rounding (tested equal);
    the copy is for decoding only (``save_model`` refuses it). ``model`` is not changed. Apply
    it before :func:`int8_linears`, which quantizes the stacked projection like any other.
    An ensemble gives an ensemble of its members' copies.

    ``wide``: every widening ``nn.Linear`` (more outputs than inputs: the stacked Q/K/V, the
    feed-forward's first matrices, the vocabulary projection) holds its weight transposed
    (:class:`qkv.layers.WideLinear`). A float32 decoding step on the CPU multiplies one row per
    hypothesis, and for those shapes the transposed layout is read about twice as fast (measured
    in ``WideLinear``'s docstring; bench/mt_speed.py end to end). A weight tied to an embedding is
    copied (the embedding keeps its rows): more memory, by the vocabulary projection's size.
    Leave it off before :func:`int8_linears` or ``.to(bfloat16)`` (no gain measured in bfloat16).
    With ``wide``, where oneDNN runs (:func:`qkv.layers.packable`), the layers that multiply many
    rows at every call, the encoder's and cross-attention's Wk and Wv (which read the encoder
    output), hold float32 weights packed for oneDNN instead (:func:`_pack_many_rows`).
    """
    import copy

    if isinstance(model, Ensemble):
        return Ensemble(tuple(for_decoding(m, wide=wide) for m in model.models))

    import torch
    from torch import nn

    from qkv.blocks import DecoderBlock, EncoderBlock
    from qkv.layers import FusedRMSNorm, WideLinear, packable

    fast = copy.deepcopy(model).eval()
    for module in fast.modules():
        if isinstance(module, DecoderBlock | EncoderBlock):
            module.self_attn.fuse_qkv()
            module.ffn.fuse_gate()
    for parent in list(fast.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.RMSNorm:
                setattr(parent, name, FusedRMSNorm(child))
    if wide and packable(torch.float32):
        _pack_many_rows(fast)
    for parent in list(fast.modules()) if wide else []:
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.out_features > child.in_features:
                setattr(parent, name, WideLinear(child))
    return fast


# The rows PackedLinear's float32 layout is chosen for: an encoder's products have a few hundred
# (a batch of sentences) to thousands (Whisper: 1,500 a window); the layout oneDNN picks barely
# changed between 64 and 6,000 rows (3,000-row products of Whisper tiny.en's shapes, one thread).
MANY_ROWS = 512


def _pack_many_rows(model: DecodingModel) -> None:
    """In place: the ``nn.Linear`` layers of ``model.encoder`` and the cross-attentions' Wk and Wv
    become float32 :class:`qkv.layers.PackedLinear` ones, and each encoder feed-forward computes
    its activation inside its first product (:meth:`qkv.layers.FeedForward.pack_first`, ungated
    activations). Their products have an encoder's rows (Whisper: 1,500 a window), compute-bound,
    where oneDNN's kernel adds the bias and applies the activation inside the product instead of
    in passes of their own over the output. The same outputs up to float rounding (tested).
    Whisper tiny.en's encoder, same-process A/B, one thread, under contention: see the commit."""
    from torch import nn

    from qkv.blocks import DecoderBlock, EncoderBlock
    from qkv.layers import POST_OPS, PackedLinear

    encoder = getattr(model, "encoder", None)
    for module in encoder.modules() if encoder is not None else ():
        if isinstance(module, EncoderBlock) and module.ffn.w_13 is None and module.ffn.activation in POST_OPS:
            module.ffn.pack_first(MANY_ROWS)
    for parent in list(encoder.modules()) if encoder is not None else []:
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child, dtype=child.weight.dtype, rows=MANY_ROWS))
    for block in model.modules():
        if isinstance(block, DecoderBlock) and block.cross_attn is not None:
            for name in ("w_k", "w_v"):
                child = getattr(block.cross_attn, name)
                if type(child) is nn.Linear:
                    setattr(block.cross_attn, name, PackedLinear(child, dtype=child.weight.dtype, rows=MANY_ROWS))


def packed_linears(model: DecodingModel) -> DecodingModel:
    """A copy of ``model`` (in bfloat16, on the CPU) whose ``nn.Linear`` layers hold their weights
    in oneDNN's packed layout (:class:`qkv.layers.PackedLinear`): the same outputs (tested), but
    a step reads each weight once instead of reordering it on every call. A tied output weight is
    packed as a copy (the embedding keeps its rows). Apply after ``.to(bfloat16)``; where
    :func:`qkv.layers.packable` says no, the copy is the model's as it was. An ensemble gives
    an ensemble of its members' copies.
    """
    import copy

    if isinstance(model, Ensemble):
        return Ensemble(tuple(packed_linears(m) for m in model.models))

    from torch import nn

    from qkv.layers import PackedLinear, packable

    packed = copy.deepcopy(model).eval()
    for parent in list(packed.modules()) if packable() else []:
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
    return packed.requires_grad_(False)


def int8_linears(model: DecodingModel, *, float_decoder: bool = False, bf16: bool | None = None) -> DecodingModel:
    """A copy of ``model`` whose ``nn.Linear`` layers, the encoder's included, hold int8 weights
    with one scale per output channel (:class:`qkv.int8.Int8Linear`), for decoding on CPUs; the
    vocabulary projection (the model's ``output``, often tied to the embedding) is float16 at one
    row, with the logits that could be the largest recomputed in float32, and from two rows kept in
    float as ``bf16`` says below (:func:`_vocabulary`). A text model's decoder layers also keep
    their weights in float16 for one-row products (``Int8Linear(row16=True)``: a batch-1 decoding
    step takes fbgemm's float16 kernel with float activations, faster there than the int8 row and
    without its activation rounding; three bytes a weight in memory instead of one).
    Embeddings, norms, convolutions and attention arithmetic stay float32.

    ``float_decoder`` (what speech models get): no int8 layer at all. The decoder's linear layers
    in bfloat16 (:class:`qkv.int8.Bf16Linear`, or packed as above), the vocabulary projection in
    bfloat16 with its near-ties in float32 (:class:`qkv.int8.NearTiesInFloat`: each row's argmax
    is float32's), and the encoder's (every layer outside the decoder) float32 weights whose
    products run in bfloat16 with float32 outputs (:class:`qkv.int8.Bf32Linear`); where ``bf16``
    is False, all float32 as the float32 copy has them (widening ones transposed, below). Why
    the decoder (Whisper tiny.en, 300 FSDD test files, greedy, the int8 encoder's outputs alike;
    docs/speech.md): int8 decoder layers with a bfloat16 vocabulary kept
    float32's words on 272, float32 ones on 283, bfloat16 ones with float32 near-ties on 285,
    float32 ones with them on 287. Why the encoder: its int8 weights cost the rest (13 of those
    300 files; on an AVX2-only CPU, where the decoder is float32, 5 of 100), and bought no time:
    its products have 1,500 rows a window, so they are compute-bound, and int8 weights there ran
    as a float32 (or bfloat16) product of weights dequantized on every call. Emulated on 100
    files, bfloat16 products with float32 outputs kept all of float32's words (docs/speech.md).

    ``bf16``: whether the layers kept in float (the vocabulary projection, a float decoder, the
    int8 layers' huge products) are bfloat16; None: where the CPU has bfloat16 arithmetic
    (:func:`qkv.int8.native_bf16`). Without it they stay float32, widening ones transposed
    (:class:`qkv.layers.WideLinear`) and with no near-ties to recompute: emulated bfloat16 costs
    several times float32 there (AMD EPYC with AVX2 alone, base translation model, int8 greedy batch
    32: the encoder's products and the vocabulary projection in bfloat16 took most of the time).

    Why int8 at all (measured on Whisper tiny.en, 50 FSDD files, docs/speed.md): PyTorch's dynamic
    quantization (activations quantized per tensor on the fly) kept the fp32 transcript on 36;
    int8 weights with float activations on 45; with the output projection in bfloat16, 49.
    Decoding reads every weight once per step, so fewer bytes is most of the gain at small
    batches. Outputs may differ slightly from float32: check with ``qkv evaluate``. Inference
    only (the copy has no gradients). An ensemble gives an ensemble of its members' copies.
    """
    import copy

    if isinstance(model, Ensemble):
        return Ensemble(tuple(int8_linears(m, float_decoder=float_decoder, bf16=bf16) for m in model.models))

    import torch
    from torch import nn

    from qkv.int8 import Bf32Linear, Int8Linear, NearTiesInFloat, native_bf16
    from qkv.layers import packable

    bf16 = native_bf16() if bf16 is None else bf16

    quantized = copy.deepcopy(model).eval()
    if float_decoder and not bf16 and packable(torch.float32):  # float32 throughout: as the float32 copy
        _pack_many_rows(quantized)
    decoder = getattr(quantized, "decoder", None)
    in_decoder = set() if decoder is None else {id(m) for m in decoder.modules()}
    for parent in list(quantized.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if parent is quantized and name == "output" and float_decoder:
                # a speech model's vocabulary: bfloat16 with float32 near-ties where native
                layer = _float_layer(child, bf16=bf16)
                setattr(parent, name, NearTiesInFloat(child, layer) if bf16 else layer)
            elif parent is quantized and name == "output":
                setattr(parent, name, _vocabulary(child, bf16=bf16))
            elif id(parent) in in_decoder and float_decoder:
                setattr(parent, name, _float_layer(child, bf16=bf16))
            elif float_decoder:  # a speech model's encoder: float32 weights, bfloat16 products where native
                setattr(parent, name, Bf32Linear(child) if bf16 else _float_layer(child, bf16=False))
            else:  # a text model: int8; its decoder's layers also keep float16 weights for one-row steps
                setattr(parent, name, Int8Linear(child, bf16=bf16, row16=id(parent) in in_decoder))
    return quantized.requires_grad_(False)


def _float_layer(linear, *, bf16: bool):
    """A layer :func:`int8_linears` keeps in float: bfloat16 (packed for oneDNN where it runs,
    :class:`qkv.layers.PackedLinear`, else :class:`qkv.int8.Bf16Linear`) where ``bf16``, else
    float32 as the float32 decoding copy has it (widening layers transposed,
    :class:`qkv.layers.WideLinear`)."""
    from qkv.int8 import Bf16Linear
    from qkv.layers import PackedLinear, WideLinear, packable

    if bf16:
        return PackedLinear(linear) if packable() else Bf16Linear(linear)
    return WideLinear(linear) if linear.out_features > linear.in_features else linear


def _vocabulary(linear, *, bf16: bool):
    """A text model's int8 vocabulary projection: at one row (a batch-1 decoding step, which reads
    this projection most) float16 weights in fbgemm's kernel (:class:`qkv.int8.Fp16Linear`, half
    float32's bytes) with the logits that could be the largest recomputed in float32
    (:class:`qkv.int8.NearTiesInFloat`: each row's argmax is float32's); from two rows on the layer
    as :func:`_float_layer` keeps it (packed bfloat16 where the CPU has bfloat16 arithmetic, else float32), both
    in :class:`qkv.int8.ByRows`. Why: SmolLM2-135M's 49152 × 576 at one row took fbgemm's float16
    kernel about half the CPU time of bfloat16 ``F.linear`` on an AVX2 CPU, and read it faster than
    packed bfloat16 where oneDNN runs bfloat16, but was slower from 40 rows on (docs/speed.md).
    Weights beyond float16's range keep :func:`_float_layer`'s layer for every row."""
    from qkv.int8 import FP16_SUBNORMAL_ERROR, ByRows, Fp16Linear, NearTiesInFloat, fp16_fits, fp16_product_error

    many = _float_layer(linear, bf16=bf16)
    if not fp16_fits(linear.weight):
        return many
    error = fp16_product_error(linear.in_features)
    near = NearTiesInFloat(linear, Fp16Linear(linear), error=error, absolute=FP16_SUBNORMAL_ERROR)
    return ByRows(near, many)
