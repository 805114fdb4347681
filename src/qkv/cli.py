"""The ``qkv`` command line: demo, train, generate, chat, evaluate, embed. The composition root.

Every user mistake (missing file, bad option value, a model of the wrong kind) ends in one
line on stderr and exit status 2; success exits 0. Progress bars go to stderr, results to
stdout, so commands compose in pipes.

What is not here: any model, training or decoding logic (the modules this file wires).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from qkv import __version__
from qkv.errors import UserError
from qkv.files import write_atomic
from qkv.memory import choose_allocator

EPILOG_DEMO = """example:
  qkv demo --out qkv-demo          # about 2 minutes on 2 CPU cores
  qkv generate --model qkv-demo/model <<< "4,317"
"""
EPILOG_TRAIN = """examples:
  qkv train recipes/numbers.yaml --out runs/numbers --set train.steps=1500 --set model.d_model=96
  qkv train recipes/shakespeare_char_cpu.yaml --out runs/shakespeare     # prints val_loss=...
  qkv train recipes/multi30k_de_en.yaml --out runs/de_en                 # a run: last/ best/ averaged/
  qkv train recipes/multi30k_de_en.yaml --out runs/de_en --resume        # continue after a stop or crash
  qkv train recipes/dailydialog_mlm.yaml --out runs/dailydialog_mlm      # BERT masked-LM pretraining
  qkv train recipes/dailydialog_acts.yaml --out runs/dailydialog_acts    # fine-tuned from it (train.init)
"""
EPILOG_GENERATE = """examples:
  echo "52,017" | qkv generate --model qkv-demo/model --beam 4 --nbest 2
  qkv generate --model qkv-demo/model --input numbers.txt --output words.txt
  qkv generate --model runs/shakespeare --prompt "ROMEO:" --sample --top-k 20 --seed 1 --max-new-tokens 50
"""
EPILOG_TRANSLATE = """examples:
  qkv translate --model runs/multi30k_de_en --beam 5 < test.de > test.en
  echo "Ein Hund läuft." | qkv translate --model runs/multi30k_de_en --nbest 3 --beam 5
  qkv translate --model runs/multi30k_de_en --input test.de --output test.en --alignments test.align
  qkv translate --model runs/en_de_seed0 --ensemble runs/en_de_seed1 --beam 5 < test.en > test.de
"""
EPILOG_CHAT = """examples:
  qkv chat --model runs/chatbot
  echo "hello , how are you ?" | qkv chat --model runs/chatbot
  qkv chat --model runs/chatbot --sample --top-p 0.9 --temperature 0.8 --seed 1
"""
EPILOG_EVALUATE = """examples:
  qkv evaluate --hyp out.txt --ref ref.txt --json
  qkv evaluate --hyp test.en --ref $QKV_DATA/multi30k/tok/test_2016_flickr.lc.norm.tok.en --tokenize moses
  qkv evaluate --model qkv-demo/model --examples 500
  qkv evaluate --model runs/shakespeare --text ../shared/data/tinyshakespeare/input.txt
  qkv evaluate --model runs/dailydialog_acts --tsv test.tsv --json     # accuracy, macro-F1
"""
EPILOG_IMPORT_HF = """examples:
  qkv import-hf ~/hf/gpt2 models/gpt2 && qkv generate --model models/gpt2 --prompt "Hello"
  qkv import-hf ~/hf/bert-base-uncased models/bert --json
"""
EPILOG_EXPORT_HF = """example:
  qkv export-hf models/gpt2 hf/gpt2     # then transformers: AutoModelForCausalLM.from_pretrained("hf/gpt2")
"""
EPILOG_EMBED = """examples:
  qkv embed --model runs/dailydialog_mlm --input sentences.txt --output vectors.npy --normalize
  echo "how are you ?" | qkv embed --model runs/dailydialog_mlm --output vectors.jsonl
  python -c "import numpy; print(numpy.load('vectors.npy').shape)"     # (lines, d_model)
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit status 2), not a usage dump."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


BF16_HELP = (
    "run the model in bfloat16 (weights cast on load): faster batched decoding on CPUs with "
    "AVX512-BF16 or AMX; outputs may differ slightly from float32 (check with qkv evaluate)"
)
INT8_HELP = (
    "run the linear layers with int8 weights (PyTorch dynamic quantization, one scale per "
    "output channel): faster decoding at every batch size on CPUs; outputs may differ slightly "
    "from float32 (check with qkv evaluate)"
)


def _add_precision(p: argparse.ArgumentParser) -> None:
    """--bf16 or --int8 (not both): the weights' precision for decoding."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--bf16", action="store_true", help=BF16_HELP)
    group.add_argument("--int8", action="store_true", help=INT8_HELP)


def _number(convert: Callable[[str], float], test: Callable[[float], bool], what: str) -> Callable[[str], float]:
    """An argparse type: ``convert`` the text, then require ``test`` (else say ``what`` is expected)."""

    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _number(int, lambda v: v > 0, "a positive integer")
_positive_float = _number(float, lambda v: v > 0, "a positive number")
# Below 0.001 the scaled logits overflow; greedy decoding is the limit anyway.
_temperature = _number(float, lambda v: v >= 1e-3, "a temperature of at least 0.001")
_probability = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def _read_lines(path: str | None) -> list[str]:
    """Lines of a UTF-8 file (or stdin for None / "-"); bad bytes name the file and line."""
    from qkv.data import decode_lines, read_lines

    if path is None or path == "-":
        return decode_lines(sys.stdin.buffer, "<stdin>")
    return read_lines(path)


class _Output:
    """Lines to stdout, or to a file that appears atomically once all lines are written."""

    def __init__(self, path: str | None) -> None:
        self.path = None if path in (None, "-") else Path(path)
        if self.path is not None and not self.path.parent.is_dir():
            raise UserError(f"cannot write {self.path}: directory {self.path.parent} does not exist")
        if self.path is not None and self.path.is_dir():
            raise UserError(f"cannot write {self.path}: it is a directory")
        if self.path is not None and not os.access(self.path.parent, os.W_OK):
            raise UserError(f"cannot write {self.path}: directory {self.path.parent} is not writable")
        self.lines: list[str] = []

    def write(self, line: str) -> None:
        if self.path is None:
            print(line, flush=True)
        else:
            self.lines.append(line)

    def close(self) -> None:
        if self.path is not None:
            write_atomic(self.path, "".join(f"{line}\n" for line in self.lines).encode())


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


# ------------------------------------------------------------------- commands


def cmd_demo(args: argparse.Namespace) -> int:
    from qkv.plots import attention_heatmap, loss_curve
    from qkv.recipes import load_recipe
    from qkv.seq2seq import cross_attention, train_numbers

    overrides = [f"train.seed={args.seed}"]
    if args.seconds is not None:
        overrides.append(f"train.seconds={args.seconds}")
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    overrides.append(f"data.eval_examples={args.examples}")
    recipe = load_recipe(None, overrides)
    out = Path(args.out)
    steps = recipe["train"]["steps"]
    print(
        f"qkv demo: training an encoder-decoder Transformer to write numbers as English words "
        f"({steps} steps, seed {args.seed})",
        file=sys.stderr,
    )
    summary = train_numbers(recipe, out / "model", progress=not args.quiet)
    if summary["steps"] < steps:
        print(
            f"qkv demo: warning: --seconds {args.seconds} stopped training after {summary['steps']} of {steps} steps",
            file=sys.stderr,
        )
    model, tokenizer = summary["model"], summary["tokenizer"]
    held_out, outputs = summary["held_out"], summary["outputs"]

    print(f"held-out examples (never seen in training), beam search width {recipe['data']['beam_size']}:")
    for (source, reference), output in list(zip(held_out, outputs, strict=True))[:8]:
        mark = "ok " if output == reference else "ERR"
        print(f"  {mark} {source:>9} -> {output}")
    wrong = [(s, r, o) for (s, r), o in zip(held_out, outputs, strict=True) if o != r]
    for source, reference, output in wrong[:3]:
        print(f"  wrong: {source} -> {output!r} (expected {reference!r})")

    # The picture: the held-out example with the longest output, source against output tokens.
    longest = max(range(len(held_out)), key=lambda i: len(outputs[i].split()))
    source = held_out[longest][0]
    src_ids, out_ids = tokenizer.encode(source), tokenizer.encode(outputs[longest])
    weights = cross_attention(model, src=src_ids, out=out_ids)  # (H, T, S)
    png = attention_heatmap(
        weights.numpy(),
        source=[tokenizer.id_to_token(i) for i in src_ids],
        output=[tokenizer.id_to_token(i) for i in [*out_ids, tokenizer.eos_id]],
        path=out / "cross_attention.png",
        title=f"cross-attention of the last decoder layer while writing {source!r}",
    )
    loss_png = loss_curve(summary["losses"], out / "loss.png", title="qkv demo: training loss")
    print(
        f"qkv demo: exact match {summary['exact_match']:.1%} on {len(held_out)} held-out numbers | "
        f"{summary['steps']} steps in {summary['train_seconds']:.0f}s "
        f"({summary['tokens_per_second']:.0f} target tokens/s) | model {out / 'model'} | "
        f"pictures {png}, {loss_png}",
        file=sys.stderr,
    )
    result = {
        "task": "numbers",
        "exact_match": round(summary["exact_match"], 4),
        "train_seconds": round(summary["train_seconds"], 1),
        "attention_png": str(png),
    }
    print(json.dumps(result))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from qkv.bert import train_classifier, train_mlm
    from qkv.lm import train_lm
    from qkv.plots import loss_curve
    from qkv.recipes import load_recipe
    from qkv.seq2seq import train_numbers, train_translation

    recipe = load_recipe(args.recipe, args.set)
    out = Path(args.out).resolve()
    if args.resume and recipe["task"] != "translation":
        raise UserError(f"--resume: the {recipe['task']} task trains in one go; only translation runs resume")
    if recipe["task"] == "lm":
        summary = train_lm(recipe, out, progress=not args.quiet)
        for problem in summary["problems"]:
            print(f"qkv train: note: {problem}", file=sys.stderr)
        score = {"val_loss": round(summary["val_loss"], 4)}
        said = f"val_loss={summary['val_loss']:.4f} (nats/token on the validation split)"
        if "reply_loss" in summary:  # dialogues: each reply given the dialogue before it
            score["reply_loss"] = round(summary["reply_loss"], 4)
            said += (
                f"; reply_loss={summary['reply_loss']:.4f} (perplexity {math.exp(summary['reply_loss']):.1f}) "
                f"on {summary['replies']} validation replies, each given the dialogue before it"
            )
    elif recipe["task"] == "translation":
        summary = train_translation(recipe, out, progress=not args.quiet, resume=args.resume)
        keys = ("bleu", "chrf", "bleu_signature", "final", "epochs", "stopped_by")
        keys += ("over_long_pairs",)
        score = {k: summary[k] for k in keys}
        said = (
            f"validation BLEU {summary['bleu']} chrF {summary['chrf']} ({summary['bleu_signature']}) "
            f"of the {summary['final']} checkpoint after {summary['epochs']} epochs (stopped by "
            f"{summary['stopped_by']}); over-long pairs: {summary['over_long_pairs']['train']} in training "
            f"(data.long: {recipe['data']['long']}), {summary['over_long_pairs']['valid']} in validation (truncated)"
        )
    elif recipe["task"] == "mlm":
        summary = train_mlm(recipe, out, progress=not args.quiet)
        score = {k: round(summary[k], 4) for k in ("valid_loss", "valid_accuracy")}
        said = (
            f"validation masked-LM loss {summary['valid_loss']:.4f} nats, accuracy {summary['valid_accuracy']:.1%} "
            f"on {summary['valid_masked']} masked tokens; {summary['truncated']} training sentences cut to the window"
        )
    elif recipe["task"] == "classify":
        summary = train_classifier(recipe, out, progress=not args.quiet)
        for problem in summary["problems"]:
            print(f"qkv train: note: {problem}", file=sys.stderr)
        majority = summary["majority"]
        score = {
            "accuracy": round(summary["accuracy"], 4),
            "macro_f1": round(summary["macro_f1"], 4),
            "majority": {k: round(v, 4) if isinstance(v, float) else v for k, v in majority.items()},
            "skipped": len(summary["problems"]),
        }
        said = (
            f"validation accuracy {summary['accuracy']:.1%}, macro-F1 {summary['macro_f1']:.3f} on "
            f"{summary['valid_examples']} examples (majority class {majority['label']!r}: accuracy "
            f"{majority['accuracy']:.1%}, macro-F1 {majority['macro_f1']:.3f})"
        )
    else:
        summary = train_numbers(recipe, out, progress=not args.quiet)
        score = {"exact_match": round(summary["exact_match"], 4)}
        said = f"held-out exact match {summary['exact_match']:.1%}"
    loss_curve(summary["losses"], out / "loss.png", title=f"training loss: {args.recipe}")
    # The rate counts what the loss is over: examples (classify), masked tokens (mlm), tokens.
    unit = {"classify": "examples", "mlm": "masked_tokens"}.get(recipe["task"], "tokens")
    result = {
        "task": recipe["task"],
        "model": str(out),
        "steps": summary["steps"],
        "train_seconds": round(summary["train_seconds"], 1),
        f"{unit}_per_second": round(summary["tokens_per_second"]),
        "final_loss": round(summary["final_loss"], 4),
        **score,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"trained {result['steps']} steps in {result['train_seconds']}s "
            f"({result[f'{unit}_per_second']} {unit.replace('_', ' ')}/s), "
            f"final training loss {result['final_loss']}, {said}; "
            f"model saved to {out}"
        )
    return 0


def _load_for_generation(path: str, *, bf16: bool = False, int8: bool = False):
    """The model of ``path`` and its Vocabularies (a decoder-only model's: one tokenizer, joint)."""
    import torch

    from qkv.checkpoint import load_model, model_dir
    from qkv.generation import for_decoding, int8_linears

    path = str(model_dir(path))  # a training run: its final checkpoint
    model, meta = load_model(path)
    if meta["kind"] == "encoder_only":
        raise UserError(f"{path} holds an encoder_only model, which does not generate text")
    model = for_decoding(model)  # one stacked Q/K/V product per self-attention (tested equal)
    if bf16:
        # Half the bytes per weight: batched decoding reads every weight once per step, and
        # the CPU's bf16 matmul units (AVX512-BF16, AMX) do the rest (bench/mt_speed.py).
        model = model.to(torch.bfloat16)
    if int8:
        model = int8_linears(model)  # a quarter of the bytes: faster at every batch size
    return model, _matching_vocabularies(path, model, files=meta.get("files", {}), use="generate")


def _matching_tokenizer(path: str, model, *, files, use: str):
    """The model directory's tokenizer (:func:`_matching_vocabularies`'s source side)."""
    return _matching_vocabularies(path, model, files=files, use=use).source


def _matching_vocabularies(path: str, model, *, files, use: str):
    """The model directory's Vocabularies (separate when ``files``, its config.json's, list
    target_tokenizer.json); refused, naming ``use`` (what needs it), when it has no
    tokenizer.json, and when a tokenizer has ids the model has no embedding for."""
    from qkv.checkpoint import model_dir
    from qkv.tokenization import FILE, Vocabularies

    if FILE not in files:
        raise UserError(f"{path} has no {FILE}; {use} needs a model saved with its tokenizer")
    vocab = Vocabularies.load(model_dir(path), files=files)
    c = model.config
    sizes = (c.src_vocab_size, c.tgt_vocab_size) if hasattr(c, "src_vocab_size") else (c.vocab_size, c.vocab_size)
    for tokenizer, name, size in vocab.tables(src_vocab_size=sizes[0], tgt_vocab_size=sizes[1]):
        if tokenizer.vocab_size > size:
            raise UserError(f"{path}: {name} has {tokenizer.vocab_size} tokens but the model only {size}")
    return vocab


SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "seed")


def _sampling(args: argparse.Namespace) -> bool:
    """Whether to sample: ``--sample``, or any of ``--temperature``, ``--top-k``, ``--top-p``
    and ``--seed`` (which mean nothing to a search: whoever sets one means to sample)."""
    return args.sample or any(getattr(args, name) is not None for name in SAMPLING_OPTIONS)


def _sampling_flags(args: argparse.Namespace) -> str:
    """The flags that asked for sampling, as typed (for an error message)."""
    given = [f"--{name.replace('_', '-')}" for name in SAMPLING_OPTIONS if getattr(args, name) is not None]
    return ", ".join((["--sample"] if args.sample else []) + given)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from qkv.generation import beam_search, continuation, greedy, most_likely, sample, sampler
    from qkv.models.decoder_only import DecoderOnly
    from qkv.seq2seq import cut_source

    if args.nbest > args.beam:
        raise UserError(f"--nbest {args.nbest} needs --beam of at least {args.nbest}")
    sampling = _sampling(args)
    if sampling and args.beam > 1:
        raise UserError(f"{_sampling_flags(args)} and --beam are exclusive: sampling draws one output per input")
    out = _Output(args.output)
    model, vocab = _load_for_generation(args.model, bf16=args.bf16, int8=args.int8)
    # Inputs in the source vocabulary, outputs in the target's (the same one but for an
    # encoder-decoder with separate vocabularies).
    source, target = vocab.source, vocab.target
    lines = [args.prompt] if args.prompt is not None else _read_lines(args.input)
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
        # sliding the window past max_len (generation.continuation).
        if sampling:
            choose = sampler(
                temperature=args.temperature or 1.0, top_k=args.top_k, top_p=args.top_p, generator=generator
            )
        else:
            choose = most_likely
        ids: list[int] = []
        shown = ""
        prompt = encoded[0] or [source.bos_id]
        if len(prompt) > window:
            print(f"qkv generate: note: the prompt keeps its newest {window} tokens (the window)", file=sys.stderr)
        # The continuation is decoded after the prompt and printed from where the prompt's text
        # ends: decoded alone, its first piece would lose its leading space (a SentencePiece
        # "▁word" at the start of a text decodes as "word").
        head = target.decode(prompt)

        def continued(ids: list[int]) -> str:
            text = target.decode([*prompt, *ids])
            return text[len(head) :] if text.startswith(head) else target.decode(ids)

        for token in continuation(model, prompt, max_new_tokens=args.max_new_tokens, choose=choose, slide=True):
            ids.append(token)
            text = continued(ids)
            if text.endswith("\ufffd"):
                continue  # a character whose bytes span several tokens (byte-level BPE): wait for the rest
            print(text[len(shown) :], end="", flush=True)
            shown = text
        print(continued(ids)[len(shown) :], flush=True)
        return 0
    for chunk in _chunks(lines, args.batch_size):
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


def _ensemble(args: argparse.Namespace, model, vocab):  # -> qkv.generation.Ensemble
    """--model's model and the --ensemble ones as one :class:`~qkv.generation.Ensemble`; each
    must be an encoder-decoder with the same vocabularies as --model's (the same tokenizers,
    special tokens and settings)."""
    from qkv.generation import Ensemble
    from qkv.models.encoder_decoder import EncoderDecoder

    models = [model]
    for path in args.ensemble:
        other, theirs = _load_for_generation(path, bf16=args.bf16, int8=args.int8)
        if not isinstance(other, EncoderDecoder):
            raise UserError(f"--ensemble {path} holds a decoder-only model; translate needs encoder-decoders")
        if not theirs.same_as(vocab):
            raise UserError(
                f"--ensemble {path}: its tokenizer differs from {args.model}'s; "
                "ensembled models must share their vocabularies"
            )
        try:  # Ensemble's own checks (special ids, vocabulary sizes), this model against --model's
            Ensemble((model, other))
        except ValueError as e:
            raise UserError(f"--ensemble {path} does not fit {args.model} ({e})") from None
        models.append(other)
    return Ensemble(tuple(models))


def cmd_translate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from qkv.models.encoder_decoder import EncoderDecoder
    from qkv.seq2seq import alignments, source_ids, translate

    if args.nbest > args.beam:
        raise UserError(f"--nbest {args.nbest} needs --beam of at least {args.nbest}")
    model, vocab = _load_for_generation(args.model, bf16=args.bf16, int8=args.int8)
    if not isinstance(model, EncoderDecoder):
        raise UserError(f"{args.model} holds a decoder-only model; translate needs an encoder-decoder (see generate)")
    aligner = model  # alignments come from --model's cross-attention, ensemble or not
    if args.ensemble:
        model = _ensemble(args, model, vocab)
    out = _Output(args.output)
    aligned = _Output(args.alignments) if args.alignments else None
    lines = _read_lines(args.input)
    window = model.config.max_len
    too_long = sum(len(ids) > window for ids in vocab.source.encode_batch(lines))
    if too_long:
        print(
            f"qkv translate: note: {too_long} input line(s) cut to the model's window of {window} tokens",
            file=sys.stderr,
        )
    start = time.perf_counter()
    found: list = []
    bar = tqdm(
        total=len(lines), desc="qkv translate", unit="line", disable=args.quiet or len(lines) < 100, dynamic_ncols=True
    )
    for chunk in _chunks(lines, 1024):  # bounded memory; each chunk is batched by tokens inside
        found += translate(
            model,
            vocab,
            chunk,
            beam_size=args.beam,
            nbest=args.nbest,
            length_penalty=args.length_penalty,
            max_len_a=args.max_len_a,
            max_len_b=args.max_len_b,
            max_tokens=args.max_tokens,
        )
        bar.update(len(chunk))
    bar.close()
    seconds = time.perf_counter() - start
    for line, hyps in zip(lines, found, strict=True):
        for h in hyps:
            text = h.text.replace("\\", "\\\\").replace("\n", "\\n")  # one output per line
            # An empty input gives --nbest empty lines (no score: nothing was translated).
            out.write(f"{text}\t{h.score:.4f}" if args.nbest > 1 and line.strip() else text)
    if aligned is not None:
        sources = source_ids(vocab.source, lines, window=window)
        for src, hyps in zip(sources, found, strict=True):
            for h in hyps:
                pairs = alignments(aligner, src=[src], out=[h.tokens])[0]
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


_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def _unescape(text: str) -> str:
    """``text`` with the escapes \\n, \\t and \\\\ replaced, left to right; any other backslash
    stays as typed (``unicode_escape`` would garble non-ASCII text and fail on a final backslash)."""
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


def cmd_chat(args: argparse.Namespace) -> int:
    model, vocab = _load_for_generation(args.model, bf16=args.bf16, int8=args.int8)
    choose = None
    if _sampling(args):
        import torch

        from qkv.generation import sampler

        generator = torch.Generator()
        if args.seed is not None:
            generator.manual_seed(args.seed)
        else:
            generator.seed()
        temperature = args.temperature or 1.0
        choose = sampler(temperature=temperature, top_k=args.top_k, top_p=args.top_p, generator=generator)
    separator = _unescape(args.separator)
    interactive = sys.stdin.isatty()
    save_history = _chat_history() if interactive else None
    if interactive:
        print(f"qkv chat with {args.model}; an empty line or Ctrl-D ends the chat", file=sys.stderr)
    try:
        _chat_loop(args, model, vocab, separator=separator, choose=choose, interactive=interactive)
    finally:
        if save_history is not None:
            save_history()
    return 0


CHAT_HISTORY = "QKV_CHAT_HISTORY"  # the environment variable naming the chat's history file


def _chat_history() -> Callable[[], None]:
    """Line editing and history for ``input()`` (GNU readline), the lines typed in earlier chats
    included: read from ``~/.qkv_chat_history`` (``$QKV_CHAT_HISTORY`` names another file; set
    empty, none is kept). Returns what saves the history (the newest 1,000 lines), atomically; a
    history that cannot be read (then it is left as it is) or written is a note on stderr, never
    the end of a chat."""
    try:
        import readline
    except ImportError:  # a Python built without GNU readline (or libedit): plain input()
        return lambda: None
    path = os.environ.get(CHAT_HISTORY, str(Path.home() / ".qkv_chat_history"))
    if not path:
        return lambda: None
    try:
        readline.read_history_file(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # not overwritten either: saving would lose the lines it holds
        print(f"qkv chat: note: cannot read the history {path} ({e.strerror or e}); not saving it", file=sys.stderr)
        return lambda: None
    readline.set_history_length(1000)

    def save() -> None:
        temporary = f"{path}.tmp-{os.getpid()}"
        try:
            readline.write_history_file(temporary)
            os.replace(temporary, path)
        except OSError as e:
            print(f"qkv chat: note: cannot save the history to {path}: {e.strerror or e}", file=sys.stderr)
            Path(temporary).unlink(missing_ok=True)

    return save


def _chat_loop(args: argparse.Namespace, model, vocab, *, separator: str, choose, interactive: bool) -> None:
    """Read a turn, print the reply, until an empty line (a terminal), Ctrl-D or the end of stdin."""
    from qkv.chat import reply
    from qkv.data import decode_lines

    turns: list[str] = []
    number = 0
    while True:
        number += 1
        try:
            if interactive:
                line = input("you> ")
            else:
                # Read bytes, one line at a time (each turn is answered before the next is read),
                # so invalid UTF-8 is named by its line, as every other command names it.
                raw = sys.stdin.buffer.readline()
                if not raw:
                    break
                line = decode_lines([raw], "<stdin>", first=number)[0]
        except EOFError:
            break
        except UnicodeDecodeError as e:  # input() in a terminal decodes the bytes itself
            raise UserError(f"<stdin>:{number}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
        line = line.strip()
        if not line:
            if interactive:
                break
            continue
        turns.append(line)
        answer = reply(model, vocab, turns, separator=separator, max_new_tokens=args.max_new_tokens, choose=choose)
        turns.append(answer)
        print(f"bot> {answer}" if interactive else answer, flush=True)


def _evaluate_classifier(path: str, tsv: str) -> dict:
    """Accuracy and macro-F1 of a classify-task model on a ``text<TAB>label`` file, computed as
    training computes its final validation scores."""
    from qkv.bert import predict_labels
    from qkv.checkpoint import load_model
    from qkv.data import read_labelled, resolve
    from qkv.evaluation import accuracy, macro_f1
    from qkv.hf.convert import classifier_labels

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
    tokenizer = _matching_tokenizer(path, model, files=meta["files"], use="--tsv")
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


def cmd_evaluate(args: argparse.Namespace) -> int:
    if args.text is not None and args.tsv is not None:
        raise UserError("give --text (a language model) or --tsv (a classifier), not both")
    if args.text is not None:
        from qkv.checkpoint import load_model
        from qkv.data import read_text, resolve
        from qkv.evaluation import lm_loss
        from qkv.lm import documents_of, split_documents, token_stream

        if args.model is None:
            raise UserError("--text needs --model DIR (a decoder-only model)")
        model, meta = load_model(args.model, kind="decoder_only")
        tokenizer = _matching_tokenizer(args.model, model, files=meta["files"], use="--text")
        # The stream as training built its validation stream: a model that read one document
        # per line (each ending with END) is scored the same way, so the loss is comparable.
        documents = documents_of(meta)
        text = read_text(resolve(args.text))
        ids = token_stream(tokenizer, split_documents(text, documents=documents), documents=documents)
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
        from qkv.seq2seq import evaluate_numbers
        from qkv.tasks import held_out_numbers, numbers_pairs

        if args.examples > len(held_out_numbers()):
            raise UserError(f"--examples {args.examples}: only {len(held_out_numbers())} held-out numbers exist")
        meta = read_meta(model_dir(args.model))
        if meta.get("task") == "classify" or meta.get("labels"):
            raise UserError(f"{args.model} is a classifier; give --tsv FILE (text<TAB>label lines) to score it")
        if meta["kind"] != "encoder_decoder":
            raise UserError(f"{args.model} is not a numbers-task model (kind {meta['kind']})")
        # Loaded first, so a model that lacks its tokenizer is told so; then only the numbers
        # task is scored (an imported or recipe-less model has no task and is refused).
        model, vocab = _load_for_generation(args.model)
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
        hyps, refs = _read_lines(args.hyp), _read_lines(args.ref)
        if len(hyps) != len(refs):
            raise UserError(f"{args.hyp} has {len(hyps)} lines but {args.ref} has {len(refs)}")
        if not hyps:
            raise UserError(f"{args.hyp} and {args.ref} are empty: nothing to score")
        result = corpus_scores(hyps, refs, tokenize=args.tokenize, lowercase=args.lowercase, lang=args.lang)
    if args.json:
        print(json.dumps(result))
    else:
        print("  ".join(f"{k}={v}" for k, v in result.items()))
    return 0


def cmd_import_hf(args: argparse.Namespace) -> int:
    from qkv.hf.convert import import_hf

    result = import_hf(args.src, args.dst)
    if result["ignored"]:  # tensors the model does not use (BERT's next-sentence head, an unused pooler)
        names = result["ignored"]
        print(
            f"qkv import-hf: note: {len(names)} tensor(s) of {args.src} not used: {', '.join(names)}", file=sys.stderr
        )
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"imported {result['architecture']} as a {result['kind']} model ({result['parameters']} parameters) "
            f"into {result['model']}; tokenizer: {result['tokenizer']}"
        )
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    import io

    import numpy as np

    from qkv.bert import sentence_embeddings
    from qkv.checkpoint import load_model

    suffix = Path(args.output).suffix
    if suffix not in (".npy", ".jsonl"):
        raise UserError(f"--output {args.output}: the name must end in .npy (NumPy float32) or .jsonl (JSON lines)")
    out = _Output(args.output)  # checks the directory before any work
    model, meta = load_model(args.model, kind="encoder_only")
    tokenizer = _matching_tokenizer(args.model, model, files=meta["files"], use="embed")
    lines = _read_lines(args.input)
    vectors, cut = sentence_embeddings(model, tokenizer, lines, batch_size=args.batch_size, normalize=args.normalize)
    if cut:
        print(
            f"qkv embed: note: {cut} line(s) cut to the model's window of {model.config.max_len} tokens",
            file=sys.stderr,
        )
    array = vectors.numpy().astype(np.float32)  # (N, D)
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


def cmd_export_hf(args: argparse.Namespace) -> int:
    from qkv.hf.convert import export_hf

    result = export_hf(args.src, args.dst)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"exported as {result['architecture']} into {result['out']}: {', '.join(result['files'])}")
    return 0


# --------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="qkv",
        description="qkv: the Transformer, whole. Train, run and score encoder-decoder, encoder-only "
        "and decoder-only models.",
        epilog="run `qkv COMMAND --help` for each command's options and an example",
    )
    parser.add_argument("--version", action="version", version=f"qkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    raw = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser(
        "demo",
        help="train the built-in numbers->words task and show what the model learned",
        description="Train a small encoder-decoder from scratch on the built-in task (numbers written with "
        "digits -> English words), offline; report exact match on held-out numbers, show beam-search outputs, "
        "draw the cross-attention, save the model. Ends with one JSON line on stdout.",
        epilog=EPILOG_DEMO,
        formatter_class=raw,
    )
    p.add_argument("--out", default="qkv-demo", help="output directory (default: qkv-demo)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument(
        "--seconds",
        type=_positive_float,
        default=None,
        help="stop training after this many seconds even if steps remain (a warning says so)",
    )
    p.add_argument("--steps", type=_positive_int, default=None, help="training steps (default: the recipe's)")
    p.add_argument("--examples", type=_positive_int, default=1000, help="held-out numbers to score (default: 1000)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_demo)

    p = sub.add_parser(
        "train",
        help="train a model from a recipe (YAML)",
        description="Train from a recipe: task, model config and training settings in YAML; any key can be "
        "overridden with --set section.key=value.",
        epilog=EPILOG_TRAIN,
        formatter_class=raw,
    )
    p.add_argument("recipe", help="recipe YAML file, e.g. recipes/numbers.yaml")
    p.add_argument("--out", required=True, help="model directory (translation: run directory) to write")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe value")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_train)

    p = sub.add_parser(
        "translate",
        help="translate text with an encoder-decoder model or training run (stdin or a file)",
        description="Read one sentence per line (stdin or --input) and write its translation per line, in "
        "order (an empty line gives an empty line), detokenized. Beam search with a length penalty; an output "
        "has at most a*S + b tokens (S: its source's length). --nbest N writes N lines per input, each "
        "text<TAB>score (an empty input: N empty lines). --alignments FILE writes, per output line, "
        "source-output token index pairs (i-j) from the last decoder layer's cross-attention. --model may be a "
        "run directory (its final checkpoint).",
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
    p.add_argument("--beam", type=_number(int, lambda v: v >= 1, "an integer >= 1"), default=5, help="beam width")
    p.add_argument(
        "--nbest",
        type=_number(int, lambda v: v >= 1, "an integer >= 1"),
        default=1,
        help="outputs per input, each with its score",
    )
    p.add_argument(
        "--length-penalty",
        type=_number(float, lambda v: v >= 0, "a number >= 0"),
        default=1.0,
        help="score = log p / length^penalty (default 1.0)",
    )
    p.add_argument(
        "--max-len-a",
        type=_number(float, lambda v: v >= 0, "a number >= 0"),
        default=1.5,
        help="outputs have at most a*S + b tokens (default a=1.5)",
    )
    p.add_argument(
        "--max-len-b", type=_number(int, lambda v: v >= 0, "an integer >= 0"), default=10, help="(default b=10)"
    )
    p.add_argument(
        "--max-tokens",
        type=_number(int, lambda v: v >= 1, "an integer >= 1"),
        default=8192,
        help="source tokens x beam per batch (default 8192)",
    )
    p.add_argument("--alignments", metavar="FILE", help="write cross-attention alignments to FILE")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    _add_precision(p)
    p.set_defaults(run=cmd_translate)

    p = sub.add_parser(
        "generate",
        help="translate / continue text with a trained model (stdin or a file)",
        description="Read one input per line (stdin, --input FILE or --prompt TEXT) and write one output per "
        "line, in order; an empty line gives an empty line. Greedy by default; --beam N for beam search, "
        "--sample for sampling. A language model given --prompt streams its continuation as it is made. "
        "An input longer than the model's window is cut (a source keeps its first max_len tokens, a prompt "
        "its newest max_len // 2; a note on stderr names the line); the output stops where the window is full, "
        "except a streamed --prompt, which slides on past it (see README, 'The window').",
        epilog=EPILOG_GENERATE,
        formatter_class=raw,
    )
    p.add_argument("--model", required=True, help="model directory (config.json + model.safetensors + tokenizer)")
    p.add_argument("--input", default=None, help="input file (default: stdin)")
    p.add_argument("--prompt", default=None, help="a single input given on the command line")
    p.add_argument("--output", default=None, help="output file (default: stdout)")
    p.add_argument("--beam", type=_positive_int, default=1, help="beam width (1: greedy)")
    p.add_argument("--nbest", type=_positive_int, default=1, help="outputs per input, with scores (needs --beam)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64, help="longest output (default: 64)")
    p.add_argument(
        "--sample", action="store_true", help="sample instead of searching (implied by the four options below)"
    )
    p.add_argument("--temperature", type=_temperature, default=None, help="sampling temperature (default: 1)")
    p.add_argument("--top-k", type=_positive_int, default=None, help="sample among the k most likely tokens")
    p.add_argument(
        "--top-p", type=_probability, default=None, help="sample from the smallest set with this probability"
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    p.add_argument("--batch-size", type=_positive_int, default=64, help="inputs decoded together")
    _add_precision(p)
    p.set_defaults(run=cmd_generate)

    p = sub.add_parser(
        "chat",
        help="talk with a model, turn by turn (interactive, or one turn per stdin line)",
        description="A multi-turn chat. The dialogue so far is given to the model, newest turns first to be "
        "kept when it no longer fits the model's window. A decoder-only model continues the dialogue until it "
        "writes the separator; an encoder-decoder model reads the dialogue and writes the reply. Reading a "
        "pipe, each input line is one turn and each reply one output line.",
        epilog=EPILOG_CHAT,
        formatter_class=raw,
    )
    p.add_argument("--model", required=True, help="model directory (decoder-only or encoder-decoder, with tokenizer)")
    p.add_argument(
        "--separator",
        default=" __eou__ ",
        help="text that ends a turn; \\n, \\t and \\\\ are a newline, a tab and a backslash "
        "(default: DailyDialog's ' __eou__ ')",
    )
    p.add_argument("--max-new-tokens", type=_positive_int, default=60, help="longest reply (default: 60)")
    p.add_argument(
        "--sample",
        action="store_true",
        help="sample replies (default: greedy, or beam search; implied by the four options below)",
    )
    p.add_argument("--temperature", type=_temperature, default=None, help="sampling temperature (default: 1)")
    p.add_argument("--top-k", type=_positive_int, default=None, help="sample among the k most likely tokens")
    p.add_argument(
        "--top-p", type=_probability, default=None, help="sample from the smallest set of tokens with this probability"
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible replies)")
    _add_precision(p)
    p.set_defaults(run=cmd_chat)

    p = sub.add_parser(
        "evaluate",
        help="score hypotheses against references (BLEU, chrF, exact match), or a model on its task",
        description="With --hyp and --ref: sacreBLEU BLEU and chrF (with signatures) and exact match. With "
        "--model: exact match of a numbers model on held-out numbers. With --model and --text: a language "
        "model's loss (nats/token) and perplexity on the text, in non-overlapping windows of its context; a "
        "model trained with one document per line (data.documents) reads every non-empty line as a document "
        "ending with END, as its validation loss was measured. "
        "With --model and --tsv: a classifier's accuracy and macro-F1 on text<TAB>label lines.",
        epilog=EPILOG_EVALUATE,
        formatter_class=raw,
    )
    p.add_argument("--hyp", default=None, help="hypotheses, one per line")
    p.add_argument("--ref", default=None, help="references, one per line")
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
        "--model",
        default=None,
        help="a model directory: a numbers-task model, with --text a LM, with --tsv a classifier",
    )
    p.add_argument("--text", default=None, help="text file: loss and perplexity of the --model language model")
    p.add_argument("--tsv", default=None, help="text<TAB>label file: accuracy and macro-F1 of the --model classifier")
    p.add_argument("--examples", type=_positive_int, default=1000, help="held-out numbers to evaluate")
    p.add_argument("--beam", type=_positive_int, default=4, help="beam width for --model")
    p.add_argument("--seed", type=int, default=1, help="which held-out numbers to draw")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.set_defaults(run=cmd_evaluate)

    p = sub.add_parser(
        "import-hf",
        help="convert a local Hugging Face checkpoint (BERT, GPT-2, Marian) into a qkv model directory",
        description="Read a Hugging Face checkpoint directory (config.json + model.safetensors or "
        "pytorch_model.bin, and its tokenizer files) of BertModel, BertForMaskedLM, "
        "BertForSequenceClassification, GPT2LMHeadModel or MarianMTModel and write a qkv model directory "
        "that computes the same outputs. Nothing is downloaded. Marian's SentencePiece files are converted "
        "(shared vocabulary) and kept for export; tensors the model does not use are named on stderr.",
        epilog=EPILOG_IMPORT_HF,
        formatter_class=raw,
    )
    p.add_argument("src", help="Hugging Face checkpoint directory (what save_pretrained writes)")
    p.add_argument("dst", help="qkv model directory to write")
    p.add_argument("--json", action="store_true", help="print a summary as one JSON line")
    p.set_defaults(run=cmd_import_hf)

    p = sub.add_parser(
        "export-hf",
        help="write a qkv model directory as a Hugging Face checkpoint (BERT, GPT-2, Marian)",
        description="Write a qkv model whose architecture is BERT's (encoder_only), GPT-2's (decoder_only) or "
        "Marian's (encoder_decoder) as a directory that transformers loads with from_pretrained: config.json, "
        "model.safetensors and the tokenizer files. A model those architectures cannot express is refused, "
        "naming the config field.",
        epilog=EPILOG_EXPORT_HF,
        formatter_class=raw,
    )
    p.add_argument("src", help="qkv model directory or training run")
    p.add_argument("dst", help="output directory (must not exist, or be an empty directory other than the current one)")
    p.add_argument("--json", action="store_true", help="print a summary as one JSON line")
    p.set_defaults(run=cmd_export_hf)

    p = sub.add_parser(
        "embed",
        help="sentence vectors from an encoder-only model (mean of its last hidden states)",
        description="Read one sentence per line (stdin or --input) and write one vector per line, in order: "
        "the mean over the sentence's positions ([BEGIN] sentence [END], padding excluded) of the encoder's "
        "last hidden states. --output NAME.npy writes a float32 NumPy array (lines x d_model); NAME.jsonl "
        'writes one {"embedding": [...]} object per line. An empty line gives a zero row (so rows match '
        "lines); a line longer than the model's window is cut to it. The file appears atomically.",
        epilog=EPILOG_EMBED,
        formatter_class=raw,
    )
    p.add_argument("--model", required=True, help="encoder_only model directory (with its tokenizer)")
    p.add_argument("--input", default=None, help="input file, one sentence per line (default: stdin)")
    p.add_argument("--output", required=True, help="output file: .npy (NumPy float32) or .jsonl (JSON lines)")
    p.add_argument("--normalize", action="store_true", help="scale every row to unit L2 norm (zero rows stay zero)")
    p.add_argument("--batch-size", type=_positive_int, default=64, help="sentences encoded together (default: 64)")
    p.set_defaults(run=cmd_embed)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except UserError as e:
        print(f"qkv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"qkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def console_main() -> int:
    """The ``qkv`` program and ``python -m qkv``: :func:`main` on the faster allocator.

    TCMalloc makes CPU training up to 1.7x faster (``memory.py``); the restart that loads it
    replaces the whole interpreter, so only these entry points choose, never :func:`main`.
    """
    choose_allocator()
    return main()
