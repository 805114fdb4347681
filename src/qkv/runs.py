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
its ``final`` checkpoint (``checkpoint.model_dir``). A task that trains into its model
directory keeps ``last``, ``best``, ``step-NNNNNNN`` and ``tensorboard`` there while it runs.

What is here: :func:`save_checkpoint` / :func:`load_checkpoint` (a model directory with what
resuming needs), :func:`average_checkpoints`, :func:`choose_final` (the better of the best and
the averaged checkpoint), :class:`Scalars` (TensorBoard) and the run directory's checks.

What is not here: the training loop, validation and the optimizer (``training.py``), the model
directory format (``checkpoint.py``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from qkv.checkpoint import (
    DTYPES,
    RUN_FILE,
    SHARDED,
    WEIGHTS,
    Model,
    load_model,
    read_meta,
    read_shards,
    save_model,
    save_shards,
    sha256_file,
    shard_index,
    state_once,
)
from qkv.distributed import all_gather, all_max, barrier, is_sharded, load_state, plain_copy, world
from qkv.errors import UserError
from qkv.files import check_writable, storage_errno, storage_error, write_atomic
from qkv.training import FitResult, Trainer

TRAINER_TENSORS = "trainer.safetensors"
TRAINER_STATE = "trainer.json"
TRAINER_PREFIX = "trainer."  # the trainer's tensors among a sharded checkpoint's


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
    # .last.*: the debris of a run killed during its first save (an FSDP save's shards), not a run
    if run.exists() and (not run.is_dir() or any(not e.name.startswith(".last.") for e in run.iterdir())):
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
    this, rank 0 alone writes the directory, and none goes on before the checkpoint is whole.

    With DDP (and one process) the directory is an ordinary model directory plus the trainer's
    state. With FSDP and ``trainer`` nothing is gathered: every worker writes its shards of the
    weights and optimizer moments in parallel (``checkpoint.save_shards``, i.e.
    ``torch.distributed.checkpoint``) and rank 0 moves them into the directory; it resumes on any
    number of workers, and ``load_model`` reads it as an ordinary model (for use and export).
    Without ``trainer`` (a final or best model) the weights are gathered and written whole."""
    if trainer is not None and is_sharded(model):
        _save_sharded(model, Path(directory), files=files, extra=extra, trainer=trainer, progress=progress)
        return
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
    tensors and metadata) beside it.

    The trainer's files are staged beside ``directory`` and moved in, not written to the
    system's temporary directory and copied: the optimizer's moments, twice the model's size,
    are written once, and a save killed midway leaves them where the next save removes them
    (``.NAME.state``), not in /tmp."""
    if state is None:
        save_model(model, directory, files=files, extra=extra)
        return
    tensors, meta = state
    staging = directory.with_name(f".{directory.name}.state")
    try:
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)  # a killed save's pieces
            staging.mkdir()
            save_file(tensors, staging / TRAINER_TENSORS)
            (staging / TRAINER_STATE).write_text(json.dumps({"trainer": meta, "progress": progress or {}}))
        except (OSError, SafetensorError) as e:
            if storage_errno(e) is not None:
                raise storage_error(directory, e) from None
            if isinstance(e, OSError):
                raise UserError(f"cannot write {staging}: {e.strerror or e}") from None
            raise
        moved = {name: (staging / name, sha256_file(staging / name)) for name in (TRAINER_TENSORS, TRAINER_STATE)}
        save_model(model, directory, files=files, extra=extra, moved=moved)
    finally:  # on any exception too (a second Ctrl-C during the save): twice the model's size
        shutil.rmtree(staging, ignore_errors=True)


def _save_sharded(
    model: Model, directory: Path, *, files: dict[str, Path], extra: dict, trainer: Trainer, progress: dict | None
) -> None:
    """:func:`save_checkpoint` of an FSDP model with its trainer: every worker writes its shards
    into a staging directory beside ``directory`` and hashes its own file; rank 0 then writes
    the model directory (atomically, as ever), the shards moved into it. A failure on rank 0
    is raised on every worker (none waits for it at a barrier)."""
    tensors, meta = trainer.state(whole=False)  # collective: every worker's RNG
    staging = directory.with_name(f".{directory.name}.shards")
    failure = None
    if world().main:
        shutil.rmtree(staging, ignore_errors=True)  # a killed save's pieces
        try:
            staging.mkdir(parents=True)
        except OSError as e:
            failure = storage_error(staging, e) if storage_errno(e) is not None else e
    _agree(failure)
    state = {WEIGHTS + name: t for name, t in state_once(model).items()}
    state.update({TRAINER_PREFIX + name: t for name, t in tensors.items()})
    save_shards(state, staging)  # collective: each worker writes its own file (DCP raises on all if one fails)
    own = sorted(staging.glob(f"shard-{world().rank + 1:05d}-*.safetensors"))
    digests = {
        name: digest for part in all_gather({f.name: sha256_file(f) for f in own}) for name, digest in part.items()
    }
    failure = None
    if world().main:
        try:
            shards = {
                f.name: (f, digests.get(f.name) or sha256_file(f)) for f in sorted(staging.glob("shard-*.safetensors"))
            }
            (staging / TRAINER_STATE).write_text(json.dumps({"trainer": meta, "progress": progress or {}}))
            shards[TRAINER_STATE] = (staging / TRAINER_STATE, sha256_file(staging / TRAINER_STATE))
            save_model(model, directory, files=files, moved=shards, extra=extra, shards=world().size)
        except BaseException as e:  # every worker must hear of it
            failure = e
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    _agree(failure)


def _agree(failure: BaseException | None) -> None:
    """Raise ``failure`` (rank 0's) on rank 0 and a UserError saying so on the other workers;
    nothing when rank 0 had none. Collective."""
    failed = all_max([0.0 if failure is None else 1.0])[0] > 0
    if failure is not None:
        raise failure
    if failed:
        raise UserError("worker 0 could not write the checkpoint (it says why); this worker stops too")


def _load_sharded(directory: Path, trainer: Trainer) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a sharded checkpoint's weights into ``trainer.model`` and return the trainer's
    tensors (this worker's shards of them) and state: on any number of workers, sharded or not."""
    stored = shard_index(directory)
    state = json.loads((directory / TRAINER_STATE).read_text())
    kept = {
        name[len(TRAINER_PREFIX) :]: (shape, DTYPES[dtype])
        for name, (dtype, shape) in stored.items()
        if name.startswith(TRAINER_PREFIX)
    }
    tensors = trainer.blank_state(kept)
    weights = {WEIGHTS + name: t for name, t in state_once(trainer.model).items()}
    for name, t in weights.items():
        if name not in stored or stored[name][1] != tuple(t.shape):
            found = stored[name][1] if name in stored else "nothing"
            raise UserError(f"{directory}: {name[len(WEIGHTS) :]} is {found} there, the model needs {tuple(t.shape)}")
    read_shards(directory, {**weights, **{TRAINER_PREFIX + k: t for k, t in tensors.items()}})
    return tensors, state


def load_checkpoint(directory: Path, trainer: Trainer) -> dict:
    """Load ``directory``'s weights into ``trainer.model`` and its training state into
    ``trainer``; returns the saved ``progress``."""
    meta = read_meta(directory)  # checks every file against its recorded SHA-256
    sharded = meta.get(SHARDED) is not None
    for name in (TRAINER_STATE,) if sharded else (TRAINER_TENSORS, TRAINER_STATE):
        if name not in meta["files"]:
            raise UserError(f"{directory} has no {name}: it is not a resumable checkpoint")
    try:
        if sharded:
            tensors, state = _load_sharded(directory, trainer)
        else:
            loaded, _ = load_model(directory, kind=meta["kind"])
            load_state(trainer.model, loaded.state_dict())  # FSDP: each worker keeps its shard
            tensors = load_file(directory / TRAINER_TENSORS)
            state = json.loads((directory / TRAINER_STATE).read_text())
    except (SafetensorError, OSError, ValueError, KeyError) as e:
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


def choose_final(
    model: nn.Module,
    directory: Path,
    result: FitResult,
    *,
    score: Callable[[nn.Module], dict],
    metric: str,
    higher: bool,
    save: Callable[[str, dict], None],
    ema: bool = False,
) -> tuple[str, dict[str, dict]]:
    """Put a run's final model into ``model`` (which holds the weights training ended with) and
    name it: the better on ``score``'s ``metric`` of the best validated checkpoint
    (``directory/best``) and the average of those kept (``result.kept``; saved as ``averaged``
    with its scores). A run stopped before any validation ends with its last weights ("last";
    "ema", saved, for a moving average, which ``last/`` does not hold as its weights). Returns
    the name and every candidate's scores. On N workers every one calls it (``score`` and the
    saves may be collective)."""
    candidates: dict[str, dict] = {}
    if result.best is not None and (directory / "best").is_dir():
        _load_weights(model, directory / "best")
        candidates["best"] = score(model)
    if len(result.kept) > 1:
        average_checkpoints([directory / name for name in result.kept], model)
        candidates["averaged"] = score(model)
        save("averaged", _numbers(candidates["averaged"]))
    if not candidates:  # the model holds the weights training ended with
        name = "ema" if ema else "last"
        candidates[name] = score(model)
        if ema:
            save(name, _numbers(candidates[name]))
    pick = max if higher else min
    final = pick(candidates, key=lambda name: candidates[name][metric])
    if final == "best" and "averaged" in candidates:
        _load_weights(model, directory / "best")
    model.eval()
    return final, candidates


def _numbers(scores: dict) -> dict:
    """The scalar scores (not the hypotheses) of a candidate, as a checkpoint records them."""
    return {k: v for k, v in scores.items() if isinstance(v, (int, float, str))}


def _load_weights(model: nn.Module, directory: Path) -> None:
    loaded, _ = load_model(directory)
    model.load_state_dict(loaded.state_dict())


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
