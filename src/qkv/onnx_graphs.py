"""The pieces every family's ONNX export wrappers share: :class:`Graph` (a module to export, its
example inputs and dynamic axes), the stacking of the decoder blocks' caches into the tensors a
graph takes and returns (:func:`cross_cache`, :func:`block_caches`, :func:`stacked_self`), and
the example sizes and axis names the graphs use, and what the decoder steps that read an encoder's
output share (:func:`sourced_cache`, :func:`sourced_example`, :data:`SOURCED_INPUTS`).

Caches are stacked over the L decoder layers: keys and values (L, B, G, P, K) each.

What is not here: the wrappers themselves (``onnx_export.py`` for text and speech models,
``onnx_tts.py`` for text-to-speech), writing the files (``onnx_export.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.blocks import BlockCache, DecoderStack

# Example sizes: at least 2 (torch.export fixes an axis whose example size is 0 or 1) and
# different from each other, so that no two axes are taken for one.
B, S, P, T = 2, 5, 3, 2
CACHE = {1: "batch", 3: "past"}
PRESENT = {1: "batch", 3: "total"}
CROSS = {1: "batch", 3: "source"}
MEMORY = {"memory": {0: "batch", 1: "source"}, "memory_mask": {0: "batch", 1: "source"}}
ENCODER_OUTPUTS = {**MEMORY, "cross_keys": CROSS, "cross_values": CROSS}  # an encoder graph's, before any extra
# A decoder step's inputs after its first (tokens or frames) when it reads an encoder's output.
SOURCED_INPUTS = {
    "memory_mask": {0: "batch", 1: "source"},
    "past_keys": CACHE,
    "past_values": CACHE,
    "cross_keys": CROSS,
    "cross_values": CROSS,
}


@dataclass(frozen=True)
class Graph:
    """One graph to export: its module, example inputs, and the dynamic axes of each input and
    output by name ({dimension: axis name}; an axis name shared by inputs is one size).
    ``min_sizes``: an axis's least size where the model needs more than none (speech frames)."""

    name: str
    module: nn.Module
    example: tuple[Tensor, ...]
    inputs: dict[str, dict[int, str]]
    outputs: dict[str, dict[int, str]]
    min_sizes: dict[str, int]


def cross_cache(decoder: DecoderStack, memory: Tensor) -> tuple[Tensor, Tensor]:
    """Every decoder block's cross-attention keys and values of the encoder output ``memory``.

    Shapes: memory (B, S, D) -> keys, values (L, B, G, S, K).
    """
    kv = [block.cross_attn.context_cache(memory) for block in decoder.blocks]
    return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])  # (L, B, G, S, K) each


def block_caches(
    past_keys: Tensor, past_values: Tensor, cross_keys: Tensor | None = None, cross_values: Tensor | None = None
) -> list[BlockCache]:
    """The models' per-block caches from stacked ones. Shapes: (L, B, G, P, K), (L, B, G, S, K)."""
    return [
        ((past_keys[i], past_values[i]), None if cross_keys is None else (cross_keys[i], cross_values[i]))
        for i in range(past_keys.shape[0])
    ]


def stacked_self(cache: list[BlockCache]) -> tuple[Tensor, Tensor]:
    """The self-attention keys and values of every block, stacked. Shapes: (L, B, G, P + T, K) twice."""
    return torch.stack([kv[0][0] for kv in cache]), torch.stack([kv[0][1] for kv in cache])


def sourced_cache(
    rows: int, d_model: int, past_keys: Tensor, past_values: Tensor, cross_keys: Tensor, cross_values: Tensor
) -> tuple[Tensor, list[BlockCache]]:
    """What a decoder step given the cross-attention cache passes its decoder: a stand-in for the
    encoder output, and the per-block caches. The blocks read the encoder output only to project
    it, which the given cache spares: the stand-in has no positions.

    Shapes: (L, B, G, P, K) twice, (L, B, G, S, K) twice -> stand-in (B, 0, D).
    """
    standin = cross_keys.new_zeros(rows, 0, d_model)  # (B, 0, D)
    return standin, block_caches(past_keys, past_values, cross_keys, cross_values)


def sourced_example(encoder: Graph) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A decoder step's example memory_mask, past_keys (random, P positions), cross_keys and
    cross_values: ``encoder`` run on its own example. Shapes: (B, S), (L, B, G, P, K), (L, B, G, S, K) twice."""
    with torch.no_grad():
        _, memory_mask, cross_keys, cross_values, *_ = encoder.module(*encoder.example)
    layers, _, heads, _, width = cross_keys.shape
    return memory_mask, torch.randn(layers, B, heads, P, width), cross_keys, cross_values
