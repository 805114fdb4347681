"""Copies of a model prepared for decoding: :func:`for_decoding` (one stacked Q/K/V product per
self-attention) and :func:`int8_linears` (int8 linear layers, PyTorch's dynamic quantization).
Both return a new model (an ensemble: an ensemble of new members) and leave theirs unchanged.

What is not here: the searches that run them (``decoding/``), loading a model directory for
decoding (``loading.py``, which applies them).
"""

from __future__ import annotations

from qkv.decoding import DecodingModel
from qkv.ensemble import Ensemble


def for_decoding(model: DecodingModel) -> DecodingModel:
    """A copy of ``model`` for decoding (eval mode): every self-attention computes Q, K and V
    with one stacked matrix product (:meth:`~qkv.attention.MultiHeadAttention.fuse_qkv`), which
    saves two calls per layer per token. Same outputs up to float rounding (tested equal);
    the copy is for decoding only (``save_model`` refuses it). ``model`` is not changed. Apply
    it before :func:`int8_linears`, which quantizes the stacked projection like any other.
    An ensemble gives an ensemble of its members' copies.
    """
    import copy

    if isinstance(model, Ensemble):
        return Ensemble(tuple(for_decoding(m) for m in model.models))

    from qkv.blocks import DecoderBlock, EncoderBlock

    fast = copy.deepcopy(model).eval()
    for module in fast.modules():
        if isinstance(module, DecoderBlock | EncoderBlock):
            module.self_attn.fuse_qkv()
    return fast


def int8_linears(model: DecodingModel) -> DecodingModel:
    """A copy of ``model`` whose ``nn.Linear`` layers hold int8 weights (one scale per output
    channel) and quantize their inputs on the fly: PyTorch's dynamic quantization (its fbgemm
    kernels), for decoding on CPUs. Embeddings, norms and attention arithmetic stay float32.

    Decoding reads every weight once per step, so a quarter of the bytes is most of the gain at
    small batches (bench/mt_speed.py). Outputs may differ slightly from float32: check with
    ``qkv evaluate``. Inference only (the copy has no gradients). An ensemble gives an
    ensemble of its members' copies.
    """
    import copy
    import warnings

    if isinstance(model, Ensemble):
        return Ensemble(tuple(int8_linears(m) for m in model.models))

    from torch import nn
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        # torch.ao.quantization announces its move to torchao, which is not a dependency here;
        # the API still ships and is what runs.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return quantize_dynamic(copy.deepcopy(model).eval(), {nn.Linear: per_channel_dynamic_qconfig})
