"""The decoding protocol and the one adapter each model family implements it with.

A search (``search.py``) asks a model for four things and nothing else, whatever its family
(openai/whisper's ``Inference``, ESPnet's decoder-as-scorer):

  * ``start(inputs)``: read the inputs (encode the sources, or read the prompts); return the
    logits of the first new token (B, V) and a state;
  * ``step(state, tokens)``: feed one chosen token per row (N,); return the next logits (N, V)
    and the new state;
  * ``feed(state, tokens)``: read forced tokens (N, L) in one call, as L steps would (an
    encoder-decoder's start tokens, Whisper's previous-text prompt: openai/whisper reads its
    prompt in one forward pass too); return the logits after the last (N, V) and the state;
  * ``reorder(state, rows)``: keep, repeat or reorder the rows (hypotheses) of a state.

Beside them, what memory planning and input checks need: ``caps`` (each input's new-token cap
within the window), ``bytes_needed`` (an estimate of what decoding holds), ``source_length``,
``reserve`` (preallocate the self-attention cache of a loop that never reorders). A decoder
whose rows may join and leave a running decoding (continuous batching, ``continuous.py``) also
has ``regroup(parts)``: the chosen rows of several states as one state (:class:`Regrouping`;
the decoder-only adapter and ensembles of it).

What is here: :class:`Decoder` and :class:`Regrouping` (the protocols), :class:`TextEncoderDecoder`,
:class:`SpeechEncoderDecoderDecoder`, :class:`DecoderOnlyDecoder`, :class:`EnsembleDecoder`
(the mean of its members' distributions) and :func:`decoder_for`, which picks the adapter of a
model once, when a search is given a model. The states are each adapter's own: a search never
looks inside one. What is not here: the searches, scorers, memory planning (their own modules),
the models (``models/``).

Shapes use the legend of ``attention.py``: B inputs, N hypotheses (rows: B times the beam),
S source positions, P prompt positions, V vocabulary, D model width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.audio import pad_features
from qkv.blocks import cache_length
from qkv.ensemble import Ensemble
from qkv.kv_cache import KVBuffer, KVCache
from qkv.models.decoder_only import DecoderOnly
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.models.speech import SpeechEncoderDecoder

DecodingModel = EncoderDecoder | SpeechEncoderDecoder | DecoderOnly | Ensemble  # what generates text
Inputs = list[list[int]] | list[Tensor]  # token ids, or (T, M) features for a speech model


class Decoder(Protocol):
    """What every search needs of a model; one adapter per family implements it.

    Attributes:
        eos_id: END (None: the model has none, and outputs run to their cap).
        window: the positions a target (or a prompt and its continuation) may take (max_len).
        vocab_size: V, the size of every step's logits.
        prompted: True when the output continues the input in one window (decoder-only).
    """

    eos_id: int | None
    window: int
    vocab_size: int
    prompted: bool
    device: torch.device

    def start(self, inputs: Inputs) -> tuple[Tensor, object]:
        """Logits of the first new token (B, V) and the state after reading ``inputs``."""
        ...

    def step(self, state: object, tokens: Tensor) -> tuple[Tensor, object]:
        """Logits (N, V) after feeding ``tokens`` (N,), and the new state."""
        ...

    def feed(self, state: object, tokens: Tensor) -> tuple[Tensor, object]:
        """Logits (N, V) after feeding ``tokens`` (N, L), L forced tokens (a prompt) read in one
        call, and the new state: the state of L steps, the logits of the last (up to float
        rounding: one product of L rows instead of L of one)."""
        ...

    def reorder(self, state: object, rows: Tensor, *, within_inputs: bool = False) -> object:
        """Row i of the new state is row ``rows[i]`` (N',). ``within_inputs``: every row comes
        from a row of its own input, so what is the same for an input's rows is kept as is."""
        ...

    def reserve(self, state: object, room: int) -> object:
        """The state with room for ``room`` more steps written in place (never reordered)."""
        ...

    def caps(self, inputs: Inputs, wanted: list[int], prefix: Sequence[int] | None) -> list[int]:
        """Each input's new-token cap: ``wanted`` cut so the output fits the window; a
        ValueError naming an input that does not fit or a ``prefix`` the model cannot take."""
        ...

    def source_length(self, row: list[int] | Tensor) -> int:
        """The tokens (or feature frames) of one input."""
        ...

    def bytes_needed(self, *, inputs: int, beam: int, source: int, steps: int) -> int:
        """An estimate of the bytes decoding holds at most beyond the weights (planning.py)."""
        ...


class Regrouping(Decoder, Protocol):
    """A :class:`Decoder` whose states can be cut and joined by rows between steps."""

    def regroup(self, parts: Sequence[tuple[object, Tensor | None]]) -> object:
        """One state holding, in order, the rows ``rows`` (N_i,) of each part's state (None: all
        of them), each row decoding on as it would have in its own state. States of different
        lengths are aligned as the adapter's ``start`` aligns its inputs."""
        ...


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


def _last_positions(tokens: Tensor) -> Tensor:
    """True at each row's last position. Shapes: (N, L) -> (N, L) bool."""
    last = torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)  # (N, L)
    last[:, -1] = True
    return last


def map_tensors(obj, fn: Callable[[Tensor], Tensor]):
    """Apply ``fn`` to every tensor in nested lists/tuples (a KV cache)."""
    if isinstance(obj, KVBuffer):
        # Its buffers are shared and written in place: picking rows of them would either copy
        # nothing (wrong rows afterwards) or break the one-writer rule. Only reserve() makes them.
        raise TypeError("a KVBuffer cache cannot be reordered: beam search keeps (k, v) tuples")
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(o, fn) for o in obj)
    return obj


def _reserved(cache: list, room: int) -> list:
    """Every block's self-attention keys and values preallocated with ``room`` more positions
    (:class:`KVBuffer`), so steps write in place instead of concatenating."""
    return [(KVBuffer.holding(self_kv, capacity=self_kv[0].shape[2] + room), cross_kv) for self_kv, cross_kv in cache]


def _filled(self_kv: KVCache | KVBuffer) -> KVCache:
    """A self-attention cache's keys and values as a ``(k, v)`` tuple (a buffer's filled positions)."""
    if isinstance(self_kv, KVBuffer):
        return self_kv.k[:, :, : self_kv.length], self_kv.v[:, :, : self_kv.length]  # (B, G, S, K) views
    return self_kv


def _kv_width(c) -> int:
    """The width of one position's keys (or values) in a self-attention cache."""
    width = getattr(c, "head_width", None) or c.d_model // c.n_heads  # a model may set its own head width
    return width * (getattr(c, "n_kv_heads", None) or c.n_heads)


# ---------------------------------------------------------------------------- encoder-decoders


@dataclass(frozen=True)
class _Sourced:
    """An encoder-decoder's state: the decoder cache and the encoder output it attends to."""

    cache: list
    memory: Tensor  # (M, S, D): one row per input, shared by its N / M hypotheses (reorder)
    src_mask: Tensor | None  # (M, S); None: every source position is real


def _inputs_of(rows: Tensor, state: _Sourced) -> Tensor:
    """The input (a row of ``state.memory``) of each of ``rows``, rows of the decoder cache: the
    cache's N rows are the memory's M inputs' W = N / M consecutive hypotheses each.
    Shapes: rows (N',) -> (N',)."""
    n = _cache_rows(state.cache, state.memory.shape[0])
    return rows // (n // state.memory.shape[0])  # (N',)


def _cache_rows(cache: list, default: int) -> int:
    """The rows (hypotheses) of a decoder cache; ``default`` for an empty one."""
    if not cache:
        return default
    return _filled(cache[0][0])[0].shape[0]


def _consecutive(m: int, w: int, device: torch.device) -> Tensor:
    """Each of ``m`` inputs ``w`` times, consecutively: 0, 0, 1, 1, ... Shapes: (M·W,)."""
    return torch.arange(m, device=device).repeat_interleave(w)  # (M·W,)


class _EncoderDecoderBase:
    """What the text and speech encoder-decoders share: decoding from BEGIN (or forced first
    tokens) over an encoder output read once, its cross-attention keys and values cached."""

    def __init__(self, model: EncoderDecoder | SpeechEncoderDecoder, *, window: int | None = None) -> None:
        c = model.config
        self.model = model
        self.eos_id, self.bos_id = c.eos_id, c.bos_id
        self.window = window or c.max_len
        self.vocab_size = getattr(c, "tgt_vocab_size", None) or c.vocab_size
        self.prompted = False  # inputs are sources: the output is a new sequence

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def read(self, inputs: Inputs) -> tuple[Tensor, Tensor]:
        """The encoder output of ``inputs`` and its valid positions: (B, S, D), (B, S)."""
        raise NotImplementedError

    def start(self, inputs: Inputs) -> tuple[Tensor, _Sourced]:
        memory, src_mask = self.read(inputs)  # (B, S, D), (B, S)
        # Without padding (e.g. one input) no key is ever masked: a None mask spares every
        # cross-attention call of every step its mask work (decoding is per-op overhead bound).
        src_mask = None if bool(src_mask.all()) else src_mask
        bos = torch.full((len(inputs), 1), self.bos_id, dtype=torch.long, device=memory.device)  # (B, 1)
        out = self.model.decode(bos, memory, src_mask=src_mask)
        return out.logits[:, -1], _Sourced(out.cache, memory, src_mask)  # (B, V)

    def step(self, state: _Sourced, tokens: Tensor) -> tuple[Tensor, _Sourced]:
        if state.src_mask is None and self.model.decoder.rows_ready(state.cache):  # no padding, caches grown in place
            # The one-row step (decode_row): no masks, no memory (the cross-attention keys and
            # values are the cache's), in inference mode as DecoderOnlyDecoder.step explains. CPU
            # time, 1 thread, same-process interleaved A/B under contention, 2026-12-07: Whisper
            # tiny.en's int8 copy, a 30-s window, 14.4 against 15.3 ms a step (medians of 10);
            # bench/mt_speed.py's base model, greedy batch 1, 80.6 against 73.0 new tokens a CPU
            # second in int8, 63.7 against 60.5 in fp32; the same tokens.
            with torch.inference_mode():
                out = self.model.decode_row(tokens, cache=state.cache)  # (N, V)
            return out.logits, replace(state, cache=out.cache)
        out = self.model.decode(tokens[:, None], state.memory, src_mask=state.src_mask, cache=state.cache)
        return out.logits[:, -1], replace(state, cache=out.cache)  # (N, V)

    def feed(self, state: _Sourced, tokens: Tensor) -> tuple[Tensor, _Sourced]:
        # The vocabulary projection (a decoding step's largest product) only where it is read.
        last = _last_positions(tokens)  # (N, L)
        out = self.model.decode(tokens, state.memory, src_mask=state.src_mask, cache=state.cache, only=last)
        return out.logits, replace(state, cache=out.cache)  # (N, V)

    def reorder(self, state: _Sourced, rows: Tensor, *, within_inputs: bool = False) -> _Sourced:
        """Row i of the new state is row ``rows[i]``. The encoder output, its mask and the
        cross-attention keys and values are held once per input (M rows) while the N hypotheses
        of the M inputs stay consecutive, W = N / M each: beam search's rows, which attend to
        their input's once (``MultiHeadAttention``), never copied W times nor reordered."""

        def pick(t: Tensor) -> Tensor:
            return t.index_select(0, rows)  # (N', ...)

        self_cache = [map_tensors(self_kv, pick) for self_kv, _ in state.cache]
        kept = replace(state, cache=[(s, cross_kv) for s, (_, cross_kv) in zip(self_cache, state.cache, strict=True)])
        if within_inputs:  # an input's rows share the encoder output and cross-attention keys/values
            return kept
        inputs = _inputs_of(rows, state)  # (N',) the input of every new row
        m = state.memory.shape[0]
        if rows.numel() % m == 0 and torch.equal(inputs, _consecutive(m, rows.numel() // m, rows.device)):
            return kept  # each input's rows consecutive, W of them: its encoder output stays shared

        def of_input(t: Tensor) -> Tensor:
            return t.index_select(0, inputs)  # (N', ...)

        cross = [map_tensors(cross_kv, of_input) for _, cross_kv in state.cache]
        return _Sourced(
            list(zip(self_cache, cross, strict=True)), of_input(state.memory), map_tensors(state.src_mask, of_input)
        )

    def reserve(self, state: _Sourced, room: int) -> _Sourced:
        return replace(state, cache=_reserved(state.cache, room))

    def caps(self, inputs: Inputs, wanted: list[int], prefix: Sequence[int] | None) -> list[int]:
        self.check_rows(inputs)
        forced = self.prefix_length(prefix)
        return [min(n, self.window - forced + 1) for n in wanted]

    def check_rows(self, inputs: Inputs) -> None:
        raise NotImplementedError

    def prefix_length(self, prefix: Sequence[int] | None) -> int:
        """The target positions the forced first tokens take (1: BEGIN alone); a ValueError
        for a prefix that does not start with BEGIN, is outside the vocabulary or does not fit."""
        if prefix is None:
            return 1
        vocab = self.vocab_size
        if not prefix or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prefix):
            raise ValueError(f"prefix must be one or more token ids in [0, {vocab}), got {list(prefix)!r}")
        if prefix[0] != self.bos_id:
            raise ValueError(f"prefix must start with BEGIN (bos_id={self.bos_id}), got {list(prefix)!r}")
        if len(prefix) > self.window:
            raise ValueError(f"a prefix of {len(prefix)} tokens does not fit the window max_len={self.window}")
        return len(prefix)

    def bytes_needed(self, *, inputs: int, beam: int, source: int, steps: int) -> int:
        c = self.model.config
        rows, layers = inputs * beam, c.n_decoder_layers
        cross = (2 * layers + 1) * rows * source * c.d_model  # encoder output + cross keys/values per row
        reading = inputs * source * (c.n_heads * source + max(c.d_ff, c.d_model))
        return 4 * (2 * 2 * layers * rows * steps * _kv_width(c) + cross + reading + 4 * rows * self.vocab_size)


class TextEncoderDecoder(_EncoderDecoderBase):
    """An :class:`~qkv.models.encoder_decoder.EncoderDecoder`: inputs are source token ids,
    right-padded into one batch."""

    def read(self, inputs: Inputs) -> tuple[Tensor, Tensor]:
        device = self.device
        src, src_mask = pad_rows(inputs, self.model.config.pad_id, left=False, device=device)  # (B, S)
        # ragged: the padding's rows skip the encoder's products (cross-attention masks them anyway)
        return self.model.encode(src, src_mask=src_mask, ragged=True), src_mask  # (B, S, D), (B, S)

    def check_rows(self, inputs: Inputs) -> None:
        for i, row in enumerate(inputs):
            if len(row) > self.window:
                raise ValueError(f"input {i} has {len(row)} tokens; the model takes at most max_len={self.window}")

    def source_length(self, row: list[int]) -> int:
        return len(row)


class SpeechEncoderDecoderDecoder(_EncoderDecoderBase):
    """A :class:`~qkv.models.speech.SpeechEncoderDecoder`: inputs are (T, M) log-mel feature
    tensors (any T: the encoder positions are computed), padded into one batch. A model with a
    CTC head also gives its per-frame log-probabilities (:meth:`ctc_log_probs`), which the CTC
    prefix scorer reads; ``blank`` is its blank label."""

    def __init__(self, model: SpeechEncoderDecoder, *, window: int | None = None) -> None:
        super().__init__(model, window=window)
        self.blank = model.config.blank

    def read(self, inputs: Inputs) -> tuple[Tensor, Tensor]:
        device = self.device
        features, valid = pad_features([f.to(device) for f in inputs])  # (B, T, M), (B, T)
        return self.model.encode(features, valid)  # (B, S, D), (B, S)

    def check_rows(self, inputs: Inputs) -> None:
        n_mels = self.model.config.features.n_mels
        for i, row in enumerate(inputs):
            if not isinstance(row, Tensor) or row.dim() != 2 or row.shape[1] != n_mels:
                shape = tuple(row.shape) if isinstance(row, Tensor) else type(row).__name__
                raise ValueError(f"input {i} must be a (T, {n_mels}) feature tensor, got {shape}")

    def source_length(self, row: Tensor) -> int:
        return row.shape[0]

    def encoded(self, inputs: Inputs) -> _Sourced:
        """A state holding only the encoder output of ``inputs`` (no decoder step yet)."""
        memory, valid = self.read(inputs)  # (B, S, D), (B, S)
        return _Sourced([], memory, valid)

    def ctc_log_probs(self, state: _Sourced) -> tuple[Tensor, Tensor]:
        """The CTC head's per-frame log-probabilities over the encoder output ``state`` holds,
        and the real frames. Shapes: returns (N, S, V) and (N, S) bool."""
        if self.model.ctc is None:
            raise ValueError("CTC decoding needs a speech model with a CTC head (ctc=True)")
        logits = self.model.ctc_logits(state.memory)  # (N, S, V)
        valid = state.src_mask
        if valid is None:
            valid = torch.ones(logits.shape[:2], dtype=torch.bool, device=logits.device)  # (N, S)
        return torch.log_softmax(logits.float(), dim=-1), valid


# ---------------------------------------------------------------------------- decoder-only


@dataclass(frozen=True)
class _Prompted:
    """A decoder-only model's state: its cache, the real tokens so far and the next position."""

    cache: list
    key_mask: Tensor | None  # (N, P): False at left padding (None: all real)
    next_position: Tensor  # (N,)


def _unbuffered(state: _Prompted) -> _Prompted:
    """``state`` with ``(k, v)`` tuples for caches (a :class:`KVBuffer`'s filled positions), which
    rows can be picked from."""
    return replace(state, cache=[(_filled(self_kv), cross_kv) for self_kv, cross_kv in state.cache])


def _left_padded(state: _Prompted, length: int) -> tuple[list[KVCache], Tensor]:
    """Every layer's keys and values of ``state`` (tuples) and its key mask, with positions
    added at the left up to ``length`` (zeros; False in the mask).
    Shapes: (N, G, S, K) -> (N, G, length, K) each; the mask (N, length)."""
    s = cache_length(state.cache)
    mask = state.key_mask
    if mask is None:
        mask = torch.ones(len(state.next_position), s, dtype=torch.bool, device=state.next_position.device)  # (N, S)
    pad = length - s
    cache = [tuple(F.pad(t, (0, 0, pad, 0)) for t in self_kv) for self_kv, _ in state.cache]  # (N, G, length, K)
    return cache, F.pad(mask, (pad, 0), value=False)  # (N, length)


class DecoderOnlyDecoder:
    """A :class:`~qkv.models.decoder_only.DecoderOnly`: inputs are prompts (an empty one starts
    from BEGIN), left-padded into one batch, each row counting positions from its first token."""

    def __init__(self, model: DecoderOnly, *, window: int | None = None) -> None:
        c = model.config
        self.model = model
        self.eos_id, self.bos_id, self.pad_id = c.eos_id, c.bos_id, c.pad_id or 0
        self.window = window or c.max_len
        self.vocab_size = c.vocab_size
        self.prompted = True  # inputs are prompts the output continues, in one window

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def start(self, inputs: Inputs) -> tuple[Tensor, _Prompted]:
        if not all(inputs):
            if self.bos_id is None:
                raise ValueError("an empty prompt needs a model with a bos_id")
            inputs = [r or [self.bos_id] for r in inputs]
        device = self.device
        prompt, valid = pad_rows(inputs, self.pad_id, left=True, device=device)  # (B, P)
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)  # (B, P): each row counts from its first token
        # The vocabulary projection at the last position alone (left padding: every row's last token).
        out = self.model.decode(prompt, key_mask=valid, positions=positions, only=_last_positions(prompt))
        # Prompts of one length need no key mask, so the steps need no self-attention mask.
        state = _Prompted(out.cache, None if bool(valid.all()) else valid, valid.sum(1))
        return out.logits, state  # (B, V)

    def step(self, state: _Prompted, tokens: Tensor) -> tuple[Tensor, _Prompted]:
        key_mask = state.key_mask
        if key_mask is not None:
            key_mask = torch.cat([key_mask, torch.ones_like(tokens[:, None], dtype=torch.bool)], dim=1)  # (N, P+1)
        # A row past its cap keeps being fed, its output ignored; clamping its position keeps a
        # learned position table from being indexed past its end.
        positions = state.next_position.clamp(max=self.model.config.max_len - 1)  # (N,)
        if key_mask is None and self.model.decoder.rows_ready(state.cache):  # no padding, caches grown in place
            # Inference mode spares every operator autograd's bookkeeping, which no_grad still does
            # (version counters, view tracking): about 0.7 µs of each one's 2-3 µs at one row, and a
            # step of a 30-layer Llama-shaped model calls about 4,100, nested ones included (1 thread,
            # contended, 2026-12-07; SmolLM2-135M int8, interleaved A/B: 51.6 against 55.0 ms). Its caches were
            # made outside and are written in place, as inference mode allows; the logits it returns
            # are read, never written, by every search.
            with torch.inference_mode():
                out = self.model.decode_row(tokens, positions=positions, cache=state.cache)  # (N, V)
            return out.logits, _Prompted(out.cache, None, state.next_position + 1)
        out = self.model.decode(tokens[:, None], key_mask=key_mask, positions=positions[:, None], cache=state.cache)
        return out.logits[:, -1], _Prompted(out.cache, key_mask, state.next_position + 1)  # (N, V)

    def feed(self, state: _Prompted, tokens: Tensor) -> tuple[Tensor, _Prompted]:
        length = tokens.shape[1]
        key_mask = state.key_mask
        if key_mask is not None:
            key_mask = torch.cat([key_mask, torch.ones_like(tokens, dtype=torch.bool)], dim=1)  # (N, P+L)
        ahead = torch.arange(length, device=tokens.device)  # (L,)
        positions = (state.next_position[:, None] + ahead).clamp(max=self.model.config.max_len - 1)  # (N, L)
        out = self.model.decode(
            tokens, key_mask=key_mask, positions=positions, cache=state.cache, only=_last_positions(tokens)
        )
        return out.logits, _Prompted(out.cache, key_mask, state.next_position + length)  # (N, V)

    def reorder(self, state: _Prompted, rows: Tensor, *, within_inputs: bool = False) -> _Prompted:
        def pick(t: Tensor) -> Tensor:
            return t.index_select(0, rows)  # (N', ...)

        return _Prompted(map_tensors(state.cache, pick), map_tensors(state.key_mask, pick), pick(state.next_position))

    def reserve(self, state: _Prompted, room: int) -> _Prompted:
        return replace(state, cache=_reserved(state.cache, room))

    def regroup(self, parts: Sequence[tuple[_Prompted, Tensor | None]]) -> _Prompted:
        """The rows of several states as one, left-padded to the longest cache as ``start`` pads
        its prompts: each row keeps its own positions (RoPE's included) and its key mask marks
        the padding False, so it attends to what it attended to alone. Positions that are
        padding in every row are cut. Shapes: each state (N_i, ...) -> (sum N_i, ...)."""
        picked = [_unbuffered(s) if rows is None else self.reorder(_unbuffered(s), rows) for s, rows in parts]
        length = max(cache_length(s.cache) for s in picked)
        padded = [_left_padded(s, length) for s in picked]
        key_mask = torch.cat([mask for _, mask in padded])  # (N, S)
        first = int(key_mask.any(0).nonzero()[0])  # the first position some row reads
        layers = zip(*(cache for cache, _ in padded), strict=True)  # per layer, every part's (k, v)
        cache = [tuple(torch.cat(t)[:, :, first:] for t in zip(*kvs, strict=True)) for kvs in layers]  # (N, G, S', K)
        key_mask = key_mask[:, first:]  # (N, S')
        positions = torch.cat([s.next_position for s in picked])  # (N,)
        return _Prompted([(kv, None) for kv in cache], None if bool(key_mask.all()) else key_mask, positions)

    def caps(self, inputs: Inputs, wanted: list[int], prefix: Sequence[int] | None) -> list[int]:
        if prefix is not None:
            raise ValueError(
                "prefix is for encoder-decoder and speech models; a decoder-only model's prompt is its input"
            )
        for i, row in enumerate(inputs):
            if len(row) > self.window:
                raise ValueError(f"input {i} has {len(row)} tokens; the model takes at most max_len={self.window}")
        # A prompt and its continuation share the window; an empty prompt starts from BEGIN.
        return [max(1, min(n, self.window - max(1, len(row)) + 1)) for n, row in zip(wanted, inputs, strict=True)]

    def source_length(self, row: list[int]) -> int:
        return len(row)

    def bytes_needed(self, *, inputs: int, beam: int, source: int, steps: int) -> int:
        c = self.model.config
        rows, layers = inputs * beam, c.n_layers
        reading = inputs * source * (c.n_heads * source + max(c.d_ff, c.d_model))
        return 4 * (2 * 2 * layers * rows * (source + steps) * _kv_width(c) + reading + 4 * rows * self.vocab_size)


# ---------------------------------------------------------------------------- ensembles


def mean_of_distributions(logits: list[Tensor]) -> Tensor:
    """log((1/n) Σᵢ softmax(logitsᵢ)) over n models: log-probabilities of the mean distribution,
    which every caller may treat as logits (softmax of log-probabilities gives them back).

    Shapes: one (N, V) tensor per model -> (N, V).
    """
    if len(logits) == 1:
        return logits[0]
    logp = torch.stack([torch.log_softmax(x.float(), dim=-1) for x in logits])  # (models, N, V)
    return torch.logsumexp(logp, dim=0) - math.log(len(logits))  # (N, V)


class EnsembleDecoder:
    """An :class:`~qkv.ensemble.Ensemble` as one decoder: each member keeps its own state, and
    every step's distribution is the mean of theirs (fairseq's ensemble rule)."""

    def __init__(self, ensemble: Ensemble) -> None:
        window = ensemble.config.max_len  # the smallest of the members'
        self.members = tuple(decoder_for(m, window=window) for m in ensemble.models)
        first = self.members[0]
        self.eos_id, self.window, self.vocab_size = first.eos_id, window, first.vocab_size
        self.prompted, self.blank = first.prompted, getattr(first, "blank", None)

    @property
    def device(self) -> torch.device:
        return self.members[0].device

    def start(self, inputs: Inputs) -> tuple[Tensor, tuple]:
        started = [m.start(inputs) for m in self.members]
        return mean_of_distributions([x for x, _ in started]), tuple(st for _, st in started)

    def step(self, state: tuple, tokens: Tensor) -> tuple[Tensor, tuple]:
        stepped = [m.step(st, tokens) for m, st in zip(self.members, state, strict=True)]
        return mean_of_distributions([x for x, _ in stepped]), tuple(st for _, st in stepped)

    def feed(self, state: tuple, tokens: Tensor) -> tuple[Tensor, tuple]:
        fed = [m.feed(st, tokens) for m, st in zip(self.members, state, strict=True)]
        return mean_of_distributions([x for x, _ in fed]), tuple(st for _, st in fed)

    def reorder(self, state: tuple, rows: Tensor, *, within_inputs: bool = False) -> tuple:
        return tuple(
            m.reorder(st, rows, within_inputs=within_inputs) for m, st in zip(self.members, state, strict=True)
        )

    def reserve(self, state: tuple, room: int) -> tuple:
        return tuple(m.reserve(st, room) for m, st in zip(self.members, state, strict=True))

    def regroup(self, parts: Sequence[tuple[tuple, Tensor | None]]) -> tuple:
        if not all(hasattr(m, "regroup") for m in self.members):
            raise ValueError("this ensemble's members cannot regroup rows (continuous batching is decoder-only's)")
        return tuple(m.regroup([(st[i], rows) for st, rows in parts]) for i, m in enumerate(self.members))

    def caps(self, inputs: Inputs, wanted: list[int], prefix: Sequence[int] | None) -> list[int]:
        return self.members[0].caps(inputs, wanted, prefix)

    def source_length(self, row: list[int] | Tensor) -> int:
        return self.members[0].source_length(row)

    def bytes_needed(self, *, inputs: int, beam: int, source: int, steps: int) -> int:
        return sum(m.bytes_needed(inputs=inputs, beam=beam, source=source, steps=steps) for m in self.members)

    def encoded(self, inputs: Inputs) -> tuple:
        return tuple(m.encoded(inputs) for m in self.members)

    def ctc_log_probs(self, state: tuple) -> tuple[Tensor, Tensor]:
        """The log of the members' mean CTC distribution per frame, and the real frames."""
        parts = [m.ctc_log_probs(st) for m, st in zip(self.members, state, strict=True)]
        valid = parts[0][1]
        if any(lp.shape != parts[0][0].shape or not torch.equal(v, valid) for lp, v in parts):
            raise ValueError("ensemble members subsample frames differently: their CTC outputs cannot be averaged")
        logp = torch.stack([lp for lp, _ in parts])  # (models, N, S, V)
        return torch.logsumexp(logp, dim=0) - math.log(len(parts)), valid


def decoder_for(model: DecodingModel | Decoder, *, window: int | None = None) -> Decoder:
    """The :class:`Decoder` of ``model``, chosen once by its family (a Decoder is returned as
    is, so every search takes a model or its decoder); a ValueError for anything else."""
    if isinstance(model, Ensemble):
        return EnsembleDecoder(model)
    if isinstance(model, SpeechEncoderDecoder):
        return SpeechEncoderDecoderDecoder(model, window=window)
    if isinstance(model, EncoderDecoder):
        return TextEncoderDecoder(model, window=window)
    if isinstance(model, DecoderOnly):
        return DecoderOnlyDecoder(model, window=window)
    if all(hasattr(model, name) for name in ("start", "step", "reorder", "caps")):
        return model
    raise ValueError(f"{type(model).__name__} does not generate text (no decoder for it)")


def member(model: DecodingModel) -> EncoderDecoder | SpeechEncoderDecoder | DecoderOnly:
    """``model`` itself, or an ensemble's first member (every member is of its family)."""
    return model.models[0] if isinstance(model, Ensemble) else model
