"""Before a search: each input's new-token cap, and how many inputs to decode at a time.

What is here: :func:`check_inputs` (caps within the window), :func:`decoding_bytes` (what
decoding holds), :func:`inputs_per_batch` (as many inputs as fit in the memory available) and
:func:`in_parts` (run a search part by part). The searches call them before they start; nothing
here runs a model. What is not here: the searches (``search.py``), the models' facts (each
:class:`~qkv.decoding.decoders.Decoder` gives its own caps and sizes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from qkv.decoding.decoders import Decoder, DecodingModel, Inputs, decoder_for
from qkv.decoding.scorers import Scorer
from qkv.errors import UserError
from qkv.memory import available_memory, human_bytes

MaxNew = int | Sequence[int]  # one cap for all inputs, or one per input
DECODING_SHARE = 0.8  # of the memory available (qkv.memory.available_memory) that decoding may plan for


def check_inputs(
    model: DecodingModel | Decoder, inputs: Inputs, *, max_new_tokens: MaxNew, prefix: Sequence[int] | None = None
) -> list[int]:
    """Check the inputs fit the model's window (``max_len``); return each row's new-token cap.

    ``max_new_tokens`` is one cap for every input or one per input (e.g. a translation
    length rule relative to each source's length).
    A source (encoder-decoder) or prompt (decoder-only) longer than ``max_len`` is refused
    with a ValueError naming its index; a speech model's inputs must be (T, M) feature tensors
    (its encoder positions are computed, so any T fits). Each row's new tokens are capped so
    none of its positions reaches ``max_len``: a target has ``max_len`` positions (BEGIN
    first); a prompt and its continuation share them (an empty prompt starts from BEGIN, one
    position). An encoder-decoder's ``prefix`` (its forced first tokens; None: BEGIN alone)
    takes that many of the target's positions; it must start with BEGIN (``bos_id``) and hold
    token ids of the model's vocabulary, and a decoder-only model takes none (its prompt is its
    input).
    """
    wanted = [max_new_tokens] * len(inputs) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(wanted) != len(inputs):
        raise ValueError(f"{len(wanted)} max_new_tokens values for {len(inputs)} inputs")
    if any(n < 1 for n in wanted):
        raise ValueError(f"max_new_tokens must be at least 1, got {min(wanted)}")
    return decoder_for(model).caps(inputs, wanted, prefix)


def decoding_bytes(model: DecodingModel | Decoder, *, inputs: int, beam: int, source: int, steps: int) -> int:
    """An estimate, in bytes, of the most that decoding ``inputs`` inputs of at most ``source``
    tokens (or feature frames) for ``steps`` new tokens with ``beam`` rows each (hypotheses)
    holds at once, beyond the weights: every decoder layer's self-attention keys and values for
    all rows, twice (a step's reordered or grown copy beside the old one); an encoder-decoder's
    encoder output and cross-attention keys and values, one copy per row; the attention weights
    and feed-forward activations of one layer while the inputs are read; and a step's logits
    four times over (logits, log-probabilities, candidates, their best). In float32 bytes.

    Shapes: rows N = inputs · beam; self-attention cache 2 · layers · N · length · D_kv.
    """
    return decoder_for(model).bytes_needed(inputs=inputs, beam=beam, source=source, steps=steps)


def inputs_per_batch(
    model: DecodingModel | Decoder,
    inputs: Inputs,
    caps: list[int],
    *,
    beam: int,
    prefix: Sequence[int] | None = None,
    scorers: Sequence[Scorer] = (),
) -> int:
    """How many of ``inputs`` to decode at a time (``caps``: their new-token caps, from
    :func:`check_inputs`; ``prefix``: an encoder-decoder's forced first tokens, held in the
    cache beside the new ones; ``scorers``: what the search adds, each holding its own: a fused
    language model its cache of END and every new token of every row) so that
    :func:`decoding_bytes` stays within :data:`DECODING_SHARE` of the memory available: all of
    them when they fit (or when the system says nothing of its memory), else as many as fit. One
    input that alone would not fit is a UserError saying how much it needs and how much there is."""
    available = available_memory()
    if available is None or not inputs:
        return len(inputs)
    decoder = decoder_for(model)
    source = max(1, max(decoder.source_length(row) for row in inputs))
    steps, budget = max(caps) + (len(prefix) - 1 if prefix else 0), available * DECODING_SHARE

    def need(n: int) -> int:
        fused = sum(s.bytes_needed(decoder, inputs=n, beam=beam, source=source, steps=max(caps)) for s in scorers)
        return decoder.bytes_needed(inputs=n, beam=beam, source=source, steps=steps) + fused

    if need(len(inputs)) <= budget:
        return len(inputs)
    one = need(1)
    if one > budget:
        raise UserError(
            f"decoding one input of {source} tokens with beam {beam} for up to {steps} new tokens would take "
            f"about {human_bytes(one)} of memory; {human_bytes(available)} is available (a narrower beam, "
            "shorter inputs or outputs would fit)"
        )
    return max(1, int(budget // one))


def in_parts(search: Callable[[Inputs, list[int], int], list], inputs: Inputs, caps: list[int], size: int) -> list:
    """``search(part, part_caps, first)`` run on ``size`` inputs at a time (``first``: the index
    of the part's first input), its outputs joined in input order: each input's search is its
    own, so the outputs are those of one run over all of them."""
    return [
        out
        for first in range(0, len(inputs), max(1, size))
        for out in search(inputs[first : first + size], caps[first : first + size], first)
    ]
