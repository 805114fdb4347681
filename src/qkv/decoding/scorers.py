"""Scorers: what a search adds to the decoder's log-probabilities, each with its weight.

A hypothesis' score is the weighted sum (ESPnet's ``BeamSearch(scorers, weights)``):
    score(g + c) = w_dec · log p_decoder(c | g) + Σₖ wₖ · scoreₖ(c | g).
A *full* scorer scores every token of the vocabulary at once (a language model, banned or
suppressed tokens); a *partial* one scores only the candidates the full scores pre-select
(the CTC prefix score, whose cost grows with every token scored). Adding a scorer is one class
with this interface and no edit to any search:

  * ``start(decoder, state, rows, steps)``: its state for N hypotheses, ``rows`` (N,) the input
    each reads (the decoder and its started state give what it needs of the inputs: the CTC
    head reads the encoder output);
  * ``score(state, candidates)``: unweighted log-scores of every next token (N, V) when
    ``candidates`` is None, else of those candidates (N, C); and what ``advance`` needs;
  * ``advance(scored, rows, tokens)``: the state once hypothesis ``rows[i]`` took ``tokens[i]``;
  * ``bytes_needed(decoder, inputs=, beam=, source=, steps=)``: what it holds, for planning;
  * optionally ``revise(total)`` (:class:`Revising`): a full scorer whose rule reads the step's
    summed scores (the decoder's and the full scorers') revises them once they are summed
    (:func:`revised`): Whisper's timestamp-probability rule (``whisper_rules.py``). A search
    picks the scorers that revise once, when it starts (:func:`revisers`).

What is here: :class:`Scorer` (the protocol) and :class:`Revising` (its optional part),
:class:`CTCPrefixScore` (joint CTC/attention decoding), :class:`LanguageModelScore` (shallow
fusion) and :class:`BannedTokens`. What is not here: the searches that weigh and rank them
(``search.py``), the CTC maths (``ctc.py``).

Shapes use the legend of ``attention.py``: N hypotheses, V vocabulary, C candidates, S frames.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from qkv.ctc import CTCPrefixes, CTCPrefixScorer
from qkv.decoding.decoders import Decoder, DecoderOnlyDecoder, decoder_for
from qkv.models.decoder_only import DecoderOnly

CTC_PRE_BEAM = 1.5  # ESPnet's pre-beam: partial scorers score only the best 1.5·W candidates of a beam


class Scorer(Protocol):
    """One term of a hypothesis' score (see the module docstring).

    Attributes:
        weight: its weight in the sum; 0 scores nothing (the search then equals one without it).
        partial: True when it scores only pre-selected candidates (needs beam search).
    """

    weight: float
    partial: bool

    def start(self, decoder: Decoder, state: object, rows: Tensor, steps: int) -> object: ...

    def score(self, state: object, candidates: Tensor | None) -> tuple[Tensor, object]: ...

    def advance(self, scored: object, rows: Tensor, tokens: Tensor) -> object: ...

    def bytes_needed(self, decoder: Decoder, *, inputs: int, beam: int, source: int, steps: int) -> int:
        """What it holds at most while decoding, in bytes (memory planning)."""
        ...


@runtime_checkable
class Revising(Protocol):
    """The optional part of a :class:`Scorer`: a rule that reads a step's summed scores (the
    decoder's and the full scorers') and revises them. A scorer has it when it has ``revise``."""

    weight: float

    def revise(self, total: Tensor) -> Tensor:
        """The step's summed scores, revised. Shapes: (N, V) -> (N, V)."""
        ...


@dataclass(frozen=True)
class _CTCScored:
    prefixes: CTCPrefixes
    psi: Tensor  # (N, C)
    gamma: Tensor  # (S, 2, N, C)
    candidates: Tensor  # (N, C)


@dataclass
class CTCPrefixScore:
    """Joint CTC/attention decoding (Watanabe et al., 2017, as ESPnet scores it): a candidate c
    of hypothesis g scores log ψ(g + c) − log ψ(g), with the CTC prefix probabilities ψ of
    :class:`~qkv.ctc.CTCPrefixScorer` over the speech model's CTC head, so a hypothesis' CTC
    term is log ψ(g). END scores the probability of exactly g; the blank −∞. With weight λ, the
    decoder's weight is 1 − λ (pass it to the search as ``decoder_weight``); λ = 1 is CTC prefix
    beam search guided by the decoder's candidates. Needs a decoder with ``ctc_log_probs``."""

    weight: float
    partial: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError(f"ctc_weight must be in [0, 1], got {self.weight}")

    def start(self, decoder: Decoder, state: object, rows: Tensor, steps: int) -> tuple[CTCPrefixScorer, CTCPrefixes]:
        if not hasattr(decoder, "ctc_log_probs"):
            raise ValueError("CTC decoding needs a speech model with a CTC head (ctc=True)")
        log_probs, valid = decoder.ctc_log_probs(state)  # (B, S, V), (B, S)
        scorer = CTCPrefixScorer(log_probs, valid, blank=decoder.blank, eos=decoder.eos_id)
        return scorer, scorer.initial(rows)

    def score(self, state: tuple[CTCPrefixScorer, CTCPrefixes], candidates: Tensor | None) -> tuple[Tensor, object]:
        scorer, prefixes = state
        psi, gamma = scorer.score(prefixes, candidates)  # (N, C), (S, 2, N, C)
        gain = psi - prefixes.score[:, None]  # (N, C); −∞ − (−∞) of an impossible prefix is NaN
        gain = gain.nan_to_num(nan=float("-inf"), posinf=float("-inf"))
        return gain, (scorer, _CTCScored(prefixes, psi, gamma, candidates))

    def advance(self, scored: tuple[CTCPrefixScorer, _CTCScored], rows: Tensor, tokens: Tensor) -> object:
        scorer, s = scored
        return scorer, scorer.extend(s.prefixes, s.psi, s.gamma, rows=rows, candidates=s.candidates, tokens=tokens)

    def bytes_needed(self, decoder: Decoder, *, inputs: int, beam: int, source: int, steps: int) -> int:
        # Per-frame log-probabilities of every input, and a step's γ for every candidate of
        # every hypothesis twice (the new and the kept), in float32; ``source`` bounds S.
        candidates = max(int(CTC_PRE_BEAM * beam), beam + 1)
        return 4 * (inputs * source * decoder.vocab_size + 2 * source * 2 * inputs * beam * candidates)


@dataclass
class LanguageModelScore:
    """Shallow fusion (Gulcehre et al., 2015; ESPnet's LM term) with a decoder-only language
    model of the decoder's vocabulary: every token scores log p_LM(c | g), the LM reading each
    hypothesis' tokens after END (it learnt text as documents each ending with END:
    ``tasks/lm.py``), so END is scored as the end of a sentence too. Its window must hold the
    longest output. That its tokens are the decoder's is the caller's to check (their
    tokenizers: ``Tokenizer.same_as``)."""

    lm: DecoderOnly
    weight: float
    partial: bool = False

    def start(self, decoder: Decoder, state: object, rows: Tensor, steps: int) -> tuple[DecoderOnlyDecoder, object]:
        lm = self.lm
        if not isinstance(lm, DecoderOnly):
            raise ValueError(f"the fused language model must be decoder-only, not {type(lm).__name__}")
        if decoder.eos_id is None:
            raise ValueError("fusing a language model needs a decoder with an END token")
        if lm.config.vocab_size != decoder.vocab_size:
            raise ValueError(f"the language model has {lm.config.vocab_size} tokens, the decoder {decoder.vocab_size}")
        if lm.config.max_len < steps:
            raise ValueError(f"the language model's window ({lm.config.max_len}) is shorter than the outputs ({steps})")
        reader = decoder_for(lm)
        inputs = int(rows.max()) + 1 if len(rows) else 0
        logits, lm_state = reader.start([[decoder.eos_id]] * inputs)  # (B, V): it has read END
        return reader, logits.index_select(0, rows), reader.reorder(lm_state, rows)  # (N, V)

    def score(self, state: tuple, candidates: Tensor | None) -> tuple[Tensor, object]:
        logp = torch.log_softmax(state[1].float(), dim=-1)  # (N, V)
        return (logp if candidates is None else logp.gather(1, candidates)), state

    def advance(self, scored: tuple, rows: Tensor, tokens: Tensor) -> object:
        reader, _, lm_state = scored
        logits, lm_state = reader.step(reader.reorder(lm_state, rows), tokens)  # (N, V)
        return reader, logits, lm_state

    def bytes_needed(self, decoder: Decoder, *, inputs: int, beam: int, source: int, steps: int) -> int:
        # Its cache of END and every new token of every hypothesis.
        return decoder_for(self.lm).bytes_needed(inputs=inputs, beam=beam, source=1, steps=steps)


@dataclass
class BannedTokens:
    """Tokens that may never be chosen (−∞), e.g. a tokenizer's unknown token or markup an
    application never wants written. A full scorer of weight 1 with no state."""

    tokens: Sequence[int]
    weight: float = 1.0
    partial: bool = False

    def start(self, decoder: Decoder, state: object, rows: Tensor, steps: int) -> Tensor:
        if any(not 0 <= t < decoder.vocab_size for t in self.tokens):
            raise ValueError(f"banned tokens must be ids in [0, {decoder.vocab_size}), got {list(self.tokens)!r}")
        row = torch.zeros(decoder.vocab_size, device=rows.device)  # (V,)
        row[list(self.tokens)] = float("-inf")
        return row

    def score(self, state: Tensor, candidates: Tensor | None) -> tuple[Tensor, Tensor]:
        return (state[None] if candidates is None else state[candidates]), state  # (1, V) or (N, C)

    def advance(self, scored: Tensor, rows: Tensor, tokens: Tensor) -> Tensor:
        return scored

    def bytes_needed(self, decoder: Decoder, *, inputs: int, beam: int, source: int, steps: int) -> int:
        return 4 * decoder.vocab_size


def revisers(scorers: Sequence[Scorer]) -> tuple[Revising, ...]:
    """The scorers that revise a step's summed scores (:class:`Revising`, with a weight), in
    order: what a search asks once, when it starts, and passes to :func:`revised` every step."""
    return tuple(s for s in scorers if isinstance(s, Revising) and s.weight != 0.0)


def revised(total: Tensor, revising: Sequence[Revising]) -> Tensor:
    """A step's summed scores after every scorer of ``revising`` (:func:`revisers`) revised them,
    in order. Shapes: (N, V) -> (N, V)."""
    for s in revising:
        total = s.revise(total)
    return total


def joint_scorers(
    *, ctc_weight: float | None = None, lm: DecoderOnly | None = None, lm_weight: float = 0.0
) -> tuple[float, list[Scorer]]:
    """The decoder's weight and the scorers of a speech model's usual search, weighed as ESPnet
    weighs them: decoder 1 − λ and the CTC prefix score λ (None: no CTC, decoder 1), plus a fused
    language model with weight β. Pass both to a search (``decoder_weight=``, ``scorers=``)."""
    scorers: list[Scorer] = []
    decoder_weight = 1.0
    if ctc_weight is not None:
        scorers.append(CTCPrefixScore(ctc_weight))
        decoder_weight = 1.0 - ctc_weight
    if lm is not None:
        scorers.append(LanguageModelScore(lm, lm_weight))
    return decoder_weight, scorers
