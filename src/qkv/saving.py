"""The save policy of a training run: when :func:`qkv.training.fit` saves what resuming needs.

What is here: :class:`Saves`, which calls a :class:`~qkv.training.Checkpointing`'s ``save`` before
a fresh run's first step and at its end (``checkpoint.always``), after every validation, every
``checkpoint.every`` steps and when a stop is asked for, and remembers where each save of this
session went (a non-finite step's error names the last).

What is not here: what a save writes and how a run is loaded (``runs.py``, ``checkpoint.py``),
the training loop and the trainer whose state is saved (``training.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # training.py imports this module: these names are for type checking only
    from qkv.training import Checkpointing, FitResult, Trainer


class Saves:
    """What :func:`~qkv.training.fit` saves for resuming (``checkpoint``; nothing without one):
    before a fresh run's first step and at the end (``checkpoint.always``), after every validation,
    every ``checkpoint.every`` steps and when a stop is asked for (:class:`~qkv.stopping.StopRequest`
    calls :meth:`save`); where each save of this session went (:attr:`last_saved`)."""

    def __init__(self, checkpoint: Checkpointing | None, trainer: Trainer, result: FitResult) -> None:
        self.checkpoint, self.trainer, self.result = checkpoint, trainer, result
        self.saved: list[tuple[str, tuple]] = []  # where each save went, and at which point of the run

    @property
    def last_saved(self) -> str | None:
        """Where the last save of this session went (None: none yet)."""
        return self.saved[-1][0] if self.saved else None

    def save(self) -> str | None:
        if self.checkpoint is None:
            return None
        r = self.result
        self.saved.append((self.checkpoint.save(self.trainer, r), (r.steps, r.epoch, r.stopped_by)))
        return self.saved[-1][0]

    def first(self) -> None:
        """A fresh run's checkpoint, before its first step."""
        if self.checkpoint is not None and self.checkpoint.always:
            self.save()

    def after_validation(self, stop_reason: Callable[[], str | None]) -> None:
        if self.checkpoint is not None:
            self.result.stopped_by = stop_reason()  # in the checkpoint: a resumed run knows it had ended
            self.save()

    def every_n_steps(self, stop_reason: Callable[[], str | None]) -> None:
        c = self.checkpoint
        if c is not None and c.every and self.result.steps % c.every == 0:
            if stop_reason() is None:  # the run ends here: its end saves
                self.save()

    def last(self) -> None:
        """The end's checkpoint, unless the last save was of this very point."""
        r = self.result
        if (
            self.checkpoint is not None
            and self.checkpoint.always
            and (not self.saved or self.saved[-1][1] != (r.steps, r.epoch, r.stopped_by))
        ):
            self.save()
