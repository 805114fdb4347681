"""BERT: ``BertModel``, ``BertForMaskedLM``, ``BertForSequenceClassification`` <-> qkv ``encoder_only``.

What is here: :func:`bert_fields` / :func:`bert_config` (HF ``config.json`` <-> qkv config
fields), :func:`bert_to_qkv` / :func:`qkv_to_bert` (weight names), :func:`bert_labels` (a
classifier's class names), :func:`bert_architecture` (the class a qkv model exports as) and
:func:`bert_tokenizer`. What is not: import and export themselves (``convert.py``), what the
families share (``common.py``).

The model: post-norm, learned positions, token types, embedding LayerNorm, pooler, MLM head
with its bias. Which class a qkv model exports as follows from its heads: classifier ->
sequence classification, MLM head -> masked LM, neither -> BertModel. A model with an MLM head
and a pooler is refused (``BertForMaskedLM`` has no pooler); one with neither exports as
``BertModel`` without pooler weights, which transformers then initializes at random:
``last_hidden_state`` is the model's, ``pooler_output`` is not. With
``tie_word_embeddings=false`` transformers 5.x computes the MLM logits with
``cls.predictions.decoder.bias`` (tied, it is ``cls.predictions.bias``): import reads the one
the model computes with, export writes both. A classifier's class names are qkv's ``labels``
(config.json, class order) and HF's ``id2label``/``label2id``, both ways. Import leaves out,
and names as ignored, the next-sentence head (``cls.seq_relationship``) and a
``BertForMaskedLM`` checkpoint's pooler. Not supported: relative positions, BERT as a decoder.

The tokenizer: ``tokenizer.json`` as it is, else ``vocab.txt`` rebuilt as HF's tokenizers do
(WordPiece); the special tokens default to [PAD], [CLS], [SEP], [UNK] (and [MASK]).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors
from torch import Tensor

from qkv.errors import UserError
from qkv.hf.common import (
    HFConfig,
    State,
    TokenizerSettings,
    hf_activation,
    linear,
    load_tokenizer,
    qkv_tokenizer,
    require,
    same_heads,
)
from qkv.models.encoder_only import EncoderOnlyConfig
from qkv.tokenization import FILE, Tokenizer

BERT = ("BertModel", "BertForMaskedLM", "BertForSequenceClassification")


def bert_fields(
    config: HFConfig, architecture: str, tensor_names: set[str], *, pad_id: int = 0, type_vocab_size: int = 2
) -> dict:
    """The qkv ``encoder_only`` fields of a BERT config.json (or of a RoBERTa's, which has the same
    fields; ``pad_id`` and ``type_vocab_size``: the family's defaults). The heads follow the class
    name's ending: ForMaskedLM, ForSequenceClassification (with a pooler), else the bare model (a
    pooler where the checkpoint has one)."""
    if config.text("position_embedding_type", "absolute") != "absolute":
        raise config.refuse("position_embedding_type", "only absolute (learned) positions are")
    for name in ("is_decoder", "add_cross_attention"):
        if config.flag(name, False):
            raise config.refuse(name, "BERT as a decoder is not")
    activation = config.activation("hidden_act", "gelu")
    mlm, classifier = architecture.endswith("ForMaskedLM"), architecture.endswith("ForSequenceClassification")
    if mlm and activation != "gelu":
        raise config.refuse("hidden_act", "qkv's masked-LM head uses exact GELU")
    d_model = config.integer("hidden_size")
    vocab_size = config.integer("vocab_size")
    n_classes = 0
    if classifier:
        labels = bert_labels(config)
        n_classes = len(labels) if labels is not None else config.integer("num_labels", 2)
    has_pooler = any(name.endswith("pooler.dense.weight") for name in tensor_names)
    return {
        "d_model": d_model,
        "n_heads": config.integer("num_attention_heads"),
        "d_ff": config.integer("intermediate_size"),
        "activation": activation,
        "norm": "layernorm",
        "norm_eps": config.number("layer_norm_eps", 1e-12),
        "norm_first": False,
        "positions": "learned",
        "max_len": config.integer("max_position_embeddings", 512),
        "dropout": config.number("hidden_dropout_prob", 0.1),
        "attention_dropout": config.number("attention_probs_dropout_prob", 0.1),
        "bias": True,
        "vocab_size": vocab_size,
        "n_layers": config.integer("num_hidden_layers"),
        "n_classes": n_classes,
        "pooling": "first",
        "type_vocab_size": config.integer("type_vocab_size", type_vocab_size, minimum=0),
        "tie_output": config.flag("tie_word_embeddings", True),
        "scale_embeddings": False,
        "pad_id": config.token_id("pad_token_id", pad_id, vocab_size) or 0,
        "embedding_norm": True,
        "pooler": classifier or (not mlm and has_pooler),
        "mlm_head": mlm,
    }


def bert_labels(config: HFConfig) -> list[str] | None:
    """The class names of a classifier's config.json, in class order (None without ``id2label``)."""
    labels = config.fields.get("id2label")
    if labels is None:
        return None
    n = len(labels) if isinstance(labels, dict) else 0
    if not n or set(labels) != {str(i) for i in range(n)} or not all(isinstance(name, str) for name in labels.values()):
        raise UserError(f'{config.path}: field \'id2label\' must map "0", "1", ..., "N-1" to label names (strings)')
    return [labels[str(i)] for i in range(n)]


def bert_architecture(config: EncoderOnlyConfig) -> str:
    """The BERT class of an encoder-only model, from its heads."""
    if config.n_classes and config.mlm_head:
        raise UserError("cannot export as BERT: the model has both a masked-LM head and a classifier")
    if config.n_classes:
        return "BertForSequenceClassification"
    return "BertForMaskedLM" if config.mlm_head else "BertModel"


def body_names(config: EncoderOnlyConfig, prefix: str) -> list[tuple[str, str]]:
    """(qkv name, HF name) of the embeddings and layers, which BERT and RoBERTa name alike
    (``prefix``: "bert.", "roberta." or none); the type table is handled apart."""
    e = f"{prefix}embeddings"
    names = [
        ("embed.token.weight", f"{e}.word_embeddings.weight"),
        ("embed.position.weight", f"{e}.position_embeddings.weight"),
    ]
    linear(names, "embed_norm", f"{e}.LayerNorm")
    for i in range(config.n_layers):
        q, h = f"encoder.blocks.{i}", f"{prefix}encoder.layer.{i}"
        for mine, theirs in (
            ("w_q", "self.query"),
            ("w_k", "self.key"),
            ("w_v", "self.value"),
            ("w_o", "output.dense"),
        ):
            linear(names, f"{q}.self_attn.{mine}", f"{h}.attention.{theirs}")
        linear(names, f"{q}.norm_1", f"{h}.attention.output.LayerNorm")
        linear(names, f"{q}.ffn.w_1", f"{h}.intermediate.dense")
        linear(names, f"{q}.ffn.w_2", f"{h}.output.dense")
        linear(names, f"{q}.norm_2", f"{h}.output.LayerNorm")
    return names


def _bert_names(config: EncoderOnlyConfig) -> list[tuple[str, str]]:
    """(qkv name, HF name) of every BERT tensor; the MLM bias and type table are handled apart."""
    prefix = "" if bert_architecture(config) == "BertModel" else "bert."
    names = body_names(config, prefix)
    if config.pooler:
        linear(names, "pooler", f"{prefix}pooler.dense")
    if config.mlm_head:
        linear(names, "mlm_dense", "cls.predictions.transform.dense")
        linear(names, "mlm_norm", "cls.predictions.transform.LayerNorm")
        names.append(("mlm_output.bias", "cls.predictions.bias"))
        if not config.tie_output:
            names.append(("mlm_output.weight", "cls.predictions.decoder.weight"))
    if config.n_classes:
        linear(names, "classifier", "classifier")
    return names


def bert_to_qkv(tensors: Mapping[str, Tensor], config: EncoderOnlyConfig) -> State:
    """qkv ``encoder_only`` weights from BERT tensors (named as :func:`qkv_to_bert` writes them)."""
    state = {mine: tensors[theirs] for mine, theirs in _bert_names(config)}
    if config.type_vocab_size:
        state["token_type.weight"] = tensors[_bert_type_name(config)]
    return state


def qkv_to_bert(state: Mapping[str, Tensor], config: EncoderOnlyConfig) -> State:
    """BERT tensors from qkv ``encoder_only`` weights; without token types, a one-row zero table."""
    tensors = {theirs: state[mine] for mine, theirs in _bert_names(config)}
    types = state["token_type.weight"] if config.type_vocab_size else torch.zeros(1, config.d_model)
    tensors[_bert_type_name(config)] = types
    return tensors


def _bert_type_name(config: EncoderOnlyConfig) -> str:
    prefix = "" if bert_architecture(config) == "BertModel" else "bert."
    return f"{prefix}embeddings.token_type_embeddings.weight"


def bert_config(config: EncoderOnlyConfig, labels: list[str] | None) -> dict:
    """The HF config.json of an encoder-only model that computes what BERT computes (else a UserError).

    ``labels``: a classifier's class names, in class order (else LABEL_0, LABEL_1, ...).
    """
    target = "BERT"
    require(
        config,
        target,
        {
            "norm_first": False,
            "norm": "layernorm",
            "positions": "learned",
            "scale_embeddings": False,
            "embedding_norm": True,
            "bias": True,
            "attention": "softmax",
        },
    )
    same_heads(config, target)
    activation = hf_activation(config.activation, target)
    if config.mlm_head and config.activation != "gelu":
        raise UserError("cannot export as BERT: its masked-LM head uses the model's activation, qkv's exact GELU")
    architecture = bert_architecture(config)
    if config.n_classes:
        require(config, "BertForSequenceClassification", {"pooler": True, "pooling": "first"})
    if config.mlm_head and config.pooler:
        raise UserError(
            "cannot export as BERT: a model with a masked-LM head exports as BertForMaskedLM, which has no "
            "pooler, and this model has one (pooler=True)"
        )
    fields = {
        "architectures": [architecture],
        "model_type": "bert",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "intermediate_size": config.d_ff,
        "hidden_act": activation,
        "hidden_dropout_prob": config.dropout,
        "attention_probs_dropout_prob": config.attention_dropout,
        "max_position_embeddings": config.max_len,
        "type_vocab_size": max(1, config.type_vocab_size),
        "layer_norm_eps": config.norm_eps,
        "pad_token_id": config.pad_id,
        "tie_word_embeddings": config.tie_output,
    }
    if config.n_classes:
        if labels is None:
            labels = [f"LABEL_{i}" for i in range(config.n_classes)]
        elif len(labels) != config.n_classes:
            raise UserError(f"cannot export as BERT: {len(labels)} label names for {config.n_classes} classes")
        fields["id2label"] = {str(i): name for i, name in enumerate(labels)}
        fields["label2id"] = {name: i for i, name in enumerate(labels)}
    return fields


BERT_ROLES = {
    "pad": ("pad_token", "[PAD]"),
    "bos": ("cls_token", "[CLS]"),
    "eos": ("sep_token", "[SEP]"),
    "unk": ("unk_token", "[UNK]"),
}


def _read_vocab_txt(path: Path) -> dict[str, int]:
    """vocab.txt as HF's BertTokenizer reads it: one token a line, its id the line number."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines(True)
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    return {line.rstrip("\n"): i for i, line in enumerate(lines)}


def bert_tokenizer(directory: Path) -> tuple[Tokenizer, Path] | None:
    """BERT's tokenizer and the file it was read from (None without one)."""
    settings = TokenizerSettings(directory)
    if (directory / FILE).is_file():
        return load_tokenizer(directory / FILE, settings, BERT_ROLES), directory / FILE
    path = directory / "vocab.txt"
    if not path.is_file():
        return None
    vocab = _read_vocab_txt(path)
    specials = settings.roles(BERT_ROLES, vocab.__contains__)
    unk, cls, sep = specials["unk"], specials["bos"], specials["eos"]
    mask, _ = settings.token("mask_token", "[MASK]")
    if unk is None or unk not in vocab:
        raise UserError(f"{path} lacks the unknown token {settings.token('unk_token', '[UNK]')[0]!r}")
    backend = HFTokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=bool(settings.flag("tokenize_chinese_chars", True)),
        strip_accents=settings.flag("strip_accents", None),
        lowercase=bool(settings.flag("do_lower_case", True)),
    )
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    if cls in vocab and sep in vocab:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{cls}:0 $A:0 {sep}:0",
            pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
            special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
        )
    backend.add_special_tokens([t for t in (*specials.values(), mask) if t is not None and t in vocab])
    return qkv_tokenizer(path, backend, specials), path
