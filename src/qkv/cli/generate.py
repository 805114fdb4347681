"""``qkv generate``: outputs of any generating model, one per input line, or a streamed continuation.

What is here: the command's arguments (``add_parser``) beside its handler, which parses, calls
the library's job (``bundle.generations``, ``bundle.continued``; the window rule is
``bundle.window_fit``'s) and prints.
"""

from __future__ import annotations

import argparse
import sys

from qkv.cli.common import (
    Output,
    add_constraints,
    add_precision,
    positive_int,
    probability,
    read_input_lines,
    sampling_flags,
    sampling_of,
    seed,
    temperature,
)
from qkv.errors import UserError

EPILOG_GENERATE = """examples:
  echo "52,017" | qkv generate --model qkv-demo/model --beam 4 --nbest 2
  qkv generate --model qkv-demo/model --input numbers.txt --output words.txt
  qkv generate --model runs/shakespeare --prompt "ROMEO:" --sample --top-k 20 --seed 1 --max-new-tokens 50
  qkv generate --model runs/shakespeare --prompt "ROMEO:" --prefix " O" --ban death --beam 4 --require love
"""


def cmd_generate(args: argparse.Namespace) -> int:
    from qkv.bundle import continued, generations, load, window_fit

    if args.nbest > args.beam:
        raise UserError(f"--nbest {args.nbest} needs --beam of at least {args.nbest}")
    sampling = sampling_of(args)
    if sampling is not None and args.beam > 1:
        raise UserError(f"{sampling_flags(args)} and --beam are exclusive: sampling draws one output per input")
    if args.require and (sampling is not None or args.beam == 1):  # said before the model is read
        why = f"{sampling_flags(args)} draws each token" if sampling is not None else "--beam 1 is greedy decoding"
        raise UserError(f"--require needs beam search: {why}")
    out = Output(args.output)
    bundle = load(args.model, bf16=args.bf16, int8=args.int8, job="generate")
    lines = [args.prompt] if args.prompt is not None else read_input_lines(args.input)
    window, fit = bundle.window, window_fit(bundle, lines)
    constrained = args.prefix is not None or args.ban or args.require
    streams = args.prompt is not None and args.output is None and args.beam == 1 and not constrained
    if bundle.kind == "decoder_only" and streams:
        # One prompt continued by a language model: each piece of text printed as it is made,
        # the window sliding on past max_len (decoding.continuation).
        if fit.cut:
            print(f"qkv generate: note: the prompt keeps its newest {window} tokens (the window)", file=sys.stderr)
        for piece in continued(bundle, args.prompt, max_new_tokens=args.max_new_tokens, sampling=sampling):
            print(piece, end="", flush=True)
        print(flush=True)
        return 0
    if fit.cut:
        where = "--prompt" if args.prompt is not None else f"{args.input or '<stdin>'}:{fit.cut[0] + 1}"
        print(
            f"qkv generate: note: {len(fit.cut)} input(s) longer than the model's window ({window} tokens, "
            f"first: {where}) keep {fit.kept} tokens",
            file=sys.stderr,
        )
    if args.max_new_tokens > fit.room:
        print(
            f"qkv generate: note: outputs stop at the model's window (max_len={window}): "
            f"at most {fit.room} new tokens{' for the longest input' if len(lines) > 1 else ''}",
            file=sys.stderr,
        )
    found = generations(
        bundle,
        lines,
        max_new_tokens=args.max_new_tokens,
        beam_size=args.beam,
        nbest=args.nbest,
        sampling=sampling,
        batch_size=args.batch_size,
        prefix=args.prefix,
        ban=args.ban,
        require=args.require,
    )
    for outputs in found:  # --nbest lines per input, an empty input's too (outputs match inputs by counting)
        for g in outputs:
            text = g.text + (f"\t{g.score:.4f}" if args.nbest > 1 and g.score is not None else "")
            # One output per line: a newline inside an output is written as \n (and \ as \\).
            out.write(text.replace("\\", "\\\\").replace("\n", "\\n"))
    out.close()
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``generate`` command's arguments."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "generate",
        help="translate / continue text with a trained model (stdin or a file)",
        description="Read one input per line (stdin, --input FILE or --prompt TEXT) and write one output per "
        "line, in order; an empty line gives an empty line. Greedy by default; --beam N for beam search, "
        "--sample for sampling. A language model given --prompt streams its continuation as it is made "
        "(without constraints). "
        "An input longer than the model's window is cut (a source keeps its first max_len tokens, a prompt "
        "its newest max_len // 2; a note on stderr names the line); the output stops where the window is full, "
        "except a streamed --prompt, which slides on past it (see docs/textbook.md, 'The window').",
        epilog=EPILOG_GENERATE,
        formatter_class=raw,
    )
    p.add_argument("--model", required=True, help="model directory (config.json + model.safetensors + tokenizer)")
    p.add_argument("--input", default=None, help="input file (default: stdin)")
    p.add_argument("--prompt", default=None, help="a single input given on the command line")
    p.add_argument("--output", default=None, help="output file (default: stdout)")
    p.add_argument("--beam", type=positive_int, default=1, help="beam width (1: greedy)")
    p.add_argument("--nbest", type=positive_int, default=1, help="outputs per input, with scores (needs --beam)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="longest output (default: 64)")
    p.add_argument(
        "--sample", action="store_true", help="sample instead of searching (implied by the four options below)"
    )
    p.add_argument("--temperature", type=temperature, default=None, help="sampling temperature (default: 1)")
    p.add_argument("--top-k", type=positive_int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=probability, default=None, help="sample from the smallest set with this probability")
    p.add_argument("--seed", type=seed, default=None, help="sampling seed (reproducible output)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="inputs decoded together")
    add_constraints(p)
    add_precision(p)
    p.set_defaults(run=cmd_generate)
