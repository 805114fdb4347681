"""The runner every task trains with: start the run, fit, save, evaluate, report.

What is here: :func:`train`, a task's run from its recipe: the run started or resumed (a model
directory, or for a task with ``run_directory`` a run directory: ``runs.py``), the task's own
parts (``Task.prepare``: data, model, step loss, validation, evaluation), the one training loop
(:func:`~qkv.training.fit`) with the hooks the recipe switches on (validation, the best and
averaged checkpoints, early stopping, TensorBoard), the final model chosen and saved, the task's
evaluation recorded, and the summary the command line reports (``Task.report``). Beside it
:func:`start_model_directory`, :func:`start_run_directory` and :func:`resumed_recipe` (what
``--resume`` may change), :func:`fit_config` and :func:`validation_of` (a train section, typed).

What is not here: the tasks' own parts (``tasks/``), recipes and the Task record
(``recipes.py``), the loop (``training.py``), checkpoints and run directories (``runs.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from qkv import __version__
from qkv.checkpoint import RUN_FILE, check_output, read_meta, save_model
from qkv.distributed import barrier, plain_copy, world
from qkv.errors import UserError
from qkv.files import write_atomic
from qkv.recipes import Recipe, Setup, Start, Task, TrainConfig, upgrade_stored
from qkv.runs import (
    TRAINER_STATE,
    Scalars,
    check_run_output,
    choose_final,
    load_checkpoint,
    read_run,
    save_checkpoint,
    write_json,
)
from qkv.tokenization import FILE as TOKENIZER_FILE
from qkv.tokenization import Tokenizer, Vocabularies
from qkv.training import Checkpointing, FitConfig, FitResult, Trainer, Validation, fit

LAST = "last"  # the checkpoint a run resumes from, inside its model or run directory


def train(task: Task, recipe: Recipe, out: str | Path, *, progress: bool = True, resume: bool = False) -> dict:
    """Train ``task`` as ``recipe`` says into ``out``; returns the summary ``task.report`` reads.

    Start: a fresh run needs an output it may write; ``resume`` continues ``OUT/last`` exactly
    (the recipe may differ in ``task.resume_may_change`` only). Then the task prepares its own
    parts (``task.prepare``) and :func:`~qkv.training.fit` trains, saving ``OUT/last`` every
    ``train.save_every`` steps and at every validation (``train.valid_every``: the task's score,
    the best kept in ``OUT/best``, the last ``train.average_last`` kept for averaging,
    ``train.patience``), TensorBoard scalars in ``OUT/tensorboard`` (``train.tensorboard``). The
    final model is the better of the best and the average on the task's score (without
    validation, the weights training ended with; with ``train.ema_decay``, their average). A
    model directory then becomes that model (saved before it is evaluated, so a failure while
    scoring loses no training), and the task's evaluation is recorded in its ``config.json``; a
    run directory keeps its checkpoints and names the final one in ``run.json``. On N workers
    every one trains and chooses; rank 0 alone saves the final model, evaluates it and returns
    the summary (the others return an empty one).
    """
    began = time.perf_counter()
    out = Path(out)
    start = start_run_directory if task.run_directory else start_model_directory
    plain, checkpoint = start(task, recipe.to_dict(task.decode), out, resume=resume)
    recipe = task.typed(plain)  # a resumed run's: the one it began with, but what may change
    setup = task.prepare(recipe, Start(out=out, checkpoint=checkpoint, progress=progress))
    validation = validation_of(recipe.train, setup, task=task.name)
    with tempfile.TemporaryDirectory() as tmp:
        run = _Output(task, recipe, out, setup, files=tokenizer_files(setup.tokenizer, Path(tmp)))
        scalars = Scalars(out / "tensorboard" if recipe.train.tensorboard and world().main else None)
        try:
            result = fit(
                setup.model,
                setup.step_loss,
                fit_config(recipe.train),
                progress=progress,
                desc=f"qkv {task.name}",
                unit=setup.unit,
                checkpoint=run.checkpointing(resume_from=checkpoint),
                epochs=setup.epochs,
                validation=validation,
                scalars=scalars.add,
            )
        finally:
            scalars.close()
        whole = plain_copy(setup.model)  # FSDP: the whole weights; with train.ema_decay, their average
        final, candidates = _final_model(whole, run, result, validation)
        if not world().main:  # rank 0 saves, evaluates and reports; the other workers' part is done
            return {}
        if task.run_directory:
            recorded, summary = setup.evaluate(whole, out, candidates.get(final))
            scores = {name: _scalars(c) for name, c in candidates.items()}
            run.record(final, result, final_scores=scores, **recorded)
            model = whole
        else:
            model = whole.cpu()
            run.save_model(model, result, chosen={"final": final, "validation": result.best} if validation else {})
            recorded, summary = setup.evaluate(model, out, candidates.get(final))
            add_to_config(out, {**recorded, "wall_seconds": time.perf_counter() - began})
    return {
        **setup.facts,
        **summary,
        "final": final,
        "epochs": result.epoch,
        "stopped_by": result.stopped_by,
        "history": result.history,  # the validations
        "train_seconds": result.seconds,
        "steps": result.steps,
        "tokens_per_second": result.tokens / max(result.seconds, 1e-9),
        "final_loss": result.losses[-1] if result.losses else float("nan"),
        "losses": result.losses,
        "model": model,
        "tokenizer": setup.tokenizer,
    }


@dataclass(frozen=True)
class _Output:
    """Where a run writes: its checkpoints (``OUT/NAME``, each with the tokenizer ``files``, the
    task, the recipe and ``setup.meta``), a run directory's ``run.json``, the final model directory."""

    task: Task
    recipe: Recipe
    out: Path
    setup: Setup
    files: dict[str, Path]

    @property
    def stored(self) -> dict:
        """The recipe as checkpoints record it (plain data)."""
        return self.recipe.to_dict(self.task.decode)

    def save(
        self, model: nn.Module, name: str, *, trainer: Trainer | None = None, result: FitResult | None = None, **more
    ) -> str:
        """``model`` as the checkpoint ``name`` (with ``trainer``, resumable); on N workers every
        one calls it, rank 0 writes."""
        unfinished = {} if self.task.run_directory else {"unfinished": True}
        extra = {"task": self.task.name, "recipe": self.stored, **self.setup.meta, **unfinished, **more}
        progress = result.progress() if result is not None else None
        save_checkpoint(model, self.out / name, files=self.files, extra=extra, trainer=trainer, progress=progress)
        return str(self.out / name)

    def record(self, final: str, result: FitResult, **more) -> None:
        """A run directory's ``run.json``: the recipe, the run so far and which checkpoint is final."""
        if self.task.run_directory and world().main:
            meta = {"qkv_version": __version__, "recipe": self.stored, "final": final, **self.setup.meta}
            write_json(self.out / RUN_FILE, {**meta, **result.progress(), **more})

    def save_model(self, model: nn.Module, result: FitResult, *, chosen: dict) -> None:
        """The finished model directory ``OUT`` (rank 0): the model, its tokenizer, what the run
        did; the run's checkpoints give way to it, TensorBoard's scalars stay."""
        timing = {"train_seconds": result.seconds, "steps": result.steps}
        timing[f"{self.task.rate_unit}_per_second"] = result.tokens / max(result.seconds, 1e-9)
        extra = {"task": self.task.name, "recipe": self.stored, **self.setup.meta, **timing, **chosen}
        save_model(model, self.out, files=self.files, extra=extra, carry=("tensorboard",))

    def checkpointing(self, *, resume_from: Path | None) -> Checkpointing:
        """How :func:`~qkv.training.fit` saves ``OUT/last`` (and, in a run directory, its
        ``run.json``), resumes from ``resume_from``, and keeps and drops validated checkpoints."""

        def save_last(trainer: Trainer, result: FitResult) -> str:
            saved = self.save(self.setup.model, LAST, trainer=trainer, result=result)
            self.record(LAST, result)  # "last" until the final models are compared
            return saved

        def load_last(trainer: Trainer) -> FitResult | None:
            if resume_from is None:
                return None
            return FitResult.resumed(load_checkpoint(resume_from, trainer), steps=trainer.steps)

        def keep(name: str, scores: dict) -> None:
            self.save(self.setup.model, name)  # called inside fit's validation: the weights validated

        def drop(name: str) -> None:
            if world().main:
                shutil.rmtree(self.out / name, ignore_errors=True)
            barrier()

        if world().main:
            self.out.mkdir(parents=True, exist_ok=True)
        every = self.recipe.train.save_every
        return Checkpointing(save_last, load_last, every, keep, drop, always=self.task.run_directory)


def _final_model(
    whole: nn.Module, run: _Output, result: FitResult, validation: Validation | None
) -> tuple[str, dict[str, dict]]:
    """The run's final model put into ``whole``, its name and the candidates' scores
    (:func:`~qkv.runs.choose_final`, by the task's ``final_score`` or its validation score):
    without validation, the weights training ended with ("last"; a run directory saves a moving
    average as "ema", which its ``last/`` does not hold as its weights)."""
    ema = run.recipe.train.ema_decay > 0
    if validation is None:
        if run.task.run_directory and ema:
            run.save(whole, "ema")
            return "ema", {}
        return LAST, {}

    def save_candidate(name: str, scores: dict) -> None:
        if run.task.run_directory:  # a model directory becomes the final model itself
            run.save(whole, name, valid_scores=scores)

    return choose_final(
        whole,
        run.out,
        result,
        score=run.setup.final_score or validation.score,
        metric=validation.metric,
        higher=validation.higher,
        save=save_candidate,
        ema=ema,
    )


def _scalars(scores: dict) -> dict:
    return {k: v for k, v in scores.items() if isinstance(v, (int, float, str))}


def tokenizer_files(tokenizer: Tokenizer | Vocabularies, tmp: Path) -> dict[str, Path]:
    """The files of a model's tokenizer (or a translation model's two), written into ``tmp``."""
    if isinstance(tokenizer, Vocabularies):
        return tokenizer.save(tmp)
    return tokenizer.save(tmp / TOKENIZER_FILE)


def add_to_config(directory: Path, fields: dict) -> None:
    """Add ``fields`` to a model directory's ``config.json`` (scores measured after the save;
    the file's own hash is not recorded, so the directory stays whole)."""
    path = directory / "config.json"
    meta = json.loads(path.read_text(encoding="utf-8"))
    write_atomic(path, (json.dumps({**meta, **fields}, indent=2) + "\n").encode())


def resumed_recipe(recipe: dict, saved: dict, where: Path, task: Task) -> dict:
    """The recipe a resumed run continues with: the one ``where`` began with (``saved``), keys
    added to the task since taking their defaults (which do what the run did), and the train
    keys of ``task.resume_may_change`` (and the tokenizer files of ``task.resume_may_name``,
    checked against the checkpoint's by the task) taken from ``recipe``; any other difference is
    refused (one line naming the keys)."""
    saved = upgrade_stored(saved)  # a run begun before the decode section
    saved = {
        **saved,
        **{
            k: {**v, **saved.get(k, {})}
            for k, v in task.defaults.items()
            # a fine-tuned run's model section holds only what its recipe named (load_recipe)
            if isinstance(v, dict) and not (k == "model" and saved.get("train", {}).get("init"))
        },
    }
    differ = []
    for section, value in recipe.items():
        if not isinstance(value, dict):
            if value != saved.get(section):
                differ.append(section)
            continue
        for key, v in value.items():
            may_change = (section == "train" and key in task.resume_may_change) or (
                section,
                key,
            ) in task.resume_may_name
            if not may_change and v != saved.get(section, {}).get(key):
                differ.append(f"{section}.{key}")
    if differ:
        raise UserError(
            f"--resume: the recipe differs from the one {where} began with in {', '.join(differ)}; "
            f"only train.{', train.'.join(task.resume_may_change)} may change"
        )
    named = {k: recipe["data"][k] or saved["data"][k] for section, k in task.resume_may_name if section == "data"}
    return {
        **saved,
        "train": {**saved["train"], **{k: recipe["train"][k] for k in task.resume_may_change}},
        "data": {**saved["data"], **named},
    }


def start_model_directory(task: Task, recipe: dict, out: Path, *, resume: bool) -> tuple[dict, Path | None]:
    """The start of a run that trains into the model directory ``out``: with ``resume``, the
    recipe to continue with (:func:`resumed_recipe`) and ``OUT/last``; else the recipe and None,
    after checking that ``out`` may be written (:func:`~qkv.checkpoint.check_output`); an
    unfinished run there is never overwritten without ``--resume``."""
    last = out / LAST
    if resume:
        if not out.exists() and out.with_name(f".{out.name}.old").is_dir():
            os.replace(out.with_name(f".{out.name}.old"), out)  # killed between the final save's renames
        if not last.exists() and (out / f".{LAST}.old").is_dir():
            os.replace(out / f".{LAST}.old", last)  # a crash between atomic_directory's two renames
        if not (last / TRAINER_STATE).is_file():
            raise UserError(f"--resume: {out} holds no unfinished run (no {LAST}/{TRAINER_STATE})")
        return resumed_recipe(recipe, read_meta(last).get("recipe", {}), out, task), last
    if last.is_dir():
        raise UserError(
            f"{out} holds an unfinished run ({LAST}/); pass --resume to continue it or choose another --out"
        )
    check_output(out)
    return recipe, None


def start_run_directory(task: Task, recipe: dict, out: Path, *, resume: bool) -> tuple[dict, Path | None]:
    """The start of a run that trains in the run directory ``out`` (``runs.py``): as
    :func:`start_model_directory`, the run's recipe read from its ``run.json``."""
    check_run_output(out, resume=resume)
    if not resume:
        return recipe, None
    return resumed_recipe(recipe, read_run(out)["recipe"], out, task), out / LAST


def fit_config(train: TrainConfig) -> FitConfig:
    """The :class:`~qkv.training.FitConfig` of a recipe's (checked) train section."""
    return FitConfig(
        steps=train.steps,
        seconds=train.seconds,
        lr=float(train.lr),
        warmup=train.warmup,
        schedule=train.schedule,
        min_lr=float(train.min_lr),
        weight_decay=float(train.weight_decay),
        betas=(0.9, float(train.beta2)),
        clip=float(train.clip),
        bf16=train.bf16,
        on_nonfinite=train.on_nonfinite,
        parallel=train.parallel,
        device=train.device,
        accumulate=train.accumulate,
        ema_decay=float(train.ema_decay),
    )


def validation_of(train: TrainConfig, setup: Setup, *, task: str) -> Validation | None:
    """The :class:`~qkv.training.Validation` a train section asks for (``valid_every``: steps, or
    ``epoch``; ``patience``; ``average_last``) with the task's score, or None (no validation)."""
    if train.valid_every is None:
        return None
    if setup.score is None:
        raise UserError(f"train.valid_every: the {task} task has no validation")
    return Validation(
        score=setup.score,
        metric=setup.metric,
        higher=setup.higher,
        every=0 if train.valid_every == "epoch" else int(train.valid_every),
        patience=train.patience,
        keep=train.average_last,
    )
