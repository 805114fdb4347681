"""Streamed speech recognition over ``/v1/audio/stream`` (issue 44, section 6): how long after a
word is spoken its final text arrives, and the WER of streaming beside offline decoding.

    bash bench/fetch_whisper_tiny.sh                        # Whisper tiny.en into /tmp/whisper-tiny.en
    python bench/stream_asr.py                              # ~60 s of joined FSDD digits, real time
    python bench/stream_asr.py --clips 20 --speed 2         # shorter, replayed twice as fast

The audio: ``--clips`` FSDD recordings (two speakers, shuffled with ``--seed``) joined with
``--gap`` seconds of silence, so every word's end is known (a clip's end: FSDD's clips are cut
close to the voice). A ``qkv serve --model DIR`` starts on a free loopback port (``--model``: a
qkv model directory; default: Whisper tiny.en imported from ``--hf``); a client (``websockets``)
sends the audio as 16 kHz s16le in ``--chunk``-second messages, paced at ``--speed`` times real
time, then ``{"type": "end"}``, while it reads the server's messages.

Delay of a word: the wall time its final arrived minus the wall time it ended being spoken (the
audio "plays" from the start, each message sent once its chunk has played, as a microphone's;
a word of the transcript matched to a spoken one by aligning the two word lists, digits written
as words). Reported: median, 90th percentile and largest delay, seconds of wall time; the
stream's WER and, from the same model in this process on the same audio, the offline WER: the
whole file decoded at once by the stream's own decoding function (an imported Whisper long-form,
greedy, no temperature fallback, a window that repeats itself left out), so the two differ by the
policy alone. (Whisper's fallback, five samples at each higher temperature, made the trailing half
second of silence of one file take minutes on a shared machine: too slow for a stream's step.) Appends the figures to
``bench/results/stream_asr.json`` (bench/record.py); ``--no-record`` prints only.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
from serving import serving  # noqa: E402

RATE = 16_000
DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def fsdd() -> Path:
    return Path(os.environ.get("QKV_DATA", ROOT.parent / "shared" / "data")) / "fsdd" / "recordings"


def joined_digits(clips: int, gap: float, seed: int):
    """FSDD clips (jackson's and theo's, shuffled) joined with ``gap`` s of silence: the waveform
    (Y,), the spoken words, and each word's end in seconds."""
    import torch

    from qkv.audio import load_audio

    files = sorted(fsdd().glob("*_jackson_[0-9].wav")) + sorted(fsdd().glob("*_theo_[0-9].wav"))
    if not files:
        raise SystemExit(f"stream_asr: no FSDD recordings in {fsdd()} (set QKV_DATA)")
    random.Random(seed).shuffle(files)
    pieces, words, ends, at = [torch.zeros(round(gap * RATE))], [], [], round(gap * RATE)
    for f in files[:clips]:
        clip = load_audio(f, sample_rate=RATE)
        at += clip.numel()
        pieces += [clip, torch.zeros(round(gap * RATE))]
        words.append(DIGITS[int(f.name[0])])
        ends.append(at / RATE)
        at += round(gap * RATE)
    return torch.cat(pieces), words, ends


def digit_words(text: str) -> list[str]:
    """A transcript's words, each digit written as its word (Whisper writes "5" or "five")."""
    return [DIGITS[int(c)] if c.isdigit() else c for c in re.findall(r"\d|[a-z]+", text.lower())]


def stream(url: str, wave, *, chunk: float, speed: float) -> tuple[list[tuple[float, str]], float]:
    """Send ``wave`` over the WebSocket as a microphone would, at ``speed`` times real time (each
    ``chunk`` once it has "played"); each final's arrival (wall seconds from the start) and text,
    and when the audio started (monotonic)."""
    from websockets.sync.client import connect

    pcm = (wave.clamp(-1, 1) * 32767).round().short().numpy().astype("<i2")
    step = round(chunk * RATE)
    finals: list[tuple[float, str]] = []
    with connect(url, max_size=None) as client:
        began = time.monotonic()

        def send() -> None:
            for k, i in enumerate(range(0, len(pcm), step)):
                wait = began + (k + 1) * chunk / speed - time.monotonic()  # as a microphone has it: once recorded
                if wait > 0:
                    time.sleep(wait)
                client.send(pcm[i : i + step].tobytes())
            client.send(json.dumps({"type": "end"}))

        sender = threading.Thread(target=send)
        sender.start()
        for message in client:
            event = json.loads(message)
            if event["type"] == "final":
                finals.append((time.monotonic() - began, event["text"]))
            elif event["type"] == "error":
                raise SystemExit(f"stream_asr: the server refused the stream: {event['error']}")
        sender.join()
    return finals, began


def delays(finals: list[tuple[float, str]], words: list[str], ends: list[float], speed: float) -> list[float]:
    """Each spoken word matched in the streamed transcript: its final's arrival minus the wall
    time it ended being spoken (its end in the audio / speed; the audio "plays" from the start)."""
    said, arrived = [], []
    for t, text in finals:
        for w in digit_words(text):
            said.append(w)
            arrived.append(t)
    out = []
    for block in difflib.SequenceMatcher(a=words, b=said, autojunk=False).get_matching_blocks():
        for k in range(block.size):
            out.append(arrived[block.b + k] - ends[block.a + k] / speed)
    return out


def offline_text(bundle, wave) -> str:
    """The whole file decoded at once by the stream's own decoding function
    (``speech_streaming.decoder_of``: an imported Whisper long-form, greedy with its timestamps,
    no temperature fallback, windows that repeat themselves left out), so that the two figures
    differ by the streaming policy alone."""
    from qkv.speech_streaming import decoder_of

    return " ".join(s.text for s in decoder_of(bundle)(wave, ""))


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="a qkv speech model directory (default: --hf imported)")
    parser.add_argument("--hf", type=Path, default=Path("/tmp/whisper-tiny.en"), help="a Hugging Face Whisper")
    parser.add_argument("--clips", type=int, default=40, help="FSDD clips joined (default: 40, about 60 s)")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds of silence between clips (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="the clips' shuffle (default: 0)")
    parser.add_argument("--chunk", type=float, default=0.1, help="seconds of audio a message (default: 0.1)")
    parser.add_argument("--speed", type=float, default=1.0, help="times real time the audio is sent (default: 1)")
    parser.add_argument("--note", default="", help="the conditions, for the record's notes (e.g. a shared machine)")
    parser.add_argument("--no-record", action="store_true", help="print only; append nothing to bench/results")
    args = parser.parse_args(argv)
    if not 1 <= args.clips <= 1000 or not 0 < args.speed <= 100 or not 0.01 <= args.chunk <= 5 or args.gap < 0:
        parser.error("--clips must be 1..1000, --speed 0..100, --chunk 0.01..5 s, --gap >= 0")
    import qkv
    from qkv.evaluation import error_rates

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from qkv.hf.convert import import_hf

            if not (args.hf / "model.safetensors").is_file():
                raise SystemExit(f"stream_asr: no {args.hf}: run bash bench/fetch_whisper_tiny.sh")
            model = Path(tmp) / "whisper"
            import_hf(args.hf, model)
        wave, words, ends = joined_digits(args.clips, args.gap, args.seed)
        seconds = wave.numel() / RATE
        with serving("stream_asr", model) as (_, url):
            print(f"stream_asr: {seconds:.1f} s of audio, {len(words)} words, at {args.speed:g}x ...", flush=True)
            ws = url.replace("http://", "ws://", 1)
            began = time.monotonic()
            finals, _ = stream(f"{ws}/v1/audio/stream", wave, chunk=args.chunk, speed=args.speed)
            stream_wall = time.monotonic() - began
        streamed = digit_words(" ".join(text for _, text in finals))
        print(f"stream_asr: streamed in {stream_wall:.1f} s: {' '.join(streamed)}", flush=True)
        bundle = qkv.load(model)
        began = time.monotonic()
        offline = digit_words(offline_text(bundle, wave))
        offline_wall = time.monotonic() - began
    truth = " ".join(words)
    wer = {
        name: error_rates([" ".join(hyp)], [truth])["wer"] for name, hyp in (("stream", streamed), ("offline", offline))
    }
    late = delays(finals, words, ends, args.speed)
    result = {
        "audio_seconds": round(seconds, 1),
        "words": len(words),
        "matched_words": len(late),
        "speed": args.speed,
        "chunk_seconds": args.chunk,
        "delay_median_s": round(statistics.median(late), 3) if late else None,
        "delay_p90_s": round(percentile(late, 90), 3) if late else None,
        "delay_max_s": round(max(late), 3) if late else None,
        "stream_wer": round(wer["stream"], 4),
        "offline_wer": round(wer["offline"], 4),
        "finals": len(finals),
        "stream_wall_s": round(stream_wall, 1),
        "offline_wall_s": round(offline_wall, 1),
    }
    print(json.dumps(result))
    if not args.no_record:
        record(result, args, model)
    return 0


def record(result: dict, args, model: Path) -> None:
    from record import append_run

    where = "Whisper tiny.en (imported)" if args.model is None else f"model {args.model}"
    setting = f"{result['audio_seconds']:g} s of joined FSDD digits at {args.speed:g}x real time"
    notes = (
        f"{where}; {setting}, {args.chunk:g} s messages, min_chunk 1 s (LocalAgreement-2); delay: a word's final "
        "arriving minus the wall time it ended being spoken (each message sent once its audio has played), "
        "wall seconds; loopback" + (f"; {args.note}" if args.note else "")
    )
    details = {k: v for k, v in result.items() if k not in ("delay_median_s", "stream_wer")}
    append_run(
        "stream_asr",
        [
            {
                "metric": f"streaming delay, end of word to its final, median ({setting})",
                "figure": result["delay_median_s"],
                "unit": "s",
                "details": details,
                "notes": notes,
            },
            {
                "metric": f"streaming WER ({setting})",
                "figure": result["stream_wer"],
                "unit": "WER",
                "peer": "the same audio decoded whole by the stream's decoding (long-form, greedy, no fallback)",
                "peer_figure": result["offline_wer"],
                "details": details,
                "notes": notes,
            },
        ],
    )


if __name__ == "__main__":
    raise SystemExit(main())
