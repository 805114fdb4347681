"""Bans: scorers that keep token sequences and words out of every output, whatever the search.

Two full scorers (``scorers.py``'s protocol), each tracking what it needs of a hypothesis'
history in its own state:

  * :class:`BannedSequences`: token sequences that never appear (Hugging Face's
    ``NoBadWordsLogitsProcessor``, and a checkpoint's ``bad_words_ids``): the last token of a
    sequence is −∞ for every hypothesis whose last tokens are the rest of it;
  * :class:`BannedWords`: words never written, however the tokens spell them. A word is matched
    in the text the tokens write (each token's text: ``Tokenizer.token_texts``), as a
    character automaton per word lifted to tokens (a table: state × token → state, and whether
    the token would write the word), so "cat" is kept out whether a model would write it as
    "▁cat", "▁c" + "at" or "▁ca" + "t".

A banned word is matched where it starts a word (text start, or after a character other than a
letter, digit or ``_``) and in any case as written: banning "cat" keeps out "cat", "cats" and
"(cat", not "concat" or "Cat". A byte-level tokenizer (GPT-2's, Whisper's) may split a character
of several bytes across tokens; a word is only matched where each of its characters is written
whole by one token.

What is not here: the scorer protocol and the searches (``scorers.py``, ``search.py``),
required words (``constrained.py``), tokenization.

Shapes use the legend of ``attention.py``: N hypotheses, V vocabulary, C candidates, K words.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from qkv.decoding.decoders import Decoder


def _row(tokens: Sequence[int], vocab: int, device) -> Tensor:
    """A (V,) row of 0 with −∞ at ``tokens``."""
    row = torch.zeros(vocab, device=device)  # (V,)
    row[list(tokens)] = float("-inf")
    return row


@dataclass
class BannedSequences:
    """Token sequences no output contains (Hugging Face's ``bad_words_ids``): a hypothesis whose
    last tokens are a sequence but its last token may not write that token next; a sequence of
    one token is never written. ``after``: the tokens written before the first new one (a forced
    prefix), which the first steps' histories end with."""

    sequences: Sequence[Sequence[int]]
    after: Sequence[int] = ()
    weight: float = 1.0
    partial: bool = False

    def __post_init__(self) -> None:
        if not all(len(s) for s in self.sequences):
            raise ValueError("a banned sequence needs at least one token")
        self.memory = max((len(s) - 1 for s in self.sequences), default=0)  # M: the history each needs

    def start(self, decoder: Decoder, state: object, rows: Tensor, steps: int) -> tuple[Tensor, list]:
        v = decoder.vocab_size
        if any(not 0 <= t < v for s in self.sequences for t in s):
            raise ValueError(f"banned sequences must hold ids in [0, {v}), got {[list(s) for s in self.sequences]!r}")
        device = rows.device
        always = _row([s[0] for s in self.sequences if len(s) == 1], v, device)  # (V,)
        by_length: dict[int, list[Sequence[int]]] = {}
        for s in self.sequences:
            if len(s) > 1:
                by_length.setdefault(len(s), []).append(s)
        groups = [
            (torch.tensor([s[:-1] for s in group], device=device), torch.tensor([s[-1] for s in group], device=device))
            for group in by_length.values()
        ]  # (K, m-1) heads and (K,) last tokens of the K sequences of each length m
        seen = [-1] * self.memory + list(self.after)
        history = torch.tensor(seen[len(seen) - self.memory :], dtype=torch.long, device=device)  # (M,)
        return history.expand(len(rows), self.memory).clone(), [always, groups]  # (N, M)

    def score(self, state: tuple[Tensor, list], candidates: Tensor | None) -> tuple[Tensor, tuple]:
        history, (always, groups) = state
        banned = always.expand(len(history), -1)  # (N, V)
        for heads, last in groups:
            m = heads.shape[1]
            ends = (history[:, None, self.memory - m :] == heads[None]).all(-1)  # (N, K): ends with the head
            hits = torch.zeros_like(banned).index_add_(1, last, ends.float())  # (N, V): heads ending here
            banned = banned.masked_fill(hits > 0, float("-inf"))
        return (banned if candidates is None else banned.gather(1, candidates)), state

    def advance(self, scored: tuple[Tensor, list], rows: Tensor, tokens: Tensor) -> tuple[Tensor, list]:
        history, tables = scored
        history = torch.cat([history.index_select(0, rows), tokens[:, None]], dim=1)  # (N, M+1)
        return history[:, 1:], tables  # (N, M)

    def bytes_needed(self, decoder: Decoder, *, inputs: int, beam: int, source: int, steps: int) -> int:
        return 4 * 3 * inputs * beam * decoder.vocab_size  # a step's ban rows, hits and gathered scores


def _is_word(char: str) -> bool:
    """A character words are made of (``\\w`` of Python's regular expressions)."""
    return char.isalnum() or char == "_"


@dataclass(frozen=True)
class WordAutomaton:
    """Where the text a hypothesis has written stands against one banned word, as a state per
    hypothesis: 0 at a word's start (text start, or after a non-word character), s in
    [1, n) when the text ends with the word's first s characters from such a start, n inside a
    word that is not the banned one. ``next``: the state after each token, from each state;
    ``hits``: the tokens that would write the word, from each state. Shapes: (n + 1, V) each.
    """

    word: str
    next: Tensor
    hits: Tensor

    @classmethod
    def of(cls, word: str, texts: Sequence[str]) -> WordAutomaton:
        """The automaton of ``word`` over tokens whose texts are ``texts`` (one per id, as
        written after other text; "" for one that writes nothing, which keeps the state)."""
        n = len(word)
        contexts = _contexts(word)
        going_on = set(word[1:])
        nexts: list[list[int]] = [[0] * len(texts) for _ in contexts]
        hits: list[list[bool]] = [[False] * len(texts) for _ in contexts]
        for t, text in enumerate(texts):
            if not text:
                for s in range(n + 1):
                    nexts[s][t] = s
            elif word[0] not in text and text[0] not in going_on:
                # No match can start inside the text nor go on into it: from every state, the
                # text leaves only whether it ends inside a word.
                after = n if _is_word(text[-1]) else 0
                for s in range(n + 1):
                    nexts[s][t] = after
            else:
                for s, context in enumerate(contexts):
                    nexts[s][t], hits[s][t] = _run(word, context, text)
        return cls(word, torch.tensor(nexts, dtype=torch.long), torch.tensor(hits))

    def state_after(self, text: str) -> int:
        """The state once ``text`` is written from a text's start; a ValueError if it holds the word."""
        state, hit = _run(self.word, " ", text) if text else (0, False)
        if hit:
            raise ValueError(f"the text before the output already holds the banned word {self.word!r}")
        return state


def _contexts(word: str) -> list[str]:
    """For each state of ``word``'s automaton, a text that leaves it there: a boundary (a space)
    and the word's first s characters; and, for "inside a word", a word character that cannot
    start the word."""
    inside = "1" if word[0] == "0" else "0"
    return [" " + word[:s] for s in range(len(word))] + [inside]


def _run(word: str, context: str, text: str) -> tuple[int, bool]:
    """The state after ``context`` + ``text``, and whether ``text`` completes the word at a
    word's start (an occurrence ending inside ``text``)."""
    n, whole = len(word), context + text
    anywhere = not _is_word(word[0])  # a word starting with, say, "$" needs no boundary before it

    def starts_word(i: int) -> bool:
        return anywhere or i == 0 or not _is_word(whole[i - 1])

    i = whole.find(word, max(0, len(context) - n + 1))
    while i != -1:
        if starts_word(i):
            return n, True
        i = whole.find(word, i + 1)
    for length in range(min(n - 1, len(whole)), 0, -1):
        i = len(whole) - length
        if whole.endswith(word[:length]) and starts_word(i):
            return length, False
    return (n if _is_word(whole[-1]) else 0), False


@dataclass
class BannedWords:
    """Words no output writes, however its tokens spell them (see the module docstring).

    ``texts``: each token id's text as written after other text (``Tokenizer.token_texts``);
    ids past it write nothing. ``after``: the text written before the first new token (a
    forced prefix), where the first token's text continues. The automata are built once, here:
    about a second per word for a vocabulary of 60,000 tokens.
    """

    words: Sequence[str]
    texts: Sequence[str]
    after: str = ""
    weight: float = 1.0
    partial: bool = False
    automata: list[WordAutomaton] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.words or any(not w or w != w.strip() for w in self.words):
            raise ValueError(
                f"banned words must be one or more, each without spaces around it, got {list(self.words)!r}"
            )
        self.automata = [WordAutomaton.of(w, self.texts) for w in self.words]
        self.first = [a.state_after(self.after) for a in self.automata]

    def start(self, decoder: Decoder, state: object, rows: Tensor, steps: int) -> tuple[Tensor, list]:
        v, device = decoder.vocab_size, rows.device
        tables = []
        for a in self.automata:
            nexts, hits = a.next[:, :v], a.hits[:, :v]  # (S, V)
            if nexts.shape[1] < v:  # ids the tokenizer does not write: they keep the state
                more = v - nexts.shape[1]
                nexts = torch.cat([nexts, torch.arange(len(nexts))[:, None].expand(-1, more)], dim=1)
                hits = torch.cat([hits, torch.zeros(len(hits), more, dtype=torch.bool)], dim=1)
            tables.append((nexts.to(device), hits.to(device)))
        states = torch.tensor(self.first, dtype=torch.long, device=device).expand(len(rows), -1)  # (N, K)
        return states.clone(), tables

    def score(self, state: tuple[Tensor, list], candidates: Tensor | None) -> tuple[Tensor, tuple]:
        states, tables = state
        banned = torch.zeros(len(states), tables[0][1].shape[1], device=states.device)  # (N, V)
        for k, (_, hits) in enumerate(tables):
            banned = banned.masked_fill(hits.index_select(0, states[:, k]), float("-inf"))  # (N, V)
        return (banned if candidates is None else banned.gather(1, candidates)), state

    def advance(self, scored: tuple[Tensor, list], rows: Tensor, tokens: Tensor) -> tuple[Tensor, list]:
        states, tables = scored
        states = states.index_select(0, rows)  # (N, K)
        moved = [nexts[states[:, k], tokens] for k, (nexts, _) in enumerate(tables)]  # K of (N,)
        return torch.stack(moved, dim=1), tables  # (N, K)

    def bytes_needed(self, decoder: Decoder, *, inputs: int, beam: int, source: int, steps: int) -> int:
        tables = sum(9 * (len(w) + 1) for w in self.words) * decoder.vocab_size  # int64 next + bool hits
        return tables + 4 * 2 * inputs * beam * decoder.vocab_size
