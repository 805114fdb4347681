"""Recipes: a YAML file that names a task, a model and training settings; what every runner shares.

What is here: :func:`load_recipe` (YAML + ``--set key=value`` overrides, checked against
the known sections and keys of each task's defaults, errors naming the file and key), and the
pieces the task runners share: :func:`fit_recipe` (the training loop with a recipe's train
section), :func:`save_model_dir`, :func:`fit_summary`, :func:`seq2seq_model`,
:func:`tokenizer_for` (a checkpoint's, a given or a newly trained vocabulary, with the SHA-256
check), :func:`vocabularies_for` (the same for a translation model's source and target: joint or
separate) and :func:`fine_tuning_fields`.

What is not here: the runners themselves (``seq2seq.py``: numbers and translation; ``lm.py``:
language modelling; ``bert.py``: masked-LM pretraining, classification, embeddings) and
argument parsing and printing (``cli.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
import yaml
from torch import nn

from qkv.checkpoint import (
    build_model,
    make_config,
    read_meta,
    save_model,
    sha256_file,
)
from qkv.data import (
    resolve,
)
from qkv.errors import UserError
from qkv.evaluation import (
    BLEU_TOKENIZERS,
)
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.tokenization import FILE as TOKENIZER_FILE
from qkv.tokenization import MAX_NBEST, TARGET_FILE, Tokenizer, Vocabularies
from qkv.training import (
    SCHEDULES,
    FitResult,
    fit,
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
        "tokenizer": "char",  # "char", or "subword" (a unigram vocabulary of vocab_size; newlines are pieces)
        "vocab_size": 4000,
        "eval_batch_size": 64,
    },
}


# Translation from parallel text (two aligned files or one TSV per split); a 3+3-layer,
# width-256 Transformer with a joint unigram vocabulary and shared embeddings by default.
# Trains in epochs with validation after each, in a run directory (``runs.py``) that can be
# resumed.
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
        "rdrop": 0.0,  # R-Drop's alpha (Liang et al., 2021): 0 off; > 0 runs each batch twice
        "seed": 0,
        "save_every": 0,  # optimizer steps between mid-epoch checkpoints of last/ (0: epoch ends only)
        "patience": None,  # stop after this many epochs without a better validation BLEU
        "average_last": 0,  # average the last N epoch checkpoints at the end (0: no averaging)
        # a qkv model directory to start from (fine-tuning): its tokenizer and architecture are
        # used; the fields the model section names must agree with it, but for
        # ENCODER_DECODER_TUNING_FIELDS (unnamed ones are the pretrained model's)
        "init": None,
        "tensorboard": True,
        "deterministic": False,  # torch.use_deterministic_algorithms (exact resumption is tested with it)
    },
    "data": {
        "train": ["multi30k/train.de", "multi30k/train.en"],
        "valid": ["multi30k/val.de", "multi30k/val.en"],
        "reverse": False,  # swap the sides: translate the second file/column into the first
        "train_pairs": None,  # use only the first N training pairs
        "valid_pairs": None,  # validate on the first N validation pairs
        # "joint": one vocabulary trained on both sides; "separate": a source vocabulary trained on
        # the source sentences and a target one on the target sentences (needs
        # model.share_embeddings=false), stored as tokenizer.json and target_tokenizer.json
        "vocab": "joint",
        "tokenizer": None,  # an existing tokenizer.json: the joint one, or the source's (else one is trained)
        "target_tokenizer": None,  # separate only: an existing target tokenizer file (else one is trained)
        "vocab_size": 8000,
        "src_vocab_size": None,  # separate only: the source vocabulary's size (null: vocab_size)
        "tgt_vocab_size": None,  # separate only: the target vocabulary's size (null: vocab_size)
        "long": "drop",
        # subword regularization (Kudo, 2018): each epoch, every training sentence in one of its
        # subword_nbest most probable segmentations, drawn with probability ∝ P^subword_alpha;
        # a unigram vocabulary only
        "subword_nbest": 0,  # 0: off (always the best segmentation)
        "subword_alpha": 0.1,
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
# pretrained model (train.init) takes its architecture (a field the recipe names must agree);
# the fields of ENCODER_HEAD_FIELDS may differ.
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


# The model fields a translation model fine-tuned from a pretrained one (train.init) may set
# for itself; every other field is the pretrained model's (regularisation only: none of these
# changes the weights' shapes or what they compute in eval mode).
ENCODER_DECODER_TUNING_FIELDS = ("dropout", "attention_dropout")


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


def override(overrides: Sequence[str], key: str) -> str | None:
    """The text of the value that the last ``key=value`` of ``overrides`` (``--set``) gives
    ``key`` (spaces around either side ignored, as :func:`load_recipe` reads them), or None."""
    value = None
    for item in overrides:
        name, _, raw = item.partition("=")
        if name.strip() == key:
            value = raw.strip()
    return value


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> dict:
    """The task's defaults, then the YAML file (if any), then ``key=value`` overrides.

    Override values are read as YAML (``train.steps=7`` is an int). The task comes from
    ``task=`` among the overrides, else the file, else "numbers". With ``train.init`` (fine-tuning)
    the model section holds only the fields the file or the overrides name and the task's tuning
    fields: the rest are the pretrained model's (:func:`fine_tuning_fields`).
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
    given = override(overrides, "task")
    task = given if given is not None else data.get("task", "numbers")
    if task not in TASKS:
        raise UserError(f"{where}: unknown task {task!r}; known: {', '.join(TASKS)}")
    recipe = copy.deepcopy(DEFAULTS[task])
    named: set[str] = set()  # the section.key pairs the file or the overrides set
    if path is not None:
        for section, value in data.items():
            if section not in recipe:
                raise UserError(f"{path}: unknown section {section!r}; known: {', '.join(recipe)}")
            if isinstance(recipe[section], dict):
                if not isinstance(value, dict):
                    raise UserError(f"{path}: section {section!r} must be a mapping")
                for key, v in value.items():
                    _set(recipe, f"{section}.{key}", v, where=str(path))
                    named.add(f"{section}.{key}")
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
        named.add(key.strip())
    _check_values(recipe, where)
    fine_tuning = recipe["train"].get("init") is not None
    if fine_tuning:
        # Fine-tuning takes the pretrained model's architecture: the model section keeps the
        # fields the recipe names (checked against the checkpoint's) and the task's tuning
        # fields (dropout, a classifier's head: the recipe's to choose), not the architecture
        # defaults, which an imported model (post-norm, GELU, ...) rarely has.
        tuning = ENCODER_HEAD_FIELDS if task == "classify" else ENCODER_DECODER_TUNING_FIELDS
        recipe["model"] = {k: v for k, v in recipe["model"].items() if f"model.{k}" in named or k in tuning}
    if task == "lm":
        if recipe["data"]["tokenizer"] not in ("char", "subword"):
            raise UserError(f"{where}: data.tokenizer must be char or subword for the lm task")
        if recipe["data"]["valid_text"] is not None and not isinstance(recipe["data"]["valid_text"], str):
            raise UserError(f"{where}: data.valid_text must be a file path or null")
    if task != "translation" and recipe["train"]["steps"] is None:
        raise UserError(f"{where}: train.steps must be a positive integer for the {task} task")
    if task == "numbers" and recipe["model"].get("max_len", 512) < NUMBERS_MIN_LEN:
        raise UserError(f"{where}: model.max_len must be at least {NUMBERS_MIN_LEN} for the numbers task")
    if task in ("mlm", "classify"):
        _check_encoder_data(recipe, where)
    if task == "translation":
        _check_vocabularies(recipe, where)
    # Check the model fields now, before any data is read (the vocabulary comes later).
    if MODEL_KINDS[task] == "encoder_decoder":
        vocab = {"src_vocab_size": 64, "tgt_vocab_size": 64}
    else:
        vocab = {"vocab_size": 64}
    try:
        if not fine_tuning:
            make_config(MODEL_KINDS[task], {**recipe["model"], **vocab})
        else:
            # The names now, and the tuning fields' values (with the defaults' other fields);
            # how the named architecture fields go together (d_model and n_heads ...) is checked
            # with the pretrained model's own at the start of training (fine_tuning_fields).
            tuned = {k: v for k, v in recipe["model"].items() if k in tuning}
            config = make_config(MODEL_KINDS[task], {**DEFAULTS[task]["model"], **vocab, **tuned})
            known = {f.name for f in dataclasses.fields(config)}
            unknown = sorted(set(recipe["model"]) - known)
            if unknown:
                raise UserError(f"unknown model field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
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
    ("data", "target_tokenizer"): ((str, type(None)), lambda v: v is None or bool(v), "a tokenizer file path or null"),
    ("data", "vocab"): (str, lambda v: v in ("joint", "separate"), "joint or separate"),
    ("data", "src_vocab_size"): ((int, type(None)), lambda v: v is None or v > 8, "an integer > 8 or null"),
    ("data", "tgt_vocab_size"): ((int, type(None)), lambda v: v is None or v > 8, "an integer > 8 or null"),
    ("data", "valid_beam"): (int, lambda v: v > 0, "a positive integer"),
    ("data", "subword_nbest"): (
        int,
        lambda v: 0 <= v <= MAX_NBEST,
        f"an integer in 0..{MAX_NBEST} (0: no subword sampling)",
    ),
    ("data", "subword_alpha"): ((int, float), lambda v: v > 0, "a number > 0"),
    ("data", "length_penalty"): ((int, float), lambda v: v >= 0, "a number >= 0"),
    ("data", "max_len_a"): ((int, float), lambda v: v >= 0, "a number >= 0"),
    ("data", "max_len_b"): (int, lambda v: v >= 0, "an integer >= 0"),
    ("train", "batch_size"): (int, lambda v: v > 0, "a positive integer"),
    ("train", "warmup"): (int, lambda v: v >= 0, "an integer >= 0"),
    ("train", "seed"): (int, lambda v: True, "an integer"),
    ("train", "schedule"): (str, lambda v: v in SCHEDULES, f"one of {', '.join(SCHEDULES)}"),
    ("train", "lr"): ((int, float), lambda v: v > 0, "a positive number"),
    ("train", "label_smoothing"): ((int, float), lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("train", "rdrop"): ((int, float), lambda v: v >= 0, "a number >= 0 (0: no R-Drop)"),
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


def seq2seq_model(recipe: dict, tokenizers: Tokenizer | Vocabularies) -> EncoderDecoder:
    """A fresh encoder-decoder from the recipe's model section and its vocabularies (one
    tokenizer: a joint vocabulary). The special ids are the target's (equal to the source's)."""
    vocab = Vocabularies.of(tokenizers)
    fields = {
        **recipe["model"],
        "src_vocab_size": vocab.source.vocab_size,
        "tgt_vocab_size": vocab.target.vocab_size,
        "pad_id": vocab.target.pad_id,
        "bos_id": vocab.target.bos_id,
        "eos_id": vocab.target.eos_id,
    }
    return build_model("encoder_decoder", fields)


def fit_recipe(
    model: nn.Module,
    step_loss: Callable[[nn.Module, int], tuple[torch.Tensor, int]],
    train: dict,
    *,
    progress: bool,
    desc: str,
    unit: str = "tok",
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
        unit=unit,
    )


def save_model_dir(model: nn.Module, tokenizer: Tokenizer, out: str | Path, *, extra: dict) -> None:
    """Save the model directory with its tokenizer files (``special_tokens.json`` too, when the
    tokenizer has one: an imported model's tokens and settings)."""
    with tempfile.TemporaryDirectory() as tmp:
        save_model(model, out, files=tokenizer.save(Path(tmp) / TOKENIZER_FILE), extra=extra)


def fit_summary(result: FitResult, model: nn.Module, tokenizer: Tokenizer | Vocabularies) -> dict:
    return {
        "train_seconds": result.seconds,
        "steps": result.steps,
        "tokens_per_second": result.tokens / max(result.seconds, 1e-9),
        "final_loss": result.losses[-1],
        "losses": result.losses,
        "model": model,
        "tokenizer": tokenizer,
    }


def tokenizer_for(data: dict, *, checkpoint: Path | None, pairs: list[tuple[str, ...]]) -> tuple[Tokenizer, str]:
    """The run's tokenizer: a checkpoint's (resume, fine-tuning), a given file, or a new one
    trained on every sentence of ``pairs``.

    A tokenizer file given together with a checkpoint must be the checkpoint's own (same
    SHA-256): a model run with a vocabulary it was not trained with would map ids to the
    wrong tokens, silently.
    """
    return _tokenizer(
        data,
        "tokenizer",
        TOKENIZER_FILE,
        checkpoint=checkpoint,
        meta=read_meta(checkpoint) if checkpoint is not None else None,
        texts=lambda: (s for pair in pairs for s in pair),
        vocab_size=int(data["vocab_size"]),
    )


def vocabularies_for(data: dict, *, checkpoint: Path | None, pairs: list[tuple[str, str]]) -> tuple[Vocabularies, str]:
    """A translation run's vocabularies, as :func:`tokenizer_for` finds one tokenizer, per
    ``data.vocab``: joint (``data.tokenizer``, or one trained on both sides of ``pairs``), or
    separate (the source's from ``data.tokenizer`` or trained on the sources, of
    ``data.src_vocab_size`` pieces; the target's from ``data.target_tokenizer`` or trained on the
    targets, of ``data.tgt_vocab_size``). A checkpoint's must be of the same kind as the recipe's.
    """
    meta = read_meta(checkpoint) if checkpoint is not None else None
    separate = data["vocab"] == "separate"
    if meta is not None and (TARGET_FILE in meta["files"]) != separate:
        has = "separate" if TARGET_FILE in meta["files"] else "joint"
        raise UserError(
            f"{checkpoint} has a {has} vocabulary but the recipe says data.vocab={data['vocab']}; set data.vocab={has}"
        )
    if not separate:
        tokenizer, said = tokenizer_for(data, checkpoint=checkpoint, pairs=pairs)
        return Vocabularies(tokenizer, tokenizer), said
    found = [
        _tokenizer(
            data,
            key,
            file,
            checkpoint=checkpoint,
            meta=meta,
            texts=lambda side=side: (pair[side] for pair in pairs),
            vocab_size=int(data[size] if data[size] is not None else data["vocab_size"]),
        )
        for side, (key, file, size) in enumerate(
            [("tokenizer", TOKENIZER_FILE, "src_vocab_size"), ("target_tokenizer", TARGET_FILE, "tgt_vocab_size")]
        )
    ]
    (source, said_source), (target, said_target) = found
    said = f"{said_source} (source), {said_target} (target)"
    try:
        return Vocabularies(source, target), said
    except UserError as e:  # two given files that do not fit together
        raise UserError(f"data.vocab=separate: {e} (source: {said_source}; target: {said_target})") from None


def _tokenizer(
    data: dict,
    key: str,
    file: str,
    *,
    checkpoint: Path | None,
    meta: dict | None,
    texts: Callable[[], Iterable[str]],
    vocab_size: int,
) -> tuple[Tokenizer, str]:
    """One tokenizer and what it is: the checkpoint's ``file`` (a file named by ``data.KEY`` must
    be that one), else the file ``data.KEY`` names, else one of ``vocab_size`` trained on ``texts``."""
    given = resolve(data[key]) if data[key] is not None else None
    if given is not None and not given.is_file():
        raise UserError(f"data.{key}: {given} does not exist")
    if checkpoint is not None and meta is not None:
        if file not in meta["files"]:
            raise UserError(f"{checkpoint} has no {file}")
        if given is not None and not _same_tokenizer(given, checkpoint / file, digest=meta["files"][file]):
            raise UserError(
                f"data.{key} {given} is not the tokenizer {checkpoint} was trained with "
                f"(SHA-256 differs from {checkpoint / file}); use that file or start a new run"
            )
        return Tokenizer.load(checkpoint / file), f"the tokenizer of {checkpoint}"
    if given is not None:
        return Tokenizer.load(given), str(given)
    tokenizer = Tokenizer.train_subword(texts(), vocab_size=vocab_size)
    return tokenizer, f"a new {tokenizer.vocab_size}-token unigram vocabulary"


def _same_tokenizer(given: Path, stored: Path, *, digest: str) -> bool:
    """Whether ``given`` is the tokenizer stored as ``stored`` (SHA-256 ``digest``): the same
    bytes, or the same tokenizer written again. A checkpoint's copy is the tokenizer as loaded
    and saved, and ``tokenizers`` writes some scores it read back with other digits (the same
    numbers to within a rounding), so a file named with data.tokenizer may not be byte-equal."""
    if sha256_file(given) == digest:
        return True
    return Tokenizer.load(given).same_as(Tokenizer.load(stored))


def fine_tuning_fields(
    model: nn.Module, recipe: dict, source: Path, *, may_differ: tuple[str, ...], use: str = "train.init"
) -> dict:
    """The config fields of a model that continues ``model`` (read from ``source``): its own,
    but for the ``may_differ`` fields the recipe's model section names. Any other field the
    section names must agree with ``model``'s: weights loaded into another architecture would
    compute something else. ``use`` (``train.init`` or ``--resume``) begins the error."""
    differ = [
        key
        for key, value in recipe["model"].items()
        if key not in may_differ and getattr(model.config, key, value) != value
    ]
    if differ:
        has = ", ".join(f"{k}={getattr(model.config, k)}" for k in differ)
        wants = ", ".join(f"{k}={recipe['model'][k]}" for k in differ)
        raise UserError(f"{use}: {source} has model {has}; the recipe says {wants}")
    tuned = {k: v for k, v in recipe["model"].items() if k in may_differ}
    return {**dataclasses.asdict(model.config), **tuned}


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


def _check_vocabularies(recipe: dict, where: str) -> None:
    """The vocabulary keys of a translation recipe: the per-side ones only with separate
    vocabularies, which cannot share one embedding table."""
    data = recipe["data"]
    if data["vocab"] == "joint":
        for key in ("target_tokenizer", "src_vocab_size", "tgt_vocab_size"):
            if data[key] is not None:
                raise UserError(f"{where}: data.{key} needs data.vocab=separate (a joint vocabulary has one)")
    elif recipe["model"].get("share_embeddings", False):
        raise UserError(
            f"{where}: model.share_embeddings=true needs data.vocab=joint (one vocabulary for source and "
            f"target); set model.share_embeddings=false for separate vocabularies"
        )
