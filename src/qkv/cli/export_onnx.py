"""``qkv export-onnx``: a model as ONNX graphs for onnxruntime, optionally checked against PyTorch.

What is here: the command's arguments (``add_parser``) beside its handler, which calls the
library (``onnx_export``: the graphs and the manifest; ``onnx_verify``: the comparison) and prints
what it wrote and measured.
"""

from __future__ import annotations

import argparse
import json

EXPORTERS = ("auto", "dynamo", "torchscript")  # onnx_export.EXPORTERS, named here so --help imports no torch
EPILOG = """examples:
  qkv export-onnx --model runs/de_en onnx/de_en --verify
  qkv import-hf /tmp/whisper-tiny.en models/whisper
  qkv export-onnx --model models/whisper onnx/whisper --int8 --verify
  python -c "from qkv.onnx_runtime import OnnxModel; print(OnnxModel('onnx/de_en').greedy([[5, 17]], max_new_tokens=9))"

what is written (docs/onnx.md): encoder.onnx and decoder_step.onnx for encoder-decoder models (text, speech,
Whisper), decoder_step.onnx for decoder-only models, encoder.onnx for encoder-only ones; NAME.int8.onnx with
--int8; onnx.json (the graphs, their inputs and outputs, the cache's layout, the special tokens) and the
model's tokenizer files; a text-to-speech model: encoder.onnx, decoder_step.onnx (its pre-net dropout an
input) and postnet.onnx. --verify exits 1 when a graph differs from PyTorch by more than 1e-4 times
max(1, the output's largest |value|), or onnxruntime's greedy decode (a TTS model's synthesis: its stop
decisions and frames) differs from qkv's.
"""


def cmd_export_onnx(args: argparse.Namespace) -> int:
    from qkv.onnx_export import export_onnx, read_source
    from qkv.onnx_runtime import EXPORT_PACKAGES, require

    require(EXPORT_PACKAGES)  # before the model is read: a missing package is said at once
    source = read_source(args.model)
    manifest = export_onnx(source, args.out_dir, int8=args.int8, exporter=args.exporter)
    report = None
    if args.verify:
        from qkv.onnx_verify import verify

        report = verify(source, args.out_dir, int8=args.int8)
    if args.json:
        print(json.dumps({"manifest": manifest, "verify": report}))
    else:
        _print_manifest(manifest, args.out_dir)
        if report is not None:
            _print_report(report)
    return 0 if report is None or report["passed"] else 1


def _print_manifest(manifest: dict, out_dir: str) -> None:
    print(f"exported a {manifest['kind']} model into {out_dir}:")
    for name, graph in manifest["graphs"].items():
        inputs = ", ".join(i["name"] for i in graph["inputs"])
        outputs = ", ".join(o["name"] for o in graph["outputs"])
        quantized = f" (+ {graph['int8']})" if graph["int8"] else ""
        print(f"  {graph['file']}{quantized}: {name}, {graph['exporter']} exporter, opset {graph['opset']}")
        print(f"      {inputs} -> {outputs}")


def _print_report(report: dict) -> None:
    print(f"verified against PyTorch (tolerance {report['tolerance']:.0e} x max(1, the output's largest |value|)):")
    for name, graph in report["graphs"].items():
        verdict = "PASS" if graph["relative_diff"] <= report["tolerance"] else "FAIL"
        floor = f"(PyTorch fp32 vs fp64: {graph['fp32_vs_fp64']:.1e})"
        said = f"max |onnxruntime - PyTorch| = {graph['max_abs_diff']:.2e}, scaled {graph['relative_diff']:.2e}"
        print(f"  {name:<14} {said} {floor}  {verdict}")
    if "synthesis" in report:
        said = report["synthesis"]
        verdict = "PASS" if said["equal"] else "FAIL"
        diff = "" if said["max_abs_diff"] is None else f", max |difference| {said['max_abs_diff']:.2e}"
        frames = f"frames {said['frames'][1]} vs {said['frames'][0]}{diff}"
        print(f"  synthesis through onnxruntime == qkv's ({frames})  {verdict}")
    if "greedy" in report:
        greedy = report["greedy"]
        tokens = sum(len(row) for row in greedy["qkv"])
        verdict = "PASS" if greedy["equal"] else "FAIL"
        print(f"  greedy decode through onnxruntime == qkv's ({len(greedy['qkv'])} inputs, {tokens} tokens)  {verdict}")
    if "int8" in report:
        drift = report["int8"]
        said = ", ".join(f"{name} {d:.2e}" for name, d in drift["graphs"].items())
        agreement = (
            f"; greedy tokens agreeing with fp32: {drift['token_agreement']:.0%}" if "token_agreement" in drift else ""
        )
        print(f"  int8 vs fp32 (reported, not checked): max |difference| {said}{agreement}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``export-onnx`` command's arguments."""
    p = sub.add_parser(
        "export-onnx",
        help="export a model as ONNX graphs (encoder, decoder step with its KV cache) for onnxruntime",
        description="Write a model's ONNX graphs with torch.onnx.export (the dynamo exporter; the TorchScript one "
        "where dynamo fails, as the manifest says): an encoder-decoder's encoder (its output, its mask and every "
        "decoder layer's cross-attention keys and values, computed once) and a decoder step that takes and returns "
        "the self-attention KV cache; a decoder-only model's step (with positions and a key mask for left-padded "
        "prompts); an encoder-only model's encoder; a text-to-speech model's text encoder, decoder step (frames in, r "
        "frames and stop logits out, its pre-net dropout an input) and post-net. Batch and length axes are dynamic. "
        "Needs the optional packages onnx, onnxruntime and onnxscript (pip install 'qkv[onnx]').",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="model directory or training run")
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (new, empty or an earlier export)")
    p.add_argument(
        "--exporter",
        choices=EXPORTERS,
        default="auto",
        help="torch.onnx's exporter: dynamo (torch.export), torchscript (the older tracer: much faster to export, "
        "no grouped-query attention) or auto (dynamo, TorchScript where dynamo fails; default)",
    )
    p.add_argument("--int8", action="store_true", help="also write int8 copies (onnxruntime's dynamic quantization)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="compare every graph with PyTorch on real inputs (within 1e-4 x max(1, |output|)) and onnxruntime's "
        "greedy decode with qkv's (token for token; a TTS model's synthesis: stop decisions and frames); with "
        "--int8, report the int8 graphs' drift; exit 1 on a failure",
    )
    p.add_argument("--json", action="store_true", help="print the manifest and the verification as one JSON line")
    p.set_defaults(run=cmd_export_onnx)
