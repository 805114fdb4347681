"""``qkv generate``: outputs of any generating model, one per input line, or a streamed continuation.

What is here: the command's arguments (``add_parser``) beside its handler.
"""

from __future__ import annotations

import argparse
import sys

from qkv.cli.common import (
    Output,
    add_precision,
    chunks,
    load_for_generation,
    positive_int,
    probability,
    read_input_lines,
    sampling_flags,
    seed,
    temperature,
    wants_sampling,
)
from qkv.errors import UserError

EPILOG_GENERATE = """examples:
  echo "52,017" | qkv generate --model qkv-demo/model --beam 4 --nbest 2
  qkv generate --model qkv-demo/model --input numbers.txt --output words.txt
  qkv generate --model runs/shakespeare --prompt "ROMEO:" --sample --top-k 20 --seed 1 --max-new-tokens 50
"""


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from qkv.decoding import beam_search, greedy, most_likely, sample, sampler
    from qkv.models.decoder_only import DecoderOnly
    from qkv.seq2seq import cut_source
    from qkv.streaming import continuation_text

    if args.nbest > args.beam:
        raise UserError(f"--nbest {args.nbest} needs --beam of at least {args.nbest}")
    sampling = wants_sampling(args)
    if sampling and args.beam > 1:
        raise UserError(f"{sampling_flags(args)} and --beam are exclusive: sampling draws one output per input")
    out = Output(args.output)
    model, vocab = load_for_generation(args.model, bf16=args.bf16, int8=args.int8)
    # Inputs in the source vocabulary, outputs in the target's (the same one but for an
    # encoder-decoder with separate vocabularies).
    source, target = vocab.source, vocab.target
    lines = [args.prompt] if args.prompt is not None else read_input_lines(args.input)
    window = model.config.max_len
    encoded = source.encode_batch(lines)
    lengths = [len(ids) for ids in encoded]
    streaming = isinstance(model, DecoderOnly) and args.prompt is not None and args.output is None and args.beam == 1
    too_long = [number for number, length in enumerate(lengths, start=1) if length > window]
    if too_long and not streaming:
        # The window rule: a source keeps its first max_len tokens (what a translation starts
        # from), a prompt its newest max_len // 2 (what a continuation follows, with room to write).
        where = "--prompt" if args.prompt is not None else f"{args.input or '<stdin>'}:{too_long[0]}"
        kept = f"their newest {window // 2}" if isinstance(model, DecoderOnly) else f"their first {window}"
        print(
            f"qkv generate: note: {len(too_long)} input(s) longer than the model's window ({window} tokens, "
            f"first: {where}) keep {kept} tokens",
            file=sys.stderr,
        )
    # One generator for the whole run: the same --seed and --batch-size give the same output.
    generator = torch.Generator()
    if args.seed is not None:
        generator.manual_seed(args.seed)
    else:
        generator.seed()

    def fit(ids: list[int]) -> list[int]:
        if len(ids) <= window:
            return ids
        return ids[-(window // 2) :] if isinstance(model, DecoderOnly) else cut_source(source, ids, window=window)

    longest = max((len(fit(ids)) for ids in encoded), default=0)
    room = window if not isinstance(model, DecoderOnly) else window - max(1, longest) + 1
    if args.max_new_tokens > room and not streaming:
        print(
            f"qkv generate: note: outputs stop at the model's window (max_len={window}): "
            f"at most {room} new tokens{' for the longest input' if len(lines) > 1 else ''}",
            file=sys.stderr,
        )
    if streaming:
        # One prompt continued by a language model: print each piece of text as it is made,
        # sliding the window past max_len (decoding.continuation).
        if sampling:
            choose = sampler(
                temperature=args.temperature or 1.0, top_k=args.top_k, top_p=args.top_p, generator=generator
            )
        else:
            choose = most_likely
        prompt = encoded[0]
        if len(prompt) > window:
            print(f"qkv generate: note: the prompt keeps its newest {window} tokens (the window)", file=sys.stderr)
        for piece in continuation_text(model, vocab, prompt, max_new_tokens=args.max_new_tokens, choose=choose):
            print(piece, end="", flush=True)
        print(flush=True)
        return 0
    for chunk in chunks(lines, args.batch_size):
        # Empty lines give empty outputs and keep their place.
        todo = [i for i, line in enumerate(chunk) if line.strip()]
        inputs = [fit(ids) for ids in source.encode_batch([chunk[i] for i in todo])]
        # An empty input still gets --nbest lines, so outputs can be matched to inputs by counting.
        results: dict[int, list[str]] = {i: [""] * args.nbest for i in range(len(chunk))}
        if inputs:
            if sampling:
                outs = sample(
                    model,
                    inputs,
                    max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature or 1.0,
                    top_k=args.top_k,
                    top_p=args.top_p,
                    generator=generator,
                )
                texts = [[target.decode(o)] for o in outs]
            elif args.beam > 1:
                hyps = beam_search(
                    model, inputs, beam_size=args.beam, max_new_tokens=args.max_new_tokens, nbest=args.nbest
                )
                texts = [
                    [target.decode(h.tokens) + (f"\t{h.score:.4f}" if args.nbest > 1 else "") for h in hs]
                    for hs in hyps
                ]
            else:
                texts = [[target.decode(o)] for o in greedy(model, inputs, max_new_tokens=args.max_new_tokens)]
            for i, text in zip(todo, texts, strict=True):
                results[i] = text
        for i in range(len(chunk)):
            for text in results[i]:
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
        "--sample for sampling. A language model given --prompt streams its continuation as it is made. "
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
    add_precision(p)
    p.set_defaults(run=cmd_generate)
