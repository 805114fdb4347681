"""Continuous batching: a decoding that inputs join and leave between its steps.

:func:`~qkv.decoding.stream` decodes a batch fixed when it starts: an input that arrives a step
later waits for the whole batch to end, and a row that ended is fed until the last one does.
Here (Orca's iteration-level scheduling: Yu et al., 2022, "Orca", section 3.1) a
:class:`Continuous` decoding holds groups of rows (one caller's inputs each, a request's):

  * :meth:`Continuous.join` reads a group's prompts (their own ``start``, a prefill of the
    group alone) and adds their rows to the running state (the decoder's ``regroup``: a
    decoder-only model left-pads the caches, each row keeping its own positions and key mask);
  * :meth:`Continuous.step` picks every group's next tokens (each group with its own
    ``choose``, so its draws depend on its rows only), then drops the groups that have ended
    (END or the cap in every row, as ``stream`` ends a row) or left (:meth:`Continuous.leave`),
    and runs one forward pass for the rows that go on.

A group's tokens are what ``stream`` yields for its inputs decoded alone (:data:`DONE` for a row
that ended while the group's other rows go on), up to the rounding of a batch's matrix products.
Model-agnostic: it asks the decoder for ``start``, ``step``, ``reserve`` and ``regroup`` only.

What is not here: who joins when and how the tokens become text (the server's
``serve/continuous.py``), fixed batches and beam search (``search.py``).

Shapes use the legend of ``attention.py``: N rows of every group, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from qkv.decoding.decoders import DecodingModel, Inputs, Regrouping, decoder_for
from qkv.decoding.planning import MaxNew, check_inputs
from qkv.decoding.search import DONE

Choose = Callable[[Tensor], Tensor]  # logits (n, V) -> tokens (n,), for one group's n rows


@dataclass(eq=False)
class Group:
    """One caller's rows in a :class:`Continuous` decoding.

    Attributes:
        caps: each row's new-token cap (``check_inputs``).
        choose: picks the group's tokens: logits (n, V) -> (n,).
        chosen: tokens picked so far per row.
        finished: (n,) True where a row has ended (END, or its cap).
        left: the caller left; the group is dropped at the next step.
    """

    caps: Tensor
    choose: Choose
    chosen: int = 0
    finished: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    left: bool = False

    @property
    def rows(self) -> int:
        return len(self.caps)

    @property
    def ended(self) -> bool:
        return self.left or bool(self.finished.all())

    def room(self) -> int:
        """The most forward passes the group may still need."""
        return max(0, int(self.caps.max()) - self.chosen)


class Continuous:
    """A running decoding of groups that join and leave between steps (see the module).

    Used from one thread. ``groups`` are the groups decoding, in row order; ``rows`` how many
    rows they hold.
    """

    def __init__(self, model: DecodingModel | Regrouping) -> None:
        decoder = decoder_for(model)
        if not hasattr(decoder, "regroup"):
            raise ValueError(f"{type(decoder).__name__} cannot regroup rows, which continuous batching needs")
        self.decoder: Regrouping = decoder
        self.groups: list[Group] = []
        self.state: object | None = None
        self.logits: Tensor | None = None  # (N, V): every row's next-token logits

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    @torch.no_grad()
    def join(self, inputs: Inputs, *, max_new_tokens: MaxNew, choose: Choose) -> Group:
        """Read ``inputs`` (a prefill of them alone) and add their rows; returns their group,
        whose first tokens the next :meth:`step` picks. A ValueError for an input that does
        not fit the window (``check_inputs``), before anything is read."""
        caps = check_inputs(self.decoder, inputs, max_new_tokens=max_new_tokens)
        logits, state = self.decoder.start(inputs)  # (n, V)
        group = Group(torch.tensor(caps), choose, finished=torch.zeros(len(inputs), dtype=torch.bool))
        parts = [] if self.state is None else [(self.state, None)]
        self._regrouped([*parts, (state, None)], [*self.groups, group], [*([self.logits] if parts else []), logits])
        return group

    def leave(self, group: Group) -> None:
        """``group`` is dropped at the next step (its caller stopped reading)."""
        group.left = True

    @torch.no_grad()
    def step(self) -> list[tuple[Group, Tensor]]:
        """Every group's next tokens (n,), :data:`DONE` for its rows that had ended; then the
        groups that have all ended leave and the others' rows take one forward pass."""
        if self.logits is None:
            return []
        picked, fed, start = [], {}, 0
        for group in self.groups:
            logits = self.logits[start : start + group.rows]  # (n, V)
            start += group.rows
            if group.left:
                continue
            tokens = group.choose(logits)  # (n,)
            picked.append((group, tokens.masked_fill(group.finished.to(tokens.device), DONE)))
            fed[group] = tokens  # a row that ended is fed too, its output unread (as in stream)
            group.chosen += 1
            group.finished = group.finished | (group.chosen >= group.caps)
            if self.decoder.eos_id is not None:
                group.finished = group.finished | (tokens.cpu() == self.decoder.eos_id)
        self._advance(fed)
        return picked

    def _advance(self, fed: dict[Group, Tensor]) -> None:
        """Drop the groups that ended, then feed the others' tokens (one forward pass)."""
        going = [g for g in self.groups if not g.ended]
        if len(going) < len(self.groups):
            if not going:
                self.groups, self.state, self.logits = [], None, None
                return
            starts = [0, *torch.tensor([g.rows for g in self.groups]).cumsum(0).tolist()]
            kept = [r for g, a in zip(self.groups, starts, strict=False) if not g.ended for r in range(a, a + g.rows)]
            rows = torch.tensor(kept, device=self.logits.device)  # (N',)
            self._regrouped([(self.state, rows)], going, [self.logits.index_select(0, rows)])
        tokens = torch.cat([fed[g] for g in going])  # (N,)
        self.logits, self.state = self.decoder.step(self.state, tokens)  # (N, V)

    def _regrouped(self, parts: list, groups: list[Group], logits: list[Tensor]) -> None:
        """The state of ``parts`` as one, with room written in place for every step left."""
        state = self.decoder.regroup(parts)
        self.state = self.decoder.reserve(state, max(g.room() for g in groups) + 1)
        self.groups, self.logits = groups, torch.cat(logits)  # (N, V)
