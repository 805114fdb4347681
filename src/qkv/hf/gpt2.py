"""GPT-2: ``GPT2LMHeadModel`` <-> qkv ``decoder_only``.

What is here: :func:`gpt2_fields` / :func:`gpt2_config` (HF ``config.json`` <-> qkv config
fields), :func:`gpt2_to_qkv` / :func:`qkv_to_gpt2` (weight names) and :func:`gpt2_tokenizer`.
What is not: import and export themselves (``convert.py``), what the families share
(``common.py``).

The model: pre-norm, learned positions, tanh GELU. HF's Conv1D weights are stored (in, out),
and its fused ``c_attn`` is split into Wq, Wk, Wv. Without ``bos_token_id``/``eos_token_id``,
GPT2Config's 50256 applies only to a vocabulary that has that id. Not supported: GPT-2 without
attention scaling, with ``scale_attn_by_inverse_layer_idx`` or with cross-attention.

The tokenizer: ``tokenizer.json`` as it is, else ``vocab.json`` + ``merges.txt`` rebuilt as
HF's GPT2Tokenizer does (byte-level BPE); the special tokens default to <|endoftext|>.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors
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
from qkv.models.decoder_only import DecoderOnlyConfig
from qkv.tokenization import FILE, Tokenizer

GPT2 = ("GPT2LMHeadModel",)


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
        linear(plain, f"{q}.norm_1", f"{h}.ln_1")
        linear(plain, f"{q}.norm_3", f"{h}.ln_2")
        transposed.append((f"{q}.self_attn.w_o.weight", f"{h}.attn.c_proj.weight"))
        transposed.append((f"{q}.ffn.w_1.weight", f"{h}.mlp.c_fc.weight"))
        transposed.append((f"{q}.ffn.w_2.weight", f"{h}.mlp.c_proj.weight"))
        for mine, theirs in (("self_attn.w_o", "attn.c_proj"), ("ffn.w_1", "mlp.c_fc"), ("ffn.w_2", "mlp.c_proj")):
            plain.append((f"{q}.{mine}.bias", f"{h}.{theirs}.bias"))
    linear(plain, "decoder.norm", "transformer.ln_f")
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
    require(
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
    same_heads(config, target)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_embd": config.d_model,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "n_inner": config.d_ff,
        "n_positions": config.max_len,
        "activation_function": hf_activation(config.activation, target),
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


GPT2_ROLES = {
    "pad": ("pad_token", None),
    "bos": ("bos_token", "<|endoftext|>"),
    "eos": ("eos_token", "<|endoftext|>"),
    "unk": ("unk_token", "<|endoftext|>"),
}


def gpt2_tokenizer(directory: Path) -> tuple[Tokenizer, Path] | None:
    """GPT-2's tokenizer and the file it was read from (None without one)."""
    settings = TokenizerSettings(directory)
    if (directory / FILE).is_file():
        return load_tokenizer(directory / FILE, settings, GPT2_ROLES), directory / FILE
    return byte_level_bpe(directory, settings, GPT2_ROLES)


def byte_level_bpe(
    directory: Path, settings: TokenizerSettings, defaults: Mapping[str, tuple[str, str | None]]
) -> tuple[Tokenizer, Path] | None:
    """The byte-level BPE of ``vocab.json`` and ``merges.txt`` (GPT-2's files, and RoBERTa's) with
    the special tokens ``settings`` name, else ``defaults``; None without those files."""
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        return None
    # As HF's GPT2Tokenizer builds it: byte-level BPE without subword prefix or word suffix.
    try:
        bpe = models.BPE.from_file(str(vocab), str(merges), continuing_subword_prefix="", end_of_word_suffix="")
    except Exception as e:  # the library raises a bare Exception for unreadable files
        raise UserError(f"cannot read {vocab} and {merges} as a byte-level BPE: {e}") from None
    specials = settings.roles(defaults, lambda token: bpe.token_to_id(token) is not None)
    backend = HFTokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(settings.flag("add_prefix_space", False)))
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens(
        sorted({t for t in specials.values() if t is not None and bpe.token_to_id(t) is not None})
    )
    return qkv_tokenizer(vocab, backend, specials), vocab
