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
    aten's kernel directly, and one float32 row in four operators (:class:`qkv.layers.FusedRMSNorm`:
    the same bits, or for one row the same up to float rounding, in fewer calls).
    Same outputs up to float rounding (tested equal);
    the copy is for decoding only (``save_model`` refuses it). ``model`` is not changed. Apply
    it before :func:`int8_linears`, which quantizes the stacked projection like any other.
    An ensemble gives an ensemble of its members' copies.

    ``wide``: every widening ``nn.Linear`` (more outputs than inputs: the stacked Q/K/V, the
    feed-forward's first matrices, the vocabulary projection) holds its weight transposed
    (:class:`qkv.layers.WideLinear`). A float32 decoding step on the CPU multiplies one row per
    hypothesis, and for those shapes the transposed layout is read about twice as fast (measured
    in ``WideLinear``'s docstring; bench/mt_speed.py end to end). A weight tied to an embedding is
    held once: the embedding reads its rows from the transposed copy (:func:`_widened`).
    Leave it off before :func:`int8_linears` or ``.to(bfloat16)`` (no gain measured in bfloat16).
    With ``wide``, where oneDNN runs (:func:`qkv.layers.packable`), the layers that multiply many
    rows at every call, the encoder's and cross-attention's Wk and Wv (which read the encoder
    output), hold float32 weights packed for oneDNN instead (:func:`_pack_many_rows`).
    """
    if isinstance(model, Ensemble):
        return Ensemble(tuple(for_decoding(m, wide=wide) for m in model.models))

    import torch
    from torch import nn

    from qkv.blocks import DecoderBlock, EncoderBlock
    from qkv.layers import FusedRMSNorm, packable

    fast, shared = _copy_for_replacing(model)
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
                setattr(parent, name, _widened(child, fast))
    return _unshare(fast, shared)


def _copy_for_replacing(model):
    """A deep copy of ``model`` (eval mode) whose ``nn.Linear`` layers hold, for now, ``model``'s
    own weights and biases, and those tensors by id: the copy functions replace those layers
    with layers of their own (stacked, transposed, packed, int8), so copying their weights first
    would hold each once more while the copy is made, and the process keeps that peak (the
    allocator keeps freed memory, ``qkv.memory``). Loading SmolLM2-135M for decoding (resident
    MiB once the copies are made, the model given still held, 2026-12-07): float32 2,102 with a
    deep copy, 1,776 without (the tied vocabulary held once too, :func:`_widened`); int8 2,717
    against 2,189. :func:`_unshare` gives whatever is left shared its own copy, so ``model`` and
    the copy never share a tensor."""
    import copy

    from torch import nn

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    shared = {id(t): t for m in linears for t in (m.weight, m.bias) if t is not None}
    return copy.deepcopy(model, memo=dict(shared)).eval(), shared


def _unshare(model: DecodingModel, shared: dict) -> DecodingModel:
    """``model`` with every parameter or buffer that is one of ``shared``'s tensors (another
    model's: :func:`_copy_for_replacing`) replaced by a copy of its own, one copy per tensor (so a
    tied weight stays tied). In place; returns ``model``."""
    from torch import nn

    copies: dict = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is None or id(tensor) not in shared:
                    continue
                if id(tensor) not in copies:
                    data = tensor.detach().clone()
                    kept = nn.Parameter(data, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else data
                    copies[id(tensor)] = kept
                store[name] = copies[id(tensor)]
    return model


def _widened(linear, model: DecodingModel):
    """``linear`` as a :class:`qkv.layers.WideLinear`; an embedding of ``model`` tied to its weight
    (a vocabulary projection's) then reads its rows from the transposed copy (a strided view,
    no copy of its own). One copy of the vocabulary instead of two: SmolLM2-135M's 49152 × 576
    is 108 MiB in float32. The price, a lookup gathering each row's K values 4·N bytes apart: one
    thread, under contention, 2026-12-07, 8 against 24 us a token at one token, 0.15 against 3.5 ms
    for a 256-token prompt (the prompt's products take hundreds of ms)."""
    from torch import nn

    from qkv.layers import WideLinear

    wide = WideLinear(linear)
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module.weight is linear.weight:
            module.weight = nn.Parameter(wide.weight_t.t(), requires_grad=False)  # (V, D): a view of (D, V)
    return wide


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
    is False, all float32 as the float32 copy has them (widening ones transposed, below) but the
    vocabulary projection, which is a text model's (:func:`_vocabulary`: float16 below
    :data:`VOCABULARY_MANY_ROWS` rows, its near-ties in float32, so the argmax is still float32's):
    the step's largest product, read in half float32's bytes (Whisper tiny.en's 384 x 51,864, one
    row, one thread, same-process A/B under contention, 2026-12-07: 4.8 against 6.1 ms a call, the
    same greedy tokens and transcripts), and the decoder's layers at one row, which take float16
    weights too (:func:`_decoder_layer`: fbgemm's float16 kernel, float32 activations and sums;
    from two rows on the float32 layers). Whisper's published weights are float16 values, so
    their float16 copy is exact and only the order of summation differs: on the real steps of a
    minute of joined speech, one thread, each step run on both copies in turn (contended,
    2026-12-08), 15.6 against 16.5 ms a step (median), the same argmax at every step, logits
    within 3.2e-5. Why
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

    if isinstance(model, Ensemble):
        return Ensemble(tuple(int8_linears(m, float_decoder=float_decoder, bf16=bf16) for m in model.models))

    import torch
    from torch import nn

    from qkv.int8 import Bf32Linear, Int8Linear, NearTiesInFloat, native_bf16
    from qkv.layers import packable

    bf16 = native_bf16() if bf16 is None else bf16

    quantized, shared = _copy_for_replacing(model)
    if float_decoder and not bf16 and packable(torch.float32):  # float32 throughout: as the float32 copy
        _pack_many_rows(quantized)
    decoder = getattr(quantized, "decoder", None)
    in_decoder = set() if decoder is None else {id(m) for m in decoder.modules()}
    for parent in list(quantized.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if parent is quantized and name == "output" and float_decoder and bf16:
                # a speech model's vocabulary where bfloat16 is native: bfloat16 with float32 near-ties
                setattr(parent, name, NearTiesInFloat(child, _float_layer(child, bf16=True)))
            elif parent is quantized and name == "output":  # a text model's, or a speech one's without bfloat16
                setattr(parent, name, _vocabulary(child, bf16=bf16))
            elif id(parent) in in_decoder and float_decoder:
                setattr(parent, name, _float_layer(child, bf16=bf16) if bf16 else _decoder_layer(child))
            elif float_decoder:  # a speech model's encoder: float32 weights, bfloat16 products where native
                setattr(parent, name, Bf32Linear(child) if bf16 else _float_layer(child, bf16=False))
            else:  # a text model: int8; its decoder's layers also keep float16 weights for one-row steps
                setattr(parent, name, Int8Linear(child, bf16=bf16, row16=id(parent) in in_decoder))
    return _unshare(quantized, shared).requires_grad_(False)


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


def _decoder_layer(linear):
    """A speech model's decoder layer where the CPU has no bfloat16 arithmetic (:func:`int8_linears`
    with ``float_decoder``): float16 weights in fbgemm's kernel at one row (:class:`qkv.int8.Fp16Linear`:
    float32 activations and sums, half float32's bytes; a batch-1 step reads every weight once), and
    :func:`_float_layer`'s float32 layer from two rows on (beam search, batched long-form, a prompt),
    both in :class:`qkv.int8.ByRows`. Weights beyond float16's range keep the float32 layer for every row."""
    from qkv.int8 import ByRows, Fp16Linear, fp16_fits

    float_ = _float_layer(linear, bf16=False)
    return ByRows(Fp16Linear(linear), float_) if fp16_fits(linear.weight) else float_


# From this many rows on, a text model's int8 vocabulary projection without bfloat16 arithmetic
# multiplies float32 weights packed for oneDNN rather than its float16 ones (fbgemm): per call, one
# thread, same-process A/B under contention, 2026-12-07, float16 with its float32 near-ties against
# the packed float32 product, SmolLM2-135M's 49152 x 576: 7.4 against 17.4 ms at 2 rows, 15.0
# against 21.7 at 8, 44.8 against 36.3 at 32, 451 against 289 at 256 (a prompt's positions); the
# base translation model's 8000 x 512: 4.0 against 5.7 ms at 8 rows, 7.0 against 6.3 at 32.
VOCABULARY_MANY_ROWS = 16


def _vocabulary(linear, *, bf16: bool):
    """A text model's int8 vocabulary projection (a speech model's too where ``bf16`` is False: its
    float decoder is float32 there, :func:`int8_linears`): float16 weights in fbgemm's kernel
    (:class:`qkv.int8.Fp16Linear`, half float32's bytes) with the logits that could be the largest
    recomputed in float32 (:class:`qkv.int8.NearTiesInFloat`, from the layer's own float32 weight,
    often the tied embedding's rows: each row's argmax is float32's) for a batch-1 decoding step,
    which reads this projection most, and from two rows on packed bfloat16 as :func:`_float_layer`
    keeps it where the CPU has bfloat16 arithmetic (``bf16``), both in :class:`qkv.int8.ByRows`.
    SmolLM2-135M's 49152 × 576 at one row took fbgemm's float16 kernel about half the CPU time of
    bfloat16 ``F.linear`` on an AVX2 CPU, and read it faster than packed bfloat16 where oneDNN
    runs bfloat16, but was slower from 40 rows on (docs/speed.md). Without bfloat16 arithmetic the
    float16 layer takes fewer than :data:`VOCABULARY_MANY_ROWS` rows, where it was the faster, and
    a widening projection's float32 weights packed for oneDNN the rest (:class:`qkv.layers.PackedLinear`;
    without oneDNN, or narrowing, :func:`_float_layer`'s layer): one float32 copy, not
    :class:`qkv.layers.WideLinear`'s two (its transposed one served one to three rows, which the
    float16 layer takes now).
    Weights beyond float16's range keep :func:`_float_layer`'s layer for every row."""
    import torch

    from qkv.int8 import FP16_SUBNORMAL_ERROR, ByRows, Fp16Linear, NearTiesInFloat, fp16_fits, fp16_product_error
    from qkv.layers import PackedLinear, packable

    if not fp16_fits(linear.weight):
        return _float_layer(linear, bf16=bf16)
    error = fp16_product_error(linear.in_features)
    near = NearTiesInFloat(linear, Fp16Linear(linear), error=error, absolute=FP16_SUBNORMAL_ERROR)
    if bf16:
        return ByRows(near, _float_layer(linear, bf16=True))
    if linear.out_features > linear.in_features and packable(torch.float32):
        return ByRows(near, PackedLinear(linear, dtype=torch.float32, rows=32), rows=VOCABULARY_MANY_ROWS)
    return ByRows(near, _float_layer(linear, bf16=False), rows=VOCABULARY_MANY_ROWS)  # no oneDNN, or narrowing
