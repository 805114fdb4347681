"""The searches: greedy, sampling, the token stream, and batched beam search.

Each takes a model (or its :class:`~qkv.decoding.decoders.Decoder`, the adapter that
:func:`~qkv.decoding.decoders.decoder_for` picks once) and optional scorers
(``scorers.py``), and asks the decoder only ``start`` / ``step`` / ``reorder``: no search knows
which family it runs. Inputs are lists of token-id lists, or for a speech model a list of
(T, M) feature tensors (``qkv.audio.features``); outputs are lists of token ids, the new tokens
only, without BEGIN and END. An encoder-decoder's decoding may start from forced tokens instead
of BEGIN alone (``prefix``, BEGIN first: Whisper's ``<|startoftranscript|>``, language, task and
``<|notimestamps|>``); they are fed as if chosen and are not part of the output.

What is here: :func:`stream` (one token per step for every row), :func:`generate` (its tokens
collected), :func:`greedy`, :func:`sample` (with :func:`sampler` and :func:`filter_logits`),
:func:`continuation` (one input, sliding past the window), :func:`beam_search` (batched, length
penalty, n-best, weighted scorers, an ``on_step`` hook that sees every step: the server's beam
trace is one) and :func:`ctc_greedy` (a CTC head's best path). What is not here: memory
planning (``planning.py``), the adapters and scorers (their modules), tokenization.

Shapes use the legend of ``attention.py``: B inputs, W beam width, N rows (B·W hypotheses),
V vocabulary, C candidates, L tokens so far.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from qkv.ctc import ctc_best_path
from qkv.decoding.decoders import Decoder, DecodingModel, Inputs, decoder_for
from qkv.decoding.planning import MaxNew, check_inputs, in_parts, inputs_per_batch
from qkv.decoding.scorers import CTC_PRE_BEAM, Revising, Scorer, revised, revisers

DONE = -1  # what :func:`stream` yields for a row that has already finished


def most_likely(logits: Tensor) -> Tensor:
    """The greedy ``choose`` for :func:`stream`. Shapes: logits (B, V) -> tokens (B,)."""
    return logits.argmax(-1)


def filter_logits(
    logits: Tensor, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> Tensor:
    """Temperature, then top-k, then nucleus (top-p; Holtzman et al., 2020) filtering.

    Removed tokens get -inf. Top-k keeps exactly k tokens (among equal logits, the ones
    ``torch.topk`` picks). Top-p keeps the smallest set of most likely tokens whose
    probability reaches ``top_p`` (always at least one). Shapes: (N, V) -> (N, V).
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0 (use greedy for temperature 0)")
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        # Exactly k kept, by index: a threshold at the k-th value would keep every token tied with it.
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, logits.topk(top_k, dim=-1).indices, True)
        logits = logits.masked_fill(~keep, float("-inf"))  # (N, V)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (N, V)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # probability of the strictly more likely tokens
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False  # the most likely token always stays
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sampler(
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Callable[[Tensor], Tensor]:
    """A ``choose`` function for :func:`stream`: draw from the filtered distribution.

    Shapes: the returned function maps logits (B, V) to tokens (B,).
    """

    def choose(logits: Tensor) -> Tensor:
        probs = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p).softmax(-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]  # (B,)

    return choose


def _started(decoder: Decoder, inputs: Inputs, prefix: Sequence[int] | None) -> tuple[Tensor, object]:
    """The decoder's start, then the rest of an encoder-decoder's forced first tokens ``prefix``
    (BEGIN first; None: BEGIN alone), fed in one call (``Decoder.feed``) as if chosen one at a
    time. Shapes: returns (B, V)."""
    logits, state = decoder.start(inputs)  # (B, V)
    if prefix is not None and len(prefix) > 1:  # one call, as openai/whisper reads its prompt, not a step a token
        tokens = torch.tensor([list(prefix[1:])] * len(inputs), dtype=torch.long, device=logits.device)  # (B, L)
        logits, state = decoder.feed(state, tokens)  # (B, V)
    return logits, state


def _weighted(
    logits: Tensor, scorers: Sequence[Scorer], scored: list, decoder_weight: float, revising: Sequence[Revising]
) -> Tensor:
    """w_dec · log p_decoder + Σ wₖ · scoreₖ over every token (full scorers; a weight of 0 adds
    nothing), then revised by the scorers that revise (``revising``: :func:`~qkv.decoding.scorers.revisers`).
    Shapes: (N, V) -> (N, V)."""
    total = decoder_weight * torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    for s, (score, _) in zip(scorers, scored, strict=True):
        if s.weight != 0.0:
            total = total + s.weight * score  # (N, V)
    return revised(total, revising)


@torch.no_grad()
def stream(
    model: DecodingModel | Decoder,
    inputs: Inputs,
    *,
    max_new_tokens: MaxNew,
    choose: Callable[[Tensor], Tensor],
    prefix: Sequence[int] | None = None,
    scorers: Sequence[Scorer] = (),
    decoder_weight: float = 1.0,
) -> Iterator[Tensor]:
    """Yield one new token per row (B,) per step; ``choose`` maps logits (B, V) to tokens (B,).
    An encoder-decoder's decoding starts from ``prefix`` (None: BEGIN), which is not yielded.
    With ``scorers`` (full ones only: a partial scorer needs beam search), ``choose`` sees
    w_dec · log p_decoder + Σ wₖ · scoreₖ instead of the decoder's logits.

    A row yields its tokens, END included, then :data:`DONE` once it has ended: by END or
    by reaching its cap (``max_new_tokens``, or less where the window is full). The loop
    ends when every row has.
    """
    if not inputs:
        return
    if any(s.partial for s in scorers):
        raise ValueError("a partial scorer (the CTC prefix score) needs beam search")
    decoder = decoder_for(model)
    caps = check_inputs(decoder, inputs, max_new_tokens=max_new_tokens, prefix=prefix)
    inputs_per_batch(decoder, inputs, caps, beam=1, prefix=prefix)  # refuses an input that alone would not fit
    logits, state = _started(decoder, inputs, prefix)  # (B, V)
    state = decoder.reserve(state, max(caps))  # a stream never reorders: its cache grows in place
    rows = torch.arange(len(inputs), device=logits.device)  # (B,)
    scoring = [s.start(decoder, state, rows, max(caps)) for s in scorers]
    revising = revisers(scorers)
    cap = torch.tensor(caps, device=logits.device)  # (B,)
    finished = torch.zeros(len(inputs), dtype=torch.bool, device=logits.device)
    for step in range(max(caps)):
        scored = [s.score(st, None) for s, st in zip(scorers, scoring, strict=True)]
        chosen = choose(_weighted(logits, scorers, scored, decoder_weight, revising) if scorers else logits)  # (B,)
        yield chosen.masked_fill(finished, DONE)
        finished = finished | (step + 1 >= cap)
        if decoder.eos_id is not None:
            finished = finished | (chosen == decoder.eos_id)
        if bool(finished.all()):
            return
        scoring = [s.advance(sc, rows, chosen) for s, (_, sc) in zip(scorers, scored, strict=True)]
        logits, state = decoder.step(state, chosen)


def collect(steps: Iterator[Tensor], n: int, *, eos_id: int | None) -> list[list[int]]:
    """The tokens of :func:`stream`'s ``n`` rows, each up to its END (left out) or its end."""
    out: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    for tokens in steps:
        for i, t in enumerate(tokens.tolist()):
            if done[i] or t == eos_id or t == DONE:
                done[i] = True
                continue
            out[i].append(t)
    return out


def generate(
    model: DecodingModel | Decoder,
    inputs: Inputs,
    *,
    max_new_tokens: MaxNew,
    choose: Callable[[Tensor], Tensor],
    prefix: Sequence[int] | None = None,
    scorers: Sequence[Scorer] = (),
    decoder_weight: float = 1.0,
) -> list[list[int]]:
    """The new tokens of every input, each token picked by ``choose`` (:func:`stream`). A batch
    whose decoding would not fit in memory is decoded in parts (:func:`inputs_per_batch`); the
    outputs are the same."""
    decoder = decoder_for(model)
    caps = check_inputs(decoder, inputs, max_new_tokens=max_new_tokens, prefix=prefix)
    size = inputs_per_batch(decoder, inputs, caps, beam=1, prefix=prefix, scorers=scorers)

    def search(part: Inputs, part_caps: list[int], first: int) -> list[list[int]]:
        steps = stream(
            decoder,
            part,
            max_new_tokens=part_caps,
            choose=choose,
            prefix=prefix,
            scorers=scorers,
            decoder_weight=decoder_weight,
        )
        return collect(steps, len(part), eos_id=decoder.eos_id)

    return in_parts(search, inputs, caps, size)


def greedy(
    model: DecodingModel | Decoder,
    inputs: Inputs,
    *,
    max_new_tokens: MaxNew,
    prefix: Sequence[int] | None = None,
    scorers: Sequence[Scorer] = (),
) -> list[list[int]]:
    """Pick the most likely token at every step (:func:`generate` with :func:`most_likely`). An
    encoder-decoder starts from ``prefix`` (its forced first tokens, BEGIN first; None: BEGIN
    alone), which the outputs leave out."""
    return generate(model, inputs, max_new_tokens=max_new_tokens, choose=most_likely, prefix=prefix, scorers=scorers)


def sample(
    model: DecodingModel | Decoder,
    inputs: Inputs,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Sample each token from the filtered distribution.

    A ``seed`` makes one call reproducible; a ``generator`` (seeded once by the caller) makes
    a sequence of calls reproducible, e.g. batch after batch of a file.
    """
    decoder = decoder_for(model)
    if generator is None:
        generator = torch.Generator(device=decoder.device)
        if seed is not None:
            generator.manual_seed(seed)
        else:
            generator.seed()
    choose = sampler(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    return generate(decoder, inputs, max_new_tokens=max_new_tokens, choose=choose)


def continuation(
    model: DecodingModel | Decoder,
    prompt: list[int],
    *,
    max_new_tokens: int,
    choose: Callable[[Tensor], Tensor],
    slide: bool = False,
) -> Iterator[int]:
    """The new tokens of one input, one at a time, ending before END (or at the cap).

    Without ``slide`` the output stops where the window is full. With ``slide`` (decoder-only
    models and their ensembles) it goes on: a prompt longer than the window keeps its newest
    ``max_len`` tokens, and whenever the window is full the newest ``max_len // 2`` tokens are
    read again from position 0 and generation continues from them. nanoGPT crops to the window
    before every token (a full forward pass each time); re-reading half a window once per
    ``max_len // 2`` tokens keeps the KV cache useful in between.
    """
    decoder = decoder_for(model)
    if not slide or not decoder.prompted:
        yield from _one_stream(decoder, prompt, max_new_tokens, choose)
        return
    window = decoder.window
    seen = list(prompt)
    context = seen[-window:]
    produced = 0
    while produced < max_new_tokens:
        room = window - len(context) + 1  # new tokens before the window is full (check_inputs)
        for tokens in stream(decoder, [context], max_new_tokens=min(room, max_new_tokens - produced), choose=choose):
            token = int(tokens[0])
            if token in (decoder.eos_id, DONE):
                return
            yield token
            seen.append(token)
            produced += 1
        context = seen[-max(1, window // 2) :]


def _one_stream(decoder: Decoder, prompt: list[int], max_new_tokens: int, choose) -> Iterator[int]:
    """One input's new tokens from :func:`stream`, stopping before END."""
    for tokens in stream(decoder, [prompt], max_new_tokens=max_new_tokens, choose=choose):
        token = int(tokens[0])
        if token in (decoder.eos_id, DONE):
            return
        yield token


# ------------------------------------------------------------------------------- beam search


class Hypothesis(NamedTuple):
    """A finished beam: its tokens and its length-normalized score."""

    tokens: list[int]
    score: float


@dataclass(frozen=True)
class Candidate:
    """One extension a beam-search step looked at: the tokens it would make (END not included),
    its score (summed; length-normalized for one that ended) and the live hypothesis of the step
    before that it extends (its index among that step's live ones; None at the first step)."""

    tokens: list[int]
    score: float
    parent: int | None


@dataclass(frozen=True)
class BeamStep:
    """What one step of beam search did for one input, as :func:`beam_search`'s ``on_step``
    sees it: ``live`` (the W hypotheses kept, best first), ``ended`` (extensions by END among
    the step's best W, set aside as finished, or the live ones finished at the output's cap:
    ``capped``) and ``dropped`` (other extensions among the step's best 2W that were not kept)."""

    input: int
    step: int
    live: list[Candidate] = field(default_factory=list)
    ended: list[Candidate] = field(default_factory=list)
    dropped: list[Candidate] = field(default_factory=list)
    capped: bool = False


@dataclass(frozen=True)
class _Options:
    beam_size: int
    length_penalty: float
    prefix: Sequence[int] | None
    scorers: tuple[Scorer, ...]
    decoder_weight: float
    on_step: Callable[[BeamStep], None] | None
    revisers: tuple[Revising, ...]  # the scorers that revise (scorers.revisers), asked once


@torch.no_grad()
def beam_search(
    model: DecodingModel | Decoder,
    inputs: Inputs,
    *,
    beam_size: int,
    max_new_tokens: MaxNew,
    length_penalty: float = 1.0,
    nbest: int = 1,
    prefix: Sequence[int] | None = None,
    scorers: Sequence[Scorer] = (),
    decoder_weight: float = 1.0,
    on_step: Callable[[BeamStep], None] | None = None,
) -> list[list[Hypothesis]]:
    """Batched beam search; returns the ``nbest`` best hypotheses of every input, best first.

    Each step scores all W·V extensions of the W live beams of an input and takes the best
    2W: an extension ending in END (among the top W) becomes a finished hypothesis, set
    aside with score / length^length_penalty (length counts END); the best W others
    live on. An input is done when W hypotheses have finished and the best live beam, scored
    at the current length, is no better than the W-th best of them (Hugging Face's rule; with
    a length penalty > 0 a live beam could in principle still overtake, so it is a heuristic,
    not a bound). Beams still alive at the input's cap (``max_new_tokens``, or less where the
    window is full) finish there. With ``beam_size=1`` and no scorers this is exactly greedy.

    A step's score of token c is ``decoder_weight`` · log p_decoder(c | g) + Σₖ wₖ · scoreₖ(c | g)
    over ``scorers`` (``scorers.py``: a language model, banned tokens, the CTC prefix score).
    With a partial scorer (CTC), END and the best max(⌊1.5·W⌋, W + 1) − 1 other tokens of a beam
    by the full scores (the decoder's log-probabilities alone when no full scorer weighs in:
    ESPnet's pre-beam) are its candidates (END always: a beam can always end, so every input
    gets a hypothesis), every other token −∞. A scorer of weight 0 changes nothing: the
    candidates always include END and the W others that the search could keep.

    ``prefix``: an encoder-decoder's forced first tokens (BEGIN first; None: BEGIN alone), read
    before the search and left out of every hypothesis (and of its length). ``on_step`` is
    called with a :class:`BeamStep` for every input still searching at every step.
    """
    if not 1 <= nbest <= beam_size:
        raise ValueError(f"nbest must be between 1 and beam_size={beam_size}, got {nbest}")
    if not inputs:
        return []
    decoder = decoder_for(model)
    caps = check_inputs(decoder, inputs, max_new_tokens=max_new_tokens, prefix=prefix)
    size = inputs_per_batch(decoder, inputs, caps, beam=beam_size, prefix=prefix, scorers=scorers)
    options = _Options(beam_size, length_penalty, prefix, tuple(scorers), decoder_weight, on_step, revisers(scorers))

    def search(part: Inputs, part_caps: list[int], first: int) -> list[list[Hypothesis]]:
        beams = _Beams(len(part), beam_size, part_caps, decoder.eos_id, options, first, decoder.device)
        return _beam(decoder, part, options, beams)

    return [sorted(f, key=lambda h: -h.score)[:nbest] for f in in_parts(search, inputs, caps, size)]


def _beam(decoder: Decoder, inputs: Inputs, o: _Options, beams: _Beams) -> list[list]:
    """Beam search of one batch of inputs (:func:`beam_search`; with the bookkeeping of
    ``constrained.py``, its search); every finished hypothesis of each input, unsorted."""
    b, w, caps = len(inputs), o.beam_size, beams.caps
    logits, state = _started(decoder, inputs, o.prefix)  # (B, V)
    rows = torch.arange(b, device=logits.device).repeat_interleave(w)  # (B*W,)
    scoring = [s.start(decoder, state, rows, max(caps)) for s in o.scorers]
    # One beam (greedy) keeps every input's row where it is, at the start and at every step: the
    # reorder would copy the whole state, for Whisper the cross-attention keys and values of
    # 1,500 frames a layer and input (a sixth of decoding 8 FSDD files, torch.profiler, 2026-12-07).
    if w > 1:
        state, logits = decoder.reorder(state, rows), logits.index_select(0, rows)  # (B*W, V)
    for step in range(max(caps)):
        logp, scored = _step_scores(logits, o, scoring, w, decoder.eos_id)  # (B*W, V)
        kept = beams.keep(logp, step)
        if kept is None:
            break
        rows, tokens = kept  # (B*W,) each
        scoring = [s.advance(sc, rows, tokens) for s, sc in zip(o.scorers, scored, strict=True)]
        logits, state = decoder.step(decoder.reorder(state, rows, within_inputs=True) if w > 1 else state, tokens)
    return beams.finished


def _step_scores(logits: Tensor, o: _Options, scoring: list, w: int, eos: int | None) -> tuple[Tensor, list]:
    """Every extension's step score (−∞ outside a partial scorer's candidates) and what each
    scorer needs to advance. Shapes: logits (N, V) -> (N, V)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    scored: list = [None] * len(o.scorers)
    fused = None  # Σ wₖ · scoreₖ of the full scorers
    for k, (s, st) in enumerate(zip(o.scorers, scoring, strict=True)):
        if not s.partial:
            score, scored[k] = s.score(st, None)  # (N, V)
            if s.weight != 0.0:
                fused = s.weight * score if fused is None else fused + s.weight * score
    partial = [k for k, s in enumerate(o.scorers) if s.partial]
    if not partial:
        total = logp if o.decoder_weight == 1.0 else o.decoder_weight * logp  # (N, V)
        return revised(total if fused is None else total + fused, o.revisers), scored
    # The pre-beam ranks by the full scores (ESPnet's "full"), so a partial scorer of weight 0
    # equals none. END is always a candidate: its CTC score (the whole hypothesis') is finite for
    # every live beam, so a beam whose other candidates have no CTC alignment left can end.
    ranked = logp if fused is None else o.decoder_weight * logp + fused  # (N, V)
    if eos is not None:
        ranked = ranked.index_fill(1, torch.tensor([eos], device=logp.device), float("inf"))
    pre_beam = min(logp.shape[-1], max(int(CTC_PRE_BEAM * w), w + 1))
    candidates = ranked.topk(pre_beam, dim=-1).indices  # (N, C)
    joint = o.decoder_weight * logp.gather(1, candidates)  # (N, C)
    for k in partial:
        score, scored[k] = o.scorers[k].score(scoring[k], candidates)  # (N, C)
        if o.scorers[k].weight > 0.0:
            joint = joint + o.scorers[k].weight * score
    total = torch.full_like(logp, float("-inf")).scatter_(1, candidates, joint)  # (N, V)
    return revised(total if fused is None else total + fused, o.revisers), scored


class _Beams:
    """The live beams of B inputs (W each), their scores and histories, and what has finished."""

    def __init__(self, b: int, w: int, caps: list[int], eos: int | None, o: _Options, first: int, device) -> None:
        self.b, self.w, self.caps, self.eos, self.o, self.first = b, w, caps, eos, o, first
        self.scores = torch.full((b, w), float("-inf"), device=device)  # (B, W)
        self.scores[:, 0] = 0.0  # all beams start equal: keep one, or the first step picks W copies
        self.history = torch.zeros((b * w, 0), dtype=torch.long, device=device)  # (B*W, L)
        self.finished: list[list[Hypothesis]] = [[] for _ in range(b)]
        self.done = [False] * b

    def keep(self, logp: Tensor, step: int) -> tuple[Tensor, Tensor] | None:
        """Choose every input's next live beams from the step scores ``logp`` (B*W, V); return
        the rows they extend and their tokens (B*W,) each, or None once every input is done."""
        b, w, device = self.b, self.w, logp.device
        v = logp.shape[-1]
        candidates = (self.scores.view(-1, 1) + logp).view(b, w * v)  # (B, W*V)
        top_scores, top_index = candidates.topk(min(2 * w, w * v), dim=-1)  # (B, 2W)
        top_rows = (top_index // v + torch.arange(b, device=device)[:, None] * w).tolist()  # (B, 2W) rows
        top_tokens, top_scores_list = (top_index % v).tolist(), top_scores.tolist()
        keep_rows, keep_tokens, keep_scores = [], [], []
        for i in range(b):
            kept = [] if self.done[i] else self._input(i, step, top_rows[i], top_tokens[i], top_scores_list[i])
            if self.done[i] or not kept:
                self.done[i] = True
                kept = [(i * w, self.eos if self.eos is not None else 0, float("-inf"))] * w
            kept += [(*kept[-1][:2], float("-inf"))] * (w - len(kept))  # fillers, never chosen again
            for row, token, score in kept:
                keep_rows.append(row)
                keep_tokens.append(token)
                keep_scores.append(score)
        if all(self.done):
            return None
        rows = torch.tensor(keep_rows, device=device)  # (B*W,)
        tokens = torch.tensor(keep_tokens, device=device)  # (B*W,)
        self.history = torch.cat([self.history.index_select(0, rows), tokens[:, None]], dim=1)  # (B*W, L+1)
        self.scores = torch.tensor(keep_scores, device=device).view(b, w)  # (B, W)
        return rows, tokens

    def _input(self, i: int, step: int, rows: list, tokens: list, scores: list) -> list[tuple[int, int, float]]:
        """One input's step: its best 2W extensions (``rows``, ``tokens``, ``scores``) sorted
        into live, finished and dropped; marks it done by Hugging Face's rule or at its cap."""
        w, finished, norm = self.w, self.finished[i], (step + 1) ** self.o.length_penalty
        trace = None if self.o.on_step is None else BeamStep(self.first + i, step)
        kept: list[tuple[int, int, float]] = []
        for j, (row, token, score) in enumerate(zip(rows, tokens, scores, strict=True)):
            if score == float("-inf"):
                break
            if len(kept) == w:
                if trace is None:
                    break
                trace.dropped.append(self._candidate(i, step, row, [token], score))
            elif token == self.eos:
                if j < w:
                    finished.append(Hypothesis(self.history[row].tolist(), score / norm))
                    if trace is not None:
                        trace.ended.append(self._candidate(i, step, row, [], score / norm))
                elif trace is not None:
                    trace.dropped.append(self._candidate(i, step, row, [], score))
            else:
                kept.append((row, token, score))
                if trace is not None:
                    trace.live.append(self._candidate(i, step, row, [token], score))
        if len(finished) >= w:
            # Done once no live beam, scored at the current length, beats the W-th best finished
            # one (Hugging Face's criterion). Stopping as soon as W have ended (fairseq's) lets
            # low-probability early ENDs crowd out the best live beam.
            wth_best = sorted((h.score for h in finished), reverse=True)[w - 1]
            self.done[i] = not kept or kept[0][2] / norm <= wth_best
        if not self.done[i] and step + 1 >= self.caps[i]:
            # The input's cap is reached: its live beams finish here, as they are.
            for row, token, score in kept:
                finished.append(Hypothesis([*self.history[row].tolist(), token], score / norm))
            if trace is not None:
                capped = [Candidate(c.tokens, c.score / norm, c.parent) for c in trace.live]
                trace = BeamStep(trace.input, step, [], trace.ended + capped, trace.dropped, capped=True)
            self.done[i] = True
        if trace is not None:
            self.o.on_step(trace)
        return kept

    def _candidate(self, i: int, step: int, row: int, tokens: list[int], score: float) -> Candidate:
        return Candidate([*self.history[row].tolist(), *tokens], score, None if step == 0 else row - i * self.w)


# ------------------------------------------------------------------------------------ CTC


@torch.no_grad()
def ctc_greedy(model: DecodingModel | Decoder, inputs: list[Tensor]) -> list[list[int]]:
    """CTC-only decoding of a speech model with a CTC head (or an ensemble of them): the encoder
    runs once, the decoder never; each input's best path (:func:`~qkv.ctc.ctc_best_path`).

    Shapes: inputs B tensors (T_b, M) -> B token lists.
    """
    if not inputs:
        return []
    decoder = decoder_for(model)
    if not hasattr(decoder, "ctc_log_probs"):
        raise ValueError("CTC decoding needs a speech model with a CTC head (ctc=True)")
    check_inputs(decoder, inputs, max_new_tokens=1)
    logp, valid = decoder.ctc_log_probs(decoder.encoded(inputs))  # (B, S, V), (B, S)
    return ctc_best_path(logp, valid, blank=decoder.blank)
