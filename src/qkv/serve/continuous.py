"""Continuous batching of every language model's generation the server answers (``/v1/generate``,
``/v1/chat``, ``/v1/chat/completions``, ``/v1/completions``; the requests it cannot hold, a beam,
constraints or a slide past the window, the routes decode alone): a request joins a running
decoding at its next step, and leaves it (its stream closed) as soon as its own answers end.

What is here: :class:`Ticket` (one request's asks, their readers and the pieces of text each
step adds, which the route reads from a queue) and :class:`Scheduler`, one asyncio task that
runs the decodings (``qkv.decoding.Continuous``), one per key (a model; a seeded request has a
decoding of its own, so its draws are its alone), a step of each in turn, each step on the
batcher's model thread (between the batcher's other jobs). Requests that arrive while nothing
decodes wait ``wait_s`` for companions, as the batcher's jobs do; one that arrives while its
model decodes joins at the next step, within ``max_tokens`` (prompt and new tokens of every row
of a decoding; one that does not fit waits for rows to leave). Each request picks its own
tokens (its own generator and repetition penalty: ``Picking``), so requests of different
sampling options share forward passes.

A step's pieces are handed over with each row's finish reason as it was at that step, so a
route never tells an end before the text that comes before it.

What is not here: HTTP and the routes' shapes (``routes/``), waiting for a ticket's answers
(``answering.py``), how tokens become text (``completions.Reader``), the step loop
(``qkv.decoding.continuous``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from qkv.decoding import Continuous, Group
from qkv.serve.batching import Batcher
from qkv.serve.completions import Ask, Picking, Reader
from qkv.serve.models import Served

Step = list[tuple[str, str | None]]  # per row: the piece of text it adds, and its finish reason then


@dataclass(eq=False)
class Ticket:
    """One request's rows (see the module): ``pieces`` gets a :data:`Step` per decoding step,
    then None once every row has ended, or the exception that ended them. ``gone`` is set by
    the route when its caller stops reading (the rows leave at the next step)."""

    served: Served
    asks: list[Ask]
    picking: Picking
    key: Hashable
    readers: list[Reader] = field(init=False)
    pieces: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.monotonic)
    gone: bool = False
    group: Group | None = None

    def __post_init__(self) -> None:
        eos = self.served.model.config.eos_id
        self.readers = [Reader(self.served.vocab.target, a, eos) for a in self.asks]

    @property
    def cost(self) -> int:
        return sum(len(a.prompt) + a.max_new_tokens for a in self.asks)

    def chooser(self) -> Callable[[Tensor], Tensor]:
        """The rows' token picker; a row whose text has ended (a stop string) writes END, so
        the decoding ends it. Shapes: (n, V) -> (n,)."""
        served = self.served
        pick = self.picking.picker(served.bundle.device, [a.prompt for a in self.asks], served.model.config.vocab_size)
        eos = served.model.config.eos_id

        def choose(logits: Tensor) -> Tensor:
            chosen = pick(logits)  # (n,)
            if eos is None:
                return chosen
            ended = torch.tensor([r.finish_reason is not None for r in self.readers], device=chosen.device)
            return chosen.masked_fill(ended, eos)

        return choose

    def read(self, tokens: list[int], ended: bool) -> Step:
        """The readers fed one step's tokens (and ended at the length where the rows ended)."""
        pieces = [r.feed(t) for r, t in zip(self.readers, tokens, strict=True)]
        if ended:
            pieces = [p + r.end("length") for p, r in zip(pieces, self.readers, strict=True)]
        return [(p, r.finish_reason) for p, r in zip(pieces, self.readers, strict=True)]


@dataclass
class Running:
    """One key's decoding and the tickets in it."""

    decoding: Continuous
    tickets: list[Ticket]

    @property
    def cost(self) -> int:
        return sum(t.cost for t in self.tickets)


class Scheduler:
    """Runs the generation routes' decodings (see the module). ``on_join(requests, rows)`` is told
    the size of a decoding each time requests join it."""

    def __init__(
        self,
        batcher: Batcher,
        *,
        wait_s: float,
        max_tokens: int,
        on_join: Callable[[int, int], None] | None = None,
    ) -> None:
        self.batcher, self.wait_s, self.max_tokens, self.on_join = batcher, wait_s, max_tokens, on_join
        self.waiting: list[Ticket] = []
        self.running: dict[Hashable, Running] = {}  # read and written on the model thread only
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def submit(self, ticket: Ticket) -> None:
        """Queue ``ticket``; its pieces come in ``ticket.pieces``."""
        if ticket.key is None:
            ticket.key = object()  # a decoding of its own
        if self._task is None:
            self._arrived = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="qkv-continuous")
        self.waiting.append(ticket)
        assert self._arrived is not None
        self._arrived.set()

    async def stop(self) -> None:
        """Stop decoding; every request still held gets a CancelledError."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for ticket in [*self.waiting, *(t for r in self.running.values() for t in r.tickets)]:
            ticket.pieces.put_nowait(asyncio.CancelledError())
        self.waiting.clear()

    async def _loop(self) -> None:
        assert self._arrived is not None
        while True:
            if not self.running:
                await self._gathered()
            admitted = self._admitted()
            try:
                handed = await self.batcher.call(self._tick, admitted)
            except Exception as e:  # a bug here must not leave every request waiting for its timeout
                held = [*admitted, *(t for r in self.running.values() for t in r.tickets)]
                self.running.clear()
                handed = [(t, e) for t in held]
            for ticket, item in handed:
                ticket.pieces.put_nowait(item)

    async def _gathered(self) -> None:
        """Wait for a request, then ``wait_s`` after it arrived for its companions."""
        assert self._arrived is not None
        while not self.waiting:
            self._arrived.clear()
            await self._arrived.wait()
        left = self.waiting[0].arrived + self.wait_s - time.monotonic()
        if left > 0:
            await asyncio.sleep(left)

    def _admitted(self) -> list[Ticket]:
        """The waiting tickets that join now: each within its key's budget (one at least, if
        its key decodes nothing)."""
        costs = {key: r.cost for key, r in self.running.items()}
        admitted = []
        for ticket in list(self.waiting):
            spent = costs.get(ticket.key)
            if ticket.gone or spent is None or spent + ticket.cost <= self.max_tokens:
                self.waiting.remove(ticket)
                admitted.append(ticket)
                costs[ticket.key] = (spent or 0) + ticket.cost
        return [t for t in admitted if not t.gone]

    # ------------------------------------------------------------------ on the model thread

    def _tick(self, admitted: list[Ticket]) -> list[tuple[Ticket, object]]:
        """Join ``admitted``, then one step of every decoding: what each ticket is handed."""
        handed: list[tuple[Ticket, object]] = []
        joined: set[Hashable] = set()
        for ticket in admitted:
            handed += self._join(ticket)
            joined.add(ticket.key)
        for key in list(self.running):
            handed += self._step(key)
        if self.on_join is not None:
            for key in joined & self.running.keys():
                running = self.running[key]
                self.on_join(len(running.tickets), running.decoding.rows)
        return handed

    def _join(self, ticket: Ticket) -> list[tuple[Ticket, object]]:
        key = ticket.key
        running = self.running.get(key) or Running(Continuous(ticket.served.model), [])
        prompts, caps = [list(a.prompt) for a in ticket.asks], [a.max_new_tokens for a in ticket.asks]
        try:
            ticket.group = running.decoding.join(prompts, max_new_tokens=caps, choose=ticket.chooser())
        except Exception as e:  # the request's own error (a bug is still a 500 there)
            return [(ticket, e)]
        running.tickets.append(ticket)
        self.running[key] = running
        return []

    def _step(self, key: Hashable) -> list[tuple[Ticket, object]]:
        running = self.running[key]
        for ticket in running.tickets:
            if ticket.gone or all(r.finish_reason is not None for r in ticket.readers):
                running.decoding.leave(ticket.group)
        try:
            stepped = dict(running.decoding.step())
        except Exception as e:  # every request of the decoding gets the error
            del self.running[key]
            return [(t, e) for t in running.tickets]
        handed: list[tuple[Ticket, object]] = []
        for ticket in running.tickets:
            tokens = stepped.get(ticket.group)
            ended = ticket.group.ended
            if tokens is not None:
                handed.append((ticket, ticket.read(tokens.tolist(), ended)))
            if ended:
                handed.append((ticket, None))
        running.tickets = [t for t in running.tickets if not t.group.ended]
        if not running.tickets:
            del self.running[key]
        return handed
