"""DistilBERT (``DistilBertModel``, ``DistilBertForMaskedLM``) -> qkv ``encoder_only``.

What is here: :func:`distilbert_fields` (HF ``config.json`` -> qkv config fields),
:func:`distilbert_to_qkv` / :func:`qkv_to_distilbert` (weight names, both ways: import builds
the names it expects from the second). What is not: import itself (``convert.py``); export,
which writes any encoder-only model as BERT (``bert.py``); the tokenizer, which is BERT's
(``bert.bert_tokenizer``: WordPiece with [CLS] and [SEP]).

A DistilBERT is a BERT without token types and pooler, with its own names and config fields
(``dim``, ``n_heads``, ``hidden_dim``, ``n_layers``, ``activation``; LayerNorm eps 1e-12). Its
position table is a table whether learned or filled with sinusoids (``sinusoidal_pos_embds``:
saved with the weights either way). The masked-LM head (``vocab_transform``, the activation,
``vocab_layer_norm``, ``vocab_projector``) is BERT's. ``DistilBertForSequenceClassification``
is not read: its head (``pre_classifier`` + ReLU) is not qkv's pooler (tanh).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from qkv.hf.common import HFConfig, State, linear
from qkv.models.encoder_only import EncoderOnlyConfig

DISTILBERT = ("DistilBertModel", "DistilBertForMaskedLM")


def distilbert_fields(config: HFConfig, architecture: str) -> dict:
    """The qkv ``encoder_only`` fields of a DistilBERT config.json."""
    activation = config.activation("activation", "gelu")
    mlm = architecture == "DistilBertForMaskedLM"
    if mlm and activation != "gelu":
        raise config.refuse("activation", "qkv's masked-LM head uses exact GELU")
    vocab_size = config.integer("vocab_size")
    return {
        "d_model": config.integer("dim"),
        "n_heads": config.integer("n_heads"),
        "d_ff": config.integer("hidden_dim"),
        "activation": activation,
        "norm": "layernorm",
        "norm_eps": 1e-12,  # DistilBERT's, fixed in its code
        "norm_first": False,
        "positions": "learned",
        "max_len": config.integer("max_position_embeddings", 512),
        "dropout": config.number("dropout", 0.1),
        "attention_dropout": config.number("attention_dropout", 0.1),
        "bias": True,
        "vocab_size": vocab_size,
        "n_layers": config.integer("n_layers"),
        "n_classes": 0,
        "pooling": "first",
        "type_vocab_size": 0,
        "tie_output": config.flag("tie_word_embeddings", True),
        "scale_embeddings": False,
        "pad_id": config.token_id("pad_token_id", 0, vocab_size) or 0,
        "embedding_norm": True,
        "pooler": False,
        "mlm_head": mlm,
    }


def _distilbert_names(config: EncoderOnlyConfig) -> list[tuple[str, str]]:
    """(qkv name, HF name) of every DistilBERT tensor."""
    prefix = "distilbert." if config.mlm_head else ""
    e = f"{prefix}embeddings"
    names = [
        ("embed.token.weight", f"{e}.word_embeddings.weight"),
        ("embed.position.weight", f"{e}.position_embeddings.weight"),
    ]
    linear(names, "embed_norm", f"{e}.LayerNorm")
    for i in range(config.n_layers):
        q, h = f"encoder.blocks.{i}", f"{prefix}transformer.layer.{i}"
        for mine, theirs in (("w_q", "q_lin"), ("w_k", "k_lin"), ("w_v", "v_lin"), ("w_o", "out_lin")):
            linear(names, f"{q}.self_attn.{mine}", f"{h}.attention.{theirs}")
        linear(names, f"{q}.norm_1", f"{h}.sa_layer_norm")
        linear(names, f"{q}.ffn.w_1", f"{h}.ffn.lin1")
        linear(names, f"{q}.ffn.w_2", f"{h}.ffn.lin2")
        linear(names, f"{q}.norm_2", f"{h}.output_layer_norm")
    if config.mlm_head:
        linear(names, "mlm_dense", "vocab_transform")
        linear(names, "mlm_norm", "vocab_layer_norm")
        names.append(("mlm_output.bias", "vocab_projector.bias"))
        if not config.tie_output:
            names.append(("mlm_output.weight", "vocab_projector.weight"))
    return names


def distilbert_to_qkv(tensors: Mapping[str, Tensor], config: EncoderOnlyConfig) -> State:
    """qkv ``encoder_only`` weights from DistilBERT tensors."""
    return {mine: tensors[theirs] for mine, theirs in _distilbert_names(config)}


def qkv_to_distilbert(state: Mapping[str, Tensor], config: EncoderOnlyConfig) -> State:
    """DistilBERT tensors from qkv ``encoder_only`` weights: what import expects to find."""
    return {theirs: state[mine] for mine, theirs in _distilbert_names(config)}
