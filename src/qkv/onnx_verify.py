"""An ONNX export checked against PyTorch on real inputs (``qkv export-onnx --verify``).

What is here: :func:`real_inputs` (sentences through the model's tokenizer, ids drawn from its
vocabulary where it has none, or the log-mel features of a generated voice-like signal for a
speech model) and :func:`verify`, which reports:
  * each graph's largest absolute difference from the PyTorch wrapper it was exported from, on
    the same inputs (a decoder step twice: with an empty cache and several tokens, then one token
    after them with the cache the first returned), passing within :data:`TOLERANCE`, beside how
    far PyTorch's own float32 outputs are from float64 (:func:`rounding_floor`: the scale of
    rounding, which deep models with long inputs such as Whisper's encoder bring near 1e-4);
  * a greedy decode driven entirely through onnxruntime (:class:`~qkv.onnx_runtime.OnnxModel`)
    beside qkv's own (:func:`~qkv.decoding.greedy`), which must be equal token for token;
  * with int8 copies, their difference from the fp32 graphs and the share of greedy tokens they
    agree on: reported, never failed (quantization changes outputs by design).

What is not here: the export (``onnx_export.py``), the runtime loop (``onnx_runtime.py``).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch

from qkv.audio import features
from qkv.decoding import greedy
from qkv.hf.whisper import start_tokens
from qkv.onnx_export import Graph, Source, graphs_of
from qkv.onnx_runtime import OnnxModel, pad_ids
from qkv.tokenization import FILE, Vocabularies

TOLERANCE = 1e-4
SENTENCES = ("A man in a blue shirt is riding a bicycle down the street.", "Two dogs are playing in the snow.")
MAX_NEW_TOKENS = 24


def real_inputs(source: Source) -> list:
    """Two inputs of different lengths (so the batch is padded): token id lists, or (T, M)
    feature tensors for a speech model."""
    c = source.model.config
    if source.meta["kind"] == "speech_encoder_decoder":
        return [features(voice_like(seconds, c.features.sample_rate), c.features) for seconds in (1.3, 0.7)]
    vocab = getattr(c, "src_vocab_size", None) or c.vocab_size
    window = c.max_len - 1  # a decoder-only prompt leaves room for a new token
    if FILE in source.meta["files"]:
        tokenizer = Vocabularies.load(source.directory, files=source.meta["files"]).source
        rows = [[t for t in tokenizer.encode(text) if t < vocab] for text in SENTENCES]
    else:  # ids drawn from the vocabulary, above the special ones
        rng = np.random.default_rng(0)
        rows = [rng.integers(min(3, vocab - 1), vocab, size=n).tolist() for n in (11, 7)]
    return [row[:window] or [0] for row in rows]


def voice_like(seconds: float, rate: int) -> np.ndarray:
    """A signal with a voice's shape: a gliding fundamental with falling harmonics, syllable-rate
    loudness and a little noise. Shapes: returns (Y,) float32."""
    t = np.arange(int(seconds * rate)) / rate
    pitch = 2 * math.pi * np.cumsum(120 + 30 * np.sin(2 * math.pi * 1.5 * t)) / rate  # 90-150 Hz
    harmonics = sum(np.sin(k * pitch) / k for k in range(1, 9))
    loudness = 0.5 + 0.5 * np.sin(2 * math.pi * 4 * t) ** 2  # about four syllables a second
    noise = np.random.default_rng(0).normal(0, 0.01, t.shape)
    return (0.1 * harmonics * loudness + noise).astype(np.float32)


def verify(source: Source, out_dir, *, int8: bool = False) -> dict:
    """The export in ``out_dir`` against ``source``'s model (see the module's docstring): per-graph
    differences, the two greedy decodes, int8's drift with ``int8``, and ``passed``."""
    inputs = real_inputs(source)
    graphs = {g.name: g for g in graphs_of(source.model)}
    fp32 = OnnxModel(out_dir)
    feeds = graph_feeds(source, fp32, graphs, inputs)
    report: dict = {"tolerance": TOLERANCE, "graphs": {}}
    for name, runs in feeds.items():
        outputs = _differences(graphs[name], fp32, runs)
        floor = rounding_floor(graphs[name], runs)
        report["graphs"][name] = {"max_abs_diff": max(outputs.values()), "outputs": outputs, "fp32_vs_fp64": floor}
    passed = all(g["max_abs_diff"] <= TOLERANCE for g in report["graphs"].values())
    if source.meta["kind"] != "encoder_only":
        ours, theirs = _greedy_pair(source, fp32, inputs)
        report["greedy"] = {"qkv": ours, "onnxruntime": theirs, "equal": ours == theirs}
        passed = passed and ours == theirs
    if int8:
        report["int8"] = _int8_drift(source, out_dir, fp32, feeds, inputs, report.get("greedy"))
    report["passed"] = passed
    return report


def graph_feeds(source: Source, session: OnnxModel, graphs: dict[str, Graph], inputs: list) -> dict[str, list]:
    """Each graph's inputs (numpy, by name) for ``inputs``: one run of an encoder, two of a
    decoder step (an empty cache, then the cache the first run returned)."""
    kind = source.meta["kind"]
    if kind == "encoder_only":
        tokens, mask = pad_ids(inputs, source.model.config.pad_id, left=False)
        return {"encoder": [{"tokens": tokens, "mask": mask}]}
    if kind == "decoder_only":
        return {"decoder_step": _prompted_feeds(source, graphs["decoder_step"], inputs)}
    encoder = session.encoder_feeds(inputs)
    encoded = _torch_run(graphs["encoder"], encoder)
    tokens = _sequences(source, inputs)  # (B, L): the start and qkv's greedy tokens
    first = {
        "tokens": tokens[:, :-1],
        "memory_mask": encoded["memory_mask"],
        "past_keys": _empty_cache(encoded["cross_keys"]),
        "past_values": _empty_cache(encoded["cross_values"]),
        "cross_keys": encoded["cross_keys"],
        "cross_values": encoded["cross_values"],
    }
    stepped = _torch_run(graphs["decoder_step"], first)
    second = {**first, "tokens": tokens[:, -1:], "past_keys": stepped["present_keys"]}
    second["past_values"] = stepped["present_values"]
    return {"encoder": [encoder], "decoder_step": [first, second]}


def _prompted_feeds(source: Source, graph: Graph, inputs: list) -> list[dict]:
    c = source.model.config
    tokens, valid = pad_ids(inputs, c.pad_id or 0, left=True)  # (B, P)
    positions = np.maximum(valid.cumsum(1) - 1, 0)  # (B, P)
    layers, heads = c.n_layers, c.n_kv_heads or c.n_heads
    empty = np.zeros((layers, len(inputs), heads, 0, c.head_width), dtype=np.float32)
    first = {"tokens": tokens, "positions": positions, "key_mask": valid, "past_keys": empty, "past_values": empty}
    stepped = _torch_run(graph, first)
    following = stepped["logits"][:, -1].argmax(-1)[:, None]  # (B, 1): the greedy token
    second = {
        "tokens": following,
        "positions": valid.sum(1, keepdims=True),
        "key_mask": np.concatenate([valid, np.ones_like(valid[:, :1])], axis=1),
        "past_keys": stepped["present_keys"],
        "past_values": stepped["present_values"],
    }
    return [first, second]


def _sequences(source: Source, inputs: list) -> np.ndarray:
    """The start tokens and qkv's greedy output of each input, cut to the window (the positions a
    decoder reads) and padded with END to one length of at least 3 (so a first step feeds several
    tokens). Shapes: returns (B, L)."""
    start, window = _start(source), source.model.config.max_len
    outputs = greedy(source.model, _torch_inputs(inputs), max_new_tokens=MAX_NEW_TOKENS, prefix=start)
    rows = [((start or [source.model.config.bos_id]) + row)[:window] for row in outputs]
    length = min(window, max(3, *(len(r) for r in rows)))
    return np.array([r + [source.model.config.eos_id] * (length - len(r)) for r in rows], dtype=np.int64)


def _start(source: Source) -> list[int] | None:
    """A Whisper's start tokens (English, transcription, no timestamps); None: BEGIN alone."""
    record = source.meta.get("whisper")
    if record is None:
        return None
    return start_tokens(source.directory, language="en" if record.get("multilingual") else None)


def _torch_inputs(inputs: list) -> list:
    return [torch.as_tensor(x) if isinstance(x, np.ndarray) else x for x in inputs]


@torch.no_grad()
def _torch_run(graph: Graph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The PyTorch wrapper's outputs by name, for numpy inputs by name."""
    out = graph.module(*(torch.from_numpy(np.ascontiguousarray(feeds[name])) for name in graph.inputs))
    out = out if isinstance(out, tuple) else (out,)
    return {name: t.numpy() for name, t in zip(graph.outputs, out, strict=True)}


def _empty_cache(like: np.ndarray) -> np.ndarray:
    """A cache of no positions with ``like``'s other sizes. Shapes: (L, B, G, S, K) -> (L, B, G, 0, K)."""
    return np.zeros((*like.shape[:3], 0, like.shape[4]), dtype=np.float32)


def _differences(graph: Graph, session: OnnxModel, runs: list[dict]) -> dict[str, float]:
    """Each output's largest absolute difference between PyTorch and onnxruntime over ``runs``."""
    largest: dict[str, float] = {}
    for feeds in runs:
        ours, theirs = _torch_run(graph, feeds), session.run(graph.name, feeds)
        for name, value in ours.items():
            diff = float(np.abs(value.astype(np.float64) - theirs[name].astype(np.float64)).max(initial=0.0))
            largest[name] = max(largest.get(name, 0.0), diff)
    return largest


@torch.no_grad()
def rounding_floor(graph: Graph, runs: list[dict]) -> float:
    """How far PyTorch's own float32 outputs are from the same graph computed in float64, on
    ``runs``: the scale of rounding, beside which a difference from onnxruntime is read."""
    wide = copy.deepcopy(graph.module).double()
    largest = 0.0
    for feeds in runs:
        ours = _torch_run(graph, feeds)
        inputs = [torch.from_numpy(np.ascontiguousarray(feeds[name])) for name in graph.inputs]
        out = wide(*(t.double() if t.is_floating_point() else t for t in inputs))
        for name, value in zip(graph.outputs, out if isinstance(out, tuple) else (out,), strict=True):
            if value.is_floating_point():
                largest = max(largest, float((torch.from_numpy(ours[name]).double() - value).abs().max()))
    return largest


def _greedy_pair(source: Source, session: OnnxModel, inputs: list) -> tuple[list[list[int]], list[list[int]]]:
    """qkv's greedy outputs of ``inputs`` and onnxruntime's, from the same start."""
    start = _start(source)
    ours = greedy(source.model, _torch_inputs(inputs), max_new_tokens=MAX_NEW_TOKENS, prefix=start)
    return ours, session.greedy(inputs, max_new_tokens=MAX_NEW_TOKENS, prefix=start)


def _int8_drift(source: Source, out_dir, fp32: OnnxModel, feeds: dict[str, list], inputs: list, greedy_report) -> dict:
    """The int8 graphs beside the fp32 ones: each graph's largest difference on the same inputs
    and, for a decoding model, the share of greedy positions where their tokens agree."""
    quantized = OnnxModel(out_dir, int8=True)
    drift: dict = {"graphs": {}}
    for name, runs in feeds.items():
        largest = 0.0
        for run in runs:
            a, b = fp32.run(name, run), quantized.run(name, run)
            largest = max(largest, *(float(np.abs(a[k] - b[k]).max(initial=0.0)) for k in a if a[k].dtype != bool))
        drift["graphs"][name] = largest
    if greedy_report is not None:
        reference = greedy_report["onnxruntime"]
        theirs = quantized.greedy(inputs, max_new_tokens=MAX_NEW_TOKENS, prefix=_start(source))
        drift["greedy"] = theirs
        drift["token_agreement"] = _agreement(reference, theirs)
    return drift


def _agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    """The share of ``reference``'s positions (of the longer of each pair) holding the same token."""
    same = sum(sum(a == b for a, b in zip(r, o, strict=False)) for r, o in zip(reference, other, strict=True))
    total = sum(max(len(r), len(o)) for r, o in zip(reference, other, strict=True))
    return same / total if total else 1.0
