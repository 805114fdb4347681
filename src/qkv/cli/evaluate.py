"""``qkv evaluate``: scores of hypotheses against references, or of a model on its task.

What is here: the command's arguments (``add_parser``) beside its handler.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from qkv.cli.common import (
    load_for_generation,
    matching_tokenizer,
    positive_int,
    read_input_lines,
)
from qkv.errors import UserError

EPILOG_EVALUATE = """examples:
  qkv evaluate --hyp out.txt --ref ref.txt --json
  qkv evaluate --hyp test.en --ref $QKV_DATA/multi30k/tok/test_2016_flickr.lc.norm.tok.en --tokenize moses
  qkv transcribe --model runs/fsdd_digits recordings/ --output transcripts.tsv
  qkv evaluate --hyp transcripts.tsv --ref truth.tsv --wer      # WER, CER (speech recognition)
  qkv evaluate --model qkv-demo/model --examples 500
  qkv evaluate --model runs/shakespeare --text ../shared/data/tinyshakespeare/input.txt
  qkv evaluate --model runs/dailydialog_acts --tsv test.tsv --json     # accuracy, macro-F1

--hyp and --ref hold one text a line, or PATH<TAB>TEXT lines as qkv transcribe writes them (the
text follows the first tab). Two PATH<TAB>TEXT files are matched by path, whatever their order;
every file must be on both sides, its path written alike (recordings/a.wav is not /data/a.wav).
A PATH<TAB>TEXT file beside plain lines is read line by line: line i of one with line i of the
other. So truth.tsv above may hold

  recordings/0_theo_0.wav<TAB>zero
  recordings/1_theo_0.wav<TAB>one

or just "zero" and "one" on two lines in the order transcribe wrote the files (sorted, per folder).
"""


def _evaluate_classifier(path: str, tsv: str) -> dict:
    """Accuracy and macro-F1 of a classify-task model on a ``text<TAB>label`` file, computed as
    training computes its final validation scores."""
    from qkv.checkpoint import load_model
    from qkv.data import read_labelled, resolve
    from qkv.evaluation import accuracy, macro_f1
    from qkv.hf.convert import classifier_labels
    from qkv.tasks.bert import predict_labels

    model, meta = load_model(path, kind="encoder_only")
    labels = classifier_labels(Path(path), meta, model.config.n_classes)  # an older import's hf.id2label too
    # A classifier is what has a class head and its label names: trained here (task classify)
    # or imported (a BertForSequenceClassification keeps its id2label, but has no task).
    if meta.get("task") not in (None, "classify"):
        why = f"its task is {meta.get('task')}"
    elif not model.config.n_classes:
        why = "it has no class head"
    elif not isinstance(labels, list):
        why = f"its {model.config.n_classes} classes have no label names (labels in config.json)"
    else:
        why = None
    if why is not None:
        raise UserError(f"{path} is not a classifier that --tsv can score: {why}")
    tokenizer = matching_tokenizer(path, model, files=meta["files"], use="--tsv")
    file = resolve(tsv)
    examples = read_labelled(file)  # every line is an example, so its index is its line number
    if not examples:
        raise UserError(f"{file} holds no text<TAB>label lines")
    for number, (_, label) in enumerate(examples, start=1):
        if label not in labels:
            raise UserError(f"{file}:{number}: label {label!r} is not one of the model's: {', '.join(labels)}")
    if (meta.get("recipe") or {}).get("data", {}).get("context"):
        # The file has no previous utterances: the scores may differ from those of training.
        print(f"qkv evaluate: note: {path} was trained with the previous utterance as context", file=sys.stderr)
    start = time.perf_counter()
    predicted = predict_labels(model, tokenizer, [text for text, _ in examples], labels=labels)
    gold = [label for _, label in examples]
    return {
        "task": "classify",
        "accuracy": round(accuracy(predicted, gold), 4),
        "macro_f1": round(macro_f1(predicted, gold), 4),
        "examples": len(examples),
        "seconds": round(time.perf_counter() - start, 1),
    }


def path_column(lines: list[str]) -> list[tuple[str, str]] | None:
    """The (path, text) of every line when each holds a tab (``qkv transcribe``'s PATH<TAB>TEXT
    lines: the text is what follows the first tab), else None (plain lines of text). The path
    is normalised (``./a.wav`` is ``a.wav``) so that two files naming one file alike match."""
    if not lines or not all("\t" in line for line in lines):
        return None
    return [(os.path.normpath(path), text) for path, text in (line.split("\t", 1) for line in lines)]


def by_path(rows: list[tuple[str, str]], name: str) -> dict[str, str]:
    """{path: text} of PATH<TAB>TEXT rows; a path given twice is refused, naming its second line."""
    texts: dict[str, str] = {}
    for number, (path, text) in enumerate(rows, start=1):
        if path in texts:
            raise UserError(f"{name}:{number}: {path} appears twice")
        texts[path] = text
    return texts


def paired_texts(hyp_lines: list[str], ref_lines: list[str], *, hyp: str, ref: str) -> tuple[list[str], list[str]]:
    """The hypothesis and reference texts to score, pair by pair, from the lines of ``hyp`` and
    ``ref``: PATH<TAB>TEXT on both sides are matched by path (in the reference's order; every
    file must be on both sides), else line i with line i (a PATH<TAB>TEXT side gives its text)."""
    hyp_rows, ref_rows = path_column(hyp_lines), path_column(ref_lines)
    if hyp_rows is not None and ref_rows is not None:
        hyp_texts, ref_texts = by_path(hyp_rows, hyp), by_path(ref_rows, ref)
        unscored = [path for path in ref_texts if path not in hyp_texts]
        if unscored:
            raise UserError(
                f"{len(unscored)} of the {len(ref_texts)} files of {ref} have no line in {hyp}, "
                f"the first {unscored[0]}: score every file (paths written alike on both sides)"
            )
        extra = [path for path in hyp_texts if path not in ref_texts]
        if extra:
            raise UserError(f"{hyp}: {extra[0]} has no reference in {ref} ({len(extra)} such files)")
        return [hyp_texts[path] for path in ref_texts], list(ref_texts.values())
    hyps = [text for _, text in hyp_rows] if hyp_rows is not None else hyp_lines
    refs = [text for _, text in ref_rows] if ref_rows is not None else ref_lines
    if len(hyps) != len(refs):
        raise UserError(f"{hyp} has {len(hyps)} lines but {ref} has {len(refs)}")
    if not hyps:
        raise UserError(f"{hyp} and {ref} are empty: nothing to score")
    return hyps, refs


def cmd_evaluate(args: argparse.Namespace) -> int:
    if args.text is not None and args.tsv is not None:
        raise UserError("give --text (a language model) or --tsv (a classifier), not both")
    if args.text is not None:
        from qkv.checkpoint import load_model
        from qkv.data import read_text, resolve
        from qkv.evaluation import lm_loss
        from qkv.tasks.lm import documents_in, documents_of, token_stream

        if args.model is None:
            raise UserError("--text needs --model DIR (a decoder-only model)")
        model, meta = load_model(args.model, kind="decoder_only")
        tokenizer = matching_tokenizer(args.model, model, files=meta["files"], use="--text")
        # The stream as training built its validation stream: a model that read one document
        # per line (each ending with END), or lines written as transcripts, is scored the same
        # way, so the loss is comparable.
        documents, transcripts = documents_of(meta)
        text = read_text(resolve(args.text))
        docs = documents_in(text, documents=documents, transcripts=transcripts)
        ids = token_stream(tokenizer, docs, documents=documents)
        if len(ids) < 2:
            raise UserError(f"{args.text} holds fewer than two tokens")
        start = time.perf_counter()
        loss = lm_loss(model, ids, context=model.config.max_len)
        result = {
            "loss": round(loss, 4),
            "perplexity": round(math.exp(loss), 3),
            "tokens": len(ids),
            "seconds": round(time.perf_counter() - start, 1),
        }
    elif args.tsv is not None:
        if args.model is None:
            raise UserError("--tsv needs --model DIR (a classify-task model)")
        result = _evaluate_classifier(args.model, args.tsv)
    elif args.model is not None:
        from qkv.checkpoint import model_dir, read_meta
        from qkv.tasks.numbers import evaluate_numbers, held_out_numbers, numbers_pairs

        if args.examples > len(held_out_numbers()):
            raise UserError(f"--examples {args.examples}: only {len(held_out_numbers())} held-out numbers exist")
        meta = read_meta(model_dir(args.model))
        if meta.get("task") == "classify" or meta.get("labels"):
            raise UserError(f"{args.model} is a classifier; give --tsv FILE (text<TAB>label lines) to score it")
        if meta["kind"] != "encoder_decoder":
            raise UserError(f"{args.model} is not a numbers-task model (kind {meta['kind']})")
        # Loaded first, so a model that lacks its tokenizer is told so; then only the numbers
        # task is scored (an imported or recipe-less model has no task and is refused).
        model, vocab = load_for_generation(args.model)
        if meta.get("task") != "numbers":
            raise UserError(f"{args.model} is not a numbers-task model (task {meta.get('task')})")
        pairs = numbers_pairs(args.examples, seed=args.seed, held_out=True)
        start = time.perf_counter()
        score, _ = evaluate_numbers(model, vocab, pairs=pairs, beam_size=args.beam)
        result = {
            "task": "numbers",
            "exact_match": round(score, 4),
            "examples": len(pairs),
            "seconds": round(time.perf_counter() - start, 1),
        }
    else:
        from qkv.evaluation import corpus_scores

        if args.hyp is None or args.ref is None:
            raise UserError("give --hyp FILE and --ref FILE (or --model DIR for the numbers task)")
        hyps, refs = paired_texts(read_input_lines(args.hyp), read_input_lines(args.ref), hyp=args.hyp, ref=args.ref)
        if args.wer:
            from qkv.evaluation import error_rates

            try:
                rates = error_rates(hyps, refs, normalize=not args.no_normalize)
            except ValueError as e:  # an empty reference: its line number
                raise UserError(f"{args.ref}: {e}") from None
            result = {k: round(v, 4) if isinstance(v, float) else v for k, v in rates.items()}
        else:
            result = corpus_scores(hyps, refs, tokenize=args.tokenize, lowercase=args.lowercase, lang=args.lang)
    if args.json:
        print(json.dumps(result))
    else:
        print("  ".join(f"{k}={v}" for k, v in result.items()))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``evaluate`` command's arguments."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "evaluate",
        help="score hypotheses against references (BLEU, chrF, WER, exact match), or a model on its task",
        description="With --hyp and --ref: sacreBLEU BLEU and chrF (with signatures) and exact match; with "
        "--wer, jiwer's word and character error rates. With "
        "--model: exact match of a numbers model on held-out numbers. With --model and --text: a language "
        "model's loss (nats/token) and perplexity on the text, in non-overlapping windows of its context; a "
        "model trained with one document per line (data.documents) reads every non-empty line as a document "
        "ending with END, as its validation loss was measured. "
        "With --model and --tsv: a classifier's accuracy and macro-F1 on text<TAB>label lines.",
        epilog=EPILOG_EVALUATE,
        formatter_class=raw,
    )
    p.add_argument("--hyp", default=None, help="hypotheses, one per line, or PATH<TAB>TEXT lines (qkv transcribe's)")
    p.add_argument(
        "--ref", default=None, help="references, one per line, or PATH<TAB>TEXT lines (matched to --hyp's by path)"
    )
    p.add_argument(
        "--tokenize",
        default="13a",
        choices=["13a", "zh", "intl", "char", "none", "moses"],
        help="BLEU tokenizer; moses: the published Multi30k metric (hypotheses Moses-normalized, tokenized and "
        "lowercased like the official tok/*.lc.norm.tok.* references, which are used as they are)",
    )
    p.add_argument("--lang", default="en", help="language of the hypotheses for --tokenize moses (default en)")
    p.add_argument("--lowercase", action="store_true", help="case-insensitive scores")
    p.add_argument(
        "--wer",
        action="store_true",
        help="word and character error rates (jiwer) instead of BLEU: transcripts compared lowercased, "
        "punctuation removed (qkv.evaluation.normalize_transcript)",
    )
    p.add_argument("--no-normalize", action="store_true", help="with --wer: compare the texts exactly as written")
    p.add_argument(
        "--model",
        default=None,
        help="a model directory: a numbers-task model, with --text a LM, with --tsv a classifier",
    )
    p.add_argument("--text", default=None, help="text file: loss and perplexity of the --model language model")
    p.add_argument("--tsv", default=None, help="text<TAB>label file: accuracy and macro-F1 of the --model classifier")
    p.add_argument("--examples", type=positive_int, default=1000, help="held-out numbers to evaluate")
    p.add_argument("--beam", type=positive_int, default=4, help="beam width for --model")
    p.add_argument("--seed", type=int, default=1, help="which held-out numbers to draw")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.set_defaults(run=cmd_evaluate)
