"""ONNX export of qkv models with ``torch.onnx.export``, one graph per part a runtime calls.

What is here:
  * the export wrappers: small modules whose forward takes and returns plain tensors, calling
    the models' own ``encode`` and ``decode`` (nothing is re-implemented): the encoder of an
    encoder-decoder (text or speech; Whisper is a speech model) returns its output, the mask of
    its real positions and every decoder layer's cross-attention keys and values, computed once
    (:func:`cross_cache`); a decoder step takes the new tokens and the self-attention cache and
    returns the logits and the grown cache; a decoder-only step also takes each token's position
    and the key mask (left-padded prompts); an encoder-only model exports its encoder;
  * :func:`graphs_of`: a model's graphs, each with example inputs and its dynamic axes;
  * :func:`export_onnx`: OUT_DIR with the graphs (``torch.onnx.export``'s dynamo exporter, the
    TorchScript one where dynamo fails or when asked; the manifest says which made each graph), their int8
    copies (onnxruntime's dynamic quantization) and the manifest ``onnx.json`` (graphs, inputs
    and outputs, the cache's layout, special tokens), beside the model's tokenizer files.

Caches are stacked over the L decoder layers: keys and values (L, B, G, P, K) each.

What is not here: running the graphs and greedy decoding through them (``onnx_runtime.py``), the
comparison with PyTorch (``onnx_verify.py``), the graphs' shared pieces (``onnx_graphs.py``),
text-to-speech models' wrappers (``onnx_tts.py``; :func:`graphs_of` and the manifest include them).
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from qkv import __version__
from qkv.checkpoint import Model, load_model, model_dir, read_meta
from qkv.errors import UserError
from qkv.files import atomic_directory, check_writable, write_atomic
from qkv.models.decoder_only import DecoderOnly
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.models.encoder_only import EncoderOnly
from qkv.models.speech import CONV2D_MIN_FRAMES, SpeechEncoderDecoder
from qkv.models.tts import TransformerTTS
from qkv.onnx_graphs import (
    CACHE,
    ENCODER_OUTPUTS,
    PRESENT,
    SOURCED_INPUTS,
    B,
    Graph,
    P,
    S,
    T,
    block_caches,
    cross_cache,
    sourced_cache,
    sourced_example,
    stacked_self,
)
from qkv.onnx_runtime import EXPORT_PACKAGES, MANIFEST, require
from qkv.onnx_tts import tts_graphs, tts_manifest

EXPORTERS = ("auto", "dynamo", "torchscript")
EXPORTED_KINDS = ("encoder_decoder", "speech_encoder_decoder", "decoder_only", "encoder_only", "tts")
PARAMETERS_INLINE = 2**30  # bytes of weights kept inside the .onnx file (protobuf's limit is 2 GiB)


# ------------------------------------------------------------------------------ the wrappers


class TextEncoderGraph(nn.Module):
    """An encoder-decoder's encoder. Shapes: source (B, S) ids, padded with pad_id -> memory
    (B, S, D), memory_mask (B, S) bool, cross_keys and cross_values (L, B, G, S, K)."""

    def __init__(self, model: EncoderDecoder) -> None:
        super().__init__()
        self.model = model

    def forward(self, source: Tensor) -> tuple[Tensor, ...]:
        mask = source != self.model.config.pad_id  # (B, S)
        memory = self.model.encode(source, src_mask=mask)  # (B, S, D)
        return memory, mask, *cross_cache(self.model.decoder, memory)


class SpeechEncoderGraph(nn.Module):
    """A speech model's encoder. Shapes: features (B, T, M), valid (B, T) bool -> memory (B, S, D),
    memory_mask (B, S), cross_keys and cross_values (L, B, G, S, K), and with a CTC head
    ctc_logits (B, S, V)."""

    def __init__(self, model: SpeechEncoderDecoder) -> None:
        super().__init__()
        self.model = model

    def forward(self, features: Tensor, valid: Tensor) -> tuple[Tensor, ...]:
        memory, mask = self.model.encode(features, valid)  # (B, S, D), (B, S)
        out = (memory, mask, *cross_cache(self.model.decoder, memory))
        return (*out, self.model.ctc_logits(memory)) if self.model.ctc is not None else out


class SourcedStepGraph(nn.Module):
    """One decoder step of an encoder-decoder (text or speech): the model's ``decode`` with its cache.

    Shapes: tokens (B, T); memory_mask (B, S) bool; past_keys, past_values (L, B, G, P, K);
    cross_keys, cross_values (L, B, G, S, K) -> logits (B, T, V), present_keys and
    present_values (L, B, G, P + T, K).
    """

    def __init__(self, model: EncoderDecoder | SpeechEncoderDecoder) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        tokens: Tensor,
        memory_mask: Tensor,
        past_keys: Tensor,
        past_values: Tensor,
        cross_keys: Tensor,
        cross_values: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        caches = past_keys, past_values, cross_keys, cross_values
        standin, cache = sourced_cache(tokens.shape[0], self.model.config.d_model, *caches)  # (B, 0, D)
        out = self.model.decode(tokens, standin, src_mask=memory_mask, cache=cache)
        return out.logits, *stacked_self(out.cache)


class PromptedStepGraph(nn.Module):
    """One step of a decoder-only model: ``decode`` with explicit positions and key mask.

    Shapes: tokens (B, T); positions (B, T); key_mask (B, P + T) bool, False at left padding;
    past_keys, past_values (L, B, G, P, K) -> logits (B, T, V), present_keys and present_values
    (L, B, G, P + T, K).
    """

    def __init__(self, model: DecoderOnly) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, tokens: Tensor, positions: Tensor, key_mask: Tensor, past_keys: Tensor, past_values: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        cache = block_caches(past_keys, past_values)
        out = self.model.decode(tokens, key_mask=key_mask, positions=positions, cache=cache)
        return out.logits, *stacked_self(out.cache)


class EncoderOnlyGraph(nn.Module):
    """An encoder-only model's encoder. Shapes: tokens (B, S), mask (B, S) bool -> hidden (B, S, D)."""

    def __init__(self, model: EncoderOnly) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, mask: Tensor) -> Tensor:
        return self.model.encode(tokens, mask=mask)  # (B, S, D)


# ------------------------------------------------------------------------------ the graphs


def graphs_of(model: Model) -> list[Graph]:
    """The graphs ``model`` exports to: encoder and decoder step, a decoder step, or an encoder
    (a text-to-speech model: ``onnx_tts.tts_graphs``)."""
    if isinstance(model, TransformerTTS):
        return tts_graphs(model)
    if isinstance(model, (EncoderDecoder, SpeechEncoderDecoder)):
        encoder = _speech_encoder(model) if isinstance(model, SpeechEncoderDecoder) else _text_encoder(model)
        return [encoder, _sourced_step(model, encoder)]
    if isinstance(model, DecoderOnly):
        return [_prompted_step(model)]
    if isinstance(model, EncoderOnly):
        return [_encoder_only(model)]
    raise UserError(f"ONNX export takes {', '.join(EXPORTED_KINDS)} models, not {type(model).__name__}")


def _text_encoder(model: EncoderDecoder) -> Graph:
    source = torch.randint(0, model.config.src_vocab_size, (B, S))
    outputs = dict(ENCODER_OUTPUTS)
    return Graph("encoder", TextEncoderGraph(model), (source,), {"source": {0: "batch", 1: "source"}}, outputs, {})


def _speech_encoder(model: SpeechEncoderDecoder) -> Graph:
    c = model.config
    frames = 4 * S + 3 if c.frontend == "conv2d" else 2 * S  # S encoder frames after subsampling
    features = torch.randn(B, frames, c.features.n_mels)
    valid = torch.ones(B, frames, dtype=torch.bool)
    outputs = dict(ENCODER_OUTPUTS)
    if model.ctc is not None:
        outputs["ctc_logits"] = {0: "batch", 1: "source"}
    inputs = {"features": {0: "batch", 1: "frames"}, "valid": {0: "batch", 1: "frames"}}
    least = {"frames": CONV2D_MIN_FRAMES} if c.frontend == "conv2d" else {}
    module = SpeechEncoderGraph(model)
    with torch.no_grad():  # once eagerly: what the model computes once and keeps (Whisper's position
        module(features, valid)  # rates) is then a constant of the graph, PyTorch's own values
    return Graph("encoder", module, (features, valid), inputs, outputs, least)


def _sourced_step(model: EncoderDecoder | SpeechEncoderDecoder, encoder: Graph) -> Graph:
    c = model.config
    memory_mask, past, cross_keys, cross_values = sourced_example(encoder)
    tokens = torch.randint(0, getattr(c, "tgt_vocab_size", None) or c.vocab_size, (B, T))
    inputs = {"tokens": {0: "batch", 1: "new"}, **SOURCED_INPUTS}
    outputs = {"logits": {0: "batch", 1: "new"}, "present_keys": PRESENT, "present_values": PRESENT}
    example = (tokens, memory_mask, past, torch.randn_like(past), cross_keys, cross_values)
    return Graph("decoder_step", SourcedStepGraph(model), example, inputs, outputs, {})


def _prompted_step(model: DecoderOnly) -> Graph:
    c = model.config
    past = torch.randn(c.n_layers, B, c.n_kv_heads or c.n_heads, P, c.head_width)
    tokens = torch.randint(0, c.vocab_size, (B, T))
    positions = torch.arange(P, P + T).repeat(B, 1)  # (B, T)
    key_mask = torch.ones(B, P + T, dtype=torch.bool)
    inputs = {
        "tokens": {0: "batch", 1: "new"},
        "positions": {0: "batch", 1: "new"},
        "key_mask": {0: "batch", 1: "total"},
        "past_keys": CACHE,
        "past_values": CACHE,
    }
    outputs = {"logits": {0: "batch", 1: "new"}, "present_keys": PRESENT, "present_values": PRESENT}
    example = (tokens, positions, key_mask, past, torch.randn_like(past))
    return Graph("decoder_step", PromptedStepGraph(model), example, inputs, outputs, {})


def _encoder_only(model: EncoderOnly) -> Graph:
    tokens = torch.randint(0, model.config.vocab_size, (B, S))
    mask = torch.ones(B, S, dtype=torch.bool)
    axes = {0: "batch", 1: "source"}
    return Graph(
        "encoder", EncoderOnlyGraph(model), (tokens, mask), {"tokens": axes, "mask": axes}, {"hidden": axes}, {}
    )


# ------------------------------------------------------------------------------ writing


@dataclass(frozen=True)
class Source:
    """A model directory read for export: the model (float32, evaluation mode), its config.json
    and where it is."""

    model: Model
    meta: dict
    directory: Path


def read_source(path: str | Path) -> Source:
    """The model directory (or training run) ``path``, loaded for export; a UserError for a kind
    or a setting that does not export."""
    directory = model_dir(path)
    meta = read_meta(directory)
    if meta["kind"] not in EXPORTED_KINDS:
        raise UserError(f"{directory} holds a {meta['kind']} model; ONNX export takes {', '.join(EXPORTED_KINDS)}")
    model, meta = load_model(directory, meta=meta)
    scaling = model.config.rope_scaling
    if scaling is not None and scaling.kind == "dynamic":
        raise UserError(
            f"{directory}: dynamic RoPE scaling reads how far the positions reach while it runs, which a graph cannot"
        )
    return Source(model.float().eval(), meta, directory)


def export_onnx(source: Source, out_dir: str | Path, *, int8: bool = False, exporter: str = "auto") -> dict:
    """Write OUT_DIR: the model's graphs (made by ``exporter``, see :func:`export_graph`; and their
    int8 copies with ``int8``), its tokenizer files and the manifest, which is returned. OUT_DIR must
    be new, empty or an earlier export; it is written whole or not at all."""
    require(EXPORT_PACKAGES)
    out = Path(out_dir)
    check_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)  # onnx/de_en with no onnx/ yet, as qkv train --out makes
    size = sum(p.numel() * p.element_size() for p in source.model.parameters())
    inline = size <= PARAMETERS_INLINE
    with atomic_directory(out) as tmp:
        graphs = {
            g.name: _written(g, tmp, inline=inline, int8=int8, exporter=exporter) for g in graphs_of(source.model)
        }
        for name in source.meta["files"]:  # the tokenizer's files: what reads and writes the token ids
            shutil.copyfile(source.directory / name, tmp / name)
        manifest = describe(source, graphs)
        write_atomic(tmp / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest


def check_out_dir(out: Path) -> None:
    """Refuse (UserError) an OUT_DIR that an export must not replace: anything but nothing, an
    empty directory or an earlier export; nor the working directory or one above it."""
    check_writable(out, inside=False)
    if not out.exists():
        return
    resolved, cwd = out.resolve(), Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise UserError(f"{out} is the current directory or one above it; choose another output directory")
    if not out.is_dir() or not (not any(out.iterdir()) or (out / MANIFEST).is_file()):
        raise UserError(
            f"{out} exists and is neither empty nor an earlier ONNX export; choose another output directory"
        )


def _written(graph: Graph, directory: Path, *, inline: bool, int8: bool, exporter: str) -> dict:
    """Export ``graph`` into ``directory`` (and quantize it with ``int8``); its manifest entry."""
    path = directory / f"{graph.name}.onnx"
    exporter = export_graph(graph, path, inline=inline, exporter=exporter)
    quantized = quantize(path, inline=inline).name if int8 else None
    return {"file": path.name, "int8": quantized, "exporter": exporter, **signature(path)}


def describe(source: Source, graphs: dict[str, dict]) -> dict:
    """The manifest: the graphs, what the decoding loop needs (the window, the cache's layout,
    the special tokens) and, for a speech model, the features its encoder reads."""
    c = source.model.config
    layers = getattr(c, "n_decoder_layers", None) or (c.n_layers if source.meta["kind"] == "decoder_only" else 0)
    special = {name: getattr(c, name, None) for name in ("pad_id", "bos_id", "eos_id")}
    if source.meta["kind"] == "speech_encoder_decoder":
        special["blank_id"] = c.blank
    manifest = {
        "qkv_version": __version__,
        "kind": source.meta["kind"],
        "model": str(source.directory),
        "window": c.max_len,
        "cache": {"layers": layers, "kv_heads": c.n_kv_heads or c.n_heads, "head_width": c.head_width}
        if layers
        else None,
        "special_tokens": special,
        "files": sorted(source.meta["files"]),
        "graphs": graphs,
    }
    if hasattr(c, "features"):
        manifest["features"] = c.features.to_dict()
    if isinstance(source.model, TransformerTTS):
        manifest["tts"] = tts_manifest(source.model)
    if "whisper" in source.meta:  # a Whisper's start tokens (languages, tasks, no timestamps)
        manifest["whisper"] = source.meta["whisper"]
    return manifest


def export_graph(graph: Graph, path: Path, *, inline: bool = True, exporter: str = "auto") -> str:
    """Write ``graph`` to ``path`` (its weights inside the file when ``inline``, else beside it in
    ``path.data``) with ``exporter``: "dynamo" (``torch.export``), "torchscript" (the older tracer,
    much faster to export, without grouped-query attention) or "auto" (dynamo, TorchScript where
    dynamo fails). Returns the one that made it; a UserError names each one's failure."""
    if exporter not in EXPORTERS:
        raise UserError(f"exporter must be one of {', '.join(EXPORTERS)}, got {exporter!r}")
    tried = ("dynamo", "torchscript") if exporter == "auto" else (exporter,)
    failures = []
    # The exporters leave a module in the mode it had before, and a wrapper is made in training
    # mode: left so, the TorchScript exporter would switch the model's dropout on for good.
    graph.module.eval()
    for name in tried:
        try:
            if name == "dynamo":
                _with_dynamo(graph, path, inline=inline)
            else:
                _with_torchscript(graph, path)
            return name
        except Exception as e:  # the exporters fail in many ways, each its own type: any failure is said
            failures.append(f"the {name} exporter says {_first_line(e)}")
    raise UserError(f"the {graph.name} graph cannot be exported: {'; '.join(failures)}")


def _with_dynamo(graph: Graph, path: Path, *, inline: bool) -> None:
    dims: dict[str, torch.export.Dim] = {}
    shapes = {
        name: {
            d: dims.setdefault(axis, torch.export.Dim(axis, min=graph.min_sizes.get(axis, 0)))
            for d, axis in axes.items()
        }
        for name, axes in graph.inputs.items()
    }
    with _quiet(), torch.no_grad():
        torch.onnx.export(
            graph.module,
            graph.example,
            str(path),
            dynamo=True,
            external_data=not inline,
            dynamic_shapes=shapes,
            input_names=list(graph.inputs),
            output_names=list(graph.outputs),
            verbose=False,
        )


def _with_torchscript(graph: Graph, path: Path) -> None:
    with _quiet(), torch.no_grad():
        torch.onnx.export(
            graph.module,
            graph.example,
            str(path),
            dynamo=False,
            dynamic_axes={**graph.inputs, **graph.outputs},
            input_names=list(graph.inputs),
            output_names=list(graph.outputs),
        )


class _quiet:
    """The exporters' and the quantizer's warnings and log lines (about torchvision, deprecations,
    tracing, pre-processing) kept off the terminal: the command reports what matters itself."""

    def __enter__(self) -> None:
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        warnings.simplefilter("ignore")
        self.loggers = [logging.getLogger("torch.onnx"), logging.getLogger()]  # the quantizer logs on the root
        self.levels = [logger.level for logger in self.loggers]
        for logger in self.loggers:
            logger.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        for logger, level in zip(self.loggers, self.levels, strict=True):
            logger.setLevel(level)
        self.warnings.__exit__(*exc)


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def quantize(path: Path, *, inline: bool = True) -> Path:
    """An int8 copy of the graph at ``path`` beside it (``NAME.int8.onnx``): onnxruntime's dynamic
    quantization, int8 weights and activations quantized per call (Jacob et al., 2018)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = path.with_name(path.stem + ".int8.onnx")
    with _quiet():
        quantize_dynamic(path, out, weight_type=QuantType.QInt8, use_external_data_format=not inline)
    return out


def signature(path: Path) -> dict[str, list[dict]]:
    """A written graph's inputs and outputs as the file declares them: name, element type, shape
    (a dimension's size, or its axis name where it is dynamic)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    graph = proto.graph

    def described(value) -> dict:
        tensor = value.type.tensor_type
        shape = [d.dim_param or d.dim_value for d in tensor.shape.dim]
        return {
            "name": value.name,
            "dtype": onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name,
            "shape": shape,
        }

    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    return {
        "opset": opset,
        "inputs": [described(v) for v in graph.input],
        "outputs": [described(v) for v in graph.output],
    }
