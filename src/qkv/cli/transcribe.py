"""``qkv transcribe``: audio files in, text out, with a speech model (trained with an ``asr``
recipe, or an imported Whisper).

What is here: the command's arguments (``add_parser``) beside its handler, which parses, calls
the library's job (``bundle.read_audio``, ``bundle.transcriptions``: reading, features, an
imported Whisper's start tokens and languages, decoding) and prints.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from qkv.cli.common import Output, add_constraints, add_precision, number, positive_int, read_input_lines
from qkv.errors import UserError

LM_WEIGHT = 0.3  # bundle.LM_WEIGHT, the library's default (the help says it without importing torch)
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".oga", ".mp3", ".aiff", ".aif")

EPILOG_TRANSCRIBE = """examples:
  qkv transcribe --model runs/fsdd_digits ../shared/data/fsdd/recordings/7_theo_0.wav
  qkv transcribe --model runs/fsdd_digits recordings/ --output transcripts.tsv   # every audio file in a folder
  qkv transcribe --model runs/speech_en --input files.txt --beam 8 --ctc-weight 0.5 --json
  qkv transcribe --model runs/speech_en --lm runs/speech_en_lm --lm-weight 0.3 talk.wav   # with a language model
  qkv transcribe --model whisper-tiny --language de --task translate talk.flac   # an imported Whisper
  find calls -name '*.wav' | qkv transcribe --model runs/speech_en --input - --skip-bad
  qkv transcribe --model runs/speech_en --ctc-weight 0 --require Zurich --ban um talk.wav   # constraints

Each line of output is PATH<TAB>TEXT; with --json one JSON object per file (path, text,
audio_seconds, load_seconds, decode_seconds), and a summary line on stderr.
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


def cmd_transcribe(args: argparse.Namespace) -> int:
    from qkv.bundle import load, read_audio, transcriptions
    from qkv.progress import progress

    paths = audio_paths(args.files, args.input)
    bundle = load(args.model, bf16=args.bf16, int8=args.int8, job="transcribe")
    out = Output(args.output)
    good, bad = read_audio(bundle, paths, max_seconds=args.max_seconds)
    if bad and not args.skip_bad:
        for path, why in bad:  # every bad file named, a line each, however many there are
            print(f"qkv transcribe: {path}: {why}", file=sys.stderr)
        raise UserError(
            f"{len(bad)} of {len(paths)} files cannot be transcribed (each named above); "
            "--skip-bad transcribes the rest"
        )
    for path, why in bad:
        print(f"qkv transcribe: skipped {path}: {why}", file=sys.stderr)
    start = time.perf_counter()
    bar = progress(len(good), desc="qkv transcribe", unit="file", disable=args.quiet or len(good) < 2)
    found = transcriptions(
        bundle,
        [wave for _, wave in good],
        beam_size=args.beam,
        ctc_weight=args.ctc_weight,
        ctc_only=args.ctc_only,
        lm=args.lm,
        lm_weight=args.lm_weight,
        language=args.language,
        task=args.task,
        batch_size=args.batch_size if args.batch_size else 32,
        on_batch=bar.update,
        prefix=args.prefix,
        ban=args.ban,
        require=args.require,
    )
    bar.close()
    elapsed = time.perf_counter() - start
    detected = sorted({t.language for t in found if t.language is not None})
    if args.language is None and detected:  # a multilingual Whisper's languages, as found
        print(
            f"qkv transcribe: detected language{'s' if len(detected) > 1 else ''} {', '.join(detected)}",
            file=sys.stderr,
        )
    audio_seconds = [wave.numel() / bundle.sample_rate for _, wave in good]
    for (path, _), heard, seconds in zip(good, found, audio_seconds, strict=True):
        if args.json:
            record = {
                "path": str(path),
                "text": heard.text,
                "audio_seconds": round(seconds, 3),
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
    total = sum(audio_seconds)
    skipped = f", {len(bad)} skipped" if bad else ""
    files = f"{len(good)} file{'s' if len(good) != 1 else ''}"
    print(
        f"qkv transcribe: {files} ({total:.1f} s of audio){skipped} in {elapsed:.1f} s, "
        f"{total / max(elapsed, 1e-9):.1f}x real time",
        file=sys.stderr,
    )
    return 0


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
    p.add_argument("--output", help="write PATH<TAB>TEXT lines here (atomically) instead of stdout")
    p.add_argument("--beam", type=positive_int, default=4, help="beam size (1: greedy; default 4)")
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
        default=60.0,
        help="refuse files longer than this (default 60)",
    )
    p.add_argument("--skip-bad", action="store_true", help="name unreadable files on stderr and transcribe the rest")
    p.add_argument("--language", help="Whisper: the spoken language's code (e.g. en, de); multilingual models only")
    p.add_argument("--task", choices=("transcribe", "translate"), help="Whisper: transcribe, or translate to English")
    p.add_argument("--json", action="store_true", help="one JSON object per file, with timings")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_constraints(p)
    add_precision(p)
    p.set_defaults(run=cmd_transcribe)
