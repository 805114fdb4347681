"""Model-agnostic decoding: greedy, sampling and beam search, with an explicit KV cache.

What is here: :func:`greedy`, :func:`sample` (with :func:`sampler` and :func:`filter_logits`),
:func:`stream` (one token per step for every row; :func:`continuation` for a single input) and
:func:`beam_search` (batched, length penalty, finished hypotheses kept aside, n-best, optional
shallow fusion of a language model), for a model or an :class:`~qkv.ensemble.Ensemble`.
Each works for an :class:`~qkv.models.encoder_decoder.EncoderDecoder` (inputs are source
sentences; decoding starts from BEGIN, and cross-attention keys/values are computed
once from the encoder output), a :class:`~qkv.models.speech.SpeechEncoderDecoder` (the same,
but inputs are feature sequences) and a :class:`~qkv.models.decoder_only.DecoderOnly` (inputs
are prompts, left-padded into one batch). The cache lives in a small state that is passed
in and out of :func:`_start`, :func:`_advance` and :func:`_select`; models never keep it. The
two encoder-decoder families differ only in how their inputs are read (:func:`_read_sources`).

Inputs are lists of token-id lists, or for a speech model a list of (T, M) feature tensors
(``qkv.audio.features``; a padded batch ``(feats, valid)`` is ``[f[v] for f, v in zip(feats,
valid)]``); outputs are lists of token ids, the new tokens only, without BEGIN and END.
An encoder-decoder's decoding may start from forced tokens instead of BEGIN alone
(``prefix``, BEGIN first: Whisper's ``<|startoftranscript|>``, language, task and
``<|notimestamps|>``); they are fed as if chosen and are not part of the output.

Speech models with a CTC head (Graves et al., 2006) also decode with it: :func:`ctc_greedy`
(the best path: the most likely label per frame, repeats merged, blanks dropped), and
:func:`beam_search` with ``ctc_weight`` λ scores every hypothesis by (1 − λ)·log p_attention +
λ·log p_CTC-prefix (Watanabe et al., 2017, "Hybrid CTC/Attention Architecture for End-to-End
Speech Recognition"), the prefix probabilities from ``ctc.py``'s :class:`~qkv.ctc.CTCPrefixScorer`.

Copies of a model prepared for faster decoding (stacked self-attention projections, int8
weights) are ``decoding_copies.py``'s.

What is not here: tokenization, batching by tokens (callers), models.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import Tensor

from qkv.attention import KVBuffer
from qkv.audio import pad_features
from qkv.ctc import CTCPrefixScorer, ctc_best_path
from qkv.ensemble import Ensemble
from qkv.errors import UserError
from qkv.memory import available_memory, human_bytes
from qkv.models.decoder_only import DecoderOnly
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.models.speech import SpeechEncoderDecoder

EncoderDecoders = EncoderDecoder | SpeechEncoderDecoder  # encode the inputs once, decode from BEGIN
DecodingModel = EncoderDecoder | SpeechEncoderDecoder | DecoderOnly | Ensemble  # what generates text
Inputs = list[list[int]] | list[Tensor]  # token ids, or (T, M) features for a speech model
MaxNew = int | Sequence[int]  # one cap for all inputs, or one per input
DONE = -1  # what :func:`stream` yields for a row that has already finished


def member(model: DecodingModel) -> EncoderDecoder | SpeechEncoderDecoder | DecoderOnly:
    """``model`` itself, or an ensemble's first member (every member is of its family)."""
    return model.models[0] if isinstance(model, Ensemble) else model


@dataclass(frozen=True)
class _Ensembled:
    """The decoding states of an ensemble's models, in its order."""

    states: tuple[_State, ...]  # members are never ensembles (Ensemble checks)


def _mean_of_distributions(logits: list[Tensor]) -> Tensor:
    """log((1/M) Σₘ softmax(logitsₘ)): log-probabilities of the mean distribution, which every
    caller may treat as logits (softmax of log-probabilities gives them back).

    Shapes: M tensors (N, V) -> (N, V).
    """
    if len(logits) == 1:
        return logits[0]
    logp = torch.stack([torch.log_softmax(x.float(), dim=-1) for x in logits])  # (models, N, V)
    return torch.logsumexp(logp, dim=0) - math.log(len(logits))  # (N, V)


class Hypothesis(NamedTuple):
    """A finished beam: its tokens and its length-normalized log-probability."""

    tokens: list[int]
    score: float


@dataclass(frozen=True)
class _State:
    """Everything a decoding step needs besides the new tokens; rows are hypotheses (N)."""

    cache: list
    memory: Tensor | None = None  # (N, S, D), encoder-decoders only
    src_mask: Tensor | None = None  # (N, S) (None: all real)
    key_mask: Tensor | None = None  # (N, P), decoder-only: real tokens so far (None: all real)
    next_position: Tensor | None = None  # (N,), decoder-only: position of the next token


def pad_rows(
    rows: list[list[int]], value: int, *, left: bool = False, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """Pad token lists into a (B, L) tensor and its (B, L) validity mask (True at real tokens)."""
    length = max(1, max(len(r) for r in rows))
    tokens = torch.full((len(rows), length), value, dtype=torch.long, device=device)
    valid = torch.zeros((len(rows), length), dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        if r:
            span = slice(length - len(r), length) if left else slice(0, len(r))
            tokens[i, span] = torch.tensor(r, dtype=torch.long, device=device)
            valid[i, span] = True
    return tokens, valid


def check_inputs(
    model: DecodingModel, inputs: Inputs, *, max_new_tokens: MaxNew, prefix: Sequence[int] | None = None
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
    window = model.config.max_len
    forced = _prefix_length(model, prefix)
    if isinstance(member(model), SpeechEncoderDecoder):
        n_mels = model.config.features.n_mels
        for i, row in enumerate(inputs):
            if not isinstance(row, Tensor) or row.dim() != 2 or row.shape[1] != n_mels:
                shape = tuple(row.shape) if isinstance(row, Tensor) else type(row).__name__
                raise ValueError(f"input {i} must be a (T, {n_mels}) feature tensor, got {shape}")
        return [min(n, window - forced + 1) for n in wanted]
    for i, row in enumerate(inputs):
        if len(row) > window:
            raise ValueError(f"input {i} has {len(row)} tokens; the model takes at most max_len={window}")
    if isinstance(member(model), EncoderDecoder):
        return [min(n, window - forced + 1) for n in wanted]
    return [max(1, min(n, window - max(1, len(row)) + 1)) for n, row in zip(wanted, inputs, strict=True)]


def _prefix_length(model: DecodingModel, prefix: Sequence[int] | None) -> int:
    """The target positions an encoder-decoder's forced first tokens take (1: BEGIN alone);
    a ValueError for a prefix that does not start with BEGIN, is outside the vocabulary or
    longer than the window, or is given to a decoder-only model."""
    if prefix is None:
        return 1
    c = model.config
    if isinstance(member(model), DecoderOnly):
        raise ValueError("prefix is for encoder-decoder and speech models; a decoder-only model's prompt is its input")
    vocab = getattr(c, "tgt_vocab_size", None) or c.vocab_size
    if not prefix or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prefix):
        raise ValueError(f"prefix must be one or more token ids in [0, {vocab}), got {list(prefix)!r}")
    if prefix[0] != c.bos_id:
        raise ValueError(f"prefix must start with BEGIN (bos_id={c.bos_id}), got {list(prefix)!r}")
    if len(prefix) > c.max_len:
        raise ValueError(f"a prefix of {len(prefix)} tokens does not fit the window max_len={c.max_len}")
    return len(prefix)


DECODING_SHARE = 0.8  # of the memory available (qkv.memory.available_memory) that decoding may plan for


def decoding_bytes(model: DecodingModel, *, inputs: int, beam: int, source: int, steps: int) -> int:
    """An estimate, in bytes, of the most that decoding ``inputs`` inputs of at most ``source``
    tokens (or feature frames) for ``steps`` new tokens with ``beam`` rows each (hypotheses)
    holds at once, beyond the weights: every decoder layer's self-attention keys and values for
    all rows, twice (a step's reordered or grown copy beside the old one); an encoder-decoder's
    encoder output and cross-attention keys and values, one copy per row; the attention weights
    and feed-forward activations of one layer while the inputs are read; and a step's logits
    four times over (logits, log-probabilities, candidates, their best). In float32 bytes.

    Shapes: rows N = inputs · beam; self-attention cache 2 · layers · N · length · D_kv.
    """
    total = 0
    for m in model.models if isinstance(model, Ensemble) else (model,):
        c = m.config
        if not hasattr(c, "d_model"):  # a stand-in model without sizes: nothing to estimate
            continue
        rows = inputs * beam
        d_kv = c.d_model // c.n_heads * (getattr(c, "n_kv_heads", None) or c.n_heads)
        vocab = getattr(c, "tgt_vocab_size", None) or c.vocab_size
        if isinstance(m, DecoderOnly):
            layers, length, cross = c.n_layers, source + steps, 0
        else:
            layers, length = c.n_decoder_layers, steps
            cross = (2 * layers + 1) * rows * source * c.d_model
        reading = inputs * source * (c.n_heads * source + max(c.d_ff, c.d_model))
        total += 4 * (2 * 2 * layers * rows * length * d_kv + cross + reading + 4 * rows * vocab)
    return total


def inputs_per_batch(
    model: DecodingModel,
    inputs: Inputs,
    caps: list[int],
    *,
    beam: int,
    prefix: Sequence[int] | None = None,
    lm: DecoderOnly | None = None,
) -> int:
    """How many of ``inputs`` to decode at a time (``caps``: their new-token caps, from
    :func:`check_inputs`; ``prefix``: an encoder-decoder's forced first tokens, held in the
    cache beside the new ones; ``lm``: a fused language model, whose cache of END and every
    new token of every row is held beside the decoder's) so that :func:`decoding_bytes` stays
    within :data:`DECODING_SHARE` of the memory available: all of them when they fit (or when
    the system says nothing of its memory), else as many as fit. One input that alone would not
    fit is a UserError saying how much it needs and how much there is."""
    available = available_memory()
    if available is None or not inputs:
        return len(inputs)
    source = max(1, max(row.shape[0] if isinstance(row, Tensor) else len(row) for row in inputs))
    steps, budget = max(caps) + (len(prefix) - 1 if prefix else 0), available * DECODING_SHARE

    def need(n: int) -> int:
        fused = 0 if lm is None else decoding_bytes(lm, inputs=n, beam=beam, source=1, steps=max(caps))
        return decoding_bytes(model, inputs=n, beam=beam, source=source, steps=steps) + fused

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


def _parts(inputs: Inputs, max_new_tokens: MaxNew, size: int) -> Iterator[tuple[Inputs, MaxNew]]:
    """``inputs`` and their caps, ``size`` inputs at a time."""
    for start in range(0, len(inputs), size):
        caps = max_new_tokens if isinstance(max_new_tokens, int) else list(max_new_tokens)[start : start + size]
        yield inputs[start : start + size], caps


def _read_sources(model: EncoderDecoder | SpeechEncoderDecoder, inputs: Inputs) -> tuple[Tensor, Tensor]:
    """An encoder-decoder's encoder output and its valid positions: token ids right-padded
    (EncoderDecoder), or feature tensors padded into a batch (SpeechEncoderDecoder).

    Shapes: B inputs -> memory (B, S, D), valid (B, S) bool.
    """
    device = next(model.parameters()).device
    if isinstance(model, SpeechEncoderDecoder):
        features, valid = pad_features([f.to(device) for f in inputs])  # (B, T, M), (B, T)
        return model.encode(features, valid)  # (B, S, D), (B, S)
    src, src_mask = pad_rows(inputs, model.config.pad_id, left=False, device=device)  # (B, S)
    return model.encode(src, src_mask=src_mask), src_mask  # (B, S, D), (B, S)


def _start(model: DecodingModel, inputs: Inputs) -> tuple[Tensor, _State]:
    """Read the inputs; return the logits of the first new token (B, V) and the state."""
    if isinstance(model, Ensemble):
        started = [_start(m, inputs) for m in model.models]
        return _mean_of_distributions([x for x, _ in started]), _Ensembled(tuple(st for _, st in started))
    device = next(model.parameters()).device
    c = model.config
    if isinstance(model, EncoderDecoders):
        memory, src_mask = _read_sources(model, inputs)  # (B, S, D), (B, S)
        # Without padding (e.g. one input) no key is ever masked: a None mask spares every
        # cross-attention call of every step its mask work (decoding is per-op overhead bound).
        src_mask = None if bool(src_mask.all()) else src_mask
        bos = torch.full((len(inputs), 1), c.bos_id, dtype=torch.long, device=device)  # (B, 1)
        out = model.decode(bos, memory, src_mask=src_mask)
        return out.logits[:, -1], _State(out.cache, memory=memory, src_mask=src_mask)  # (B, V)
    if not all(inputs):
        if c.bos_id is None:
            raise ValueError("an empty prompt needs a model with a bos_id")
        inputs = [r or [c.bos_id] for r in inputs]
    prompt, valid = pad_rows(inputs, c.pad_id or 0, left=True, device=device)  # (B, P)
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)  # (B, P): each row counts from its first token
    out = model.decode(prompt, key_mask=valid, positions=positions)
    # As above: prompts of one length need no key mask, so the steps need no self-attention mask.
    state = _State(out.cache, key_mask=None if bool(valid.all()) else valid, next_position=valid.sum(1))
    return out.logits[:, -1], state  # (B, V)


def _start_from(model: DecodingModel, inputs: Inputs, prefix: Sequence[int] | None) -> tuple[Tensor, _State]:
    """:func:`_start`, then the rest of an encoder-decoder's forced first tokens ``prefix``
    (BEGIN first; None: BEGIN alone), one step each as if chosen."""
    logits, state = _start(model, inputs)  # (B, V)
    for token in (prefix or [])[1:]:
        logits, state = _advance(
            model, state, torch.full((len(inputs),), token, dtype=torch.long, device=logits.device)
        )  # (B, V)
    return logits, state


def _advance(model: DecodingModel, state: _State, tokens: Tensor) -> tuple[Tensor, _State]:
    """Feed one new token per row (N,); return the next logits (N, V) and the new state."""
    if isinstance(model, Ensemble):
        stepped = [_advance(m, st, tokens) for m, st in zip(model.models, state.states, strict=True)]
        return _mean_of_distributions([x for x, _ in stepped]), _Ensembled(tuple(st for _, st in stepped))
    if isinstance(model, EncoderDecoders):
        out = model.decode(tokens[:, None], state.memory, src_mask=state.src_mask, cache=state.cache)  # (N, 1, V)
        return out.logits[:, -1], replace(state, cache=out.cache)
    key_mask = None
    if state.key_mask is not None:
        new = torch.ones_like(tokens[:, None], dtype=torch.bool)  # (N, 1)
        key_mask = torch.cat([state.key_mask, new], dim=1)  # (N, P+1)
    # A row past its cap (check_inputs) keeps being fed, its output ignored; clamping its
    # position keeps a learned position table from being indexed past its end.
    positions = state.next_position.clamp(max=model.config.max_len - 1)[:, None]  # (N, 1)
    out = model.decode(tokens[:, None], key_mask=key_mask, positions=positions, cache=state.cache)
    return out.logits[:, -1], replace(state, cache=out.cache, key_mask=key_mask, next_position=state.next_position + 1)


def _growable(state: _State, *, room: int) -> _State:
    """The same state with every self-attention cache preallocated (:class:`KVBuffer`) with
    ``room`` more positions, so steps write keys and values in place instead of concatenating.
    Only for loops that never branch or reorder rows (:func:`stream`)."""
    if isinstance(state, _Ensembled):
        return _Ensembled(tuple(_growable(st, room=room) for st in state.states))
    cache = [
        (KVBuffer.holding(self_kv, capacity=self_kv[0].shape[2] + room), cross_kv) for self_kv, cross_kv in state.cache
    ]
    return replace(state, cache=cache)


def _map(obj, fn: Callable[[Tensor], Tensor]):
    """Apply ``fn`` to every tensor in nested lists/tuples (the cache)."""
    if isinstance(obj, KVBuffer):
        # Its buffers are shared and written in place: picking rows of them would either copy
        # nothing (wrong rows afterwards) or break the one-writer rule. Only stream() grows them.
        raise TypeError("a KVBuffer cache cannot be reordered: beam search keeps (k, v) tuples")
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(o, fn) for o in obj)
    return obj


def _select(state: _State, rows: Tensor, *, within_inputs: bool = False) -> _State:
    """Keep, repeat or reorder hypotheses: row i of the result is row ``rows[i]``.

    ``within_inputs`` says every row is taken from a row of the same input (as beam search
    does between steps): then the encoder output, its mask and the cross-attention keys and
    values, identical across an input's rows, are kept as they are instead of copied.
    """
    if isinstance(state, _Ensembled):
        return _Ensembled(tuple(_select(st, rows, within_inputs=within_inputs) for st in state.states))

    def pick(t: Tensor) -> Tensor:
        return t.index_select(0, rows)  # (N, ...) rows picked

    if within_inputs:
        cache = [(_map(self_kv, pick), cross_kv) for self_kv, cross_kv in state.cache]
        return replace(
            state, cache=cache, key_mask=_map(state.key_mask, pick), next_position=_map(state.next_position, pick)
        )
    return _State(
        _map(state.cache, pick),
        memory=_map(state.memory, pick),
        src_mask=_map(state.src_mask, pick),
        key_mask=_map(state.key_mask, pick),
        next_position=_map(state.next_position, pick),
    )


def _eos(model: DecodingModel) -> int | None:
    return model.config.eos_id


@torch.no_grad()
def stream(
    model: DecodingModel,
    inputs: Inputs,
    *,
    max_new_tokens: MaxNew,
    choose: Callable[[Tensor], Tensor],
    prefix: Sequence[int] | None = None,
) -> Iterator[Tensor]:
    """Yield one new token per row (B,) per step; ``choose`` maps logits (B, V) to tokens (B,).
    An encoder-decoder's decoding starts from ``prefix`` (None: BEGIN), which is not yielded.

    A row yields its tokens, END included, then :data:`DONE` once it has ended: by END or
    by reaching its cap (``max_new_tokens``, or less where the window is full). The loop
    ends when every row has.
    """
    if not inputs:
        return
    eos = _eos(model)
    caps = check_inputs(model, inputs, max_new_tokens=max_new_tokens, prefix=prefix)
    inputs_per_batch(model, inputs, caps, beam=1, prefix=prefix)  # refuses an input that alone would not fit
    logits, state = _start_from(model, inputs, prefix)  # (B, V)
    state = _growable(state, room=max(caps))
    cap = torch.tensor(caps, device=logits.device)  # (B,)
    finished = torch.zeros(len(inputs), dtype=torch.bool, device=logits.device)
    for step in range(max(caps)):
        chosen = choose(logits)  # (B,)
        yield chosen.masked_fill(finished, DONE)
        finished = finished | (step + 1 >= cap)
        if eos is not None:
            finished = finished | (chosen == eos)
        if bool(finished.all()):
            return
        logits, state = _advance(model, state, chosen)


def _collect(model: DecodingModel, steps: Iterator[Tensor], n: int) -> list[list[int]]:
    eos = _eos(model)
    out: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    for tokens in steps:
        for i, t in enumerate(tokens.tolist()):
            if done[i] or t == eos or t == DONE:
                done[i] = True
                continue
            out[i].append(t)
    return out


def most_likely(logits: Tensor) -> Tensor:
    """The greedy ``choose`` for :func:`stream`. Shapes: logits (B, V) -> tokens (B,)."""
    return logits.argmax(-1)


def continuation(
    model: DecodingModel,
    prompt: list[int],
    *,
    max_new_tokens: int,
    choose: Callable[[Tensor], Tensor],
    slide: bool = False,
) -> Iterator[int]:
    """The new tokens of one input, one at a time, ending before END (or at the cap).

    Without ``slide`` the output stops where the window is full. With ``slide`` (decoder-only
    models and their ensembles) it goes on: a prompt longer than the window keeps its newest ``max_len`` tokens,
    and whenever the window is full the newest ``max_len // 2`` tokens are read again from
    position 0 and generation continues from them. nanoGPT crops to the window before every
    token (a full forward pass each time); re-reading half a window once per ``max_len // 2``
    tokens keeps the KV cache useful in between.
    """
    eos = _eos(model)
    if not slide or not isinstance(member(model), DecoderOnly):
        for tokens in stream(model, [prompt], max_new_tokens=max_new_tokens, choose=choose):
            token = int(tokens[0])
            if token in (eos, DONE):
                return
            yield token
        return
    window = model.config.max_len
    seen = list(prompt)
    context = seen[-window:]
    produced = 0
    while produced < max_new_tokens:
        room = window - len(context) + 1  # new tokens before the window is full (check_inputs)
        for tokens in stream(model, [context], max_new_tokens=min(room, max_new_tokens - produced), choose=choose):
            token = int(tokens[0])
            if token in (eos, DONE):
                return
            yield token
            seen.append(token)
            produced += 1
        context = seen[-max(1, window // 2) :]


def greedy(
    model: DecodingModel, inputs: Inputs, *, max_new_tokens: MaxNew, prefix: Sequence[int] | None = None
) -> list[list[int]]:
    """Pick the most likely token at every step. A batch whose decoding would not fit in memory
    is decoded in parts (:func:`inputs_per_batch`); the outputs are the same. An encoder-decoder
    starts from ``prefix`` (its forced first tokens, BEGIN first; None: BEGIN alone), which the
    outputs leave out."""
    caps = check_inputs(model, inputs, max_new_tokens=max_new_tokens, prefix=prefix)
    size = inputs_per_batch(model, inputs, caps, beam=1, prefix=prefix)
    if size < len(inputs):
        return [
            out
            for part, part_caps in _parts(inputs, max_new_tokens, size)
            for out in greedy(model, part, max_new_tokens=part_caps, prefix=prefix)
        ]
    steps = stream(model, inputs, max_new_tokens=max_new_tokens, choose=most_likely, prefix=prefix)
    return _collect(model, steps, len(inputs))


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


def sample(
    model: DecodingModel,
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
    if generator is None:
        generator = torch.Generator(device=next(member(model).parameters()).device)
        if seed is not None:
            generator.manual_seed(seed)
        else:
            generator.seed()
    choose = sampler(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    size = inputs_per_batch(model, inputs, check_inputs(model, inputs, max_new_tokens=max_new_tokens), beam=1)
    return [
        out
        for part, caps in _parts(inputs, max_new_tokens, size)
        for out in _collect(model, stream(model, part, max_new_tokens=caps, choose=choose), len(part))
    ]


# ------------------------------------------------------------------------------------ CTC


def _ctc_log_probs(model: DecodingModel, state: _State | _Ensembled) -> tuple[Tensor, Tensor]:
    """The CTC head's per-frame log-probabilities over the encoder output a decoding state holds
    (an ensemble: of the mean of its members' distributions), and the real frames.

    Shapes: returns (B, S, V) and (B, S) bool.
    """
    if isinstance(model, Ensemble):
        parts = [_ctc_log_probs(m, st) for m, st in zip(model.models, state.states, strict=True)]
        valid = parts[0][1]
        if any(lp.shape != parts[0][0].shape or not torch.equal(v, valid) for lp, v in parts):
            raise ValueError("ensemble members subsample frames differently: their CTC outputs cannot be averaged")
        logp = torch.stack([lp for lp, _ in parts])  # (models, B, S, V)
        return torch.logsumexp(logp, dim=0) - math.log(len(parts)), valid
    if not isinstance(model, SpeechEncoderDecoder) or model.ctc is None:
        raise ValueError("CTC decoding needs a speech model with a CTC head (ctc=True)")
    logits = model.ctc_logits(state.memory)  # (B, S, V)
    valid = state.src_mask
    if valid is None:
        valid = torch.ones(logits.shape[:2], dtype=torch.bool, device=logits.device)  # (B, S)
    return torch.log_softmax(logits.float(), dim=-1), valid


def _encoded(model: DecodingModel, inputs: Inputs) -> _State | _Ensembled:
    """A decoding state holding only the encoder output of ``inputs`` (no decoder step)."""
    if isinstance(model, Ensemble):
        return _Ensembled(tuple(_encoded(m, inputs) for m in model.models))
    memory, valid = _read_sources(model, inputs)  # (B, S, D), (B, S)
    return _State([], memory=memory, src_mask=valid)


@torch.no_grad()
def ctc_greedy(model: DecodingModel, inputs: list[Tensor]) -> list[list[int]]:
    """CTC-only decoding of a speech model with a CTC head (or an ensemble of them): the encoder
    runs once, the decoder never; each input's best path (:func:`ctc_best_path`).

    Shapes: inputs B tensors (T_b, M) -> B token lists.
    """
    if not inputs:
        return []
    if not isinstance(member(model), SpeechEncoderDecoder):
        raise ValueError("CTC decoding needs a speech model with a CTC head (ctc=True)")
    check_inputs(model, inputs, max_new_tokens=1)
    logp, valid = _ctc_log_probs(model, _encoded(model, inputs))  # (B, S, V), (B, S)
    return ctc_best_path(logp, valid, blank=model.config.blank)


CTC_PRE_BEAM = 1.5  # ESPnet's pre-beam: CTC scores only the best 1.5·W attention candidates of a beam


@torch.no_grad()
def beam_search(
    model: DecodingModel,
    inputs: Inputs,
    *,
    beam_size: int,
    max_new_tokens: MaxNew,
    length_penalty: float = 1.0,
    nbest: int = 1,
    ctc_weight: float | None = None,
    prefix: Sequence[int] | None = None,
    lm: DecoderOnly | None = None,
    lm_weight: float = 0.0,
) -> list[list[Hypothesis]]:
    """Batched beam search; returns the ``nbest`` best hypotheses of every input, best first.

    Each step scores all W·V extensions of the W live beams of an input and takes the best
    2W: an extension ending in END (among the top W) becomes a finished hypothesis, set
    aside with score log p / length^length_penalty (length counts END); the best W others
    live on. An input is done when W hypotheses have finished and the best live beam, scored
    at the current length, is no better than the W-th best of them (Hugging Face's rule; with
    a length penalty > 0 a live beam could in principle still overtake, so it is a heuristic,
    not a bound). Beams still alive at the input's cap (``max_new_tokens``, or less where the
    window is full) finish there. With ``beam_size=1`` this is exactly greedy search.

    ``ctc_weight`` λ (a speech model with a CTC head): joint CTC/attention decoding (Watanabe et
    al., 2017, as ESPnet scores it). Each step, END and the best max(⌊1.5·W⌋, W + 1) − 1
    other tokens of a beam by attention (and the LM) are its candidates (END always: a beam can
    always end, so every input gets a hypothesis); each is scored (1 − λ)·log p_attention(c | g) +
    λ·(log ψ(g + c) − log ψ(g)) with the CTC prefix probabilities ψ of
    :class:`CTCPrefixScorer` (so a hypothesis' score is (1 − λ)·log p_attention + λ·log ψ),
    every other token −∞. λ = 1 is CTC prefix beam search guided by the decoder's candidates.
    λ = 0 runs all of it with the CTC term weighted zero and returns exactly what ``None``
    (attention only, with the same LM if any) returns: a beam's candidates always include END
    and the W others that its search could keep.

    ``prefix``: an encoder-decoder's forced first tokens (BEGIN first; None: BEGIN alone), read
    before the search and left out of every hypothesis (and of its length).

    ``lm`` with ``lm_weight`` β: shallow fusion (Gulcehre et al., 2015; ESPnet's LM term; with
    CTC, the pre-beam ranks candidates by (1 − λ)·log p_attention + β·log p_LM) with a
    decoder-only language model of the same vocabulary: every candidate's score gains
    β·log p_LM(c | g), the LM reading each beam's tokens after END (it learnt text as documents
    each ending with END: ``tasks/lm.py``), so END is scored as the end of a sentence too. Its
    window must hold the longest output. β = 0 returns exactly what no LM returns.
    """
    if not 1 <= nbest <= beam_size:
        raise ValueError(f"nbest must be between 1 and beam_size={beam_size}, got {nbest}")
    if ctc_weight is not None and not 0.0 <= ctc_weight <= 1.0:
        raise ValueError(f"ctc_weight must be in [0, 1], got {ctc_weight}")
    if not inputs:
        return []
    eos = _eos(model)
    caps = check_inputs(model, inputs, max_new_tokens=max_new_tokens, prefix=prefix)
    size = inputs_per_batch(model, inputs, caps, beam=beam_size, prefix=prefix, lm=lm)
    if size < len(inputs):  # decoded in parts that fit in memory; each input's search is its own
        options = {
            "beam_size": beam_size,
            "length_penalty": length_penalty,
            "nbest": nbest,
            "ctc_weight": ctc_weight,
            "prefix": prefix,
            "lm": lm,
            "lm_weight": lm_weight,
        }
        return [
            h
            for part, cap in _parts(inputs, max_new_tokens, size)
            for h in beam_search(model, part, max_new_tokens=cap, **options)
        ]
    b, w = len(inputs), beam_size
    logits, state = _start_from(model, inputs, prefix)  # (B, V)
    device = logits.device
    rows = torch.arange(b, device=device).repeat_interleave(w)  # (B*W,)
    scorer = prefixes = None
    if ctc_weight is not None:
        log_probs, valid = _ctc_log_probs(model, state)  # (B, S, V), (B, S)
        scorer = CTCPrefixScorer(log_probs, valid, blank=model.config.blank, eos=eos)
        prefixes = scorer.initial(rows)
        pre_beam = min(logits.shape[-1], max(int(CTC_PRE_BEAM * w), w + 1))
        end = None if eos is None else torch.tensor([eos], device=device)  # (1,)
    state, logits = _select(state, rows), logits.index_select(0, rows)  # (B*W, V)
    if lm is not None:
        lm_logits, lm_state = _start_lm(lm, logits.shape[-1], eos, b, max(caps))  # (B, V)
        lm_state, lm_logits = _select(lm_state, rows), lm_logits.index_select(0, rows)  # (B*W, V)
    scores = torch.full((b, w), float("-inf"), device=device)
    scores[:, 0] = 0.0  # all beams start equal: keep one, or the first step picks W copies
    history = torch.zeros((b * w, 0), dtype=torch.long, device=device)  # (B*W, L)
    finished: list[list[Hypothesis]] = [[] for _ in range(b)]
    done = [False] * b
    for step in range(max(caps)):
        logp = torch.log_softmax(logits.float(), dim=-1)  # (B*W, V)
        fused = None
        if lm is not None and lm_weight != 0.0:
            fused = lm_weight * torch.log_softmax(lm_logits.float(), dim=-1)  # (B*W, V)
        if scorer is not None:
            # Ranked with the LM (ESPnet's "full" pre-beam), so λ = 0 equals no CTC with an LM too.
            # END is always a candidate: its CTC score (the whole hypothesis') is finite for every
            # live beam, so a beam whose other candidates have no CTC alignment left can end.
            full = logp if fused is None else (1.0 - ctc_weight) * logp + fused  # (B*W, V)
            ranked = full if end is None else full.index_fill(1, end, float("inf"))  # (B*W, V)
            ctc_candidates = ranked.topk(pre_beam, dim=-1).indices  # (B*W, C)
            psi, gamma = scorer.score(prefixes, ctc_candidates)  # (B*W, C), (S, 2, B*W, C)
            joint = (1.0 - ctc_weight) * logp.gather(1, ctc_candidates)  # (B*W, C)
            if ctc_weight > 0.0:
                gain = psi - prefixes.score[:, None]  # (B*W, C); −∞ − (−∞) of an impossible prefix is NaN
                joint = joint + ctc_weight * gain.nan_to_num(nan=float("-inf"), posinf=float("-inf"))
            logp = torch.full_like(logp, float("-inf")).scatter_(1, ctc_candidates, joint)  # (B*W, V)
        if fused is not None:
            logp = logp + fused  # (B*W, V)
        v = logp.shape[-1]
        candidates = (scores.view(-1, 1) + logp).view(b, w * v)  # (B, W*V)
        top_scores, top_index = candidates.topk(min(2 * w, w * v), dim=-1)  # (B, 2W)
        top_rows = (top_index // v + torch.arange(b, device=device)[:, None] * w).tolist()  # (B, 2W) rows
        top_tokens, top_scores_list = (top_index % v).tolist(), top_scores.tolist()
        length_norm = (step + 1) ** length_penalty
        keep_rows, keep_tokens, keep_scores = [], [], []
        for i in range(b):
            kept = []
            if not done[i]:
                for j, (row, token, score) in enumerate(
                    zip(top_rows[i], top_tokens[i], top_scores_list[i], strict=True)
                ):
                    if score == float("-inf") or len(kept) == w:
                        break
                    if token == eos:
                        if j < w:
                            finished[i].append(Hypothesis(history[row].tolist(), score / length_norm))
                    else:
                        kept.append((row, token, score))
                if len(finished[i]) >= w:
                    # Done once no live beam, scored at the current length, beats the W-th best
                    # finished one (Hugging Face's criterion). Stopping as soon as W have ended
                    # (fairseq's) lets low-probability early ENDs crowd out the best live beam.
                    wth_best = sorted((h.score for h in finished[i]), reverse=True)[w - 1]
                    done[i] = not kept or kept[0][2] / length_norm <= wth_best
                if not done[i] and step + 1 >= caps[i]:
                    # The input's cap is reached: its live beams finish here, as they are.
                    for row, token, score in kept:
                        finished[i].append(Hypothesis([*history[row].tolist(), token], score / length_norm))
                    done[i] = True
            if done[i] or not kept:
                done[i] = True
                kept = [(i * w, eos if eos is not None else 0, float("-inf"))] * w
            kept += [(*kept[-1][:2], float("-inf"))] * (w - len(kept))
            for row, token, score in kept:
                keep_rows.append(row)
                keep_tokens.append(token)
                keep_scores.append(score)
        if all(done):
            break
        rows = torch.tensor(keep_rows, device=device)
        tokens = torch.tensor(keep_tokens, device=device)  # (B*W,)
        history = torch.cat([history.index_select(0, rows), tokens[:, None]], dim=1)  # (B*W, L+1)
        scores = torch.tensor(keep_scores, device=device).view(b, w)  # (B, W)
        if scorer is not None:
            prefixes = scorer.extend(prefixes, psi, gamma, rows=rows, candidates=ctc_candidates, tokens=tokens)
        logits, state = _advance(model, _select(state, rows, within_inputs=True), tokens)
        if lm is not None:
            lm_logits, lm_state = _advance(lm, _select(lm_state, rows), tokens)  # (B*W, V)
    return [sorted(f, key=lambda h: -h.score)[:nbest] for f in finished]


def _start_lm(lm: DecoderOnly, vocab_size: int, eos: int | None, inputs: int, steps: int) -> tuple[Tensor, _State]:
    """A fused language model's first logits (B, V) and state: it has read END, where one of
    its documents ends and the next begins. Refused unless it has the decoder's vocabulary
    size and a window of at least ``steps`` (at the last step it has read END and steps − 1
    tokens); that the tokens are the same ones is the caller's to check (their tokenizers:
    ``Tokenizer.same_as``)."""
    if not isinstance(lm, DecoderOnly):
        raise ValueError(f"the fused language model must be decoder-only, not {type(lm).__name__}")
    if eos is None:
        raise ValueError("fusing a language model needs a decoder with an END token")
    if lm.config.vocab_size != vocab_size:
        raise ValueError(f"the language model has {lm.config.vocab_size} tokens, the decoder {vocab_size}")
    if lm.config.max_len < steps:
        raise ValueError(f"the language model's window ({lm.config.max_len}) is shorter than the outputs ({steps})")
    return _start(lm, [[eos]] * inputs)
