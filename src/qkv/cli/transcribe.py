"""``qkv transcribe``: audio files in, text out, with a speech model (trained with an ``asr``
recipe, or an imported Whisper).

What is here: the command's arguments (``add_parser``) beside its handler. The decoding is
``tasks.asr.transcribe``'s; reading audio and features ``qkv.audio``'s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from qkv.cli.common import Output, add_precision, number, positive_int, read_input_lines
from qkv.errors import UserError

LM_WEIGHT = 0.3  # ESPnet's usual shallow-fusion weight; bench/asr.py --lm-weight measures others
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".oga", ".mp3", ".aiff", ".aif")

EPILOG_TRANSCRIBE = """examples:
  qkv transcribe --model runs/fsdd_digits ../shared/data/fsdd/recordings/7_theo_0.wav
  qkv transcribe --model runs/fsdd_digits recordings/ --output transcripts.tsv   # every audio file in a folder
  qkv transcribe --model runs/speech_en --input files.txt --beam 8 --ctc-weight 0.5 --json
  qkv transcribe --model runs/speech_en --lm runs/speech_en_lm --lm-weight 0.3 talk.wav   # with a language model
  qkv transcribe --model whisper-tiny --language de --task translate talk.flac   # an imported Whisper
  find calls -name '*.wav' | qkv transcribe --model runs/speech_en --input - --skip-bad

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
    from qkv.audio import features, load_many
    from qkv.checkpoint import model_dir, read_meta
    from qkv.loading import load_for_generation, load_fusion_lm
    from qkv.progress import progress
    from qkv.tasks.asr import too_short, transcribe

    paths = audio_paths(args.files, args.input)
    model, vocab = load_for_generation(args.model, bf16=args.bf16, int8=args.int8, speech=True)
    whisper = "whisper" in read_meta(model_dir(args.model))
    if args.lm_weight is not None and args.lm is None:
        raise UserError("--lm-weight weighs the language model of --lm; name one")
    lm = None if args.lm is None else load_fusion_lm(args.lm, vocab.target, model=model, bf16=args.bf16)
    if not whisper and (args.language is not None or args.task is not None):
        raise UserError("--language and --task apply to imported Whisper models only")
    out = Output(args.output)
    config = model.config.features
    longest = args.max_seconds
    if config.kind == "whisper":  # one chunk is all a Whisper encoder reads
        longest = min(longest, config.chunk_seconds)
    good, bad = load_many(paths, sample_rate=config.sample_rate, max_seconds=longest, skip_bad=True)
    short = [(p, w) for p, w in good if too_short(model, config.frames(w.numel()))]
    if short:  # a file too short for the front-end is a bad file like the rest
        good = [(p, w) for p, w in good if not too_short(model, config.frames(w.numel()))]
        bad += [(p, f"{1000 * w.numel() / config.sample_rate:.0f} ms is too short for this model") for p, w in short]
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
    feats, load_seconds = [], []
    for _, wave in good:
        t = time.perf_counter()
        feats.append(features(wave, config))
        load_seconds.append(time.perf_counter() - t)
    groups = _prefix_groups(args, model, feats) if whisper else {None: list(range(len(feats)))}
    bar = progress(len(good), desc="qkv transcribe", unit="file", disable=args.quiet or len(good) < 2)
    results: list = [None] * len(feats)
    decode_seconds = [0.0] * len(feats)
    for prefix, rows in groups.items():
        batch_seconds: list[float] = []
        last = [time.perf_counter()]

        def done(n: int, batch_seconds=batch_seconds, last=last) -> None:  # a batch's files share its time
            now = time.perf_counter()
            batch_seconds.extend([(now - last[0]) / n] * n)
            last[0] = now
            bar.update(n)

        texts = transcribe(
            model,
            vocab.target,
            [feats[i] for i in rows],
            beam_size=args.beam,
            ctc_weight=args.ctc_weight,
            ctc_only=args.ctc_only,
            batch_size=args.batch_size if args.batch_size else 32,
            prefix=list(prefix) if prefix is not None else None,
            on_batch=done,
            lm=lm,
            lm_weight=LM_WEIGHT if args.lm_weight is None else args.lm_weight,
        )
        # transcribe decodes in length order: the batch times, in that order, map back to the files.
        order = sorted(range(len(rows)), key=lambda j: feats[rows[j]].shape[0])
        for j, seconds in zip(order, batch_seconds, strict=True):
            decode_seconds[rows[j]] = seconds
        for j, text in enumerate(texts):
            results[rows[j]] = text
    bar.close()
    elapsed = time.perf_counter() - start
    audio_seconds = [wave.numel() / config.sample_rate for _, wave in good]
    for i, ((path, _), result) in enumerate(zip(good, results, strict=True)):
        text = result.text.strip()
        if args.json:
            record = {
                "path": str(path),
                "text": text,
                "audio_seconds": round(audio_seconds[i], 3),
                "load_seconds": round(load_seconds[i], 4),
                "decode_seconds": round(decode_seconds[i], 4),
            }
            out.write(json.dumps(record, ensure_ascii=False))
        else:
            out.write(f"{path}\t{text}")
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


def _prefix_groups(args: argparse.Namespace, model, feats: list) -> dict[tuple[int, ...], list[int]]:
    """An imported Whisper's start tokens, and the files that take them: ``--language`` and
    ``--task`` for all, or for a multilingual model without ``--language`` each file's own
    language, detected as Whisper does (and named on stderr)."""
    from qkv.checkpoint import model_dir, read_meta
    from qkv.hf.whisper import detect_language, start_tokens

    directory = model_dir(args.model)
    task = args.task or "transcribe"
    if args.language is not None or not read_meta(directory)["whisper"].get("multilingual"):
        return {tuple(start_tokens(directory, language=args.language, task=task)): list(range(len(feats)))}
    groups: dict[tuple[int, ...], list[int]] = {}
    languages = [
        code for i in range(0, len(feats), 16) for code in detect_language(model, feats[i : i + 16], directory)
    ]
    for i, code in enumerate(languages):
        groups.setdefault(tuple(start_tokens(directory, language=code, task=task)), []).append(i)
    found = sorted(set(languages))
    print(f"qkv transcribe: detected language{'s' if len(found) > 1 else ''} {', '.join(found)}", file=sys.stderr)
    return groups


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
    add_precision(p)
    p.set_defaults(run=cmd_transcribe)
