"""The KV cache of self-attention: keys and values of the positions seen so far, and how it grows.

What is here: :data:`KVCache` (a ``(k, v)`` tuple, grown by concatenation), :class:`KVBuffer`
(a cache preallocated for a whole output and written in place, for decoding loops that never
branch) and :func:`extend_cache`, the one step that grows either.

What is not here: the attention maths and :class:`~qkv.attention.MultiHeadAttention`, which
calls :func:`extend_cache` (``attention.py``, also the shape legend these comments use), the
caches of whole blocks (``blocks.py``), reordering caches for beam search (``decoding/``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# A cache of one attention layer: keys and values of the positions seen so far,
# each (B, G, S, K). Passed in and returned explicitly; never stored on the module.
# A self-attention cache may instead be a KVBuffer (below), which grows in place.
KVCache = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class KVBuffer:
    """A self-attention KV cache with room to grow: new keys and values are written in place.

    Appending to a ``(k, v)`` tuple concatenates, which copies the whole cache every step;
    decoding a token at a time is bound by such per-step work, so a decoding loop that never
    branches (``decoding.stream``) preallocates its caches once with :meth:`holding`. An
    append writes positions ``length..`` of the buffers and returns a new ``KVBuffer`` over the
    same buffers. The old one still reads its own positions, but appending to it again would
    overwrite the new one's: that is refused (``filled`` is shared by every KVBuffer of one
    buffer). Beam search reorders rows every step and keeps tuples. Inference only (under
    ``torch.no_grad``): the in-place writes would change tensors that autograd saved, so a
    buffer holding tensors that require gradients is refused.

    Shapes:
        k, v: (B, G, capacity, K); the first ``length`` positions are filled.
    """

    k: Tensor
    v: Tensor
    length: int
    filled: list[int]  # one shared cell: how many positions of the buffers are written

    @staticmethod
    def holding(cache: KVCache, *, capacity: int) -> KVBuffer:
        """A buffer of ``capacity`` positions holding ``cache``'s keys and values."""
        k, v = cache  # (B, G, S, K) each
        _refuse_tracked(k, v)
        b, g, s, d = k.shape
        if capacity < s:
            raise ValueError(f"capacity {capacity} is below the cache's {s} positions")
        buf_k = k.new_empty(b, g, capacity, d)  # (B, G, capacity, K)
        buf_v = v.new_empty(b, g, capacity, v.shape[-1])  # (B, G, capacity, K)
        buf_k[:, :, :s] = k
        buf_v[:, :, :s] = v
        return KVBuffer(buf_k, buf_v, s, [s])

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KVBuffer]:
        """Write ``k``, ``v`` (B, G, T, K) after the filled positions; return all keys and
        values so far (views, (B, G, length + T, K)) and the grown buffer."""
        _refuse_tracked(k, v)
        if self.filled[0] != self.length:
            raise RuntimeError("this KV buffer was appended to already: continue from the KVBuffer that returned")
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV buffer full: {end} positions needed, capacity {self.k.shape[2]}")
        # narrow, not indexing: one operator each, without Python's slicing of a tuple of slices
        # (3.5 µs less a layer of a decoding step: 12.1 against 15.6 µs, one thread, contended)
        self.k.narrow(2, self.length, k.shape[2]).copy_(k)  # (B, G, T, K) written in place
        self.v.narrow(2, self.length, v.shape[2]).copy_(v)  # (B, G, T, K) written in place
        self.filled[0] = end
        grown = KVBuffer(self.k, self.v, end, self.filled)
        return self.k.narrow(2, 0, end), self.v.narrow(2, 0, end), grown  # (B, G, S, K) views


def _refuse_tracked(k: Tensor, v: Tensor) -> None:
    """A KVBuffer's in-place writes would change tensors autograd saved: inference only."""
    if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
        raise RuntimeError("a KVBuffer is for inference (torch.no_grad): its in-place writes break autograd")


def extend_cache(cache: KVCache | KVBuffer | None, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KVCache | KVBuffer]:
    """Self-attention's keys and values so far, ``cache``'s positions then the new ``k``, ``v``,
    and the cache to return: a :class:`KVBuffer` is written in place, a ``(k, v)`` tuple is
    concatenated (a copy), no cache is just the new keys and values.

    Shapes:
        cache: (B, G, P, K) twice, or a KVBuffer holding P positions; k, v: (B, G, T, K).
        returns: (B, G, P + T, K) twice, and the grown cache.
    """
    if cache is None:
        return k, v, (k, v)
    if isinstance(cache, KVBuffer):
        return cache.append(k, v)  # (B, G, P + T, K) views, written in place
    k = torch.cat([cache[0], k], dim=2)  # (B, G, P + T, K)
    v = torch.cat([cache[1], v], dim=2)  # (B, G, P + T, K)
    return k, v, (k, v)
