"""Training on several processes with ``torch.distributed``: joining the process group torchrun
describes, which rows of a batch this worker trains on, sums and agreements between workers, and
starting N local workers through torchrun's own launcher.

qkv has no launcher or collective of its own: ``qkv train --nproc N`` runs
``torch.distributed.run`` (torchrun), which starts N copies of ``qkv train`` with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; each joins the group
(:func:`start`: gloo on CPU, NCCL on GPU) and the model is wrapped in DDP or FSDP
(``training.Trainer``). Every token-budget batch is the recipe's: each worker takes every N-th
row of it (:func:`share`), its loss is weighted by its share of the batch's tokens, so one step
on N workers is one step on the whole batch (up to floating-point order).

With ``WORLD_SIZE`` unset or 1 nothing here makes a process group, and every function answers
for one process: the single-process path is the one qkv always had.

Also here: :func:`wrap` (the model in DDP, or sharded by FSDP2's ``fully_shard`` block by
block), and for a sharded model its whole weights (:func:`full_state`, :func:`plain_copy`: the
finished model is saved whole) and loading whole weights into shards (:func:`load_state`).
Resumable checkpoints of a sharded model are written shard by shard by every worker
(``runs.save_checkpoint`` with ``checkpoint.save_shards``: torch.distributed.checkpoint).

What is not here: the weighted gradient step (``training.Trainer``), which rank writes what
(``runner.train`` and ``runs.save_checkpoint``: rank 0 alone).
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from qkv.blocks import DecoderBlock, EncoderBlock
from qkv.errors import UserError

T = TypeVar("T")
R = TypeVar("R")

# On GPUs, NCCL for CUDA tensors and gloo for the CPU ones (the small sums workers agree on).
BACKENDS = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl"}
PARALLEL = ("ddp", "fsdp")  # train.parallel: how N workers hold the model
DEVICES = ("auto", "cpu", "cuda")  # train.device: where a worker trains (auto: its GPU when there is one)
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun: how often the group was restarted


@dataclass(frozen=True)
class World:
    """This process's place among the workers: ``rank`` of ``size``, ``local_rank`` on its machine."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: the worker that writes logs, checkpoints and the model directory."""
        return self.rank == 0


def env_int(env: Mapping[str, str], name: str, default: int | None, *, least: int = 0, most: int | None = None) -> int:
    """The integer torchrun set in the environment variable ``name`` (``default`` when unset or
    empty; None: it must be set); text that is no integer, or one outside ``least``..``most``, is
    a UserError naming it."""
    text = env.get(name, "")
    if not text.strip():
        if default is None:
            raise UserError(f"the environment variable {name} is not set, but WORLD_SIZE is (torchrun sets both)")
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least or (most is not None and value > most):
        span = f"from {least} to {most}" if most is not None else f"of at least {least}"
        raise UserError(
            f"the environment variable {name}={text!r} must be an integer {span} (torchrun sets it; "
            "unset it to train in one process)"
        )
    return value


def world() -> World:
    """The current process group's view (one process when none was started)."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), env_int(os.environ, "LOCAL_RANK", 0))
    return World()


def device(requested: str = "auto") -> torch.device:
    """Where this worker trains (``train.device``): ``"cpu"``; ``"cuda"``, this worker's GPU
    (``LOCAL_RANK``'s under torchrun, else the first); ``"auto"``: ``"cuda"`` when torch sees a
    GPU, else ``"cpu"``. A UserError when ``"cuda"`` is asked for and there is none."""
    if requested not in DEVICES:
        raise UserError(f"train.device must be one of {', '.join(DEVICES)}, got {requested!r}")
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("train.device is cuda, but this torch sees no CUDA GPU (use cpu or auto)")
    return torch.device("cuda", env_int(os.environ, "LOCAL_RANK", 0) % torch.cuda.device_count())


def start(environ: dict[str, str] | None = None, *, timeout_s: float = 1800.0, on: str = "auto") -> World:
    """Join the process group torchrun describes in the environment (``WORLD_SIZE`` > 1), with
    NCCL for CUDA tensors when the workers train on GPUs (``on``: ``train.device``,
    :func:`device`), gloo for CPU tensors always; without it (or ``WORLD_SIZE`` = 1) do nothing."""
    env = os.environ if environ is None else environ
    size = env_int(env, "WORLD_SIZE", 1, least=1)
    if size <= 1 or (dist.is_available() and dist.is_initialized()):
        return world()
    if not dist.is_available():
        raise UserError("WORLD_SIZE is set but this torch has no torch.distributed")
    # Checked here, not inside init_process_group, whose errors about them name no variable.
    rank = env_int(env, "RANK", None, most=size - 1)
    local_rank = env_int(env, "LOCAL_RANK", 0)
    port = env_int(env, "MASTER_PORT", None, least=1, most=65535)
    if not env.get("MASTER_ADDR", "").strip():
        raise UserError("the environment variable MASTER_ADDR is not set, but WORLD_SIZE is (torchrun sets both)")
    device = "cuda" if on != "cpu" and torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    timeout = timedelta(seconds=timeout_s)
    try:
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's own store (its agent hosts it) outlives a restart of the group, with the
            # last attempt's gloo addresses still in it: each attempt gets its own key prefix,
            # or a restarted worker may dial a dead one (measured: 2 restarts in 5 hung).
            store = dist.TCPStore(env["MASTER_ADDR"], port, size, False, timeout=timeout)
            store = dist.PrefixStore(f"qkv/attempt_{env.get(RESTART_COUNT, '0')}", store)
            dist.init_process_group(BACKENDS[device], store=store, rank=rank, world_size=size, timeout=timeout)
        else:
            dist.init_process_group(BACKENDS[device], timeout=timeout)
    except (RuntimeError, ValueError) as e:  # DistNetworkError is a RuntimeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot join the process group at {where} ({BACKENDS[device]}): {first}") from None
    return world()


def finish() -> None:
    """Leave the process group, if one was joined.

    Garbage is collected first: a DDP or FSDP wrapper left in a reference cycle still holds the
    group, whose gloo threads would then outlive ``destroy_process_group`` into interpreter
    teardown, where a thread touching Python aborts the process (PyTorch PR 179291)."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


def restarted(environ: dict[str, str] | None = None) -> bool:
    """Whether torchrun restarted this worker's group (``--max-restarts``) after a failure."""
    env = os.environ if environ is None else environ
    return env_int(env, RESTART_COUNT, 0) > 0


def share(n: int) -> tuple[list[int], bool]:
    """The positions (of ``0..n-1``, a batch's rows) this worker trains on: every ``size``-th
    from its rank. When the batch has fewer rows than there are workers, a worker with no row
    gets row 0 and ``False``: it computes that row's loss but counts it as zero tokens, so every
    worker still runs forward and backward and the step is the whole batch's."""
    w = world()
    mine = list(range(w.rank, n, w.size))
    return (mine, True) if mine else ([0], False)


def all_sum(values: Sequence[float]) -> list[float]:
    """Element-wise sums over the workers (float64; the values themselves with one process)."""
    if world().size == 1:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_max(values: Sequence[float]) -> list[float]:
    """Element-wise maxima over the workers: what they must agree on, e.g. whether any was asked
    to stop, or the elapsed time a time cap is measured by."""
    if world().size == 1:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_gather(value: T) -> list[T]:
    """Every worker's ``value`` (picklable, small: RNG states, a shard's hypotheses), by rank."""
    w = world()
    if w.size == 1:
        return [value]
    out: list = [None] * w.size
    dist.all_gather_object(out, value)
    return out


def sharded_map(fn: Callable[[Sequence[T]], list[R]], items: Sequence[T]) -> list[R]:
    """``fn(items)``, each worker computing every ``size``-th item and all receiving all results
    in order (validation decoding split across workers, every worker scoring the same list)."""
    w = world()
    if w.size == 1:
        return fn(items)
    parts = all_gather(fn(items[w.rank :: w.size]))
    out: list = [None] * len(items)
    for rank, part in enumerate(parts):
        out[rank :: w.size] = part
    return out


def barrier() -> None:
    """Wait for every worker (nothing with one process)."""
    if world().size > 1:
        dist.barrier()


def launch(argv: Sequence[str], *, nproc: int, max_restarts: int = 0, on: str = "auto") -> int:
    """Run ``python -m qkv ARGV`` on ``nproc`` local workers through torchrun's own launcher
    (``torch.distributed.run``, standalone rendezvous on a free local port); returns the exit
    status of the first worker that failed, else 0."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # One GPU, or at least one core, per worker: more would only queue for the same hardware.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit, what = (torch.cuda.device_count(), "GPUs") if device(on).type == "cuda" else (cores, "CPU cores")
    if nproc > limit:
        raise UserError(f"--nproc {nproc}: this machine has {limit} {what}, one per worker (at most --nproc {limit})")
    # Each worker's threads: the cores shared out (torchrun would set 1 and warn about it).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    args = parse_args(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            "--module",
            "qkv",
            *argv,
        ]
    )
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        print(f"qkv: worker {rank} of {nproc} ended with exit status {failure.exitcode}", file=sys.stderr)
        return code
    return 0


class Forward(nn.Module):
    """What DDP or FSDP wraps: the model, and a forward that runs one batch's loss (a closure
    over the model) inside the wrapper's forward, so that every task's loss, however many of
    the model's methods it calls (a speech model's encode and decode), is one wrapped forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Callable[[], tuple[Tensor, float]]) -> tuple[Tensor, float]:
        return batch()


def wrap(model: nn.Module, parallel: str = "ddp") -> nn.Module:
    """What a training step calls with its batch closure: ``model`` itself with one process;
    with several, DDP around :class:`Forward` (``"ddp"``: every worker holds the whole model,
    gradients averaged) or FSDP2 (``"fsdp"``: parameters, gradients and optimizer moments
    sharded, each encoder/decoder block its own unit, gathered only while it runs)."""
    if parallel not in PARALLEL:
        raise ValueError(f"parallel must be one of {PARALLEL}, got {parallel!r}")
    w = world()
    if w.size == 1:
        return model
    runner = Forward(model)
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        where = next(model.parameters()).device
        # Unused parameters (a BERT pooler in masked-LM training) must not stall the all-reduce.
        return DistributedDataParallel(
            runner, device_ids=[where.index] if where.type == "cuda" else None, find_unused_parameters=True
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # The mesh on the model's own device: without one FSDP picks the GPU whenever there is one,
    # and would move a model that train.device keeps on the CPU.
    mesh = init_device_mesh(next(model.parameters()).device.type, (w.size,))
    for module in model.modules():
        if isinstance(module, (EncoderBlock, DecoderBlock)):
            fully_shard(module, mesh=mesh)
    fully_shard(runner, mesh=mesh)
    return runner


def _dtensor() -> type | None:
    """The DTensor class if FSDP could have made one (its module is imported), else None: checking
    costs nothing on one process (importing it takes a while: every checkpoint would pay)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are FSDP shards (DTensors)."""
    dtensor = _dtensor()
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


def full_tensor(t: Tensor) -> Tensor:
    """A whole tensor from an FSDP shard (collective: every worker must call it), else ``t``."""
    dtensor = _dtensor()
    return t.full_tensor() if dtensor is not None and isinstance(t, dtensor) else t


def full_state(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with sharded tensors gathered whole (collective under FSDP)."""
    return {name: full_tensor(t) for name, t in model.state_dict().items()}


def plain_copy(model: nn.Module) -> nn.Module:
    """``model`` itself, or for a sharded one an unsharded copy of the same class and config
    with its whole weights (collective: every worker calls it; rank 0 saves the copy)."""
    if not is_sharded(model):
        return model
    copy = type(model)(model.config)
    copy.load_state_dict(full_state(model))
    return copy.train(model.training)


def shard_like(whole: Tensor, like: Tensor) -> Tensor:
    """``whole`` cut as ``like`` is (this worker's FSDP shard of it), or ``whole`` itself (also
    when it is a shard already)."""
    dtensor = _dtensor()
    if dtensor is None or not isinstance(like, dtensor) or isinstance(whole, dtensor):
        return whole
    from torch.distributed.tensor import distribute_tensor

    # Every worker read the same file: each cuts its own piece, nothing is sent.
    return distribute_tensor(whole.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)


def load_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """``model.load_state_dict(state)`` for whole tensors, also when ``model`` is sharded."""
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    own = model.state_dict()
    if set(own) != set(state):
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise RuntimeError(f"state does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, t in own.items():
            piece = shard_like(state[name], t)
            if isinstance(t, DTensor):
                t.to_local().copy_(piece.to_local())
            else:
                t.copy_(piece)
