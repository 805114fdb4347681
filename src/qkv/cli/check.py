"""``qkv check``: the properties qkv's tests prove on tiny models, measured on the user's own model.

What is here: the command's arguments (``add_parser``) beside its handler, and the table it
prints. The checks themselves are ``qkv.checks``, which the test suite calls too.
"""

from __future__ import annotations

import argparse
import json
import math

EPILOG = """examples:
  qkv check --model runs/de_en                            # inputs drawn from the model's tokenizer
  qkv check --model models/whisper-tiny.en --input talk.wav --grad
  qkv check --model models/gpt2 --input prompts.txt --json
  qkv check --model runs/de_en --onnx                     # the ONNX export too (onnx extra)
exit status: 0 when every judged row passes, 1 when one fails, 2 on a usage mistake
"""

HEADER = ("property", "measured", "tolerance", "result", "what")


def cmd_check(args: argparse.Namespace) -> int:
    from qkv.checks import checked, checks, failed
    from qkv.progress import progress

    target = checked(args.model, given=args.input)
    todo = checks(target, grad=args.grad, onnx=args.onnx)
    bar = progress(len(todo), desc="qkv check", unit="check")
    rows = []
    for label, check in todo:
        bar.set_postfix(running=label)  # a bar on a terminal shows it at once
        rows.append(check())
        bar.set_postfix(done=f"{label} {rows[-1].status}")
        bar.update(1)
    bar.close()
    if args.json:
        print(
            json.dumps(
                {"model": str(target.directory), "passed": not failed(rows), "rows": [r.as_dict() for r in rows]}
            )
        )
    else:
        print(table(rows))
        counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "FAIL", "INFO", "SKIP")}
        print(f"{target.directory}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return 1 if failed(rows) else 0


def table(rows) -> str:
    """The rows as an aligned plain-text table, one row per property."""
    cells = [HEADER] + [(r.name, shown(r.measured), shown(r.tolerance), r.status, r.detail) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER) - 1)]
    return "\n".join(
        "  ".join(c[i].ljust(widths[i]) if i == 0 else c[i].rjust(widths[i]) for i in range(len(widths))) + "  " + c[-1]
        for c in cells
    )


def shown(x: float | None) -> str:
    """A measurement as the table writes it: "-" for none, a count as an integer, else 2 digits."""
    if x is None:
        return "-"
    if not math.isfinite(x) or x == 0:
        return str(x).removesuffix(".0")  # inf, nan, 0
    return str(int(x)) if x >= 1 and x == int(x) else f"{x:.1e}"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``check`` command's arguments."""
    p = sub.add_parser(
        "check",
        help="prove on your model what qkv's tests prove on tiny ones (attention paths, causality, padding, "
        "KV cache, batching, beam 1 == greedy, bf16/int8 drift, save/load and export round trips)",
        description="Run the properties qkv's test suite proves on tiny models on a model directory of any kind "
        "(translation, language model, encoder, speech, imported Whisper, text-to-speech) and print one row "
        "per property: the largest difference measured, the tolerance and PASS/FAIL. bf16 and int8 drift "
        "from float32 is reported (INFO), never failed; a property that does not apply to the model is SKIP. "
        "Inputs are the file given by --input, else drawn from the model's tokenizer (a generated signal for "
        "a speech model). Exit status 1 when a row fails.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="qkv model directory or training run")
    p.add_argument(
        "--input",
        metavar="FILE",
        help="what the model reads: a text file (its first 8 non-empty lines) or, for a speech model, an "
        "audio file (checked whole and cut shorter, so a batch pads)",
    )
    p.add_argument("--grad", action="store_true", help="compare the attention paths' gradients too (slower)")
    p.add_argument(
        "--onnx",
        action="store_true",
        help="export the model with qkv export-onnx and compare onnxruntime with PyTorch (seconds per graph; "
        "needs the onnx extra)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    p.set_defaults(run=cmd_check)
