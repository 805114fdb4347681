"""An ONNX export checked against PyTorch on real inputs (``qkv export-onnx --verify``).

What is here: :func:`real_inputs` (sentences through the model's tokenizer, ids drawn from its
vocabulary where it has none, or the log-mel features of a generated voice-like signal for a
speech model) and :func:`verify`, which reports:
  * each graph's largest absolute difference from the PyTorch wrapper it was exported from, on
    the same inputs (a decoder step twice: with an empty cache and several tokens, then one token
    after them with the cache the first returned), passing within :data:`TOLERANCE` times
    max(1, the output's largest |value|): float32 rounding grows with the numbers rounded, so
    an output of magnitude 12 (Whisper tiny.en's encoder) differs by 12 times what one of
    magnitude 1 does for the same relative error (docs/onnx.md, "Tolerance"); beside it, how far PyTorch's
    own float32 outputs are from float64 (:func:`rounding_floor`: the scale of rounding);
  * a greedy decode driven entirely through onnxruntime (:class:`~qkv.onnx_runtime.OnnxModel`)
    beside qkv's own (:func:`~qkv.decoding.greedy`), which must be equal token for token; for a
    text-to-speech model, a synthesis through onnxruntime beside ``synthesis.synthesize`` (the
    pre-net's dropout off in both): the same stop decisions (frame counts) and frames within
    the same tolerance;
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
from qkv.synthesis import synthesize
from qkv.tokenization import FILE, Vocabularies

TOLERANCE = 1e-4
SENTENCES = ("A man in a blue shirt is riding a bicycle down the street.", "Two dogs are playing in the snow.")
MAX_NEW_TOKENS = 24
MAX_FRAMES = 60  # a text-to-speech model's frames compared (its stop token may end a text sooner)


def real_inputs(source: Source) -> list:
    """Two inputs of different lengths (so the batch is padded): token id lists, or (T, M)
    feature tensors for a speech model."""
    c = source.model.config
    if source.meta["kind"] == "speech_encoder_decoder":
        return [features(voice_like(seconds, c.features.sample_rate), c.features) for seconds in (1.3, 0.7)]
    vocab = getattr(c, "src_vocab_size", None) or c.vocab_size
    window = c.max_len - 1 if source.meta["kind"] != "tts" else None  # a prompt leaves room for a new token
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
        outputs, scales = _differences(graphs[name], fp32, runs)
        report["graphs"][name] = {
            "max_abs_diff": max(outputs.values()),
            "relative_diff": max(outputs[k] / max(1.0, scales[k]) for k in outputs),
            "outputs": outputs,
            "scales": scales,
            "fp32_vs_fp64": rounding_floor(graphs[name], runs),
        }
    passed = all(g["relative_diff"] <= TOLERANCE for g in report["graphs"].values())
    if source.meta["kind"] == "tts":
        report["synthesis"] = _synthesis_pair(source, fp32, inputs)
        passed = passed and report["synthesis"]["equal"]
    elif source.meta["kind"] != "encoder_only":
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
    if kind == "tts":
        return _tts_feeds(source, session, graphs, inputs)
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


def _tts_feeds(source: Source, session: OnnxModel, graphs: dict[str, Graph], inputs: list) -> dict[str, list]:
    """A text-to-speech model's graph inputs: the texts; two decoder runs (the go frame and the
    frames qkv synthesizes for them, with drawn pre-net dropout, then the next frame with the
    cache the first returned); the post-net over the frames the first run wrote, one row padded."""
    model = source.model
    speakers = [0] * len(inputs) if model.config.n_speakers else None
    encoder = session.text_feeds(inputs, speakers)
    encoded = _torch_run(graphs["encoder"], encoder)
    said = synthesize(model, inputs, speakers=speakers, max_frames=3 * model.config.reduction, prenet_dropout=False)
    frames = np.zeros((len(inputs), 4, model.config.features.n_mels), dtype=np.float32)  # (B, 4, M)
    for i, s in enumerate(said):  # each step's last frame, as the decoder reads it; zeros after the stop
        read = model.scale(s.mel)[model.config.reduction - 1 :: model.config.reduction][:3].numpy()
        frames[i, 1 : 1 + len(read)] = read
    first = {
        "frames": frames[:, :3],
        "memory_mask": encoded["memory_mask"],
        "prenet_keep": _keep(model, len(inputs), 3),
    }
    first.update(past_keys=_empty_cache(encoded["cross_keys"]), past_values=_empty_cache(encoded["cross_values"]))
    first.update(cross_keys=encoded["cross_keys"], cross_values=encoded["cross_values"])
    stepped = _torch_run(graphs["decoder_step"], first)
    second = {**first, "frames": frames[:, 3:], "prenet_keep": _keep(model, len(inputs), 1)}
    second.update(past_keys=stepped["present_keys"], past_values=stepped["present_values"])
    feeds = {"encoder": [encoder], "decoder_step": [first, second]}
    if "postnet" in graphs:
        valid = np.ones(stepped["mel"].shape[:2], dtype=bool)  # (B, T)
        valid[-1, valid.shape[1] // 2 :] = False
        feeds["postnet"] = [{"mel": stepped["mel"], "valid": valid}]
    return feeds


def _keep(model, rows: int, steps: int) -> np.ndarray:
    """Drawn pre-net dropout multipliers. Shapes: -> (2, B, U, prenet_dim), B ``rows``, U ``steps``."""
    c, rng = model.config, np.random.default_rng(steps)
    shape = (2, rows, steps, c.prenet_dim)
    return ((rng.random(shape) >= c.prenet_dropout) / (1.0 - c.prenet_dropout)).astype(np.float32)


def _synthesis_pair(source: Source, session: OnnxModel, inputs: list) -> dict:
    """qkv's synthesis of ``inputs`` and onnxruntime's, the pre-net's dropout off in both: each
    text's frame count and whether it hit the cap (equal, or the stop decisions differ), and
    the largest difference of their frames, within :data:`TOLERANCE` of their largest |value|."""
    speakers = [0] * len(inputs) if source.model.config.n_speakers else None
    ours = synthesize(source.model, inputs, speakers=speakers, max_frames=MAX_FRAMES, prenet_dropout=False)
    theirs = session.synthesize(inputs, speakers=speakers, max_frames=MAX_FRAMES, prenet_dropout=False)
    lengths = ([len(s.mel) for s in ours], [len(mel) for mel, _ in theirs])
    capped = ([s.hit_cap for s in ours], [cap for _, cap in theirs])
    same = lengths[0] == lengths[1] and capped[0] == capped[1]
    diff = (
        max(float(np.abs(s.mel.numpy() - mel).max()) for s, (mel, _) in zip(ours, theirs, strict=True))
        if same
        else None
    )
    scale = max(float(s.mel.abs().max()) for s in ours)
    tolerance = TOLERANCE * max(1.0, scale)
    equal = same and diff <= tolerance
    return {"frames": lengths, "hit_cap": capped, "max_abs_diff": diff, "tolerance": tolerance, "equal": equal}


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


def _differences(graph: Graph, session: OnnxModel, runs: list[dict]) -> tuple[dict[str, float], dict[str, float]]:
    """Each output's largest absolute difference between PyTorch and onnxruntime over ``runs``,
    and its scale: PyTorch's largest absolute value of it (1 for a boolean mask)."""
    largest: dict[str, float] = {}
    scales: dict[str, float] = {}
    for feeds in runs:
        ours, theirs = _torch_run(graph, feeds), session.run(graph.name, feeds)
        for name, value in ours.items():
            wide = value.astype(np.float64)
            diff = float(np.abs(wide - theirs[name].astype(np.float64)).max(initial=0.0))
            largest[name] = max(largest.get(name, 0.0), diff)
            scales[name] = max(scales.get(name, 0.0), float(np.abs(wide).max(initial=0.0)))
    return largest, scales


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
