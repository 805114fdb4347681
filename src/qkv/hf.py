"""Hugging Face checkpoints: import BERT, GPT-2 and Marian into qkv model directories, and back.

What is here: :func:`import_hf` (a local Hugging Face checkpoint directory -> a qkv model
directory, tokenizer included) and :func:`export_hf` (a qkv model directory -> a directory
that ``transformers`` loads with ``from_pretrained``), and for each architecture a small set of
pure functions: the qkv config fields of an HF ``config.json``, the HF ``config.json`` of a qkv
config, and one pair of weight-name mappings (``bert_to_qkv`` / ``qkv_to_bert``, ``gpt2_to_qkv``
/ ``qkv_to_gpt2``, ``marian_to_qkv`` / ``qkv_to_marian``).

Supported:
  * BERT: ``BertModel``, ``BertForMaskedLM``, ``BertForSequenceClassification`` <-> an
    ``encoder_only`` model (post-norm, learned positions, token types, embedding LayerNorm,
    pooler, MLM head with its bias). Which of the three a qkv model exports as follows from
    its heads: classifier -> sequence classification, MLM head -> masked LM, neither -> BertModel.
    With ``tie_word_embeddings=false`` transformers 5.x computes the MLM logits with
    ``cls.predictions.decoder.bias`` (tied, it is ``cls.predictions.bias``): import reads the
    one the model computes with, export writes both. A classifier's class names are qkv's
    ``labels`` (config.json, class order) and HF's ``id2label``/``label2id``, both ways.
    A model with an MLM head and a pooler is refused (``BertForMaskedLM`` has no pooler); one
    with neither exports as ``BertModel`` without pooler weights, which transformers then
    initializes at random: ``last_hidden_state`` is the model's, ``pooler_output`` is not.
  * GPT-2: ``GPT2LMHeadModel`` <-> ``decoder_only`` (pre-norm, learned positions, tanh GELU;
    HF's Conv1D weights are stored (in, out) and its fused ``c_attn`` is split into Wq, Wk, Wv;
    without ``bos_token_id``/``eos_token_id``, GPT2Config's 50256 applies only to a vocabulary
    that has that id).
  * Marian: ``MarianMTModel`` <-> ``encoder_decoder`` (post-norm, sinusoids in two halves,
    √D-scaled embeddings, shared or separate embeddings, ``final_logits_bias``; decoding starts
    from the padding token, so the qkv ``bos_id`` is Marian's ``decoder_start_token_id``).
    Shared embeddings without ``tie_word_embeddings``: transformers 5.x then does not tie
    ``model.shared`` to the stacks' ``embed_tokens``, which it computes with; import reads the
    encoder's (refusing a decoder table that differs: qkv shares one), export writes all three.
  * Weights from ``model.safetensors``, or ``pytorch_model.bin`` read with
    ``torch.load(weights_only=True)`` (nothing is unpickled beyond tensors); fp16/bf16 weights
    become fp32. Tensors the model does not use (BERT's next-sentence head
    ``cls.seq_relationship``, the pooler of a ``BertForMaskedLM`` checkpoint) are left out and
    named in :func:`import_hf`'s summary (``ignored``; the CLI prints them on stderr); buffers and
    second copies of tied weights are not named.
  * Tokenizers: ``tokenizer.json`` as it is, else BERT's ``vocab.txt`` (WordPiece) or GPT-2's
    ``vocab.json`` + ``merges.txt`` (byte-level BPE) rebuilt as HF's tokenizers do; the special
    tokens' roles go to ``special_tokens.json`` (``tokenization.py``): those that
    ``tokenizer_config.json`` or ``special_tokens_map.json`` name, else HF's defaults ([CLS],
    <|endoftext|>, ...) where the vocabulary has them (else the role has no token). Where
    config.json gives the padding, BEGIN or END id too, the two must agree. Export writes
    ``tokenizer.json`` and a ``tokenizer_config.json`` for ``PreTrainedTokenizerFast`` (with the
    mask token: qkv's ``<mask>`` or BERT's ``[MASK]``).
  * Marian's tokenizer: ``source.spm`` + ``vocab.json`` become a ``tokenizer.json`` that gives
    the ids ``MarianTokenizer`` gives a source text (``</s>`` appended) and, with a shared
    vocabulary, the text its ``decode(ids, skip_special_tokens=True)`` gives
    (:func:`_marian_tokenizer`). With separate vocabularies (``separate_vocabs`` in
    ``tokenizer_config.json``) ``target.spm`` + ``target_vocab.json`` become qkv's
    ``target_tokenizer.json`` the same way: it encodes targets as MarianTokenizer's target mode
    does and decodes as its ``decode`` does; the two sides must give the special tokens the
    same ids (qkv's model has one padding, BEGIN and END id). So ``qkv translate`` and ``qkv
    generate`` run an imported Marian. ``source.spm``, ``target.spm``, the ``vocab.json`` files
    and ``tokenizer_config.json`` are kept in the qkv directory (with their SHA-256) and are
    what export writes back.
  * Export reads a model directory or a training run (its final checkpoint) and writes a new or
    empty directory (not the working directory), whole or not at all, flushed to disk
    (``files.atomic_directory``, as ``checkpoint.save_model`` writes).

Not supported (a :class:`~qkv.errors.UserError` names the file and the field or tensor):
other architectures; sharded checkpoints (``*.index.json``); quantized checkpoints
(``quantization_config``, or a weight that is not floating-point); BERT with relative
positions or as a decoder; GPT-2 without attention scaling or with
``scale_attn_by_inverse_layer_idx``; Marian with different encoder and decoder widths or head
counts; a ``source.spm`` other than a unigram model of normal and control pieces (BPE, byte
fallback, user-defined pieces); a Marian tokenizer whose files are missing (say,
``separate_vocabs`` without ``target_vocab.json``) is not converted (its files are kept and
exported; the model runs from token ids in Python and ``qkv translate`` refuses it). A qkv
translation model trained with separate vocabularies
(``target_tokenizer.json``) is not exported: Marian's separate vocabularies are SentencePiece
files qkv does not write. Generation settings (``generation_config.json``: beams,
``bad_words_ids``, forced END) are not carried over; Marian's ``activation_dropout`` is dropped
(training only).

Where the converted Marian tokenizer still differs from ``MarianTokenizer``: a target-language
code (``>>fra<<``) is read wherever it stands (``MarianTokenizer``: at the start only, and an
unknown code as ``<unk>``); a ``source.spm`` piece that ``vocab.json`` lacks, which
``MarianTokenizer`` reads as ``<unk>``, is segmented around instead; a text that only its
normalization (NFKC) turns into a special token's text (fullwidth ``＜pad＞``, where ``<`` and
``>`` have pieces) reads as that token. Targets with a shared vocabulary (fine-tuning,
teacher-forced loss) are segmented with ``source.spm`` (``MarianTokenizer``: ``target.spm``),
as qkv has one tokenizer for both sides there; with separate vocabularies with
``target.spm``, as MarianTokenizer does. (Either way without the tokenizer's ``</s>``: the
batch appends END, the same id.)

``transformers`` is never imported: configs are read and written as JSON and tensors with
safetensors. The models do not import this module.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from torch import Tensor

from qkv.checkpoint import build_model, check_output, load_model, model_dir, save_model
from qkv.errors import UserError
from qkv.files import atomic_directory, read_json_object
from qkv.layers import sinusoidal_encoding
from qkv.models.decoder_only import DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoderConfig
from qkv.models.encoder_only import EncoderOnlyConfig
from qkv.tokenization import FILE, TARGET_FILE, Tokenizer, Vocabularies

if TYPE_CHECKING:  # protobuf-generated; imported where used, so that qkv.hf loads without protobuf
    from sentencepiece.sentencepiece_model_pb2 import ModelProto

BERT = ("BertModel", "BertForMaskedLM", "BertForSequenceClassification")
GPT2 = ("GPT2LMHeadModel",)
MARIAN = ("MarianMTModel",)
HF_CONFIG = "config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
MARIAN_TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json", "target_vocab.json", TOKENIZER_CONFIG)
# Suffixes of the vocab.json tokens the source SentencePiece model never produces, in the
# converted Unigram model: with a space in them they can never match text (the normalizer
# turns every space into "▁"), and the decoder removes the suffix (or, for a control piece
# such as <s>, the whole token, which SentencePiece decodes to nothing).
NOT_SOURCE, CONTROL = " (not in source.spm)", " (control)"
WEIGHTS = "model.safetensors"
WEIGHTS_BIN = "pytorch_model.bin"
# Buffers that HF checkpoints may hold and no model computes with (BERT's position and type ids,
# old GPT-2 checkpoints' causal mask): not reported as ignored tensors.
BUFFERS = re.compile(r"(?:^|\.)(?:position_ids|token_type_ids)$|(?:^|\.)attn\.(?:masked_)?bias$")

# HF activation names -> qkv's (HF's gelu_new and gelu_pytorch_tanh are both the tanh GELU).
ACTIVATIONS_FROM_HF = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
ACTIVATIONS_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}

State = dict[str, Tensor]


# ------------------------------------------------------------------ reading HF files


class HFConfig:
    """An HF ``config.json``, read field by field with HF's defaults; errors name the file and field."""

    def __init__(self, path: Path, fields: dict) -> None:
        self.path, self.fields = path, fields

    def refuse(self, name: str, why: str) -> UserError:
        return UserError(f"{self.path}: {name}={self.fields.get(name)!r} is not supported: {why}")

    def integer(self, name: str, default: int | None = None, *, minimum: int = 1) -> int:
        value = self.fields.get(name, default)
        if value is None:
            raise UserError(f"{self.path}: field {name!r} is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise UserError(f"{self.path}: field {name!r} must be an integer >= {minimum}, got {value!r}")
        return value

    def number(self, name: str, default: float) -> float:
        value = self.fields.get(name, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{self.path}: field {name!r} must be a number, got {value!r}")
        return float(value)

    def flag(self, name: str, default: bool) -> bool:
        value = self.fields.get(name, default)
        if not isinstance(value, bool):
            raise UserError(f"{self.path}: field {name!r} must be true or false, got {value!r}")
        return value

    def text(self, name: str, default: str) -> str:
        value = self.fields.get(name, default)
        if not isinstance(value, str):
            raise UserError(f"{self.path}: field {name!r} must be a string, got {value!r}")
        return value

    def activation(self, name: str, default: str) -> str:
        value = self.text(name, default)
        if value not in ACTIVATIONS_FROM_HF:
            raise self.refuse(name, f"known activations: {', '.join(ACTIVATIONS_FROM_HF)}")
        return ACTIVATIONS_FROM_HF[value]

    def token_id(self, name: str, default: int | None, vocab_size: int) -> int | None:
        """A special token id (None where the model has none); a one-element list counts as its element."""
        value = self.fields.get(name, default)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
            raise UserError(f"{self.path}: field {name!r} must be one token id in [0, {vocab_size}), got {value!r}")
        return value


def read_config(directory: Path) -> tuple[HFConfig, str]:
    """The config of an HF checkpoint directory and its architecture (the first of "architectures")."""
    path = directory / HF_CONFIG
    if not directory.is_dir():
        raise UserError(f"{directory} does not exist or is not a directory")
    if not path.is_file():
        raise UserError(f"{path} is missing: {directory} is not a Hugging Face checkpoint directory")
    fields = read_json_object(path)
    if fields.get("quantization_config") is not None:
        raise UserError(f"{path}: field 'quantization_config' is set: quantized checkpoints are not supported")
    architectures = fields.get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise UserError(f"{path}: field 'architectures' is missing or empty; it names the model class")
    architecture = architectures[0]
    if architecture not in BERT + GPT2 + MARIAN:
        raise UserError(
            f"{path}: architecture {architecture!r} is not supported; qkv imports {', '.join(BERT + GPT2 + MARIAN)}"
        )
    return HFConfig(path, fields), architecture


def read_tensors(directory: Path) -> tuple[Path, State]:
    """The tensors of ``model.safetensors`` (or of ``pytorch_model.bin``, tensors only) and their file."""
    safetensors, pickled = directory / WEIGHTS, directory / WEIGHTS_BIN
    if safetensors.is_file():
        try:
            return safetensors, load_file(safetensors)
        except (SafetensorError, OSError) as e:
            raise UserError(f"{safetensors} cannot be read as safetensors: {e}") from None
    if pickled.is_file():
        try:
            tensors = torch.load(pickled, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for a file it refuses or cannot read
            raise UserError(f"{pickled} cannot be read as a tensor dictionary (weights_only=True): {e}") from None
        if not isinstance(tensors, dict) or not all(isinstance(v, Tensor) for v in tensors.values()):
            raise UserError(f"{pickled} does not hold a dictionary of tensors")
        return pickled, tensors
    for index in (f"{WEIGHTS}.index.json", f"{WEIGHTS_BIN}.index.json"):
        if (directory / index).is_file():
            raise UserError(f"{directory / index}: sharded checkpoints are not supported; merge the shards first")
    raise UserError(f"{directory} has neither {WEIGHTS} nor {WEIGHTS_BIN}")


def _canonical_names(names: list[str], expected: Mapping[str, Tensor], prefix: str) -> dict[str, str]:
    """The name under which the mapping reads each stored tensor -> its stored name.

    Old BERT checkpoints call LayerNorm's weight and bias gamma and beta; HF stores a model's
    body with or without ``prefix`` ("bert.", "transformer.") depending on the class that saved
    it. A name the mapping does not read stays as stored.
    """
    canonical: dict[str, str] = {}
    for stored in names:
        name = stored
        if name.endswith("LayerNorm.gamma"):
            name = name[: -len("gamma")] + "weight"
        elif name.endswith("LayerNorm.beta"):
            name = name[: -len("beta")] + "bias"
        candidates = (name, prefix + name, name.removeprefix(prefix)) if prefix else (name,)
        canonical.setdefault(next((c for c in candidates if c in expected), name), stored)
    return canonical


def _first(names: tuple[str, ...], tensors: Mapping[str, Tensor]) -> str | None:
    return next((name for name in names if name in tensors), None)


def _read_from(
    tensors: Mapping[str, Tensor],
    config: EncoderOnlyConfig | DecoderOnlyConfig | EncoderDecoderConfig,
    file: Path,
) -> dict[str, str]:
    """Where the mapping reads a tensor under another name (expected name -> the name it is read from).

    transformers 5.x ties a copy to its original only with ``tie_word_embeddings``; without it
    the model computes with the copy, and the original may be a stale, unused tensor. Older
    checkpoints may hold either name alone.
    """
    read: dict[str, str] = {}
    if isinstance(config, EncoderOnlyConfig) and config.mlm_head:
        # BertForMaskedLM adds cls.predictions.decoder.bias; tied, it is cls.predictions.bias.
        bias, decoder_bias = "cls.predictions.bias", "cls.predictions.decoder.bias"
        found = _first((bias, decoder_bias) if config.tie_output else (decoder_bias, bias), tensors)
        if found is not None:
            read[bias] = found
    if isinstance(config, EncoderDecoderConfig) and config.share_embeddings:
        # Tied, both stacks read model.shared; untied, each reads its own embed_tokens table,
        # which qkv's one shared table can only hold if the two are equal.
        shared, encoder, decoder = (
            "model.shared.weight",
            "model.encoder.embed_tokens.weight",
            "model.decoder.embed_tokens.weight",
        )
        order = (shared, encoder, decoder) if config.tie_output else (encoder, shared, decoder)
        found = _first(order, tensors)
        if found is not None:
            read[shared] = found
            other = tensors.get(decoder)
            if not config.tie_output and other is not None and not torch.equal(other, tensors[found]):
                raise UserError(
                    f"{file}: tensors {found!r} and {decoder!r} differ, but qkv's encoder and decoder share one "
                    f"embedding table ({HF_CONFIG}: share_encoder_decoder_embeddings=true, tie_word_embeddings=false)"
                )
    return read


def _check_tensors(
    file: Path,
    architecture: str,
    tensors: Mapping[str, Tensor],
    expected: Mapping[str, Tensor],
    stored: Mapping[str, str],
) -> None:
    """Every tensor the config implies is there, floating-point, with its shape (``stored``: the
    name each has in the file)."""
    for name, want in expected.items():
        if name not in tensors:
            raise UserError(f"{file}: tensor {name!r} is missing; a {architecture} with this {HF_CONFIG} needs it")
        have = tensors[name]
        if not have.is_floating_point():
            raise UserError(
                f"{file}: tensor {stored.get(name, name)!r} is {have.dtype}; only floating-point weights are "
                "supported (quantized checkpoints are not)"
            )
        if tuple(have.shape) != tuple(want.shape):
            raise UserError(
                f"{file}: tensor {stored.get(name, name)!r} has shape {tuple(have.shape)}; "
                f"{HF_CONFIG} implies {tuple(want.shape)}"
            )


def _ignored(tensors: Mapping[str, Tensor], used: set[str], stored: Mapping[str, str]) -> list[str]:
    """The stored names of the tensors nothing reads: not a buffer, and not a copy of a tensor
    that is read (a tied weight saved under both of its names)."""
    read = [tensors[name] for name in used if name in tensors]
    ignored = []
    for name, tensor in tensors.items():
        if name in used or BUFFERS.search(name):
            continue
        if any(t.shape == tensor.shape and t.dtype == tensor.dtype and torch.equal(t, tensor) for t in read):
            continue
        ignored.append(stored.get(name, name))
    return sorted(ignored)


def _load_state(model: torch.nn.Module, state: State) -> None:
    """Copy ``state`` into the model; every parameter (tied ones once) must be covered, each by
    a tensor of its exact shape (``copy_`` would broadcast)."""
    params = model.state_dict()
    covered = set()
    with torch.no_grad():
        for name, tensor in state.items():
            # A bug here, not the user's: _check_tensors has checked every tensor the mapping reads.
            if name not in params or params[name].shape != tensor.shape:
                want = tuple(params[name].shape) if name in params else "no such parameter"
                raise RuntimeError(f"the weight mapping gives {name} shape {tuple(tensor.shape)}; the model: {want}")
            params[name].copy_(tensor)
            covered.add(params[name].data_ptr())
    left = [name for name, p in params.items() if p.data_ptr() not in covered]
    if left:
        raise RuntimeError(f"the weight mapping left {', '.join(left[:5])} unset")  # a bug here, not the user's


def _linear(names: list[tuple[str, str]], qkv: str, hf: str, *, bias: bool = True) -> None:
    names.append((f"{qkv}.weight", f"{hf}.weight"))
    if bias:
        names.append((f"{qkv}.bias", f"{hf}.bias"))


def _require(config: object, target: str, wanted: Mapping[str, object]) -> None:
    """Refuse to export a model whose config differs from what the HF architecture computes."""
    for name, value in wanted.items():
        have = getattr(config, name)
        if have != value:
            raise UserError(f"cannot export as {target}: it needs {name}={value!r}, this model has {name}={have!r}")


def _same_heads(config: EncoderOnlyConfig | DecoderOnlyConfig | EncoderDecoderConfig, target: str) -> None:
    if config.n_kv_heads not in (None, config.n_heads):
        raise UserError(f"cannot export as {target}: grouped-query attention (n_kv_heads={config.n_kv_heads})")


def _hf_activation(activation: str, target: str) -> str:
    if activation not in ACTIVATIONS_TO_HF:
        raise UserError(f"cannot export as {target}: activation={activation!r} has no {target} equivalent")
    return ACTIVATIONS_TO_HF[activation]


# ---------------------------------------------------------------------------- BERT


def bert_fields(config: HFConfig, architecture: str, tensor_names: set[str]) -> dict:
    """The qkv ``encoder_only`` fields of a BERT config.json."""
    if config.text("position_embedding_type", "absolute") != "absolute":
        raise config.refuse("position_embedding_type", "only absolute (learned) positions are")
    for name in ("is_decoder", "add_cross_attention"):
        if config.flag(name, False):
            raise config.refuse(name, "BERT as a decoder is not")
    activation = config.activation("hidden_act", "gelu")
    if architecture == "BertForMaskedLM" and activation != "gelu":
        raise config.refuse("hidden_act", "qkv's masked-LM head uses exact GELU")
    d_model = config.integer("hidden_size")
    vocab_size = config.integer("vocab_size")
    n_classes = 0
    if architecture == "BertForSequenceClassification":
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
        "type_vocab_size": config.integer("type_vocab_size", 2, minimum=0),
        "tie_output": config.flag("tie_word_embeddings", True),
        "scale_embeddings": False,
        "pad_id": config.token_id("pad_token_id", 0, vocab_size) or 0,
        "embedding_norm": True,
        "pooler": architecture == "BertForSequenceClassification" or (architecture == "BertModel" and has_pooler),
        "mlm_head": architecture == "BertForMaskedLM",
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


def _bert_names(config: EncoderOnlyConfig) -> list[tuple[str, str]]:
    """(qkv name, HF name) of every BERT tensor; the MLM bias and type table are handled apart."""
    prefix = "" if bert_architecture(config) == "BertModel" else "bert."
    e = f"{prefix}embeddings"
    names = [
        ("embed.token.weight", f"{e}.word_embeddings.weight"),
        ("embed.position.weight", f"{e}.position_embeddings.weight"),
    ]
    _linear(names, "embed_norm", f"{e}.LayerNorm")
    for i in range(config.n_layers):
        q, h = f"encoder.blocks.{i}", f"{prefix}encoder.layer.{i}"
        for mine, theirs in (
            ("w_q", "self.query"),
            ("w_k", "self.key"),
            ("w_v", "self.value"),
            ("w_o", "output.dense"),
        ):
            _linear(names, f"{q}.self_attn.{mine}", f"{h}.attention.{theirs}")
        _linear(names, f"{q}.norm_1", f"{h}.attention.output.LayerNorm")
        _linear(names, f"{q}.ffn.w_1", f"{h}.intermediate.dense")
        _linear(names, f"{q}.ffn.w_2", f"{h}.output.dense")
        _linear(names, f"{q}.norm_2", f"{h}.output.LayerNorm")
    if config.pooler:
        _linear(names, "pooler", f"{prefix}pooler.dense")
    if config.mlm_head:
        _linear(names, "mlm_dense", "cls.predictions.transform.dense")
        _linear(names, "mlm_norm", "cls.predictions.transform.LayerNorm")
        names.append(("mlm_output.bias", "cls.predictions.bias"))
        if not config.tie_output:
            names.append(("mlm_output.weight", "cls.predictions.decoder.weight"))
    if config.n_classes:
        _linear(names, "classifier", "classifier")
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
    _require(
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
    _same_heads(config, target)
    activation = _hf_activation(config.activation, target)
    if config.mlm_head and config.activation != "gelu":
        raise UserError("cannot export as BERT: its masked-LM head uses the model's activation, qkv's exact GELU")
    architecture = bert_architecture(config)
    if config.n_classes:
        _require(config, "BertForSequenceClassification", {"pooler": True, "pooling": "first"})
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


# --------------------------------------------------------------------------- GPT-2


def gpt2_fields(config: HFConfig) -> dict:
    """The qkv ``decoder_only`` fields of a GPT-2 config.json."""
    if not config.flag("scale_attn_weights", True):
        raise config.refuse("scale_attn_weights", "qkv always scales scores by 1/√K")
    if config.flag("scale_attn_by_inverse_layer_idx", False):
        raise config.refuse("scale_attn_by_inverse_layer_idx", "qkv scales every layer alike")
    if config.flag("add_cross_attention", False):
        raise config.refuse("add_cross_attention", "GPT-2 with cross-attention is not")
    d_model = config.integer("n_embd")
    vocab_size = config.integer("vocab_size")
    d_ff = config.fields.get("n_inner")
    # GPT2Config's default BEGIN and END (<|endoftext|>) exist only in a vocabulary that has id 50256.
    default_end = 50256 if vocab_size > 50256 else None
    return {
        "d_model": d_model,
        "n_heads": config.integer("n_head"),
        "d_ff": 4 * d_model if d_ff is None else config.integer("n_inner"),
        "activation": config.activation("activation_function", "gelu_new"),
        "norm": "layernorm",
        "norm_eps": config.number("layer_norm_epsilon", 1e-5),
        "norm_first": True,
        "positions": "learned",
        "max_len": config.integer("n_positions", 1024),
        "dropout": config.number("resid_pdrop", 0.1),
        "attention_dropout": config.number("attn_pdrop", 0.1),
        "bias": True,
        "vocab_size": vocab_size,
        "n_layers": config.integer("n_layer"),
        "tie_output": config.flag("tie_word_embeddings", True),
        "scale_embeddings": False,
        "pad_id": config.token_id("pad_token_id", None, vocab_size),
        "bos_id": config.token_id("bos_token_id", default_end, vocab_size),
        "eos_id": config.token_id("eos_token_id", default_end, vocab_size),
    }


def _gpt2_names(config: DecoderOnlyConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(qkv name, HF name) pairs: plain tensors, and Conv1D tensors stored transposed (in, out).
    The fused ``c_attn`` is handled apart."""
    plain = [("embed.token.weight", "transformer.wte.weight"), ("embed.position.weight", "transformer.wpe.weight")]
    transposed: list[tuple[str, str]] = []
    for i in range(config.n_layers):
        q, h = f"decoder.blocks.{i}", f"transformer.h.{i}"
        _linear(plain, f"{q}.norm_1", f"{h}.ln_1")
        _linear(plain, f"{q}.norm_3", f"{h}.ln_2")
        transposed.append((f"{q}.self_attn.w_o.weight", f"{h}.attn.c_proj.weight"))
        transposed.append((f"{q}.ffn.w_1.weight", f"{h}.mlp.c_fc.weight"))
        transposed.append((f"{q}.ffn.w_2.weight", f"{h}.mlp.c_proj.weight"))
        for mine, theirs in (("self_attn.w_o", "attn.c_proj"), ("ffn.w_1", "mlp.c_fc"), ("ffn.w_2", "mlp.c_proj")):
            plain.append((f"{q}.{mine}.bias", f"{h}.{theirs}.bias"))
    _linear(plain, "decoder.norm", "transformer.ln_f")
    if not config.tie_output:
        plain.append(("output.weight", "lm_head.weight"))
    return plain, transposed


def gpt2_to_qkv(tensors: Mapping[str, Tensor], config: DecoderOnlyConfig) -> State:
    """qkv ``decoder_only`` weights from GPT-2 tensors (named as :func:`qkv_to_gpt2` writes them)."""
    plain, transposed = _gpt2_names(config)
    state = {mine: tensors[theirs] for mine, theirs in plain}
    state.update({mine: tensors[theirs].t() for mine, theirs in transposed})  # (in, out) -> (out, in)
    for i in range(config.n_layers):
        q, h = f"decoder.blocks.{i}.self_attn", f"transformer.h.{i}.attn.c_attn"
        weights = tensors[f"{h}.weight"].t().chunk(3, dim=0)  # (D, 3D) -> 3 x (D, D), rows = outputs
        biases = tensors[f"{h}.bias"].chunk(3)  # (3D,) -> 3 x (D,)
        for name, w, b in zip(("w_q", "w_k", "w_v"), weights, biases, strict=True):
            state[f"{q}.{name}.weight"], state[f"{q}.{name}.bias"] = w, b
    return state


def qkv_to_gpt2(state: Mapping[str, Tensor], config: DecoderOnlyConfig) -> State:
    """GPT-2 tensors from qkv ``decoder_only`` weights.

    A model without linear biases (``bias=False``, as the Shakespeare and chat recipes train)
    gets zero biases, which GPT-2's Conv1D layers always have: x·W + 0 is the same function.
    """
    if not config.bias:
        # Inside the blocks the 2-D weights are exactly the linear layers' (norms' are 1-D).
        state = dict(state)
        for name, weight in list(state.items()):
            if name.startswith("decoder.blocks.") and name.endswith(".weight") and weight.ndim == 2:  # (out, in)
                state[name.removesuffix("weight") + "bias"] = weight.new_zeros(weight.shape[0])  # (out,)
    plain, transposed = _gpt2_names(config)
    tensors = {theirs: state[mine] for mine, theirs in plain}
    tensors.update({theirs: state[mine].t() for mine, theirs in transposed})  # (out, in) -> (in, out)
    for i in range(config.n_layers):
        q, h = f"decoder.blocks.{i}.self_attn", f"transformer.h.{i}.attn.c_attn"
        weight = torch.cat([state[f"{q}.{n}.weight"] for n in ("w_q", "w_k", "w_v")], dim=0)  # (3D, D)
        tensors[f"{h}.weight"] = weight.t()  # (D, 3D)
        tensors[f"{h}.bias"] = torch.cat([state[f"{q}.{n}.bias"] for n in ("w_q", "w_k", "w_v")])  # (3D,)
    return tensors


def gpt2_config(config: DecoderOnlyConfig) -> dict:
    """The HF config.json of a decoder-only model that computes what GPT-2 computes (else a UserError)."""
    target = "GPT-2"
    _require(
        config,
        target,
        {
            "norm_first": True,
            "norm": "layernorm",
            "positions": "learned",
            "scale_embeddings": False,
            "attention": "softmax",
        },
    )
    _same_heads(config, target)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_embd": config.d_model,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "n_inner": config.d_ff,
        "n_positions": config.max_len,
        "activation_function": _hf_activation(config.activation, target),
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.attention_dropout,
        "layer_norm_epsilon": config.norm_eps,
        "scale_attn_weights": True,
        "bos_token_id": config.bos_id,
        "eos_token_id": config.eos_id,
        "pad_token_id": config.pad_id,
        "tie_word_embeddings": config.tie_output,
    }


# -------------------------------------------------------------------------- Marian


def marian_fields(config: HFConfig) -> dict:
    """The qkv ``encoder_decoder`` fields of a Marian config.json."""
    n_heads, d_ff = config.integer("encoder_attention_heads", 16), config.integer("encoder_ffn_dim", 4096)
    if config.integer("decoder_attention_heads", 16) != n_heads:
        raise config.refuse("decoder_attention_heads", f"qkv's stacks share one head count, here {n_heads}")
    if config.integer("decoder_ffn_dim", 4096) != d_ff:
        raise config.refuse("decoder_ffn_dim", f"qkv's stacks share one feed-forward width, here {d_ff}")
    share = config.flag("share_encoder_decoder_embeddings", True)
    src_vocab = config.integer("vocab_size")
    tgt_vocab = src_vocab
    if not share and config.fields.get("decoder_vocab_size") is not None:
        tgt_vocab = config.integer("decoder_vocab_size")
    pad_id = config.token_id("pad_token_id", 58100, tgt_vocab)
    bos_id = config.token_id("decoder_start_token_id", 58100, tgt_vocab)
    eos_id = config.token_id("eos_token_id", 0, tgt_vocab)
    for name, value in (("pad_token_id", pad_id), ("decoder_start_token_id", bos_id), ("eos_token_id", eos_id)):
        if value is None:
            raise UserError(f"{config.path}: field {name!r} must be a token id, got null")
    return {
        "d_model": config.integer("d_model", 1024),
        "n_heads": n_heads,
        "d_ff": d_ff,
        "activation": config.activation("activation_function", "gelu"),
        "norm": "layernorm",
        "norm_eps": 1e-5,  # Marian's LayerNorms keep torch's default epsilon
        "norm_first": False,
        "positions": "sinusoidal_halves",
        "max_len": config.integer("max_position_embeddings", 1024),
        "dropout": config.number("dropout", 0.1),
        "attention_dropout": config.number("attention_dropout", 0.0),
        "bias": True,
        "src_vocab_size": src_vocab,
        "tgt_vocab_size": tgt_vocab,
        "n_encoder_layers": config.integer("encoder_layers", 12),
        "n_decoder_layers": config.integer("decoder_layers", 12),
        "share_embeddings": share,
        "tie_output": config.flag("tie_word_embeddings", True),
        "scale_embeddings": config.flag("scale_embedding", False),
        "pad_id": pad_id,
        "bos_id": bos_id,
        "eos_id": eos_id,
        "output_bias": True,
    }


def _marian_names(config: EncoderDecoderConfig) -> list[tuple[str, str]]:
    """(qkv name, HF name) of every Marian tensor but ``final_logits_bias`` (shaped (1, V) there)."""
    if config.share_embeddings:
        names = [("src_embed.token.weight", "model.shared.weight")]
    else:
        names = [
            ("src_embed.token.weight", "model.encoder.embed_tokens.weight"),
            ("tgt_embed.token.weight", "model.decoder.embed_tokens.weight"),
        ]
    if not config.tie_output:
        names.append(("output.weight", "lm_head.weight"))
    attention = (("w_q", "q_proj"), ("w_k", "k_proj"), ("w_v", "v_proj"), ("w_o", "out_proj"))
    for stack, n_layers in (("encoder", config.n_encoder_layers), ("decoder", config.n_decoder_layers)):
        for i in range(n_layers):
            q, h = f"{stack}.blocks.{i}", f"model.{stack}.layers.{i}"
            for mine, theirs in attention:
                _linear(names, f"{q}.self_attn.{mine}", f"{h}.self_attn.{theirs}")
                if stack == "decoder":
                    _linear(names, f"{q}.cross_attn.{mine}", f"{h}.encoder_attn.{theirs}")
            _linear(names, f"{q}.norm_1", f"{h}.self_attn_layer_norm")
            if stack == "decoder":
                _linear(names, f"{q}.norm_2", f"{h}.encoder_attn_layer_norm")
            _linear(names, f"{q}.ffn.w_1", f"{h}.fc1")
            _linear(names, f"{q}.ffn.w_2", f"{h}.fc2")
            _linear(names, f"{q}.norm_{3 if stack == 'decoder' else 2}", f"{h}.final_layer_norm")
    return names


def marian_to_qkv(tensors: Mapping[str, Tensor], config: EncoderDecoderConfig) -> State:
    """qkv ``encoder_decoder`` weights from Marian tensors (named as :func:`qkv_to_marian` writes them)."""
    state = {mine: tensors[theirs] for mine, theirs in _marian_names(config)}
    state["output.bias"] = tensors["final_logits_bias"].reshape(-1)  # (1, V) -> (V,)
    return state


def qkv_to_marian(state: Mapping[str, Tensor], config: EncoderDecoderConfig) -> State:
    """Marian tensors from qkv ``encoder_decoder`` weights (a zero ``final_logits_bias`` without an output bias)."""
    tensors = {theirs: state[mine] for mine, theirs in _marian_names(config)}
    bias = state["output.bias"] if config.output_bias else torch.zeros(config.tgt_vocab_size)
    tensors["final_logits_bias"] = bias.reshape(1, -1)  # (V,) -> (1, V)
    return tensors


def marian_config(config: EncoderDecoderConfig) -> dict:
    """The HF config.json of an encoder-decoder model that computes what Marian computes (else a UserError)."""
    target = "Marian"
    _require(
        config,
        target,
        {
            "norm_first": False,
            "norm": "layernorm",
            "positions": "sinusoidal_halves",
            "bias": True,
            "attention": "softmax",
        },
    )
    _same_heads(config, target)
    if abs(config.norm_eps - 1e-5) > 1e-12:
        raise UserError(f"cannot export as Marian: its LayerNorms use eps=1e-05, this model has {config.norm_eps}")
    activation = _hf_activation(config.activation, target)
    return {
        "architectures": ["MarianMTModel"],
        "model_type": "marian",
        "vocab_size": config.src_vocab_size,
        "decoder_vocab_size": config.tgt_vocab_size,
        "d_model": config.d_model,
        "encoder_layers": config.n_encoder_layers,
        "decoder_layers": config.n_decoder_layers,
        "encoder_attention_heads": config.n_heads,
        "decoder_attention_heads": config.n_heads,
        "encoder_ffn_dim": config.d_ff,
        "decoder_ffn_dim": config.d_ff,
        "activation_function": "swish" if activation == "silu" else activation,
        "dropout": config.dropout,
        "attention_dropout": config.attention_dropout,
        "activation_dropout": 0.0,
        "max_position_embeddings": config.max_len,
        "scale_embedding": config.scale_embeddings,
        "share_encoder_decoder_embeddings": config.share_embeddings,
        "tie_word_embeddings": config.tie_output,
        "pad_token_id": config.pad_id,
        "decoder_start_token_id": config.bos_id,
        "eos_token_id": config.eos_id,
        "forced_eos_token_id": config.eos_id,
        "is_encoder_decoder": True,
    }


def _marian_positions(tensors: Mapping[str, Tensor], config: EncoderDecoderConfig, file: Path) -> set[str]:
    """Marian checkpoints may hold the sinusoids, which qkv computes itself: they must be Marian's.
    Returns the names of those the checkpoint holds."""
    found = set()
    for stack in ("encoder", "decoder"):
        name = f"model.{stack}.embed_positions.weight"
        if name in tensors:
            stored = tensors[name].float()  # (P, D)
            computed = sinusoidal_encoding(torch.arange(stored.shape[0]), config.d_model, halves=True)  # (P, D)
            if stored.shape != computed.shape or (stored - computed).abs().max() > 1e-3:
                raise UserError(f"{file}: tensor {name!r} is not Marian's sinusoids, which qkv computes itself")
            found.add(name)
    return found


def _untied_copies(config: EncoderOnlyConfig | DecoderOnlyConfig | EncoderDecoderConfig, tensors: State) -> State:
    """The tensors that transformers 5.x reads under a second name when ``tie_word_embeddings``
    is false (and so does not tie that name to the first): BertForMaskedLM's
    ``cls.predictions.decoder.bias``, and a Marian with shared embeddings' ``embed_tokens`` tables."""
    tensors = dict(tensors)
    if isinstance(config, EncoderOnlyConfig) and config.mlm_head and not config.tie_output:
        tensors["cls.predictions.decoder.bias"] = tensors["cls.predictions.bias"].clone()
    if isinstance(config, EncoderDecoderConfig) and config.share_embeddings and not config.tie_output:
        for stack in ("encoder", "decoder"):
            tensors[f"model.{stack}.embed_tokens.weight"] = tensors["model.shared.weight"].clone()
    return tensors


# ---------------------------------------------------------------------- tokenizers


class TokenizerSettings:
    """tokenizer_config.json, with special_tokens_map.json's entries where it has none; errors
    name the file a field came from."""

    def __init__(self, directory: Path) -> None:
        self.fields: dict = {}
        self.paths: dict[str, Path] = {}
        for name in ("special_tokens_map.json", TOKENIZER_CONFIG):
            path = directory / name
            if path.is_file():
                loaded = read_json_object(path)
                self.fields.update(loaded)
                self.paths.update(dict.fromkeys(loaded, path))

    def get(self, name: str, default: object = None) -> object:
        return self.fields.get(name, default)

    def flag(self, name: str, default: bool | None) -> bool | None:
        """A true/false field; null only where the default is None (``strip_accents``: null
        follows ``do_lower_case``)."""
        value = self.fields.get(name, default)
        if not isinstance(value, bool) and (value is not None or default is not None):
            allowed = "true or false" if default is not None else "true, false or null"
            raise UserError(f"{self.paths[name]}: field {name!r} must be {allowed}, got {value!r}")
        return value

    def token(self, name: str, default: str | None) -> tuple[str | None, bool]:
        """A special token's text (a string, or {"content": ...} as older files write it; null:
        none) and whether the files name it (False: the default)."""
        value = self.fields.get(name, default)
        if isinstance(value, dict):
            value = value.get("content")
        if name in self.fields and (value is None or isinstance(value, str)):
            return value, True
        return default, False

    def roles(
        self, defaults: Mapping[str, tuple[str, str | None]], has: Callable[[str], bool]
    ) -> dict[str, str | None]:
        """role -> token, from ``defaults`` (role -> (field, default token)): the token the files
        name (Tokenizer refuses one the vocabulary lacks), else the default where the vocabulary
        has it (``has``), else none."""
        roles: dict[str, str | None] = {}
        for role, (field, default) in defaults.items():
            token, named = self.token(field, default)
            roles[role] = token if named or (token is not None and has(token)) else None
        return roles


BERT_ROLES = {
    "pad": ("pad_token", "[PAD]"),
    "bos": ("cls_token", "[CLS]"),
    "eos": ("sep_token", "[SEP]"),
    "unk": ("unk_token", "[UNK]"),
}
GPT2_ROLES = {
    "pad": ("pad_token", None),
    "bos": ("bos_token", "<|endoftext|>"),
    "eos": ("eos_token", "<|endoftext|>"),
    "unk": ("unk_token", "<|endoftext|>"),
}


def _tokenizer(path: Path, backend: HFTokenizer, specials: dict[str, str | None]) -> Tokenizer:
    """A qkv Tokenizer over ``backend``, read from ``path``; its errors name the file."""
    try:
        return Tokenizer(backend, specials=specials)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


def _load_tokenizer(
    path: Path, settings: TokenizerSettings, defaults: Mapping[str, tuple[str, str | None]]
) -> Tokenizer:
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception for unreadable files
        raise UserError(f"cannot read tokenizer {path}: {e}") from None
    roles = settings.roles(defaults, lambda token: backend.token_to_id(token) is not None)
    return _tokenizer(path, backend, roles)


def _read_vocab_txt(path: Path) -> dict[str, int]:
    """vocab.txt as HF's BertTokenizer reads it: one token a line, its id the line number."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines(True)
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    return {line.rstrip("\n"): i for i, line in enumerate(lines)}


def _bert_tokenizer(directory: Path) -> tuple[Tokenizer, Path] | None:
    """BERT's tokenizer and the file it was read from (None without one)."""
    settings = TokenizerSettings(directory)
    if (directory / FILE).is_file():
        return _load_tokenizer(directory / FILE, settings, BERT_ROLES), directory / FILE
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
    return _tokenizer(path, backend, specials), path


def _gpt2_tokenizer(directory: Path) -> tuple[Tokenizer, Path] | None:
    """GPT-2's tokenizer and the file it was read from (None without one)."""
    settings = TokenizerSettings(directory)
    if (directory / FILE).is_file():
        return _load_tokenizer(directory / FILE, settings, GPT2_ROLES), directory / FILE
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        return None
    # As HF's GPT2Tokenizer builds it: byte-level BPE without subword prefix or word suffix.
    try:
        bpe = models.BPE.from_file(str(vocab), str(merges), continuing_subword_prefix="", end_of_word_suffix="")
    except Exception as e:  # the library raises a bare Exception for unreadable files
        raise UserError(f"cannot read {vocab} and {merges} as a byte-level BPE: {e}") from None
    specials = settings.roles(GPT2_ROLES, lambda token: bpe.token_to_id(token) is not None)
    backend = HFTokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(settings.flag("add_prefix_space", False)))
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens(
        sorted({t for t in specials.values() if t is not None and bpe.token_to_id(t) is not None})
    )
    return _tokenizer(vocab, backend, specials), vocab


def _check_token_ids(config: HFConfig, tokenizer: Tokenizer, fields: Mapping[str, str], source: Path) -> None:
    """Where config.json gives a special token's id (``fields``: field -> role) and the tokenizer
    has that role, the two must agree."""
    for field, role in fields.items():
        value = config.fields.get(field)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        have = getattr(tokenizer, f"{role}_id")
        if value is not None and have is not None and value != have:
            raise UserError(
                f"{config.path}: field {field!r} is {value!r}, but the tokenizer ({source}) gives its {role} token "
                f"{tokenizer.specials[role]!r} the id {have}"
            )


def _read_spm(path: Path) -> ModelProto:
    """The protobuf of a SentencePiece model file."""
    from google.protobuf.message import DecodeError
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except (OSError, DecodeError) as e:
        raise UserError(f"cannot read {path} as a SentencePiece model: {e}") from None
    if not proto.pieces:
        raise UserError(f"{path} is not a SentencePiece model: it has no pieces")
    return proto


def _check_spm(path: Path, proto: ModelProto) -> None:
    """Refuse what the conversion below does not reproduce (none of it occurs in Marian's models)."""
    from sentencepiece.sentencepiece_model_pb2 import ModelProto, TrainerSpec

    piece_type = ModelProto.SentencePiece
    spec, trainer = proto.normalizer_spec, proto.trainer_spec
    refused = [
        ("model_type", trainer.model_type != TrainerSpec.UNIGRAM, "only unigram models are"),
        ("byte_fallback", trainer.byte_fallback, "byte pieces are not"),
        ("treat_whitespace_as_suffix", trainer.treat_whitespace_as_suffix, "only word-initial ▁ is"),
        ("escape_whitespaces", not spec.escape_whitespaces, "spaces must become ▁"),
        ("denormalizer_spec", bool(proto.denormalizer_spec.precompiled_charsmap), "a denormalizer is not"),
    ]
    for field, bad, why in refused:
        if bad:
            raise UserError(f"{path}: {field} is not supported: {why}")
    for piece in proto.pieces:
        if piece.type not in (piece_type.NORMAL, piece_type.UNKNOWN, piece_type.CONTROL):
            kind = piece_type.Type.Name(piece.type).lower()
            raise UserError(f"{path}: piece {piece.piece!r} is {kind}; qkv converts normal and control pieces only")


def _marian_tokenizer(directory: Path, config: EncoderDecoderConfig, *, spm_file: str, vocab_file: str) -> Tokenizer:
    """One side of MarianTokenizer as a ``tokenizers`` Unigram model over the ids of ``vocab_file``.

    The sides: the source's ``source.spm`` + ``vocab.json``, which with a shared vocabulary is
    the target's too; with separate vocabularies the target's ``target.spm`` +
    ``target_vocab.json`` (MarianTokenizer's target mode, and its decoding). Below, source.spm
    and vocab.json stand for either pair.

    MarianTokenizer segments a source text with source.spm, looks each piece up in vocab.json
    (a piece it lacks is <unk>) and appends </s>; it decodes ids through vocab.json and, with a
    shared vocabulary, source.spm, then strips the text. Rebuilt here as HF's converter of
    SentencePiece models does it: source.spm's normalizer (precompiled character map,
    whitespace rules) and Metaspace, then a Unigram model whose token i is vocab.json's id i,
    scored as in source.spm so that its best segmentation is SentencePiece's, and a
    post-processor that appends </s> (``Tokenizer.add_special_tokens``). BEGIN is the decoder's
    start token; multilingual models' target-language codes (>>fra<<) are added tokens.

    SentencePiece never produces most other vocab.json tokens (the target side's pieces, its
    own control pieces such as <s>), so they are kept out of the text's reach (NOT_SOURCE): a
    low score would not do, as the Unigram model prefers any piece to <unk>. It does produce,
    for a run of characters it has no piece for, the run's text as one piece, which vocab.json
    may hold (the target side's "É", or a rare character of the source side); a normalizer
    step turns every such run that vocab.json lacks into one U+FFFF (read as <unk>), so that a
    token made of such characters matches only a whole run, as MarianTokenizer's look-up does.
    The unmatched tokens get source.spm's lowest score: the Unigram model scores <unk> from the
    lowest score of its vocabulary, which must stay SentencePiece's.
    """
    spm_path, vocab_path = directory / spm_file, directory / vocab_file
    proto = _read_spm(spm_path)
    _check_spm(spm_path, proto)
    vocab = read_json_object(vocab_path)
    ids = list(vocab.values())
    if any(type(i) is not int for i in ids) or sorted(ids) != list(range(len(ids))):
        raise UserError(f"{vocab_path} must map tokens to the ids 0, 1, ..., N-1, each once")
    tokens = sorted(vocab, key=vocab.__getitem__)  # token i has id i
    settings = TokenizerSettings(directory)
    eos, _ = settings.token("eos_token", "</s>")
    unk, _ = settings.token("unk_token", "<unk>")
    pad, _ = settings.token("pad_token", "<pad>")
    if config.bos_id >= len(tokens):
        raise UserError(f"{vocab_path} has no id {config.bos_id} ({HF_CONFIG}'s decoder_start_token_id)")
    specials = {"pad": pad, "bos": tokens[config.bos_id], "eos": eos, "unk": unk}
    for role, token in specials.items():
        if token is None or token not in vocab:
            raise UserError(f"{vocab_path} lacks the {role} token {token!r}")
    codes = [t for t in tokens if t.startswith(">>") and t.endswith("<<")]  # MarianTokenizer's test
    whole = set(specials.values()) | set(codes)  # matched in the raw text, before the normalizer

    normal = type(proto).SentencePiece.NORMAL
    source = {p.piece: p for p in proto.pieces}
    lowest = min((p.score for p in proto.pieces if p.type == normal), default=0.0)
    # SentencePiece reads a character it has no one-character piece for as unknown.
    known = {p.piece for p in proto.pieces if p.type == normal and len(p.piece) == 1}
    scored: list[tuple[str, float]] = []
    surfaces = []  # tokens that are the text of a run of unknown characters
    for token in tokens:
        piece = source.get(token)
        if token in whole:
            scored.append((token, 0.0))  # SentencePiece scores its control pieces 0 too
        elif piece is not None and piece.type == normal:
            scored.append((token, piece.score))
        elif piece is None and token and not known.intersection(token):
            scored.append((token, lowest))  # one piece beats two or more: a whole run is this token
            surfaces.append(token)
        else:
            scored.append((token + (NOT_SOURCE if piece is None else CONTROL), lowest))
    backend = HFTokenizer(models.Unigram(scored, unk_id=vocab[unk], byte_fallback=False))

    spec = proto.normalizer_spec
    steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    steps.append(normalizers.Replace(" ", "▁"))
    if spec.add_dummy_prefix:
        # SentencePiece prefixes "▁" even to a text that starts with one; Metaspace would not.
        steps.append(normalizers.Replace(Regex(r"\A▁"), "▁▁"))
    # A maximal run of unknown characters (none before it, at least one) that is not one of
    # the surfaces becomes U+FFFF, a noncharacter no vocabulary holds: one <unk>.
    unknown = "[^" + "".join(re.escape(c) for c in sorted(known)) + "]"
    run = rf"(?<!{unknown})(?={unknown})"
    if surfaces:
        run += rf"(?!(?:{'|'.join(re.escape(t) for t in surfaces)})(?!{unknown}))"
    steps.append(normalizers.Replace(Regex(rf"{run}{unknown}+"), "\uffff"))
    backend.normalizer = normalizers.Sequence(steps)
    # "always": every stretch of text between special tokens gets the prefix, as MarianTokenizer
    # hands each stretch to SentencePiece on its own; split=False: one Viterbi pass per stretch.
    scheme = "always" if spec.add_dummy_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace(Regex(rf"\A.*{re.escape(CONTROL)}\z"), ""),
            decoders.Replace(NOT_SOURCE, ""),
            decoders.Replace("▁", " "),
            decoders.Fuse(),
            decoders.Replace(Regex(r"\A\s+|\s+\z"), ""),  # MarianTokenizer strips the decoded text
        ]
    )
    backend.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {eos}:0", pair=f"$A:0 $B:0 {eos}:0", special_tokens=[(eos, vocab[eos])]
    )
    backend.add_special_tokens(sorted(set(specials.values())))
    backend.add_tokens([AddedToken(code, normalized=False) for code in codes])
    return Tokenizer(backend, specials=specials, add_special_tokens=True)


def _hf_tokenizer_config(tokenizer: Tokenizer, kind: str, max_len: int) -> dict:
    """A tokenizer_config.json that loads tokenizer.json as it is, with its special tokens."""
    s = tokenizer.specials
    settings: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len}
    if kind == "encoder_only":  # BERT's names for BEGIN and END
        settings.update(cls_token=s["bos"], sep_token=s["eos"], pad_token=s["pad"], unk_token=s["unk"])
    else:
        settings.update(bos_token=s["bos"], eos_token=s["eos"], pad_token=s["pad"], unk_token=s["unk"])
    if tokenizer.mask_id is not None:  # qkv's <mask>, or an imported BERT's [MASK]
        settings["mask_token"] = tokenizer.backend.id_to_token(tokenizer.mask_id)
    return {k: v for k, v in settings.items() if v is not None}


# ------------------------------------------------------------------ import / export


def import_hf(src: str | Path, dst: str | Path) -> dict:
    """Convert the HF checkpoint directory ``src`` into the qkv model directory ``dst``.

    Returns a summary: architecture, kind, model directory, parameter count, what became of
    the tokenizer, and ``ignored``: the checkpoint's tensors that the model does not use (say,
    BERT's next-sentence head, or the pooler of a BertForMaskedLM checkpoint), by stored name.
    """
    src, dst = Path(src), Path(dst)
    check_output(dst)
    config, architecture = read_config(src)
    file, stored = read_tensors(src)
    labels = None
    if architecture in BERT:
        kind, fields = "encoder_only", bert_fields(config, architecture, set(stored))
        to_qkv, from_qkv, prefix = bert_to_qkv, qkv_to_bert, "bert."
        if architecture == "BertForSequenceClassification":
            # HF's names where config.json has none (older files leave out two classes' defaults).
            labels = bert_labels(config) or [f"LABEL_{i}" for i in range(fields["n_classes"])]
    elif architecture in GPT2:
        kind, fields = "decoder_only", gpt2_fields(config)
        to_qkv, from_qkv, prefix = gpt2_to_qkv, qkv_to_gpt2, "transformer."
    else:
        kind, fields = "encoder_decoder", marian_fields(config)
        to_qkv, from_qkv, prefix = marian_to_qkv, qkv_to_marian, ""
    try:
        model = build_model(kind, fields)
    except UserError as e:
        raise UserError(f"{config.path}: {e}") from None
    # What a checkpoint of this config holds, named and shaped: the export of a model built from it.
    expected = from_qkv(model.state_dict(), model.config)
    if architecture in BERT and model.config.type_vocab_size == 0:
        expected = {k: v for k, v in expected.items() if not k.endswith("token_type_embeddings.weight")}
    names = _canonical_names(list(stored), expected, prefix)  # canonical name -> stored name
    tensors = {name: stored[original] for name, original in names.items()}
    read = _read_from(tensors, model.config, file)  # expected name -> canonical name
    inputs = {name: tensors[read.get(name, name)] for name in expected if read.get(name, name) in tensors}
    used = {read.get(name, name) for name in expected}
    if isinstance(model.config, EncoderDecoderConfig):
        inputs.setdefault("final_logits_bias", torch.zeros(1, model.config.tgt_vocab_size))  # absent: zero
        used |= _marian_positions(tensors, model.config, file)
    origin = {name: names.get(read.get(name, name), name) for name in expected}  # the name in the file
    _check_tensors(file, architecture, inputs, expected, origin)
    _load_state(model, to_qkv(inputs, model.config))
    model.eval()
    ignored = _ignored(tensors, used, names)

    extra: dict = {"hf": {"architecture": architecture}}
    if labels is not None:
        extra["labels"] = labels  # as qkv's own classifiers store them (bert.py)
    with tempfile.TemporaryDirectory() as tmp:
        files: dict[str, Path] = {}
        c = model.config
        # Each tokenizer and the file its vocabulary came from: one (joint), or a Marian's
        # source and target (separate vocabularies).
        tokenizers: list[tuple[Tokenizer, Path]] = []
        said = "none"
        if architecture in MARIAN:
            # The SentencePiece files are kept whatever happens, for export_hf to write back.
            files = {name: src / name for name in MARIAN_TOKENIZER_FILES if (src / name).is_file()}
            kept = f"kept {', '.join(files)} for export"
            pairs = [("source.spm", "vocab.json")]
            if TokenizerSettings(src).get("separate_vocabs"):  # MarianTokenizer's target mode reads these
                pairs.append(("target.spm", "target_vocab.json"))
            missing = [name for pair in pairs for name in pair if name not in files]
            if missing:
                said = f"{kept}; not converted: {' and '.join(missing)} missing" if files else said
            else:
                for spm_file, vocab_file in pairs:
                    side = _marian_tokenizer(src, c, spm_file=spm_file, vocab_file=vocab_file)
                    tokenizers.append((side, src / vocab_file))
                converted = " and ".join(f"{a} + {b}" for a, b in pairs)
                said = f"{FILE}{f' and {TARGET_FILE}' if len(pairs) == 2 else ''} from {converted} ({kept})"
        else:
            found = _bert_tokenizer(src) if architecture in BERT else _gpt2_tokenizer(src)
            if found is not None:
                tokenizers, said = [found], FILE
        if tokenizers:
            try:  # the model has one padding, BEGIN and END id for both sides
                vocabularies = Vocabularies(tokenizers[0][0], tokenizers[-1][0])  # one tokenizer: joint
            except UserError as e:
                raise UserError(f"{tokenizers[-1][1]}: {e}") from None
            if architecture in BERT:
                ids = {"pad_token_id": "pad"}  # BERT's config.json has no ids for [CLS] and [SEP]
            elif architecture in GPT2:
                ids = {"pad_token_id": "pad", "bos_token_id": "bos", "eos_token_id": "eos"}
            else:
                ids = {"pad_token_id": "pad", "eos_token_id": "eos"}  # BEGIN is decoder_start_token_id's token
            sizes = (c.src_vocab_size, c.tgt_vocab_size) if architecture in MARIAN else (c.vocab_size, c.vocab_size)
            tables = vocabularies.tables(src_vocab_size=sizes[0], tgt_vocab_size=sizes[1])
            for (tokenizer, _, size), (_, source) in zip(tables, tokenizers, strict=True):
                if tokenizer.vocab_size > size:
                    raise UserError(
                        f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but the model only {size}"
                    )
                _check_token_ids(config, tokenizer, ids, source)
            files.update(vocabularies.save(tmp))
        save_model(model, dst, files=files, extra=extra)
    return {
        "architecture": architecture,
        "kind": kind,
        "model": str(dst),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer": said,
        "ignored": ignored,
    }


def export_hf(src: str | Path, dst: str | Path) -> dict:
    """Write the qkv model directory (or training run) ``src`` as the HF checkpoint directory ``dst``.

    ``dst`` must not exist or be an empty directory (not the working directory or one above
    it); it is written whole or not at all, flushed to disk. Returns a summary: architecture,
    model_type, directory and the files written.
    """
    src, dst = model_dir(Path(src)), Path(dst)
    check_output(dst, models=False)
    model, meta = load_model(src)
    if TARGET_FILE in meta["files"] and "source.spm" not in meta["files"]:
        # (An imported Marian's separate vocabularies are written back as its own files, below.)
        raise UserError(
            f"{src} has separate source and target vocabularies ({FILE}, {TARGET_FILE}); export-hf writes "
            f"one tokenizer for both, so it cannot export this model"
        )
    config = model.config
    state = model.state_dict()
    if isinstance(config, EncoderOnlyConfig):
        hf_config = bert_config(config, classifier_labels(src, meta, config.n_classes))
        tensors = qkv_to_bert(state, config)
    elif isinstance(config, DecoderOnlyConfig):
        hf_config, tensors = gpt2_config(config), qkv_to_gpt2(state, config)
    else:
        hf_config, tensors = marian_config(config), qkv_to_marian(state, config)
    tensors = _untied_copies(config, tensors)
    hf_config["dtype"] = "float32"
    files = meta["files"]
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        with atomic_directory(dst) as tmp:
            save_file(
                {k: v.detach().float().contiguous().clone() for k, v in tensors.items()},
                tmp / WEIGHTS,
                {"format": "pt"},
            )
            (tmp / HF_CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
            if FILE in files and "source.spm" not in files:
                tokenizer = Tokenizer.load(src / FILE)
                shutil.copyfile(src / FILE, tmp / FILE)
                settings = _hf_tokenizer_config(tokenizer, meta["kind"], config.max_len)
                (tmp / TOKENIZER_CONFIG).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
            else:
                # An imported Marian model's own files, which MarianTokenizer reads; the tokenizer.json
                # converted from them stays behind (transformers has no fast Marian tokenizer to read it).
                for name in MARIAN_TOKENIZER_FILES:
                    if name in files:
                        shutil.copyfile(src / name, tmp / name)
    except OSError as e:
        raise UserError(f"cannot write {dst}: {e.strerror or e}") from None
    return {
        "architecture": hf_config["architectures"][0],
        "model_type": hf_config["model_type"],
        "out": str(dst),
        "files": sorted(p.name for p in dst.iterdir()),
    }


def classifier_labels(src: Path, meta: dict, n_classes: int) -> list[str] | None:
    """A classifier's class names from its config.json: ``labels`` (qkv's classifiers and
    imports), else an older import's ``hf.id2label``; None when it has neither."""
    if not n_classes:
        return None
    labels = meta.get("labels")
    if labels is not None:
        if not isinstance(labels, list) or len(labels) != n_classes or not all(isinstance(x, str) for x in labels):
            raise UserError(f"{src / HF_CONFIG}: field 'labels' must list the {n_classes} class names (strings)")
        return labels
    hf = meta.get("hf")
    old = hf.get("id2label") if isinstance(hf, dict) else None
    if isinstance(old, dict) and set(old) == {str(i) for i in range(n_classes)}:
        return [str(old[str(i)]) for i in range(n_classes)]
    return None
