"""RoBERTa and XLM-RoBERTa (``RobertaModel``, ``...ForMaskedLM``, ``...ForSequenceClassification``) -> encoder_only.

What is here: :func:`roberta_fields` (HF ``config.json`` -> qkv config fields),
:func:`roberta_to_qkv` / :func:`qkv_to_roberta` (weight names, both ways: import builds the
names it expects from the second) and :func:`roberta_tokenizer`. What is not: import itself
(``convert.py``); export, which writes any encoder-only model as BERT (``bert.py``).

A RoBERTa is a BERT (the same layers, names and config fields, under ``roberta.``) with three
differences. Positions: a real token at index i reads row ``pad_token_id + 1 + i`` of the
position table (HF numbers positions from after the padding id), so qkv keeps the rows from
there on and its window is ``max_position_embeddings - pad_token_id - 1`` (514 -> 512). Heads:
the classifier is ``classifier.dense`` + tanh (qkv's pooler, on the first token) then
``classifier.out_proj``; the masked-LM head is ``lm_head.dense`` / ``lm_head.layer_norm`` /
``lm_head.bias`` with the tied embeddings. Tokenizer: byte-level BPE (RoBERTa) or Unigram
(XLM-R) with <s> text </s>: ``tokenizer.json`` as it is, else RoBERTa's ``vocab.json`` and
``merges.txt`` as GPT-2's; the special tokens default to <pad>, <s>, </s>, <unk> (and <mask>).
Exported back (``qkv export-hf``), such a model is a ``BertModel`` that computes the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from qkv.hf.bert import bert_fields, body_names
from qkv.hf.common import HFConfig, State, TokenizerSettings, linear, load_tokenizer
from qkv.hf.gpt2 import byte_level_bpe
from qkv.models.encoder_only import EncoderOnlyConfig
from qkv.tokenization import FILE, Tokenizer

ROBERTA = (
    "RobertaModel",
    "RobertaForMaskedLM",
    "RobertaForSequenceClassification",
    "XLMRobertaModel",
    "XLMRobertaForMaskedLM",
    "XLMRobertaForSequenceClassification",
)
ROBERTA_ROLES = {
    "pad": ("pad_token", "<pad>"),
    "bos": ("cls_token", "<s>"),
    "eos": ("sep_token", "</s>"),
    "unk": ("unk_token", "<unk>"),
}


def roberta_fields(config: HFConfig, architecture: str, tensor_names: set[str]) -> dict:
    """The qkv ``encoder_only`` fields of a RoBERTa config.json."""
    fields = bert_fields(config, architecture, tensor_names, pad_id=1, type_vocab_size=1)
    offset = fields["pad_id"] + 1  # the first position row a real token reads
    positions = config.integer("max_position_embeddings", 514)
    if positions <= offset:
        raise config.refuse("max_position_embeddings", f"RoBERTa's positions start at pad_token_id + 1 = {offset}")
    return {**fields, "max_len": positions - offset}


def _prefix(config: EncoderOnlyConfig) -> str:
    return "roberta." if config.mlm_head or config.n_classes else ""


def _roberta_names(config: EncoderOnlyConfig) -> list[tuple[str, str]]:
    """(qkv name, HF name) of every tensor but the type table (handled apart)."""
    prefix = _prefix(config)
    names = body_names(config, prefix)
    if config.n_classes:
        linear(names, "pooler", "classifier.dense")
        linear(names, "classifier", "classifier.out_proj")
    elif config.pooler:
        linear(names, "pooler", f"{prefix}pooler.dense")
    if config.mlm_head:
        linear(names, "mlm_dense", "lm_head.dense")
        linear(names, "mlm_norm", "lm_head.layer_norm")
        names.append(("mlm_output.bias", "lm_head.bias"))
        if not config.tie_output:
            names.append(("mlm_output.weight", "lm_head.decoder.weight"))
    return names


def roberta_to_qkv(tensors: Mapping[str, Tensor], config: EncoderOnlyConfig) -> State:
    """qkv ``encoder_only`` weights from RoBERTa tensors: the position rows from pad_id + 1 on."""
    state = {mine: tensors[theirs] for mine, theirs in _roberta_names(config)}
    offset = config.pad_id + 1
    state["embed.position.weight"] = state["embed.position.weight"][offset : offset + config.max_len]
    if config.type_vocab_size:
        state["token_type.weight"] = tensors[f"{_prefix(config)}embeddings.token_type_embeddings.weight"]
    return state


def qkv_to_roberta(state: Mapping[str, Tensor], config: EncoderOnlyConfig) -> State:
    """RoBERTa tensors from qkv ``encoder_only`` weights (the rows before pad_id + 1 zero): what
    import expects to find, named and shaped."""
    tensors = {theirs: state[mine] for mine, theirs in _roberta_names(config)}
    position = f"{_prefix(config)}embeddings.position_embeddings.weight"
    table = tensors[position]
    tensors[position] = torch.cat([table.new_zeros(config.pad_id + 1, table.shape[1]), table])
    if config.type_vocab_size:
        tensors[f"{_prefix(config)}embeddings.token_type_embeddings.weight"] = state["token_type.weight"]
    return tensors


def roberta_tokenizer(directory: Path) -> tuple[Tokenizer, Path] | None:
    """RoBERTa's (or XLM-R's) tokenizer and the file it was read from (None without one)."""
    settings = TokenizerSettings(directory)
    if (directory / FILE).is_file():
        return load_tokenizer(directory / FILE, settings, ROBERTA_ROLES), directory / FILE
    return byte_level_bpe(directory, settings, ROBERTA_ROLES)
