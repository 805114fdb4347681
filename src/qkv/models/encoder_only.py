"""The encoder-only Transformer (BERT; Devlin et al., 2019): read a sequence both ways.

What is here: :class:`EncoderOnlyConfig` and :class:`EncoderOnly`: token (+ optional
token-type) embedding, optionally normalized (BERT), a stack of encoder blocks, an optional masked-LM
head (dense, GELU, norm, projection to the vocabulary) and a sequence-classification head
over the pooled first token or the mean of the real tokens, optionally through BERT's pooler
(dense + tanh).

What is not here: the 15% masking recipe and losses (``losses.py``). Shapes use the
legend of ``attention.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.blocks import BlockConfig, EncoderStack, check_fields
from qkv.layers import Dropout, InputEmbedding, make_norm

POOLINGS = ("first", "mean")


def masked_mean(h: Tensor, mask: Tensor) -> Tensor:
    """The mean of the vectors at the True positions of each row (a row with none: zeros).

    Shapes: h (B, S, D), mask (B, S) -> (B, D).
    """
    weights = mask.to(h.dtype)[..., None]  # (B, S, 1)
    return (h * weights).sum(1) / weights.sum(1).clamp(min=1.0)  # (B, D)


@dataclass(frozen=True)
class EncoderOnlyConfig(BlockConfig):
    """An encoder-only model: the per-block settings of :class:`BlockConfig` plus these.

    Attributes:
        vocab_size: vocabulary size V.
        n_layers: encoder blocks N.
        n_classes: outputs of the classification head (0: no head).
        pooling: "first" (the first token, as BERT's [CLS]) or "mean" (of real tokens).
        type_vocab_size: token types (segments A/B; 0: none).
        tie_output: the MLM projection reuses the token embedding.
        scale_embeddings: multiply embeddings by √D (initialised with std 1/√D, so tokens
            and sinusoidal positions start at the same scale).
        pad_id: padding id.
        embedding_norm: normalize the sum of token, position and type embeddings before the
            first block (BERT's embedding LayerNorm).
        pooler: pass the pooled vector through a dense layer and tanh before the classifier
            (BERT's pooler).
        mlm_head: build the masked-LM head (False: ``forward`` is refused, e.g. a model
            imported from a BERT classifier, which has no such head).
    """

    vocab_size: int = 30522
    n_layers: int = 12
    n_classes: int = 0
    pooling: str = "first"
    type_vocab_size: int = 0
    tie_output: bool = True
    scale_embeddings: bool = True
    pad_id: int = 0
    embedding_norm: bool = False
    pooler: bool = False
    mlm_head: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(
            self,
            positive_ints=("vocab_size", "n_layers"),
            booleans=("tie_output", "scale_embeddings", "embedding_norm", "pooler", "mlm_head"),
        )
        if not isinstance(self.n_classes, int) or isinstance(self.n_classes, bool) or self.n_classes < 0:
            raise ValueError(f"n_classes must be an integer >= 0, got {self.n_classes!r}")
        if not isinstance(self.type_vocab_size, int) or self.type_vocab_size < 0:
            raise ValueError(f"type_vocab_size must be an integer >= 0, got {self.type_vocab_size!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"pad_id={self.pad_id} is outside the vocabulary")


class EncoderOnly(nn.Module):
    """Encoder-only (BERT-style) model with masked-LM and classification heads.

    BERT itself is ``norm_first=False, positions="learned", scale_embeddings=False,
    embedding_norm=True, pooler=True`` (``hf.py`` converts its checkpoints).

    Shapes:
        tokens: (B, S); mask: (B, S) bool, True for real tokens (default tokens != pad);
        token_types: (B, S) or None. ``encode`` -> (B, S, D); ``forward`` (masked-LM
        logits) -> (B, S, V); ``classify`` -> (B, n_classes).
    """

    def __init__(self, config: EncoderOnlyConfig) -> None:
        super().__init__()
        self.config = c = config
        self.embed = InputEmbedding(
            c.vocab_size,
            c.d_model,
            positions=c.positions,
            max_len=c.max_len,
            scale=c.scale_embeddings,
            dropout=0.0,  # applied once in encode(), after the token types are added
        )
        self.token_type = nn.Embedding(c.type_vocab_size, c.d_model) if c.type_vocab_size else None
        self.embed_norm = make_norm(c.norm, c.d_model, eps=c.norm_eps) if c.embedding_norm else None
        self.encoder = EncoderStack(c, c.n_layers)
        # Masked-LM head as in BERT: a transform before the (tied) projection.
        self.mlm_dense: nn.Linear | None = None
        self.mlm_norm: nn.Module | None = None
        self.mlm_output: nn.Linear | None = None
        if c.mlm_head:
            self.mlm_dense = nn.Linear(c.d_model, c.d_model)
            self.mlm_norm = make_norm(c.norm, c.d_model, eps=c.norm_eps)
            self.mlm_output = nn.Linear(c.d_model, c.vocab_size)
            if c.tie_output:
                self.mlm_output.weight = self.embed.token.weight
        self.classifier = nn.Linear(c.d_model, c.n_classes) if c.n_classes else None
        self.pooler = nn.Linear(c.d_model, c.d_model) if c.pooler else None
        self.dropout = Dropout(c.dropout)

    def encode(self, tokens: Tensor, *, mask: Tensor | None = None, token_types: Tensor | None = None) -> Tensor:
        """Last hidden states. Shapes: tokens (B, S) -> (B, S, D)."""
        if mask is None:
            mask = tokens != self.config.pad_id  # (B, S)
        positions = torch.arange(tokens.shape[1], device=tokens.device)  # (S,)
        x = self.embed(tokens, positions)  # (B, S, D)
        if self.token_type is not None:
            types = token_types if token_types is not None else torch.zeros_like(tokens)
            x = x + self.token_type(types)  # (B, S, D)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = self.dropout(x)
        return self.encoder(x, valid=mask, positions=positions)  # (B, S, D)

    def forward(
        self,
        tokens: Tensor,
        *,
        mask: Tensor | None = None,
        token_types: Tensor | None = None,
        only: Tensor | None = None,
    ) -> Tensor:
        """Masked-LM logits at every position, or with ``only`` (a (B, S) bool tensor, True
        where a prediction is wanted, e.g. the masked positions) at those positions only,
        row by row, which spares the vocabulary projection everywhere else.

        Shapes: (B, S) -> (B, S, V); with ``only``: (N, V), N = only.sum().
        """
        if self.mlm_dense is None or self.mlm_norm is None or self.mlm_output is None:
            raise ValueError("this model has no masked-LM head (mlm_head=False)")
        h = self.encode(tokens, mask=mask, token_types=token_types)  # (B, S, D)
        if only is not None:
            h = h[only]  # (N, D)
        h = self.mlm_norm(torch.nn.functional.gelu(self.mlm_dense(h)))  # (B, S, D) or (N, D)
        return self.mlm_output(h)  # (B, S, V) or (N, V)

    def classify(self, tokens: Tensor, *, mask: Tensor | None = None, token_types: Tensor | None = None) -> Tensor:
        """Sequence-classification logits. Shapes: (B, S) -> (B, n_classes)."""
        if self.classifier is None:
            raise ValueError("this model has no classification head (n_classes=0)")
        if mask is None:
            mask = tokens != self.config.pad_id  # (B, S)
        h = self.encode(tokens, mask=mask, token_types=token_types)  # (B, S, D)
        if self.config.pooling == "first":
            pooled = h[:, 0]  # (B, D)
        else:
            pooled = masked_mean(h, mask)  # (B, D)
        if self.pooler is not None:
            pooled = torch.tanh(self.pooler(pooled))  # (B, D)
        return self.classifier(self.dropout(pooled))  # (B, n_classes)
