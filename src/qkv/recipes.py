"""Recipes: a YAML file that names a task, a model and training settings; what every task shares.

What is here: the typed recipe, :class:`Recipe` with its sections :class:`TrainConfig` (how
every task trains; a task's subclass adds its own settings) and :class:`DecodeConfig` (how the
run's model decodes when scored, which its model directory then records), the model section
(the family's config fields) and the task's own data dataclass; :class:`Task` (what a task
module tells the loader, the runner and the command line) with :class:`Start` and
:class:`Setup` (what a task is given and gives back: its own parts of a run);
:func:`load_recipe` (a task's defaults, the YAML file, ``--set key=value`` overrides; values
checked by :data:`COMMON_RULES` and the task's own rules, errors naming the file and key, keys
that moved (:data:`MOVED`) named with their new place; :func:`upgrade_stored` reads a
checkpoint's recipe of before), and the pieces the tasks share: :func:`seq2seq_model`,
:func:`tokenizer_for` / :func:`find_tokenizer` (a checkpoint's, a given or a newly trained
vocabulary, with the SHA-256 check), :func:`fine_tuning_fields` and the batch orders
(:func:`length_batches`, :func:`batch_of_step`, :func:`step_seed`).

What is not here: the runner (``runner.py``: start, fit, save, evaluate), the tasks (``tasks/``:
one module each, with its defaults, rules and parts; ``tasks.TASKS`` lists them) and argument
parsing and printing (``cli/``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import torch
import yaml
from torch import nn

from qkv.checkpoint import (
    build_model,
    make_config,
    read_meta,
    sha256_file,
)
from qkv.data import (
    resolve,
)
from qkv.distributed import DEVICES, PARALLEL
from qkv.errors import UserError
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.schedules import SCHEDULES
from qkv.stopping import ON_NONFINITE
from qkv.tokenization import FILE as TOKENIZER_FILE
from qkv.tokenization import Tokenizer, Vocabularies
from qkv.training import Epochs

# A value rule: (accepted types, test, what the value must be, for the error).
Rule = tuple[type | tuple[type, ...], Callable[[object], bool], str]


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a task's run starts (what ``Task.prepare`` is given).

    Attributes:
        out: the model directory the run becomes, or its run directory (``Task.run_directory``).
        checkpoint: the checkpoint a resumed run continues from (its tokenizer, its architecture);
            None for a fresh run.
        progress: whether to show progress.
    """

    out: Path
    checkpoint: Path | None
    progress: bool


@dataclasses.dataclass(frozen=True)
class Setup:
    """A task's own parts of a run, which ``Task.prepare`` returns; ``runner.train`` does the rest.

    Attributes:
        model: the model to train (fresh, fine-tuned from ``train.init``, or as ``Start.checkpoint``
            was built).
        step_loss: ``step_loss(model, i)``: the loss of batch i and its count of target tokens (or
            examples, or audio seconds), drawn from i alone (:func:`~qkv.training.fit`).
        tokenizer: saved with every checkpoint (a translation model's two: ``Vocabularies``).
        evaluate: ``evaluate(model, out, validated) -> (recorded, summary)``: the final model's
            scores, which the model directory's ``config.json`` (or ``run.json``) records, and what
            else the summary holds; it may write beside the model (samples, pictures).
            ``validated``: the final model's scores by ``final_score`` (None without validation).
        score: the task's validation (``train.valid_every``), its scores by name; None: none.
        metric: the score that ranks checkpoints; ``higher``: whether higher is better.
        final_score: how the best and the averaged checkpoints are compared at the end (None:
            ``score``; translation decodes with the final beam).
        epochs: the run counts epochs (translation); None: steps.
        meta: what every checkpoint's ``config.json`` records beside the task and the recipe.
        facts: what the summary holds beside the scores (problems met, the vocabulary, ...).
        unit: what ``step_loss`` counts, in the progress bar.
    """

    model: nn.Module
    step_loss: Callable[[nn.Module, int], tuple[torch.Tensor, float]]
    tokenizer: Tokenizer | Vocabularies
    evaluate: Callable[[nn.Module, Path, dict | None], tuple[dict, dict]]
    score: Callable[[nn.Module], dict[str, float]] | None = None
    metric: str = "loss"
    higher: bool = False
    final_score: Callable[[nn.Module], dict] | None = None
    epochs: Epochs | None = None
    meta: dict = dataclasses.field(default_factory=dict)
    facts: dict = dataclasses.field(default_factory=dict)
    unit: str = "tok"


# Train keys a resumed run may change (every other change would make it differ from an
# uninterrupted one): caps, how often it saves and validates, what it keeps, where it runs.
RESUME_MAY_CHANGE = ("seconds", "save_every", "patience", "average_last", "tensorboard", "parallel", "device")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How a run trains (the recipe's ``train`` section): what every task shares. A task whose
    training has settings of its own (a loss weight, a batch measured in frames) extends it with
    a subclass, which also gives the shared settings the task's own defaults.

    Attributes:
        steps: optimizer steps (None: the task counts epochs instead, as translation may).
        seconds: stop after this much training time (None: no limit).
        lr, warmup, schedule, min_lr: the peak learning rate, its warm-up steps, its decay
            (``schedules.SCHEDULES``) and its floor.
        weight_decay, beta2: AdamW's decoupled weight decay and second-moment decay (β1 is 0.9).
        clip: gradient-norm clipping (0: none). bf16: autocast to bfloat16.
        label_smoothing: ε of the smoothed cross-entropy (Szegedy et al., 2016).
        seed: every random draw of the run follows from it.
        accumulate: batches per optimizer step (K batches of B train as one of K·B).
        ema_decay: d of a moving average of the weights, saved and evaluated in their place (0: off).
        valid_every: steps between validations by the task's own metric ("epoch": at each
            epoch's end; None: none); the best is kept.
        patience: stop after this many validations without a better score (None: never).
        average_last: average the last N validated checkpoints; the final model is the better of
            that and the best.
        tensorboard: TensorBoard scalars in ``OUT/tensorboard``.
        save_every: steps between checkpoints in ``OUT/last`` (``--resume``); 0: on a signal only.
        on_nonfinite: a NaN/inf loss or gradient: "stop" (naming the step and module) or "skip" it.
        parallel: on N workers (``--nproc``): "ddp" (the whole model each) or "fsdp" (sharded).
        device: "cpu", "cuda" (each worker its GPU) or "auto" (cuda when there is one).
    """

    steps: int | None = None
    seconds: float | None = None
    lr: float = 1e-3
    warmup: int = 0
    schedule: str = "cosine"
    min_lr: float = 0.0
    weight_decay: float = 0.01
    beta2: float = 0.98
    clip: float = 1.0
    bf16: bool = False
    label_smoothing: float = 0.0
    seed: int = 0
    accumulate: int = 1
    ema_decay: float = 0.0
    valid_every: int | str | None = None
    patience: int | None = None
    average_last: int = 0
    tensorboard: bool = False
    save_every: int = 500
    on_nonfinite: str = "stop"
    parallel: str = "ddp"
    device: str = "auto"


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """How a task's model decodes when the run scores it, and what its model directory then
    records as the decoding defaults of ``qkv translate`` / ``transcribe`` / ``speak`` and the
    server (the recipe's ``decode`` section). A task names the settings that apply to it
    (``Task.decode``); a recipe that sets another is refused.

    Attributes:
        beam_size: beam width of the final scoring (1: greedy).
        valid_beam: beam width of the validations during training (1: greedy).
        length_penalty: hypotheses ranked by log p / length^penalty (GNMT's simple form).
        max_len_a, max_len_b: an output of a source of S tokens has at most a·S + b tokens
            (fairseq's rule).
        ctc_weight: λ of the joint CTC/attention score λ·CTC + (1 − λ)·attention (Watanabe et
            al., 2017) in decoding (0: the attention decoder alone). Not the loss weight:
            that is ``train.ctc_loss_weight``.
        lm: a language-model directory (same tokens) fused into the beam search (None: none).
        lm_weight: its weight in the shallow fusion (ESPnet's usual 0.3).
        stop_threshold: a TTS decoder stops when its stop probability passes this.
        attention_window: [back, ahead]: TTS synthesis keeps cross-attention near its peak (None: free).
    """

    beam_size: int = 4
    valid_beam: int = 1
    length_penalty: float = 1.0
    max_len_a: float = 1.5
    max_len_b: int = 10
    ctc_weight: float = 0.3
    lm: str | None = None
    lm_weight: float = 0.3
    stop_threshold: float = 0.5
    attention_window: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A loaded, checked recipe: what :func:`load_recipe` returns and a task's run reads.

    Attributes:
        task: the task's name (``tasks.TASKS``).
        model: the model section: fields of the family's config (``checkpoint.KINDS``), checked
            against it; a mapping, not the config itself, because the vocabulary sizes and
            special ids come from the tokenizer at the start of the run, and a fine-tuned model
            takes every field its recipe does not name from the pretrained model.
        train: :class:`TrainConfig` (the task's subclass).
        data: the task's own data settings (its dataclass, ``Task.data``).
        decode: :class:`DecodeConfig`.
    """

    task: str
    model: Mapping
    train: TrainConfig
    data: object
    decode: DecodeConfig

    def to_dict(self, decode_keys: Sequence[str] | None = None) -> dict:
        """The recipe as plain data (what checkpoints store as JSON): ``decode`` holds
        ``decode_keys`` (the task's, ``Task.decode``; None: all)."""
        decode = dataclasses.asdict(self.decode)
        return _plain(
            {
                "task": self.task,
                "model": dict(self.model),
                "train": dataclasses.asdict(self.train),
                "data": dataclasses.asdict(self.data),
                "decode": {k: v for k, v in decode.items() if decode_keys is None or k in decode_keys},
            }
        )


def _plain(value):
    """``value`` as JSON would give it back: tuples as lists, mappings as dicts (a copy)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# Keys that moved to another place, from a recipe (or a stored checkpoint's recipe) of before
# the decode section: a recipe naming one is refused with the new name, a stored one is moved.
MOVED = {
    **{
        f"data.{key}": f"decode.{key}"
        for key in (
            "beam_size",
            "valid_beam",
            "length_penalty",
            "max_len_a",
            "max_len_b",
            "ctc_weight",
            "stop_threshold",
            "attention_window",
        )
    },
    "train.ctc_weight": "train.ctc_loss_weight",
}


def upgrade_stored(recipe: Mapping | None) -> dict:
    """A stored recipe (a checkpoint's ``config.json``) in today's layout: keys of :data:`MOVED`
    moved where they are now; a copy (None: an empty recipe)."""
    out = copy.deepcopy(dict(recipe or {}))
    for old, new in MOVED.items():
        (section, key), (to, name) = old.split("."), new.split(".")
        if isinstance(out.get(section), dict) and key in out[section]:
            out.setdefault(to, {}).setdefault(name, out[section].pop(key))
    return out


@dataclasses.dataclass(frozen=True)
class Task:
    """What recipes, the runner and the command line know of a task; each module of ``qkv.tasks`` defines one.

    ``model``: the model section's defaults (fields of the family's config dataclass).
    ``train``: the task's :class:`TrainConfig` (a subclass with its defaults and its own
    settings); ``data``: its data settings (a frozen dataclass); ``decode``: the
    :class:`DecodeConfig` settings that apply to it. ``model_kind``: the family
    (``checkpoint.KINDS``). ``prepare``: its own parts of a run, ``prepare(recipe, start)`` ->
    :class:`Setup` (``runner.train`` starts the run, trains, saves, evaluates). ``report``:
    ``report(summary, recipe)`` -> (the scores as JSON fields, one sentence saying them).
    ``rules``: value rules for the task's own keys, added to :data:`COMMON_RULES`. ``check``:
    rules across keys, ``check(recipe, where)``, run on the typed recipe. ``tuning_fields``: the
    model fields a model fine-tuned from a pretrained one (``train.init``) may set for itself.
    ``rate_unit``: what the training rate counts. ``loss_name``: what the training loss is, as
    the loss picture's axis says it. ``run_directory``: the task trains in a run directory
    (``runs.py``) rather than into its model directory. ``resume_may_change``: the train keys
    ``--resume`` may change; ``resume_may_name``: (section, key) of tokenizer files it may name
    (the task checks them against the checkpoint's).
    """

    name: str
    model: Mapping
    train: type[TrainConfig]
    data: type
    model_kind: str
    prepare: Callable[[Recipe, Start], Setup]
    report: Callable[[dict, Recipe], tuple[dict, str]]
    decode: tuple[str, ...] = ()
    rules: Mapping[tuple[str, str], Rule] = dataclasses.field(default_factory=dict)
    check: Callable[[Recipe, str], None] | None = None
    tuning_fields: tuple[str, ...] = ()
    rate_unit: str = "tokens"
    loss_name: str = "cross-entropy (nats/token)"
    run_directory: bool = False
    resume_may_change: tuple[str, ...] = RESUME_MAY_CHANGE
    resume_may_name: tuple[tuple[str, str], ...] = ()

    @property
    def defaults(self) -> dict:
        """Every key a recipe of the task may set, with its default, as plain data (a fresh copy)."""
        return Recipe(self.name, self.model, self.train(), self.data(), DecodeConfig()).to_dict(self.decode)

    def from_stored(self, recipe: Mapping | None) -> Recipe:
        """The :class:`Recipe` a checkpoint's ``config.json`` records (``meta["recipe"]``): in
        today's layout (:func:`upgrade_stored`), keys added since taking their defaults and
        keys since removed left out."""
        stored, defaults = upgrade_stored(recipe), self.defaults
        plain = {
            section: {**value, **{k: v for k, v in (stored.get(section) or {}).items() if k in value}}
            for section, value in defaults.items()
            if isinstance(value, dict)
        }
        plain["model"] = {**defaults["model"], **(stored.get("model") or {})}
        return self.typed(plain)

    def typed(self, recipe: Mapping) -> Recipe:
        """The :class:`Recipe` of a checked recipe given as plain data (``to_dict``'s layout)."""
        decode = {k: v for k, v in recipe.get("decode", {}).items() if k in self.decode}
        if decode.get("attention_window") is not None:
            decode["attention_window"] = tuple(decode["attention_window"])
        return Recipe(
            task=self.name,
            model=MappingProxyType(copy.deepcopy(dict(recipe["model"]))),
            train=self.train(**recipe["train"]),
            data=self.data(**copy.deepcopy(recipe["data"])),
            decode=DecodeConfig(**decode),
        )


def read_yaml(text: str):
    """The plain data of a YAML text (yaml.YAMLError or RecursionError when it is not YAML), read
    by a safe loader (plain data only: no Python objects, no code): libyaml's where PyYAML was
    built with it, which refuses nesting deeper than 1,000 at once, where the pure-Python one
    takes seconds (quadratic in the depth) to reach Python's recursion limit."""
    return yaml.load(text, Loader=yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader)


def _set(recipe: dict, key: str, value, *, where: str) -> None:
    parts = key.split(".")
    node = recipe
    for i, part in enumerate(parts[:-1]):
        if not isinstance(node.get(part), dict):
            raise UserError(f"{where}: {'.'.join(parts[: i + 1])} is not a section of the recipe")
        node = node[part]
    if parts[0] != "model" and parts[-1] not in node:
        if key in MOVED:
            raise UserError(f"{where}: {key} has moved: it is {MOVED[key]} now")
        if parts[0] == "decode" and parts[-1] in {f.name for f in dataclasses.fields(DecodeConfig)}:
            known = ", ".join(sorted(node)) or "none"
            raise UserError(f"{where}: {key} does not apply to this task; its decode keys: {known}")
        raise UserError(f"{where}: unknown key {key!r}; known in this section: {', '.join(sorted(node))}")
    if isinstance(node.get(parts[-1]), dict) and isinstance(value, dict):
        for name, inner in value.items():  # a nested section (a speech model's features): key by key
            _set(recipe, f"{key}.{name}", inner, where=where)
        return
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


def load_recipe(
    path: str | Path | None, overrides: Sequence[str] = (), *, tasks: Mapping[str, Task], default: str
) -> Recipe:
    """The task's defaults, then the YAML file (if any), then ``key=value`` overrides: a
    :class:`Recipe`, its values checked (errors name the file and the key; a key that moved is
    named with its new place, :data:`MOVED`).

    Override values are read as YAML (``train.steps=7`` is an int). The task comes from
    ``task=`` among the overrides, else the file, else ``default``; ``tasks`` are the known
    ones by name (``qkv.tasks.TASKS``). With ``train.init`` (fine-tuning) the model section
    holds only the fields the file or the overrides name and the task's tuning fields: the rest
    are the pretrained model's (:func:`fine_tuning_fields`).
    """
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"recipe {path} does not exist")
        try:
            data = read_yaml(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise UserError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
        except RecursionError:  # sequences or mappings nested deeper than Python's stack
            raise UserError(f"{path} is nested too deeply to read as YAML") from None
        except OSError as e:
            raise UserError(f"cannot read {path}: {e.strerror}") from None
        if not isinstance(data, dict):
            raise UserError(f"{path}: expected a mapping of sections (task, model, train, data)")
    where = str(path) if path is not None else "recipe"
    given = override(overrides, "task")
    name = given if given is not None else data.get("task", default)
    if not isinstance(name, str) or name not in tasks:
        raise UserError(f"{where}: unknown task {name!r}; known: {', '.join(tasks)}")
    task = tasks[name]
    recipe = copy.deepcopy(task.defaults)
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
            value = read_yaml(raw)
        except yaml.YAMLError as e:
            raise UserError(f"--set {item!r}: the value is not valid YAML: {str(e).splitlines()[0]}") from None
        except RecursionError:
            raise UserError(f"--set {item!r}: the value is nested too deeply to read as YAML") from None
        _set(recipe, key.strip(), value, where=f"--set {item}")
        named.add(key.strip())
    _check_values(recipe, where, {**COMMON_RULES, **task.rules})
    _check_validation(recipe["train"], where)
    fine_tuning = recipe["train"].get("init") is not None
    if fine_tuning:
        # Fine-tuning takes the pretrained model's architecture: the model section keeps the
        # fields the recipe names (checked against the checkpoint's) and the task's tuning
        # fields (dropout, a classifier's head: the recipe's to choose), not the architecture
        # defaults, which an imported model (post-norm, GELU, ...) rarely has.
        recipe["model"] = {k: v for k, v in recipe["model"].items() if f"model.{k}" in named or k in task.tuning_fields}
    # Check the model fields now, before any data is read (the vocabulary comes later).
    if task.model_kind == "encoder_decoder":
        vocab = {"src_vocab_size": 64, "tgt_vocab_size": 64}
    else:
        vocab = {"vocab_size": 64}
    try:
        if not fine_tuning:
            make_config(task.model_kind, {**recipe["model"], **vocab})
        else:
            # The names now, and the tuning fields' values (with the defaults' other fields);
            # how the named architecture fields go together (d_model and n_heads ...) is checked
            # with the pretrained model's own at the start of training (fine_tuning_fields).
            tuned = {k: v for k, v in recipe["model"].items() if k in task.tuning_fields}
            config = make_config(task.model_kind, {**task.defaults["model"], **vocab, **tuned})
            known = {f.name for f in dataclasses.fields(config)}
            unknown = sorted(set(recipe["model"]) - known)
            if unknown:
                named = ", ".join(n if n.isprintable() else repr(n) for n in unknown)
                raise UserError(f"unknown model field(s) {named}; known: {', '.join(sorted(known))}")
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    typed = task.typed(recipe)
    if task.check is not None:
        task.check(typed, where)
    return typed


# Value rules every task shares: (section, key) -> Rule. A task adds its own (Task.rules);
# a rule whose key the task's recipe lacks is skipped.
COMMON_RULES: dict[tuple[str, str], Rule] = {
    ("train", "save_every"): (int, lambda v: v >= 0, "an integer >= 0 (0: only when stopped by a signal)"),
    ("train", "accumulate"): (int, lambda v: v > 0, "a positive integer"),
    ("train", "ema_decay"): ((int, float), lambda v: 0 <= v < 1, "a number in [0, 1) (0: no moving average)"),
    ("train", "valid_every"): (
        (int, str, type(None)),
        lambda v: v is None or v == "epoch" or (isinstance(v, int) and v > 0),
        "a positive number of steps, epoch, or null (no validation)",
    ),
    ("train", "patience"): ((int, type(None)), lambda v: v is None or v > 0, "a positive integer or null"),
    ("train", "average_last"): (int, lambda v: v >= 0, "an integer >= 0"),
    ("train", "tensorboard"): (bool, lambda v: True, "true or false"),
    ("train", "on_nonfinite"): (str, lambda v: v in ON_NONFINITE, f"one of {', '.join(ON_NONFINITE)}"),
    ("train", "steps"): ((int, type(None)), lambda v: v is None or v > 0, "a positive integer"),
    ("train", "init"): ((str, type(None)), lambda v: v is None or bool(v), "a model directory or null"),
    ("data", "tokenizer"): ((str, type(None)), lambda v: v is None or bool(v), "a tokenizer.json path or null"),
    ("train", "batch_size"): (int, lambda v: v > 0, "a positive integer"),
    ("train", "warmup"): (int, lambda v: v >= 0, "an integer >= 0"),
    ("train", "seed"): (int, lambda v: -(2**63) <= v < 2**64, "an integer from -2**63 to 2**64 - 1 (a torch seed)"),
    ("train", "schedule"): (str, lambda v: v in SCHEDULES, f"one of {', '.join(SCHEDULES)}"),
    ("train", "lr"): ((int, float), lambda v: v > 0, "a positive number"),
    ("train", "label_smoothing"): ((int, float), lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("train", "seconds"): ((int, float, type(None)), lambda v: v is None or v > 0, "a positive number or null"),
    ("train", "min_lr"): ((int, float), lambda v: v >= 0, "a number >= 0"),
    ("train", "weight_decay"): ((int, float), lambda v: v >= 0, "a number >= 0"),
    ("train", "beta2"): ((int, float), lambda v: 0 < v < 1, "a number in (0, 1)"),
    ("train", "clip"): ((int, float), lambda v: v >= 0, "a number >= 0 (0: no clipping)"),
    ("train", "bf16"): (bool, lambda v: True, "true or false"),
    ("train", "parallel"): (
        str,
        lambda v: v in PARALLEL,
        f"one of {', '.join(PARALLEL)}",
    ),
    ("train", "device"): (str, lambda v: v in DEVICES, f"one of {', '.join(DEVICES)}"),
    ("decode", "beam_size"): (int, lambda v: v > 0, "a positive integer"),
    ("decode", "valid_beam"): (int, lambda v: v > 0, "a positive integer"),
    ("decode", "length_penalty"): ((int, float), lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    ("decode", "max_len_a"): ((int, float), lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    ("decode", "max_len_b"): (int, lambda v: v >= 0, "an integer >= 0"),
    ("decode", "ctc_weight"): ((int, float), lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    ("decode", "lm"): ((str, type(None)), lambda v: v is None or bool(v), "a language-model directory or null"),
    ("decode", "lm_weight"): ((int, float), lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    ("decode", "stop_threshold"): ((int, float), lambda v: 0 < v < 1, "a number in (0, 1)"),
    ("decode", "attention_window"): (
        (list, type(None)),
        lambda v: (
            v is None
            or (
                len(v) == 2
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in v)
                and v[1] >= 1  # with ahead 0 the window could never move past its first symbol
            )
        ),
        "null or [back, ahead]: two integers >= 0, ahead >= 1",
    ),
    ("data", "val_fraction"): ((int, float), lambda v: 0 < v < 1, "a number in (0, 1)"),
    ("data", "eval_batch_size"): (int, lambda v: v > 0, "a positive integer"),
    ("data", "vocab_size"): (int, lambda v: v > 8, "an integer > 8"),
}


def _check_validation(train: dict, where: str) -> None:
    """What needs validation has it: early stopping and averaging compare validated checkpoints;
    validation at every epoch's end needs a task that trains in epochs."""
    every = train.get("valid_every")
    if every == "epoch" and "epochs" not in train:
        raise UserError(f"{where}: train.valid_every=epoch needs a task that trains in epochs; give a number of steps")
    for key in ("patience", "average_last"):
        if every is None and train.get(key):
            raise UserError(f"{where}: train.{key} needs validation; set train.valid_every (a number of steps)")


def _as_number(value: object) -> object:
    """YAML reads 1e-3 (no dot) as a string; numbers written that way are numbers here."""
    if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        return float(value)
    return value


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)")


def _check_values(recipe: dict, where: str, rules: Mapping[tuple[str, str], Rule]) -> None:
    for key, value in recipe["model"].items():
        recipe["model"][key] = _as_number(value)
    for (section, key), (types, test, what) in rules.items():
        if key not in recipe.get(section, {}):
            continue  # a key of another task
        if float in (types if isinstance(types, tuple) else (types,)):
            recipe[section][key] = _as_number(recipe[section][key])
        value = recipe[section][key]
        if (isinstance(value, bool) and types is not bool) or not isinstance(value, types) or not test(value):
            raise UserError(f"{where}: {section}.{key} must be {what}, got {value!r}")


def require_steps(recipe: Recipe, where: str) -> None:
    """A task that trains for a number of steps (all but translation, which counts epochs)."""
    if recipe.train.steps is None:
        raise UserError(f"{where}: train.steps must be a positive integer for the {recipe.task} task")


def seq2seq_model(recipe: Recipe, tokenizers: Tokenizer | Vocabularies) -> EncoderDecoder:
    """A fresh encoder-decoder from the recipe's model section and its vocabularies (one
    tokenizer: a joint vocabulary). The special ids are the target's (equal to the source's)."""
    vocab = Vocabularies.of(tokenizers)
    fields = {
        **recipe.model,
        "src_vocab_size": vocab.source.vocab_size,
        "tgt_vocab_size": vocab.target.vocab_size,
        "pad_id": vocab.target.pad_id,
        "bos_id": vocab.target.bos_id,
        "eos_id": vocab.target.eos_id,
    }
    return build_model("encoder_decoder", fields)


def step_seed(seed: int, step: int) -> int:
    """A seed for the random draws of one training step, fixed by the run's seed and the step
    alone, so that a resumed run draws what an uninterrupted one would have."""
    return (seed * 1_000_003 + step) % 2**63


def length_batches(frames: Sequence[int], budget: int) -> list[list[int]]:
    """Indices grouped into batches of similar length: sorted by frames, cut so that a batch's
    padded size (its longest × its count) stays within ``budget`` (one longer utterance alone)."""
    order = sorted(range(len(frames)), key=lambda i: (frames[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:  # ascending: the newest is the longest
        if current and frames[i] * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def batch_of_step(batches: int, step: int, seed: int) -> int:
    """Which batch step ``step`` trains on: every batch once per epoch, epochs in their own
    order, all of it fixed by (seed, step), so a resumed run takes the same batches."""
    epoch, within = divmod(step, batches)
    order = torch.randperm(batches, generator=torch.Generator().manual_seed(step_seed(seed, -1 - epoch)))
    return int(order[within])


def tokenizer_for(data, *, checkpoint: Path | None, pairs: list[tuple[str, ...]]) -> tuple[Tokenizer, str]:
    """The run's tokenizer: a checkpoint's (resume, fine-tuning), a given file, or a new one
    trained on every sentence of ``pairs``.

    A tokenizer file given together with a checkpoint must be the checkpoint's own (same
    SHA-256): a model run with a vocabulary it was not trained with would map ids to the
    wrong tokens, silently.
    """
    return find_tokenizer(
        data,
        "tokenizer",
        TOKENIZER_FILE,
        checkpoint=checkpoint,
        meta=read_meta(checkpoint) if checkpoint is not None else None,
        texts=lambda: (s for pair in pairs for s in pair),
        vocab_size=int(data.vocab_size),
    )


def find_tokenizer(
    data,
    key: str,
    file: str,
    *,
    checkpoint: Path | None,
    meta: dict | None,
    texts: Callable[[], Iterable[str]],
    vocab_size: int,
) -> tuple[Tokenizer, str]:
    """One tokenizer and what it is: the checkpoint's ``file`` (a file named by ``data.KEY`` (a
    task's data settings) must be that one), else the file ``data.KEY`` names, else one of
    ``vocab_size`` trained on ``texts``."""
    named = getattr(data, key)
    given = resolve(named) if named is not None else None
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
    model: nn.Module, recipe: Recipe, source: Path, *, may_differ: tuple[str, ...], use: str = "train.init"
) -> dict:
    """The config fields of a model that continues ``model`` (read from ``source``): its own,
    but for the ``may_differ`` fields the recipe's model section names. Any other field the
    section names must agree with ``model``'s: weights loaded into another architecture would
    compute something else. ``use`` (``train.init`` or ``--resume``) begins the error."""
    differ = [
        key
        for key, value in recipe.model.items()
        if key not in may_differ and getattr(model.config, key, value) != value
    ]
    if differ:
        has = ", ".join(f"{k}={getattr(model.config, k)}" for k in differ)
        wants = ", ".join(f"{k}={recipe.model[k]}" for k in differ)
        raise UserError(f"{use}: {source} has model {has}; the recipe says {wants}")
    tuned = {k: v for k, v in recipe.model.items() if k in may_differ}
    return {**dataclasses.asdict(model.config), **tuned}
