"""``qkv transcribe``: audio files in, text out, with a speech model (trained with an ``asr``
recipe, or an imported Whisper).

What is here: the command's arguments (``add_parser``) beside its handler, which parses (the
flags as the job's options: ``_options``), calls the library's job (``bundle.read_audio``,
``bundle.transcriptions``: reading, features, an imported Whisper's start tokens and languages,
decoding) and prints (``_write_transcripts``, and subtitle files by ``--format``). What is not
here: any decoding or reading of audio (``qkv.bundle``), the subtitle formats (``qkv.subtitles``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from qkv.cli.common import (
    Output,
    add_constraints,
    add_precision,
    add_threads,
    number,
    positive_int,
    read_input_lines,
    use_threads,
)
from qkv.errors import UserError

if TYPE_CHECKING:
    from qkv.bundle import TranscriptionOptions

LM_WEIGHT = 0.3  # bundle.LM_WEIGHT, the library's default (the help says it without importing torch)
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".oga", ".mp3", ".aiff", ".aif")

EPILOG_TRANSCRIBE = """examples:
  qkv transcribe --model runs/fsdd_digits ../shared/data/fsdd/recordings/7_theo_0.wav
  qkv transcribe --model runs/fsdd_digits recordings/ --output transcripts.tsv   # every audio file in a folder
  qkv transcribe --model runs/speech_en --input files.txt --beam 8 --ctc-weight 0.5 --json
  qkv transcribe --model runs/speech_en --lm runs/speech_en_lm --lm-weight 0.3 talk.wav   # with a language model
  qkv transcribe --model whisper-tiny --language de --task translate talk.flac   # an imported Whisper
  qkv transcribe --model whisper-base --multilingual --format srt interview.wav   # each window's language
  find calls -name '*.wav' | qkv transcribe --model runs/speech_en --input - --skip-bad
  qkv transcribe --model runs/speech_en --ctc-weight 0 --require Zurich --ban um talk.wav   # constraints
  qkv transcribe --model whisper-tiny.en lecture.mp3 --format srt --output-dir subtitles/   # any length
  qkv transcribe --model whisper-tiny.en recordings/ --format txt --output hyp.txt   # for evaluate --wer
  qkv transcribe --model whisper-tiny.en meeting.flac --format vtt --threads 2   # two CPU threads
  qkv transcribe --model runs/speech_en lecture.wav --format srt --vad silero   # cut by Silero VAD
  qkv transcribe --model whisper-tiny.en talk.wav --word-timestamps --format json   # each word's times
  qkv transcribe --model whisper-tiny.en talk.wav --word-timestamps --format srt --max-words-per-line 3
  qkv transcribe --model whisper-tiny.en lecture.mp3 --batched 8 --format srt   # speech chunks 8 at a time

Each line of output is PATH<TAB>TEXT; with --json one JSON object per file (path, text,
audio_seconds, load_seconds, decode_seconds), and a summary line on stderr. --format txt writes
one line per file, its text alone (what `qkv evaluate --hyp FILE --wer` reads, line by line);
--format json one JSON object per file (path, text, language, segments with start and end in
seconds); tsv (start and end in ms), srt and vtt hold one file's segments: with several files,
give --output-dir, which writes one file per input (NAME.FORMAT, as the Whisper CLI does).
--word-timestamps times each word (Whisper's alignment heads and dynamic time warping, as
openai/whisper): json segments get "words" [{word, start, end, probability}], and srt/vtt cues
of at most --max-words-per-line words each.

An imported Whisper decodes greedily, with its checkpoint's suppressed tokens and, for times,
its timestamp rules, as transformers' generate does; audio longer than 30 s (and any audio with
times: --format tsv/json/srt/vtt or --output-dir) is read in 30 s windows moving by the last
timestamp, each window after the previous text, with temperature fallback (0, 0.2, ... 1.0;
5 samples each) where the text repeats itself (gzip compression ratio > 2.4) or is unlikely
(mean log-probability < -1), and a window skipped as silence where no-speech probability > 0.6
and the log-probability is below -1: openai/whisper's transcribe defaults. A model of qkv's own
reads a file longer than 30 s piece by piece, cut where voice activity stops (an energy
detector; --vad silero: Silero VAD), each piece a segment with its times. --batched N reads a
Whisper's long audio as faster-whisper's batched pipeline does: the speech --vad finds, merged
into chunks of at most 30 s, N chunks decoded at once, none after the previous text (faster on
long files; the sequential windows stay the default, as in faster-whisper). Files are read a
block at a time, so memory does not grow with their length; progress is counted in seconds of
audio.
"""


def audio_paths(files: list[str], listing: str | None) -> list[Path]:
    """The files to transcribe, in order: those named (a folder: its audio files, sorted), then
    those listed one per line in ``listing`` ("-": stdin)."""
    paths: list[Path] = []
    for name in files:
        path = Path(name)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix.lower() in AUDIO_SUFFIXES and p.is_file())
            if not found:
                raise UserError(f"{path} holds no audio files ({', '.join(AUDIO_SUFFIXES)})")
            paths += found
        else:
            paths.append(path)
    if listing is not None:
        paths += [Path(line.strip()) for line in read_input_lines(listing) if line.strip()]
    if not paths:
        raise UserError("no audio files: name some, a folder, or --input LIST")
    return paths


def _check_format(args: argparse.Namespace, paths: list[Path]) -> None:
    """Refuse a format that holds one file's segments for several files without --output-dir."""
    if args.output_dir is not None and args.output is not None:
        raise UserError("give --output (one file for all inputs) or --output-dir (one file per input), not both")
    if args.format in ("tsv", "srt", "vtt") and args.output_dir is None and len(paths) > 1:
        raise UserError(
            f"--format {args.format} holds one file's segments: give --output-dir DIR for {len(paths)} files"
        )
    if args.json and args.format is not None:
        raise UserError("give --json (lines with timings) or --format, not both")
    if args.max_words_per_line is not None and not (args.word_timestamps and args.format in ("srt", "vtt")):
        raise UserError(
            "--max-words-per-line cuts srt and vtt cues by timed words: give --word-timestamps and --format srt or vtt"
        )
    if args.output_dir is not None:
        stems = [p.stem for p in paths]
        twice = sorted({s for s in stems if stems.count(s) > 1})
        if twice:
            raise UserError(f"--output-dir: several inputs are named {', '.join(twice)}; each needs its own name")


def _options(args: argparse.Namespace, timed: bool, prompt: tuple[int, ...]) -> TranscriptionOptions:
    """The flags as ``bundle.transcriptions``' options (``timed``: read an imported Whisper's
    inputs window by window; ``prompt``: its initial prompt's ids)."""
    from qkv.bundle import OwnModelOptions, TranscriptionOptions, WhisperOptions
    from qkv.longform import LongForm
    from qkv.vad import Vad

    long_form = LongForm(
        initial_prompt=prompt,
        word_timestamps=args.word_timestamps,
        multilingual=args.multilingual,
        temperatures=(0.0,) if args.no_fallback else LongForm.temperatures,
    )
    return TranscriptionOptions(
        beam_size=args.beam,
        lm=args.lm,
        lm_weight=args.lm_weight,
        prefix=args.prefix,
        ban=args.ban,
        require=args.require,
        batch_size=args.batch_size or TranscriptionOptions.batch_size,
        vad=Vad(detector=args.vad),
        whisper=WhisperOptions(
            language=args.language, task=args.task, timestamps=timed, long_form=long_form, batched=args.batched
        ),
        own=OwnModelOptions(ctc_weight=args.ctc_weight, ctc_only=args.ctc_only),
    )


def cmd_transcribe(args: argparse.Namespace) -> int:
    from qkv.bundle import load, transcriptions
    from qkv.bundle.transcription import initial_prompt
    from qkv.progress import progress

    paths = audio_paths(args.files, args.input)
    args.format = args.format or ("txt" if args.output_dir is not None else None)
    _check_format(args, paths)
    use_threads(args.threads)
    bundle = load(args.model, bf16=args.bf16, int8=args.int8, job="transcribe")
    if args.initial_prompt is not None and bundle.whisper is None:
        raise UserError("--initial-prompt is for an imported Whisper")
    if args.word_timestamps and bundle.whisper is None:
        raise UserError("--word-timestamps is for an imported Whisper")
    timed = bundle.whisper is not None and (args.format not in (None, "txt") or args.output_dir is not None)
    prompt = () if args.initial_prompt is None else initial_prompt(bundle, args.initial_prompt)
    out = Output(args.output)
    good, bad = _readable(bundle, paths, skip_bad=args.skip_bad, max_seconds=args.max_seconds)
    start = time.perf_counter()
    timed = timed or bool(prompt) or args.word_timestamps or args.multilingual
    chunk = bundle.features.chunk_seconds if bundle.whisper is not None else None
    seconds = [source.seconds for _, source in good]
    windowed = sum(s for s in seconds if chunk is not None and (timed or s > chunk))
    if windowed:  # progress in seconds of audio read window by window
        bar = progress(round(windowed), desc="qkv transcribe", unit="s", disable=args.quiet)
    else:
        bar = progress(len(good), desc="qkv transcribe", unit="file", disable=args.quiet or len(good) < 2)
    found = transcriptions(
        bundle,
        [source for _, source in good],
        _options(args, timed, prompt),
        on_batch=None if windowed else bar.update,
        on_seconds=whole_seconds(bar.update) if windowed else None,
    )
    bar.close()
    elapsed = time.perf_counter() - start
    if args.language is None:
        _say_detected(found)
    _write_transcripts(args, out, good, found, bad)
    total = sum(seconds)
    skipped = f", {len(bad)} skipped" if bad else ""
    files = f"{len(good)} file{'s' if len(good) != 1 else ''}"
    print(
        f"qkv transcribe: {files} ({total:.1f} s of audio){skipped} in {elapsed:.1f} s, "
        f"{total / max(elapsed, 1e-9):.1f}x real time",
        file=sys.stderr,
    )
    return 0


def _readable(bundle, paths: list[Path], *, skip_bad: bool, max_seconds: float | None) -> tuple[list, list]:
    """The files the model can read and the others, with why (``bundle.read_audio``): each of
    those named on stderr, skipped with ``skip_bad``, else refused together in one line."""
    from qkv.bundle import read_audio

    good, bad = read_audio(bundle, paths, max_seconds=max_seconds)
    if bad and not skip_bad:
        for path, why in bad:  # every bad file named, a line each, however many there are
            print(f"qkv transcribe: {path}: {why}", file=sys.stderr)
        raise UserError(
            f"{len(bad)} of {len(paths)} files cannot be transcribed (each named above); "
            "--skip-bad transcribes the rest"
        )
    for path, why in bad:
        print(f"qkv transcribe: skipped {path}: {why}", file=sys.stderr)
    return good, bad


def _say_detected(found: list) -> None:
    """The languages a multilingual Whisper detected (its inputs' and windows'), on stderr; none: nothing."""
    detected = sorted(({t.language for t in found} | {s.language for t in found for s in t.segments}) - {None})
    if detected:
        print(
            f"qkv transcribe: detected language{'s' if len(detected) > 1 else ''} {', '.join(detected)}",
            file=sys.stderr,
        )


def _write_transcripts(args: argparse.Namespace, out: Output, good: list, found: list, bad: list) -> None:
    """Each good file's transcript (``found``, in order) as ``--format``, ``--json`` (then a line
    for each bad file) or PATH<TAB>TEXT lines; ``out`` closed after."""
    from qkv.subtitles import Heard

    for (path, source), heard in zip(good, found, strict=True):
        if args.format is not None:
            _write_format(args, out, path, Heard(heard.text, heard.segments, heard.language))
        elif args.json:
            record = {
                "path": str(path),
                "text": heard.text,
                "audio_seconds": round(source.seconds, 3),
                "load_seconds": round(heard.feature_seconds, 4),
                "decode_seconds": round(heard.decode_seconds, 4),
            }
            out.write(json.dumps(record, ensure_ascii=False))
        else:
            out.write(f"{path}\t{heard.text}")
    if args.json:
        for path, why in bad:
            out.write(json.dumps({"path": str(path), "error": why}, ensure_ascii=False))
    out.close()


def whole_seconds(update: Callable[[int], object]) -> Callable[[float], None]:
    """``update(n)`` in whole seconds of audio, given the windows' seconds (fractions kept until
    they add up to one): a progress bar or log line counts seconds, not 0.02-second steps."""
    done = [0.0, 0]  # seconds read, seconds reported

    def report(seconds: float) -> None:
        done[0] += seconds
        if (step := int(done[0]) - done[1]) > 0:
            update(step)
            done[1] += step

    return report


def _write_format(args: argparse.Namespace, out: Output, path: Path, heard) -> None:
    """One input's transcript in ``args.format``: its own file in --output-dir, else a line (txt:
    the text; json: an object) or, for one input, the whole file to the output."""
    from qkv.files import write_atomic
    from qkv.subtitles import record, render

    if args.output_dir is not None:
        folder = Path(args.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        text = render(args.format, heard, max_words=args.max_words_per_line)
        write_atomic(folder / f"{path.stem}.{args.format}", text.encode())
    elif args.format == "txt":
        out.write(" ".join(heard.text.split()))
    elif args.format == "json":
        out.write(json.dumps({"path": str(path), **dataclasses.asdict(record(heard))}, ensure_ascii=False))
    else:
        out.write(render(args.format, heard, max_words=args.max_words_per_line).rstrip("\n"))


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``transcribe`` command's arguments."""
    p = sub.add_parser(
        "transcribe",
        help="speech to text: transcribe (or translate) audio files with a speech model",
        description="Transcribe audio files (WAV, FLAC, OGG, ... at any sample rate; mixed to mono and "
        "resampled) with a speech model: one trained with an asr recipe, or an imported Whisper.",
        epilog=EPILOG_TRANSCRIBE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="speech model directory (or a training run)")
    p.add_argument("files", nargs="*", help="audio files, or folders of them")
    p.add_argument("--input", help="a file listing audio paths, one per line ('-': stdin)")
    p.add_argument("--output", help="write the output here (atomically) instead of stdout")
    p.add_argument(
        "--format",
        choices=("txt", "tsv", "json", "srt", "vtt"),
        help="txt: a line of text per file (what evaluate --wer reads); json, tsv, srt, vtt: segments with times "
        "(default: PATH<TAB>TEXT lines)",
    )
    p.add_argument("--output-dir", help="write one file per input here, NAME.FORMAT (--format; default txt)")
    p.add_argument(
        "--beam",
        type=positive_int,
        help="beam size (1: greedy; default: the recipe's, else 4; an imported Whisper: 1, greedy, as Whisper and "
        "transformers decode)",
    )
    p.add_argument(
        "--ctc-weight",
        type=number(float, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        default=0.0,
        help="joint CTC/attention decoding: weight of the CTC prefix score (needs a CTC head; default 0)",
    )
    p.add_argument("--ctc-only", action="store_true", help="CTC best-path decoding alone (no decoder; fastest)")
    p.add_argument(
        "--lm",
        help="a language model of the speech model's tokens (lm task, data.tokenizer=the speech model) "
        "fused into the beam search",
    )
    p.add_argument(
        "--lm-weight",
        type=number(float, lambda v: v >= 0, "a number >= 0"),
        help=f"weight of the --lm log-probabilities (default {LM_WEIGHT})",
    )
    p.add_argument("--batch-size", type=positive_int, help="files decoded at once (default 32)")
    p.add_argument(
        "--max-seconds",
        type=number(float, lambda v: v > 0, "a positive number of seconds"),
        help="refuse files longer than this (default: no limit: an imported Whisper reads 30 s windows, other models "
        "pieces of at most 30 s cut where voice activity stops)",
    )
    p.add_argument(
        "--no-fallback",
        action="store_true",
        help="Whisper, window by window: decode each window once, greedily (no temperature fallback; faster)",
    )
    p.add_argument(
        "--initial-prompt",
        help="Whisper: text read before the first window (spellings, names, style); decodes with timestamps",
    )
    p.add_argument(
        "--multilingual",
        action="store_true",
        help="a multilingual Whisper without --language: detect each 30 s window's language and decode it in that "
        "one (faster-whisper's multilingual; default: the first window's for the whole file, as openai/whisper)",
    )
    p.add_argument(
        "--vad",
        choices=("energy", "silero"),
        default="energy",
        help="qkv's own models, files over 30 s, and Whisper with --batched: how voice activity is found, to cut "
        "them into pieces (default energy; silero: Silero VAD's ONNX model, pip install silero-vad)",
    )
    p.add_argument(
        "--batched",
        type=positive_int,
        metavar="N",
        help="Whisper, long audio (and any with times): its speech (found by --vad) in chunks of at most 30 s, N "
        "decoded at once, no previous text (faster-whisper's batched pipeline; default: 30 s windows in turn)",
    )
    p.add_argument(
        "--word-timestamps",
        action="store_true",
        help="Whisper: time each word (json: segments' words; srt/vtt: see --max-words-per-line)",
    )
    p.add_argument(
        "--max-words-per-line",
        type=positive_int,
        help="with --word-timestamps and --format srt or vtt: a cue per run of at most this many words",
    )
    p.add_argument("--skip-bad", action="store_true", help="name unreadable files on stderr and transcribe the rest")
    p.add_argument("--language", help="Whisper: the spoken language's code (e.g. en, de); multilingual models only")
    p.add_argument("--task", choices=("transcribe", "translate"), help="Whisper: transcribe, or translate to English")
    p.add_argument("--json", action="store_true", help="one JSON object per file, with timings")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_constraints(p)
    add_precision(p)
    add_threads(p)
    p.set_defaults(run=cmd_transcribe)
