"""``qkv speak``: text in, speech out, with a text-to-speech model trained with a ``tts`` recipe
or a Piper voice imported with ``qkv import-hf VOICE.onnx``.

What is here: the command's arguments (``add_parser``) beside its handler, which parses, calls
the library's job (``bundle.speeches``: voices, the recipe's reading and stop, synthesis and the
vocoder; ``bundle.piper_speeches`` for a Piper voice) and writes the files.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from qkv.cli.common import add_threads, number, positive_int, read_input_lines, seed, use_threads
from qkv.errors import UserError
from qkv.files import check_writable

PIPER_OPTIONS = ("noise_scale", "length_scale", "noise_w")  # an imported Piper voice's (VITS's) scales

EPILOG_SPEAK = """examples:
  qkv speak --model runs/tts_en --text "A dog runs across the grass." --output dog.wav
  qkv speak --model runs/tts_en --input sentences.txt --output-dir spoken/     # 0001.wav, 0002.wav, ...
  echo "Two men are talking." | qkv speak --model runs/tts_en --output-dir spoken/ --rate 22050
  qkv speak --model runs/tts_voices --speaker jackson --text "three one four" --output jackson.wav
  qkv import-hf en_US-joe-medium.onnx voices/joe      # a Piper voice (VOICE.onnx.json beside it)
  qkv speak --model voices/joe --text "Hello there." --output hello.wav --length-scale 1.2 --noise-scale 0.5
  qkv speak --model runs/tts_en --input sentences.txt --output-dir spoken/ --threads 2   # two CPU threads
  qkv speak --model runs/tts_en_natural --vocoder vocoders/joe --text "A dog runs." --output dog.wav  # neural vocoder

Each file written is printed as PATH<TAB>SECONDS<TAB>TEXT (with --json, one object per line);
a sentence that ran into --max-seconds before the model ended it is named on stderr.
"""


def wav_paths(args: argparse.Namespace, n: int) -> list[Path]:
    """The files ``n`` sentences go to: ``--output``, or numbered in ``--output-dir``; a UserError
    naming the option when they cannot be written (checked before any work)."""
    if args.output is None and args.output_dir is None:
        raise UserError("say where the speech goes: --output FILE.wav (one sentence) or --output-dir DIR")
    if args.output is not None:
        path = Path(args.output)
        if path.is_dir():
            raise UserError(f"--output {path} is a directory; name a .wav file, or use --output-dir")
        if not path.parent.is_dir():
            raise UserError(f"cannot write {path}: directory {path.parent} does not exist")
        check_writable(path, inside=False)
        return [path]
    folder = Path(args.output_dir)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output-dir {folder} is a file")
    check_writable(folder, inside=True)
    return [folder / f"{k:04d}.wav" for k in range(1, n + 1)]


def cmd_speak(args: argparse.Namespace) -> int:
    from qkv.bundle import load, neural_vocoder, speeches
    from qkv.progress import progress
    from qkv.vocoder import write_wav

    texts, paths = _texts_and_paths(args)  # a bad output is said before the model is read
    use_threads(args.threads)
    vocoder = neural_vocoder(args.vocoder) if args.vocoder is not None else None
    bundle = load(args.model, job="speak")
    if args.output_dir is not None:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    if bundle.kind == "vits":
        if args.vocoder is not None:
            raise UserError("--vocoder is for qkv's own TTS models; a Piper voice speaks through its own generator")
        return _speak_piper(args, bundle, texts, paths)
    rate = bundle.sample_rate if vocoder is None else vocoder.sample_rate  # the waveforms' rate
    given = [f"--{n.replace('_', '-')}" for n in PIPER_OPTIONS if getattr(args, n) is not None]
    if given:
        raise UserError(f"{', '.join(given)}: options of an imported Piper voice; {args.model} is qkv's own TTS model")
    bar = progress(len(texts), desc="qkv speak", unit="sentence", disable=args.quiet or len(texts) < 2)
    start = time.perf_counter()
    results = speeches(
        bundle,
        texts,
        speaker=args.speaker,
        max_seconds=args.max_seconds,
        stop_threshold=args.stop_threshold,  # None: as trained (the recipe's)
        attention_window=args.attention_window,
        batch_size=args.batch_size,
        seed=args.seed,
        on_batch=bar.update,
        vocoder=vocoder,
    )
    bar.close()
    elapsed = time.perf_counter() - start
    cap = min(args.max_seconds, bundle.longest_speech)  # what synthesis stops at
    total = 0.0
    for path, text, (synthesis, wave) in zip(paths, texts, results, strict=True):
        write_wav(path, wave, rate, rate=args.rate)
        total += _said(args, rate, path, text, wave, hit_cap=synthesis.hit_cap)
        if synthesis.hit_cap:
            why = "--max-seconds" if cap == args.max_seconds else "the model's window (model.max_len steps)"
            print(f"qkv speak: {path}: {text!r} did not end within {cap:.1f} s ({why})", file=sys.stderr)
    _summary(len(paths), total, elapsed)
    return 0


def _texts_and_paths(args: argparse.Namespace) -> tuple[list[str], list[Path]]:
    """The sentences to speak and the WAV file each goes to (checked before the model loads)."""
    if args.text is not None and args.input is not None:
        raise UserError("give --text or --input, not both")
    texts = [args.text] if args.text is not None else [t for t in read_input_lines(args.input) if t.strip()]
    if not texts:
        raise UserError("nothing to say: give --text, --input FILE or lines on stdin")
    if args.output is not None and len(texts) != 1:
        raise UserError(f"--output names one file but there are {len(texts)} sentences; use --output-dir")
    return texts, wav_paths(args, len(texts))


def _speak_piper(args: argparse.Namespace, bundle, texts: list[str], paths: list[Path]) -> int:
    """``qkv speak`` with an imported Piper voice (``bundle.piper_speeches``): its own scales."""
    from qkv.bundle import piper_speeches

    if args.stop_threshold is not None or args.attention_window is not None:
        raise UserError("--stop-threshold and --attention-window are for qkv's own TTS models, not a Piper voice")
    start = time.perf_counter()
    waves = piper_speeches(
        bundle,
        texts,
        speaker=args.speaker,
        noise_scale=args.noise_scale,
        length_scale=args.length_scale,
        noise_w=args.noise_w,
        seed=args.seed,
    )
    elapsed = time.perf_counter() - start
    total = 0.0
    for path, text, wave in zip(paths, texts, waves, strict=True):
        bundle.write_wav(path, wave, rate=args.rate)
        total += _said(args, bundle.sample_rate, path, text, wave, hit_cap=False)
    _summary(len(paths), total, elapsed)
    return 0


def _said(args: argparse.Namespace, rate: int, path: Path, text: str, wave, *, hit_cap: bool) -> float:
    """Print the line for one file written (``wave`` at ``rate`` Hz); its seconds."""
    seconds = wave.numel() / rate
    if args.json:
        record = {"path": str(path), "seconds": round(seconds, 3), "text": text, "hit_cap": hit_cap}
        print(json.dumps(record, ensure_ascii=False), flush=True)
    else:
        print(f"{path}\t{seconds:.2f}\t{text}", flush=True)
    return seconds


def _summary(files: int, total: float, elapsed: float) -> None:
    said = f"{files} file{'s' if files != 1 else ''}"
    rtf = elapsed / max(total, 1e-9)
    print(
        f"qkv speak: {said}, {total:.1f} s of speech in {elapsed:.1f} s (real-time factor {rtf:.2f})", file=sys.stderr
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``speak`` command's arguments."""
    p = sub.add_parser(
        "speak",
        help="text to speech: WAV files from sentences with a TTS model",
        description="Speak sentences with a text-to-speech model (trained with a tts recipe): the model writes "
        "log-mel frames until its stop token, Griffin-Lim turns them into a waveform, a 16-bit WAV is written. "
        "Numbers and common symbols are read as words. A Piper voice (qkv import-hf VOICE.onnx DIR) speaks "
        "through its VITS model instead, from espeak-ng phonemes as Piper makes them (pip install piper-tts), "
        "with --length-scale, --noise-scale and --noise-w.",
        epilog=EPILOG_SPEAK,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="TTS model directory (or a training run)")
    p.add_argument("--text", help="one sentence to speak")
    p.add_argument("--input", help="a file of sentences, one per line ('-' or none given: stdin)")
    p.add_argument("--output", help="the WAV file for one sentence")
    p.add_argument("--output-dir", help="a folder for numbered WAV files, one per sentence")
    p.add_argument("--speaker", help="the voice, for a model trained with several (data.speakers)")
    p.add_argument("--rate", type=int, choices=(16000, 22050), help="the WAV's sample rate (default: the model's)")
    p.add_argument(
        "--max-seconds",
        type=number(float, lambda v: v > 0, "a positive number of seconds"),
        default=20.0,
        help="stop a sentence that has not ended by this length (default 20)",
    )
    p.add_argument(
        "--stop-threshold",
        type=number(float, lambda v: 0 < v < 1, "a probability between 0 and 1"),
        help="end a sentence when its stop probability passes this (default: the recipe's decode.stop_threshold)",
    )
    p.add_argument(
        "--attention-window",
        nargs=2,
        type=number(int, lambda v: v >= 0, "an integer >= 0"),
        metavar=("BACK", "AHEAD"),
        help="keep cross-attention within BACK symbols before and AHEAD after its furthest peak "
        "(default: the model's recipe, decode.attention_window)",
    )
    p.add_argument("--batch-size", type=positive_int, default=16, help="sentences synthesized at once (default 16)")
    p.add_argument(
        "--seed", type=seed, default=0, help="the pre-net dropout's (a Piper voice: the noise's) draws (default 0)"
    )
    p.add_argument(
        "--length-scale",
        type=number(float, lambda v: v > 0, "a positive number"),
        help="a Piper voice: durations times this (above 1: slower; default: the voice's)",
    )
    p.add_argument(
        "--noise-scale",
        type=number(float, lambda v: v >= 0, "a number >= 0"),
        help="a Piper voice: the prior's noise, how varied the sound is (default: the voice's, e.g. 0.667)",
    )
    p.add_argument(
        "--noise-w",
        type=number(float, lambda v: v >= 0, "a number >= 0"),
        help="a Piper voice: the duration predictor's noise, how varied the rhythm is (default: the voice's, e.g. 0.8)",
    )
    p.add_argument(
        "--vocoder",
        help="a neural vocoder directory (bench/train_vocoder.py: a mel adapter + the Piper voice's generator) "
        "in place of Griffin-Lim; its speech is at the voice's rate (22,050 Hz)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per file written")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_threads(p)
    p.set_defaults(run=cmd_speak)
