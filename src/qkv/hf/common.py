"""What the Hugging Face families share: reading a checkpoint, fitting its tensors to a qkv model, tokenizer files.

What is here: :class:`HFConfig` (``config.json`` read field by field, with HF's defaults) and
:func:`read_config`; :func:`read_tensors`; the steps between a checkpoint's tensors and a qkv
model that import and export take for every family (:func:`canonical_names`,
:func:`read_from`, :func:`check_tensors`, :func:`ignored_tensors`, :func:`load_state`,
:func:`untied_copies`); what the families' own modules build on (:func:`linear` for their
weight-name lists, :func:`require`, :func:`same_heads` and :func:`hf_activation` for their
export checks); :class:`TokenizerSettings`, :func:`load_tokenizer` and :func:`qkv_tokenizer`.
What is not: any one family's config fields, tensor names or tokenizer (``bert.py``,
``gpt2.py``, ``marian.py``), and the import and export that use all of this (``convert.py``).

Weights are read from ``model.safetensors``, from the shards that
``model.safetensors.index.json`` names (its ``weight_map``: each tensor's file), or from
``pytorch_model.bin`` with ``torch.load(weights_only=True)`` (nothing is unpickled beyond
tensors); fp16/bf16 weights become fp32. Not supported: sharded pickles
(``pytorch_model.bin.index.json``); quantized checkpoints (``quantization_config``, or a weight
that is not floating-point). Buffers (position and type ids, old GPT-2 checkpoints' causal mask,
old Llamas' RoPE frequencies) and second copies of tied weights are not reported as ignored
tensors.

transformers 5.x ties a second name of a weight to the first only with
``tie_word_embeddings``; without it the model computes with the second, and the first may be
stale. Import reads the one the model computes with (:func:`read_from`), export writes both
(:func:`untied_copies`). Both know the two cases there are: BERT's MLM bias, a Marian's shared
embeddings. (Whisper's ``proj_out`` is no such case: tied, it is the decoder's ``embed_tokens``;
untied, it is qkv's own output layer.)

A tokenizer's special tokens (padding, BEGIN, END, unknown) are those that
``tokenizer_config.json`` or ``special_tokens_map.json`` name, else HF's defaults ([CLS],
<|endoftext|>, ...) where the vocabulary has them, else the role has no token
(:meth:`TokenizerSettings.roles`); their roles go to ``special_tokens.json``
(``tokenization.py``). A ``tokenizer.json`` is read as it is (:func:`load_tokenizer`), but for
its padding and truncation, which qkv never keeps (:func:`tokenizer_file_settings` names them).

``transformers`` is never imported: configs are read as JSON and tensors with safetensors.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer
from torch import Tensor

from qkv.errors import UserError
from qkv.files import read_json_object
from qkv.models.decoder_only import DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoderConfig
from qkv.models.encoder_only import EncoderOnlyConfig
from qkv.models.speech import SpeechConfig
from qkv.tokenization import Tokenizer

HF_CONFIG = "config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_BIN = "pytorch_model.bin"
WEIGHTS_INDEX = f"{WEIGHTS}.index.json"  # a sharded checkpoint's map of tensors to files
# Buffers that HF checkpoints may hold and no model computes with (BERT's position and type ids,
# old GPT-2 checkpoints' causal mask): not reported as ignored tensors.
BUFFERS = re.compile(
    r"(?:^|\.)(?:position_ids|token_type_ids)$|(?:^|\.)attn\.(?:masked_)?bias$|(?:^|\.)rotary_emb\.inv_freq$"
)

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


def read_config(directory: Path, supported: tuple[str, ...]) -> tuple[HFConfig, str]:
    """The config of an HF checkpoint directory and its architecture (the first of "architectures"),
    one of ``supported``."""
    path = directory / HF_CONFIG
    if not directory.is_dir():
        raise UserError(f"{directory} does not exist or is not a directory")
    if not os.path.lexists(path):
        raise UserError(f"{path} is missing: {directory} is not a Hugging Face checkpoint directory")
    fields = read_json_object(path)  # not a regular file, too large: said as such
    if fields.get("quantization_config") is not None:
        raise UserError(f"{path}: field 'quantization_config' is set: quantized checkpoints are not supported")
    architectures = fields.get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise UserError(f"{path}: field 'architectures' is missing or empty; it names the model class")
    architecture = architectures[0]
    if architecture not in supported:
        raise UserError(f"{path}: architecture {architecture!r} is not supported; qkv imports {', '.join(supported)}")
    return HFConfig(path, fields), architecture


def read_tensors(directory: Path) -> tuple[Path, State]:
    """The tensors of ``model.safetensors``, of the shards its index names, or of
    ``pytorch_model.bin`` (tensors only), and the file named in errors (the index for shards)."""
    safetensors, pickled, index = directory / WEIGHTS, directory / WEIGHTS_BIN, directory / WEIGHTS_INDEX
    if safetensors.is_file():
        return safetensors, _safetensors(safetensors)
    if index.is_file():
        return index, _shards(index)
    if pickled.is_file():
        try:
            with warnings.catch_warnings():  # "Detected pickle protocol 4 ...": the error says enough
                warnings.simplefilter("ignore")
                tensors = torch.load(pickled, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for a file it refuses or cannot read
            raise UserError(
                f"{pickled} cannot be read as a tensor dictionary by PyTorch's restricted unpickler "
                f"(weights_only=True; nothing in it was run): {_unpickler_reason(e)}"
            ) from None
        if not isinstance(tensors, dict) or not all(isinstance(v, Tensor) for v in tensors.values()):
            raise UserError(f"{pickled} does not hold a dictionary of tensors")
        return pickled, tensors
    if (directory / f"{WEIGHTS_BIN}.index.json").is_file():
        raise UserError(f"{directory / WEIGHTS_BIN}.index.json: sharded pickles are not read; save as safetensors")
    raise UserError(f"{directory} has neither {WEIGHTS} nor {WEIGHTS_BIN}")


def _safetensors(path: Path) -> State:
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path} cannot be read as safetensors: {e}") from None


def _shards(index: Path) -> State:
    """Every tensor of a sharded checkpoint: each shard its index's ``weight_map`` names, read
    once, keeping the tensors the map gives it."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise UserError(f"{index}: field 'weight_map' must map tensor names to shard files")
    tensors: State = {}
    for file in sorted(set(weight_map.values())):
        shard = index.parent / file
        if Path(file).name != file or not shard.is_file():
            raise UserError(f"{index}: shard {file!r} is not a file beside it")
        loaded = _safetensors(shard)
        for name, where in weight_map.items():
            if where == file:
                if name not in loaded:
                    raise UserError(f"{index}: tensor {name!r} is not in {file}, where weight_map puts it")
                tensors[name] = loaded[name]
    return tensors


def _unpickler_reason(error: Exception) -> str:
    """The sentence of torch.load's error that says why (its message is a page of advice)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "WeightsUnpickler error:" in line:
            reason = line.split("WeightsUnpickler error:", 1)[1].strip() or (lines[i + 1] if i + 1 < len(lines) else "")
            return reason.split(". Please", 1)[0].rstrip(".")
    return lines[0] if lines else type(error).__name__


def canonical_names(names: list[str], expected: Mapping[str, Tensor], prefix: str) -> dict[str, str]:
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


def read_from(
    tensors: Mapping[str, Tensor],
    config: EncoderOnlyConfig | DecoderOnlyConfig | EncoderDecoderConfig | SpeechConfig,
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


def check_tensors(
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


def ignored_tensors(tensors: Mapping[str, Tensor], used: set[str], stored: Mapping[str, str]) -> list[str]:
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


def load_state(model: torch.nn.Module, state: State) -> None:
    """Copy ``state`` into the model; every parameter (tied ones once) must be covered, each by
    a tensor of its exact shape (``copy_`` would broadcast)."""
    params = model.state_dict()
    covered = set()
    with torch.no_grad():
        for name, tensor in state.items():
            # A bug here, not the user's: check_tensors has checked every tensor the mapping reads.
            if name not in params or params[name].shape != tensor.shape:
                want = tuple(params[name].shape) if name in params else "no such parameter"
                raise RuntimeError(f"the weight mapping gives {name} shape {tuple(tensor.shape)}; the model: {want}")
            params[name].copy_(tensor)
            covered.add(params[name].data_ptr())
    left = [name for name, p in params.items() if p.data_ptr() not in covered]
    if left:
        raise RuntimeError(f"the weight mapping left {', '.join(left[:5])} unset")  # a bug here, not the user's


def untied_copies(
    config: EncoderOnlyConfig | DecoderOnlyConfig | EncoderDecoderConfig | SpeechConfig, tensors: State
) -> State:
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


def renamed(tensors: Mapping[str, Tensor], pairs: list[tuple[str, str]]) -> State:
    """The tensor each pair's second name holds, under its first name: the one mover of the
    name tables (a table read one way imports, the other way exports)."""
    return {new: tensors[old] for new, old in pairs}


def linear(names: list[tuple[str, str]], qkv: str, hf: str, *, bias: bool = True) -> None:
    names.append((f"{qkv}.weight", f"{hf}.weight"))
    if bias:
        names.append((f"{qkv}.bias", f"{hf}.bias"))


def require(config: object, target: str, wanted: Mapping[str, object]) -> None:
    """Refuse to export a model whose config differs from what the HF architecture computes."""
    for name, value in wanted.items():
        have = getattr(config, name)
        if have != value:
            raise UserError(f"cannot export as {target}: it needs {name}={value!r}, this model has {name}={have!r}")


def same_heads(
    config: EncoderOnlyConfig | DecoderOnlyConfig | EncoderDecoderConfig | SpeechConfig, target: str
) -> None:
    if config.n_kv_heads not in (None, config.n_heads):
        raise UserError(f"cannot export as {target}: grouped-query attention (n_kv_heads={config.n_kv_heads})")


def hf_activation(activation: str, target: str) -> str:
    if activation not in ACTIVATIONS_TO_HF:
        raise UserError(f"cannot export as {target}: activation={activation!r} has no {target} equivalent")
    return ACTIVATIONS_TO_HF[activation]


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


def qkv_tokenizer(path: Path, backend: HFTokenizer, specials: dict[str, str | None]) -> Tokenizer:
    """A qkv Tokenizer over ``backend``, read from ``path``; its errors name the file."""
    try:
        return Tokenizer(backend, specials=specials)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


def tokenizer_file_settings(path: Path) -> list[str]:
    """The padding and truncation a ``tokenizer.json`` asks for, in words ("fixed padding to 128
    tokens", "truncation at 128 tokens"); none for another file or one without them. qkv does not
    keep them (:class:`~qkv.tokenization.Tokenizer`)."""
    if path.name != "tokenizer.json":
        return []
    spec = read_json_object(path)
    found = []
    padding, truncation = spec.get("padding"), spec.get("truncation")
    if isinstance(padding, dict):
        strategy = padding.get("strategy")
        fixed = strategy.get("Fixed") if isinstance(strategy, dict) else None
        found.append(f"fixed padding to {fixed} tokens" if fixed is not None else "padding to the longest text")
    if isinstance(truncation, dict):
        found.append(f"truncation at {truncation.get('max_length')} tokens")
    return found


def load_tokenizer(
    path: Path, settings: TokenizerSettings, defaults: Mapping[str, tuple[str, str | None]]
) -> Tokenizer:
    """The tokenizer of ``path`` (a ``tokenizer.json``) with the special-token roles ``settings``
    name (else ``defaults``); its padding and truncation switched off (:class:`Tokenizer` does)."""
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception for unreadable files
        raise UserError(f"cannot read tokenizer {path}: {e}") from None
    roles = settings.roles(defaults, lambda token: backend.token_to_id(token) is not None)
    return qkv_tokenizer(path, backend, roles)
