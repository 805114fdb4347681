"""``qkv translate``: batched translation of lines (beam, n-best, alignments, ensembles).

What is here: the command's arguments (``add_parser``) beside its handler, which parses, calls
the library's job (``bundle.translations``) and prints.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from qkv.cli.common import Output, add_constraints, add_precision, add_threads, number, read_input_lines, use_threads
from qkv.errors import UserError

EPILOG_TRANSLATE = """examples:
  qkv translate --model runs/multi30k_de_en --beam 5 < test.de > test.en
  echo "Ein Hund läuft." | qkv translate --model runs/multi30k_de_en --nbest 3 --beam 5
  qkv translate --model runs/multi30k_de_en --input test.de --output test.en --alignments test.align
  qkv translate --model runs/en_de_seed0 --ensemble runs/en_de_seed1 --beam 5 < test.en > test.de
  echo "Ein Hund läuft." | qkv translate --model runs/multi30k_de_en --prefix "The dog" --ban runs
  qkv translate --model runs/multi30k_de_en --require puppy --terms glossary.tsv < test.de > test.en
  qkv translate --model runs/multi30k_de_en --threads 2 < test.de > test.en   # two CPU threads
"""


def cmd_translate(args: argparse.Namespace) -> int:
    from qkv.bundle import load, read_terms, translations, window_fit
    from qkv.progress import progress
    from qkv.seq2seq import alignments, source_ids

    if args.nbest > args.beam:
        raise UserError(f"--nbest {args.nbest} needs --beam of at least {args.nbest}")
    terms = read_terms(args.terms) if args.terms else []
    use_threads(args.threads)
    bundle = load(args.model, bf16=args.bf16, int8=args.int8, job="translate")
    others = [load(path, bf16=args.bf16, int8=args.int8) for path in args.ensemble]
    out = Output(args.output)
    aligned = Output(args.alignments) if args.alignments else None
    lines = read_input_lines(args.input)
    too_long = len(window_fit(bundle, lines).cut)
    if too_long:
        print(
            f"qkv translate: note: {too_long} input line(s) cut to the model's window of {bundle.window} tokens",
            file=sys.stderr,
        )
    start = time.perf_counter()
    bar = progress(len(lines), desc="qkv translate", unit="line", disable=args.quiet or len(lines) < 100)
    found = translations(
        bundle,
        lines,
        beam_size=args.beam,
        nbest=args.nbest,
        length_penalty=args.length_penalty,
        max_len_a=args.max_len_a,
        max_len_b=args.max_len_b,
        max_tokens=args.max_tokens,
        ensemble=others,
        on_batch=bar.update,
        prefix=args.prefix,
        ban=args.ban,
        require=args.require,
        terms=terms,
    )
    bar.close()
    seconds = time.perf_counter() - start
    for line, hyps in zip(lines, found, strict=True):
        for h in hyps:
            text = h.text.replace("\\", "\\\\").replace("\n", "\\n")  # one output per line
            # An empty input gives --nbest empty lines (no score: nothing was translated).
            out.write(f"{text}\t{h.score:.4f}" if args.nbest > 1 and line.strip() else text)
    if aligned is not None:  # from --model's cross-attention, ensemble or not
        sources = source_ids(bundle.vocab.source, lines, window=bundle.window)
        for src, hyps in zip(sources, found, strict=True):
            for h in hyps:
                pairs = alignments(bundle.model, src=[src], out=[h.tokens])[0]
                aligned.write(" ".join(f"{j}-{t}" for j, t in pairs))
        aligned.close()
    out.close()
    words = sum(len(h.tokens) for hyps in found for h in hyps[:1])
    if not args.quiet:
        print(
            f"qkv translate: {len(lines)} lines in {seconds:.1f}s ({len(lines) / max(seconds, 1e-9):.1f} lines/s, "
            f"{words / max(seconds, 1e-9):.0f} output tokens/s), beam {args.beam}",
            file=sys.stderr,
        )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``translate`` command's arguments."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "translate",
        help="translate text with an encoder-decoder model or training run (stdin or a file)",
        description="Read one sentence per line (stdin or --input) and write its translation per line, in "
        "order (an empty line gives an empty line), detokenized. Beam search with a length penalty; an output "
        "has at most a*S + b tokens (S: its source's length). --nbest N writes N lines per input, each "
        "text<TAB>score (an empty input: N empty lines). --alignments FILE writes, per output line, "
        "source-output token index pairs (i-j) from the last decoder layer's cross-attention. --model may be a "
        "run directory (its final checkpoint). Constraints: --prefix starts every output (and is written as its "
        "start), --ban keeps words out, --require and --terms put words in.",
        epilog=EPILOG_TRANSLATE,
        formatter_class=raw,
    )
    p.add_argument("--model", required=True, help="model directory or training run directory")
    p.add_argument(
        "--ensemble",
        action="append",
        default=[],
        metavar="DIR",
        help="another model (or run) with the same tokenizer, decoded together with --model: each step's "
        "distribution is the mean of the models' (repeat for more)",
    )
    p.add_argument("--input", help="input file (default: stdin)")
    p.add_argument("--output", help="output file, written atomically (default: stdout)")
    p.add_argument("--beam", type=number(int, lambda v: v >= 1, "an integer >= 1"), default=5, help="beam width")
    p.add_argument(
        "--nbest",
        type=number(int, lambda v: v >= 1, "an integer >= 1"),
        default=1,
        help="outputs per input, each with its score",
    )
    p.add_argument(
        "--length-penalty",
        type=number(float, lambda v: 0 <= v < math.inf, "a finite number >= 0"),
        default=1.0,
        help="score = log p / length^penalty (default 1.0)",
    )
    p.add_argument(
        "--max-len-a",
        type=number(float, lambda v: 0 <= v < math.inf, "a finite number >= 0"),
        default=1.5,
        help="outputs have at most a*S + b tokens (default a=1.5)",
    )
    p.add_argument(
        "--max-len-b", type=number(int, lambda v: v >= 0, "an integer >= 0"), default=10, help="(default b=10)"
    )
    p.add_argument(
        "--max-tokens",
        type=number(int, lambda v: v >= 1, "an integer >= 1"),
        default=8192,
        help="source tokens x beam per batch (default 8192)",
    )
    p.add_argument("--alignments", metavar="FILE", help="write cross-attention alignments to FILE")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    add_constraints(p, terms=True)
    add_precision(p)
    add_threads(p)
    p.set_defaults(run=cmd_translate)
