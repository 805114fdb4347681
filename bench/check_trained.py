"""``qkv check`` on trained and imported models: the table of issue 47's "done means", measured.

    python bench/check_trained.py                     # trains what is missing under /tmp/qkv-check
    python bench/check_trained.py --mt runs/multi30k_en_de --tts runs/tts_en --whisper models/whisper-tiny.en
    python bench/check_trained.py --thorough          # and again on real sentences, with --grad --onnx
    python bench/check_trained.py --no-record         # print only

Three models, each checked by ``qkv check --model DIR --json`` in a process of its own (what a
user runs, on inputs drawn from the model's tokenizer or a generated signal):

* a Multi30k en→de translation model of ``recipes/multi30k_en_de.yaml`` (its architecture: 4+4
  layers, d=128), trained here by ``qkv train`` for a few minutes (``--mt`` names another);
* a text-to-speech model of ``recipes/tts_en.yaml`` (espeak-ng's voice reading Multi30k's
  captions, as phonemes), trained here on a slice of its corpus for a few minutes (``--tts``);
* OpenAI's Whisper tiny.en imported by ``qkv import-hf`` (``--whisper``; skipped when absent:
  ``bench/fetch_whisper_tiny.sh`` fetches it, ``qkv import-hf`` imports it).

With ``--thorough`` the two trained models are checked again on real sentences (the first 8 of
Multi30k's val.en, read as each model reads them: the TTS model's as espeak-ng phonemes), with
the gradients of the two attention paths (``--grad``) and the ONNX round trip (``--onnx``).

The short runs are real trained models (their weights have left initialisation: logits of tens,
attention that is no longer uniform), not good ones: the properties are about the computation,
not the quality. Records go to ``bench/results/check_trained.json``: per model, the number of
rows that FAIL (target: 0) with the rows' statuses, and one record per measured row (its largest
difference; a judged row's target is its tolerance).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

# Ten minutes of each recipe on a busy two-core machine: the recipes' own models, on a slice of
# their data, in smaller batches (more steps in the time) with a shorter warmup.
MT_SHORT = (
    "train.epochs=4",
    "train.seconds=600",
    "train.max_tokens=1024",
    "train.warmup=100",
    "train.lr=0.002",
    "train.average_last=1",
    "data.train_pairs=6000",
    "data.valid_pairs=200",
)
TTS_SHORT = (
    "data.sentences=400",
    "data.test_sentences=2",
    "train.steps=600",
    "train.seconds=600",
    "train.warmup=100",
    "train.batch_frames=4000",
)
MODELS = {  # the name a record gives each model, its recipe and its short run's overrides
    "mt": ("Multi30k en→de (recipe's model, a short run)", "recipes/multi30k_en_de.yaml", MT_SHORT),
    "tts": ("TTS en, espeak-ng voice (recipe's model, a short run)", "recipes/tts_en.yaml", TTS_SHORT),
    "whisper": ("Whisper tiny.en (imported)", None, ()),
}


def qkv(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """``python -m qkv ARGS`` in a process of its own, with this checkout's src first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "qkv", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def trained(key: str, out: Path) -> Path:
    """The model of ``MODELS[key]`` trained by ``qkv train`` into ``out`` (kept: a second run reuses it)."""
    from qkv.checkpoint import model_dir
    from qkv.errors import UserError

    _, recipe, overrides = MODELS[key]
    try:
        if (model_dir(out) / "config.json").is_file():  # a finished run: its final checkpoint
            return out
    except UserError:
        pass  # a run that did not finish: trained again
    sets = [x for kv in overrides for x in ("--set", kv)]
    start = time.perf_counter()
    done = qkv("train", recipe, "--out", str(out), *sets, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"qkv train {recipe} failed:\n{done.stderr[-4000:]}")
    print(f"trained {recipe} into {out} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return out


def checked(model: Path, *options: str) -> tuple[dict, float]:
    """``qkv check --model MODEL --json OPTIONS``'s object and the seconds it took (exit 0 or 1:
    rows; else a mistake)."""
    start = time.perf_counter()
    done = qkv("check", "--model", str(model), "--json", *options, timeout=3600)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"qkv check --model {model} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout), seconds


def shown(x: float) -> float:
    """``x`` to 3 significant digits, as the page shows it (the exact value stays in the details)."""
    return float(f"{x:.3g}")


def records_of(label: str, result: dict, seconds: float) -> list[dict]:
    """The records of one model's check: the FAIL count (target 0), then each measured row."""
    rows = result["rows"]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("PASS", "FAIL", "INFO", "SKIP")}
    out = [
        {
            "metric": f"{label}: rows that FAIL",
            "figure": counts["FAIL"],
            "unit": "rows",
            "target": {"max": 0},
            "details": {**counts, "seconds": round(seconds, 1), "model": result["model"]},
            "notes": "; ".join(f"{r['name']}: {r['status']}" for r in rows),
        }
    ]
    for r in rows:
        if r["measured"] is None:
            continue
        judged = r["tolerance"] is not None
        out.append(
            {
                "metric": f"{label}: {r['name']}",
                "figure": shown(r["measured"]),
                "unit": "",
                "target": {"max": shown(r["tolerance"])} if judged else None,
                "details": {"status": r["status"], "measured": r["measured"], "tolerance": r["tolerance"]},
                "notes": r["detail"],
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mt", type=Path, help="a trained translation model (default: train one under --root)")
    p.add_argument("--tts", type=Path, help="a trained text-to-speech model (default: train one under --root)")
    p.add_argument("--whisper", type=Path, default=Path("/tmp/whisper-tiny.en-qkv"), help="an imported Whisper")
    p.add_argument("--root", type=Path, default=Path("/tmp/qkv-check"), help="where the short runs are trained")
    p.add_argument(
        "--thorough",
        action="store_true",
        help="check the two trained models again on real sentences (the first 8 of Multi30k's val.en), with "
        "--grad and --onnx (minutes more; needs the onnx extra)",
    )
    p.add_argument("--no-record", action="store_true", help="print, do not write bench/results/check_trained.json")
    args = p.parse_args(argv)

    from qkv.checks import Row
    from qkv.cli.check import table

    models = {
        "mt": args.mt or trained("mt", args.root / "mt"),
        "tts": args.tts or trained("tts", args.root / "tts"),
        "whisper": args.whisper,
    }
    runs = [(MODELS[key][0], model, ()) for key, model in models.items()]
    if args.thorough:
        from qkv.data import resolve

        sentences = str(resolve("multi30k/val.en"))
        thorough = ("--input", sentences, "--grad", "--onnx")
        runs += [(f"{MODELS[key][0]}, val.en, --grad --onnx", models[key], thorough) for key in ("mt", "tts")]
    records = []
    for label, model, options in runs:
        if not model.exists():
            print(f"{label}: {model} is absent (bench/fetch_whisper_tiny.sh, then qkv import-hf): skipped")
            continue
        result, seconds = checked(model, *options)
        print(f"\n{label} ({model}, {seconds:.0f} s)\n{table([Row(**r) for r in result['rows']])}")
        records += records_of(label, result, seconds)
    if records and not args.no_record:
        import record

        record.append_run("check_trained", records)
    failed = [r for r in records if r["metric"].endswith("rows that FAIL") and r["figure"]]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
