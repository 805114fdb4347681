"""``qkv demo``: train the built-in numbers task, show what the model learned, draw its attention.

What is here: the command's arguments (``add_parser``) beside its handler.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qkv.cli.common import (
    positive_float,
    positive_int,
    seed,
)

EPILOG_DEMO = """example:
  qkv demo --out qkv-demo          # about 2 minutes on 2 idle CPU cores, never more than 3
  qkv generate --model qkv-demo/model <<< "4,317"
"""

# Training stops here on a busy machine, its schedule shortened to anneal by then
# (training.fit); on an idle 2-core machine the 3,000 steps take about 100 s and the cap
# never binds.
DEMO_SECONDS = 180.0
# Optimizer steps per second of the demo's model on 2 idle Zen 4 cores (bench/results/demo.json:
# 3,000 steps in 81-105 s), for the time printed before training starts.
IDLE_STEPS_PER_SECOND = 30.0


def cmd_demo(args: argparse.Namespace) -> int:
    from qkv.plots import attention_heatmap, loss_curve
    from qkv.seq2seq import cross_attention
    from qkv.tasks import load_recipe
    from qkv.tasks.numbers import TASK, train_numbers

    overrides = [f"train.seed={args.seed}", f"train.seconds={args.seconds}"]
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    overrides.append(f"data.eval_examples={args.examples}")
    recipe = load_recipe(None, overrides)
    out = Path(args.out)
    steps = recipe.train.steps
    expected = min(steps / IDLE_STEPS_PER_SECOND, args.seconds)
    print(
        f"qkv demo: training an encoder-decoder Transformer to write numbers as English words "
        f"({steps} steps, seed {args.seed}): about {expected / 60:.1f} min on 2 idle CPU cores, "
        f"at most {args.seconds / 60:.1f} min (--seconds), then ~10 s to score {args.examples} held-out numbers",
        file=sys.stderr,
    )
    summary = train_numbers(recipe, out / "model", progress=not args.quiet)
    if summary["steps"] < steps:
        print(
            f"qkv demo: note: the {args.seconds:g}-second cap (--seconds) ended training after {summary['steps']} of "
            f"{steps} steps (a busy machine?); the schedule was shortened to end there",
            file=sys.stderr,
        )
    model, tokenizer = summary["model"], summary["tokenizer"]
    held_out, outputs = summary["held_out"], summary["outputs"]

    print(f"held-out examples (never seen in training), beam search width {recipe.decode.beam_size}:")
    for (source, reference), output in list(zip(held_out, outputs, strict=True))[:8]:
        mark = "ok " if output == reference else "ERR"
        print(f"  {mark} {source:>9} -> {output}")
    wrong = [(s, r, o) for (s, r), o in zip(held_out, outputs, strict=True) if o != r]
    for source, reference, output in wrong[:3]:
        print(f"  wrong: {source} -> {output!r} (expected {reference!r})")

    # The picture: the held-out example with the longest output, source against output tokens.
    longest = max(range(len(held_out)), key=lambda i: len(outputs[i].split()))
    source = held_out[longest][0]
    src_ids, out_ids = tokenizer.encode(source), tokenizer.encode(outputs[longest])
    weights = cross_attention(model, src=src_ids, out=out_ids)  # (H, T, S)
    png = attention_heatmap(
        weights.numpy(),
        source=[tokenizer.id_to_token(i) for i in src_ids],
        output=[tokenizer.id_to_token(i) for i in [*out_ids, tokenizer.eos_id]],
        path=out / "cross_attention.png",
        title=f"cross-attention of the last decoder layer while writing {source!r}",
    )
    loss_png = loss_curve(summary["losses"], out / "loss.png", title="qkv demo: training loss", ylabel=TASK.loss_name)
    print(
        f"qkv demo: exact match {summary['exact_match']:.1%} on {len(held_out)} held-out numbers | "
        f"{summary['steps']} steps in {summary['train_seconds']:.0f}s "
        f"({summary['tokens_per_second']:.0f} target tokens/s) | model {out / 'model'} | "
        f"pictures {png}, {loss_png}",
        file=sys.stderr,
    )
    result = {
        "task": "numbers",
        "exact_match": round(summary["exact_match"], 4),
        "train_seconds": round(summary["train_seconds"], 1),
        "attention_png": str(png),
    }
    print(json.dumps(result))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``demo`` command's arguments."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "demo",
        help="train the built-in numbers->words task and show what the model learned",
        description="Train a small encoder-decoder from scratch on the built-in task (numbers written with "
        "digits -> English words), offline; report exact match on held-out numbers, show beam-search outputs, "
        "draw the cross-attention, save the model. Ends with one JSON line on stdout.",
        epilog=EPILOG_DEMO,
        formatter_class=raw,
    )
    p.add_argument("--out", default="qkv-demo", help="output directory (default: qkv-demo)")
    p.add_argument("--seed", type=seed, default=0, help="random seed (default: 0)")
    p.add_argument(
        "--seconds",
        type=positive_float,
        default=DEMO_SECONDS,
        help=f"cap on training time (default: {DEMO_SECONDS:g}); on a machine too busy for all the steps, the "
        "learning-rate schedule is shortened to end at the cap, and a note says so",
    )
    p.add_argument("--steps", type=positive_int, default=None, help="training steps (default: the recipe's)")
    p.add_argument("--examples", type=positive_int, default=1000, help="held-out numbers to score (default: 1000)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_demo)
