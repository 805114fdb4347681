"""Fuzzing at length: the properties of tests/test_fuzz.py, with many more inputs per category.

    python bench/fuzz.py                                   # 2,000 inputs per category (about ten minutes on 2 cores)
    python bench/fuzz.py --examples 200 --only corpora     # one category, quicker

Each category (model directories, config.json, recipes, tokenizer files, corpora, command lines;
and the newer surfaces: audio files, speech manifests, speech model directories, checkpoints to
import, speech command lines with torchrun's environment) draws its inputs with hypothesis from
its strategies in tests/test_fuzz.py or tests/test_fuzz_speech.py, seeded (``--seed``),
and runs its property on each: the case must succeed or end in one line naming the culprit (a
refusal within 2 s), with no traceback and no hang. Failures are counted, not shrunk; the first
few of each category are printed. The table (category, inputs tried, failures, slowest refusal)
is printed, and the run appends two records per category to bench/results/fuzz.json (inputs
tried, and failures, whose target is 0) through bench/record.py, unless ``--no-record``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_properties():
    """tests/test_fuzz.py (the harness, its CATEGORIES) and tests/test_fuzz_speech.py (the newer
    surfaces' CATEGORIES, on the same harness), imported by name as pytest imports them, so that
    both share one harness: returns the harness module and every category."""
    sys.path.insert(0, str(ROOT / "tests"))
    import test_fuzz
    import test_fuzz_speech

    return test_fuzz, {**test_fuzz.CATEGORIES, **test_fuzz_speech.CATEGORIES}


def run_category(properties, categories: dict, name: str, *, examples: int, seed: int, show: int) -> dict:
    """Run one category's property on ``examples`` drawn inputs; returns its counts."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seeded

    strategies, check = categories[name]
    counts = {"tried": 0, "failures": 0, "slowest": 0.0, "first": []}
    judge = properties._judge

    def timed_judge(outcome, names):
        if outcome.status == 2 and outcome.failure is None:
            counts["slowest"] = max(counts["slowest"], outcome.seconds)
        return judge(outcome, names)

    def one(**case) -> None:
        counts["tried"] += 1
        try:
            failure = check(**case)
        except Exception as e:  # the harness's own mistake (preparing the case): counted, not hidden
            failure = f"harness error: {type(e).__name__}: {e}"
        if failure is not None:
            counts["failures"] += 1
            if len(counts["first"]) < show:
                counts["first"].append((failure, repr(case)[:400]))

    runner = seeded(seed)(
        settings(
            max_examples=examples,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )(given(**strategies)(one))
    )
    properties._judge = timed_judge
    try:
        runner()
    finally:
        properties._judge = judge
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Fuzz qkv's inputs (model directories, config.json, recipes, tokenizer files, corpora, "
        "command lines, audio files, speech manifests and models, checkpoints to import, speech command lines) "
        "with the properties of tests/test_fuzz.py and tests/test_fuzz_speech.py; print and record the counts.",
        epilog="example: python bench/fuzz.py --examples 300",
    )
    parser.add_argument("--examples", type=int, default=2000, help="inputs per category (default 2000)")
    parser.add_argument("--only", action="append", default=[], metavar="CATEGORY", help="run this category only")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--show", type=int, default=3, help="failures printed per category (default 3)")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/results/fuzz.json")
    args = parser.parse_args(argv)
    properties, categories = load_properties()
    names = args.only or list(categories)
    unknown = [n for n in names if n not in categories]
    if unknown:
        parser.error(f"unknown categories {unknown}; known: {', '.join(categories)}")
    results = {}
    for name in names:
        start = time.perf_counter()
        results[name] = run_category(
            properties, categories, name, examples=args.examples, seed=args.seed, show=args.show
        )
        counts = results[name]
        print(
            f"{name}: {counts['tried']} inputs, {counts['failures']} failures ({time.perf_counter() - start:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        for failure, case in counts["first"]:
            print(f"  FAILED {failure}\n    on {case}", file=sys.stderr)
    width = max(len(n) for n in names)
    print(f"{'category':<{width}}  {'inputs tried':>12}  {'failures':>8}  {'slowest refusal':>15}")
    for name, counts in results.items():
        print(f"{name:<{width}}  {counts['tried']:>12}  {counts['failures']:>8}  {counts['slowest']:>14.2f}s")
    total_tried = sum(c["tried"] for c in results.values())
    total_failed = sum(c["failures"] for c in results.values())
    print(f"{'total':<{width}}  {total_tried:>12}  {total_failed:>8}")
    if not args.no_record:
        _record(results, examples=args.examples, seed=args.seed)
    return 1 if total_failed else 0


def _record(results: dict, *, examples: int, seed: int) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from record import append_run  # bench/record.py, beside this script

    records = []
    for name, counts in results.items():
        records.append(
            {"metric": f"{name}: inputs tried", "figure": counts["tried"], "unit": "inputs", "details": {"seed": seed}}
        )
        records.append(
            {
                "metric": f"{name}: failures",
                "figure": counts["failures"],
                "unit": "failures",
                "target": {"max": 0},
                "details": {"slowest refusal (s)": round(counts["slowest"], 2)},
                "notes": "; ".join(f for f, _ in counts["first"]),
            }
        )
    append_run("fuzz", records)


if __name__ == "__main__":
    sys.exit(main())
