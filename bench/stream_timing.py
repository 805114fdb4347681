"""What word times cost a stream (``/v1/audio/stream``'s ``timing``): compute per second of audio
of ``SpeechStream`` over Whisper tiny.en, three ways, in one process, interleaved.

    bash bench/fetch_whisper_tiny.sh                  # Whisper tiny.en into /tmp/whisper-tiny.en
    python bench/stream_timing.py --seconds 30 --rounds 3
    python bench/stream_timing.py --seconds 15 --rounds 5 --one-step --no-record   # one step's work, quick

The ways: ``estimated`` (``decoder_of`` alone: each segment's time shared out by characters);
``timer`` (``timer_of``: a step that commits words reads the buffer again, encoder and decoder, to
align them, as the stream did first); ``shared`` (``decoder_of(words=True)``: each step's decoding
aligns its words with the encoder output it has already read, ``LongForm.word_timestamps``: one
decoder pass more). The audio: the first ``--seconds`` of ``bench/joined_speech.py``'s natural
speech (seed 0; its captions spoken once and cached), fed in 1 s chunks as a client sends them.
Compute: the process's CPU seconds (``time.process_time``: less sensitive than wall time to
other work on a shared machine) per second of audio, the median over ``--rounds`` rounds, the
ways alternated within each round. Beside it: whether the ways commit the same words, and how far
the two aligned ways' word times are apart. Appends to ``bench/results/stream_timing.json``
(``bench/record.py``); ``--no-record`` prints only. ``--one-step``: the work of one step that
commits, on a buffer of ``--seconds`` (decoded, and aligned the way's way), instead of a whole
stream: quick on a busy machine, and the step that pays for the alignment.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

WAYS = ("estimated", "timer", "shared")


def one_step(bundle, wave, way: str) -> tuple[list, float]:
    """The words of one step's work on the buffer ``wave``, timed ``way``'s way, and its CPU seconds."""
    from qkv.speech_streaming import decoder_of, timer_of, words_of

    began = time.process_time()
    segments = decoder_of(bundle, words=way == "shared")(wave, "")
    if way == "timer":
        segments = timer_of(bundle)(wave, segments)
    return words_of(segments, 0.0)[0], time.process_time() - began


def streamed(bundle, wave, way: str) -> tuple[list, float]:
    """The words ``way`` commits over ``wave`` in 1 s chunks, and the CPU seconds it took."""
    from qkv.speech_streaming import SpeechStream, decoder_of, timer_of

    timer = timer_of(bundle) if way == "timer" else None
    stream = SpeechStream(decoder_of(bundle, words=way == "shared"), sample_rate=16000, timer=timer)
    words, began = [], time.process_time()
    for piece in wave.split(16000):
        stream.insert(piece)
        if stream.ready():
            words += stream.step().committed
    words += stream.finish().committed
    return words, time.process_time() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="example: python bench/stream_timing.py --seconds 30 --rounds 3"
    )
    parser.add_argument("--hf", type=Path, default=Path("/tmp/whisper-tiny.en"), help="a Hugging Face Whisper")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds of speech streamed (default: 30)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three ways (default: 3)")
    parser.add_argument("--note", default="", help="the conditions, for the record's notes (e.g. a shared machine)")
    parser.add_argument("--no-record", action="store_true", help="print only; append nothing to bench/results")
    parser.add_argument("--one-step", action="store_true", help="one committing step's work on the buffer, per way")
    args = parser.parse_args(argv)
    import torch
    from joined_speech import joined_speech

    import qkv
    from qkv.hf.convert import import_hf

    if not (args.hf / "model.safetensors").is_file():
        raise SystemExit(f"stream_timing: no {args.hf}: run bash bench/fetch_whisper_tiny.sh")
    joined = joined_speech(args.seconds / 60, 0, log=sys.stderr)
    wave = torch.from_numpy(joined.wave)  # (Y,)
    with tempfile.TemporaryDirectory() as tmp:
        import_hf(args.hf, Path(tmp) / "whisper")
        bundle = qkv.load(Path(tmp) / "whisper")
    seconds, found = wave.numel() / 16000, {way: [] for way in WAYS}
    words = {}
    for r in range(args.rounds):
        for way in WAYS if r % 2 == 0 else WAYS[::-1]:
            words[way], cpu = (one_step if args.one_step else streamed)(bundle, wave, way)
            found[way].append(cpu / seconds)
            print(f"round {r + 1}, {way}: {cpu / seconds:.3f} CPU s per s of audio", file=sys.stderr, flush=True)
    result = summary(found, words, seconds)
    print(json.dumps(result))
    if not args.no_record:
        record(result, args)
    return 0


def summary(found: dict[str, list[float]], words: dict[str, list], seconds: float) -> dict:
    """The medians, their ratios to ``estimated``, and how the ways' words compare."""
    median = {way: statistics.median(found[way]) for way in WAYS}
    texts = {way: [w.text for w in words[way]] for way in WAYS}
    same = texts["timer"] == texts["shared"]
    apart = [
        max(abs(a.start - b.start), abs(a.end - b.end)) for a, b in zip(words["timer"], words["shared"], strict=False)
    ]
    return {
        "audio_seconds": round(seconds, 1),
        "cpu_per_audio_second": {way: round(median[way], 4) for way in WAYS},
        "over_estimated": {way: round(median[way] / median["estimated"], 3) for way in WAYS},
        "rounds": {way: [round(v, 4) for v in found[way]] for way in WAYS},
        "words": {way: len(texts[way]) for way in WAYS},
        "same_words_timer_shared": same,
        "same_words_estimated_shared": texts["estimated"] == texts["shared"],
        "aligned_share": {way: sum(w.aligned for w in words[way]) / max(1, len(words[way])) for way in WAYS},
        "times_apart_median_s": round(statistics.median(apart), 3) if apart else None,
        "times_apart_max_s": round(max(apart), 3) if apart else None,
    }


def record(result: dict, args) -> None:
    from record import append_run

    what = "one committing step's work on a buffer of" if args.one_step else "SpeechStream over"
    notes = (
        f"Whisper tiny.en; {what} {result['audio_seconds']:g} s of joined natural speech "
        "(bench/joined_speech.py, seed 0)"
        + ("" if args.one_step else " in 1 s chunks")
        + "; CPU seconds of the process (time.process_time) per second "
        f"of audio, median of {args.rounds} interleaved rounds" + (f"; {args.note}" if args.note else "")
    )
    ratio = result["over_estimated"]
    append_run(
        "stream_timing",
        [
            {
                "metric": ("one committing step's" if args.one_step else "stream")
                + " compute with aligned word times, shared encoder output, x estimated times",
                "figure": ratio["shared"],
                "unit": "x",
                "peer": "the separate timer (timer_of: encoder and decoder again on each committing step)",
                "peer_figure": ratio["timer"],
                "details": result,
                "notes": notes,
            }
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
