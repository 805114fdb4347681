"""How much text a text-to-speech model can say in a given time, and cutting a longer text into
pieces that fit: the check that refuses or splits before the model reads a word.

A Transformer-TTS model writes frames until its stop token or a cap (``--max-seconds``, or its
window of ``max_len`` steps): a text that needs longer than the cap is cut off mid-word, after
the model has read all of it (attention over every symbol at each step). No one speaks faster
than :data:`FASTEST` characters a second (fast English speech is about 250 words a minute,
some 20 characters a second with the spaces), so a text longer than ``FASTEST × cap``
characters cannot end in time: it is split at sentence ends, else at commas, else between
words (:func:`split_text`), and a single word too long for the cap is refused (:class:`TooLong`).

What is here: :func:`most_characters`, :func:`split_text`. What is not here: speaking the
pieces and joining their audio (``bundle.speeches``), text normalisation (``tasks/tts.py``).
"""

from __future__ import annotations

import math
import re

FASTEST = 30.0  # characters a second: faster than anyone speaks (see above)

# Where a text may be cut, best first: after a sentence's end, after a comma, between words.
_BREAKS = (re.compile(r"(?<=[.!?…;:])\s+"), re.compile(r"(?<=,)\s+"), re.compile(r"\s+"))


class TooLong(ValueError):
    """A word longer than the characters allowed: no cut between words makes it fit."""

    def __init__(self, word: str, limit: int) -> None:
        shown = repr(word) if len(word) <= 24 else f"{word[:20]!r}..."
        super().__init__(f"a word of {len(word):,} characters ({shown}) is longer than {limit:,}")
        self.word = word
        self.limit = limit


def most_characters(seconds: float) -> int:
    """The most characters that can be said in ``seconds`` (at :data:`FASTEST`), at least 1."""
    return max(1, math.floor(seconds * FASTEST))


def split_text(text: str, limit: int) -> list[str]:
    """``text`` (stripped) in pieces of at most ``limit`` characters, in order: cut at sentence
    ends where that is enough, else also at commas, else also between words, and consecutive
    pieces joined again (by one space) while they fit. A text that fits is one piece; a word
    longer than ``limit`` raises :class:`TooLong`."""
    return _split(text.strip(), limit, 0)


def _split(text: str, limit: int, level: int) -> list[str]:
    if len(text) <= limit:
        return [text]
    if level == len(_BREAKS):
        raise TooLong(text, limit)
    pieces: list[str] = []
    for part in filter(None, _BREAKS[level].split(text)):
        for piece in _split(part, limit, level + 1):
            if pieces and len(pieces[-1]) + 1 + len(piece) <= limit:
                pieces[-1] = f"{pieces[-1]} {piece}"
            else:
                pieces.append(piece)
    return pieces
