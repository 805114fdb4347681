"""The speed cost of required terms: beam search against lexically constrained beam search
(dynamic beam allocation, ``decoding.constrained_beam_search``) with 2 required terms per input.

    python bench/constraints_speed.py                      # the base model, random weights
    python bench/constraints_speed.py --model runs/de_en --input test.de --require dog --require man
    python bench/constraints_speed.py --tiny --rounds 1 --no-record   # a quick check that it runs

Without ``--model``: ``bench/mt_speed.py``'s base encoder-decoder (d=512, 8 heads, 6+6 layers,
vocabulary 8,000; its decoding copy), random weights and fixed seeds, 32 sources of 16-32 random
tokens, at most 32 new tokens each, beam 5, and per source 2 required terms of 2 random tokens
(a word of 2 pieces each). With
``--model DIR --input FILE``: ``qkv translate``'s job (``bundle.translations``, the recipe's
beam) on the file's lines, plain against ``--require``'s words.

Each side runs in a process of its own (``--worker``), rounds alternating, so neither runs
beside the other's threads or warm caches; a side's figure is its best time over the rounds.
One record goes to ``bench/results/constraints_speed.json``: the constrained time over the
plain time (target ≤ 2), with both times and how many outputs hold every term.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = 2.0  # issue 47: constrained beam search with 2 terms at most 2x the plain beam search


def random_side(constrained: bool, tiny: bool) -> dict:
    """Time plain or constrained beam search of random sources on a random-weight model."""
    import torch

    from qkv.decoding import Required, beam_search, constrained_beam_search
    from qkv.decoding_copies import for_decoding
    from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig

    vocab, width, layers, sources_n = (97, 32, 1, 4) if tiny else (8000, 512, 6, 32)
    torch.manual_seed(0)
    config = EncoderDecoderConfig(
        src_vocab_size=vocab,
        tgt_vocab_size=vocab,
        d_model=width,
        n_heads=8 if not tiny else 4,
        d_ff=4 * width,
        n_encoder_layers=layers,
        n_decoder_layers=layers,
        dropout=0.0,
    )
    model = for_decoding(EncoderDecoder(config).eval())
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(16, 33, (sources_n,), generator=g).tolist()
    sources = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]
    terms = [[Required((tuple(p),)) for p in torch.randint(4, vocab, (2, 2), generator=g).tolist()] for _ in sources]

    def run():
        if constrained:
            return constrained_beam_search(model, sources, required=terms, beam_size=5, max_new_tokens=32)
        return beam_search(model, sources, beam_size=5, max_new_tokens=32)

    seconds, found = timed(run)
    held = sum(all(_holds(h[0].tokens, t.ways[0]) for t in ts) for h, ts in zip(found, terms, strict=True))
    tokens = sum(len(h[0].tokens) for h in found)
    return {"seconds": seconds, "outputs": len(found), "with_every_term": held, "tokens": tokens}


def _holds(tokens: list[int], way: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i : i + len(way)]) == way for i in range(len(tokens)))


def model_side(constrained: bool, model: str, input_file: str, require: list[str]) -> dict:
    """Time ``qkv translate``'s job on a file, plain or with required words."""
    from qkv.bundle import load, translations

    bundle = load(model, job="translate")
    lines = [line for line in Path(input_file).read_text(encoding="utf-8").splitlines() if line.strip()]
    seconds, found = timed(lambda: translations(bundle, lines, require=require if constrained else ()))
    held = sum(all(word in hyps[0].text for word in require) for hyps in found)
    tokens = sum(len(hyps[0].tokens) for hyps in found)
    return {"seconds": seconds, "outputs": len(found), "with_every_term": held, "tokens": tokens}


def timed(run) -> tuple[float, object]:
    """The faster of two timed runs after a warm-up, and the last output."""
    run()
    times, out = [], None
    for _ in range(2):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
    return min(times), out


def worker(args: argparse.Namespace) -> dict:
    constrained = args.worker == "constrained"
    if args.model:
        return model_side(constrained, args.model, args.input, args.require)
    return random_side(constrained, args.tiny)


def run_side(side: str, argv: list[str]) -> dict:
    """One worker process for ``side`` ("plain" or "constrained")."""
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", side]
    paths = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]  # this tree's qkv first
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the {side} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a translation model directory (default: the random base model)")
    parser.add_argument("--input", help="with --model: source lines to translate")
    parser.add_argument("--require", action="append", default=[], help="with --model: a required word (give 2)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model and 4 sources: a check that it runs")
    parser.add_argument("--rounds", type=int, default=2, help="plain/constrained rounds, each a process per side")
    parser.add_argument("--no-record", action="store_true", help="print only")
    parser.add_argument("--results", type=Path, help="the folder of the record (default bench/results)")
    parser.add_argument("--worker", choices=("plain", "constrained"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model and (not args.input or len(args.require) != 2):
        parser.error("--model needs --input FILE and two --require words")
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    argv = [a for a in sys.argv[1:] if a not in ("--no-record",)]
    best: dict[str, dict] = {}
    for r in range(args.rounds):
        for side in ("plain", "constrained"):
            found = run_side(side, argv)
            if side not in best or found["seconds"] < best[side]["seconds"]:
                best[side] = found
            print(f"round {r + 1} {side}: {found['seconds']:.3f} s, {found}", flush=True)
    ratio = best["constrained"]["seconds"] / best["plain"]["seconds"]
    what = f"{args.model} on {args.input}" if args.model else ("tiny" if args.tiny else "base") + " random model"
    print(f"constrained / plain: {ratio:.2f}x (target <= {TARGET:g}x), {what}")
    record = {
        "metric": "beam search with 2 required terms, time / plain beam search"
        + (" (tiny check)" if args.tiny else ""),
        "figure": round(ratio, 3),
        "unit": "x",
        "target": {"max": TARGET},
        "details": {side: best[side] for side in best},
        "notes": f"{what}; beam 5 (--model: the recipe's); best of {args.rounds} alternating rounds, each side in "
        "its own process",
    }
    if not args.no_record:
        sys.path.insert(0, str(ROOT / "bench"))
        from record import append_run

        append_run("constraints_speed", [record], results=args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
