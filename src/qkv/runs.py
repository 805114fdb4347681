"""Run directories: the checkpoints of a training run that trains in epochs.

A run directory (``qkv train RECIPE --out RUN`` for the translation task) holds:

    run.json        the resolved recipe, one record per epoch, and which checkpoint is ``final``
    last/           the latest checkpoint: a model directory plus ``trainer.safetensors`` and
                    ``trainer.json`` (optimizer, schedule, RNG, position in the data order):
                    ``--resume`` continues from it exactly
    best/           the checkpoint with the best validation score
    epoch-NNN/      the last N epoch-end checkpoints, kept when averaging is asked for
    averaged/       their parameter average (Vaswani et al., 2017, section 6.1)
    tensorboard/    TensorBoard scalars (training loss, learning rate, tokens/s; validation)

Every checkpoint is written atomically (``checkpoint.save_model``): a crash mid-write leaves
the previous ``last`` whole. Commands that take ``--model`` accept a run directory and use
its ``final`` checkpoint (``checkpoint.model_dir``).

What is not here: the training loop and validation (``seq2seq.py``), the optimizer
(``training.py``), the model directory format (``checkpoint.py``).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from qkv.checkpoint import RUN_FILE, Model, load_model, read_meta, save_model
from qkv.distributed import barrier, load_state, plain_copy, world
from qkv.errors import UserError
from qkv.files import check_writable, storage_errno, storage_error, write_atomic
from qkv.training import Trainer

TRAINER_TENSORS = "trainer.safetensors"
TRAINER_STATE = "trainer.json"


def check_run_output(run: Path, *, resume: bool) -> None:
    """A new run needs a new or empty directory; ``resume`` needs a run with a ``last`` checkpoint.
    Either way the process must be allowed to write in it (or, for a new one, to make it)."""
    check_writable(run, inside=True)  # else the first checkpoint fails after an epoch of training
    if resume:
        last, previous = run / "last", run / ".last.old"
        if not last.exists() and previous.is_dir():
            # A crash between save_model's two renames: the previous checkpoint is whole.
            os.replace(previous, last)
        if not (run / RUN_FILE).is_file() or not (last / TRAINER_STATE).is_file():
            raise UserError(f"--resume: {run} holds no resumable run (no {RUN_FILE} and last/{TRAINER_STATE})")
        return
    if run.exists() and (not run.is_dir() or any(run.iterdir())):
        what = "a training run" if (run / RUN_FILE).is_file() else "files"
        raise UserError(f"{run} already holds {what}; pass --resume to continue it or choose another --out")


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically."""
    write_atomic(path, (json.dumps(data, indent=2) + "\n").encode())


def read_run(run: Path) -> dict:
    """The run's ``run.json`` (UserError if missing or unreadable)."""
    path = run / RUN_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict) or "recipe" not in data:
        raise UserError(f"{path} is not a qkv run file")
    return data


def save_checkpoint(
    model: Model,
    directory: Path,
    *,
    files: dict[str, Path],
    extra: dict,
    trainer: Trainer | None = None,
    progress: dict | None = None,
) -> None:
    """Save a model directory; with ``trainer``, also what resuming needs (``progress``: the
    loop's own state, e.g. the position in the data order). On several workers every one calls
    this (FSDP weights and the trainer's state are gathered from all), rank 0 alone writes, and
    none goes on before the checkpoint is whole."""
    whole = plain_copy(model)
    state = trainer.state() if trainer is not None else None
    if world().main:
        _write_checkpoint(whole, directory, files=files, extra=extra, state=state, progress=progress)
    barrier()


def _write_checkpoint(
    model: Model,
    directory: Path,
    *,
    files: dict[str, Path],
    extra: dict,
    state: tuple[dict, dict] | None,
    progress: dict | None,
) -> None:
    """What :func:`save_checkpoint` writes: the model directory, and ``state`` (a trainer's
    tensors and metadata) beside it."""
    with tempfile.TemporaryDirectory() as tmp:
        files = dict(files)
        if state is not None:
            tensors, meta = state
            try:
                save_file(tensors, Path(tmp) / TRAINER_TENSORS)
                (Path(tmp) / TRAINER_STATE).write_text(json.dumps({"trainer": meta, "progress": progress or {}}))
            except (OSError, SafetensorError) as e:
                if storage_errno(e) is None:
                    raise
                raise storage_error(directory, e) from None
            files[TRAINER_TENSORS] = Path(tmp) / TRAINER_TENSORS
            files[TRAINER_STATE] = Path(tmp) / TRAINER_STATE
        save_model(model, directory, files=files, extra=extra)


def load_checkpoint(directory: Path, trainer: Trainer) -> dict:
    """Load ``directory``'s weights into ``trainer.model`` and its training state into
    ``trainer``; returns the saved ``progress``."""
    meta = read_meta(directory)  # checks every file against its recorded SHA-256
    for name in (TRAINER_TENSORS, TRAINER_STATE):
        if name not in meta["files"]:
            raise UserError(f"{directory} has no {name}: it is not a resumable checkpoint")
    loaded, _ = load_model(directory, kind=meta["kind"])
    load_state(trainer.model, loaded.state_dict())  # FSDP: each worker keeps its shard
    try:
        tensors = load_file(directory / TRAINER_TENSORS)
        state = json.loads((directory / TRAINER_STATE).read_text())
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{directory}: cannot read the training state: {e}") from None
    try:
        trainer.restore(tensors, state["trainer"])
    except (KeyError, ValueError, RuntimeError) as e:
        raise UserError(f"{directory}: the training state does not fit this model and optimizer: {e}") from None
    return state["progress"]


def average_checkpoints(directories: list[Path], model: nn.Module) -> None:
    """Set ``model``'s parameters to the mean of the checkpoints' (which share its config)."""
    total: dict[str, torch.Tensor] = {}
    for directory in directories:
        loaded, _ = load_model(directory)
        for name, tensor in loaded.state_dict().items():
            total[name] = total.get(name, 0) + tensor.double()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(total[name] / len(directories))


class Scalars:
    """TensorBoard scalars in ``directory`` (``tensorboard --logdir RUN``); nothing when off."""

    def __init__(self, directory: Path | None) -> None:
        self.writer = None
        if directory is not None:
            from torch.utils.tensorboard import SummaryWriter  # slow import: only when used

            self.writer = SummaryWriter(log_dir=str(directory))

    def add(self, tag: str, value: float, step: int) -> None:
        if self.writer is not None:
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
