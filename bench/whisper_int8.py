"""Does ``--int8`` keep Whisper's words (issue 44, section 5)? Whisper tiny.en transcripts in qkv
float32 and qkv int8 (``qkv.load(DIR, int8=True)``: what ``qkv transcribe --int8`` runs), and
faster-whisper's (CTranslate2) float32 and int8, on the same FSDD test files in one run: how many
int8 transcripts equal their own engine's float32 ones (target: 95%); then, optionally, one long
recording read as ``qkv transcribe`` reads it: the WER of qkv float32 and of qkv int8.

    bash bench/fetch_whisper_tiny.sh && qkv import-hf /tmp/whisper-tiny.en /tmp/whisper-tiny.en-qkv
    python bench/whisper_int8.py                             # 300 files, recorded
    python bench/whisper_int8.py --files 100 --long-minutes 3 --notes "busy machine"
    python bench/whisper_int8.py --files 8 --no-record       # a smoke run (minutes)

Every engine runs in a process of its own, as bench/whisper_speed.py runs them (its children:
the same calls, the same files, ``--threads`` threads each): qkv ``--batch`` files a call, as
``qkv transcribe`` batches them, greedy, no timestamps; faster-whisper one file a call (its API),
on the CTranslate2 copy of tiny.en that whisper_speed.py fetches. FSDD: ``--files`` of the 300
test files spread evenly over digits and speakers (300: all). Long-form (``--long-minutes``,
default 0: none): ``bench/joined_speech.py``'s natural speech, greedy with Whisper's temperature
fallback, WER as whisper_speed.py scores it.

Prints each engine's agreement; records to bench/results/whisper_int8.json (bench/record.py, with
the CPU's vector flags) unless ``--no-record``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from whisper_speed import (  # noqa: E402
    CT2_MODEL,
    HF_MODEL,
    QKV_MODEL,
    cpu_flags,
    fsdd_workload,
    long_workload,
    workload_rows,
)

ENGINES = ("qkv fp32", "qkv int8", "faster-whisper fp32", "faster-whisper int8")
PEER = "faster-whisper int8"


def agreement(texts: dict[str, list[str]]) -> dict[str, int]:
    """Per int8 engine, how many of its transcripts equal its own engine's float32 ones."""
    same = {}
    for name, got in texts.items():
        reference = texts.get(name.rsplit(" ", 1)[0] + " fp32")
        if name.endswith("int8") and reference is not None:
            same[name] = sum(a == b for a, b in zip(reference, got, strict=True))
    return same


def records(same: dict[str, int], files: int, wers: dict[str, float], notes: str) -> list[dict]:
    """qkv int8's agreement with its float32 beside faster-whisper int8's (target: 95%), and its
    long-form WER above float32's (target: at most 0.5 points)."""
    out = []
    if "qkv int8" in same:
        out.append(
            {
                "metric": f"Whisper tiny.en FSDD test {files} files greedy: qkv int8 transcripts equal to fp32's",
                "figure": round(100 * same["qkv int8"] / files, 2),
                "unit": "%",
                "peer": f"{PEER} (equal to its fp32's)",
                "peer_figure": round(100 * same[PEER] / files, 2) if PEER in same else None,
                "target": {"min": 95},
                "details": {f"{n} equal": f"{k}/{files}" for n, k in same.items()},
                "notes": notes,
            }
        )
    if {"qkv fp32", "qkv int8"} <= wers.keys():
        out.append(
            {
                "metric": "Whisper tiny.en long-form speech: qkv int8 WER above qkv fp32's",
                "figure": round(wers["qkv int8"] - wers["qkv fp32"], 2),
                "unit": "WER points",
                "target": {"max": 0.5},
                "details": {f"{n} WER %": w for n, w in wers.items()},
                "notes": notes,
            }
        )
    return out


def speed_args(args: argparse.Namespace, engines: tuple[str, ...]) -> argparse.Namespace:
    """The options whisper_speed.py's children read, from ours."""
    return argparse.Namespace(
        engines=list(engines),
        beam=1,
        batch=args.batch,
        threads=args.threads,
        hf_model=HF_MODEL,
        qkv_model=args.model,
        ct2_model=args.ct2_model,
        no_fallback=False,
        row_timeout=args.row_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=QKV_MODEL, help="Whisper tiny.en imported (qkv import-hf)")
    parser.add_argument("--ct2-model", type=Path, default=CT2_MODEL, help="its CTranslate2 copy (whisper_speed.py)")
    parser.add_argument("--data", type=Path, default=None, help="the FSDD folder (default $QKV_DATA/fsdd)")
    parser.add_argument("--files", type=int, default=300, help="FSDD test files, spread evenly (300: all)")
    parser.add_argument("--batch", type=int, default=32, help="files per call, as qkv transcribe")
    parser.add_argument("--threads", type=int, default=2, help="threads per engine")
    parser.add_argument("--long-minutes", type=float, default=0.0, help="minutes of long-form speech (0: none)")
    parser.add_argument("--row-timeout", type=float, default=7200, help="seconds one engine may take on a workload")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--notes", default="", help="notes for the records (say when the machine was busy)")
    args = parser.parse_args(argv)

    engines = ENGINES if args.ct2_model.is_dir() else ENGINES[:2]
    _, references, waves = fsdd_workload(args.data, args.files)
    rows = workload_rows("fsdd", references, waves, speed_args(args, engines))
    same = agreement({e: r["texts"] for e, r in rows.items()})
    for name, r in rows.items():
        print(f"{name:<20} {r['seconds']:8.1f} s  WER {r['wer']:6.2f}%", flush=True)
    for name, k in same.items():
        print(f"{name}: equal to its fp32 on {k}/{len(waves)} ({100 * k / len(waves):.1f}%)", flush=True)
    wers = {}
    if args.long_minutes > 0:
        reference, wave = long_workload(args.data, args.long_minutes)
        long_rows = workload_rows("long", [reference], [wave], speed_args(args, ENGINES[:2]))
        wers = {e: r["wer"] for e, r in long_rows.items()}
        print(f"long-form {args.long_minutes:g} min: " + ", ".join(f"{e} WER {w:.2f}%" for e, w in wers.items()))
    if not args.no_record:
        from record import append_run

        machine = {"cpu_flags": " ".join(cpu_flags()), "threads": args.threads}
        append_run("whisper_int8", [{**r, "machine": machine} for r in records(same, len(waves), wers, args.notes)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
