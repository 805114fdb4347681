"""The encoder–decoder Transformer (Vaswani et al., 2017): sequence in, sequence out.

What is here: :class:`EncoderDecoderConfig` and :class:`EncoderDecoder`, with
``encode(src)`` (the source read by the encoder blocks, same length out), ``decode(tgt,
memory)`` (masked self-attention over the target so far, cross-attention to the encoder
output, logits over the target vocabulary; with an explicit KV cache) and ``forward``
(both, for teacher-forced training).

What is not here: losses (``losses.py``), decoding loops that start from the BEGIN token
and stop at END (``decoding/``). Shapes use the legend of ``attention.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.blocks import (
    BlockCache,
    BlockConfig,
    DecoderOutput,
    DecoderStack,
    EncoderStack,
    cache_length,
    check_fields,
    decode_row,
)
from qkv.layers import InputEmbedding


@dataclass(frozen=True)
class EncoderDecoderConfig(BlockConfig):
    """An encoder–decoder model: the per-block settings of :class:`BlockConfig` plus these.

    Attributes:
        src_vocab_size, tgt_vocab_size: vocabulary sizes (V).
        n_encoder_layers, n_decoder_layers: blocks in each stack.
        share_embeddings: one embedding table for source and target (needs one vocabulary).
        tie_output: the output projection reuses the target embedding (Press & Wolf, 2017).
        scale_embeddings: multiply embeddings by √D (Vaswani et al., section 3.4).
        pad_id, bos_id, eos_id: padding, BEGIN and END token ids (BEGIN may be the padding
            id, as in Marian, whose decoder starts from its padding token).
        output_bias: a bias on the output projection (Marian's final_logits_bias),
            initialised to zero.
    """

    src_vocab_size: int = 8000
    tgt_vocab_size: int = 8000
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    share_embeddings: bool = False
    tie_output: bool = True
    scale_embeddings: bool = True
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    output_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(
            self,
            positive_ints=("src_vocab_size", "tgt_vocab_size", "n_encoder_layers", "n_decoder_layers"),
            booleans=("share_embeddings", "tie_output", "scale_embeddings", "output_bias"),
        )
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError("share_embeddings needs src_vocab_size == tgt_vocab_size")
        for name in ("pad_id", "bos_id", "eos_id"):
            if not 0 <= getattr(self, name) < self.tgt_vocab_size:
                raise ValueError(f"{name}={getattr(self, name)} is outside the target vocabulary")


class EncoderDecoder(nn.Module):
    """Encoder–decoder Transformer.

    Shapes:
        src: (B, S) token ids; tgt: (B, T) token ids starting with BEGIN (bos_id).
        forward returns logits (B, T, V): position t predicts tgt[t + 1].
    """

    def __init__(self, config: EncoderDecoderConfig) -> None:
        super().__init__()
        self.config = c = config
        self.src_embed = _embedding(c, c.src_vocab_size)
        self.tgt_embed = self.src_embed if c.share_embeddings else _embedding(c, c.tgt_vocab_size)
        self.encoder = EncoderStack(c, c.n_encoder_layers)
        self.decoder = DecoderStack(c, c.n_decoder_layers, cross_attention=True)
        self.output = nn.Linear(c.d_model, c.tgt_vocab_size, bias=c.output_bias)
        if self.output.bias is not None:
            nn.init.zeros_(self.output.bias)
        if c.tie_output:
            self.output.weight = self.tgt_embed.token.weight

    def encode(self, src: Tensor, *, src_mask: Tensor | None = None, ragged: bool = False) -> Tensor:
        """Read the source. ``src_mask`` (B, S) bool marks real tokens (default: src != pad).
        ``ragged`` (decoding): the padding's positions are left out of every position-wise
        product and come out as zeros (:class:`~qkv.blocks.EncoderStack`).

        Shapes: src (B, S) -> memory (B, S, D).
        """
        if src_mask is None:
            src_mask = src != self.config.pad_id
        positions = torch.arange(src.shape[1], device=src.device)  # (S,)
        x = self.src_embed(src, positions)  # (B, S, D)
        return self.encoder(x, valid=src_mask, positions=positions, ragged=ragged)  # (B, S, D)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        *,
        src_mask: Tensor | None,
        cache: list[BlockCache] | None = None,
        need_weights: bool = False,
        only: Tensor | None = None,
    ) -> DecoderOutput:
        """Predict the next target tokens from the target so far and the encoder output.

        With a ``cache`` from an earlier call, ``tgt`` holds only the new positions. Target
        padding needs no mask: it only ever follows real tokens, which the causal mask
        already keeps from seeing it. With ``only`` (True where a prediction is wanted),
        the output layer runs at those positions alone: in training, padding positions
        would cost the largest matmul of a small model and a softmax over the vocabulary
        for a loss that ignores them.

        Shapes:
            tgt: (B, T); memory: (B, S, D); src_mask: (B, S) bool (None: every source token is
            real; unlike :meth:`encode`, decode has no token ids to derive padding from).
            only: (B, T) bool or None.
            returns logits (B, T, V), or (N, V) with ``only`` (N = only.sum()), the cache,
            and optionally the cross-attention weights.
        """
        past = cache_length(cache)
        positions = torch.arange(past, past + tgt.shape[1], device=tgt.device)  # (T,)
        x = self.tgt_embed(tgt, positions)  # (B, T, D)
        x, cache, weights = self.decoder(
            x, positions=positions, memory=memory, memory_mask=src_mask, cache=cache, need_weights=need_weights
        )  # (B, T, D)
        if only is not None:
            x = x[only]  # (N, D)
        return DecoderOutput(self.output(x), cache, weights)  # (B, T, V) or (N, V)

    def decode_row(self, tokens: Tensor, *, cache: list[BlockCache]) -> DecoderOutput:
        """:meth:`decode` of one new token per row after ``cache``'s positions, over a source
        without padding (``src_mask`` None) whose cross-attention keys and values the cache holds,
        where ``self.decoder.rows_ready(cache)``: the decoding step's fast path
        (:meth:`~qkv.blocks.DecoderStack.forward_row`), the same logits up to float rounding (tested).

        Shapes: tokens (N,). Returns logits (N, V) and the cache.
        """
        return decode_row(self.tgt_embed, self.decoder, self.output, tokens, cache)  # (N, V)

    def forward(self, src: Tensor, tgt: Tensor, *, only: Tensor | None = None) -> Tensor:
        """Teacher-forced logits, at every target position or where ``only`` is True.

        Shapes: src (B, S), tgt (B, T), only (B, T) bool -> (B, T, V), or (N, V) with ``only``.
        """
        src_mask = src != self.config.pad_id  # (B, S)
        memory = self.encode(src, src_mask=src_mask)  # (B, S, D)
        return self.decode(tgt, memory, src_mask=src_mask, only=only).logits  # (B, T, V) or (N, V)


def _embedding(c: EncoderDecoderConfig, vocab_size: int) -> InputEmbedding:
    return InputEmbedding(
        vocab_size, c.d_model, positions=c.positions, max_len=c.max_len, scale=c.scale_embeddings, dropout=c.dropout
    )
