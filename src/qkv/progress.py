"""Progress that people and log files can both read: a bar on a terminal, sparse plain lines elsewhere.

On a terminal, :func:`progress` returns a ``tqdm`` bar, redrawn in place. Off a terminal (a log
file, CI, ``nohup``) a redrawn bar leaves one carriage-return frame per update (a 76-second
training run once left a 700-line, 200 KB log), so there it returns :class:`Lines`: one plain
line every ``QKV_PROGRESS_SECONDS`` seconds (default 30) or every ``QKV_PROGRESS_PERCENT``
percent of the work (default 10), whichever comes first, and a last line when the work ends.
``QKV_PROGRESS=lines`` or ``bar`` overrides the choice.

What is not here: the one-line summary each command prints at the end (the commands' own).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from tqdm import tqdm

from qkv.errors import UserError

SECONDS = "QKV_PROGRESS_SECONDS"
PERCENT = "QKV_PROGRESS_PERCENT"
MODE = "QKV_PROGRESS"


def _setting(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or math.isinf(value):
        raise UserError(f"{name}={raw!r}: expected a positive number")
    return value


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Lines:
    """A progress report in plain lines, for logs: the part of tqdm's interface qkv uses
    (``update``, ``set_postfix``, ``write``, ``close``).

    A line is printed when ``every_seconds`` have passed since the last one, or when the work
    crosses another ``every_percent`` of ``total``; :meth:`close` prints the last state unless
    it was just printed. Each line: what, done/total, percent, elapsed, rate, time left, and the
    postfix (loss, learning rate, ...).
    """

    def __init__(
        self,
        total: int | None,
        *,
        desc: str,
        unit: str,
        initial: int = 0,
        every_seconds: float = 30.0,
        every_percent: float = 10.0,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.n = self.start_n = initial
        self.every_seconds, self.every_percent = every_seconds, every_percent
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.start = self.last_time = clock()
        self.last_step = self._step(initial)
        self.postfix = ""
        self.printed_n: int | None = None

    def _step(self, n: int) -> int:
        """Which ``every_percent`` slice of the total ``n`` is in (0 without a total)."""
        if not self.total:
            return 0
        return int(100 * n / self.total // self.every_percent)

    def update(self, n: int = 1) -> None:
        self.n += n
        now, step = self.clock(), self._step(self.n)
        if now - self.last_time >= self.every_seconds or step > self.last_step:
            self._print(now)
            self.last_step = step

    def set_postfix(self, ordered_dict: Mapping[str, object] | None = None, **values: object) -> None:
        items = {**(ordered_dict or {}), **values}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def write(self, message: str, file: TextIO | None = None) -> None:
        print(message, file=file if file is not None else self.stream, flush=True)

    def close(self) -> None:
        if self.printed_n != self.n:
            self._print(self.clock())

    def line(self, now: float) -> str:
        elapsed = now - self.start
        done = self.n - self.start_n
        rate = done / elapsed if elapsed > 0 else 0.0
        where = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        units = self.unit if self.unit.endswith("s") else f"{self.unit}s"  # "600 s" of audio, not "600 ss"
        parts = [f"{self.desc}: {where} {units}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        parts.append(f"{_duration(elapsed)} elapsed")
        parts.append(f"{rate:.3g} {self.unit}/s")
        if self.total and rate > 0 and self.n < self.total:
            parts.append(f"{_duration((self.total - self.n) / rate)} left")
        text = ", ".join(parts)
        return f"{text}; {self.postfix}" if self.postfix else text

    def _print(self, now: float) -> None:
        print(self.line(now), file=self.stream, flush=True)
        self.last_time, self.printed_n = now, self.n


def progress(
    total: int | None,
    *,
    desc: str,
    unit: str,
    initial: int = 0,
    disable: bool = False,
    stream: TextIO | None = None,
) -> tqdm | Lines:
    """A progress report on ``stream`` (stderr): a tqdm bar on a terminal, :class:`Lines`
    elsewhere (see the module docstring); a disabled tqdm (prints nothing) with ``disable``."""
    stream = stream if stream is not None else sys.stderr
    mode = os.environ.get(MODE, "").strip().lower()
    if mode not in ("", "bar", "lines"):
        raise UserError(f"{MODE}={mode!r}: expected bar or lines")
    every_seconds, every_percent = _setting(SECONDS, 30.0), _setting(PERCENT, 10.0)
    if disable:
        return tqdm(total=total, disable=True)
    terminal = hasattr(stream, "isatty") and stream.isatty()
    if mode == "bar" or (terminal and mode != "lines"):
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=stream, dynamic_ncols=True)
    return Lines(
        total,
        desc=desc,
        unit=unit,
        initial=initial,
        every_seconds=every_seconds,
        every_percent=every_percent,
        stream=stream,
    )
