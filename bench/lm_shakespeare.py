"""Character-level Shakespeare: qkv's `qkv train` against nanoGPT's figures at the same configuration.

Runs `qkv train` on a recipe (default: recipes/shakespeare_char_cpu.yaml, nanoGPT's CPU
configuration) as a user would, timing the whole command, then prints the validation loss
(nats per character over the whole validation split, non-overlapping windows of the context)
and the wall time beside the peer's.

The peer: nanoGPT's own train.py is not a package and cannot be fetched on this machine, so
its figures are the ones measured on this machine (2026-11-29, torch 2.13 CPU, idle) and
recorded in the project's issue: 100 s wall clock for the whole run, 1.898 nats/char on the
whole validation split (its own 20-batch estimate: 1.886). They are printed as such, not
re-measured here.

    python bench/lm_shakespeare.py [--recipe recipes/shakespeare_char.yaml] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NANOGPT = {"recipe": "recipes/shakespeare_char_cpu.yaml", "val_loss": 1.898, "wall_seconds": 100.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=NANOGPT["recipe"], help="an lm recipe (default: nanoGPT's CPU config)")
    parser.add_argument("--out", default=None, help="model directory (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or Path(tmp) / "model")
        command = [sys.executable, "-m", "qkv", "train", str(ROOT / args.recipe), "--out", str(out), "--json"]
        start = time.perf_counter()
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            print(f"qkv train failed with status {done.returncode}", file=sys.stderr)
            return 1
        result = json.loads(done.stdout.strip().splitlines()[-1])
    row = "{:<34} {:>14} {:>16}"
    print(row.format("", "qkv (measured)", "nanoGPT (issue)"))
    same = args.recipe == NANOGPT["recipe"]
    peer_loss = f"{NANOGPT['val_loss']:.3f}" if same else "-"
    peer_wall = f"{NANOGPT['wall_seconds']:.0f}" if same else "-"
    print(row.format("validation loss (nats/char)", f"{result['val_loss']:.4f}", peer_loss))
    print(row.format("wall clock, whole command (s)", f"{wall:.1f}", peer_wall))
    print(row.format("training steps", result["steps"], 2000 if same else "-"))
    print(row.format("training tokens/s", result["tokens_per_second"], "-"))
    if same:
        print(
            f"ratio: loss {result['val_loss'] / NANOGPT['val_loss']:.3f}x, "
            f"time {wall / NANOGPT['wall_seconds']:.2f}x of nanoGPT's"
        )
    print(json.dumps({"recipe": args.recipe, "val_loss": result["val_loss"], "wall_seconds": round(wall, 1)}))
    _record(args.recipe, result, wall, same=same)
    return 0


def _record(recipe: str, result: dict, wall: float, *, same: bool) -> None:
    """Append this run's loss and time to bench/results/lm_shakespeare.json (docs/results.md is rendered from it)."""
    from record import append_run  # bench/record.py, beside this script

    name = Path(recipe).stem
    peer = "nanoGPT (measured on this machine 2026-11-29, issue 4)" if same else None
    details = {"training steps": result["steps"], "training tokens/s": result["tokens_per_second"]}
    loss = {
        "metric": f"{name}: validation loss",
        "figure": result["val_loss"],
        "unit": "nats/char",
        "peer": peer,
        "peer_figure": NANOGPT["val_loss"] if same else None,
        "target": {"max": 1.5} if name == "shakespeare_char" else None,  # issue 4's target for this recipe
        "details": details,
    }
    if same:  # nanoGPT's time is the target for its own configuration
        time = {"figure": round(wall, 1), "unit": "s", "peer_figure": NANOGPT["wall_seconds"], "target": {"max": 100}}
    else:
        time = {"figure": round(wall / 60, 1), "unit": "min", "peer_figure": None, "target": None}
    append_run("lm_shakespeare", [loss, {"metric": f"{name}: whole command", "peer": peer, **time}])


if __name__ == "__main__":
    raise SystemExit(main())
