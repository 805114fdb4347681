"""``qkv embed``: sentence vectors from an encoder-only model.

What is here: the command's arguments (``add_parser``) beside its handler, which parses, calls
the library's job (``bundle.embeddings``: the settings chosen, the vectors) and writes them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qkv.cli.common import Output, positive_int, read_input_lines
from qkv.errors import UserError
from qkv.files import write_atomic

EPILOG_EMBED = """examples:
  qkv embed --model runs/dailydialog_mlm --input sentences.txt --output vectors.npy --normalize
  qkv import-hf ~/hf/all-MiniLM-L6-v2 models/minilm     # a sentence-transformers checkpoint
  qkv embed --model models/minilm --input sentences.txt --output vectors.npy   # its pooling, as its authors set
  qkv embed --model models/minilm --pooling cls --no-normalize --max-len 128 --output v.npy < sentences.txt

how the settings are chosen (stderr says which, and from where):
  each of pooling, normalization and window comes from its option where given; else from what the
  model directory records (config.json "embedding": qkv import-hf writes there a sentence-transformers
  checkpoint's pooling (1_Pooling/config.json) and Normalize module (modules.json), and the window its
  users get: sentence_bert_config.json max_seq_length, else tokenizer_config.json model_max_length, else
  max_position_embeddings); else qkv's defaults: mean pooling, not normalized, the model's whole window.
  echo "how are you ?" | qkv embed --model runs/dailydialog_mlm --output vectors.jsonl
  python -c "import numpy; print(numpy.load('vectors.npy').shape)"     # (lines, d_model)
"""
# qkv.embedding.POOLINGS, written out so that the parser (and `qkv --help`) need not import torch;
# tests/test_cli_light.py checks that the two agree.
POOLINGS = ("mean", "cls", "max", "mean_sqrt_len")


def cmd_embed(args: argparse.Namespace) -> int:
    import io

    import numpy as np

    from qkv.bundle import embeddings, load
    from qkv.embedding import choose

    suffix = Path(args.output).suffix
    if suffix not in (".npy", ".jsonl"):
        raise UserError(f"--output {args.output}: the name must end in .npy (NumPy float32) or .jsonl (JSON lines)")
    out = Output(args.output)  # checks the directory before any work
    bundle = load(args.model, job="embed")
    # The options are checked before stdin is read: a wrong one must not wait for input first.
    choose(
        bundle.embedding,
        model_max_len=bundle.window,
        pooling=args.pooling,
        normalize=args.normalize,
        max_len=args.max_len,
    )
    lines = read_input_lines(args.input)
    found = embeddings(
        bundle, lines, pooling=args.pooling, normalize=args.normalize, max_len=args.max_len, batch_size=args.batch_size
    )
    chosen = found.settings
    print(f"qkv embed: {chosen.said}", file=sys.stderr)
    if found.cut:
        print(f"qkv embed: note: {found.cut} line(s) cut to the window of {chosen.max_len} tokens", file=sys.stderr)
    array = found.vectors.numpy().astype(np.float32)  # (N, D)
    if suffix == ".jsonl":
        for row in array.tolist():
            out.write(json.dumps({"embedding": row}))
        out.close()
    else:
        buffer = io.BytesIO()
        np.save(buffer, array)
        write_atomic(Path(args.output), buffer.getvalue())
    blank = sum(not line.strip() for line in lines)
    print(
        f"qkv embed: {len(lines)} lines -> {args.output} ({array.shape[0]} x {array.shape[1]} float32"
        f"{f'; {blank} empty line(s) as zero rows' if blank else ''})",
        file=sys.stderr,
    )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``embed`` command's arguments."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "embed",
        help="sentence vectors from an encoder-only model (its last hidden states, pooled)",
        description="Read one sentence per line (stdin or --input) and write one vector per line, in order: "
        "the encoder's last hidden states over the sentence's positions ([BEGIN] sentence [END], padding "
        "excluded), pooled: their mean (qkv's default), the first token's ([CLS]), their maximum, or their sum "
        "over the square root of the length; a model imported from a sentence-transformers checkpoint pools "
        "as its authors set (see below). --output NAME.npy writes a float32 NumPy array (lines x d_model); "
        'NAME.jsonl writes one {"embedding": [...]} object per line. An empty line gives a zero row (so rows '
        "match lines); a line longer than the window is cut to it. The file appears atomically.",
        epilog=EPILOG_EMBED,
        formatter_class=raw,
    )
    p.add_argument("--model", required=True, help="encoder_only model directory (with its tokenizer)")
    p.add_argument("--input", default=None, help="input file, one sentence per line (default: stdin)")
    p.add_argument("--output", required=True, help="output file: .npy (NumPy float32) or .jsonl (JSON lines)")
    p.add_argument(
        "--pooling",
        choices=POOLINGS,
        default=None,
        help="how a sentence's token vectors become one (default: as the model directory records, else mean)",
    )
    p.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="scale every row to unit L2 norm, zero rows staying zero (default: as recorded, else not)",
    )
    p.add_argument(
        "--max-len",
        type=positive_int,
        default=None,
        help="cut each line to this many tokens, BEGIN and END included (default: as recorded, else the "
        "model's positions)",
    )
    p.add_argument("--batch-size", type=positive_int, default=64, help="sentences encoded together (default: 64)")
    p.set_defaults(run=cmd_embed)
