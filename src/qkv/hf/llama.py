"""The Llama family: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM`` and
``Gemma3ForCausalLM`` <-> qkv ``decoder_only``.

What is here: :func:`llama_fields` / :func:`llama_config` (HF ``config.json`` <-> qkv config
fields), :func:`llama_to_qkv` / :func:`qkv_to_llama` (weight names: one table per family over
one mover, :func:`~qkv.hf.common.renamed`), :func:`rope_of` (``rope_theta`` and
``rope_scaling``/``rope_parameters`` read), :func:`llama_tokenizer` and :func:`stop_ids`.
What is not: import and export themselves (``convert.py``), GGUF files (``gguf.py``, which
reads its metadata into such a config.json), chat templates (``qkv/templates.py``).

The models: pre-norm RMSNorm, RoPE, a gated feed-forward network (SwiGLU; Gemma's GEGLU with
the tanh GELU), grouped-query attention, no biases, optionally tied output. Per family:

    Llama    ``attention_bias`` and ``mlp_bias`` together become ``bias`` (one alone is refused)
    Qwen2    biases on Wq, Wk, Wv alone (``qkv_bias``); ``use_sliding_window`` from
             ``max_window_layers`` on
    Mistral  ``sliding_window`` in every layer
    Gemma3   per-head query/key RMSNorm (``qk_norm``), a norm after each sub-layer too
             (``sandwich_norm``), embeddings scaled by √D, scores by 1/√query_pre_attn_scalar,
             sliding layers (``layer_types``, else every 6th layer global) with their own RoPE
             base (``local_rope_base``); its norms compute x̂·(1 + w), so import stores 1 + w
             and export writes w back

RoPE: ``rope_theta`` and ``rope_scaling`` (transformers 4.x) or ``rope_parameters``
(transformers 5.x: the same, in one object; Gemma 3's by layer type): linear, dynamic, llama3
and yarn scaling (:class:`~qkv.positions.RopeScaling`). Dynamic NTK scaling is computed
from the positions each call reads, where transformers keeps the largest length seen: the
two agree on any one sequence read at once, and differ only while a cache holds positions
past the pretraining window. Refused, by field: other scalings (longrope, ...), partial rotary
dimensions, logit soft-capping, bidirectional attention, other activations.

The tokenizer: ``tokenizer.json`` as it is (byte-level BPE for Llama 3, Qwen2, SmolLM; BPE
with byte fallback for Llama 2, TinyLlama, Gemma), its post-processor applied by ``encode``
when it adds tokens (Llama's BEGIN), as the model's tokenizer does; the special tokens those of
``tokenizer_config.json``, else the ids config.json gives. A checkpoint with ``tokenizer.model``
alone (SentencePiece, no ``tokenizer.json``) is imported without its tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from torch import Tensor

from qkv.errors import UserError
from qkv.hf.common import HFConfig, State, TokenizerSettings, load_tokenizer, renamed, require
from qkv.models.decoder_only import DecoderOnlyConfig
from qkv.positions import ROPE_SCALINGS, RopeScaling
from qkv.tokenization import FILE, Tokenizer

GEMMA3 = ("Gemma3ForCausalLM",)
LLAMA = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", *GEMMA3)
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Gemma3ForCausalLM": "gemma3_text",
}
SLIDING, FULL = "sliding_attention", "full_attention"
# An imported checkpoint's own files, kept in the model directory for chat (its template, its
# generation defaults) and written back by export.
GENERATION_CONFIG, CHAT_TEMPLATE = "generation_config.json", "chat_template.jinja"
LLAMA_FILES = ("tokenizer_config.json", "special_tokens_map.json", GENERATION_CONFIG, CHAT_TEMPLATE)
GEMMA_PATTERN = 6  # Gemma 3: five sliding layers, then one global (its config's default)

# (qkv name, HF name) in every block; Gemma's and biases added below.
ATTENTION = [(f"self_attn.w_{x}.weight", f"self_attn.{x}_proj.weight") for x in "qkvo"]
FEED_FORWARD = [
    ("ffn.w_1.weight", "mlp.gate_proj.weight"),
    ("ffn.w_3.weight", "mlp.up_proj.weight"),
    ("ffn.w_2.weight", "mlp.down_proj.weight"),
]
LLAMA_NORMS = [("norm_1.weight", "input_layernorm.weight"), ("norm_3.weight", "post_attention_layernorm.weight")]
GEMMA_NORMS = [
    ("norm_1.weight", "input_layernorm.weight"),
    ("post_norm_1.weight", "post_attention_layernorm.weight"),
    ("norm_3.weight", "pre_feedforward_layernorm.weight"),
    ("post_norm_3.weight", "post_feedforward_layernorm.weight"),
    ("self_attn.q_norm.weight", "self_attn.q_norm.weight"),
    ("self_attn.k_norm.weight", "self_attn.k_norm.weight"),
]


# ------------------------------------------------------------------------------ config


def llama_fields(config: HFConfig, architecture: str) -> dict:
    """The qkv ``decoder_only`` fields of a Llama-family config.json."""
    gemma = architecture in GEMMA3
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.fields.get(name) is not None:
            raise config.refuse(name, "qkv does not soft-cap logits")
    if config.fields.get("use_bidirectional_attention"):
        raise config.refuse("use_bidirectional_attention", "a causal language model attends to the past only")
    if config.number("partial_rotary_factor", 1.0) != 1.0:
        raise config.refuse("partial_rotary_factor", "qkv rotates every dimension of a head")
    d_model, n_heads = config.integer("hidden_size"), config.integer("num_attention_heads")
    n_kv_heads = config.integer("num_key_value_heads", n_heads)
    head_dim = config.integer("head_dim", d_model // n_heads)
    vocab_size = config.integer("vocab_size")
    max_len = config.integer("max_position_embeddings")
    n_layers = config.integer("num_hidden_layers")
    window, sliding = _sliding(config, architecture, n_layers)
    base, scaling = rope_of(config, FULL if gemma else None)
    fields = {
        "d_model": d_model,
        "n_heads": n_heads,
        "n_kv_heads": None if n_kv_heads == n_heads else n_kv_heads,
        "head_dim": None if d_model % n_heads == 0 and head_dim == d_model // n_heads else head_dim,
        "d_ff": config.integer("intermediate_size"),
        "activation": _activation(config, gemma),
        "norm": "rmsnorm",
        "norm_eps": config.number("rms_norm_eps", 1e-6),
        "norm_first": True,
        "positions": "rope",
        "max_len": max_len,
        "dropout": 0.0,
        "attention_dropout": config.number("attention_dropout", 0.0),
        **_biases(config, architecture),
        "vocab_size": vocab_size,
        "n_layers": n_layers,
        "tie_output": config.flag("tie_word_embeddings", gemma),
        "scale_embeddings": gemma,
        "rope_base": base,
        "rope_scaling": scaling,
        "pad_id": config.token_id("pad_token_id", 0 if gemma else None, vocab_size),
        "bos_id": config.token_id("bos_token_id", None, vocab_size),
        "eos_id": (stop_ids(config, vocab_size) or [None])[0],
        "sliding_window": window,
        "sliding_blocks": sliding,
    }
    if gemma:
        fields.update(_gemma_fields(config, head_dim, window))
    return fields


def _gemma_fields(config: HFConfig, head_dim: int, window: int | None) -> dict:
    """What Gemma 3 adds: per-head query/key norms, sandwich norms, its score scale and its
    sliding layers' own RoPE base (unscaled)."""
    scalar = config.number("query_pre_attn_scalar", 256)
    local_base, local_scaling = rope_of(config, SLIDING)
    if local_scaling is not None:
        raise config.refuse("rope_parameters", "Gemma 3's sliding layers rotate unscaled in qkv")
    return {
        "qk_norm": True,
        "sandwich_norm": True,
        "attention_scale": None if scalar == head_dim else scalar**-0.5,
        "local_rope_base": local_base if window is not None else None,
    }


def stop_ids(config: HFConfig, vocab_size: int) -> list[int]:
    """config.json's ``eos_token_id``: one id or a list of them (Llama 3 instruct ends turns with
    several), as a list."""
    value = config.fields.get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab_size:
            raise UserError(
                f"{config.path}: field 'eos_token_id' must be token ids in [0, {vocab_size}), got {value!r}"
            )
    return values


def _activation(config: HFConfig, gemma: bool) -> str:
    """SwiGLU (Llama's silu gate) or GEGLU with the tanh GELU (Gemma's)."""
    name = "hidden_activation" if gemma and "hidden_activation" in config.fields else "hidden_act"
    wanted = ("gelu_pytorch_tanh", "gelu_new") if gemma else ("silu", "swish")
    value = config.text(name, wanted[0])
    if value not in wanted:
        raise config.refuse(name, f"this family's gated feed-forward network is qkv's with {wanted[0]}")
    return "geglu_tanh" if gemma else "swiglu"


def _biases(config: HFConfig, architecture: str) -> dict:
    """``bias`` (every linear layer) and ``qkv_bias`` (Wq, Wk, Wv alone: Qwen2's)."""
    if architecture == "Qwen2ForCausalLM":
        return {"bias": False, "qkv_bias": True}
    attention, mlp = config.flag("attention_bias", False), config.flag("mlp_bias", False)
    if attention != mlp:
        raise config.refuse("mlp_bias", f"with attention_bias={attention}: qkv has biases everywhere or nowhere")
    return {"bias": attention, "qkv_bias": None}


def _sliding(config: HFConfig, architecture: str, n_layers: int) -> tuple[int | None, list[int] | None]:
    """The sliding window and the layers that slide (None: all), from ``layer_types`` where
    config.json has them, else each family's rule."""
    window = config.fields.get("sliding_window")
    if architecture == "LlamaForCausalLM" or (
        architecture == "Qwen2ForCausalLM" and not config.flag("use_sliding_window", False)
    ):
        window = None
    if window is None:
        return None, None
    window = config.integer("sliding_window")
    types = config.fields.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layers or not set(types) <= {SLIDING, FULL}:
            raise config.refuse("layer_types", f"give {n_layers} of {SLIDING!r} and {FULL!r}")
        layers = [i for i, t in enumerate(types) if t == SLIDING]
    elif architecture == "Qwen2ForCausalLM":  # transformers' rule: from max_window_layers on
        first = config.integer("max_window_layers", 28, minimum=0)
        layers = list(range(first, n_layers))
    elif architecture in GEMMA3:
        pattern = config.fields.get(
            "sliding_window_pattern", config.fields.get("_sliding_window_pattern", GEMMA_PATTERN)
        )
        layers = [i for i in range(n_layers) if (i + 1) % pattern]
    else:  # Mistral: every layer
        return window, None
    if not layers:
        return None, None
    return window, (None if len(layers) == n_layers else layers)


def rope_of(config: HFConfig, layer_type: str | None = None) -> tuple[float, dict | None]:
    """RoPE's base and scaling (the fields of :class:`~qkv.positions.RopeScaling`, or None) from
    ``rope_parameters`` (transformers 5), else ``rope_theta`` and ``rope_scaling``; Gemma 3's
    for ``layer_type`` (its global layers' from ``rope_theta`` and ``rope_scaling``, its local
    ones' base from ``rope_local_base_freq``)."""
    parameters = config.fields.get("rope_parameters")
    if isinstance(parameters, dict) and layer_type is not None and layer_type in parameters:
        parameters = parameters[layer_type]
    elif layer_type == SLIDING:  # Gemma 3 before rope_parameters
        return config.number("rope_local_base_freq", 10000.0), None
    if not isinstance(parameters, dict):
        theta = 1_000_000.0 if layer_type == FULL else 10000.0  # Gemma 3's global default, else everyone's
        parameters = {**(config.fields.get("rope_scaling") or {}), "rope_theta": config.number("rope_theta", theta)}
    base = parameters.get("rope_theta", 10000.0)
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind == "default":
        return float(base), None
    return float(base), _scaling(config, kind, parameters)


def _scaling(config: HFConfig, kind: str, p: dict) -> dict:
    """RopeScaling's fields from HF's scaling parameters, with transformers' defaults."""
    if kind not in ROPE_SCALINGS:
        raise config.refuse("rope_scaling", f"qkv's RoPE scalings are {', '.join(ROPE_SCALINGS)}; not {kind!r}")
    window = config.integer("max_position_embeddings")
    original = p.get("original_max_position_embeddings") or config.fields.get("original_max_position_embeddings")
    if kind == "dynamic":
        original = window  # transformers grows the base past max_position_embeddings
    factor = p.get("factor")
    if factor is None and kind == "yarn" and original:
        factor = window / original
    fields: dict = {"kind": kind, "factor": factor, "original_max_len": original or window}
    if kind == "llama3":
        if p.get("low_freq_factor") is None or p.get("high_freq_factor") is None:
            raise config.refuse("rope_scaling", "llama3 scaling needs low_freq_factor and high_freq_factor")
        fields.update(low_freq_factor=p["low_freq_factor"], high_freq_factor=p["high_freq_factor"])
    if kind == "yarn":
        fields.update(
            beta_fast=p.get("beta_fast") or 32.0,
            beta_slow=p.get("beta_slow") or 1.0,
            attention_factor=p.get("attention_factor") or _yarn_attention(factor, p),
            truncate=p.get("truncate", True),
        )
    fields = {k: v for k, v in fields.items() if v is not None}
    try:
        RopeScaling(**fields)
    except (TypeError, ValueError) as e:
        raise config.refuse("rope_scaling", str(e)) from None
    return fields


def _yarn_attention(factor: float, p: dict) -> float | None:
    """YaRN's attention factor where ``mscale`` and ``mscale_all_dim`` set it (DeepSeek's
    checkpoints); None: RopeScaling's 0.1·ln(s) + 1."""
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if not (mscale and mscale_all_dim) or factor <= 1:
        return None
    return (0.1 * mscale * math.log(factor) + 1.0) / (0.1 * mscale_all_dim * math.log(factor) + 1.0)


def llama_architecture(config: DecoderOnlyConfig) -> str:
    """The architecture a qkv RoPE model exports as when it was not imported: Gemma 3's with its
    norms, Qwen2's with biases on Wq, Wk, Wv alone, Mistral's with a window in every layer, else
    Llama's."""
    if config.sandwich_norm or config.qk_norm:
        return "Gemma3ForCausalLM"
    if config.qkv_bias and not config.bias:
        return "Qwen2ForCausalLM"
    if config.sliding_window is not None and config.sliding_blocks is None:
        return "MistralForCausalLM"
    return "LlamaForCausalLM"


def llama_config(config: DecoderOnlyConfig, architecture: str) -> dict:
    """The HF config.json of a decoder-only model that computes what ``architecture`` computes
    (else a UserError naming the field)."""
    gemma = architecture in GEMMA3
    target = architecture
    require(
        config,
        target,
        {
            "norm_first": True,
            "norm": "rmsnorm",
            "positions": "rope",
            "attention": "softmax",
            "activation": "geglu_tanh" if gemma else "swiglu",
            "scale_embeddings": gemma,
            "qk_norm": gemma,
            "sandwich_norm": gemma,
        },
    )
    if architecture == "Qwen2ForCausalLM":
        require(config, target, {"bias": False, "qkv_bias": True})
    elif config.qkv_bias not in (None, config.bias):
        raise UserError(f"cannot export as {target}: biases on Wq, Wk, Wv alone (qkv_bias) are Qwen2's")
    if architecture != "MistralForCausalLM" and not gemma and architecture != "Qwen2ForCausalLM":
        require(config, target, {"sliding_window": None})
    if not gemma and config.local_rope_base is not None:
        raise UserError(f"cannot export as {target}: local_rope_base (sliding layers' own RoPE) is Gemma 3's")
    hf = {
        "architectures": [architecture],
        "model_type": MODEL_TYPES[architecture],
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads or config.n_heads,
        "head_dim": config.head_width,
        "max_position_embeddings": config.max_len,
        "rms_norm_eps": config.norm_eps,
        "attention_dropout": config.attention_dropout,
        "tie_word_embeddings": config.tie_output,
        "bos_token_id": config.bos_id,
        "eos_token_id": config.eos_id,
        "pad_token_id": config.pad_id,
        **_hf_rope(config, gemma),
        **_hf_sliding(config, architecture),
    }
    if gemma:
        scale = config.attention_scale
        hf.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=config.head_width if scale is None else _inverse_square(scale),
            attention_bias=config.bias,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
        )
    else:
        hf["hidden_act"] = "silu"
        if architecture == "LlamaForCausalLM":
            hf.update(attention_bias=config.bias, mlp_bias=config.bias)
    return hf


def _inverse_square(scale: float) -> float:
    """query_pre_attn_scalar from its scale s = scalar^-1/2 (a whole number where it was one)."""
    scalar = scale**-2
    return round(scalar) if abs(scalar - round(scalar)) < 1e-6 * scalar else scalar


def _hf_rope(config: DecoderOnlyConfig, gemma: bool) -> dict:
    """RoPE's settings in both spellings: ``rope_theta``/``rope_scaling`` (transformers 4.x) and
    ``rope_parameters`` (5.x; by layer type for Gemma 3)."""
    scaling = None
    if config.rope_scaling is not None:
        s = config.rope_scaling
        scaling = {"rope_type": s.kind, "factor": s.factor}
        if s.kind in ("llama3", "yarn"):
            scaling["original_max_position_embeddings"] = s.original_max_len
        if s.kind == "llama3":
            scaling.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
        if s.kind == "yarn":
            scaling.update(
                beta_fast=s.beta_fast, beta_slow=s.beta_slow, attention_factor=s.attention_factor, truncate=s.truncate
            )
    parameters = {"rope_theta": config.rope_base, **(scaling or {"rope_type": "default"})}
    if not gemma:
        return {"rope_theta": config.rope_base, "rope_scaling": scaling, "rope_parameters": parameters}
    local = config.local_rope_base if config.local_rope_base is not None else config.rope_base
    return {
        "rope_theta": config.rope_base,
        "rope_local_base_freq": local,
        "rope_scaling": scaling,
        "rope_parameters": {FULL: parameters, SLIDING: {"rope_type": "default", "rope_theta": local}},
    }


def _hf_sliding(config: DecoderOnlyConfig, architecture: str) -> dict:
    """sliding_window and the layers that slide, as ``architecture`` says them."""
    window = config.sliding_window
    sliding = set(range(config.n_layers) if config.sliding_blocks is None else config.sliding_blocks)
    types = [SLIDING if window is not None and i in sliding else FULL for i in range(config.n_layers)]
    if architecture == "MistralForCausalLM":
        if window is not None and config.sliding_blocks is not None and len(sliding) != config.n_layers:
            raise UserError("cannot export as MistralForCausalLM: it slides every layer or none (sliding_blocks)")
        return {"sliding_window": window}
    if architecture == "Qwen2ForCausalLM":
        first = min(sliding) if window is not None else config.n_layers
        if window is not None and sliding != set(range(first, config.n_layers)):
            raise UserError("cannot export as Qwen2ForCausalLM: its sliding layers are the last ones (sliding_blocks)")
        return {
            "use_sliding_window": window is not None,
            "sliding_window": window,
            "max_window_layers": first,
            "layer_types": types,
        }
    if architecture in GEMMA3:
        return {"sliding_window": window or config.max_len, "layer_types": types}
    return {}


# ------------------------------------------------------------------------------ weights


def _names(config: DecoderOnlyConfig) -> list[tuple[str, str]]:
    """(qkv name, HF name) of every tensor a model of ``config`` has."""
    gemma = config.sandwich_norm
    per_block = [*ATTENTION, *FEED_FORWARD, *(GEMMA_NORMS if gemma else LLAMA_NORMS)]
    qkv_bias = config.bias if config.qkv_bias is None else config.qkv_bias
    if qkv_bias:
        per_block += [(f"self_attn.w_{x}.bias", f"self_attn.{x}_proj.bias") for x in "qkv"]
    if config.bias:  # Wo and the feed-forward network's
        per_block += [
            (m.replace("weight", "bias"), t.replace("weight", "bias")) for m, t in ATTENTION[3:] + FEED_FORWARD
        ]
    names = [("embed.token.weight", "model.embed_tokens.weight"), ("decoder.norm.weight", "model.norm.weight")]
    for i in range(config.n_layers):
        names += [(f"decoder.blocks.{i}.{mine}", f"model.layers.{i}.{theirs}") for mine, theirs in per_block]
    if not config.tie_output:
        names.append(("output.weight", "lm_head.weight"))
    return names


def _is_gemma_norm(config: DecoderOnlyConfig, name: str) -> bool:
    """Whether ``name`` (qkv's) is a norm gain Gemma stores as w where qkv's is 1 + w."""
    return config.sandwich_norm and "norm" in name and name.endswith(".weight")


def llama_to_qkv(tensors: Mapping[str, Tensor], config: DecoderOnlyConfig) -> State:
    """qkv ``decoder_only`` weights from a Llama-family checkpoint's tensors."""
    state = renamed(tensors, _names(config))
    return {name: (t + 1 if _is_gemma_norm(config, name) else t) for name, t in state.items()}


def qkv_to_llama(state: Mapping[str, Tensor], config: DecoderOnlyConfig) -> State:
    """A Llama-family checkpoint's tensors from qkv ``decoder_only`` weights."""
    shifted = {name: (t - 1 if _is_gemma_norm(config, name) else t) for name, t in state.items()}
    return renamed(shifted, [(theirs, mine) for mine, theirs in _names(config)])


# ------------------------------------------------------------------------------ tokenizer

LLAMA_ROLES = {
    "pad": ("pad_token", None),
    "bos": ("bos_token", None),
    "eos": ("eos_token", None),
    "unk": ("unk_token", None),
}


def llama_tokenizer(directory: Path, config: HFConfig) -> tuple[Tokenizer, Path] | None:
    """The checkpoint's ``tokenizer.json`` with its special tokens (``tokenizer_config.json``'s,
    else the ids of config.json), encoding as the file's post-processor says (None without the
    file)."""
    path = directory / FILE
    if not path.is_file():
        return None
    settings = TokenizerSettings(directory)
    tokenizer = load_tokenizer(path, settings, LLAMA_ROLES)
    roles = dict(tokenizer.specials)
    for role, field in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "pad_token_id")):
        value = config.fields.get(field)
        value = value[0] if isinstance(value, list) and value else value
        if roles[role] is None and isinstance(value, int) and not isinstance(value, bool):
            roles[role] = tokenizer.backend.id_to_token(value)
    # The post-processor (Llama's BEGIN) is applied where it adds tokens, as transformers does.
    backend = tokenizer.backend
    adds = backend.encode("a", add_special_tokens=True).ids != backend.encode("a", add_special_tokens=False).ids
    try:
        return Tokenizer(backend, specials=roles, add_special_tokens=adds), path
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
