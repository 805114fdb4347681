"""Piper voices in: a Piper ``VOICE.onnx`` (+ ``VOICE.onnx.json``) read into a qkv VITS model directory.

What is here: :func:`import_piper`, which reads the ONNX graph's initializers with the ``onnx``
package and maps them onto :class:`~qkv.models.vits.Vits`, and :func:`read_voice`, the config
and weights it finds. Piper's export (``torch.onnx.export`` of VITS's ``infer``) folds weight
normalisation into plain weights, and the exporter renames some of them: a convolution whose
weight was computed (weight norm) is named ``onnx::Conv_NNNN``, the phoneme embedding takes the
name of another graph value, and the duration flow's affine step keeps exp(−logs) rather than
logs. Those are found through the node that reads them, whose name is the module's path
(``/flow/flows.0/enc/in_layers.0/Conv``). The hyper-parameters the weights do not show
(dilations, strides) are read from the nodes' attributes. The voice's ``.onnx.json`` (phoneme
map, espeak-ng voice, speakers, default scales) is copied into the directory as ``piper.json``.

What is not here: the model (``models/vits.py``), phonemes and speaking (``tasks/piper.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from qkv.checkpoint import save_model
from qkv.errors import UserError
from qkv.files import read_json_object
from qkv.models.vits import Vits, VitsConfig
from qkv.piper import VOICE_FILE

_INSTALL = "install it: pip install onnx"


def _onnx_graph(path: Path):
    try:
        import onnx
    except ImportError:
        raise UserError(f"reading a Piper voice needs the onnx package; {_INSTALL}") from None
    try:
        return onnx.load(str(path)).graph
    except Exception as e:  # onnx raises DecodeError and others for a file that is not a model
        raise UserError(f"{path} cannot be read as an ONNX model: {str(e).splitlines()[0] if str(e) else e}") from None


def _module_path(node_name: str) -> str:
    """``/flow/flows.0/enc/in_layers.0/Conv`` -> ``flow.flows.0.enc.in_layers.0``."""
    return ".".join(node_name.strip("/").split("/")[:-1])


def named_weights(graph) -> dict[str, np.ndarray]:
    """The graph's weights under the VITS module names: initializers named so already, renamed
    ones by the node that reads them (a Conv's weight and bias, an embedding's Gather), and the
    duration flow's affine log-scale from its folded exp(−logs)."""
    from onnx import numpy_helper

    arrays = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    weights = {name: a for name, a in arrays.items() if re.match(r"^(enc_p|dp|flow|dec|emb_g)\.", name)}
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name not in arrays or name in weights:
                continue
            if node.op_type in ("Conv", "ConvTranspose") and i in (1, 2):
                weights[f"{_module_path(node.name)}.{'weight' if i == 1 else 'bias'}"] = arrays[name]
            elif node.op_type == "Gather" and i == 0 and node.name.endswith("emb/Gather"):
                weights[f"{_module_path(node.name)}.weight"] = arrays[name]
            elif node.op_type == "Mul" and node.name == "/dp/flows.0/Mul" and name.endswith("Exp_output_0"):
                weights["dp.flows.0.logs"] = -np.log(arrays[name])  # the reverse step multiplies by exp(−logs)
    return weights


def _conv_attributes(graph) -> dict[str, dict[str, list[int]]]:
    """Each Conv/ConvTranspose node's integer attributes (dilations, strides, pads), by module path."""
    return {
        _module_path(n.name): {a.name: list(a.ints) for a in n.attribute}
        for n in graph.node
        if n.op_type in ("Conv", "ConvTranspose")
    }


def _count(weights: dict, pattern: str) -> int:
    return len({m.group(1) for name in weights if (m := re.match(pattern, name))})


def _text_fields(w: dict) -> dict:
    """The text encoder's and duration predictor's sizes, from their weights' shapes."""
    n_symbols, hidden = w["enc_p.emb.weight"].shape
    _, offsets, head = w["enc_p.encoder.attn_layers.0.emb_rel_k"].shape
    return {
        "n_symbols": int(n_symbols),
        "hidden": int(hidden),
        "inter_channels": int(w["enc_p.proj.weight"].shape[0] // 2),
        "filter_channels": int(w["enc_p.encoder.ffn_layers.0.conv_1.weight"].shape[0]),
        "n_heads": int(hidden // head),
        "n_layers": _count(w, r"enc_p\.encoder\.attn_layers\.(\d+)\."),
        "kernel_size": int(w["enc_p.encoder.ffn_layers.0.conv_1.weight"].shape[2]),
        "window": int((offsets - 1) // 2),
        "dp_filter_channels": int(w["dp.pre.weight"].shape[0]),
        "dp_kernel_size": int(w["dp.convs.convs_sep.0.weight"].shape[2]),
        "dp_flows": 1 + _count(w, r"dp\.flows\.(\d+)\.pre\."),  # VITS's first coupling is never exported
        "dp_bins": int((w["dp.flows.3.proj.weight"].shape[0] + 1) // 3),
    }


def _decoder_fields(w: dict, convs: dict) -> dict:
    """The latent flow's and generator's sizes: shapes from the weights, dilations and strides
    from the convolution nodes."""
    n_ups = _count(w, r"dec\.ups\.(\d+)\.")
    n_blocks = _count(w, r"dec\.resblocks\.(\d+)\.") // n_ups
    kind = "1" if "dec.resblocks.0.convs1.0.weight" in w else "2"
    name = "convs1" if kind == "1" else "convs"
    dilations = [
        [
            convs[f"dec.resblocks.{b}.{name}.{i}"]["dilations"][0]
            for i in range(_count(w, rf"dec\.resblocks\.{b}\.{name}\.(\d+)\."))
        ]
        for b in range(n_blocks)
    ]
    return {
        "flow_couplings": _count(w, r"flow\.flows\.(\d+)\.pre\."),
        "flow_layers": _count(w, r"flow\.flows\.0\.enc\.in_layers\.(\d+)\."),
        "flow_kernel_size": int(w["flow.flows.0.enc.in_layers.0.weight"].shape[2]),
        "resblock": kind,
        "resblock_kernel_sizes": [int(w[f"dec.resblocks.{b}.{name}.0.weight"].shape[2]) for b in range(n_blocks)],
        "resblock_dilation_sizes": dilations,
        "upsample_rates": [convs[f"dec.ups.{i}"]["strides"][0] for i in range(n_ups)],
        "upsample_kernel_sizes": [int(w[f"dec.ups.{i}.weight"].shape[2]) for i in range(n_ups)],
        "upsample_initial_channel": int(w["dec.conv_pre.weight"].shape[0]),
    }


def _voice_fields(voice: dict, w: dict) -> dict:
    """What the .onnx.json says: the sample rate, speakers and default scales."""
    inference = voice.get("inference") or {}
    return {
        "n_speakers": int(voice.get("num_speakers", 1)),
        "speaker_channels": int(w["emb_g.weight"].shape[1]) if "emb_g.weight" in w else 0,
        "sample_rate": int((voice.get("audio") or {}).get("sample_rate", 22050)),
        "noise_scale": float(inference.get("noise_scale", 0.667)),
        "length_scale": float(inference.get("length_scale", 1.0)),
        "noise_w": float(inference.get("noise_w", 0.8)),
    }


def read_voice(onnx_path: str | Path) -> tuple[Vits, dict, list[str]]:
    """The voice in ``onnx_path`` (its ``.onnx.json`` beside it) as a :class:`Vits` with its
    weights, the .onnx.json's contents, and the initializers that are no weight (exported
    constants, named for the report)."""
    onnx_path = Path(onnx_path)
    json_path = onnx_path.with_name(onnx_path.name + ".json")
    if not onnx_path.is_file():
        raise UserError(f"{onnx_path} is not a file")
    if not json_path.is_file():
        raise UserError(f"{json_path} is missing: a Piper voice is VOICE.onnx with VOICE.onnx.json beside it")
    voice = read_json_object(json_path)
    if voice.get("phoneme_type", "espeak") != "espeak":
        raise UserError(f"{json_path}: phoneme_type {voice.get('phoneme_type')!r}; qkv speaks espeak-ng voices only")
    graph = _onnx_graph(onnx_path)
    w = named_weights(graph)
    needed = ("enc_p.emb.weight", "dp.flows.3.proj.weight", "dec.conv_pre.weight")
    if any(n not in w for n in needed):
        missing = ", ".join(n for n in needed if n not in w)
        raise UserError(f"{onnx_path} is not a Piper VITS voice qkv reads (no {missing})")
    fields = {**_text_fields(w), **_decoder_fields(w, _conv_attributes(graph)), **_voice_fields(voice, w)}
    try:
        model = Vits(VitsConfig(**fields))
    except ValueError as e:
        raise UserError(f"{onnx_path}: {e}") from None
    state = model.state_dict()
    missing = sorted(set(state) - set(w))
    if missing:
        raise UserError(f"{onnx_path}: no weights for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    for name, target in state.items():
        if tuple(w[name].shape) != tuple(target.shape):
            raise UserError(
                f"{onnx_path}: {name} has shape {tuple(w[name].shape)}, the model needs {tuple(target.shape)}"
            )
    model.load_state_dict({name: torch.from_numpy(np.array(w[name], dtype=np.float32)) for name in state})
    return model.eval(), voice, sorted(set(w) - set(state))


def import_piper(src: str | Path, dst: str | Path) -> dict:
    """Write the Piper voice ``src`` (VOICE.onnx) as a qkv model directory ``dst``; a summary."""
    src = Path(src)
    model, voice, unused = read_voice(src)
    speakers = sorted(voice.get("speaker_id_map") or {}, key=lambda s: voice["speaker_id_map"][s])
    extra = {"piper": {"source": src.name, "piper_version": voice.get("piper_version")}}
    if speakers:
        extra["speakers"] = speakers
    save_model(model, dst, files={VOICE_FILE: src.with_name(src.name + ".json")}, extra=extra)
    c = model.config
    return {
        "model": str(dst),
        "kind": "vits",
        "architecture": "Piper VITS",
        "parameters": sum(p.numel() for p in model.parameters()),
        "sample_rate": c.sample_rate,
        "speakers": len(speakers) or 1,
        "language": (voice.get("language") or {}).get("code"),
        "ignored": unused,
    }
