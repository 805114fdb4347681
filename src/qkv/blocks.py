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

from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor, nn

from qkv.attention import (
    NORMALIZATIONS,
    KVBuffer,
    KVCache,
    MultiHeadAttention,
    alibi_bias,
    causal_mask,
    padding_mask,
)
from qkv.layers import ACTIVATIONS, NORMS, POSITIONS, Dropout, FeedForward, make_norm

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
        activation: "relu", "gelu", "gelu_tanh" (GPT-2's tanh approximation), "silu" or "swiglu".
        norm: "layernorm" or "rmsnorm"; norm_eps its epsilon.
        norm_first: pre-norm (True) or post-norm (False, the original paper).
        attention: attention normalization, "softmax" or "sigmoid".
        positions: "sinusoidal", "sinusoidal_halves" (sines then cosines, Marian's layout),
            "learned", "rope", "alibi" or "none".
        max_len: longest sequence (needed by learned positions; a limit for the others).
        dropout: dropout on sub-layer outputs and embeddings.
        attention_dropout: dropout on attention weights.
        bias: biases in the linear layers.
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

    def __post_init__(self) -> None:
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
            booleans=("norm_first", "bias"),
        )
        if self.n_kv_heads is not None:
            check_fields(self, positive_ints=("n_kv_heads",))
        if not isinstance(self.norm_eps, (int, float)) or isinstance(self.norm_eps, bool) or self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be a positive number, got {self.norm_eps!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.positions == "rope" and (self.d_model // self.n_heads) % 2:
            raise ValueError("positions='rope' needs an even head width d_model // n_heads")
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")


def check_fields(config: object, *, positive_ints: tuple[str, ...] = (), booleans: tuple[str, ...] = ()) -> None:
    """Raise ValueError naming the first field that is not a positive int / not a bool."""
    for name in positive_ints:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for name in booleans:
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(config, name)!r}")


def _attention(config: BlockConfig, *, rope: bool, key_bias: bool) -> MultiHeadAttention:
    return MultiHeadAttention(
        config.d_model,
        config.n_heads,
        n_kv_heads=config.n_kv_heads,
        normalization=config.attention,
        dropout=config.attention_dropout,
        bias=config.bias,
        key_bias=key_bias,
        rope=rope,
    )


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
        self.self_attn = _attention(config, rope=config.positions == "rope", key_bias=key_bias)
        self.ffn = FeedForward(config.d_model, config.d_ff, activation=config.activation, bias=config.bias)
        self.norm_1 = make_norm(config.norm, config.d_model, eps=config.norm_eps)
        self.norm_2 = make_norm(config.norm, config.d_model, eps=config.norm_eps)
        self.dropout = Dropout(config.dropout)

    def forward(self, x: Tensor, *, mask: Tensor | None, bias: Tensor | None, positions: Tensor) -> Tensor:
        if self.norm_first:  # pre-norm: x + Sublayer(Norm(x))
            x = x + self._sa_block(self.norm_1(x), mask, bias, positions)  # (B, S, D)
            x = x + self._ff_block(self.norm_2(x))  # (B, S, D)
        else:  # post-norm: Norm(x + Sublayer(x))
            x = self.norm_1(x + self._sa_block(x, mask, bias, positions))  # (B, S, D)
            x = self.norm_2(x + self._ff_block(x))  # (B, S, D)
        return x

    def _sa_block(self, x: Tensor, mask: Tensor | None, bias: Tensor | None, positions: Tensor) -> Tensor:
        h, _, _ = self.self_attn(x, mask=mask, bias=bias, positions=positions)  # (B, S, D)
        return self.dropout(h)

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.dropout(self.ffn(x))  # (B, S, D)


class DecoderBlock(nn.Module):
    """Masked self-attention, cross-attention to the encoder output (if any), then the FFN.

    Decoder-only models build it with ``cross_attention=False``; ``key_bias=False`` leaves the
    bias out of both attentions' Wk (Whisper).

    Shapes:
        x: (B, T, D); self_mask: bool broadcastable to (B, H, T, S_self) where S_self counts
        the cached positions too; memory: (B, S, D); memory_mask: broadcastable to
        (B, H, T, S). Returns (B, T, D), the block's new cache and, when ``need_weights``,
        the cross-attention weights (B, H, T, S) (self-attention ones without cross-attention).
    """

    def __init__(self, config: BlockConfig, *, cross_attention: bool, key_bias: bool = True) -> None:
        super().__init__()
        self.norm_first = config.norm_first
        self.self_attn = _attention(config, rope=config.positions == "rope", key_bias=key_bias)
        self.cross_attn = _attention(config, rope=False, key_bias=key_bias) if cross_attention else None
        self.ffn = FeedForward(config.d_model, config.d_ff, activation=config.activation, bias=config.bias)
        self.norm_1 = make_norm(config.norm, config.d_model, eps=config.norm_eps)
        self.norm_2 = make_norm(config.norm, config.d_model, eps=config.norm_eps) if cross_attention else None
        self.norm_3 = make_norm(config.norm, config.d_model, eps=config.norm_eps)
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
    ) -> tuple[Tensor, BlockCache, Tensor | None]:
        self_cache, cross_cache = cache if cache is not None else (None, None)
        if self.norm_first:  # pre-norm: x + Sublayer(Norm(x))
            h, self_cache, weights = self._sa_block(
                self.norm_1(x), self_mask, self_bias, positions, self_cache, need_weights
            )  # (B, T, D)
            x = x + h
            if self.cross_attn is not None:
                h, cross_cache, weights = self._ca_block(self.norm_2(x), memory, memory_mask, cross_cache, need_weights)
                x = x + h
            x = x + self._ff_block(self.norm_3(x))  # (B, T, D)
        else:  # post-norm: Norm(x + Sublayer(x))
            h, self_cache, weights = self._sa_block(x, self_mask, self_bias, positions, self_cache, need_weights)
            x = self.norm_1(x + h)  # (B, T, D)
            if self.cross_attn is not None:
                h, cross_cache, weights = self._ca_block(x, memory, memory_mask, cross_cache, need_weights)
                x = self.norm_2(x + h)
            x = self.norm_3(x + self._ff_block(x))  # (B, T, D)
        return x, (self_cache, cross_cache), weights

    def _sa_block(
        self,
        x: Tensor,
        mask: Tensor | None,
        bias: Tensor | None,
        positions: Tensor,
        cache: KVCache | KVBuffer | None,
        need_weights: bool,
    ) -> tuple[Tensor, KVCache | KVBuffer, Tensor | None]:
        """Masked self-attention, its grown cache, and its weights when they are the block's
        (``need_weights`` without cross-attention)."""
        h, cache, weights = self.self_attn(
            x,
            mask=mask,
            bias=bias,
            positions=positions,
            cache=cache,
            need_weights=need_weights and self.cross_attn is None,
        )  # (B, T, D)
        return self.dropout(h), cache, weights

    def _ca_block(
        self, x: Tensor, memory: Tensor | None, mask: Tensor | None, cache: KVCache | None, need_weights: bool
    ) -> tuple[Tensor, KVCache, Tensor | None]:
        """Cross-attention to the encoder output ``memory`` (its keys and values projected on the
        first call, then taken from ``cache``), and its weights when ``need_weights``."""
        h, cache, weights = self.cross_attn(x, context=memory, mask=mask, cache=cache, need_weights=need_weights)
        return self.dropout(h), cache, weights  # (B, T, D)

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.dropout(self.ffn(x))  # (B, T, D)


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

    def forward(self, x: Tensor, *, valid: Tensor | None, positions: Tensor) -> Tensor:
        s = x.shape[1]
        mask = padding_mask(valid) if valid is not None else None  # (B, 1, 1, S)
        bias = alibi_bias(self.n_heads, s, s, causal=False, device=x.device) if self.alibi else None  # (1, H, S, S)
        for block in self.blocks:
            x = block(x, mask=mask, bias=bias, positions=positions)  # (B, S, D)
        return self.norm(x)


class DecoderStack(nn.Module):
    """``n_layers`` decoder blocks: causal self-attention (with a KV cache) and, when built with
    ``cross_attention=True``, attention to the encoder output ``memory``. ``key_bias`` goes to
    every block.

    Shapes:
        x: (B, T, D), the new positions only; positions: (B, T) or (T,).
        key_mask: (B, P + T) bool over cached and new positions, True for real tokens
        (None: all real); memory: (B, S, D); memory_mask: (B, S) bool (None: all real).
        cache: one :data:`BlockCache` per block, holding P positions (None: P = 0).
        Returns (B, T, D), the new cache and, when ``need_weights``, one (B, H, T, S)
        weight tensor per block (cross-attention, or self-attention without it).
    """

    def __init__(self, config: BlockConfig, n_layers: int, *, cross_attention: bool, key_bias: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            DecoderBlock(config, cross_attention=cross_attention, key_bias=key_bias) for _ in range(n_layers)
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
        # One new position may see every key: its causal mask is all True, and None spares
        # each block's attention the mask work (the decoding step).
        self_mask = None
        if t > 1 or key_mask is not None:
            self_mask = causal_mask(t, s, device=x.device)[None, None]  # (1, 1, T, S_self)
        if key_mask is not None:
            self_mask = self_mask & padding_mask(key_mask)  # (B, 1, T, S_self)
        self_bias = (
            alibi_bias(self.n_heads, t, s, causal=True, device=x.device) if self.alibi else None
        )  # (1, H, T, S_self)
        cross_mask = padding_mask(memory_mask) if memory_mask is not None else None  # (B, 1, 1, S)
        new_cache, weights = [], []
        for i, block in enumerate(self.blocks):
            x, block_cache, w = block(
                x,
                self_mask=self_mask,
                self_bias=self_bias,
                positions=positions,
                memory=memory,
                memory_mask=cross_mask,
                cache=cache[i] if cache else None,
                need_weights=need_weights,
            )  # (B, T, D)
            new_cache.append(block_cache)
            weights.append(w)
        return self.norm(x), new_cache, (weights if need_weights else None)


def _final_norm(config: BlockConfig) -> nn.Module:
    return make_norm(config.norm, config.d_model, eps=config.norm_eps) if config.norm_first else nn.Identity()
