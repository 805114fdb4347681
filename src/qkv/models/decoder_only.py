"""The decoder-only Transformer (GPT; Radford et al., 2018): predict the next token.

What is here: :class:`DecoderOnlyConfig` and :class:`DecoderOnly`: token embedding, N
decoder blocks without cross-attention (masked self-attention + FFN), and an LM head.
``decode`` takes and returns an explicit KV cache and accepts left-padded batches (a key
mask plus per-row positions); ``forward`` is the plain training call.

What is not here: losses (``losses.py``), sampling and search (``decoding/``).
Shapes use the legend of ``attention.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.blocks import BlockCache, BlockConfig, DecoderOutput, DecoderStack, LayerPlan, cache_length, check_fields
from qkv.layers import InputEmbedding
from qkv.positions import Rope


@dataclass(frozen=True)
class DecoderOnlyConfig(BlockConfig):
    """A decoder-only model: the per-block settings of :class:`BlockConfig` plus these.

    Attributes:
        vocab_size: vocabulary size V.
        n_layers: decoder blocks N.
        tie_output: the LM head reuses the token embedding (Press & Wolf, 2017).
        scale_embeddings: multiply embeddings by √D (initialised with std 1/√D, so tokens
            and sinusoidal positions start at the same scale).
        pad_id, bos_id, eos_id: special token ids, or None where the vocabulary has none.
        sliding_window: sliding-window attention (Mistral, Gemma 3): the layers of
            ``sliding_blocks`` attend only to the newest ``sliding_window`` positions, their
            own included (None: every layer attends to all).
        sliding_blocks: the indices of those layers (None: every layer).
        local_rope_base: RoPE's base in the sliding layers, unscaled (Gemma 3's
            ``rope_local_base_freq``; None: the same RoPE as the other layers).
    """

    vocab_size: int = 50304
    n_layers: int = 12
    tie_output: bool = True
    scale_embeddings: bool = True
    pad_id: int | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    sliding_window: int | None = None
    sliding_blocks: tuple[int, ...] | None = None
    local_rope_base: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.sliding_blocks, list):  # config.json holds a list
            object.__setattr__(self, "sliding_blocks", tuple(self.sliding_blocks))
        check_fields(self, positive_ints=("vocab_size", "n_layers"), booleans=("tie_output", "scale_embeddings"))
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary")
        if self.sliding_window is not None:
            check_fields(self, positive_ints=("sliding_window",))
        elif self.sliding_blocks is not None or self.local_rope_base is not None:
            raise ValueError("sliding_blocks and local_rope_base need a sliding_window")
        layers = self.sliding_blocks or ()
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.n_layers for i in layers):
            raise ValueError(
                f"sliding_blocks must be layer indices in [0, {self.n_layers}), got {self.sliding_blocks!r}"
            )
        if self.local_rope_base is not None and (self.positions != "rope" or not self.local_rope_base > 0):
            raise ValueError("local_rope_base must be a positive number, with positions='rope'")

    def layer_plans(self) -> list[LayerPlan]:
        """What each decoder block does apart from the shared settings: the sliding layers' window
        and, with ``local_rope_base``, their own unscaled RoPE."""
        sliding = set(range(self.n_layers) if self.sliding_blocks is None else self.sliding_blocks)
        local = Rope(self.local_rope_base) if self.local_rope_base is not None else None
        return [
            LayerPlan(self.sliding_window, local) if self.sliding_window is not None and i in sliding else LayerPlan()
            for i in range(self.n_layers)
        ]


class DecoderOnly(nn.Module):
    """Decoder-only (GPT-style) language model.

    Shapes:
        tokens: (B, T); forward returns logits (B, T, V): position t predicts token t + 1.
    """

    def __init__(self, config: DecoderOnlyConfig) -> None:
        super().__init__()
        self.config = c = config
        self.embed = InputEmbedding(
            c.vocab_size,
            c.d_model,
            positions=c.positions,
            max_len=c.max_len,
            scale=c.scale_embeddings,
            dropout=c.dropout,
        )
        self.decoder = DecoderStack(c, c.n_layers, cross_attention=False, plans=c.layer_plans())
        self.output = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_output:
            self.output.weight = self.embed.token.weight

    def decode(
        self,
        tokens: Tensor,
        *,
        key_mask: Tensor | None = None,
        positions: Tensor | None = None,
        cache: list[BlockCache] | None = None,
        need_weights: bool = False,
        only: Tensor | None = None,
    ) -> DecoderOutput:
        """Logits for the next token at every new position, with an explicit KV cache.

        ``key_mask`` marks the real tokens among the cached and new ones (left padding of
        a batch of prompts is False); ``positions`` are the new tokens' positions (default:
        continuing the cache from 0). For left-padded rows pass ``cumsum(key_mask) - 1``
        so every row counts its own positions from its first real token. With ``only`` (True
        where a prediction is wanted) the vocabulary projection runs at those positions alone: a
        prompt's decoding reads its last position's logits, and the projection of every position
        of a 256-token prompt is SmolLM2-135M's largest product (256 x 576 x 49,152).

        Shapes:
            tokens: (B, T); key_mask: (B, P + T) bool; positions: (B, T) or (T,); only: (B, T) bool.
            returns logits (B, T, V), or (N, V) with ``only`` (N = only.sum()), the cache, and
            optionally self-attention weights.
        """
        if positions is None:
            past = cache_length(cache)
            positions = torch.arange(past, past + tokens.shape[1], device=tokens.device)  # (T,)
        x = self.embed(tokens, positions)  # (B, T, D)
        x, cache, weights = self.decoder(
            x, positions=positions, key_mask=key_mask, cache=cache, need_weights=need_weights
        )  # (B, T, D)
        if only is not None:
            x = x[only]  # (N, D)
        return DecoderOutput(self.output(x), cache, weights)  # (B, T, V) or (N, V)

    def decode_row(self, tokens: Tensor, *, positions: Tensor, cache: list[BlockCache]) -> DecoderOutput:
        """:meth:`decode` of one new token per row that sees every cached position (no row is
        padded: no ``key_mask``), over preallocated caches (:class:`~qkv.kv_cache.KVBuffer`), where
        ``self.decoder.rows_ready(cache)``: the decoding step's fast path
        (:meth:`~qkv.blocks.DecoderStack.forward_row`), the same logits up to float rounding (tested).

        Shapes: tokens (B,); positions (B,). Returns logits (B, V) and the cache.
        """
        x = self.embed(tokens, positions)  # (B, D)
        x, cache = self.decoder.forward_row(x, positions=positions[:, None], cache=cache)  # (B, D)
        return DecoderOutput(self.output(x), cache, None)  # (B, V)

    def forward(self, tokens: Tensor) -> Tensor:
        """Training logits for a batch of unpadded blocks. Shapes: (B, T) -> (B, T, V)."""
        return self.decode(tokens).logits  # (B, T, V)
