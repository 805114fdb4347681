"""Build a recipe's Piper-taught corpus a slice at a time, so that hours of speaking on 2 cores
can be spread over sessions: each slice is a finished cache entry (the first N training
sentences, the held-out splits as the recipe says), and the next reuses its audio
(``speech_corpora/piper.py``: a corpus of N sentences is a prefix of one of more), so stopping
this at any moment keeps the largest slice finished, and running it again with ``--start N`` (the
largest slice's sentences) goes on from there.

    nohup nice -n 15 python bench/piper_corpus_slices.py recipes/tts_en_natural.yaml --slice 200 > slices.log &
    python bench/piper_corpus_slices.py recipes/tts_en_natural.yaml --set data.held_out_sentences=20 --until 1000

After each slice it prints one JSON line: the training sentences, the seconds it took, the new
sentences a second, the entry, and the ``--set`` that trains on it. A slice superseded by a larger
one is removed (its audio lives on, hard-linked, in the larger) unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

ALL_TRAIN = 29_000  # Multi30k's English training captions


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Build a recipe's Piper-taught corpus in growing slices, each one cached and reused.",
        epilog="example: python bench/piper_corpus_slices.py recipes/tts_en_natural.yaml --slice 200 --until 1000",
    )
    p.add_argument("recipe", type=Path, help="a recipe with data.corpus: piper")
    p.add_argument("--set", action="append", default=[], help="a recipe override, KEY=VALUE (as qkv train's)")
    p.add_argument("--slice", type=int, default=200, help="training sentences each slice adds (default 200)")
    p.add_argument("--until", type=int, help="stop at this many training sentences (default: the recipe's)")
    p.add_argument("--start", type=int, default=0, help="the largest slice already built (its sentences are reused)")
    p.add_argument("--keep", action="store_true", help="keep every slice's cache entry, not only the largest")
    return p


def main() -> int:
    args = parser().parse_args()
    from qkv.speech_corpora import piper_corpus
    from qkv.tasks import load_recipe
    from qkv.tasks.piper_teacher import piper_teacher

    data = load_recipe(args.recipe, args.set).data
    if data.corpus != "piper" or args.slice < 1:
        raise SystemExit("the recipe's data.corpus must be piper, and --slice at least 1")
    teacher = piper_teacher(data.piper_voice)
    until = args.until or data.sentences or ALL_TRAIN
    done, previous = args.start, None
    while done < until:
        n = min(until, done + args.slice)
        start = time.perf_counter()
        corpus = piper_corpus(
            teacher, sentences=n, held_out_sentences=data.held_out_sentences, seed=int(data.corpus_seed)
        )
        seconds = time.perf_counter() - start
        if previous is not None and previous != corpus.root and not args.keep:
            shutil.rmtree(previous)  # every file of it is hard-linked (or copied) into the new slice
        line = {
            "train_sentences": len(corpus["train"]),
            "seconds": round(seconds, 1),
            "new_per_second": round((n - done) / seconds, 3),
            "entry": str(corpus.root),
            "train_with": f"--set data.sentences={n}",
            "load_average_1min": round(os.getloadavg()[0], 2),
        }
        print(json.dumps(line), flush=True)
        done, previous = n, corpus.root
    return 0


if __name__ == "__main__":
    sys.exit(main())
