"""Decoding: one protocol every model family implements, scorers with weights, and searches
that take both.

  * ``decoders.py``: the :class:`Decoder` protocol (``start`` / ``step`` / ``reorder``) and one
    adapter per family (text and speech encoder-decoders, decoder-only, ensembles), picked once
    by :func:`decoder_for`;
  * ``scorers.py``: what a search adds to the decoder's log-probabilities, each with a weight
    (the CTC prefix score, a fused language model, banned tokens; a new one is one class);
  * ``whisper_rules.py``: Whisper's decoding rules as scorers (suppressed tokens, timestamp
    rules);
  * ``bans.py``: scorers that ban token sequences (a checkpoint's ``bad_words_ids``) and words,
    however the tokens spell them;
  * ``search.py``: greedy, sampling, the token stream, batched beam search with an ``on_step``
    hook, CTC best path;
  * ``continuous.py``: continuous batching, a decoding that inputs join and leave between steps;
  * ``constrained.py``: beam search whose outputs contain required terms (dynamic beam
    allocation, Post & Vilar, 2018);
  * ``planning.py``: each input's cap within the window, and how many inputs fit in memory.

Copies of a model prepared for faster decoding (stacked projections, int8) are
``decoding_copies.py``'s; a beam search's trace for the server's page is ``inspection.py``'s,
an ``on_step`` hook. What is not here: tokenization, the models.

The names below are the package's public interface: import them from ``qkv.decoding``.
"""

from qkv.decoding.bans import BannedSequences, BannedWords
from qkv.decoding.constrained import AT_START, Required, bank_sizes, constrained_beam_search
from qkv.decoding.continuous import Continuous, Group
from qkv.decoding.decoders import (
    Decoder,
    DecodingModel,
    Inputs,
    Regrouping,
    decoder_for,
    mean_of_distributions,
    member,
    pad_rows,
)
from qkv.decoding.planning import DECODING_SHARE, MaxNew, check_inputs, decoding_bytes, inputs_per_batch
from qkv.decoding.scorers import (
    BannedTokens,
    CTCPrefixScore,
    LanguageModelScore,
    Revising,
    Scorer,
    joint_scorers,
    revised,
    revisers,
)
from qkv.decoding.search import (
    DONE,
    BeamStep,
    Candidate,
    Hypothesis,
    beam_search,
    collect,
    continuation,
    ctc_greedy,
    filter_logits,
    generate,
    greedy,
    most_likely,
    sample,
    sampler,
    stream,
)
from qkv.decoding.whisper_rules import SuppressTokens, TimestampRules, whisper_scorers

__all__ = [
    "AT_START",
    "DECODING_SHARE",
    "DONE",
    "BannedSequences",
    "BannedTokens",
    "BannedWords",
    "BeamStep",
    "CTCPrefixScore",
    "Candidate",
    "Continuous",
    "Decoder",
    "DecodingModel",
    "Group",
    "Hypothesis",
    "Inputs",
    "LanguageModelScore",
    "MaxNew",
    "Regrouping",
    "Required",
    "Revising",
    "Scorer",
    "SuppressTokens",
    "TimestampRules",
    "bank_sizes",
    "beam_search",
    "check_inputs",
    "collect",
    "constrained_beam_search",
    "continuation",
    "ctc_greedy",
    "decoder_for",
    "decoding_bytes",
    "filter_logits",
    "generate",
    "greedy",
    "inputs_per_batch",
    "joint_scorers",
    "mean_of_distributions",
    "member",
    "most_likely",
    "pad_rows",
    "revised",
    "revisers",
    "sample",
    "sampler",
    "stream",
    "whisper_scorers",
]
