"""Training: the optimizer step and the training loop.

What is here: :class:`Trainer` (AdamW, the schedule, gradient clipping and accumulation, a
moving average of the weights, bf16 autocast, and its state for checkpoints and exact
resumption) and :func:`fit`, the one training loop of every task (:class:`FitConfig`): steps or
:class:`Epochs`, a time budget, :class:`Validation` with the best and averaged checkpoints and
early stopping, :class:`Checkpointing` for saves and resumption, TensorBoard scalars and a
progress bar with loss, learning rate and tokens/s; :class:`FitResult`, the run so far.

What is not here: the learning-rate schedules (``schedules.py``), the stops by a signal or a
non-finite step (:class:`~qkv.stopping.StopRequest`, :class:`~qkv.stopping.NonFinite`,
``stopping.py``), the losses of the model families and the batches they read (``losses.py``),
the tasks' parts and the runner that calls fit (``tasks/``, ``runner.py``), when fit saves
(:class:`~qkv.saving.Saves`, ``saving.py``), models, decoding, data files.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from qkv import distributed
from qkv.errors import UserError
from qkv.progress import progress as progress_report
from qkv.saving import Saves
from qkv.schedules import lr_factor
from qkv.stopping import ON_NONFINITE, NonFinite, StopRequest, first_nonfinite_module


def ema_update(average: Tensor, value: Tensor, decay: float) -> None:
    """One step of an exponential moving average, in place: average ← d·average + (1 − d)·value."""
    average.lerp_(value, 1.0 - decay)  # a + w·(v − a) = (1 − w)·a + w·v with w = 1 − d


@dataclass
class FitResult:
    """What a :func:`fit` run did, and where it is (a checkpoint saves it: :meth:`progress`).

    Steps taken, training seconds (validation excluded), the loss of every step, target tokens
    and the learning rate the schedule had reached. A run in epochs: the epochs completed and
    the next batch of the current one. With validation: one record per validation
    (``history``), the best of them, how many validations since it (``bad``) and the names of
    the checkpoints kept for averaging. ``stopped_by``: what ended the run (steps, seconds,
    epochs, patience), or None while it runs.
    """

    steps: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    lr: float = 0.0
    epoch: int = 0
    batch: int = 0
    history: list[dict] = field(default_factory=list)
    best: dict | None = None
    bad: int = 0
    kept: list[str] = field(default_factory=list)
    stopped_by: str | None = None

    def progress(self) -> dict:
        """The run so far as JSON-able data, which :meth:`resumed` turns back into it."""
        return dataclasses.asdict(self)

    @classmethod
    def resumed(cls, saved: dict, *, steps: int) -> FitResult:
        """The result a checkpoint's :meth:`progress` saved (a field it lacks takes its default;
        ``steps``: the trainer's, for progress saved without them)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{"steps": steps, **{k: v for k, v in saved.items() if k in known}})


class Trainer:
    """The optimizer side of one training run: AdamW, the schedule, clipping, the step count.

    ``step(batches)`` takes one optimizer step over one or more batches (gradient
    accumulation: the gradient is the mean over all their target tokens, as if they were one
    batch). ``state()``/``restore()`` give everything needed to continue exactly: optimizer
    moments, schedule, step count and the global torch RNG that dropout draws from (and the
    GPU's, training on one), as tensors plus JSON (checkpoints store them with safetensors;
    nothing is pickled).

    AdamW (Loshchilov & Hutter, 2019) without weight decay on biases and norm gains; the
    schedule is ``"inverse_sqrt"`` (Vaswani et al., eq. 3) or ``"cosine"`` down to
    ``min_lr`` at ``total_steps``; optional bf16 autocast (weights, gradients and the
    optimizer stay fp32: mixed precision, Micikevicius et al., 2018, without loss scaling,
    which bf16's fp32-sized exponent does not need).

    On N workers (torchrun: :mod:`qkv.distributed`) the model is wrapped for ``parallel``
    (``"ddp"`` or ``"fsdp"``) and each batch callable computes this worker's share of a batch:
    its loss is weighted by its tokens and the gradient divided by the tokens of all shares
    (summed across workers), so the step equals one step on the whole batch. The state holds
    every worker's RNG, and the optimizer moments whole or (``state(whole=False)``) as shards.
    ``device`` (a recipe's ``train.device``: ``distributed.device``) moves the model first.

    ``ema_decay`` d > 0 keeps an exponential moving average of the weights beside them (Polyak &
    Juditsky, 1992; the "EMA" of timm and nanochat): after every optimizer step t,
    e_t = d·e_(t−1) + (1 − d)·θ_t, from e_0 = the weights the run starts with
    (:func:`ema_update`). The average is part of the state (``ema.I`` for parameter I, cut like
    the optimizer's moments), so a resumed run continues it exactly; :meth:`averaged` puts it
    into the model for a while (validation), :meth:`keep_averaged` for good (the end of a run).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        warmup: int,
        total_steps: int,
        schedule: str = "inverse_sqrt",
        min_lr: float = 0.0,
        weight_decay: float = 0.01,
        clip: float = 1.0,
        betas: tuple[float, float] = (0.9, 0.98),
        bf16: bool = False,
        on_nonfinite: str = "stop",
        parallel: str = "ddp",
        device: str | None = None,
        ema_decay: float = 0.0,
    ) -> None:
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
        if device is not None:  # a recipe's train.device; None: the model stays where it is
            model.to(distributed.device(device))  # in place: the caller's model moves too
        self.model = model
        self.world = distributed.world()
        self.runner = distributed.wrap(model, parallel)  # the model itself with one process
        self.clip = clip
        self.bf16 = bf16
        self.on_nonfinite = on_nonfinite
        self.steps = 0
        self.skipped = 0  # steps whose non-finite loss or gradient was skipped (on_nonfinite="skip")
        # After wrapping: fully_shard replaces the parameters by shards (which keep their whole shape).
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr,
            betas=betas,
            fused=True,  # one kernel for all parameters: ~7 ms/step less on nanoGPT's CPU config
        )
        self.schedule, self.warmup, self.total_steps, self.floor = schedule, warmup, total_steps, min_lr / lr
        self.planned_steps = total_steps  # the most a time cap's replan() may give back
        factor = lr_factor(schedule, warmup=warmup, total=total_steps, floor=self.floor)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.device_type = next(model.parameters()).device.type
        self.ema_decay = ema_decay
        # The average of each parameter, in the optimizer's order (its state's indices); None: off.
        self.ema = [p.detach().clone() for p in self.parameters()] if ema_decay > 0 else None

    def parameters(self) -> list[Tensor]:
        """The parameters in the order the optimizer's state indexes them."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @torch.no_grad()
    def _swap_averaged(self) -> None:
        """Exchange the model's weights and their moving average."""
        for p, e in zip(self.parameters(), self.ema or [], strict=False):
            held = p.detach().clone()
            p.copy_(e)
            e.copy_(held)

    @contextmanager
    def averaged(self) -> Iterator[None]:
        """Inside the block the model holds the moving average of its weights (``ema_decay``;
        without one, its weights), afterwards its own again."""
        self._swap_averaged()
        try:
            yield
        finally:
            self._swap_averaged()

    @torch.no_grad()
    def keep_averaged(self) -> None:
        """Put the moving average into the model for good (nothing without ``ema_decay``)."""
        for p, e in zip(self.parameters(), self.ema or [], strict=False):
            p.copy_(e)

    def replan(self, total_steps: int) -> None:
        """End a decaying schedule (cosine) at ``total_steps`` instead (never past the steps it
        was made for, never before the steps taken): a run that must stop sooner (a time cap)
        still anneals to ``min_lr``, and one the cap lets go further again gets that road
        back. The rate of the next step follows the new curve at once."""
        self.total_steps = max(min(total_steps, self.planned_steps), self.steps)
        factor = lr_factor(self.schedule, warmup=self.warmup, total=self.total_steps, floor=self.floor)
        self.scheduler.lr_lambdas = [factor] * len(self.optimizer.param_groups)
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * factor(self.steps)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def forward(self, batch: Callable[[], tuple[Tensor, int]]) -> tuple[Tensor, int]:
        """One batch closure's (loss, tokens): inside the DDP/FSDP wrapper's forward on several workers."""
        return self.runner(batch) if self.world.size > 1 else batch()

    @property
    def lr(self) -> float:
        """The learning rate of the next step."""
        return self.scheduler.get_last_lr()[0]

    def step(self, batches: Sequence[Callable[[], tuple[Tensor, int]]]) -> tuple[float, int]:
        """One optimizer step; each callable computes one batch's mean loss and its token count.

        Returns the mean loss per token over the batches and the number of tokens.
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        shared = self.world.size > 1
        total, loss_sum = 0, 0.0
        for i, batch in enumerate(batches):
            # DDP: all-reduce once, at the last batch's backward (gradients add up meanwhile).
            last = i == len(batches) - 1
            sync = self.runner.no_sync() if shared and not last and hasattr(self.runner, "no_sync") else nullcontext()
            with sync:
                with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.bf16):
                    loss, n_tokens = self.forward(batch)
                # One batch: its mean loss. Several, or a worker's share: weight each by its
                # tokens, divide once below by all of them.
                (loss if len(batches) == 1 and not shared else loss * n_tokens).backward()
            total += n_tokens
            loss_sum += loss.item() * n_tokens
        if shared:
            # The wrapper averaged the gradients over the N workers: times N / all tokens.
            total, loss_sum = distributed.all_sum([total, loss_sum])
            for p in self.model.parameters():
                if p.grad is not None and total > 0:
                    p.grad.mul_(self.world.size / total)
        elif len(batches) > 1 and total > 0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(total)
        # The gradient's norm is needed anyway to clip; without clipping (inf) nothing is scaled.
        norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.clip if self.clip > 0 else math.inf)
        loss = loss_sum / max(total, 1)
        if not (math.isfinite(loss) and math.isfinite(float(norm))):
            what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {float(norm)}"
            if self.on_nonfinite == "stop":
                raise NonFinite(self.steps, what, first_nonfinite_module(self.model, batches, run=self.forward))
            self.optimizer.zero_grad(set_to_none=True)  # skip: the weights and moments stay as they were
            self.skipped += 1
        else:
            self.optimizer.step()
            if self.ema is not None:
                with torch.no_grad():
                    for e, p in zip(self.ema, self.parameters(), strict=True):
                        ema_update(e, p.detach(), self.ema_decay)
        self.scheduler.step()
        self.steps += 1
        return loss, total

    def state(self, *, whole: bool = True) -> tuple[dict[str, Tensor], dict]:
        """(tensors, JSON-able metadata) that :meth:`restore` turns back into this state.

        Under FSDP the optimizer moments are gathered whole, or with ``whole=False`` left as
        this worker's shards (for ``checkpoint.save_shards``: nothing is gathered)."""
        optimizer = self.optimizer.state_dict()
        # Every worker's RNG (collective with several): rank 0's is "rng.torch", rank r's "rng.torch.r".
        states = distributed.all_gather(torch.get_rng_state())
        tensors = {"rng.torch": states[0], **{f"rng.torch.{r}": t for r, t in enumerate(states) if r}}
        if self.device_type == "cuda":  # dropout on a GPU draws from the GPU's generator
            states = distributed.all_gather(torch.cuda.get_rng_state())
            tensors.update({"rng.cuda": states[0], **{f"rng.cuda.{r}": t for r, t in enumerate(states) if r}})
        scalars: dict[str, dict] = {}
        moments = {
            f"optimizer.{index}.{name}": value
            for index, values in optimizer["state"].items()
            for name, value in values.items()
            if isinstance(value, Tensor)
        }
        for index, values in optimizer["state"].items():
            for name, value in values.items():
                if not isinstance(value, Tensor):
                    scalars.setdefault(str(index), {})[name] = value
        moments.update({f"ema.{index}": e for index, e in enumerate(self.ema or [])})
        for key, value in moments.items():
            if whole:  # FSDP: gathered whole (collective), resumable with any N
                tensors[key] = distributed.full_tensor(value.detach()).clone().contiguous()
            else:
                tensors[key] = value.detach()
        meta = {
            "steps": self.steps,
            "total_steps": self.total_steps,
            "skipped": self.skipped,
            "param_groups": optimizer["param_groups"],
            "optimizer_scalars": scalars,
            "scheduler": {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"},
        }
        return tensors, meta

    def blank_state(self, stored: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, Tensor]:
        """Tensors for a saved :meth:`state` (``stored``: each one's whole shape and dtype) to be
        read into, moments cut as this worker's parameters are (``checkpoint.read_shards``
        reads each worker's part of them, whatever the saving run's sharding was)."""
        params = self.parameters()
        blank = {}
        for key, (shape, dtype) in stored.items():
            parts = key.split(".", 2)
            if (parts[0] == "optimizer" and parts[2] != "step") or parts[0] == "ema":
                like = params[int(parts[1])]
                if tuple(like.shape) != tuple(shape):
                    raise ValueError(f"{key} has shape {tuple(shape)}, its parameter {tuple(like.shape)}")
                blank[key] = torch.zeros_like(like.detach(), dtype=dtype)
            else:
                blank[key] = torch.zeros(shape, dtype=dtype)
        return blank

    def restore(self, tensors: dict[str, Tensor], meta: dict) -> None:
        """Continue from a :meth:`state` (the same model and settings are assumed); moments may
        be whole or already this worker's shards (:meth:`blank_state`)."""
        state: dict[int, dict] = {}
        params = self.parameters()  # the indices' order
        for key, value in tensors.items():
            if key.startswith("optimizer."):
                _, index, name = key.split(".", 2)
                like = params[int(index)] if name != "step" else value  # moments are cut as their parameter
                state.setdefault(int(index), {})[name] = distributed.shard_like(value, like)
        if self.ema is not None:
            missing = [i for i in range(len(self.ema)) if f"ema.{i}" not in tensors]
            if missing:
                raise ValueError(f"ema_decay is {self.ema_decay} but the state holds no moving average")
            with torch.no_grad():
                for i, e in enumerate(self.ema):
                    e.copy_(distributed.shard_like(tensors[f"ema.{i}"], params[i]))
        for index, values in meta["optimizer_scalars"].items():
            state.setdefault(int(index), {}).update(values)
        groups = [{**g, "betas": tuple(g["betas"])} for g in meta["param_groups"]]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        self.scheduler.load_state_dict({**meta["scheduler"], "lr_lambdas": [None] * len(groups)})
        self.steps = int(meta["steps"])
        self.skipped = int(meta.get("skipped", 0))
        if int(meta.get("total_steps", self.total_steps)) != self.total_steps:  # a schedule a time cap replanned
            self.replan(int(meta["total_steps"]))
        # This worker's RNG; a worker the saving run did not have takes rank 0's.
        torch.set_rng_state(tensors.get(f"rng.torch.{self.world.rank}", tensors["rng.torch"]).cpu())
        if self.device_type == "cuda" and "rng.cuda" in tensors:
            torch.cuda.set_rng_state(tensors.get(f"rng.cuda.{self.world.rank}", tensors["rng.cuda"]).cpu())


@dataclass(frozen=True)
class Checkpointing:
    """How :func:`fit` saves what resuming needs and resumes, and keeps validated checkpoints.

    Attributes:
        save: ``save(trainer, result)`` writes what resuming needs and returns where.
        load: ``load(trainer)`` restores a saved run into ``trainer`` and returns its
            :class:`FitResult` so far (None: start afresh).
        every: steps between saves (0: only when stopped by a signal, or a validation).
        keep: ``keep(name, scores)`` saves the weights just validated (the moving average with
            ``ema_decay``) as the checkpoint ``name`` ("best", "epoch-NNN", "step-NNNNNNN").
        drop: ``drop(name)`` removes a kept checkpoint that averaging no longer needs.
        always: save when a fresh run starts and when a run ends too, so that the checkpoint
            always exists (a run directory's ``last/``).
    """

    save: Callable[[Trainer, FitResult], str]
    load: Callable[[Trainer], FitResult | None] | None = None
    every: int = 0
    keep: Callable[[str, dict], None] | None = None
    drop: Callable[[str], None] | None = None
    always: bool = False


@dataclass(frozen=True)
class Epochs:
    """A run counted in epochs, passes over the data in an order of each epoch's own (:func:`fit`).

    Attributes:
        count: epochs to train; the run ends after the last, or sooner by a cap or patience.
        begin: ``begin(e)`` makes epoch e's batches ready and returns how many it has; the
            step loss then reads batch b of it as ``step_loss(model, b)``. Called when an epoch
            starts, and on resume for the epoch the run stopped in: it must depend on e alone.
    """

    count: int
    begin: Callable[[int], int]


@dataclass(frozen=True)
class Validation:
    """Validation during :func:`fit`, and what follows from it: the best checkpoint, early
    stopping and the last checkpoints kept for averaging (Vaswani et al., 2017, section 6.1).

    Attributes:
        score: the task's validation of a model, its scores by name (floats); called on every
            worker with the whole weights (the moving average with ``ema_decay``), in eval mode.
        metric: the score that ranks checkpoints (a loss, BLEU, WER, accuracy).
        higher: whether a higher ``metric`` is better.
        every: steps between validations; 0: at the end of every epoch (a run with :class:`Epochs`).
        patience: stop after this many validations without a better ``metric`` (None: never).
        keep: how many of the last validated checkpoints to keep for averaging (0: none).
    """

    score: Callable[[nn.Module], dict[str, float]]
    metric: str
    higher: bool
    every: int = 0
    patience: int | None = None
    keep: int = 0

    def better(self, score: float, best: float) -> bool:
        return score > best if self.higher else score < best


RESCHEDULE_EVERY = 25  # steps between estimates of how many steps fit in a time cap


@dataclass(frozen=True)
class FitConfig:
    """How :func:`fit` trains: the optimizer side of a recipe's train section, typed
    (``runner.fit_config`` reads one).

    Attributes:
        steps: optimizer steps to take; the schedule ends there. With epochs (:class:`Epochs`)
            a cap, or None: the epochs end the run and plan the schedule.
        lr: the peak learning rate.
        warmup: steps of linear warmup.
        schedule: ``"inverse_sqrt"`` or ``"cosine"`` (:data:`~qkv.schedules.SCHEDULES`).
        min_lr: where the cosine schedule ends.
        seconds: a cap on wall time (None: none); a cosine schedule is replanned to end there.
        weight_decay: AdamW's, on matrices only.
        clip: the gradient norm's cap (0: no clipping).
        betas: AdamW's.
        bf16: bf16 autocast.
        on_nonfinite: a NaN/inf loss or gradient: ``"stop"`` or ``"skip"`` the step.
        parallel: ``"ddp"`` or ``"fsdp"`` on several workers.
        device: where to train (``distributed.device``); None: where the model is.
        accumulate: batches per optimizer step (gradient accumulation: one step over K batches
            is one step over their union, :meth:`Trainer.step`).
        ema_decay: d of the moving average of the weights (0: none); with one, the model
            :func:`fit` returns holds the average (:class:`Trainer`).
    """

    steps: int | None
    lr: float
    warmup: int
    schedule: str = "inverse_sqrt"
    min_lr: float = 0.0
    seconds: float | None = None
    weight_decay: float = 0.01
    clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.98)
    bf16: bool = False
    on_nonfinite: str = "stop"
    parallel: str = "ddp"
    device: str | None = None
    accumulate: int = 1
    ema_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.accumulate < 1:
            raise ValueError(f"accumulate must be a positive integer, got {self.accumulate}")


def fit(
    model: nn.Module,
    step_loss: Callable[[nn.Module, int], tuple[Tensor, int]],
    config: FitConfig,
    *,
    progress: bool = True,
    desc: str = "train",
    unit: str = "tok",
    checkpoint: Checkpointing | None = None,
    epochs: Epochs | None = None,
    validation: Validation | None = None,
    scalars: Callable[[str, float, int], None] | None = None,
) -> FitResult:
    """Train ``model`` for ``config.steps`` optimizer steps, or ``epochs``, or until
    ``config.seconds`` have passed: the one training loop of every task.

    ``step_loss(model, i)`` returns the loss of batch ``i`` and its number of target tokens (or
    examples, for a per-example loss; ``unit`` names them in the progress bar); it owns the
    data, so the loop is the same for every model family. Step s takes the batches
    s·K … s·K + K − 1 (K = ``config.accumulate``; one batch, s, without accumulation), and its
    gradient is that of their union. With ``epochs``, i counts the batches of the current
    epoch (:class:`Epochs`) and a step takes the next K of them, fewer at an epoch's end. The
    optimizer side is a :class:`Trainer`; with ``config.ema_decay`` the returned model holds
    the moving average of its weights.

    ``validation`` scores the model every ``validation.every`` steps or at every epoch's end
    (:class:`Validation`): the records go to ``FitResult.history``, the best is kept
    (``checkpoint.keep("best", …)``), the last ``validation.keep`` are kept for averaging, and
    ``validation.patience`` validations without a better score stop the run. Validation time
    is not training time. ``scalars(tag, value, step)`` receives the training loss, learning
    rate and rate every 10 steps and every validation score (TensorBoard).

    With ``seconds``, a decaying schedule (cosine) ends where the time does: every
    ``RESCHEDULE_EVERY`` steps after warm-up the steps that still fit are estimated from the
    rate so far, and when fewer than planned fit, the schedule is planned to end there
    (:meth:`Trainer.replan`): a capped run on a busy machine anneals instead of stopping at
    a high learning rate. The estimate follows the rate both ways, so a slow stretch early on
    (another job beside it) does not anneal the run long before its time is up: the estimate
    is always ahead of the step taken, and the schedule ends at the cap. On a machine fast
    enough for the steps planned nothing changes.

    With ``checkpoint``, what resuming needs (weights, optimizer, schedule, RNG, the moving
    average, the :class:`FitResult` so far) is saved every ``checkpoint.every`` steps, after
    every validation and when SIGTERM or Ctrl-C asks the run to stop (:class:`~qkv.stopping.StopRequest`),
    and ``checkpoint.load`` may continue a saved run: the steps already taken are not taken
    again, and the run ends as an uninterrupted one would (``step_loss`` must draw batch i from
    i alone; ``epochs.begin`` an epoch's order from the epoch alone). A run that had stopped
    goes straight to its end. A non-finite loss or gradient stops the run with
    :class:`~qkv.stopping.NonFinite` (naming the last checkpoint saved) or, with ``on_nonfinite="skip"``,
    skips the step.

    On N workers (torchrun) ``step_loss`` computes this worker's share of the batch
    (:func:`qkv.distributed.share`); the workers agree after every step on the elapsed time and
    on any stop request, so that they stop, reschedule and save at the same step. Only rank 0
    shows progress; ``checkpoint`` and ``validation.score`` are called on every worker.
    """
    if config.steps is None and epochs is None:
        raise ValueError("fit needs config.steps or epochs")
    if validation is not None and validation.every == 0 and epochs is None:
        raise ValueError("validation at the end of every epoch needs epochs")
    planned = config.steps if epochs is None else planned_steps(epochs, config.accumulate, config.steps)
    trainer = _trainer(model, config, planned)
    loaded = checkpoint.load(trainer) if checkpoint is not None and checkpoint.load is not None else None
    result = loaded if loaded is not None else FitResult()
    start = time.perf_counter() - result.seconds
    saves = Saves(checkpoint, trainer, result)
    stop_reason = functools.partial(_stop_reason, result, config, epochs, validation)
    main = trainer.world.main
    bar = progress_report(planned, initial=result.steps, desc=desc, unit="step", disable=not (progress and main))
    say = (lambda line: bar.write(line, file=sys.stderr)) if progress and main else None
    size = None  # the current epoch's batches, once begun
    if loaded is None:
        saves.first()
    with StopRequest() as stop:
        while (reason := stop_reason()) is None:
            if epochs is not None and size is None:
                size = epochs.begin(result.epoch)  # an epoch's order (its draw of pieces) is training time
            first, count = _next_batches(result, size, config.accumulate)
            stop.check(result.steps, saves.save)
            batches = [lambda i=i: step_loss(model, i) for i in range(first, first + count)]
            loss, n_tokens = _step(trainer, saves, batches)
            _count_step(result, loss, n_tokens)
            result.seconds = stop.agree(time.perf_counter() - start)
            result.lr = trainer.lr
            bar.update(1)
            _report_step(bar.set_postfix, scalars, result, loss, unit=unit, planned=planned)
            _replan(trainer, result, config, planned)
            ended = _advance(result, size, count)
            size = None if ended else size
            if validation is not None and (ended if validation.every == 0 else result.steps % validation.every == 0):
                start += _validate(model, trainer, result, validation, checkpoint, scalars, epochs is not None, say)
                saves.after_validation(stop_reason)
            else:
                saves.every_n_steps(stop_reason)
    result.stopped_by = reason
    saves.last()
    bar.close()
    trainer.keep_averaged()  # with ema_decay: the moving average is the model trained
    model.eval()
    return result


def _trainer(model: nn.Module, config: FitConfig, planned: int) -> Trainer:
    """The optimizer side of a :func:`fit` run as ``config`` says, its schedule ``planned`` steps long."""
    return Trainer(
        model,
        lr=config.lr,
        warmup=config.warmup,
        total_steps=planned,
        schedule=config.schedule,
        min_lr=config.min_lr,
        weight_decay=config.weight_decay,
        clip=config.clip,
        betas=config.betas,
        bf16=config.bf16,
        on_nonfinite=config.on_nonfinite,
        parallel=config.parallel,
        device=config.device,
        ema_decay=config.ema_decay,
    )


def _step(trainer: Trainer, saves: Saves, batches: Sequence[Callable[[], tuple[Tensor, int]]]) -> tuple[float, int]:
    """The trainer's step over ``batches``; a non-finite loss or gradient stops the run with the
    last checkpoint of this session named."""
    try:
        return trainer.step(batches)
    except NonFinite as e:
        last = f"; the last checkpoint: {saves.last_saved}" if saves.saved else "; no checkpoint was saved yet"
        raise UserError(f"{e}{last}") from None


def _count_step(result: FitResult, loss: float, tokens: int) -> None:
    """A step taken: its loss and target tokens counted in ``result``."""
    result.steps += 1
    result.tokens += tokens
    result.losses.append(loss)


def _next_batches(result: FitResult, size: int | None, accumulate: int) -> tuple[int, int]:
    """The first batch of the next step and how many it takes: the next ``accumulate`` of the
    current epoch (``size`` batches; fewer at its end), or of the steps so far."""
    if size is not None:
        return result.batch, min(accumulate, size - result.batch)
    return result.steps * accumulate, accumulate


def _advance(result: FitResult, size: int | None, count: int) -> bool:
    """Move a run in epochs past the ``count`` batches of the step taken; whether the epoch ended."""
    if size is None:
        return False
    ended = result.batch + count >= size
    result.batch = 0 if ended else result.batch + count
    result.epoch += int(ended)
    return ended


def _report_step(
    postfix: Callable[[dict], None],
    scalars: Callable[[str, float, int], None] | None,
    result: FitResult,
    loss: float,
    *,
    unit: str,
    planned: int,
) -> None:
    """Every 10th step and the last planned: the loss, learning rate and rate (``unit``/s) on the
    progress bar (``postfix``) and to ``scalars``."""
    if result.steps % 10 != 1 and result.steps != planned:
        return
    rate = result.tokens / max(result.seconds, 1e-9)
    postfix({"loss": f"{loss:.3f}", "lr": f"{result.lr:.2e}", f"{unit}_s": f"{rate:.0f}"})
    if scalars is not None:
        scalars("train/loss", loss, result.steps)
        scalars("train/lr", result.lr, result.steps)
        scalars(f"train/{unit}_per_second", rate, result.steps)


def _replan(trainer: Trainer, result: FitResult, config: FitConfig, planned: int) -> None:
    """With a time cap, every ``RESCHEDULE_EVERY`` steps after warm-up: the schedule planned to
    end with the steps that still fit, when that is not where it ends now (:func:`fit`)."""
    if config.seconds is not None and result.steps > config.warmup and result.steps % RESCHEDULE_EVERY == 0:
        fit_in_time = int(result.steps * config.seconds / result.seconds)
        if min(fit_in_time, planned) != trainer.total_steps:
            trainer.replan(fit_in_time)


def planned_steps(epochs: Epochs, accumulate: int, cap: int | None) -> int:
    """The optimizer steps of a run in epochs, for its schedule and progress bar: epoch 0's steps
    times the epochs (an epoch whose order draws other pieces may hold a few batches more or
    fewer: the epochs, not this, end the run), or the cap if sooner."""
    total = epochs.count * math.ceil(epochs.begin(0) / accumulate)
    return min(total, cap) if cap is not None else total


def _stop_reason(
    result: FitResult, config: FitConfig, epochs: Epochs | None, validation: Validation | None
) -> str | None:
    """Why the run must stop before its next step, or None. Checked before every step, so that a
    resumed run that had stopped takes none; a fresh run always takes one (a time cap counts
    from the first step)."""
    if validation is not None and validation.patience is not None and result.bad >= validation.patience:
        return "patience"
    if epochs is not None and result.epoch >= epochs.count:
        return "epochs"
    if config.steps is not None and result.steps >= config.steps:
        return "steps"
    if config.seconds is not None and result.steps > 0 and result.seconds >= config.seconds:
        return "seconds"
    return None


def _validate(
    model: nn.Module,
    trainer: Trainer,
    result: FitResult,
    validation: Validation,
    checkpoint: Checkpointing | None,
    scalars: Callable[[str, float, int], None] | None,
    in_epochs: bool,
    say: Callable[[str], None] | None,
) -> float:
    """One validation (:class:`Validation`) of the weights, or their moving average: its record in
    ``result.history``, the best and those kept for averaging saved, patience counted, the scores
    said (rank 0) and sent to ``scalars``. Returns the seconds it took."""
    began = time.perf_counter()
    with trainer.averaged():
        scores = validation.score(distributed.plain_copy(model).eval())  # FSDP: the whole weights
        entry = {"epoch": result.epoch} if in_epochs else {}
        entry.update(step=result.steps, train_seconds=round(result.seconds, 1))
        entry.update({f"valid_{name}": value for name, value in scores.items()})
        result.history.append(entry)
        key = f"valid_{validation.metric}"
        if result.best is None or validation.better(entry[key], result.best[key]):
            result.best, result.bad = entry, 0
            if checkpoint is not None and checkpoint.keep is not None:
                checkpoint.keep("best", scores)
        else:
            result.bad += 1
        if validation.keep and checkpoint is not None and checkpoint.keep is not None:
            name = f"epoch-{result.epoch:03d}" if in_epochs else f"step-{result.steps:07d}"
            checkpoint.keep(name, scores)
            result.kept.append(name)
            for old in result.kept[: -validation.keep]:
                if checkpoint.drop is not None:
                    checkpoint.drop(old)
            result.kept = result.kept[-validation.keep :]
    seconds = time.perf_counter() - began
    for name, value in scores.items():
        if scalars is not None:
            scalars(f"valid/{name}", value, result.steps)
    where = f"epoch {result.epoch} (step {result.steps})" if in_epochs else f"step {result.steps}"
    said = ", ".join(f"{name} {value:.4g}" for name, value in scores.items())
    if say is not None:
        say(f"validation after {where}: {said} ({seconds:.1f}s)")
    return seconds
