"""Does ``--int8`` keep Whisper's words (issue 44, section 5)? Whisper tiny.en transcripts in qkv
float32 and qkv int8 (``qkv.load(DIR, int8=True)``: what ``qkv transcribe --int8`` runs) on FSDD's
test files, and faster-whisper's (CTranslate2) float32 and int8 on the same files: how many int8
transcripts equal their own engine's float32 ones; then one long recording read as
``qkv transcribe`` reads it (30-second windows, fallback): the WER of float32 and of int8.

    bash bench/fetch_whisper_tiny.sh && qkv import-hf /tmp/whisper-tiny.en /tmp/whisper-tiny.en-qkv
    python bench/whisper_int8.py                           # 300 files + 3 minutes of speech, recorded
    python bench/whisper_int8.py --files 32 --long-minutes 0 --no-record

FSDD: the first ``--files`` test files in order, greedy, ``--batch`` files a call (as ``qkv
transcribe`` batches them: a step of a batch is many rows, the int8 layers' middle band), no
timestamps; faster-whisper one file per call (its API), as bench/whisper_speed.py calls it (the
CTranslate2 copy of tiny.en that it fetches). Whisper pads every file to a 30-second window, so
the encoder is most of the work: each model's encoder outputs are kept one per file.
Long-form: ``bench/joined_speech.py``'s natural speech
(Multi30k test captions spoken by a Piper voice, joined with silences; cached once spoken),
greedy with Whisper's temperature fallback, WER as bench/whisper_speed.py scores it.

Prints one line per engine; records to bench/results/whisper_int8.json (bench/record.py, with the
CPU's vector flags: int8 activations use 8 bits with VNNI, 7 without) unless ``--no-record``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from whisper_speed import CT2_MODEL, QKV_MODEL, cpu_flags, faster_whisper_engine, long_workload, wer  # noqa: E402


def shared_encoder(model, outputs: dict):
    """``model`` whose ``encode`` keeps each input's output in ``outputs`` (keyed by its features)
    and computes only those not there: a batch's rows are encoded independently, and the int8
    copies' encoders compute the same, so they share one ``outputs``."""
    import torch

    original = model.encode

    def encode(features, valid=None):
        keys = [hashlib.sha1(row.numpy().tobytes()).hexdigest() for row in features]  # (T, M) each
        if valid is not None and not bool(valid.all()):  # Whisper's windows are whole: never here
            return original(features, valid)
        missing = sorted({i for i, k in enumerate(keys) if k not in outputs})
        if missing:
            memory, _ = original(features[missing])  # (B', S, D)
            outputs.update({keys[i]: m for i, m in zip(missing, memory, strict=True)})
        memory = torch.stack([outputs[k] for k in keys])  # (B, S, D)
        return memory, torch.ones(memory.shape[:2], dtype=torch.bool)  # (B, S)

    model.encode = encode
    return model


def qkv_models(path: Path) -> dict:
    """The qkv bundles to compare, float32 and ``--int8``, each encoder's outputs kept per file."""
    import qkv

    bundles = {"qkv fp32": qkv.load(path), "qkv int8": qkv.load(path, int8=True)}
    return {name: dataclasses.replace(b, model=shared_encoder(b.model, {})) for name, b in bundles.items()}


def fsdd(args: argparse.Namespace) -> dict[str, list[str]]:
    """Every engine's transcripts of the first ``args.files`` FSDD test files, timed."""
    from qkv.audio import load_audio
    from qkv.bundle import transcriptions
    from qkv.speech_corpora import fsdd_digits

    files = [u.path for u in fsdd_digits(args.data)["test"][: args.files]]
    texts = {}
    for name, bundle in qkv_models(args.model).items():
        start = time.perf_counter()
        texts[name] = [t.text for t in transcriptions(bundle, files, beam_size=1, batch_size=args.batch)]
        print(f"{name}: {time.perf_counter() - start:.0f} s for {len(files)} files", flush=True)
    if args.ct2_model.is_dir():
        waves = [load_audio(f).numpy() for f in files]
        for precision in ("fp32", "int8"):
            run = faster_whisper_engine(args.ct2_model, precision, beam=1, threads=args.threads, long=False)
            start = time.perf_counter()
            texts[f"faster-whisper {precision}"] = run(waves)
            print(f"faster-whisper {precision}: {time.perf_counter() - start:.0f} s", flush=True)
    return texts


def agreement(texts: dict[str, list[str]]) -> dict[str, int]:
    """Per int8 engine, how many transcripts equal its own engine's float32 ones."""
    same = {}
    for name, got in texts.items():
        reference = texts.get(name.split(" ")[0] + " fp32")
        if "int8" in name and reference is not None:
            same[name] = sum(a == b for a, b in zip(reference, got, strict=True))
    return same


def long_form(args: argparse.Namespace) -> dict[str, float]:
    """The WER (%) of qkv float32 and int8 on ``args.long_minutes`` of natural speech."""
    import torch

    import qkv
    from qkv.bundle import transcriptions

    reference, wave = long_workload(args.data.parent, args.long_minutes)
    found = {}
    for name, int8 in (("qkv fp32", False), ("qkv int8", True)):
        bundle = qkv.load(args.model, int8=int8)
        start = time.perf_counter()
        text = transcriptions(bundle, [torch.from_numpy(wave)], timestamps=False)[0].text
        found[name] = round(wer([reference], [text]), 2)
        print(f"{name}: WER {found[name]:.2f}% on {args.long_minutes} min ({time.perf_counter() - start:.0f} s)")
    return found


def records(same: dict[str, int], files: int, wers: dict[str, float], notes: str) -> list[dict]:
    """qkv int8's agreement with its float32 beside faster-whisper int8's (target: 95%), and its
    long-form WER above float32's (target: at most 0.5 points)."""
    out = []
    peer = "faster-whisper int8"
    for name in [n for n in same if n.startswith("qkv")]:
        out.append(
            {
                "metric": f"Whisper tiny.en FSDD test {files} files greedy: {name} transcripts equal to fp32's",
                "figure": round(100 * same[name] / files, 2),
                "unit": "%",
                "peer": f"{peer} (equal to its fp32's)",
                "peer_figure": round(100 * same[peer] / files, 2) if peer in same else None,
                "target": {"min": 95},
                "details": {f"{n} equal": f"{k}/{files}" for n, k in same.items()},
                "notes": notes,
            }
        )
    if wers:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=QKV_MODEL, help="Whisper tiny.en imported (qkv import-hf)")
    parser.add_argument("--ct2-model", type=Path, default=CT2_MODEL, help="its CTranslate2 copy (whisper_speed.py)")
    parser.add_argument("--data", type=Path, default=Path("/work/shared/data/fsdd"), help="the FSDD folder")
    parser.add_argument("--files", type=int, default=300, help="the first N test files (300: all)")
    parser.add_argument("--batch", type=int, default=32, help="files per call, as qkv transcribe")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--long-minutes", type=float, default=3.0, help="0: no long-form")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--notes", default="")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    texts = fsdd(args)
    same = agreement(texts)
    for name, k in same.items():
        print(f"{name}: equal to its fp32 on {k}/{args.files} ({100 * k / args.files:.1f}%)")
    wers = long_form(args) if args.long_minutes > 0 else {}
    if not args.no_record:
        from record import append_run

        machine = {"cpu_flags": " ".join(cpu_flags()), "threads": args.threads}
        append_run("whisper_int8", [{**r, "machine": machine} for r in records(same, args.files, wers, args.notes)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
