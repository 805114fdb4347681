"""An exported qkv model run by onnxruntime: its graphs, and greedy decoding driven through them.

What is here: :data:`MANIFEST` (the file ``qkv export-onnx`` writes beside the graphs: which
graphs, their inputs and outputs, the cache's layout and the special tokens), :func:`require`
(the optional packages, named in one line when missing) and :class:`OnnxModel`, which opens one
onnxruntime session per graph (fp32, or the int8 copies) and decodes greedily with them:
the encoder once, then one decoder step per token, its KV cache passed in and returned. The loop
is numpy alone (no PyTorch), and takes its decisions as qkv's greedy search does
(``decoding/search.py``: the same caps within the window, BEGIN or a forced prefix first, END
left out), so the two are compared token for token (``onnx_verify.py``, tests/test_onnx.py).

A text-to-speech model is run the same way by :meth:`OnnxModel.synthesize` (the text encoder
once, then decoder steps of r frames each until the stop token, then the post-net), as
``synthesis.synthesize`` runs it in PyTorch (without its attention window).

What is not here: the export (``onnx_export.py``), tokenization and feature computation (the
graphs take token ids and log-mel frames; the manifest says which features a speech model reads),
the vocoder (frames to a waveform: ``vocoder.py``).

Shapes use the legend of ``attention.py``; caches are stacked over the L decoder layers:
(L, B, G, P, K).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from qkv.errors import UserError
from qkv.files import read_json_object

MANIFEST = "onnx.json"
# The packages each side needs (import name, what pip installs); the extra "qkv[onnx]" has them all.
EXPORT_PACKAGES = (("onnx", "onnx"), ("onnxruntime", "onnxruntime"), ("onnxscript", "onnxscript"))
RUNTIME_PACKAGES = (("onnxruntime", "onnxruntime"),)


def require(packages: Sequence[tuple[str, str]]) -> None:
    """Refuse in one line (UserError) when one of ``packages`` cannot be imported, naming it."""
    for module, package in packages:
        try:
            importlib.import_module(module)
        except ImportError:
            raise UserError(
                f"ONNX export and runtime need the optional package {package}: pip install {package} "
                "(or pip install 'qkv[onnx]')"
            ) from None


def read_manifest(directory: str | Path) -> dict:
    """The manifest of an export directory (UserError when it has none)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise UserError(f"{path} is missing: {directory} is not a directory written by qkv export-onnx")
    return read_json_object(path)


class OnnxModel:
    """The graphs of an export directory in onnxruntime sessions (``int8``: the quantized copies).

    Shapes (the inputs of :meth:`greedy`): token id lists for text models; (T, M) float32 log-mel
    frames for a speech model, computed as the manifest's ``features`` say.
    """

    def __init__(self, directory: str | Path, *, int8: bool = False, threads: int | None = None) -> None:
        """``threads``: onnxruntime's threads within an operator (None: its default, every core)."""
        require(RUNTIME_PACKAGES)
        import onnxruntime

        self.directory = Path(directory)
        self.manifest = m = read_manifest(directory)
        self.kind: str = m["kind"]
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # errors only: the quantized graphs warn about shapes they cannot infer
        if threads is not None:
            options.intra_op_num_threads = threads
        self.sessions = {}
        for name, graph in m["graphs"].items():
            file = graph["int8"] if int8 else graph["file"]
            if file is None:
                raise UserError(f"{self.directory}: graph {name} has no int8 copy; export with --int8")
            self.sessions[name] = onnxruntime.InferenceSession(
                str(self.directory / file), options, providers=["CPUExecutionProvider"]
            )

    def run(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One graph's outputs by name, for its inputs by name."""
        session = self.sessions[graph]
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, feeds), strict=True))

    def greedy(self, inputs: Sequence, *, max_new_tokens: int, prefix: Sequence[int] | None = None) -> list[list[int]]:
        """The most likely token at every step, for every input, up to END (left out) or its cap.

        An encoder-decoder starts from ``prefix`` (its forced first tokens, BEGIN first; None:
        BEGIN alone); a decoder-only model continues each prompt (an empty one from BEGIN).
        """
        if self.kind in ("encoder_decoder", "speech_encoder_decoder"):
            return self._sourced_greedy(inputs, max_new_tokens, prefix)
        if self.kind == "decoder_only":
            if prefix is not None:
                raise ValueError("prefix is for encoder-decoder and speech models")
            return self._prompted_greedy(inputs, max_new_tokens)
        raise ValueError(f"a {self.kind} model does not decode")

    def encoder_feeds(self, inputs: Sequence) -> dict[str, np.ndarray]:
        """The encoder graph's inputs for a batch: right-padded token ids, or padded frames."""
        if self.kind == "speech_encoder_decoder":
            frames = [np.asarray(f, dtype=np.float32) for f in inputs]
            features = np.zeros((len(frames), max(len(f) for f in frames), frames[0].shape[1]), np.float32)
            valid = np.zeros(features.shape[:2], dtype=bool)  # (B, T)
            for i, f in enumerate(frames):
                features[i, : len(f)], valid[i, : len(f)] = f, True
            return {"features": features, "valid": valid}
        tokens, _ = pad_ids(inputs, self.manifest["special_tokens"]["pad_id"], left=False)
        return {"source": tokens}

    def _sourced_greedy(self, inputs: Sequence, max_new: int, prefix: Sequence[int] | None) -> list[list[int]]:
        special = self.manifest["special_tokens"]
        encoded = self.run("encoder", self.encoder_feeds(inputs))
        start = list(prefix) if prefix is not None else [special["bos_id"]]
        cap = min(max_new, self.manifest["window"] - len(start) + 1)  # as the PyTorch decoder caps it
        tokens = np.array([start] * len(inputs), dtype=np.int64)  # (B, L)
        past = self._empty_cache(len(inputs))
        loop = _Greedy([cap] * len(inputs), special["eos_id"])
        while True:
            out = self.run(
                "decoder_step",
                {
                    "tokens": tokens,
                    "memory_mask": encoded["memory_mask"],
                    "past_keys": past[0],
                    "past_values": past[1],
                    "cross_keys": encoded["cross_keys"],
                    "cross_values": encoded["cross_values"],
                },
            )
            if not loop.take(out["logits"][:, -1]):
                return loop.outputs
            tokens, past = loop.chosen[:, None], (out["present_keys"], out["present_values"])  # (B, 1)

    def _prompted_greedy(self, inputs: Sequence[Sequence[int]], max_new: int) -> list[list[int]]:
        special, window = self.manifest["special_tokens"], self.manifest["window"]
        if not all(inputs) and special["bos_id"] is None:
            raise ValueError("an empty prompt needs a model with a bos_id")
        caps = [max(1, min(max_new, window - max(1, len(row)) + 1)) for row in inputs]
        prompts = [list(row) or [special["bos_id"]] for row in inputs]
        tokens, valid = pad_ids(prompts, special["pad_id"] or 0, left=True)  # (B, P)
        positions = np.maximum(valid.cumsum(1) - 1, 0)  # (B, P): each row counts from its first token
        key_mask, following = valid, valid.sum(1)  # (B, P), (B,)
        past = self._empty_cache(len(inputs))
        loop = _Greedy(caps, special["eos_id"])
        while True:
            feeds = {"tokens": tokens, "positions": positions, "key_mask": key_mask}
            out = self.run("decoder_step", {**feeds, "past_keys": past[0], "past_values": past[1]})
            if not loop.take(out["logits"][:, -1]):
                return loop.outputs
            tokens, past = loop.chosen[:, None], (out["present_keys"], out["present_values"])  # (B, 1)
            # A row past its cap is still fed; clamping keeps a learned position table in range.
            positions = np.minimum(following, window - 1)[:, None]  # (B, 1)
            key_mask = np.concatenate([key_mask, np.ones((len(inputs), 1), dtype=bool)], axis=1)  # (B, P + 1)
            following = following + 1

    def synthesize(
        self,
        texts: Sequence[Sequence[int]],
        *,
        speakers: Sequence[int] | None = None,
        max_frames: int = 1000,
        stop_threshold: float = 0.5,
        prenet_dropout: bool = True,
        seed: int | None = 0,
    ) -> list[tuple[np.ndarray, bool]]:
        """A text-to-speech model's log-mel frames for each text (symbol ids, no padding), as
        ``synthesis.synthesize`` makes them: r frames a step from the go frame, the last frame
        written read next, each text ending at its first frame whose stop probability passes
        ``stop_threshold`` (or at the cap: ``max_frames``, the window), then refined by the
        post-net on its own. The pre-net's dropout draws from numpy's generator (``seed``), or
        is off (``prenet_dropout=False``: what a comparison with PyTorch's frames needs).

        Shapes: returns per text (unscaled log-mel frames (T, M), whether it hit the cap).
        """
        tts, b = self.manifest["tts"], len(texts)
        r, n_mels = tts["reduction"], tts["n_mels"]
        encoded = self.run("encoder", self.text_feeds(texts, speakers))
        steps = min(-(-max_frames // r), self.manifest["window"])
        keep = _PrenetDraws(tts["prenet_dropout"] if prenet_dropout else 0.0, tts["prenet_dim"], seed)
        frames, past = np.zeros((b, 1, n_mels), np.float32), self._empty_cache(b)  # (B, 1, M): the go frame
        written, ends = [], np.full(b, -1)  # ends (B,): frames of a text that has stopped
        for step in range(steps):
            feeds = {"frames": frames, "memory_mask": encoded["memory_mask"], "prenet_keep": keep(b)}
            feeds.update(past_keys=past[0], past_values=past[1])
            feeds.update(cross_keys=encoded["cross_keys"], cross_values=encoded["cross_values"])
            out = self.run("decoder_step", feeds)
            written.append(out["mel"])  # (B, r, M)
            ends = stop_ends(ends, out["stop"], step * r, stop_threshold)
            if (ends >= 0).all():
                break
            frames, past = out["mel"][:, -1:], (out["present_keys"], out["present_values"])  # (B, 1, M)
        mel = np.concatenate(written, axis=1)  # (B, U·r, M)
        lengths = [mel.shape[1] if end < 0 else int(end) for end in ends]
        return [(self._refined(mel[i, :n]), bool(ends[i] < 0)) for i, n in enumerate(lengths)]

    def text_feeds(self, texts: Sequence[Sequence[int]], speakers: Sequence[int] | None) -> dict[str, np.ndarray]:
        """A text-to-speech encoder's inputs: the texts right-padded, and the speakers of a model of several."""
        if not texts or not all(texts):
            raise ValueError("every text needs at least one symbol")
        if (speakers is None) != (self.manifest["tts"]["n_speakers"] == 0):
            raise ValueError("speakers are needed exactly when the model has several voices")
        feeds = {"text": pad_ids(texts, self.manifest["special_tokens"]["pad_id"], left=False)[0]}
        if speakers is not None:
            feeds["speakers"] = np.asarray(speakers, dtype=np.int64)  # (B,)
        return feeds

    def _refined(self, mel: np.ndarray) -> np.ndarray:
        """One text's frames through the post-net (if the model has one), unscaled. Shapes: (T, M) -> (T, M)."""
        tts = self.manifest["tts"]
        if tts["postnet"]:
            mel = self.run("postnet", {"mel": mel[None], "valid": np.ones((1, len(mel)), dtype=bool)})["refined"][0]
        return mel * np.float32(tts["mel_std"]) + np.float32(tts["mel_mean"])

    def _empty_cache(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of no positions yet. Shapes: (L, B, G, 0, K) twice."""
        c = self.manifest["cache"]
        empty = np.zeros((c["layers"], rows, c["kv_heads"], 0, c["head_width"]), dtype=np.float32)
        return empty, empty


class _Greedy:
    """The bookkeeping of a greedy loop: each row's tokens until END or its cap."""

    def __init__(self, caps: list[int], eos_id: int | None) -> None:
        self.caps, self.eos_id, self.step = caps, eos_id, 0
        self.outputs: list[list[int]] = [[] for _ in caps]
        self.done = [False] * len(caps)
        self.chosen = np.zeros(len(caps), dtype=np.int64)

    def take(self, logits: np.ndarray) -> bool:
        """Choose each row's most likely token (logits (B, V)); False once every row has ended."""
        self.chosen = logits.argmax(-1).astype(np.int64)  # (B,): the first of equal maxima, as torch's
        for i, token in enumerate(self.chosen.tolist()):
            if self.done[i]:
                continue
            if token == self.eos_id:
                self.done[i] = True
                continue
            self.outputs[i].append(token)
            self.done[i] = self.step + 1 >= self.caps[i]
        self.step += 1
        return not all(self.done)


class _PrenetDraws:
    """The pre-net's dropout multipliers for one step: each element 0 with probability p, else
    1 / (1 - p) (inverted dropout, as ``layers.dropout`` scales); all ones when p is 0."""

    def __init__(self, p: float, width: int, seed: int | None) -> None:
        self.p, self.width, self.rng = p, width, np.random.default_rng(seed)

    def __call__(self, rows: int) -> np.ndarray:
        shape = (2, rows, 1, self.width)  # (2, B, 1, prenet_dim): the two layers, one step
        if self.p == 0.0:
            return np.ones(shape, dtype=np.float32)
        return ((self.rng.random(shape) >= self.p) / (1.0 - self.p)).astype(np.float32)


def stop_ends(ends: np.ndarray, stop: np.ndarray, before: int, threshold: float) -> np.ndarray:
    """Each text's length once it stops: the first frame of this step's whose stop probability
    passes ``threshold``, counted after the ``before`` frames of the earlier steps; texts that
    had stopped (``ends`` >= 0) keep theirs, -1 for those still going.

    Shapes: ends (B,), stop (B, r) logits -> (B,).
    """
    stopping = 1.0 / (1.0 + np.exp(-stop.astype(np.float32))) > threshold  # (B, r)
    first = np.where(stopping.any(1), stopping.argmax(1), -1)  # (B,)
    return np.where((ends < 0) & (first >= 0), before + first + 1, ends)


def pad_ids(rows: Sequence[Sequence[int]], value: int, *, left: bool) -> tuple[np.ndarray, np.ndarray]:
    """Token lists padded into one (B, L) int64 array and its (B, L) validity mask."""
    length = max(1, max(len(r) for r in rows))
    tokens = np.full((len(rows), length), value, dtype=np.int64)
    valid = np.zeros((len(rows), length), dtype=bool)
    for i, row in enumerate(rows):
        if row:
            span = slice(length - len(row), length) if left else slice(0, len(row))
            tokens[i, span], valid[i, span] = row, True
    return tokens, valid
