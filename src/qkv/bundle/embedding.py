"""The embedding job: :func:`embeddings` (each text's vector, as an :class:`Embedded`, with the
settings used and where each came from).

What is not here: pooling and the choice of settings (``qkv.embedding``), the server's
classification over the vectors (``qkv.serve``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from qkv.embedding import Choice, choose, sentence_embeddings

if TYPE_CHECKING:
    from qkv.bundle.core import Bundle


@dataclass(frozen=True)
class Embedded:
    """What :func:`embeddings` gives: ``vectors`` (N, D) float32, one row per text; ``cut``:
    how many texts were cut to the window; ``settings``: the pooling, normalization and
    window used, and which came from where (``embedding.Choice``)."""

    vectors: Tensor
    cut: int
    settings: Choice


def embeddings(
    bundle: Bundle,
    texts: Sequence[str],
    *,
    pooling: str | None = None,
    normalize: bool | None = None,
    max_len: int | None = None,
    batch_size: int = 64,
) -> Embedded:
    """Each text's vector (``embedding.sentence_embeddings``): each setting as given, else as
    the model directory records it, else qkv's (mean pooling, not normalized, the whole
    window). An empty text gives a zero row."""
    bundle.require("embed")
    chosen = choose(
        bundle.embedding, model_max_len=bundle.window, pooling=pooling, normalize=normalize, max_len=max_len
    )
    vectors, cut = sentence_embeddings(
        bundle.model,
        bundle.vocab.source,
        list(texts),
        pooling=chosen.pooling,
        normalize=chosen.normalize,
        max_len=chosen.max_len,
        batch_size=batch_size,
    )
    return Embedded(vectors, cut, chosen)
