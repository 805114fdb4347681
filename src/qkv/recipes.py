"""Recipes: a YAML file that names a task, a model and training settings, and its runner.

What is here: :func:`load_recipe` (YAML + ``--set key=value`` overrides, checked against
the known sections and keys, errors naming the file and key), :func:`train_numbers` (the
built-in numbers task end to end: data, tokenizer, model, training, held-out exact match,
model directory), :func:`train_lm` (character-level language modelling on a text file,
scored by validation loss), :func:`train_translation` (parallel text, subword vocabulary,
token-budget batches, validation BLEU) and :func:`cross_attention` (last-layer cross-attention of one example,
for pictures).

What is not here: argument parsing and printing (``cli.py``).
"""

from __future__ import annotations

import copy
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import yaml
from torch import nn

from qkv.checkpoint import build_model, check_output, make_config, save_model
from qkv.data import batches_by_tokens, read_parallel, read_text, resolve
from qkv.errors import UserError
from qkv.evaluation import corpus_scores, exact_match, lm_loss
from qkv.generation import beam_search
from qkv.models.decoder_only import DecoderOnly
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.tasks import numbers_pairs
from qkv.tokenization import FILE as TOKENIZER_FILE
from qkv.tokenization import Tokenizer
from qkv.training import SCHEDULES, FitResult, fit, seq2seq_batch, sequence_loss

TASKS = ("numbers", "lm", "translation")

# Every key a recipe may set, with its default, per task. The model section takes the
# fields of the task's model config dataclass (checked before any data is read).
NUMBERS_DEFAULTS: dict = {
    "task": "numbers",
    "model": {
        "d_model": 64,
        "n_heads": 4,
        "d_ff": 256,
        "n_encoder_layers": 2,
        "n_decoder_layers": 2,
        "share_embeddings": True,
        "tie_output": True,
        "dropout": 0.0,
        "max_len": 64,
    },
    "train": {
        "steps": 3000,  # ~100 s on 2 Zen 4 cores
        "seconds": None,
        "batch_size": 128,
        "lr": 3e-3,
        "warmup": 100,
        "schedule": "cosine",
        "min_lr": 0.0,
        "weight_decay": 0.01,
        "beta2": 0.98,
        "clip": 1.0,
        "bf16": False,
        "label_smoothing": 0.0,
        "seed": 0,
    },
    "data": {"eval_examples": 1000, "beam_size": 4},
}

# Character-level language modelling; the defaults are nanoGPT's Shakespeare CPU
# configuration (4 layers, 4 heads, width 128, context 64, batch 12, 2,000 steps).
LM_DEFAULTS: dict = {
    "task": "lm",
    "model": {
        "d_model": 128,
        "n_heads": 4,
        "d_ff": 512,
        "n_layers": 4,
        "max_len": 64,
        "dropout": 0.0,
        "positions": "learned",
        "activation": "gelu",
        "bias": False,
        "scale_embeddings": False,
        "tie_output": True,
    },
    "train": {
        "steps": 2000,
        "seconds": None,
        "batch_size": 12,
        "lr": 1e-3,
        "warmup": 100,
        "schedule": "cosine",
        "min_lr": 1e-4,
        "weight_decay": 0.1,
        "beta2": 0.99,
        "clip": 1.0,
        "bf16": False,
        "label_smoothing": 0.0,
        "seed": 0,
    },
    "data": {"text": "tinyshakespeare/input.txt", "val_fraction": 0.1, "eval_batch_size": 64},
}

# Translation from parallel text (two aligned files or one TSV per split); a 3+3-layer,
# width-256 Transformer with a shared unigram vocabulary by default.
TRANSLATION_DEFAULTS: dict = {
    "task": "translation",
    "model": {
        "d_model": 256,
        "n_heads": 4,
        "d_ff": 1024,
        "n_encoder_layers": 3,
        "n_decoder_layers": 3,
        "share_embeddings": True,
        "tie_output": True,
        "dropout": 0.1,
        "max_len": 256,
    },
    "train": {
        "steps": 10000,
        "seconds": None,
        "max_tokens": 4096,
        "lr": 1e-3,
        "warmup": 1000,
        "schedule": "inverse_sqrt",
        "min_lr": 0.0,
        "weight_decay": 0.01,
        "beta2": 0.98,
        "clip": 1.0,
        "bf16": False,
        "label_smoothing": 0.1,
        "seed": 0,
    },
    "data": {
        "train": ["multi30k/train.de", "multi30k/train.en"],
        "valid": ["multi30k/val.de", "multi30k/val.en"],
        "vocab_size": 8000,
        "long": "drop",
        "beam_size": 4,
        "bleu_tokenize": "13a",
        "lowercase": False,
    },
}

DEFAULTS = {"numbers": NUMBERS_DEFAULTS, "lm": LM_DEFAULTS, "translation": TRANSLATION_DEFAULTS}
# The longest numbers target is 10 words ("seven hundred seventy seven thousand ..."):
# BEGIN + 10 words are 11 decoder positions; the longest source is 7 tokens.
NUMBERS_MIN_LEN = 11
MODEL_KINDS = {"numbers": "encoder_decoder", "lm": "decoder_only", "translation": "encoder_decoder"}


def _set(recipe: dict, key: str, value, *, where: str) -> None:
    parts = key.split(".")
    node = recipe
    for i, part in enumerate(parts[:-1]):
        if not isinstance(node.get(part), dict):
            raise UserError(f"{where}: {'.'.join(parts[: i + 1])} is not a section of the recipe")
        node = node[part]
    if parts[0] != "model" and parts[-1] not in node:
        raise UserError(f"{where}: unknown key {key!r}; known in this section: {', '.join(sorted(node))}")
    if isinstance(node.get(parts[-1]), dict):
        raise UserError(f"{where}: {key} is a section; set its keys, e.g. {key}.{next(iter(node[parts[-1]]))}=...")
    node[parts[-1]] = value


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> dict:
    """The task's defaults, then the YAML file (if any), then ``key=value`` overrides.

    Override values are read as YAML (``train.steps=7`` is an int). The task comes from
    ``task=`` among the overrides, else the file, else "numbers".
    """
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"recipe {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise UserError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
        except OSError as e:
            raise UserError(f"cannot read {path}: {e.strerror}") from None
        if not isinstance(data, dict):
            raise UserError(f"{path}: expected a mapping of sections (task, model, train, data)")
    where = str(path) if path is not None else "recipe"
    task = data.get("task", "numbers")
    for item in overrides:
        if item.partition("=")[0].strip() == "task":
            task = item.partition("=")[2].strip()
    if task not in TASKS:
        raise UserError(f"{where}: unknown task {task!r}; known: {', '.join(TASKS)}")
    recipe = copy.deepcopy(DEFAULTS[task])
    if path is not None:
        for section, value in data.items():
            if section not in recipe:
                raise UserError(f"{path}: unknown section {section!r}; known: {', '.join(recipe)}")
            if isinstance(recipe[section], dict):
                if not isinstance(value, dict):
                    raise UserError(f"{path}: section {section!r} must be a mapping")
                for key, v in value.items():
                    _set(recipe, f"{section}.{key}", v, where=str(path))
            else:
                recipe[section] = value
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise UserError(f"--set {item!r}: expected key=value, e.g. train.steps=3000")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise UserError(f"--set {item!r}: the value is not valid YAML: {str(e).splitlines()[0]}") from None
        _set(recipe, key.strip(), value, where=f"--set {item}")
    _check_values(recipe, where)
    if task == "numbers" and recipe["model"].get("max_len", 512) < NUMBERS_MIN_LEN:
        raise UserError(f"{where}: model.max_len must be at least {NUMBERS_MIN_LEN} for the numbers task")
    # Check the model fields now, before any data is read (the vocabulary comes later).
    vocab = {"vocab_size": 64} if task == "lm" else {"src_vocab_size": 64, "tgt_vocab_size": 64}
    make_config(MODEL_KINDS[task], {**recipe["model"], **vocab})
    return recipe


def _paths(value: list) -> bool:
    return 1 <= len(value) <= 2 and all(isinstance(v, str) and v for v in value)


# (section, key) -> (accepted types, test, what the value must be)
_RULES = {
    ("train", "steps"): (int, lambda v: v > 0, "a positive integer"),
    ("train", "batch_size"): (int, lambda v: v > 0, "a positive integer"),
    ("train", "warmup"): (int, lambda v: v >= 0, "an integer >= 0"),
    ("train", "seed"): (int, lambda v: True, "an integer"),
    ("train", "schedule"): (str, lambda v: v in SCHEDULES, f"one of {', '.join(SCHEDULES)}"),
    ("train", "lr"): ((int, float), lambda v: v > 0, "a positive number"),
    ("train", "label_smoothing"): ((int, float), lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("train", "seconds"): ((int, float, type(None)), lambda v: v is None or v > 0, "a positive number or null"),
    ("train", "min_lr"): ((int, float), lambda v: v >= 0, "a number >= 0"),
    ("train", "weight_decay"): ((int, float), lambda v: v >= 0, "a number >= 0"),
    ("train", "beta2"): ((int, float), lambda v: 0 < v < 1, "a number in (0, 1)"),
    ("train", "clip"): ((int, float), lambda v: v >= 0, "a number >= 0 (0: no clipping)"),
    ("train", "bf16"): (bool, lambda v: True, "true or false"),
    ("data", "eval_examples"): (int, lambda v: 0 < v <= 10_000, "an integer in 1..10000 (held-out numbers)"),
    ("data", "beam_size"): (int, lambda v: v > 0, "a positive integer"),
    ("data", "text"): (str, lambda v: bool(v), "a file path"),
    ("data", "val_fraction"): ((int, float), lambda v: 0 < v < 1, "a number in (0, 1)"),
    ("data", "eval_batch_size"): (int, lambda v: v > 0, "a positive integer"),
    ("train", "max_tokens"): (int, lambda v: v > 0, "a positive integer"),
    ("data", "train"): (list, _paths, "a list of one TSV path or two aligned file paths"),
    ("data", "valid"): (list, _paths, "a list of one TSV path or two aligned file paths"),
    ("data", "vocab_size"): (int, lambda v: v > 8, "an integer > 8"),
    ("data", "long"): (str, lambda v: v in ("drop", "truncate"), "drop or truncate"),
    ("data", "bleu_tokenize"): (str, lambda v: v in ("13a", "zh", "intl", "char", "none"), "a sacreBLEU tokenizer"),
    ("data", "lowercase"): (bool, lambda v: True, "true or false"),
}


def _as_number(value: object) -> object:
    """YAML reads 1e-3 (no dot) as a string; numbers written that way are numbers here."""
    if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        return float(value)
    return value


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)")


def _check_values(recipe: dict, where: str) -> None:
    for key, value in recipe["model"].items():
        recipe["model"][key] = _as_number(value)
    for (section, key), (types, test, what) in _RULES.items():
        if key not in recipe.get(section, {}):
            continue  # a key of another task
        if float in (types if isinstance(types, tuple) else (types,)):
            recipe[section][key] = _as_number(recipe[section][key])
        value = recipe[section][key]
        if (isinstance(value, bool) and types is not bool) or not isinstance(value, types) or not test(value):
            raise UserError(f"{where}: {section}.{key} must be {what}, got {value!r}")


def _seq2seq_model(recipe: dict, tokenizer: Tokenizer) -> EncoderDecoder:
    """A fresh encoder-decoder from the recipe's model section and one shared vocabulary."""
    fields = {
        **recipe["model"],
        "src_vocab_size": tokenizer.vocab_size,
        "tgt_vocab_size": tokenizer.vocab_size,
        "pad_id": tokenizer.pad_id,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
    }
    return build_model("encoder_decoder", fields)


def _fit(
    model: nn.Module,
    step_loss: Callable[[nn.Module, int], tuple[torch.Tensor, int]],
    train: dict,
    *,
    progress: bool,
    desc: str,
) -> FitResult:
    """:func:`~qkv.training.fit` with a recipe's train section."""
    return fit(
        model,
        step_loss,
        steps=int(train["steps"]),
        seconds=train["seconds"],
        lr=float(train["lr"]),
        warmup=int(train["warmup"]),
        schedule=train["schedule"],
        min_lr=float(train["min_lr"]),
        weight_decay=float(train["weight_decay"]),
        betas=(0.9, float(train["beta2"])),
        clip=float(train["clip"]),
        bf16=train["bf16"],
        progress=progress,
        desc=desc,
    )


def _save(model: nn.Module, tokenizer: Tokenizer, out: str | Path, *, extra: dict) -> None:
    """Save the model directory with its tokenizer file."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_path = Path(tmp) / TOKENIZER_FILE
        tokenizer.save(tokenizer_path)
        save_model(model, out, files={TOKENIZER_FILE: tokenizer_path}, extra=extra)


def _summary(result: FitResult, model: nn.Module, tokenizer: Tokenizer) -> dict:
    return {
        "train_seconds": result.seconds,
        "steps": result.steps,
        "tokens_per_second": result.tokens / max(result.seconds, 1e-9),
        "final_loss": result.losses[-1],
        "losses": result.losses,
        "model": model,
        "tokenizer": tokenizer,
    }


def cross_attention(model: EncoderDecoder, *, src: list[int], out: list[int]) -> torch.Tensor:
    """Cross-attention weights of the last decoder layer while it produces ``out`` + END.

    Row t is the step that reads BEGIN + out[:t] and produces (out + [END])[t].

    Shapes: returns (H, T, S) with T = len(out) + 1 and S = len(src).
    """
    c = model.config
    source = torch.tensor([src])  # (1, S)
    target = torch.tensor([[c.bos_id, *out]])  # (1, T)
    with torch.no_grad():
        memory = model.encode(source)  # (1, S, D)
        attention = model.decode(target, memory, src_mask=source != c.pad_id, need_weights=True).attention
    return attention[-1][0]  # (H, T, S)


def evaluate_numbers(
    model: EncoderDecoder, tokenizer: Tokenizer, *, pairs: list[tuple[str, str]], beam_size: int
) -> tuple[float, list[str]]:
    """Exact match of beam-search outputs on (digits, words) pairs; returns it and the outputs."""
    outputs = beam_translate(model, tokenizer, [a for a, _ in pairs], beam_size=beam_size)
    return exact_match(outputs, [b for _, b in pairs]), outputs


def beam_translate(
    model: EncoderDecoder, tokenizer: Tokenizer, texts: list[str], *, beam_size: int, batch_size: int = 64
) -> list[str]:
    """The best beam-search output of every text, in order.

    Texts are decoded in batches of similar length; a source is cut to the model's window,
    and an output may have at most 2·S + 10 tokens (S: the longest source of its batch).
    """
    sources = [ids[: model.config.max_len] for ids in tokenizer.encode_batch(texts)]
    outputs = [""] * len(texts)
    by_length = sorted(range(len(texts)), key=lambda i: len(sources[i]))
    for k in range(0, len(by_length), batch_size):
        chunk = by_length[k : k + batch_size]
        found = beam_search(
            model,
            [sources[i] for i in chunk],
            beam_size=beam_size,
            max_new_tokens=2 * max(len(sources[i]) for i in chunk) + 10,
        )
        for i, hyps in zip(chunk, found, strict=True):
            outputs[i] = tokenizer.decode(hyps[0].tokens)
    return outputs


def train_numbers(recipe: dict, out: str | Path, *, progress: bool = True) -> dict:
    """Train the numbers task as ``recipe`` says; save the model directory to ``out``.

    Returns a summary: exact match on held-out numbers, timings, and what is needed to
    show examples (model, tokenizer, held-out pairs, outputs, losses).
    """
    check_output(out)
    train, data = recipe["train"], recipe["data"]
    seed = int(train["seed"])
    torch.manual_seed(seed)
    # The vocabulary is closed (digits, a comma, 31 words), so a modest sample covers it.
    tokenizer = Tokenizer.train_word_level(s for pair in numbers_pairs(20_000, seed=seed, held_out=False) for s in pair)
    model = _seq2seq_model(recipe, tokenizer)
    batch_size = int(train["batch_size"])

    def step_loss(m: EncoderDecoder, step: int) -> tuple[torch.Tensor, int]:
        # Fresh examples every step (never a held-out number), fixed by (seed, step).
        pairs = numbers_pairs(batch_size, seed=seed * 1_000_003 + step, held_out=False)
        src = tokenizer.encode_batch([a for a, _ in pairs])
        tgt = tokenizer.encode_batch([b for _, b in pairs])
        s, t_in, t_out = seq2seq_batch(
            list(zip(src, tgt, strict=True)), pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id
        )
        loss = sequence_loss(m(s, t_in), t_out, ignore_id=tokenizer.pad_id, label_smoothing=train["label_smoothing"])
        return loss, int((t_out != tokenizer.pad_id).sum())

    result = _fit(model, step_loss, train, progress=progress, desc="qkv numbers")
    held_out = numbers_pairs(int(data["eval_examples"]), seed=seed + 1, held_out=True)
    start = time.perf_counter()
    score, outputs = evaluate_numbers(model, tokenizer, pairs=held_out, beam_size=int(data["beam_size"]))
    eval_seconds = time.perf_counter() - start
    _save(model, tokenizer, out, extra={"task": "numbers", "recipe": recipe, "exact_match": score})
    return {
        "exact_match": score,
        "eval_seconds": eval_seconds,
        **_summary(result, model, tokenizer),
        "held_out": held_out,
        "outputs": outputs,
    }


def train_lm(recipe: dict, out: str | Path, *, progress: bool = True) -> dict:
    """Train a character-level decoder-only language model as ``recipe`` says; save it to ``out``.

    The text's first (1 - val_fraction) is for training, the rest for validation, as
    nanoGPT splits Tiny Shakespeare. Batches are ``batch_size`` random contiguous blocks of
    ``max_len`` + 1 characters. The validation loss is measured on the whole validation
    split in non-overlapping windows of the context length (:func:`~qkv.evaluation.lm_loss`).
    """
    check_output(out)
    train, data = recipe["train"], recipe["data"]
    seed = int(train["seed"])
    path = resolve(data["text"])
    text = read_text(path)
    split = int(len(text) * (1 - float(data["val_fraction"])))
    if split < 2 or len(text) - split < 2:
        raise UserError(f"{path}: too short to split into training and validation text")
    torch.manual_seed(seed)
    tokenizer = Tokenizer.train_char_level([text])
    train_ids = torch.tensor(tokenizer.encode(text[:split]), dtype=torch.long)
    val_ids = torch.tensor(tokenizer.encode(text[split:]), dtype=torch.long)
    fields = {**recipe["model"], "vocab_size": tokenizer.vocab_size}
    model = build_model("decoder_only", fields)
    context, batch_size = model.config.max_len, int(train["batch_size"])
    if len(train_ids) <= context + 1:
        raise UserError(f"{path}: the training text is shorter than one context window ({context + 1} tokens)")
    generator = torch.Generator().manual_seed(seed)

    def step_loss(m: DecoderOnly, step: int) -> tuple[torch.Tensor, int]:
        starts = torch.randint(len(train_ids) - context, (batch_size,), generator=generator)
        x = torch.stack([train_ids[s : s + context] for s in starts])  # (B, T)
        y = torch.stack([train_ids[s + 1 : s + context + 1] for s in starts])  # (B, T)
        loss = sequence_loss(m(x), y, ignore_id=None, label_smoothing=train["label_smoothing"])
        return loss, y.numel()

    result = _fit(model, step_loss, train, progress=progress, desc="qkv lm")
    start = time.perf_counter()
    val_loss = lm_loss(model, val_ids, context=context, batch_size=int(data["eval_batch_size"]))
    eval_seconds = time.perf_counter() - start
    _save(model, tokenizer, out, extra={"task": "lm", "recipe": recipe, "val_loss": val_loss})
    return {"val_loss": val_loss, "eval_seconds": eval_seconds, **_summary(result, model, tokenizer)}


def _fit_window(ids: list[list[int]], limit: int, *, long: str) -> tuple[list[list[int] | None], int]:
    """Truncate rows longer than ``limit`` tokens, or mark them for dropping (None); count them."""
    changed = 0
    out: list[list[int] | None] = []
    for row in ids:
        if len(row) > limit:
            changed += 1
            out.append(row[:limit] if long == "truncate" else None)
        else:
            out.append(row)
    return out, changed


def train_translation(recipe: dict, out: str | Path, *, progress: bool = True) -> dict:
    """Train an encoder-decoder on parallel text as ``recipe`` says; save it to ``out``.

    A joint unigram vocabulary is trained on both sides of the training pairs. Pairs longer
    than the model's window are dropped or truncated (``data.long``) and counted. Batches hold
    at most ``train.max_tokens`` padded tokens, length-bucketed and reshuffled every epoch.
    At the end the validation set is translated with beam search and scored with sacreBLEU.
    """
    check_output(out)
    train, data = recipe["train"], recipe["data"]
    seed = int(train["seed"])
    torch.manual_seed(seed)
    pairs = read_parallel(*data["train"])
    valid = read_parallel(*data["valid"])
    tokenizer = Tokenizer.train_subword((s for pair in pairs for s in pair), vocab_size=int(data["vocab_size"]))
    model = _seq2seq_model(recipe, tokenizer)
    window = model.config.max_len
    src, long_src = _fit_window(tokenizer.encode_batch([a for a, _ in pairs]), window, long=data["long"])
    tgt, long_tgt = _fit_window(tokenizer.encode_batch([b for _, b in pairs]), window - 1, long=data["long"])
    examples = [(s, t) for s, t in zip(src, tgt, strict=True) if s is not None and t is not None]
    if not examples:
        raise UserError("no training pair fits the model's window (model.max_len)")
    lengths = [max(len(s), len(t) + 1) for s, t in examples]

    def epochs() -> Iterator[list[int]]:
        epoch = 0
        while True:
            yield from batches_by_tokens(lengths, max_tokens=int(train["max_tokens"]), seed=seed + epoch)
            epoch += 1

    order = epochs()

    def step_loss(m: EncoderDecoder, step: int) -> tuple[torch.Tensor, int]:
        rows = next(order)
        s, t_in, t_out = seq2seq_batch(
            [examples[i] for i in rows], pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id
        )
        loss = sequence_loss(m(s, t_in), t_out, ignore_id=tokenizer.pad_id, label_smoothing=train["label_smoothing"])
        return loss, int((t_out != tokenizer.pad_id).sum())

    result = _fit(model, step_loss, train, progress=progress, desc="qkv translation")
    start = time.perf_counter()
    hypotheses = beam_translate(model, tokenizer, [a for a, _ in valid], beam_size=int(data["beam_size"]))
    scores = corpus_scores(
        hypotheses, [b for _, b in valid], tokenize=data["bleu_tokenize"], lowercase=data["lowercase"]
    )
    eval_seconds = time.perf_counter() - start
    _save(model, tokenizer, out, extra={"task": "translation", "recipe": recipe, "valid_scores": scores})
    return {
        "bleu": scores["bleu"],
        "chrf": scores["chrf"],
        "bleu_signature": scores["bleu_signature"],
        "over_long_pairs": max(long_src, long_tgt),
        "eval_seconds": eval_seconds,
        **_summary(result, model, tokenizer),
        "hypotheses": hypotheses,
    }
