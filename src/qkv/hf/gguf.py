"""GGUF files (llama.cpp's format): a Llama-family model, its tokenizer and chat template, in one file.

What is here: :func:`read_gguf`, which reads a ``.gguf`` file with the ``gguf`` package (llama.cpp's
own reader; nothing here parses the format) into what a Hugging Face checkpoint directory would
hold: its ``config.json`` fields (:func:`gguf_config`), its tensors under Hugging Face's names,
dequantised to float32 (:func:`gguf_tensors`), its tokenizer (:func:`gguf_tokenizer`) and chat
template. ``convert.import_gguf`` imports that as ``llama.py`` imports a checkpoint directory.
What is not: the model maths (``llama.py``'s fields and names do it), writing GGUF files.

Architectures: ``llama`` (Llama 2 and 3, SmolLM, TinyLlama, and Mistral, which llama.cpp files as
llama), ``qwen2``, ``gemma3``; others are refused by name. Tensors: every type the ``gguf`` package
dequantises (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K to Q6_K, ...), each to float32;
names mapped by the package's own table (``gguf.get_tensor_name_map``). llama.cpp stores a llama's
Wq and Wk rows permuted for its interleaved RoPE (``convert_hf_to_gguf.py``'s ``permute``), and
Gemma's norm gains as 1 + w: both are undone, as transformers' GGUF loader undoes them. Llama
3.1's ``rope_freqs.weight`` (its RoPE frequency factors) becomes the llama3 ``rope_scaling`` that
gives them (:func:`llama3_scaling`; transformers' GGUF reader leaves it out, and rotates as an
unscaled Llama would).

Metadata: llama.cpp's keys (``gguf.Keys``) become config.json's fields as transformers maps them;
what a GGUF leaves out takes llama.cpp's values: Gemma 3's every sixth layer global, its local
RoPE base 10000, its scores scaled by 1/√K (27B: 1/√(D/H)). (transformers' GGUF reader leaves
``query_pre_attn_scalar`` at its default, 256: the same for Gemma 3's published sizes but 27B.)

The tokenizer, from ``tokenizer.ggml.*`` into a ``tokenizers`` tokenizer:
    gpt2   byte-level BPE (Llama 3, Qwen2, SmolLM): the vocabulary and merges, split before
           BPE as ``tokenizer.ggml.pre`` names (llama.cpp's regular expressions for llama-bpe,
           qwen2 and the like; SmolLM's digits one by one; else GPT-2's)
    llama  SentencePiece BPE with byte fallback (Llama 2, TinyLlama; Gemma without the prefix
           space), merges from the file or, where it has none, from the scores (Gemma: from the
           order of its tokens), as transformers rebuilds them
Control tokens (type 3) are special tokens, user-defined ones (type 4) matched whole; BEGIN is
added where ``add_bos_token`` says (a SentencePiece vocabulary: unless it says not to).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from qkv.errors import UserError
from qkv.hf.common import State
from qkv.positions import RopeScaling, rope_frequencies
from qkv.tokenization import Tokenizer

# general.architecture -> the Hugging Face class that computes the same.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
GEMMA_PATTERN, GEMMA_LOCAL_BASE = 6, 10000.0  # llama.cpp's Gemma 3: five sliding layers per global one
GEMMA_27B_LAYERS = 62  # how llama.cpp tells Gemma 3 27B, whose scores it scales otherwise
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's RoPE frequency factors: read into rope_scaling, not a weight
LLAMA3_WINDOW = 8192  # Llama 3.1's original_max_position_embeddings (convert_hf_to_gguf.py's default too)
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values

# Pre-tokenizer splits by tokenizer.ggml.pre (llama.cpp's llama-vocab.cpp; transformers' GGUF reader).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@dataclass(frozen=True)
class GGUFCheckpoint:
    """What one GGUF file holds, as a checkpoint directory would: config.json's fields (with
    ``architectures``), the tensors under Hugging Face's names, the tokenizer (None: the file has
    none), the chat template (None: none) and the ids that end a turn."""

    fields: dict
    tensors: State
    tokenizer: Tokenizer | None
    template: str | None
    stops: list[int]


def read_gguf(path: Path) -> GGUFCheckpoint:
    """The model, tokenizer and chat template of the GGUF file ``path``."""
    reader = _reader(path)
    meta = _metadata(reader)
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    fields = gguf_config(path, meta, [t.name for t in reader.tensors], None if freqs is None else freqs.data)
    tokenizer = gguf_tokenizer(path, meta)
    stops = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    return GGUFCheckpoint(
        fields, gguf_tensors(path, reader, fields), tokenizer, meta.get("tokenizer.chat_template"), stops
    )


def _reader(path: Path):
    import gguf

    if not path.is_file():
        raise UserError(f"{path} does not exist or is not a file")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as e:  # the reader's errors for a file it cannot read
        raise UserError(f"{path} cannot be read as a GGUF file: {e}") from None


def _metadata(reader) -> dict:
    """Every metadata key's value as Python data (strings, numbers, lists)."""
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError):
            continue  # a value the reader cannot give back is one qkv does not read
    return meta


# ------------------------------------------------------------------------------ config


def gguf_config(path: Path, meta: Mapping, tensor_names: list[str], rope_freqs: np.ndarray | None = None) -> dict:
    """config.json's fields of the model a GGUF file's metadata describes (transformers' mapping
    of llama.cpp's keys, with llama.cpp's values for what the file leaves out); ``rope_freqs``:
    the file's ``rope_freqs.weight`` (Llama 3.1's RoPE frequency factors), read as the llama3
    ``rope_scaling`` that makes them (:func:`llama3_scaling`)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"{path}: architecture {arch!r} is not supported; qkv imports GGUF {', '.join(ARCHITECTURES)}")

    def get(key: str, default: object = None) -> object:
        return meta.get(key.format(arch=arch), default)

    tokens = meta.get("tokenizer.ggml.tokens") or []
    heads = get("{arch}.attention.head_count")
    d_model = get("{arch}.embedding_length")
    head_dim = get("{arch}.attention.key_length", get("{arch}.rope.dimension_count"))
    rotated = get("{arch}.rope.dimension_count", head_dim)
    if head_dim is not None and rotated != head_dim:
        raise UserError(f"{path}: RoPE rotates {rotated} of {head_dim} dimensions; qkv rotates every one")
    name = str(meta.get("general.name", "")).lower()
    fields = {
        "architectures": ["MistralForCausalLM" if arch == "llama" and "mistral" in name else ARCHITECTURES[arch]],
        "vocab_size": get("{arch}.vocab_size", len(tokens)),
        "hidden_size": d_model,
        "intermediate_size": get("{arch}.feed_forward_length"),
        "num_hidden_layers": get("{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": get("{arch}.context_length"),
        "rms_norm_eps": get("{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("{arch}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(get) if rope_freqs is None else llama3_scaling(path, rope_freqs, get),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "sliding_window": get("{arch}.attention.sliding_window"),
    }
    if arch == "gemma3":
        # llama.cpp scales Gemma 3's scores by 1/√K, but the 27B's (62 layers) by 1/√(D/H).
        scalar = d_model // heads if fields["num_hidden_layers"] == GEMMA_27B_LAYERS else head_dim
        fields.update(
            query_pre_attn_scalar=scalar,
            sliding_window_pattern=get("{arch}.attention.sliding_window_pattern", GEMMA_PATTERN),
            rope_local_base_freq=get("{arch}.rope.freq_base_swa", GEMMA_LOCAL_BASE),
            hidden_activation="gelu_pytorch_tanh",
        )
    if arch == "qwen2":
        fields["use_sliding_window"] = False
    missing = [
        k for k, v in fields.items() if v is None and k in ("hidden_size", "num_hidden_layers", "num_attention_heads")
    ]
    if missing:
        raise UserError(f"{path}: metadata {missing[0]!r} (llama.cpp's {arch}.*) is missing")
    return fields


def _rope_scaling(get) -> dict | None:
    """config.json's rope_scaling from llama.cpp's rope.scaling.* keys (None: unscaled)."""
    kind = get("{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": get("{arch}.rope.scaling.factor")}
    original = get("{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


def llama3_scaling(path: Path, factors: np.ndarray, get) -> dict:
    """config.json's llama3 ``rope_scaling`` from llama.cpp's ``rope_freqs.weight``, which holds, per
    RoPE frequency, what it divides it by (``convert_hf_to_gguf.py`` computes them by Llama 3.1's
    rule from factor s, low_freq_factor, high_freq_factor and the original window L₀). The file
    keeps only the quotients: s is the largest; Llama 3.1's and 3.2's own low 1, high 4 and L₀
    8192 (or the file's rope.scaling.original_context_length) are taken, and the factors they give
    must be the file's (else refused by name: qkv would rotate otherwise than llama.cpp)."""
    width = get("{arch}.embedding_length") // get("{arch}.attention.head_count")
    head_dim = get("{arch}.rope.dimension_count") or get("{arch}.attention.key_length") or width
    base = float(get("{arch}.rope.freq_base", 10000.0))
    original = int(get("{arch}.rope.scaling.original_context_length") or LLAMA3_WINDOW)
    found = np.asarray(factors, dtype=np.float64).reshape(-1)
    scaling = {
        "rope_type": "llama3",
        "factor": float(found.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }
    kept = RopeScaling("llama3", scaling["factor"], original, 1.0, 4.0)
    plain, _ = rope_frequencies(head_dim, base=base)  # (K/2,)
    scaled, _ = rope_frequencies(head_dim, base=base, scaling=kept)  # (K/2,)
    expected = (plain.double() / scaled.double()).numpy()
    if found.shape != expected.shape or not np.allclose(found, expected, rtol=1e-5, atol=0):
        raise UserError(
            f"{path}: tensor 'rope_freqs.weight' holds RoPE factors that Llama 3.1's rule (low_freq_factor 1, "
            f"high_freq_factor 4, original window {original}) does not give; qkv does not read them"
        )
    return scaling


# ------------------------------------------------------------------------------ tensors


def gguf_tensors(path: Path, reader, fields: dict) -> State:
    """Every tensor of the file under its Hugging Face name, dequantised to float32, with
    llama.cpp's permutation of a llama's Wq and Wk rows and Gemma's 1 + w norm gains undone."""
    import gguf

    arch = reader.fields["general.architecture"].contents()
    names = _hf_names(arch, fields["num_hidden_layers"])
    heads, kv_heads = fields["num_attention_heads"], fields["num_key_value_heads"]
    tensors: State = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name == ROPE_FREQS:
            continue  # read into the config's rope_scaling (gguf_config)
        try:
            weights = gguf.dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise UserError(
                f"{path}: tensor {name!r} is {tensor.tensor_type.name}, which cannot be dequantised: {e}"
            ) from None
        if arch == "llama" and ".attn_q." in name:
            weights = _unpermute(_split_by(path, name, weights, heads, "head_count"), heads)
        elif arch == "llama" and ".attn_k." in name:
            weights = _unpermute(_split_by(path, name, weights, kv_heads, "head_count_kv"), kv_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            weights = weights - 1  # llama.cpp stores Gemma's norm gains as 1 + w
        tensors[names.get(name, name)] = torch.from_numpy(
            np.array(weights, dtype=np.float32)
        )  # a copy: the file is mapped
    return tensors


def _hf_names(arch: str, n_layers: int) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, by the gguf package's own table."""
    import gguf

    architecture = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    table = gguf.get_tensor_name_map(architecture, n_layers)
    hf = ["model.embed_tokens", "model.norm", "lm_head"]
    per_layer = [
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        *(f"self_attn.{x}" for x in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")),
        *(f"mlp.{x}" for x in ("gate_proj", "up_proj", "down_proj")),
    ]
    hf += [f"model.layers.{i}.{part}" for i in range(n_layers) for part in per_layer]
    names = {}
    for name in hf:
        found = table.get_name(name)
        if found is not None:
            for suffix in (".weight", ".bias"):
                names[found + suffix] = name + suffix
    return names


def _split_by(path: Path, name: str, weights: np.ndarray, heads: object, key: str) -> np.ndarray:
    """``weights``, whose rows must part into ``heads`` heads of an even size (a UserError naming
    the tensor and the metadata key otherwise: a damaged file's head count)."""
    rows = weights.shape[0] if weights.ndim else 0
    if not isinstance(heads, int) or heads <= 0 or rows % (2 * heads) or rows == 0:
        raise UserError(
            f"{path}: tensor {name!r} has {rows} rows, which llama.attention.{key} = {heads!r} heads cannot "
            "share in even halves; the file is damaged or not llama.cpp's"
        )
    return weights


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of a llama's Wq or Wk rows (``convert_hf_to_gguf.py``:
    each head's rows reordered from rotate-half pairs (i, i + K/2) to interleaved ones).

    Shapes: (heads·K, D) -> (heads·K, D)."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


# ------------------------------------------------------------------------------ tokenizer


def gguf_tokenizer(path: Path, meta: Mapping) -> Tokenizer | None:
    """The tokenizer ``tokenizer.ggml.*`` describes (None without one), with BEGIN, END, padding
    and unknown from its ids."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        return None
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level(tokens, meta)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        gemma = meta.get("general.architecture") == "gemma3"
        backend = _sentencepiece(tokens, meta, gemma=gemma)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))  # llama.cpp's default for it
    else:
        raise UserError(f"{path}: tokenizer.ggml.model {kind!r} is not read; qkv reads gpt2 and llama tokenizers")
    _add_special(backend, tokens, types, byte_level=kind == "gpt2")
    roles = {}
    for role, key in (("pad", "padding"), ("bos", "bos"), ("eos", "eos"), ("unk", "unknown")):
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        roles[role] = tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None
    if add_bos and roles["bos"] is not None:
        bos = roles["bos"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    try:
        return Tokenizer(backend, specials=roles, add_special_tokens=add_bos)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


def _byte_level(tokens: list[str], meta: Mapping) -> HFTokenizer:
    """Byte-level BPE over the file's vocabulary and merges, split as ``tokenizer.ggml.pre`` says."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {(t if set(t) <= alphabet else _byte_spelling(t)): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    backend = HFTokenizer(
        models.BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    pre = meta.get("tokenizer.ggml.pre")
    if pre in SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre == "smollm":  # SmolLM's own tokenizer.json (and llama.cpp): digits one by one, then GPT-2's
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def _byte_spelling(token: str) -> str:
    """A token written in plain text spelled in the byte-level alphabet (GPT-2's bytes_to_unicode)."""
    table = _bytes_to_unicode()
    return "".join(table[b] for b in token.encode("utf-8"))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (Radford et al., 2019, encoder.py)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _sentencepiece(tokens: list[str], meta: Mapping, *, gemma: bool) -> HFTokenizer:
    """SentencePiece BPE with byte fallback, as transformers' LlamaTokenizer (or GemmaTokenizer:
    no prefix space, spaces split off) builds it from a vocabulary and merges."""
    if gemma:  # a token of spaces is stored as spaces; the model's pieces spell them "▁"
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    elif gemma:  # Gemma's scores do not follow its merge order; the order of its tokens does
        merges = merges_from_scores(vocab, {t: -i for i, t in enumerate(tokens)})
    else:
        merges = merges_from_scores(vocab, dict(zip(tokens, meta.get("tokenizer.ggml.scores") or [], strict=False)))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    backend = HFTokenizer(
        models.BPE(
            vocab, merges, fuse_unk=True, byte_fallback=True, unk_token=tokens[unk] if isinstance(unk, int) else None
        )
    )
    replace = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence(replace)
    else:
        prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if prefix else "never", split=False
        )
        backend.decoder = decoders.Sequence(replace + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def merges_from_scores(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every split of a piece into two pieces
    of the vocabulary, the best-scored piece's first (ties: shorter left part first), as
    transformers' ``generate_merges`` recovers them."""
    merges = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special(backend: HFTokenizer, tokens: list[str], types: list[int], *, byte_level: bool) -> None:
    """Control tokens become special tokens (matched whole, dropped when decoding); user-defined
    ones are matched whole. In a byte-level vocabulary a control token outside the byte alphabet
    is a mislabel llama.cpp makes, and is left as it is."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if byte_level else None
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types, strict=False)
        if kind == CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types, strict=False)
            if kind == USER_DEFINED
        ]
    )
