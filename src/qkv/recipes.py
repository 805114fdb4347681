"""Recipes: a YAML file that names a task, a model and training settings, and its runner.

What is here: :func:`load_recipe` (YAML + ``--set key=value`` overrides, checked against
the known sections and keys, errors naming the file and key), :func:`train_numbers` (the
built-in numbers task end to end: data, tokenizer, model, training, held-out exact match,
model directory), :func:`train_lm` (character-level language modelling on a text file,
scored by validation loss), :func:`train_translation` (parallel text, subword vocabulary,
token-budget batches, validation BLEU), :func:`cross_attention` (last-layer cross-attention of one example,
for pictures), and for encoder-only models :func:`train_mlm` (masked-LM pretraining on sentences),
:func:`train_classifier` (sequence classification, from scratch or from a pretrained model;
accuracy and macro-F1 beside the majority class), :func:`predict_labels` and
:func:`sentence_embeddings` (mean of the last hidden states, for ``qkv embed``).

What is not here: argument parsing and printing (``cli.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import yaml
from torch import nn
from tqdm import tqdm

from qkv import __version__
from qkv.checkpoint import (
    RUN_FILE,
    build_model,
    check_output,
    load_model,
    make_config,
    model_dir,
    read_meta,
    save_model,
    sha256_file,
)
from qkv.data import (
    DAILYDIALOG_LABELS,
    EOU,
    batches_by_tokens,
    read_dailydialog,
    read_labelled,
    read_lines,
    read_parallel,
    read_text,
    resolve,
)
from qkv.errors import UserError
from qkv.evaluation import (
    BLEU_TOKENIZERS,
    accuracy,
    corpus_scores,
    exact_match,
    lm_loss,
    macro_f1,
    masked_lm_scores,
)
from qkv.generation import beam_search, pad_rows
from qkv.models.decoder_only import DecoderOnly
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.models.encoder_only import EncoderOnly, masked_mean
from qkv.runs import (
    Scalars,
    average_checkpoints,
    check_run_output,
    load_checkpoint,
    read_run,
    save_checkpoint,
    write_json,
)
from qkv.tasks import numbers_pairs
from qkv.tokenization import FILE as TOKENIZER_FILE
from qkv.tokenization import Tokenizer
from qkv.training import (
    IGNORE,
    SCHEDULES,
    FitResult,
    Trainer,
    fit,
    mask_tokens,
    seq2seq_batch,
    sequence_loss,
)

TASKS = ("numbers", "lm", "translation", "mlm", "classify")

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
    "data": {
        "text": "tinyshakespeare/input.txt",
        "valid_text": None,  # a separate validation file (else the last val_fraction of the text)
        "val_fraction": 0.1,
        # "text": one stream; "lines": every line a document ending with END; "dailydialog": the
        # dialogues of the DailyDialog folder data.text (train / validation splits), one per document
        "documents": "text",
        "tokenizer": "char",  # "char", or "subword" (a unigram vocabulary of vocab_size; needs lines)
        "vocab_size": 4000,
        "eval_batch_size": 64,
    },
}

# Translation from parallel text (two aligned files or one TSV per split); a 3+3-layer,
# width-256 Transformer with a shared unigram vocabulary by default. Trains in epochs with
# validation after each, in a run directory (``runs.py``) that can be resumed.
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
        "epochs": 20,
        "steps": None,  # a cap on optimizer steps (null: epochs decide)
        "seconds": None,  # a cap on training wall time (validation excluded)
        "max_tokens": 4096,  # padded source or target tokens per batch
        "accumulate": 1,  # batches per optimizer step
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
        "save_every": 0,  # optimizer steps between mid-epoch checkpoints of last/ (0: epoch ends only)
        "patience": None,  # stop after this many epochs without a better validation BLEU
        "average_last": 0,  # average the last N epoch checkpoints at the end (0: no averaging)
        "init": None,  # a qkv model directory to start from (fine-tuning; its tokenizer is used)
        "tensorboard": True,
        "deterministic": False,  # torch.use_deterministic_algorithms (exact resumption is tested with it)
    },
    "data": {
        "train": ["multi30k/train.de", "multi30k/train.en"],
        "valid": ["multi30k/val.de", "multi30k/val.en"],
        "reverse": False,  # swap the sides: translate the second file/column into the first
        "train_pairs": None,  # use only the first N training pairs
        "valid_pairs": None,  # validate on the first N validation pairs
        "tokenizer": None,  # an existing tokenizer.json (else one is trained on the training pairs)
        "vocab_size": 8000,
        "long": "drop",
        "valid_beam": 1,  # decoding for the per-epoch validation BLEU (1: greedy)
        "beam_size": 4,  # decoding for the final validation BLEU
        "length_penalty": 1.0,
        "max_len_a": 1.5,  # outputs may have at most a·S + b tokens (S: source length)
        "max_len_b": 10,
        "bleu_tokenize": "13a",
        "lowercase": False,
    },
}

# Encoder-only models (BERT) on sentences: masked-LM pretraining (mlm) and sequence
# classification (classify), on DailyDialog by default (its utterances; its dialog acts).
# Sized to train in about 10-20 minutes each on 2 CPU cores. A classifier fine-tuned from a
# pretrained model (train.init) must name the same architecture; the fields of
# ENCODER_HEAD_FIELDS may differ.
ENCODER_MODEL: dict = {
    "d_model": 256,
    "n_heads": 4,
    "d_ff": 1024,
    "n_layers": 4,
    "max_len": 64,
    "dropout": 0.1,
    "positions": "learned",
    "activation": "gelu",
    "norm_first": True,
}
ENCODER_HEAD_FIELDS = ("dropout", "attention_dropout", "pooling", "pooler", "n_classes", "mlm_head")
MLM_DEFAULTS: dict = {
    "task": "mlm",
    "model": dict(ENCODER_MODEL),
    "train": {
        "steps": 4000,
        "seconds": None,
        "batch_size": 64,  # sentences per step
        "lr": 1e-3,
        "warmup": 400,
        "schedule": "cosine",
        "min_lr": 1e-5,
        "weight_decay": 0.01,
        "beta2": 0.98,
        "clip": 1.0,
        "bf16": False,
        "label_smoothing": 0.0,
        "seed": 0,
    },
    "data": {
        "dailydialog": "text",  # "text": DailyDialog's utterances (train / validation splits); null: sentences
        "dailydialog_dir": "dailydialog",  # the DailyDialog folder (as given, or under $QKV_DATA)
        "sentences": None,  # a text file, one sentence per line (with dailydialog: null)
        "valid_sentences": None,  # its validation file (null: the last val_fraction of the sentences)
        "val_fraction": 0.05,
        "train_examples": None,  # use only the first N training sentences
        "valid_examples": None,  # validate on the first N validation sentences
        "tokenizer": None,  # an existing tokenizer.json (else a unigram vocabulary is trained); a mask is added
        "vocab_size": 8000,
        "mask_rate": 0.15,  # the share of tokens selected for prediction (80% masked, 10% random, 10% kept)
        "eval_batch_size": 64,
    },
}
CLASSIFY_DEFAULTS: dict = {
    "task": "classify",
    "model": {**ENCODER_MODEL, "pooling": "mean"},
    "train": {
        "steps": 2000,
        "seconds": None,
        "batch_size": 32,  # examples per step
        "lr": 3e-4,
        "warmup": 200,
        "schedule": "cosine",
        "min_lr": 0.0,
        "weight_decay": 0.01,
        "beta2": 0.98,
        "clip": 1.0,
        "bf16": False,
        "label_smoothing": 0.0,
        "seed": 0,
        "init": None,  # a pretrained encoder_only model directory (its tokenizer is used); null: from scratch
    },
    "data": {
        "dailydialog": "act",  # "act" or "emotion": DailyDialog's per-utterance labels; null: train_tsv
        "dailydialog_dir": "dailydialog",
        "context": False,  # DailyDialog: read the previous utterance too ([BEGIN] previous [END] utterance [END])
        "train_tsv": None,  # text<TAB>label lines (with dailydialog: null)
        "valid_tsv": None,  # its validation file (null: the last val_fraction of the training lines)
        "val_fraction": 0.1,
        "train_examples": None,
        "valid_examples": None,
        "tokenizer": None,
        "vocab_size": 8000,
        "eval_batch_size": 64,
    },
}

DEFAULTS = {
    "numbers": NUMBERS_DEFAULTS,
    "lm": LM_DEFAULTS,
    "translation": TRANSLATION_DEFAULTS,
    "mlm": MLM_DEFAULTS,
    "classify": CLASSIFY_DEFAULTS,
}
# The longest numbers target is 10 words ("seven hundred seventy seven thousand ..."):
# BEGIN + 10 words are 11 decoder positions; the longest source is 7 tokens.
NUMBERS_MIN_LEN = 11
MODEL_KINDS = {
    "numbers": "encoder_decoder",
    "lm": "decoder_only",
    "translation": "encoder_decoder",
    "mlm": "encoder_only",
    "classify": "encoder_only",
}


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
    if task == "lm":
        if recipe["data"]["tokenizer"] not in ("char", "subword"):
            raise UserError(f"{where}: data.tokenizer must be char or subword for the lm task")
        if recipe["data"]["tokenizer"] == "subword" and recipe["data"]["documents"] == "text":
            raise UserError(f"{where}: data.tokenizer=subword needs data.documents=lines (pieces never span lines)")
        if recipe["data"]["valid_text"] is not None and not isinstance(recipe["data"]["valid_text"], str):
            raise UserError(f"{where}: data.valid_text must be a file path or null")
    if task != "translation" and recipe["train"]["steps"] is None:
        raise UserError(f"{where}: train.steps must be a positive integer for the {task} task")
    if task == "numbers" and recipe["model"].get("max_len", 512) < NUMBERS_MIN_LEN:
        raise UserError(f"{where}: model.max_len must be at least {NUMBERS_MIN_LEN} for the numbers task")
    if task in ("mlm", "classify"):
        _check_encoder_data(recipe, where)
    # Check the model fields now, before any data is read (the vocabulary comes later).
    if MODEL_KINDS[task] == "encoder_decoder":
        vocab = {"src_vocab_size": 64, "tgt_vocab_size": 64}
    else:
        vocab = {"vocab_size": 64}
    make_config(MODEL_KINDS[task], {**recipe["model"], **vocab})
    return recipe


def _paths(value: list) -> bool:
    return 1 <= len(value) <= 2 and all(isinstance(v, str) and v for v in value)


# (section, key) -> (accepted types, test, what the value must be)
_RULES = {
    ("train", "steps"): ((int, type(None)), lambda v: v is None or v > 0, "a positive integer"),
    ("train", "epochs"): (int, lambda v: v > 0, "a positive integer"),
    ("train", "accumulate"): (int, lambda v: v > 0, "a positive integer"),
    ("train", "save_every"): (int, lambda v: v >= 0, "an integer >= 0 (0: at epoch ends only)"),
    ("train", "patience"): ((int, type(None)), lambda v: v is None or v > 0, "a positive integer or null"),
    ("train", "average_last"): (int, lambda v: v >= 0, "an integer >= 0"),
    ("train", "init"): ((str, type(None)), lambda v: v is None or bool(v), "a model directory or null"),
    ("train", "tensorboard"): (bool, lambda v: True, "true or false"),
    ("train", "deterministic"): (bool, lambda v: True, "true or false"),
    ("data", "reverse"): (bool, lambda v: True, "true or false"),
    ("data", "train_pairs"): ((int, type(None)), lambda v: v is None or v > 0, "a positive integer or null"),
    ("data", "valid_pairs"): ((int, type(None)), lambda v: v is None or v > 0, "a positive integer or null"),
    ("data", "tokenizer"): ((str, type(None)), lambda v: v is None or bool(v), "a tokenizer.json path or null"),
    ("data", "valid_beam"): (int, lambda v: v > 0, "a positive integer"),
    ("data", "length_penalty"): ((int, float), lambda v: v >= 0, "a number >= 0"),
    ("data", "max_len_a"): ((int, float), lambda v: v >= 0, "a number >= 0"),
    ("data", "max_len_b"): (int, lambda v: v >= 0, "an integer >= 0"),
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
    ("data", "documents"): (str, lambda v: v in ("text", "lines", "dailydialog"), "text, lines or dailydialog"),
    ("data", "val_fraction"): ((int, float), lambda v: 0 < v < 1, "a number in (0, 1)"),
    ("data", "eval_batch_size"): (int, lambda v: v > 0, "a positive integer"),
    ("train", "max_tokens"): (int, lambda v: v > 0, "a positive integer"),
    ("data", "train"): (list, _paths, "a list of one TSV path or two aligned file paths"),
    ("data", "valid"): (list, _paths, "a list of one TSV path or two aligned file paths"),
    ("data", "vocab_size"): (int, lambda v: v > 8, "an integer > 8"),
    ("data", "long"): (str, lambda v: v in ("drop", "truncate"), "drop or truncate"),
    ("data", "bleu_tokenize"): (str, lambda v: v in BLEU_TOKENIZERS, f"one of {', '.join(BLEU_TOKENIZERS)}"),
    ("data", "lowercase"): (bool, lambda v: True, "true or false"),
    ("data", "dailydialog"): (
        (str, type(None)),
        lambda v: v is None or v in ("text", "act", "emotion"),
        "text (utterances, for mlm), act or emotion (labels, for classify), or null",
    ),
    ("data", "dailydialog_dir"): (str, lambda v: bool(v), "a DailyDialog folder"),
    ("data", "sentences"): ((str, type(None)), lambda v: v is None or bool(v), "a text file or null"),
    ("data", "valid_sentences"): ((str, type(None)), lambda v: v is None or bool(v), "a text file or null"),
    ("data", "train_tsv"): ((str, type(None)), lambda v: v is None or bool(v), "a text<TAB>label file or null"),
    ("data", "valid_tsv"): ((str, type(None)), lambda v: v is None or bool(v), "a text<TAB>label file or null"),
    ("data", "train_examples"): ((int, type(None)), lambda v: v is None or v > 0, "a positive integer or null"),
    ("data", "valid_examples"): ((int, type(None)), lambda v: v is None or v > 0, "a positive integer or null"),
    ("data", "mask_rate"): ((int, float), lambda v: 0 < v < 1, "a number in (0, 1)"),
    ("data", "context"): (bool, lambda v: True, "true or false"),
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
    outputs = beam_translate(model, tokenizer, [a for a, _ in pairs], beam_size=beam_size, max_len_a=2.0)
    return exact_match(outputs, [b for _, b in pairs]), outputs


class Translation(NamedTuple):
    """One scored output of :func:`translate`: detokenized text, token ids, beam score."""

    text: str
    tokens: list[int]
    score: float


def translate(
    model: EncoderDecoder,
    tokenizer: Tokenizer,
    texts: list[str],
    *,
    beam_size: int,
    nbest: int = 1,
    length_penalty: float = 1.0,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
    max_tokens: int = 8192,
) -> list[list[Translation]]:
    """The ``nbest`` best outputs of every text, in input order.

    Texts are decoded in batches of similar length holding at most ``max_tokens`` source
    tokens times the beam width. A source longer than the model's window is cut to it; an
    output may have at most ⌊a·S⌋ + b tokens, S its own source's length (the max-length rule
    of fairseq's ``--max-len-a/-b``). An empty (or all-blank) text gives empty outputs.
    """
    sources = [ids[: model.config.max_len] for ids in tokenizer.encode_batch(texts)]
    found: list[list[Translation]] = [[Translation("", [], 0.0)] * nbest for _ in texts]
    todo = sorted((i for i in range(len(texts)) if texts[i].strip() and sources[i]), key=lambda i: len(sources[i]))
    budget = max(1, max_tokens // beam_size)
    k = 0
    while k < len(todo):
        end = k + 1  # sorted by length: the chunk's last source is its longest
        while end < len(todo) and len(sources[todo[end]]) * (end - k + 1) <= budget:
            end += 1
        chunk, k = todo[k:end], end
        hypotheses = beam_search(
            model,
            [sources[i] for i in chunk],
            beam_size=beam_size,
            nbest=nbest,
            length_penalty=length_penalty,
            max_new_tokens=[int(max_len_a * len(sources[i])) + max_len_b for i in chunk],
        )
        for i, hyps in zip(chunk, hypotheses, strict=True):
            found[i] = [Translation(tokenizer.decode(h.tokens), h.tokens, h.score) for h in hyps]
            # Always nbest outputs, so they can be matched to inputs by counting.
            found[i] += [Translation("", [], float("-inf"))] * (nbest - len(found[i]))
    return found


def beam_translate(
    model: EncoderDecoder,
    tokenizer: Tokenizer,
    texts: list[str],
    *,
    beam_size: int,
    length_penalty: float = 1.0,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
) -> list[str]:
    """The best output of every text, in order (:func:`translate`)."""
    found = translate(
        model,
        tokenizer,
        texts,
        beam_size=beam_size,
        length_penalty=length_penalty,
        max_len_a=max_len_a,
        max_len_b=max_len_b,
    )
    return [hyps[0].text for hyps in found]


@torch.no_grad()
def alignments(model: EncoderDecoder, *, src: list[list[int]], out: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Hard alignments from cross-attention: each output token (END excluded) paired with the
    source token its last decoder layer attends to most, averaged over heads (as fairseq's
    ``--print-alignment`` does with its alignment layer). Pairs are (source index, output index).
    """
    found: list[list[tuple[int, int]]] = []
    for s, o in zip(src, out, strict=True):
        if not s or not o:
            found.append([])
            continue
        weights = cross_attention(model, src=s, out=o)  # (H, T, S)
        best = weights.mean(0)[: len(o)].argmax(-1).tolist()  # (T,): END's row dropped
        found.append([(j, t) for t, j in enumerate(best)])
    return found


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
    """Train a decoder-only language model as ``recipe`` says; save it to ``out``.

    Validation text is ``data.valid_text`` or else the text's last ``val_fraction``, as nanoGPT
    splits Tiny Shakespeare. ``data.documents="lines"`` makes every non-empty line a document
    that ends with END (a DailyDialog dialogue, say), so the model learns where one ends.
    Tokens are characters or unigram subwords. Batches are ``batch_size`` random contiguous
    blocks of ``max_len`` + 1 tokens of the training stream. The validation loss is measured
    on the whole validation stream in non-overlapping windows of the context length
    (:func:`~qkv.evaluation.lm_loss`).
    """
    check_output(out)
    train, data = recipe["train"], recipe["data"]
    seed = int(train["seed"])
    problems: list[str] = []
    if data["documents"] == "dailydialog":
        path = Path(data["text"])
        split_docs = {}
        for split in ("train", "validation"):
            dialogues, _ = read_dailydialog(path, split)
            split_docs[split] = [f" {EOU} ".join(u for u, _ in d) + f" {EOU}" for d in dialogues if d]
            # The text needs no labels, but a dialogue whose act labels do not line up is
            # reported (the known DailyDialog quirk); its text is still used.
            _, misaligned = read_dailydialog(path, split, labels="act")
            problems += [f"{p.replace('; dialogue skipped', '')}; its text is still used" for p in misaligned]
        train_text, valid_text = "\n".join(split_docs["train"]), "\n".join(split_docs["validation"])
    elif data["valid_text"] is not None:
        path = resolve(data["text"])
        text = read_text(path)
        train_text, valid_text = text, read_text(resolve(data["valid_text"]))
    else:
        path = resolve(data["text"])
        text = read_text(path)
        split = int(len(text) * (1 - float(data["val_fraction"])))
        if split < 2 or len(text) - split < 2:
            raise UserError(f"{path}: too short to split into training and validation text")
        train_text, valid_text = text[:split], text[split:]
    if data["documents"] != "text":
        train_docs = [line for line in train_text.splitlines() if line.strip()]
        valid_docs = [line for line in valid_text.splitlines() if line.strip()]
    else:
        train_docs, valid_docs = [train_text], [valid_text]
    if not train_docs or not valid_docs:
        raise UserError(f"{path}: no training or no validation text")
    torch.manual_seed(seed)
    if data["tokenizer"] == "subword":
        tokenizer = Tokenizer.train_subword(train_docs, vocab_size=int(data["vocab_size"]))
    else:
        tokenizer = Tokenizer.train_char_level(train_docs)
    end = [tokenizer.eos_id] if data["documents"] != "text" else []

    def stream(docs: list[str]) -> torch.Tensor:
        return torch.tensor([i for ids in tokenizer.encode_batch(docs) for i in [*ids, *end]], dtype=torch.long)

    train_ids, val_ids = stream(train_docs), stream(valid_docs)
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
    return {
        "val_loss": val_loss,
        "val_tokens": len(val_ids),
        "problems": problems,
        "eval_seconds": eval_seconds,
        **_summary(result, model, tokenizer),
    }


# Train settings that may change when a run is resumed; any other change would make the
# continued run differ from an uninterrupted one, so it is refused.
RESUME_MAY_CHANGE = ("epochs", "steps", "seconds", "patience", "average_last", "save_every", "tensorboard")


def _resumed_recipe(recipe: dict, saved: dict, run: Path) -> dict:
    """The run's own recipe with only the RESUME_MAY_CHANGE train keys taken from ``recipe``."""
    differ = []
    for section, value in recipe.items():
        if not isinstance(value, dict):
            if value != saved.get(section):
                differ.append(section)
            continue
        for key, v in value.items():
            # A tokenizer file may be named: it is checked against the checkpoint's (SHA-256).
            may_change = (section == "train" and key in RESUME_MAY_CHANGE) or (section, key) == ("data", "tokenizer")
            if not may_change and v != saved.get(section, {}).get(key):
                differ.append(f"{section}.{key}")
    if differ:
        raise UserError(
            f"--resume: the recipe differs from the one {run} was trained with in {', '.join(differ)}; "
            f"only train.{', train.'.join(RESUME_MAY_CHANGE)} may change"
        )
    return {
        **saved,
        "train": {**saved["train"], **{k: recipe["train"][k] for k in RESUME_MAY_CHANGE}},
        "data": {**saved["data"], "tokenizer": recipe["data"]["tokenizer"] or saved["data"]["tokenizer"]},
    }


def _tokenizer_for(data: dict, *, checkpoint: Path | None, pairs: list[tuple[str, ...]]) -> tuple[Tokenizer, str]:
    """The run's tokenizer: a checkpoint's (resume, fine-tuning), a given file, or a new one.

    A tokenizer file given together with a checkpoint must be the checkpoint's own (same
    SHA-256): a model run with a vocabulary it was not trained with would map ids to the
    wrong tokens, silently.
    """
    given = resolve(data["tokenizer"]) if data["tokenizer"] is not None else None
    if given is not None and not given.is_file():
        raise UserError(f"data.tokenizer: {given} does not exist")
    if checkpoint is not None:
        meta = read_meta(checkpoint)
        if TOKENIZER_FILE not in meta["files"]:
            raise UserError(f"{checkpoint} has no {TOKENIZER_FILE}")
        if given is not None and sha256_file(given) != meta["files"][TOKENIZER_FILE]:
            raise UserError(
                f"data.tokenizer {given} is not the tokenizer {checkpoint} was trained with "
                f"(SHA-256 differs from {checkpoint / TOKENIZER_FILE}); use that file or start a new run"
            )
        return Tokenizer.load(checkpoint / TOKENIZER_FILE), f"the tokenizer of {checkpoint}"
    if given is not None:
        return Tokenizer.load(given), str(given)
    tokenizer = Tokenizer.train_subword((s for pair in pairs for s in pair), vocab_size=int(data["vocab_size"]))
    return tokenizer, f"a new {tokenizer.vocab_size}-token unigram vocabulary"


@torch.no_grad()
def teacher_forced_loss(
    model: EncoderDecoder, tokenizer: Tokenizer, examples: list[tuple[list[int], list[int]]], *, max_tokens: int
) -> float:
    """Mean cross-entropy per target token (END included, no label smoothing) of ``examples``."""
    model.eval()
    lengths = [max(len(s), len(t) + 1) for s, t in examples]
    total, count = 0.0, 0
    for rows in batches_by_tokens(lengths, max_tokens=max_tokens, seed=0):
        s, t_in, t_out = seq2seq_batch(
            [examples[i] for i in rows], pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id
        )
        n = int((t_out != tokenizer.pad_id).sum())
        total += sequence_loss(model(s, t_in), t_out, ignore_id=tokenizer.pad_id).item() * n
        count += n
    return total / max(count, 1)


def _encode_pairs(
    tokenizer: Tokenizer, pairs: list[tuple[str, str]], *, window: int, long: str
) -> tuple[list[tuple[list[int], list[int]]], int]:
    """Token ids of the pairs, over-long ones (a source over the window, a target over the
    window less BEGIN) dropped or truncated (``long``); and how many pairs were over-long."""
    sources = tokenizer.encode_batch([a for a, _ in pairs])
    targets = tokenizer.encode_batch([b for _, b in pairs])
    examples, over_long = [], 0
    for s, t in zip(sources, targets, strict=True):
        if len(s) > window or len(t) > window - 1:
            over_long += 1
            if long == "drop":
                continue
            s, t = s[:window], t[: window - 1]
        examples.append((s, t))
    return examples, over_long


def train_translation(recipe: dict, out: str | Path, *, progress: bool = True, resume: bool = False) -> dict:
    """Train an encoder-decoder on parallel text as ``recipe`` says, in the run directory ``out``.

    The vocabulary is a joint unigram model trained on both sides of the training pairs (or
    a given tokenizer, or the checkpoint's). Pairs longer than the model's window are dropped
    or truncated (``data.long``) and counted. Batches hold at most ``train.max_tokens``
    padded tokens, length-bucketed and reshuffled every epoch (seed + epoch), so the data
    order is a function of the seed and a position (epoch, batch) is enough to resume.
    After every epoch: validation loss and BLEU (``data.valid_beam``), TensorBoard scalars,
    ``best``/``last``/``epoch-NNN`` checkpoints, early stopping (``train.patience``). At the
    end: the last N epoch checkpoints averaged (``train.average_last``) and the final model,
    the better on validation BLEU with ``data.beam_size`` of best and averaged, is named in
    ``run.json``. ``resume`` continues from ``last`` exactly as if never stopped.
    """
    run = Path(out)
    check_run_output(run, resume=resume)
    if resume:
        recipe = _resumed_recipe(recipe, read_run(run)["recipe"], run)
    train, data = recipe["train"], recipe["data"]
    seed = int(train["seed"])
    torch.manual_seed(seed)
    if train["deterministic"]:
        torch.use_deterministic_algorithms(True)
    pairs = read_parallel(*data["train"])[: data["train_pairs"]]
    valid = read_parallel(*data["valid"])[: data["valid_pairs"]]
    if data["reverse"]:
        pairs, valid = [(b, a) for a, b in pairs], [(b, a) for a, b in valid]
    init = Path(train["init"]).expanduser() if train["init"] is not None else None
    start_from = run / "last" if resume else (model_dir(init) if init is not None else None)
    tokenizer, vocabulary = _tokenizer_for(data, checkpoint=start_from, pairs=pairs)
    model = _seq2seq_model(recipe, tokenizer)
    if init is not None and not resume:
        pretrained, _ = load_model(start_from, kind="encoder_decoder")
        check_fine_tuning(pretrained, recipe, start_from)
        model.load_state_dict(pretrained.state_dict())
    window = model.config.max_len
    examples, over_long = _encode_pairs(tokenizer, pairs, window=window, long=data["long"])
    if not examples:
        raise UserError("no training pair fits the model's window (model.max_len)")
    valid_examples, _ = _encode_pairs(tokenizer, valid, window=window, long="truncate")
    lengths = [max(len(s), len(t) + 1) for s, t in examples]
    max_tokens, accumulate = int(train["max_tokens"]), int(train["accumulate"])
    steps_per_epoch = math.ceil(len(batches_by_tokens(lengths, max_tokens=max_tokens, seed=seed)) / accumulate)
    total_steps = int(train["epochs"]) * steps_per_epoch
    if train["steps"] is not None:
        total_steps = min(total_steps, int(train["steps"]))
    trainer = Trainer(
        model,
        lr=float(train["lr"]),
        warmup=int(train["warmup"]),
        total_steps=total_steps,
        schedule=train["schedule"],
        min_lr=float(train["min_lr"]),
        weight_decay=float(train["weight_decay"]),
        clip=float(train["clip"]),
        betas=(0.9, float(train["beta2"])),
        bf16=train["bf16"],
    )
    state = {"epoch": 0, "batch": 0, "tokens": 0, "seconds": 0.0, "history": [], "losses": [], "best": None, "bad": 0}
    if resume:
        state = load_checkpoint(run / "last", trainer)
    run.mkdir(parents=True, exist_ok=True)
    scalars = Scalars(run / "tensorboard" if train["tensorboard"] else None)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_file = Path(tmp) / TOKENIZER_FILE
        tokenizer.save(tokenizer_file)
        extra = {"task": "translation", "recipe": recipe}

        def save(name: str, *, resumable: bool = False, scores: dict | None = None) -> None:
            save_checkpoint(
                model,
                run / name,
                files={TOKENIZER_FILE: tokenizer_file},
                extra={**extra, **({"valid_scores": scores} if scores else {})},
                trainer=trainer if resumable else None,
                progress=state if resumable else None,
            )

        def record(final: str) -> None:
            write_json(run / RUN_FILE, {"qkv_version": __version__, "recipe": recipe, "final": final, **state})

        def validate(beam: int) -> dict:
            start = time.perf_counter()
            hypotheses = beam_translate(
                model,
                tokenizer,
                [a for a, _ in valid],
                beam_size=beam,
                length_penalty=float(data["length_penalty"]),
                max_len_a=float(data["max_len_a"]),
                max_len_b=int(data["max_len_b"]),
            )
            scores = corpus_scores(
                hypotheses, [b for _, b in valid], tokenize=data["bleu_tokenize"], lowercase=data["lowercase"]
            )
            return {**scores, "seconds": round(time.perf_counter() - start, 1), "hypotheses": hypotheses}

        if not resume:
            save("last", resumable=True)
            record("last")

        def batch_loss(rows: list[int]) -> tuple[torch.Tensor, int]:
            s, t_in, t_out = seq2seq_batch(
                [examples[i] for i in rows], pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id
            )
            logits = model(s, t_in)  # (B, T, V)
            loss = sequence_loss(logits, t_out, ignore_id=tokenizer.pad_id, label_smoothing=train["label_smoothing"])
            return loss, int((t_out != tokenizer.pad_id).sum())

        bar = tqdm(
            total=total_steps,
            initial=trainer.steps,
            desc="qkv translation",
            unit="step",
            disable=not progress,
            dynamic_ncols=True,
        )
        seconds_cap = train["seconds"]
        stop = None
        session_start, session_tokens = time.perf_counter(), 0
        while stop is None:
            if state["epoch"] >= int(train["epochs"]):
                stop = "epochs"
                break
            order = batches_by_tokens(lengths, max_tokens=max_tokens, seed=seed + state["epoch"])
            tick = time.perf_counter()
            while state["batch"] < len(order) and stop is None:
                group = order[state["batch"] : state["batch"] + accumulate]
                loss, n_tokens = trainer.step([lambda rows=rows: batch_loss(rows) for rows in group])
                now = time.perf_counter()
                state["seconds"] += now - tick
                tick = now
                state["batch"] += len(group)
                state["tokens"] += n_tokens
                session_tokens += n_tokens
                state["losses"].append(round(loss, 4))
                bar.update(1)
                if trainer.steps % 10 == 0:
                    rate = session_tokens / max(now - session_start, 1e-9)
                    bar.set_postfix(
                        epoch=state["epoch"] + 1, loss=f"{loss:.3f}", lr=f"{trainer.lr:.2e}", tok_s=f"{rate:.0f}"
                    )
                    scalars.add("train/loss", loss, trainer.steps)
                    scalars.add("train/lr", trainer.lr, trainer.steps)
                    scalars.add("train/tokens_per_second", rate, trainer.steps)
                if trainer.steps >= total_steps:
                    stop = "steps"
                elif seconds_cap is not None and state["seconds"] >= seconds_cap:
                    stop = "seconds"
                if (
                    train["save_every"]
                    and trainer.steps % int(train["save_every"]) == 0
                    and state["batch"] < len(order)
                ):
                    save("last", resumable=True)
            if state["batch"] >= len(order):  # the epoch is complete: validate, keep checkpoints
                model.eval()
                scores = validate(int(data["valid_beam"]))
                valid_loss = teacher_forced_loss(model, tokenizer, valid_examples, max_tokens=max_tokens)
                state["epoch"] += 1
                state["batch"] = 0
                entry = {
                    "epoch": state["epoch"],
                    "step": trainer.steps,
                    "train_seconds": round(state["seconds"], 1),
                    "valid_loss": round(valid_loss, 4),
                    "valid_bleu": scores["bleu"],
                    "valid_chrf": scores["chrf"],
                }
                state["history"].append(entry)
                scalars.add("valid/loss", valid_loss, trainer.steps)
                scalars.add("valid/bleu", scores["bleu"], trainer.steps)
                scalars.add("valid/chrf", scores["chrf"], trainer.steps)
                if progress:
                    tqdm.write(
                        f"epoch {entry['epoch']}: step {entry['step']}, valid loss {valid_loss:.4f}, "
                        f"BLEU {scores['bleu']} (beam {data['valid_beam']}, {scores['seconds']}s)"
                    )
                if state["best"] is None or scores["bleu"] > state["best"]["valid_bleu"]:
                    state["best"], state["bad"] = entry, 0
                    save("best")
                else:
                    state["bad"] += 1
                    if train["patience"] is not None and state["bad"] >= int(train["patience"]):
                        stop = "patience"
                keep = int(train["average_last"])
                if keep:
                    save(f"epoch-{state['epoch']:03d}")
                    for old in sorted(run.glob("epoch-[0-9][0-9][0-9]"))[:-keep]:
                        shutil.rmtree(old)
            save("last", resumable=True)
            record("last")
        bar.close()
        scalars.close()

        # The final model: best and (if asked) averaged, compared on validation BLEU at the final beam.
        candidates = {}
        if (run / "best").is_dir():
            best_model, _ = load_model(run / "best")
            model.load_state_dict(best_model.state_dict())
            candidates["best"] = validate(int(data["beam_size"]))
        epochs = sorted(run.glob("epoch-[0-9][0-9][0-9]"))
        if len(epochs) > 1:
            average_checkpoints(epochs, model)
            candidates["averaged"] = validate(int(data["beam_size"]))
            save("averaged", scores={k: v for k, v in candidates["averaged"].items() if k != "hypotheses"})
        if not candidates:  # stopped before the first epoch ended
            last_model, _ = load_model(run / "last")
            model.load_state_dict(last_model.state_dict())
            candidates["last"] = validate(int(data["beam_size"]))
        final = max(candidates, key=lambda name: candidates[name]["bleu"])
        if final != "averaged":
            final_model, _ = load_model(run / final)
            model.load_state_dict(final_model.state_dict())
        scores = candidates[final]
        state["final_scores"] = {
            name: {k: v for k, v in c.items() if k != "hypotheses"} for name, c in candidates.items()
        }
        state["stopped_by"] = stop
        record(final)
    result = FitResult(steps=trainer.steps, seconds=state["seconds"], losses=state["losses"], tokens=state["tokens"])
    return {
        "bleu": scores["bleu"],
        "chrf": scores["chrf"],
        "bleu_signature": scores["bleu_signature"],
        "final": final,
        "epochs": state["epoch"],
        "stopped_by": stop,
        "history": state["history"],
        "vocabulary": vocabulary,
        "over_long_pairs": over_long,
        "eval_seconds": scores["seconds"],
        **_summary(result, model, tokenizer),
        "hypotheses": scores["hypotheses"],
    }


def check_fine_tuning(
    model: nn.Module, recipe: dict, init: Path, *, may_differ: tuple[str, ...] = ("dropout",)
) -> None:
    """A model to fine-tune must have the architecture the recipe names (``may_differ`` fields aside)."""
    differ = [
        key
        for key, value in recipe["model"].items()
        if key not in may_differ and getattr(model.config, key, value) != value
    ]
    if differ:
        has = ", ".join(f"{k}={getattr(model.config, k)}" for k in differ)
        wants = ", ".join(f"{k}={recipe['model'][k]}" for k in differ)
        raise UserError(f"train.init: {init} has model {has}; the recipe says {wants}")


# ------------------------------------------------------------------ encoder-only (BERT)


def _check_encoder_data(recipe: dict, where: str) -> None:
    """The data sources of an mlm or classify recipe: DailyDialog or a file, exactly one."""
    data, task = recipe["data"], recipe["task"]
    own_file, own_valid = ("sentences", "valid_sentences") if task == "mlm" else ("train_tsv", "valid_tsv")
    kinds = ("text",) if task == "mlm" else ("act", "emotion")
    if data["dailydialog"] is not None:
        if data["dailydialog"] not in kinds:
            wanted = "text (its utterances)" if task == "mlm" else "act or emotion (its labels)"
            raise UserError(f"{where}: data.dailydialog must be {wanted} or null for the {task} task")
        for key in (own_file, own_valid):
            if data[key] is not None:
                raise UserError(f"{where}: data.{key} and data.dailydialog exclude each other; set one to null")
    elif data[own_file] is None:
        raise UserError(f"{where}: set data.{own_file} (a file) or data.dailydialog for the {task} task")
    if task == "classify" and data["context"] and data["dailydialog"] is None:
        raise UserError(f"{where}: data.context needs data.dailydialog (a TSV line has no previous utterance)")


def _frame(
    tokenizer: Tokenizer, texts: list[str], *, max_len: int, contexts: list[str | None] | None = None
) -> tuple[list[list[int]], int]:
    """Token ids as the encoder reads them, and how many texts were cut to fit ``max_len``.

    [BEGIN] text [END] (BERT's [CLS] text [SEP]), or with a context [BEGIN] context [END]
    text [END]: the text is cut at its end to fit, then the context at its start to fill the
    room that is left (no room: no context).
    """
    begin = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    end = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    room = max_len - len(begin) - len(end)
    if room < 1:
        raise UserError(f"model.max_len={max_len} leaves no room for text between BEGIN and END")
    text_ids = tokenizer.encode_batch(texts)
    context_ids = tokenizer.encode_batch([c or "" for c in contexts]) if contexts is not None else None
    rows, cut = [], 0
    for i, ids in enumerate(text_ids):
        if len(ids) > room:
            ids, cut = ids[:room], cut + 1
        row = begin + ids + end
        keep = max_len - len(row) - len(end)  # context tokens that fit
        if context_ids is not None and context_ids[i] and keep > 0:
            row = begin + context_ids[i][-keep:] + end + ids + end
        rows.append(row)
    return rows, cut


def _special_ids(tokenizer: Tokenizer) -> list[int]:
    ids = (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id, tokenizer.mask_id)
    return sorted({i for i in ids if i is not None})


def _masked(
    rows: list[list[int]], tokenizer: Tokenizer, *, random_ids: torch.Tensor, rate: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A masked-LM batch: corrupted ids (B, S), real-token mask (B, S), labels (B, S) (``IGNORE``
    where nothing is predicted); special tokens and padding are never selected."""
    x, valid = pad_rows(rows, tokenizer.pad_id)  # (B, S), (B, S)
    maskable = valid & ~torch.isin(x, torch.tensor(_special_ids(tokenizer)))  # (B, S)
    inputs, labels = mask_tokens(
        x, maskable=maskable, mask_id=tokenizer.mask_id, random_ids=random_ids, generator=generator, rate=rate
    )
    return inputs, valid, labels


def _mlm_sentences(data: dict) -> tuple[list[str], list[str], str]:
    """Training and validation sentences of an mlm recipe, and where they come from."""
    if data["dailydialog"] is not None:
        folder = data["dailydialog_dir"]
        train = [u for dialogue in read_dailydialog(folder, "train")[0] for u, _ in dialogue]
        valid = [u for dialogue in read_dailydialog(folder, "validation")[0] for u, _ in dialogue]
        source = f"DailyDialog utterances ({folder})"
    else:
        path = resolve(data["sentences"])
        train = [line for line in read_lines(path) if line.strip()]
        source = str(path)
        if data["valid_sentences"] is not None:
            valid = [line for line in read_lines(resolve(data["valid_sentences"])) if line.strip()]
        else:
            split = int(len(train) * (1 - float(data["val_fraction"])))
            train, valid = train[:split], train[split:]
    train, valid = train[: data["train_examples"]], valid[: data["valid_examples"]]
    if not train or not valid:
        raise UserError(f"{source}: too few sentences for training and validation ({len(train)} and {len(valid)})")
    return train, valid, source


def train_mlm(recipe: dict, out: str | Path, *, progress: bool = True) -> dict:
    """Pretrain an encoder-only model by masked-LM (Devlin et al., 2019) as ``recipe`` says; save it to ``out``.

    Sentences (DailyDialog's utterances, or the lines of a text file) are framed as [BEGIN]
    sentence [END] and cut to the model's window; a unigram vocabulary (or the given
    tokenizer) gets a mask token. Every step takes ``batch_size`` random sentences and selects
    ``mask_rate`` of their ordinary tokens (:func:`~qkv.training.mask_tokens`: 80% masked,
    10% random, 10% kept); the loss is the cross-entropy at the selected positions only. At
    the end: the loss and accuracy at the selected positions of the validation sentences
    (masked with a fixed seed, so the number is comparable between runs).
    """
    check_output(out)
    train, data = recipe["train"], recipe["data"]
    seed = int(train["seed"])
    torch.manual_seed(seed)
    sentences, valid, source = _mlm_sentences(data)
    tokenizer, vocabulary = _tokenizer_for(data, checkpoint=None, pairs=[(s,) for s in sentences])
    tokenizer.add_mask()
    fields = {**recipe["model"], "vocab_size": tokenizer.vocab_size, "pad_id": tokenizer.pad_id}
    model = build_model("encoder_only", fields)
    window = model.config.max_len
    examples, truncated = _frame(tokenizer, sentences, max_len=window)
    valid_examples, _ = _frame(tokenizer, valid, max_len=window)
    specials = set(_special_ids(tokenizer))
    random_ids = torch.tensor([i for i in range(tokenizer.vocab_size) if i not in specials])
    rate, batch_size = float(data["mask_rate"]), int(train["batch_size"])
    # The validation sentences are masked once, now, with their own seed (the same for every run).
    valid_generator = torch.Generator().manual_seed(seed + 1)
    size = int(data["eval_batch_size"])
    valid_batches = [
        _masked(valid_examples[i : i + size], tokenizer, random_ids=random_ids, rate=rate, generator=valid_generator)
        for i in range(0, len(valid_examples), size)
    ]
    if not any((labels != IGNORE).any() for _, _, labels in valid_batches):
        raise UserError(
            f"no token of the {len(valid_examples)} validation sentence(s) was selected for masking; give more"
        )
    generator = torch.Generator().manual_seed(seed)

    def step_loss(m: EncoderOnly, step: int) -> tuple[torch.Tensor, int]:
        for _ in range(100):  # redrawn in the rare case that no token of the batch was selected
            rows = torch.randint(len(examples), (batch_size,), generator=generator).tolist()
            inputs, valid_tokens, labels = _masked(
                [examples[i] for i in rows], tokenizer, random_ids=random_ids, rate=rate, generator=generator
            )
            selected = labels != IGNORE  # (B, S)
            if selected.any():
                break
        else:
            raise UserError(f"{source}: no token to mask (the sentences hold only special or unknown tokens)")
        logits = m(inputs, mask=valid_tokens, only=selected)  # (N, V)
        targets = labels[selected]  # (N,)
        loss = sequence_loss(  # (1, N, V) against (1, N)
            logits[None], targets[None], ignore_id=None, label_smoothing=train["label_smoothing"]
        )
        return loss, len(targets)

    result = _fit(model, step_loss, train, progress=progress, desc="qkv mlm")
    start = time.perf_counter()
    valid_loss, valid_accuracy, valid_masked = masked_lm_scores(model, valid_batches)
    scores = {"valid_loss": valid_loss, "valid_accuracy": valid_accuracy, "valid_masked": valid_masked}
    eval_seconds = time.perf_counter() - start
    _save(model, tokenizer, out, extra={"task": "mlm", "recipe": recipe, **scores})
    return {
        **scores,
        "eval_seconds": eval_seconds,
        "train_sentences": len(examples),
        "valid_sentences": len(valid_examples),
        "truncated": truncated,
        "source": source,
        "vocabulary": vocabulary,
        **_summary(result, model, tokenizer),
    }


Labelled = tuple[str | None, str, str]  # (context or None, text, label)


def _classify_examples(data: dict) -> tuple[list[Labelled], list[Labelled], list[str], list[str], str]:
    """Training and validation examples of a classify recipe, the label names (class ids in
    order), the problems found in the data (DailyDialog lines skipped) and the source."""
    problems: list[str] = []
    if data["dailydialog"] is not None:
        folder, kind = data["dailydialog_dir"], data["dailydialog"]
        splits = []
        for split in ("train", "validation"):
            dialogues, found = read_dailydialog(folder, split, labels=kind)
            problems += found
            examples: list[Labelled] = []
            for dialogue in dialogues:
                previous = None
                for text, label in dialogue:
                    examples.append((previous if data["context"] else None, text, str(label)))
                    previous = text
            splits.append(examples)
        train, valid = splits
        names = list(DAILYDIALOG_LABELS[kind])
        source = f"DailyDialog {kind} labels ({folder})"
    else:
        path = resolve(data["train_tsv"])
        train = [(None, text, label) for text, label in read_labelled(path)]
        source = str(path)
        if data["valid_tsv"] is not None:
            valid_path = resolve(data["valid_tsv"])
            valid = [(None, text, label) for text, label in read_labelled(valid_path)]
            names = sorted({label for _, _, label in train})
            for number, (_, _, label) in enumerate(valid, start=1):
                if label not in names:
                    raise UserError(f"{valid_path}:{number}: label {label!r} does not occur in {path}")
        else:
            split = int(len(train) * (1 - float(data["val_fraction"])))
            names = sorted({label for _, _, label in train})
            train, valid = train[:split], train[split:]
    train, valid = train[: data["train_examples"]], valid[: data["valid_examples"]]
    if not train or not valid:
        raise UserError(f"{source}: too few examples for training and validation ({len(train)} and {len(valid)})")
    if len(names) < 2:
        raise UserError(f"{source}: the training examples have {len(names)} label(s); classification needs two")
    return train, valid, names, problems, source


def _load_encoder(model: EncoderOnly, pretrained: EncoderOnly, init: Path) -> None:
    """Copy a pretrained encoder's weights into ``model``, all but its masked-LM and
    classification heads (the new classifier starts fresh; a pretrained pooler is kept)."""
    state = {k: v for k, v in pretrained.state_dict().items() if not k.startswith(("mlm_", "classifier."))}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(("classifier.", "pooler."))]
    if missing or unexpected:
        raise UserError(f"train.init: {init} does not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")


@torch.no_grad()
def _predict(model: EncoderOnly, rows: list[list[int]], *, batch_size: int) -> list[int]:
    """The most likely class of every row of ids, in order (batched by similar length)."""
    model.eval()
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    predicted = [0] * len(rows)
    for k in range(0, len(order), batch_size):
        chunk = order[k : k + batch_size]
        x, valid = pad_rows([rows[i] for i in chunk], model.config.pad_id)  # (B, S), (B, S)
        for i, c in zip(chunk, model.classify(x, mask=valid).argmax(-1).tolist(), strict=True):
            predicted[i] = c
    return predicted


def predict_labels(
    model: EncoderOnly,
    tokenizer: Tokenizer,
    texts: list[str],
    *,
    labels: list[str],
    contexts: list[str | None] | None = None,
    batch_size: int = 64,
) -> list[str]:
    """The predicted label name of every text (``labels``: the names of the class ids, as a
    classify model directory stores them in config.json under "labels")."""
    if model.config.n_classes != len(labels):
        raise UserError(f"the model has {model.config.n_classes} classes but {len(labels)} label names")
    rows, _ = _frame(tokenizer, texts, max_len=model.config.max_len, contexts=contexts)
    return [labels[c] for c in _predict(model, rows, batch_size=batch_size)]


def train_classifier(recipe: dict, out: str | Path, *, progress: bool = True) -> dict:
    """Train an encoder-only sequence classifier as ``recipe`` says; save it to ``out``.

    Examples are (text, label): DailyDialog utterances with their dialog act or emotion
    (optionally read together with the previous utterance, ``data.context``), or the lines of
    a ``text<TAB>label`` file. From scratch (a vocabulary trained on the training texts, or
    ``data.tokenizer``), or from a pretrained model (``train.init``: its encoder weights and
    its tokenizer; a different ``data.tokenizer`` is refused; the recipe must name its
    architecture, but for ``ENCODER_HEAD_FIELDS``). Every step takes ``batch_size`` random
    examples (the reported tokens are examples). At the end: accuracy and macro-F1 on the
    validation split, beside the majority class of the training labels. The label names are
    saved in config.json ("labels"), in class-id order.
    """
    check_output(out)
    train, data = recipe["train"], recipe["data"]
    seed = int(train["seed"])
    torch.manual_seed(seed)
    examples, valid, names, problems, source = _classify_examples(data)
    init = Path(train["init"]).expanduser() if train["init"] is not None else None
    start_from = model_dir(init) if init is not None else None
    texts = [(text,) for _, text, _ in examples]
    tokenizer, vocabulary = _tokenizer_for(data, checkpoint=start_from, pairs=texts)
    fields = {**recipe["model"], "vocab_size": tokenizer.vocab_size, "pad_id": tokenizer.pad_id}
    pretrained = None
    if start_from is not None:
        pretrained, _ = load_model(start_from, kind="encoder_only")
        check_fine_tuning(pretrained, recipe, start_from, may_differ=ENCODER_HEAD_FIELDS)
        head = {k: v for k, v in recipe["model"].items() if k in ENCODER_HEAD_FIELDS}
        fields = {**dataclasses.asdict(pretrained.config), **head}
    model = build_model("encoder_only", {**fields, "n_classes": len(names), "mlm_head": False})
    if pretrained is not None:
        _load_encoder(model, pretrained, start_from)
    window = model.config.max_len
    contexts = [context for context, _, _ in examples] if data["context"] else None
    rows, truncated = _frame(tokenizer, [text for _, text, _ in examples], max_len=window, contexts=contexts)
    index = {name: i for i, name in enumerate(names)}
    targets = torch.tensor([index[label] for _, _, label in examples])  # (N,)
    batch_size = int(train["batch_size"])
    generator = torch.Generator().manual_seed(seed)

    def step_loss(m: EncoderOnly, step: int) -> tuple[torch.Tensor, int]:
        pick = torch.randint(len(rows), (batch_size,), generator=generator)  # (B,)
        x, valid_tokens = pad_rows([rows[i] for i in pick.tolist()], model.config.pad_id)  # (B, S), (B, S)
        logits = m.classify(x, mask=valid_tokens)  # (B, C)
        loss = sequence_loss(  # one "token" per example: (B, 1, C) against (B, 1)
            logits[:, None], targets[pick][:, None], ignore_id=None, label_smoothing=train["label_smoothing"]
        )
        return loss, batch_size

    result = _fit(model, step_loss, train, progress=progress, desc="qkv classify")
    start = time.perf_counter()
    predicted = predict_labels(
        model,
        tokenizer,
        [text for _, text, _ in valid],
        labels=names,
        contexts=[context for context, _, _ in valid] if data["context"] else None,
        batch_size=int(data["eval_batch_size"]),
    )
    gold = [label for _, _, label in valid]
    majority = Counter(label for _, _, label in examples).most_common(1)[0][0]
    scores = {
        "accuracy": accuracy(predicted, gold),
        "macro_f1": macro_f1(predicted, gold),
        "majority": {
            "label": majority,
            "accuracy": accuracy([majority] * len(gold), gold),
            "macro_f1": macro_f1([majority] * len(gold), gold),
        },
    }
    eval_seconds = time.perf_counter() - start
    initialized_from = str(start_from) if start_from is not None else None
    extra = {"task": "classify", "labels": names, "recipe": recipe, "init": initialized_from, **scores}
    _save(model, tokenizer, out, extra=extra)
    return {
        **scores,
        "labels": names,
        "train_examples": len(examples),
        "valid_examples": len(valid),
        "problems": problems,
        "truncated": truncated,
        "source": source,
        "init": initialized_from,
        "vocabulary": vocabulary,
        "eval_seconds": eval_seconds,
        "predictions": predicted,
        **_summary(result, model, tokenizer),
    }


@torch.no_grad()
def sentence_embeddings(
    model: EncoderOnly, tokenizer: Tokenizer, texts: list[str], *, batch_size: int = 64, normalize: bool = False
) -> tuple[torch.Tensor, int]:
    """One vector per text: the mean of the last hidden states over its real positions
    ([BEGIN] text [END], padding excluded); and how many texts were cut to the window.

    An empty (or blank) text gives a zero row, so rows match texts one to one;
    ``normalize`` scales every other row to unit L2 norm. Batches group texts of similar
    length; padding does not change a row (keys at padding get no attention weight).

    Shapes: returns (N, D) float32.
    """
    model.eval()
    todo = [i for i, text in enumerate(texts) if text.strip()]
    rows, cut = _frame(tokenizer, [texts[i] for i in todo], max_len=model.config.max_len)
    vectors = torch.zeros(len(texts), model.config.d_model)  # (N, D)
    order = sorted(range(len(todo)), key=lambda k: len(rows[k]))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        x, valid = pad_rows([rows[k] for k in chunk], model.config.pad_id)  # (B, S), (B, S)
        h = model.encode(x, mask=valid)  # (B, S, D)
        vectors[[todo[k] for k in chunk]] = masked_mean(h, valid).float()  # (B, D)
    if normalize:
        vectors = torch.nn.functional.normalize(vectors, dim=-1)  # zero rows stay zero
    return vectors, cut
