"""Transformer blocks and stacks, shared by the three model families.

What is here: :class:`BlockConfig` (the per-block settings every model config inherits),
:class:`EncoderBlock` (self-attention + FFN), :class:`DecoderBlock` (masked self-attention
+ optional cross-attention + FFN), and the stacks :class:`EncoderStack` and
:class:`DecoderStack`, which build masks once and end with the final norm of a pre-norm
stack. Each sub-layer is wrapped in a residual connection and a norm, either
after the residual (post-norm, Vaswani et al., 2017, section 3.1: LayerNorm(x + Sublayer(x)))
or before the sub-layer (pre-norm, Xiong et al., 2020: x + Sublayer(LayerNorm(x))). A block's
forward picks one of the two once and calls its sub-layers, ``_sa_block``, ``_ca_block`` and
``_ff_block``, as PyTorch's ``TransformerDecoderLayer`` does.

What is not here: embeddings and output heads (they belong to each model file), masks
(callers build them once per forward, ``attention.py``). Shapes use the legend of
``attention.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from qkv.attention import NORMALIZATIONS, MultiHeadAttention, causal_mask, padding_mask
from qkv.kv_cache import KVBuffer, KVCache
from qkv.layers import ACTIVATIONS, NORMS, POSITIONS, Dropout, FeedForward, make_norm
from qkv.positions import Rope, RopeScaling, alibi_bias

# The cache of one decoder block: self-attention keys/values (grow each step) and
# cross-attention keys/values (computed once from the encoder output; None without
# cross-attention).
BlockCache = tuple[KVCache | KVBuffer, KVCache | None]


class DecoderOutput(NamedTuple):
    """What a decoding step returns.

    logits: (B, T, V), or (N, V) at the positions a caller selected (``only``); cache: one
    block cache per decoder block; attention: when asked,
    one (B, H, T, S) weight tensor per decoder block (cross-attention where there is
    one, else self-attention), else None.
    """

    logits: Tensor
    cache: list[BlockCache]
    attention: list[Tensor] | None


@dataclass(frozen=True)
class BlockConfig:
    """Settings shared by every block of a model; each model config extends it.

    Attributes:
        d_model: model width D.
        n_heads: attention heads H.
        n_kv_heads: key/value heads for grouped-query attention (None: H).
        d_ff: feed-forward width F.
        activation: "relu", "gelu", "gelu_tanh" (GPT-2's tanh approximation), "silu", or the
            gated "swiglu" (Llama) and "geglu_tanh" (Gemma).
        norm: "layernorm" or "rmsnorm"; norm_eps its epsilon.
        norm_first: pre-norm (True) or post-norm (False, the original paper).
        attention: attention normalization, "softmax" or "sigmoid".
        positions: "sinusoidal", "sinusoidal_halves" (sines then cosines, Marian's layout),
            "learned", "rope", "alibi" or "none".
        max_len: longest sequence (needed by learned positions; a limit for the others).
        dropout: dropout on sub-layer outputs and embeddings.
        attention_dropout: dropout on attention weights.
        bias: biases in the linear layers.

    Options that imported checkpoints need (each default leaves a model as it was):
        head_dim: each attention head's width K (None: D // H; Gemma's heads are wider).
        qkv_bias: biases on Wq, Wk, Wv whatever ``bias`` says (Qwen2: there and nowhere
            else); None: as ``bias``.
        qk_norm: RMS-normalise each head's queries and keys before RoPE (Gemma 3).
        attention_scale: scores are Q·Kᵀ times this (None: 1/√K; Gemma: 1/√query_pre_attn_scalar).
        sandwich_norm: with pre-norm, also normalise each sub-layer's output before it is added
            to the residual stream (Gemma 2 and 3: x + Norm(Sublayer(Norm(x)))).
        rope_base: RoPE's base (HF's ``rope_theta``; Llama 3: 500000).
        rope_scaling: RoPE's scaling past the pretraining window (:class:`~qkv.positions.RopeScaling`;
            config.json holds it as an object), or None.
    """

    d_model: int = 512
    n_heads: int = 8
    n_kv_heads: int | None = None
    d_ff: int = 2048
    activation: str = "relu"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_first: bool = True
    attention: str = "softmax"
    positions: str = "sinusoidal"
    max_len: int = 512
    dropout: float = 0.1
    attention_dropout: float = 0.0
    bias: bool = True
    head_dim: int | None = None
    qkv_bias: bool | None = None
    qk_norm: bool = False
    attention_scale: float | None = None
    sandwich_norm: bool = False
    rope_base: float = 10000.0
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        try:  # config.json holds the scaling as an object
            object.__setattr__(self, "rope_scaling", RopeScaling.of(self.rope_scaling))
        except TypeError as e:
            raise ValueError(f"rope_scaling: {e}") from None
        choices = {
            "activation": ACTIVATIONS,
            "norm": NORMS,
            "attention": NORMALIZATIONS,
            "positions": POSITIONS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        check_fields(
            self,
            positive_ints=("d_model", "n_heads", "d_ff", "max_len"),
            booleans=("norm_first", "bias", "qk_norm", "sandwich_norm"),
        )
        for name in ("n_kv_heads", "head_dim"):
            if getattr(self, name) is not None:
                check_fields(self, positive_ints=(name,))
        if self.qkv_bias is not None:
            check_fields(self, booleans=("qkv_bias",))
        for name in ("norm_eps", "rope_base", "attention_scale"):
            value = getattr(self, name)
            if (value is not None or name != "attention_scale") and not _positive_number(value):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.positions == "rope" and self.head_width % 2:
            raise ValueError("positions='rope' needs an even head width (d_model // n_heads, or head_dim)")
        if self.rope_scaling is not None and self.positions != "rope":
            raise ValueError("rope_scaling needs positions='rope'")
        if self.sandwich_norm and not self.norm_first:
            raise ValueError("sandwich_norm needs pre-norm blocks (norm_first=true)")
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")

    @property
    def head_width(self) -> int:
        """Each attention head's width K."""
        return self.head_dim or self.d_model // self.n_heads

    def rope(self) -> Rope | None:
        """The RoPE of the blocks' self-attention (None: positions are not RoPE)."""
        return Rope(self.rope_base, self.rope_scaling) if self.positions == "rope" else None


def _positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def check_fields(config: object, *, positive_ints: tuple[str, ...] = (), booleans: tuple[str, ...] = ()) -> None:
    """Raise ValueError naming the first field that is not a positive int / not a bool."""
    for name in positive_ints:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for name in booleans:
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(config, name)!r}")


class LayerPlan(NamedTuple):
    """What one decoder block does apart from the config's settings: its self-attention sees
    only the newest ``window`` keys (sliding-window layers; None: all of them), and rotates
    with ``rope`` (None: the config's)."""

    window: int | None = None
    rope: Rope | None = None


def _attention(config: BlockConfig, *, rope: Rope | None, key_bias: bool) -> MultiHeadAttention:
    return MultiHeadAttention(
        config.d_model,
        config.n_heads,
        n_kv_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        normalization=config.attention,
        dropout=config.attention_dropout,
        bias=config.bias if config.qkv_bias is None else config.qkv_bias,
        key_bias=key_bias,
        output_bias=config.bias,
        rope=rope or False,
        qk_norm=config.qk_norm,
        norm_eps=config.norm_eps,
        scale=config.attention_scale,
    )


def _sandwich(config: BlockConfig) -> nn.Module | None:
    """The norm of a sub-layer's output in a sandwich-norm block (Gemma), else None."""
    return make_norm(config.norm, config.d_model, eps=config.norm_eps) if config.sandwich_norm else None


class EncoderBlock(nn.Module):
    """Self-attention over the whole sequence, then the feed-forward network.

    ``key_bias=False`` leaves the bias out of Wk (Whisper; see :class:`MultiHeadAttention`).

    Shapes:
        x: (B, S, D); mask: bool broadcastable to (B, H, S, S); bias: (1, H, S, S) or None;
        positions: (B, S) or (S,). Returns (B, S, D).
    """

    def __init__(self, config: BlockConfig, *, key_bias: bool = True) -> None:
        super().__init__()
        self.norm_first = config.norm_first
        self.self_attn = _attention(config, rope=config.rope(), key_bias=key_bias)
        self.ffn = FeedForward(config.d_model, config.d_ff, activation=config.activation, bias=config.bias)
        self.norm_1 = make_norm(config.norm, config.d_model, eps=config.norm_eps)
        self.norm_2 = make_norm(config.norm, config.d_model, eps=config.norm_eps)
        self.post_norm_1, self.post_norm_2 = _sandwich(config), _sandwich(config)
        self.dropout = Dropout(config.dropout)

    def forward(self, x: Tensor, *, mask: Tensor | None, bias: Tensor | None, positions: Tensor) -> Tensor:
        return self._residuals(x, lambda h: self._sa_block(h, mask, bias, positions))  # (B, S, D)

    def forward_rows(
        self, rows: Tensor, *, where: Tensor, shape: tuple[int, int], mask: Tensor | None, bias: Tensor | None,
        positions: Tensor,
    ) -> Tensor:  # fmt: skip
        """:meth:`forward` over a padded batch's real positions alone (``rows``, the positions
        ``where`` of the B·S in ``shape``): norms, projections, the feed-forward and the residual
        additions on the N real rows (they are position-wise), attention on the padded layout
        (:meth:`~qkv.attention.MultiHeadAttention.forward_rows`). Shapes: (N, D) -> (N, D)."""

        def sa(h: Tensor) -> Tensor:
            h = self.self_attn.forward_rows(h, where=where, shape=shape, mask=mask, bias=bias, positions=positions)
            return self.dropout(h if self.post_norm_1 is None else self.post_norm_1(h))  # (N, D)

        return self._residuals(rows, sa)  # (N, D)

    def _residuals(self, x: Tensor, sa) -> Tensor:
        """The block's two sublayers around ``sa`` (self-attention of its input) and the
        feed-forward, pre-norm or post-norm (Vaswani et al., 2017; Xiong et al., 2020), for the
        padded batch and its real rows alike. Shapes: (..., D) -> (..., D)."""
        if self.norm_first:  # pre-norm: x + Sublayer(Norm(x))
            x = x + sa(self.norm_1(x))  # (..., D)
            return x + self._ff_block(self.norm_2(x))  # (..., D)
        x = self.norm_1(x + sa(x))  # post-norm: Norm(x + Sublayer(x))
        return self.norm_2(x + self._ff_block(x))  # (..., D)

    def _sa_block(self, x: Tensor, mask: Tensor | None, bias: Tensor | None, positions: Tensor) -> Tensor:
        h, _, _ = self.self_attn(x, mask=mask, bias=bias, positions=positions)  # (B, S, D)
        return self.dropout(h if self.post_norm_1 is None else self.post_norm_1(h))

    def _ff_block(self, x: Tensor) -> Tensor:
        h = self.ffn(x)  # (B, S, D)
        return self.dropout(h if self.post_norm_2 is None else self.post_norm_2(h))


class DecoderBlock(nn.Module):
    """Masked self-attention, cross-attention to the encoder output (if any), then the FFN.

    Decoder-only models build it with ``cross_attention=False``; ``key_bias=False`` leaves the
    bias out of both attentions' Wk (Whisper); ``plan`` is what this block does apart from the
    config (a sliding window, its own RoPE: :class:`LayerPlan`).

    Shapes:
        x: (B, T, D); self_mask: bool broadcastable to (B, H, T, S_self) where S_self counts
        the cached positions too; memory: (B, S, D); memory_mask: broadcastable to
        (B, H, T, S). Returns (B, T, D), the block's new cache and, when ``need_weights``,
        the cross-attention weights (B, H, T, S) (self-attention ones without cross-attention).
    """

    def __init__(
        self, config: BlockConfig, *, cross_attention: bool, key_bias: bool = True, plan: LayerPlan | None = None
    ) -> None:
        super().__init__()
        plan = plan or LayerPlan()
        self.norm_first = config.norm_first
        self.window = plan.window
        self.self_attn = _attention(config, rope=plan.rope or config.rope(), key_bias=key_bias)
        self.cross_attn = _attention(config, rope=None, key_bias=key_bias) if cross_attention else None
        self.ffn = FeedForward(config.d_model, config.d_ff, activation=config.activation, bias=config.bias)
        self.norm_1 = make_norm(config.norm, config.d_model, eps=config.norm_eps)
        self.norm_2 = make_norm(config.norm, config.d_model, eps=config.norm_eps) if cross_attention else None
        self.norm_3 = make_norm(config.norm, config.d_model, eps=config.norm_eps)
        self.post_norm_1 = _sandwich(config)
        self.post_norm_2 = _sandwich(config) if cross_attention else None
        self.post_norm_3 = _sandwich(config)
        self.dropout = Dropout(config.dropout)

    def forward(
        self,
        x: Tensor,
        *,
        self_mask: Tensor | None,
        self_bias: Tensor | None,
        positions: Tensor,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: BlockCache | None = None,
        need_weights: bool = False,
        rotation: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, BlockCache, Tensor | None]:
        self_cache, cross_cache = cache if cache is not None else (None, None)
        if self.norm_first:  # pre-norm: x + Sublayer(Norm(x))
            h, self_cache, weights = self._sa_block(
                self.norm_1(x), self_mask, self_bias, positions, self_cache, need_weights, rotation
            )  # (B, T, D)
            x = x + h
            if self.cross_attn is not None:
                h, cross_cache, weights = self._ca_block(self.norm_2(x), memory, memory_mask, cross_cache, need_weights)
                x = x + h
            x = x + self._ff_block(self.norm_3(x))  # (B, T, D)
        else:  # post-norm: Norm(x + Sublayer(x))
            h, self_cache, weights = self._sa_block(
                x, self_mask, self_bias, positions, self_cache, need_weights, rotation
            )  # (B, T, D)
            x = self.norm_1(x + h)  # (B, T, D)
            if self.cross_attn is not None:
                h, cross_cache, weights = self._ca_block(x, memory, memory_mask, cross_cache, need_weights)
                x = self.norm_2(x + h)
            x = self.norm_3(x + self._ff_block(x))  # (B, T, D)
        return x, (self_cache, cross_cache), weights

    def forward_row(
        self, x: Tensor, cache: KVBuffer, rotation: tuple[Tensor, Tensor] | None, cross: KVCache | None = None
    ) -> tuple[Tensor, KVBuffer]:
        """:meth:`forward` of one new position per row, in eval mode (no dropout), every cached key
        in sight (:meth:`MultiHeadAttention.forward_row`) and, in a block with cross-attention,
        every source position (``cross``: its keys and values cached by an earlier call,
        :meth:`MultiHeadAttention.forward_row_cross`). Shapes: x (B, D) -> (B, D), and the grown buffer."""
        if self.norm_first:  # pre-norm: x + Sublayer(Norm(x))
            h, cache = self.self_attn.forward_row(self.norm_1(x), cache, rotation, self.window)  # (B, D)
            x = x + (h if self.post_norm_1 is None else self.post_norm_1(h))
            if cross is not None:
                x = x + self._ca_row(self.norm_2(x), cross)  # (B, D)
            h = self.ffn(self.norm_3(x))  # (B, D)
            return x + (h if self.post_norm_3 is None else self.post_norm_3(h)), cache
        h, cache = self.self_attn.forward_row(x, cache, rotation, self.window)  # post-norm: Norm(x + Sublayer(x))
        x = self.norm_1(x + h)  # (B, D)
        if cross is not None:
            x = self.norm_2(x + self._ca_row(x, cross))  # (B, D)
        return self.norm_3(x + self.ffn(x)), cache

    def _ca_row(self, x: Tensor, cross: KVCache) -> Tensor:
        """:meth:`_ca_block` of one position per row over cached keys and values, no mask, in eval
        mode. Shapes: (B, D) -> (B, D)."""
        h = self.cross_attn.forward_row_cross(x, cross)  # (B, D)
        return h if self.post_norm_2 is None else self.post_norm_2(h)

    def _sa_block(
        self,
        x: Tensor,
        mask: Tensor | None,
        bias: Tensor | None,
        positions: Tensor,
        cache: KVCache | KVBuffer | None,
        need_weights: bool,
        rotation: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, KVCache | KVBuffer, Tensor | None]:
        """Masked self-attention, its grown cache, and its weights when they are the block's
        (``need_weights`` without cross-attention). ``rotation``: RoPE's tables of ``positions``
        when the stack computed them for every block (None: the attention computes its own)."""
        h, cache, weights = self.self_attn(
            x,
            mask=mask,
            bias=bias,
            positions=positions,
            cache=cache,
            need_weights=need_weights and self.cross_attn is None,
            rotation=rotation,
        )  # (B, T, D)
        return self.dropout(h if self.post_norm_1 is None else self.post_norm_1(h)), cache, weights

    def _ca_block(
        self, x: Tensor, memory: Tensor | None, mask: Tensor | None, cache: KVCache | None, need_weights: bool
    ) -> tuple[Tensor, KVCache, Tensor | None]:
        """Cross-attention to the encoder output ``memory`` (its keys and values projected on the
        first call, then taken from ``cache``), and its weights when ``need_weights``."""
        h, cache, weights = self.cross_attn(x, context=memory, mask=mask, cache=cache, need_weights=need_weights)
        return self.dropout(h if self.post_norm_2 is None else self.post_norm_2(h)), cache, weights  # (B, T, D)

    def _ff_block(self, x: Tensor) -> Tensor:
        h = self.ffn(x)  # (B, T, D)
        return self.dropout(h if self.post_norm_3 is None else self.post_norm_3(h))


def cache_length(cache: list[BlockCache] | None) -> int:
    """Number of positions already held in a decoder stack's self-attention cache."""
    if not cache:
        return 0
    self_kv = cache[0][0]
    return self_kv.length if isinstance(self_kv, KVBuffer) else self_kv[0].shape[2]


class EncoderStack(nn.Module):
    """``n_layers`` encoder blocks over an embedded sequence; same length out as in.

    Builds the padding mask (and the ALiBi bias) once for all blocks and ends with the
    final norm of a pre-norm stack (Xiong et al., 2020), whose residual stream would
    otherwise never be normalized. ``key_bias`` goes to every block.

    ``ragged`` (decoding, where nothing reads the padding's outputs): with padding in the batch,
    every position-wise part (norms, projections, feed-forward) runs on the real positions alone
    (:meth:`EncoderBlock.forward_rows`) and the padding's outputs are zeros; the real positions'
    outputs equal the padded computation's up to float rounding (tested).

    Shapes:
        x: (B, S, D); valid: (B, S) bool, True for real tokens (None: all real);
        positions: (B, S) or (S,). Returns (B, S, D).
    """

    def __init__(self, config: BlockConfig, n_layers: int, *, key_bias: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EncoderBlock(config, key_bias=key_bias) for _ in range(n_layers))
        self.norm = _final_norm(config)
        self.alibi = config.positions == "alibi"
        self.n_heads = config.n_heads

    def forward(self, x: Tensor, *, valid: Tensor | None, positions: Tensor, ragged: bool = False) -> Tensor:
        b, s, d = x.shape
        mask = padding_mask(valid) if valid is not None else None  # (B, 1, 1, S)
        bias = alibi_bias(self.n_heads, s, s, causal=False, device=x.device) if self.alibi else None  # (1, H, S, S)
        if ragged and valid is not None and not bool(valid.all()):
            where = valid.reshape(-1).nonzero().squeeze(1)  # (N,) the real positions among the B·S
            rows = x.reshape(b * s, d).index_select(0, where)  # (N, D)
            for block in self.blocks:
                rows = block.forward_rows(rows, where=where, shape=(b, s), mask=mask, bias=bias, positions=positions)
            return x.new_zeros(b * s, d).index_copy_(0, where, self.norm(rows)).view(b, s, d)  # (B, S, D)
        for block in self.blocks:
            x = block(x, mask=mask, bias=bias, positions=positions)  # (B, S, D)
        return self.norm(x)


class DecoderStack(nn.Module):
    """``n_layers`` decoder blocks: causal self-attention (with a KV cache) and, when built with
    ``cross_attention=True``, attention to the encoder output ``memory``. ``key_bias`` goes to
    every block; ``plans`` (one :class:`LayerPlan` per block; None: none) gives blocks a
    sliding window or their own RoPE. The causal mask is built once per window.

    Shapes:
        x: (B, T, D), the new positions only; positions: (B, T) or (T,).
        key_mask: (B, P + T) bool over cached and new positions, True for real tokens
        (None: all real); memory: (B, S, D); memory_mask: (B, S) bool (None: all real).
        cache: one :data:`BlockCache` per block, holding P positions (None: P = 0).
        Returns (B, T, D), the new cache and, when ``need_weights``, one (B, H, T, S)
        weight tensor per block (cross-attention, or self-attention without it).
    """

    def __init__(
        self,
        config: BlockConfig,
        n_layers: int,
        *,
        cross_attention: bool,
        key_bias: bool = True,
        plans: Sequence[LayerPlan] | None = None,
    ) -> None:
        super().__init__()
        plans = plans or [LayerPlan()] * n_layers
        if len(plans) != n_layers:
            raise ValueError(f"{len(plans)} layer plans for {n_layers} layers")
        self.blocks = nn.ModuleList(
            DecoderBlock(config, cross_attention=cross_attention, key_bias=key_bias, plan=plan) for plan in plans
        )
        self.norm = _final_norm(config)
        self.alibi = config.positions == "alibi"
        self.n_heads = config.n_heads

    def forward(
        self,
        x: Tensor,
        *,
        positions: Tensor,
        key_mask: Tensor | None = None,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: list[BlockCache] | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, list[BlockCache], list[Tensor] | None]:
        t = x.shape[1]
        s = cache_length(cache) + t
        masks = {w: self._self_mask(t, s, w, key_mask, x.device) for w in {b.window for b in self.blocks}}
        self_bias = (
            alibi_bias(self.n_heads, t, s, causal=True, device=x.device) if self.alibi else None
        )  # (1, H, T, S_self)
        cross_mask = padding_mask(memory_mask) if memory_mask is not None else None  # (B, 1, 1, S)
        rotations = self._rotations(positions, x)
        new_cache, weights = [], []
        for i, block in enumerate(self.blocks):
            x, block_cache, w = block(
                x,
                self_mask=masks[block.window],
                self_bias=self_bias,
                positions=positions,
                memory=memory,
                memory_mask=cross_mask,
                cache=cache[i] if cache else None,
                need_weights=need_weights,
                rotation=rotations.get(block.self_attn.rope),
            )  # (B, T, D)
            new_cache.append(block_cache)
            weights.append(w)
        return self.norm(x), new_cache, (weights if need_weights else None)

    def rows_ready(self, cache: list[BlockCache] | None) -> bool:
        """Whether :meth:`forward_row` can take the next step over ``cache``: preallocated
        self-attention caches (:class:`KVBuffer`) and, in blocks with cross-attention, its keys
        and values cached with one row per row (not shared by an input's beams), eval mode, no
        gradients, no autocast, softmax attention on its fused path (not forced explicit: ``qkv
        check``), no ALiBi. Whether a source is padded the stack cannot know: its caller asks
        that. Cheap enough to ask at every step."""
        return (
            bool(cache)
            and not self.training
            and not self.alibi
            and not torch.is_grad_enabled()
            and all(
                isinstance(self_kv, KVBuffer) and _cross_ready(b, cross_kv, self_kv.k.shape[0])
                for b, (self_kv, cross_kv) in zip(self.blocks, cache, strict=True)
            )
            and not torch.is_autocast_enabled(cache[0][0].k.device.type)
            and all(_fused(b.self_attn) and (b.cross_attn is None or _fused(b.cross_attn)) for b in self.blocks)
        )

    def forward_row(self, x: Tensor, *, positions: Tensor, cache: list[BlockCache]) -> tuple[Tensor, list[BlockCache]]:
        """:meth:`forward` of one new position per row (a decoding step), as rows (B, D), that may
        see every cached position (no key mask: no row is padded) and, with cross-attention, every
        source position (no memory mask: no source is padded; its keys and values are the cache's,
        projected once by the first call), over preallocated caches, when :meth:`rows_ready` says
        so: the same outputs up to float rounding (tested), with less per-call work (no masks to
        build or pass, no weights, no dropout, one call per block and sub-layer, 2-D products). A
        one-row decoding step is bound by such work more than by arithmetic (docs/speed.md).

        Shapes: x (B, D); positions (B, 1), or (1,) for every row. Returns (B, D) and the grown cache.
        """
        rotations = self._rotations(positions, x)  # {rope: ((B, 1, 1, K), (B, 1, 1, K))}
        grown = []
        for block, (self_kv, cross_kv) in zip(self.blocks, cache, strict=True):
            x, self_kv = block.forward_row(x, self_kv, rotations.get(block.self_attn.rope), cross_kv)  # (B, D)
            grown.append((self_kv, cross_kv))
        return self.norm(x), grown

    def _rotations(self, positions: Tensor, x: Tensor) -> dict:
        """RoPE's tables of ``positions`` (:meth:`~qkv.attention.MultiHeadAttention.rotation`), once
        per RoPE among the blocks (sliding layers may have their own): every block would otherwise
        compute the same angles, 8 operators each, a tenth of a decoding step's operators in a
        30-layer model. None under autocast, where the queries' dtype is autocast's, not ``x``'s
        (each block then computes its own, as the attention does alone).

        Shapes: positions (B, T) or (T,); returns {rope: ((B, 1, T, K), (B, 1, T, K))}.
        """
        if torch.is_autocast_enabled(x.device.type):
            return {}
        owners: dict = {}
        for block in self.blocks:
            owners.setdefault(block.self_attn.rope, block.self_attn)
        return {rope: attn.rotation(positions, like=x) for rope, attn in owners.items() if rope is not None}

    @staticmethod
    def _self_mask(t: int, s: int, window: int | None, key_mask: Tensor | None, device) -> Tensor | None:
        """The self-attention mask of ``t`` new positions after ``s - t`` cached ones, for blocks
        with ``window`` (None: all keys). One new position that may see every key needs none:
        None spares each block's attention the mask work (the decoding step).

        Shapes: key_mask (B, S_self); returns (1 or B, 1, T, S_self) bool, or None.
        """
        if t == 1 and key_mask is None and (window is None or s <= window):
            return None
        mask = causal_mask(t, s, window=window, device=device)[None, None]  # (1, 1, T, S_self)
        if key_mask is not None:
            mask = mask & padding_mask(key_mask)  # (B, 1, T, S_self)
        return mask


def decode_row(
    embed: nn.Module, decoder: DecoderStack, output: nn.Module, tokens: Tensor, cache: list[BlockCache]
) -> DecoderOutput:
    """An encoder–decoder model's one-row step (its ``decode_row``: text and speech alike): one new
    token per row after ``cache``'s positions, embedded by ``embed`` (tokens, positions), through
    :meth:`DecoderStack.forward_row` (every row at the same position: no source or row is padded)
    and ``output``, the vocabulary projection.

    Shapes: tokens (N,). Returns logits (N, V) and the cache.
    """
    past = cache_length(cache)
    positions = torch.arange(past, past + 1, device=tokens.device)  # (1,): every row's
    x = embed(tokens, positions)  # (N, D)
    x, cache = decoder.forward_row(x, positions=positions, cache=cache)  # (N, D)
    return DecoderOutput(output(x), cache, None)  # (N, V)


def _fused(attention: MultiHeadAttention) -> bool:
    """Whether ``attention`` takes the fused kernel, as the one-row step always does: softmax, and
    the explicit path not forced (``qkv check`` compares the two)."""
    return attention.normalization == "softmax" and attention.path != "explicit"


def _cross_ready(block: DecoderBlock, cross_kv: KVCache | None, rows: int) -> bool:
    """Whether ``block``'s cross-attention cache suits :meth:`DecoderBlock.forward_row` for ``rows``
    rows: none in a block without cross-attention; else keys and values already projected, a row of
    them for each row (beam search's caches share an input's among its beams; its steps keep
    :meth:`DecoderBlock.forward`)."""
    if block.cross_attn is None or cross_kv is None:
        return block.cross_attn is None and cross_kv is None
    return cross_kv[0].shape[0] == rows


def _final_norm(config: BlockConfig) -> nn.Module:
    return make_norm(config.norm, config.d_model, eps=config.norm_eps) if config.norm_first else nn.Identity()
