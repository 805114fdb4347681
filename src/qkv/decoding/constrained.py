"""Lexically constrained beam search: every output contains its input's required terms.

Dynamic beam allocation (Post & Vilar, 2018, "Fast Lexically Constrained Decoding with Dynamic
Beam Allocation for Neural Machine Translation"; Sockeye's implementation): each hypothesis
tracks its progress through its input's terms, counted in tokens written of them. At each step
the candidates of an input are the best 2W extensions of its W live hypotheses (as in
``search.beam_search``), each live hypothesis' single best token, and the tokens that advance
its terms (the next token of a term under way, else the first token of every term not yet
written); they are grouped into banks by progress, and the beam is divided among the banks
(W // banks each, the rest to the bank that has written every term; a bank short of candidates
passes its share down), so hypotheses that force a term in compete with their own kind rather
than with the unconstrained best. END is allowed only to a hypothesis that has written every
term, and an input's outputs are those that have, best first, before any that reached the cap
without them.

A term is :class:`Required`: any one of several token sequences (its ``ways``, say a word as the
tokenizer writes it at a text's start and after a space), tracked per hypothesis by an
Aho–Corasick automaton over its ways, so a term written half-way and abandoned counts what its
suffix still gives. Bans and every other full scorer (``scorers.py``, ``bans.py``) apply as in
beam search; a partial one (the CTC prefix score) is refused.

Guarantee: the most advanced candidate always keeps a place (the bank of every term gets at
least one slot, passed down while it is empty), and forcing advances it one token per step, so
an input whose cap leaves room for all its terms' tokens (plus a forced prefix's) gets an
output with every term, unless a scorer bans a term's tokens. Without terms the search is
:func:`~qkv.decoding.search.beam_search`, step for step (tested: the same outputs and scores).

What is here: :class:`Required` (with :data:`AT_START`), :func:`bank_sizes` and
:func:`constrained_beam_search` (its banks: beam search's bookkeeping, ``search._Beams``, with
each hypothesis' term states and the step chosen by bank). What is not: the plain searches and
the steps' loop and scores they share with this one (``search.py``), bans (``bans.py``), turning
words into token sequences (the caller's tokenizer: ``bundle/constraints.py``).

Shapes use the legend of ``attention.py``: B inputs, W beam width, N rows (B·W hypotheses),
V vocabulary, L tokens so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.decoding.decoders import Decoder, DecodingModel, Inputs, decoder_for
from qkv.decoding.planning import MaxNew, check_inputs, in_parts, inputs_per_batch
from qkv.decoding.scorers import Scorer, revisers
from qkv.decoding.search import Hypothesis, _beam, _Beams, _Options

MET = -1  # a term's automaton state once one of its ways is written (it stays there)
AT_START = -2  # first in a way that only counts at the output's start (before any token or prefix)


@dataclass(frozen=True)
class Required:
    """A term an output must contain, written any one of its ``ways`` (token sequences). A way
    that starts with :data:`AT_START` counts only as the output's first tokens: a word as a
    tokenizer writes it at a text's start ("dog") may not be right after other text ("a dog"),
    where another way ("▁dog", " " + "dog") writes it."""

    ways: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.ways or not all(w and w != (AT_START,) for w in self.ways):
            raise ValueError(f"a required term needs one or more non-empty token sequences, got {self.ways!r}")
        if any(t == AT_START for w in self.ways for t in w[1:]):
            raise ValueError(f"AT_START may only begin a way, got {self.ways!r}")


class _Term:
    """The Aho–Corasick automaton of one term's ways over token ids (node 0: nothing under
    way; a node: the longest prefix of a way the text ends with; :data:`MET` once a way is
    written). ``length``: the tokens the term counts for once written (its longest way)."""

    def __init__(self, ways: tuple[tuple[int, ...], ...]) -> None:
        self.children: list[dict[int, int]] = [{}]
        self.depth, ends = [0], [False]
        for way in ways:
            node = 0
            for token in way:
                if token not in self.children[node]:
                    self.children[node][token] = len(self.children)
                    self.children.append({})
                    self.depth.append(self.depth[node] + (token != AT_START))  # tokens written
                    ends.append(False)
                node = self.children[node][token]
            ends[node] = True
        self.fail = [0] * len(self.children)
        queue = list(self.children[0].values())
        while queue:  # breadth first: a node's failure link is found from its parent's
            node = queue.pop(0)
            for token, child in self.children[node].items():
                link = self.fail[node]
                while link and token not in self.children[link]:
                    link = self.fail[link]
                self.fail[child] = self.children[link].get(token, 0)
                ends[child] = ends[child] or ends[self.fail[child]]
                queue.append(child)
        self.ends = ends
        self.length = max(len(way) - (way[0] == AT_START) for way in ways)

    def next(self, node: int, token: int) -> int:
        if node == MET:
            return MET
        while node and token not in self.children[node]:
            node = self.fail[node]
        node = self.children[node].get(token, 0)
        return MET if self.ends[node] else node


def bank_sizes(beam: int, counts: Sequence[int]) -> list[int]:
    """How many of the ``beam`` places each bank gets, given ``counts`` candidates in each
    (bank j: j tokens of the terms written). Post & Vilar's allocation as Sockeye makes it: beam
    // banks each and the remainder to the last bank (every term written); then, from the last
    down, a bank's places beyond its candidates pass to the bank below; places the first bank
    cannot use go back to the highest banks with candidates left. The sum is min(beam, Σ counts).
    """
    n = len(counts)
    sizes = [beam // n] * n
    sizes[-1] += beam - sum(sizes)
    unused = 0
    for j in reversed(range(n)):
        over = sizes[j] - counts[j]
        if over > 0:
            sizes[j] -= over
            if j:
                sizes[j - 1] += over
            else:
                unused = over
    for j in reversed(range(n)):
        more = min(unused, counts[j] - sizes[j])
        sizes[j] += more
        unused -= more
    return sizes


@torch.no_grad()
def constrained_beam_search(
    model: DecodingModel | Decoder,
    inputs: Inputs,
    *,
    required: Sequence[Sequence[Required]],
    beam_size: int,
    max_new_tokens: MaxNew,
    length_penalty: float = 1.0,
    nbest: int = 1,
    prefix: Sequence[int] | None = None,
    scorers: Sequence[Scorer] = (),
    decoder_weight: float = 1.0,
) -> list[list[Hypothesis]]:
    """Beam search whose outputs contain ``required[i]``, the terms of input i (see the module
    docstring); returns the ``nbest`` best hypotheses of every input: those with every term
    first, best first, then any that reached the cap without them.

    The rest is :func:`~qkv.decoding.search.beam_search`'s: scores, length penalty, the
    stopping rule (counting the live hypotheses that have every term), caps within the window,
    memory planning, ``prefix`` (an encoder-decoder's forced first tokens, BEGIN first; a term
    they already write counts as written) and full ``scorers`` with ``decoder_weight``.
    """
    if not 1 <= nbest <= beam_size:
        raise ValueError(f"nbest must be between 1 and beam_size={beam_size}, got {nbest}")
    if len(required) != len(inputs):
        raise ValueError(f"{len(required)} lists of required terms for {len(inputs)} inputs")
    if any(s.partial for s in scorers):
        raise ValueError("a partial scorer (the CTC prefix score) cannot join a constrained beam search")
    if not inputs:
        return []
    decoder = decoder_for(model)
    caps = check_inputs(decoder, inputs, max_new_tokens=max_new_tokens, prefix=prefix)
    size = inputs_per_batch(decoder, inputs, caps, beam=beam_size, prefix=prefix, scorers=scorers)
    options = _Options(beam_size, length_penalty, prefix, tuple(scorers), decoder_weight, None, revisers(scorers))

    def search(part: Inputs, part_caps: list[int], first: int) -> list[list[tuple[Hypothesis, bool]]]:
        terms = [[_Term(term.ways) for term in required[first + i]] for i in range(len(part))]
        banks = _Banks(terms, beam_size, part_caps, decoder.eos_id, options, decoder.device)
        return _beam(decoder, part, options, banks)

    found = in_parts(search, inputs, caps, size)
    return [[h for h, _ in sorted(f, key=lambda x: (not x[1], -x[0].score))[:nbest]] for f in found]


class _Banks(_Beams):
    """Beam search's bookkeeping (:class:`~qkv.decoding.search._Beams`: the live hypotheses of B
    inputs, W each, their scores and histories, what has finished), with each live hypothesis'
    state in each of its input's terms, and each input's step chosen by bank."""

    def __init__(self, terms: list[list[_Term]], w: int, caps: list[int], eos: int | None, o: _Options, device) -> None:
        b = len(terms)
        super().__init__(b, w, caps, eos, o, 0, device)
        self.terms = terms
        forced = [AT_START, *list(o.prefix or [])[1:]]  # the output's start, then what the prefix writes
        self.states = [self._after(i, (0,) * len(terms[i]), forced) for i in range(b) for _ in range(w)]
        self.finished: list[list[tuple[Hypothesis, bool]]] = [[] for _ in range(b)]  # with whether every term is
        self._extras: list[list[tuple[int, int, float]]] = []  # this step's candidates beyond the best 2W
        self._chosen: dict[tuple[int, int], tuple[int, ...]] = {}  # this step's kept (row, token): its term states

    def _after(self, i: int, state: tuple[int, ...], tokens: Sequence[int]) -> tuple[int, ...]:
        """Input ``i``'s term states once ``tokens`` follow ``state``."""
        for token in tokens:
            state = tuple(term.next(node, token) for term, node in zip(self.terms[i], state, strict=True))
        return state

    def _progress(self, i: int, state: tuple[int, ...]) -> int:
        """The bank of a hypothesis: the tokens of its written terms, plus those of the term
        furthest under way (one only: terms that share tokens would count them twice, and
        forcing one could then leave the sum where it was)."""
        pairs = list(zip(self.terms[i], state, strict=True))
        written = sum(term.length for term, node in pairs if node == MET)
        return written + max((term.depth[node] for term, node in pairs if node != MET), default=0)

    def _advancing(self, i: int, state: tuple[int, ...]) -> set[int]:
        """The tokens that advance a term: the next of those under way, else the first of every
        term not written (Sockeye's rule: a term under way is finished before another starts)."""
        pairs = list(zip(self.terms[i], state, strict=True))
        under_way = [(term, node) for term, node in pairs if node != MET and term.depth[node] > 0]
        if under_way:
            return {t for term, node in under_way for t in term.children[node]}
        firsts = {t for term, node in pairs if node != MET for t in (*term.children[node], *term.children[0])}
        return firsts - {AT_START}

    def keep(self, logp: Tensor, step: int) -> tuple[Tensor, Tensor] | None:
        """Beam search's step (:meth:`_Beams.keep`) over the step scores ``logp`` (B*W, V), END
        allowed only to a hypothesis with every term; the kept hypotheses' term states follow
        them (a filler, never extended, keeps the state of the row it copies)."""
        unmet = [r for r, state in enumerate(self.states) if any(node != MET for node in state)]
        if unmet and self.eos is not None:  # END only once every term is written
            logp[unmet, self.eos] = float("-inf")  # (a tensor of this step's own)
        self._extras = self._extra(self.scores.view(-1, 1) + logp)  # (B*W, V) summed scores
        self._chosen = {}
        kept = super().keep(logp, step)
        if kept is not None:
            rows, tokens = kept  # (B*W,) each
            pairs = zip(rows.tolist(), tokens.tolist(), strict=True)
            self.states = [self._chosen.get((row, token), self.states[row]) for row, token in pairs]
        return kept

    def _extra(self, scores: Tensor) -> list[list[tuple[int, int, float]]]:
        """Each input's candidates beyond the best 2W, from its live hypotheses (rows): each
        one's best token, the tokens that advance its terms, and END once it has every term.
        Shapes: scores (B*W, V) summed scores."""
        best = scores.argmax(-1).tolist()  # (B*W,)
        live = self.scores.view(-1).tolist()
        pairs: list[tuple[int, int, int]] = []  # (input, row, token)
        for i in range(self.b):
            if self.done[i] or not self.terms[i]:
                continue  # without terms the best 2W are all beam search looks at
            for row in range(i * self.w, (i + 1) * self.w):
                if live[row] == float("-inf"):
                    continue
                state = self.states[row]
                wanted = {best[row], *self._advancing(i, state)}
                if self.eos is not None and all(node == MET for node in state):
                    wanted.add(self.eos)
                pairs += [(i, row, t) for t in sorted(wanted)]
        extra: list[list[tuple[int, int, float]]] = [[] for _ in range(self.b)]
        if pairs:
            flat = torch.tensor([row * scores.shape[1] + t for _, row, t in pairs], device=scores.device)
            for (i, row, t), s in zip(pairs, scores.view(-1).index_select(0, flat).tolist(), strict=True):
                extra[i].append((row, t, s))
        return extra

    def _input(self, i: int, step: int, rows: list, tokens: list, scores: list) -> list[tuple[int, int, float]]:
        """One input's step: its best 2W extensions (``rows``, ``tokens``, ``scores``), then the
        rest of its candidates (:meth:`_extra`), sorted into finished and live by bank; marks it
        done by Hugging Face's rule or at its cap. The kept ones' term states go to ``_chosen``."""
        listed = [*zip(rows, tokens, scores, strict=True), *self._extras[i]]
        w, norm, terms = self.w, (step + 1) ** self.o.length_penalty, self.terms[i]
        top = sum(term.length for term in terms)  # the bank of every term written
        seen, ranked = set(), []
        for row, token, score in listed:
            if score == float("-inf") or (row, token) in seen:
                continue
            seen.add((row, token))
            state = self.states[row] if token == self.eos else self._after(i, self.states[row], [token])
            ranked.append((row, token, score, state, top if token == self.eos else self._progress(i, state)))
        ranked.sort(key=lambda c: -c[2])  # stable: the best 2W keep beam search's order
        finished, counts, rank = self.finished[i], [0] * (top + 1), [0] * (top + 1)
        live = []
        for row, token, score, state, bank in ranked:
            if token == self.eos:
                if rank[bank] < w:  # as beam search: an END among the bank's W best finishes
                    finished.append((Hypothesis(self.history[row].tolist(), score / norm), True))
            else:
                live.append((row, token, score, state, bank))
                counts[bank] += 1
            rank[bank] += 1
        sizes, kept = bank_sizes(w, counts), []
        for row, token, score, state, bank in live:
            if sizes[bank] > 0:
                sizes[bank] -= 1
                kept.append((row, token, score, state))
        complete = [c for c in kept if all(node == MET for node in c[3])]
        done = [h.score for h, met in finished if met]
        if len(done) >= w:
            # Hugging Face's rule, over the live hypotheses that could end now (every term written).
            wth_best = sorted(done, reverse=True)[w - 1]
            self.done[i] = not complete or complete[0][2] / norm <= wth_best
        if not self.done[i] and step + 1 >= self.caps[i]:
            for row, token, score, state in kept:  # the cap: live hypotheses finish as they are
                met = all(node == MET for node in state)
                finished.append((Hypothesis([*self.history[row].tolist(), token], score / norm), met))
            self.done[i] = True
        self._chosen.update(((row, token), state) for row, token, _, state in kept)
        return [(row, token, score) for row, token, score, _ in kept]
