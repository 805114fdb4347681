"""Why a training run stops early: a signal, or a step that is not finite.

What is here: :class:`StopRequest` (SIGTERM and Ctrl-C stop at a step boundary after a save;
on several workers, all at the same step), :class:`NonFinite` (a step whose loss or gradient is
NaN or infinite), :func:`first_nonfinite_module` (where such a step first went wrong) and
:data:`ON_NONFINITE` (what a recipe's ``train.on_nonfinite`` may ask for).
What is not here: the training loop that checks them (:func:`~qkv.training.fit`), what it saves
(``saving.py``).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from qkv import distributed
from qkv.errors import Stopped, UserError

ON_NONFINITE = ("stop", "skip")


class NonFinite(UserError):
    """A step whose loss or gradient is NaN or infinite, with the step and the first module
    (in the order the forward pass runs them) whose output was not finite."""

    def __init__(self, step: int, what: str, module: str | None) -> None:
        where = f"; the first non-finite output: {module}" if module else ""
        super().__init__(
            f"step {step + 1}: the {what}{where}; lower train.lr, or set train.on_nonfinite=skip to skip such steps"
        )
        self.step, self.module = step, module


@torch.no_grad()
def first_nonfinite_module(
    model: nn.Module, batches: Sequence[Callable[[], tuple[Tensor, int]]], *, run: Callable | None = None
) -> str | None:
    """The name of the first submodule whose output holds a NaN or an infinity when the batches
    run forward again (forward hooks, gradients off), or None when only the loss was not finite.
    ``run``: what calls a batch closure (:meth:`Trainer.forward`: the wrapper on several workers)."""
    found: list[str] = []

    def hook(name: str) -> Callable:
        def check(module: nn.Module, inputs: object, output: object) -> None:
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            if not found and any(
                isinstance(o, Tensor) and o.is_floating_point() and not o.isfinite().all() for o in outputs
            ):
                found.append(name)

        return check

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules() if name]
    try:
        for batch in batches:
            run(batch) if run is not None else batch()
            if found:
                break
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}


class StopRequest:
    """SIGTERM and SIGINT (Ctrl-C) while training. The first asks the loop to stop at the next
    step boundary, after it saves what resuming needs (:meth:`check`); a second one stops at
    once (a KeyboardInterrupt: every write is atomic, so nothing is left half-written). Signal
    handlers can only be set in the main thread; elsewhere this does nothing."""

    def __init__(self) -> None:
        self.signal: int | None = None  # the signal this process received
        self.agreed: int | None = None  # on several workers: the one any of them received (agree)
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNAL_NAMES:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum
        print(
            f"\n{SIGNAL_NAMES[signum]}: stopping after this step to save a checkpoint (again: stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def agree(self, seconds: float) -> float:
        """On several workers (a collective every one calls at the same step): whether any was
        asked to stop, and the longest elapsed time, so that all stop at the same step; that
        time is returned (``seconds`` itself with one process)."""
        if distributed.world().size == 1:
            return seconds
        seconds, signum = distributed.all_max([seconds, float(self.signal or 0)])
        self.agreed = int(signum) or None
        return seconds

    def check(self, step: int, save: Callable[[], str | None]) -> None:
        """Raise :class:`~qkv.errors.Stopped` (after ``save()``) if a stop was asked for (on
        several workers: agreed by the last :meth:`agree`, so that all of them stop here)."""
        signum = self.signal if distributed.world().size == 1 else self.agreed
        if signum is None:
            return
        saved = save()
        where = f"; checkpoint saved in {saved}" if saved else ""
        raise Stopped(
            f"stopped by {SIGNAL_NAMES[signum]} after step {step}{where}", exit_code=128 + signum, saved=saved
        )
