"""ONNX export of a text-to-speech model (``models/tts.py``): the graphs a runtime calls to say a text.

What is here:
  * :class:`TTSEncoderGraph`: the text's encoder output, the mask of its real symbols and every
    decoder block's cross-attention keys and values (computed once);
  * :class:`TTSStepGraph`: decoder steps with the self-attention cache as input and output: the
    frames read (the last one written, or the go frame) -> r frames written per step, their stop
    logits and the grown cache. The pre-net's dropout, which Transformer-TTS keeps on at
    inference (Li et al., 2019, section 3.4), is an input (``prenet_keep``, the multipliers
    0 or 1 / (1 - p)): a graph draws nothing, so the caller's draws (or ones: dropout off) decide;
  * :class:`PostnetGraph`: the post-net's refinement of a whole spectrogram;
  * :func:`tts_graphs` (the graphs with example inputs and dynamic axes) and :func:`tts_manifest`
    (what the synthesis loop needs beside the graphs: the reduction, the pre-net, the scaling).

The wrappers call the model's own ``encode``, ``decode`` and ``refine``: nothing is re-implemented.

What is not here: writing the files (``onnx_export.py``), the synthesis loop through onnxruntime
(``onnx_runtime.py``), the comparison with PyTorch (``onnx_verify.py``), the vocoder (Griffin-Lim
has no weights to export).

Shapes use the legend of ``attention.py``: text (B, S); frames (B, U, M), U decoder steps of r
frames each; caches (L, B, G, P, K).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.models.tts import TransformerTTS
from qkv.onnx_graphs import (
    ENCODER_OUTPUTS,
    PRESENT,
    SOURCED_INPUTS,
    B,
    Graph,
    S,
    T,
    cross_cache,
    sourced_cache,
    sourced_example,
    stacked_self,
)


class TTSEncoderGraph(nn.Module):
    """The text encoder. Shapes: text (B, S) ids padded with pad_id (and speakers (B,) for a
    model of several voices) -> memory (B, S, D), memory_mask (B, S) bool, cross_keys and
    cross_values (L, B, G, S, K)."""

    def __init__(self, model: TransformerTTS) -> None:
        super().__init__()
        self.model = model

    def forward(self, text: Tensor, speakers: Tensor | None = None) -> tuple[Tensor, ...]:
        mask = text != self.model.config.pad_id  # (B, S)
        memory = self.model.encode(text, mask, speakers)  # (B, S, D)
        return memory, mask, *cross_cache(self.model.decoder, memory)


class TTSStepGraph(nn.Module):
    """Decoder steps of a text-to-speech model: its ``decode`` with the cache and given dropout.

    Shapes: frames (B, U, M) read; memory_mask (B, S) bool; past_keys, past_values
    (L, B, G, P, K); cross_keys, cross_values (L, B, G, S, K); prenet_keep (2, B, U, prenet_dim)
    -> mel (B, U·r, M) scaled frames, stop (B, U·r) logits, present_keys and present_values
    (L, B, G, P + U, K).
    """

    def __init__(self, model: TransformerTTS) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        frames: Tensor,
        memory_mask: Tensor,
        past_keys: Tensor,
        past_values: Tensor,
        cross_keys: Tensor,
        cross_values: Tensor,
        prenet_keep: Tensor,
    ) -> tuple[Tensor, ...]:
        caches = past_keys, past_values, cross_keys, cross_values
        standin, cache = sourced_cache(frames.shape[0], self.model.config.d_model, *caches)  # (B, 0, D)
        out = self.model.decode(frames, standin, memory_valid=memory_mask, cache=cache, prenet_keep=prenet_keep)
        return out.mel, out.stop, *stacked_self(out.cache)


class PostnetGraph(nn.Module):
    """The post-net. Shapes: mel (B, T, M) scaled frames, valid (B, T) bool -> refined (B, T, M)."""

    def __init__(self, model: TransformerTTS) -> None:
        super().__init__()
        self.model = model

    def forward(self, mel: Tensor, valid: Tensor) -> Tensor:
        return self.model.refine(mel, valid)  # (B, T, M)


def tts_graphs(model: TransformerTTS) -> list[Graph]:
    """The encoder, the decoder step and (where the model has one) the post-net."""
    encoder = _encoder(model)
    graphs = [encoder, _step(model, encoder)]
    if model.postnet is not None:
        graphs.append(_postnet(model))
    return graphs


def _encoder(model: TransformerTTS) -> Graph:
    c = model.config
    text = torch.randint(0, c.vocab_size, (B, S))
    text[:, 0] = (c.pad_id + 1) % c.vocab_size  # a real symbol first: no row is all padding
    inputs = {"text": {0: "batch", 1: "source"}}
    example = (text,)
    if c.n_speakers:
        inputs["speakers"] = {0: "batch"}
        example = (text, torch.arange(B) % c.n_speakers)
    return Graph("encoder", TTSEncoderGraph(model), example, inputs, dict(ENCODER_OUTPUTS), {})


def _step(model: TransformerTTS, encoder: Graph) -> Graph:
    c = model.config
    memory_mask, past, cross_keys, cross_values = sourced_example(encoder)
    frames = torch.randn(B, T, c.features.n_mels)
    keep = torch.ones(2, B, T, c.prenet_dim)
    inputs = {"frames": {0: "batch", 1: "new"}, **SOURCED_INPUTS, "prenet_keep": {1: "batch", 2: "new"}}
    written = {0: "batch", 1: "written"}
    outputs = {"mel": written, "stop": written, "present_keys": PRESENT, "present_values": PRESENT}
    example = (frames, memory_mask, past, torch.randn_like(past), cross_keys, cross_values, keep)
    return Graph("decoder_step", TTSStepGraph(model), example, inputs, outputs, {})


def _postnet(model: TransformerTTS) -> Graph:
    mel = torch.randn(B, S, model.config.features.n_mels)
    valid = torch.ones(B, S, dtype=torch.bool)
    axes = {0: "batch", 1: "frames"}
    return Graph("postnet", PostnetGraph(model), (mel, valid), {"mel": axes, "valid": axes}, {"refined": axes}, {})


def tts_manifest(model: TransformerTTS) -> dict:
    """The manifest's ``tts`` entry: what the synthesis loop needs beside the graphs."""
    c = model.config
    return {
        "reduction": c.reduction,
        "n_mels": c.features.n_mels,
        "prenet_dim": c.prenet_dim,
        "prenet_dropout": c.prenet_dropout,
        "mel_mean": c.mel_mean,
        "mel_std": c.mel_std,
        "n_speakers": c.n_speakers,
        "postnet": model.postnet is not None,
    }
