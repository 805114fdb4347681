"""Whisper's decoding rules as scorers (``scorers.py``'s protocol), so that every search applies them.

openai/whisper's ``decoding.py`` filters the logits of every step (its ``LogitFilter``s), and
Hugging Face's ``generate`` does the same with logits processors; here each is a full scorer of
weight 1 whose scores are 0 or −∞:

  * :class:`SuppressTokens`: tokens never written (the checkpoint's ``suppress_tokens``: most
    punctuation-only and special tokens) and tokens never written first (``begin_suppress_tokens``:
    a blank and END, Whisper's ``SuppressBlank``);
  * :class:`TimestampRules`: Whisper's ``ApplyTimestampRules`` (Radford et al., 2022, section
    2.3; HF's ``WhisperTimeStampLogitsProcessor``): <|notimestamps|> never; the first token a
    timestamp, at most ``max_initial`` steps of 20 ms in; timestamps in pairs (a segment's end
    and the next one's start) except right before END; after one timestamp of a pair no text
    token; timestamps never decreasing, and a new segment never of zero length. It also
    *revises* the summed scores of a step (``revise``, which the searches call after the full
    scorers): where the probability of all timestamps together beats that of every text token,
    only timestamps stay.

:func:`whisper_scorers` builds both from the token ids a checkpoint gives. What is not here: the
start tokens and the settings (``hf/whisper.py``), long-form transcription (``longform.py``),
the searches (``search.py``).

Shapes use the legend of ``attention.py``: N hypotheses, V vocabulary, C candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.decoding.decoders import Decoder
from qkv.decoding.scorers import Scorer

NEG = float("-inf")


def _banned(tokens: Sequence[int], vocab: int, device) -> Tensor:
    """A (V,) row of 0 with −∞ at ``tokens``."""
    row = torch.zeros(vocab, device=device)  # (V,)
    row[list(tokens)] = NEG
    return row


def _picked(rows: Tensor, candidates: Tensor | None) -> Tensor:
    """Scores of every token (N, V), or of the candidates (N, C) only."""
    return rows if candidates is None else rows.gather(1, candidates)


@dataclass
class SuppressTokens:
    """``always`` are never written; ``first`` are not written as the first new token (after the
    forced start tokens and any previous-text prompt). State: the two rows and whether the next
    step is the first."""

    always: Sequence[int]
    first: Sequence[int] = ()
    weight: float = 1.0
    partial: bool = False

    def start(self, decoder: Decoder, state: object, rows: Tensor, steps: int) -> tuple[Tensor, Tensor, bool]:
        v = decoder.vocab_size
        if any(not 0 <= t < v for t in [*self.always, *self.first]):
            raise ValueError(f"suppressed tokens must be ids in [0, {v})")
        always = _banned(self.always, v, rows.device)  # (V,)
        at_first = always + _banned(self.first, v, rows.device)  # (V,)
        return always, at_first, True

    def score(self, state: tuple, candidates: Tensor | None) -> tuple[Tensor, tuple]:
        always, at_first, first = state
        row = (at_first if first else always)[None]  # (1, V)
        if candidates is not None:
            row = row.expand(candidates.shape[0], -1).gather(1, candidates)  # (N, C)
        return row, state

    def advance(self, scored: tuple, rows: Tensor, tokens: Tensor) -> tuple:
        always, at_first, _ = scored
        return always, at_first, False

    def bytes_needed(self, decoder: Decoder, *, inputs: int, beam: int, source: int, steps: int) -> int:
        return 2 * 4 * decoder.vocab_size


@dataclass(frozen=True)
class _Stamps:
    """Each hypothesis' last two new tokens (−1: none yet), its last timestamp (−1: none) and the
    new tokens so far (the same for every row of a step)."""

    last: Tensor  # (N,)
    before_last: Tensor  # (N,)
    stamp: Tensor  # (N,)
    length: int
    vocab: int  # V


@dataclass
class TimestampRules:
    """openai/whisper's ``ApplyTimestampRules`` (see the module docstring). ``timestamp_begin``:
    the id of <|0.00|> (every id from it up is a timestamp, 20 ms apart); ``eos``: END (the text
    tokens are the ids below it); ``no_timestamps``: <|notimestamps|>; ``max_initial``: the
    latest first timestamp, in 20 ms steps (None: any)."""

    timestamp_begin: int
    eos: int
    no_timestamps: int
    max_initial: int | None = None
    weight: float = 1.0
    partial: bool = False

    def start(self, decoder: Decoder, state: object, rows: Tensor, steps: int) -> _Stamps:
        if not 0 < self.timestamp_begin < decoder.vocab_size:
            raise ValueError(f"timestamp_begin {self.timestamp_begin} is not an id of [1, {decoder.vocab_size})")
        none = torch.full((len(rows),), -1, dtype=torch.long, device=rows.device)  # (N,)
        return _Stamps(none, none, none, 0, decoder.vocab_size)

    def score(self, state: _Stamps, candidates: Tensor | None) -> tuple[Tensor, _Stamps]:
        return _picked(self.masks(state), candidates), state

    def masks(self, s: _Stamps) -> Tensor:
        """The rules' −∞ for every hypothesis and token. Shapes: returns (N, V)."""
        n, tb = s.last.shape[0], self.timestamp_begin
        v = s.vocab
        ids = torch.arange(v, device=s.last.device)[None]  # (1, V)
        stamp_ids, text_ids = ids >= tb, ids < self.eos  # (1, V) each
        last_stamp = s.last >= tb  # (N,)
        pair_done = last_stamp & ((s.before_last >= tb) | (s.length < 2))  # (N,): a pair is complete
        pair_open = last_stamp & ~pair_done  # (N,): the segment's end is written, the next start not
        banned = (pair_done[:, None] & stamp_ids) | (pair_open[:, None] & text_ids)  # (N, V)
        # Never decreasing; a repeated timestamp only closes a pair (no zero-length segment).
        lowest = torch.where(s.stamp >= 0, s.stamp + (~pair_open).long(), torch.full_like(s.stamp, tb))  # (N,)
        banned |= stamp_ids & (ids < lowest[:, None])
        if s.length == 0:  # the first token: a timestamp, and not too late
            banned |= ~stamp_ids
            if self.max_initial is not None:
                banned |= ids > tb + self.max_initial
        banned[:, self.no_timestamps] = True
        return torch.zeros(n, v, device=ids.device).masked_fill_(banned, NEG)  # (N, V)

    def advance(self, scored: _Stamps, rows: Tensor, tokens: Tensor) -> _Stamps:
        last, stamp = scored.last.index_select(0, rows), scored.stamp.index_select(0, rows)  # (N,) each
        stamp = torch.where(tokens >= self.timestamp_begin, tokens, stamp)
        return _Stamps(tokens, last, stamp, scored.length + 1, scored.vocab)

    def revise(self, total: Tensor) -> Tensor:
        """Where all timestamps together are likelier than every text token, only timestamps
        stay (the rule reads the step's scores so far). Shapes: (N, V) -> (N, V)."""
        tb = self.timestamp_begin
        logp = torch.log_softmax(total.float(), dim=-1)  # (N, V)
        stamps = logp[:, tb:].logsumexp(dim=-1)  # (N,)
        text = logp[:, :tb].max(dim=-1).values  # (N,)
        only_stamps = (stamps > text)[:, None] & (torch.arange(total.shape[-1], device=total.device) < tb)  # (N, V)
        return total.masked_fill(only_stamps, NEG)

    def bytes_needed(self, decoder: Decoder, *, inputs: int, beam: int, source: int, steps: int) -> int:
        return 4 * 3 * inputs * beam * decoder.vocab_size  # a step's masks and revised scores


def whisper_scorers(
    *,
    eos: int,
    suppress: Sequence[int] = (),
    begin_suppress: Sequence[int] = (),
    no_timestamps: int | None = None,
    timestamps: bool = False,
    max_initial: int | None = None,
) -> list[Scorer]:
    """Whisper's rules as scorers: the suppressed tokens (where there are any), and with
    ``timestamps`` the timestamp rules, the timestamps being every id after <|notimestamps|>
    (``no_timestamps``, which timestamps need)."""
    scorers: list[Scorer] = []
    if suppress or begin_suppress:
        scorers.append(SuppressTokens(tuple(suppress), tuple(begin_suppress)))
    if timestamps:
        if no_timestamps is None:
            raise ValueError("timestamps need a model with a <|notimestamps|> token (the timestamps follow it)")
        scorers.append(TimestampRules(no_timestamps + 1, eos, no_timestamps, max_initial))
    return scorers
