"""Tests of qkv.decoding: the Decoder protocol, KV cache, greedy, sampling, filtering and beam search.

Two kinds of models are used: random tiny models (any positions scheme), and two tiny
models trained for a moment to reproduce fixed sequences followed by END, so that END
really occurs and search decisions have clear margins.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from lockstep import greedy_in_step
from qkv.attention import attention_path
from qkv.blocks import cache_length
from qkv.checkpoint import save_model
from qkv.checks import PASS, Probe, beam_one_equals_greedy, cached_equals_full
from qkv.decoding import (
    beam_search,
    continuation,
    decoder_for,
    filter_logits,
    greedy,
    most_likely,
    sample,
)
from qkv.decoding_copies import for_decoding, int8_linears, packed_linears
from qkv.ensemble import Ensemble
from qkv.kv_cache import KVBuffer
from qkv.layers import FeedForward, FusedRMSNorm, PackedLinear, WideLinear, packable
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig

SRC_V, TGT_V, V = 17, 13, 13
PAD, BOS, EOS = 0, 1, 2
ATOL = 1e-5


def _block(positions: str, **overrides) -> dict:
    d_model = 18 if positions == "rope" else 15
    fields = {"d_model": d_model, "n_heads": 3, "d_ff": 11, "dropout": 0.0, "max_len": 40, "positions": positions}
    fields.update(overrides)
    return fields


def make_ed(positions: str = "sinusoidal", *, seed: int = 0, **overrides) -> EncoderDecoder:
    torch.manual_seed(seed)
    fields = {"src_vocab_size": SRC_V, "tgt_vocab_size": TGT_V, "n_encoder_layers": 2, "n_decoder_layers": 2}
    fields.update(overrides)
    return EncoderDecoder(EncoderDecoderConfig(**_block(positions, **fields))).eval()


def make_do(positions: str = "sinusoidal", *, seed: int = 0, **overrides) -> DecoderOnly:
    torch.manual_seed(seed)
    fields = {"vocab_size": V, "n_layers": 2, "pad_id": PAD, "bos_id": BOS, "eos_id": EOS}
    fields.update(overrides)
    return DecoderOnly(DecoderOnlyConfig(**_block(positions, **fields))).eval()


def _random_rows(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _train(model, loss_fn, steps: int) -> None:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@pytest.fixture(scope="module")
def copy_model() -> tuple[EncoderDecoder, list[list[int]]]:
    """A 1+1-layer encoder-decoder trained to copy 8 fixed sources and then emit END."""
    model = make_ed(seed=0, n_encoder_layers=1, n_decoder_layers=1)
    sources = _random_rows([2, 3, 4, 5, 2, 3, 4, 5], 13, seed=0)
    width = max(map(len, sources))
    src = torch.full((len(sources), width), PAD)
    tgt = torch.full((len(sources), width + 2), PAD)
    for i, s in enumerate(sources):
        src[i, : len(s)] = torch.tensor(s)
        tgt[i, : len(s) + 2] = torch.tensor([BOS, *s, EOS])

    def loss_fn():
        logits = model(src, tgt[:, :-1])
        return F.cross_entropy(logits.reshape(-1, TGT_V), tgt[:, 1:].reshape(-1), ignore_index=PAD)

    _train(model, loss_fn, 300)
    return model, sources


@pytest.fixture(scope="module")
def lm_model() -> tuple[DecoderOnly, list[list[int]], list[list[int]]]:
    """A 2-layer decoder-only model trained on 6 fixed sequences + END; returns (model, prompts, continuations)."""
    model = make_do("rope", seed=1)
    # seed 2: no prompt occurs anywhere else in the rows, so every continuation is learnable
    # (with seed 1, prompt [6, 6] also ends another row and was not learned on one thread)
    rows = _random_rows([4, 5, 6, 3, 5, 6], V, seed=2)
    prompts = [r[:2] if i % 2 else r[:3] for i, r in enumerate(rows)]
    continuations = [r[len(p) :] for r, p in zip(rows, prompts, strict=True)]
    width = max(map(len, rows)) + 1
    x = torch.full((len(rows), width), PAD)
    for i, r in enumerate(rows):
        x[i, : len(r) + 1] = torch.tensor([*r, EOS])

    def loss_fn():
        return F.cross_entropy(model(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1), ignore_index=PAD)

    _train(model, loss_fn, 300)
    return model, prompts, continuations


# ------------------------------------------------------------- references


def _ref_greedy(model, inputs: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy decoding by full, uncached forward passes, one input at a time."""
    outputs = []
    with torch.no_grad():
        for row in inputs:
            out: list[int] = []
            for _ in range(max_new_tokens):
                if isinstance(model, EncoderDecoder):
                    logits = model(torch.tensor([row]), torch.tensor([[BOS, *out]]))[0, -1]
                else:
                    logits = model(torch.tensor([row + out]))[0, -1]
                token = int(logits.argmax())
                if token == model.config.eos_id:
                    break
                out.append(token)
            outputs.append(out)
    return outputs


def _sequence_logprob(model, row: list[int], continuation: list[int]) -> float:
    """log p(continuation | row) by one teacher-forced forward pass."""
    with torch.no_grad():
        if isinstance(model, EncoderDecoder):
            logits = model(torch.tensor([row]), torch.tensor([[BOS, *continuation[:-1]]]))[0]
        else:
            logits = model(torch.tensor([row + continuation[:-1]]))[0, len(row) - 1 :]
        logp = logits.log_softmax(-1)
        return float(sum(logp[i, t] for i, t in enumerate(continuation)))


# ----------------------------------------------------------------- the cache


@pytest.mark.parametrize("positions", ["sinusoidal", "rope", "alibi", "learned"])
@pytest.mark.parametrize("extra", [{}, {"n_kv_heads": 1, "attention": "sigmoid"}], ids=["mha", "gqa-sigmoid"])
def test_encoder_decoder_cached_equals_uncached(positions: str, extra: dict) -> None:
    """Encoder-decoder: step-by-step decoding with the KV cache gives the logits of one full pass."""
    model = make_ed(positions, seed=2, **extra)
    src = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 4, 3, PAD, PAD, PAD, PAD]])
    tgt = torch.tensor([[BOS, 4, 5, 6, 7], [BOS, 8, 9, 10, 11]])
    src_mask = src != PAD
    with torch.no_grad():
        memory = model.encode(src, src_mask=src_mask)
        full = model.decode(tgt, memory, src_mask=src_mask).logits
        cache, steps = None, []
        for i in range(tgt.shape[1]):
            out = model.decode(tgt[:, i : i + 1], memory, src_mask=src_mask, cache=cache)
            cache = out.cache
            steps.append(out.logits)
    assert cache[0][0][0].shape[2] == tgt.shape[1]  # self-attention cache grew to T
    assert cache[0][1][0].shape[2] == src.shape[1]  # cross-attention cache is the source
    assert (torch.cat(steps, dim=1) - full).abs().max() <= ATOL


@pytest.mark.parametrize("positions", ["sinusoidal", "rope", "alibi", "learned"])
@pytest.mark.parametrize("extra", [{}, {"n_kv_heads": 1, "attention": "sigmoid"}], ids=["mha", "gqa-sigmoid"])
def test_decoder_only_cached_equals_uncached(positions: str, extra: dict) -> None:
    """Decoder-only: a prefix then one token at a time with the cache gives the logits of one full pass."""
    model = make_do(positions, seed=3, **extra)
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 3, 4, 5, 6]])
    with torch.no_grad():
        full = model(tokens)
        out = model.decode(tokens[:, :3])
        cache, steps = out.cache, [out.logits]
        for i in range(3, tokens.shape[1]):
            out = model.decode(tokens[:, i : i + 1], cache=cache)
            cache = out.cache
            steps.append(out.logits)
    assert (torch.cat(steps, dim=1) - full).abs().max() <= ATOL


@pytest.mark.parametrize("positions", ["sinusoidal", "rope", "alibi", "learned"])
def test_start_and_advance_match_full_forward(positions: str) -> None:
    """A decoder-only Decoder's start/step on left-padded prompts of different lengths give each
    prompt's own full-pass logits (qkv check's KV cache row, the same function)."""
    model = make_do(positions, seed=4)
    prompts = [[3, 4, 5, 6, 7], [8], [9, 10, 11]]
    new = [[5, 6, 7], [8, 9, 10], [11, 12, 3]]
    row = cached_equals_full(model, Probe(prompts, new))
    assert row.status == PASS and row.measured <= ATOL


def test_start_and_advance_encoder_decoder() -> None:
    """The encoder-decoder Decoder's start/step (right-padded sources) match each source's full pass."""
    model = make_ed("rope", seed=5)
    sources = [[3, 4, 5, 6, 7], [8], [9, 10, 11]]
    new = [[5, 6], [8, 9], [11, 12]]
    row = cached_equals_full(model, Probe(sources, new))
    assert row.status == PASS and row.measured <= ATOL


# ------------------------------------------------------------------- greedy


@pytest.mark.parametrize("positions", ["sinusoidal", "rope", "alibi", "learned"])
def test_greedy_equals_uncached_reference(positions: str) -> None:
    """greedy() (batched, cached) equals argmax decoding by full forward passes, both families."""
    inputs = [[3, 4, 5, 6, 7], [8], [9, 10, 11]]
    for model in (make_ed(positions, seed=6), make_do(positions, seed=6)):
        assert greedy(model, inputs, max_new_tokens=6) == _ref_greedy(model, inputs, 6)


def test_trained_copy_model_greedy(copy_model) -> None:
    """The trained copy model mostly reproduces its sources; greedy matches the uncached reference."""
    model, sources = copy_model
    out = greedy(model, sources, max_new_tokens=8)
    assert out == _ref_greedy(model, sources, 8)
    assert sum(o == s for o, s in zip(out, sources, strict=True)) >= 6
    assert all(len(o) <= 8 for o in out)


def test_greedy_output_excludes_end_and_stops(lm_model) -> None:
    """Outputs hold new tokens only: no prompt, no END; a row stops at END."""
    model, prompts, continuations = lm_model
    out = greedy(model, prompts, max_new_tokens=8)
    assert all(EOS not in o for o in out)
    assert sum(o == c for o, c in zip(out, continuations, strict=True)) >= 4
    assert out == _ref_greedy(model, prompts, 8)


def test_empty_prompt() -> None:
    """An empty decoder-only prompt starts from BEGIN; without a bos_id it is a ValueError."""
    model = make_do(seed=7)
    assert greedy(model, [[]], max_new_tokens=3) == greedy(model, [[BOS]], max_new_tokens=3)
    with pytest.raises(ValueError):
        greedy(make_do(seed=7, bos_id=None), [[]], max_new_tokens=3)


# -------------------------------------------------------------- beam search


@pytest.mark.parametrize("seed", [8, 9, 10])
def test_beam_one_equals_greedy_random_models(seed: int) -> None:
    """beam_search(beam_size=1) gives the greedy tokens (random models, inputs of several lengths)."""
    inputs = _random_rows([1, 4, 6, 2], 13, seed=seed)
    for model in (make_ed("alibi", seed=seed), make_do("rope", seed=seed)):
        row = beam_one_equals_greedy(model, Probe(inputs, []))  # qkv check's row: up to 8 new tokens
        assert row.status == PASS and row.measured == 0


def test_beam_one_copies_no_state() -> None:
    """One beam keeps every input's row where it is: beam_search(beam_size=1) never asks the
    decoder to reorder its state (for Whisper a copy of every layer's cross-attention keys and
    values), and gives the greedy tokens; two beams do reorder."""
    inputs = _random_rows([1, 4, 6, 2], 13, seed=11)
    model = make_ed("alibi", seed=11)
    decoder = decoder_for(model)
    calls = []
    real = decoder.reorder

    def counted(state, rows, *, within_inputs=False):
        calls.append(within_inputs)
        return real(state, rows, within_inputs=within_inputs)

    decoder.reorder = counted
    found = beam_search(decoder, inputs, beam_size=1, max_new_tokens=5)
    assert [h[0].tokens for h in found] == greedy(model, inputs, max_new_tokens=5) and calls == []
    beam_search(decoder, inputs, beam_size=2, max_new_tokens=5)
    assert calls and calls[0] is False


@pytest.mark.parametrize("lengths", [[3, 5, 1], [4, 4]])
def test_encoder_decoder_beams_share_their_inputs_encoder_output(lengths: list[int]) -> None:
    """Reordered into W consecutive rows per input (beam search's start), an encoder-decoder's
    state attends to each input's encoder output once for its W rows, and every step gives the
    logits of the same rows picked in another order (each row its own copy), padded or not."""
    inputs = _random_rows(lengths, SRC_V, seed=12)
    model = make_ed("sinusoidal", seed=12)
    decoder, b, w = decoder_for(model), len(lengths), 3
    with torch.no_grad():
        _, state = decoder.start(inputs)
        shared = decoder.reorder(state, torch.arange(b).repeat_interleave(w))  # rows 0,0,0,1,1,1,...
        own = decoder.reorder(state, torch.arange(b).repeat(w))  # rows 0,1,...,0,1,...: copies
        same = torch.tensor([(i % w) * b + i // w for i in range(b * w)])  # own's row of each shared row
        back = torch.argsort(same)  # the shared row of each of own's
        for step in range(4):
            tokens = torch.randint(3, TGT_V, (b * w,), generator=torch.Generator().manual_seed(step))
            a, shared = decoder.step(shared, tokens)
            c, own = decoder.step(own, tokens[back])
            torch.testing.assert_close(a, c[same], atol=ATOL, rtol=0)
            picked = torch.tensor([w - 1, 0, 1] * b) + torch.arange(b).repeat_interleave(w) * w  # within inputs
            shared = decoder.reorder(shared, picked, within_inputs=True)
            own = decoder.reorder(own, same[picked][back])


def test_beam_one_equals_greedy_trained(copy_model, lm_model) -> None:
    """beam_search(beam_size=1) equals greedy on the trained models, where END does occur."""
    model, sources = copy_model
    greedy_out = greedy(model, sources, max_new_tokens=8)
    assert any(len(o) < 8 for o in greedy_out)  # END was produced somewhere
    assert [b[0].tokens for b in beam_search(model, sources, beam_size=1, max_new_tokens=8)] == greedy_out
    lm, prompts, _ = lm_model
    greedy_out = greedy(lm, prompts, max_new_tokens=8)
    assert any(len(o) < 8 for o in greedy_out)
    assert [b[0].tokens for b in beam_search(lm, prompts, beam_size=1, max_new_tokens=8)] == greedy_out


def test_beam_finds_memorized_sequences(copy_model) -> None:
    """With beam 3 the copy model's best hypothesis is mostly the source itself."""
    model, sources = copy_model
    best = [b[0].tokens for b in beam_search(model, sources, beam_size=3, max_new_tokens=8)]
    assert sum(o == s for o, s in zip(best, sources, strict=True)) >= 6


def _assert_same_hypotheses(batched, alone) -> None:
    assert [h.tokens for h in batched] == [h.tokens for h in alone]
    assert all(math.isclose(a.score, b.score, abs_tol=1e-4) for a, b in zip(batched, alone, strict=True))


@pytest.mark.parametrize("trained", [False, True])
def test_encoder_decoder_batch_equals_one_by_one(trained: bool, copy_model) -> None:
    """Encoder-decoder: greedy and beam(3) on a batch of different lengths equal decoding each input alone."""
    if trained:
        model, inputs = copy_model
        inputs = inputs[:5]
    else:
        model, inputs = make_ed("rope", seed=11), _random_rows([5, 1, 3, 7], SRC_V, seed=11)
    batched = greedy(model, inputs, max_new_tokens=8)
    assert batched == [greedy(model, [x], max_new_tokens=8)[0] for x in inputs]
    beams = beam_search(model, inputs, beam_size=3, max_new_tokens=8, nbest=3)
    for x, hyps in zip(inputs, beams, strict=True):
        _assert_same_hypotheses(hyps, beam_search(model, [x], beam_size=3, max_new_tokens=8, nbest=3)[0])


@pytest.mark.parametrize("trained", [False, True])
def test_decoder_only_batch_equals_one_by_one(trained: bool, lm_model) -> None:
    """Decoder-only (left-padded batch): greedy and beam(3) equal decoding each prompt alone."""
    if trained:
        model, inputs, _ = lm_model
    else:
        model, inputs = make_do("alibi", seed=12), _random_rows([5, 1, 3, 7], V, seed=12)
    batched = greedy(model, inputs, max_new_tokens=8)
    assert batched == [greedy(model, [x], max_new_tokens=8)[0] for x in inputs]
    beams = beam_search(model, inputs, beam_size=3, max_new_tokens=8, nbest=3)
    for x, hyps in zip(inputs, beams, strict=True):
        _assert_same_hypotheses(hyps, beam_search(model, [x], beam_size=3, max_new_tokens=8, nbest=3)[0])


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 0.6])
def test_beam_nbest_sorted_and_scores_are_normalized_logprobs(length_penalty: float, copy_model, lm_model) -> None:
    """n-best lists are sorted by score, at most nbest long, distinct, and each score is
    log p(tokens [+ END]) / length^length_penalty recomputed by a full forward pass."""
    max_new = 6
    for model, inputs in (
        (copy_model[0], copy_model[1][:4]),
        (lm_model[0], lm_model[1][:4]),
        (make_do(seed=13), [[3, 4]]),
    ):
        results = beam_search(
            model, inputs, beam_size=4, max_new_tokens=max_new, nbest=3, length_penalty=length_penalty
        )
        assert len(results) == len(inputs)
        for row, hyps in zip(inputs, results, strict=True):
            assert 1 <= len(hyps) <= 3
            scores = [h.score for h in hyps]
            assert scores == sorted(scores, reverse=True)
            assert len({tuple(h.tokens) for h in hyps}) == len(hyps)
            for h in hyps:
                assert EOS not in h.tokens and len(h.tokens) <= max_new
                # shorter than max_new_tokens: it ended with END, which counts in score and length
                continuation = [*h.tokens, EOS] if len(h.tokens) < max_new else h.tokens
                expected = _sequence_logprob(model, row, continuation) / len(continuation) ** length_penalty
                assert math.isclose(h.score, expected, abs_tol=1e-4)


def test_beam_nbest_bounds() -> None:
    """nbest must lie in [1, beam_size]."""
    model = make_do(seed=14)
    with pytest.raises(ValueError):
        beam_search(model, [[3]], beam_size=2, max_new_tokens=3, nbest=3)
    with pytest.raises(ValueError):
        beam_search(model, [[3]], beam_size=2, max_new_tokens=3, nbest=0)


def test_beam_respects_max_new_tokens() -> None:
    """No hypothesis is longer than max_new_tokens; a model without END returns full-length beams."""
    model = make_do(seed=15, eos_id=None)
    for hyps in beam_search(model, [[3, 4], [5]], beam_size=3, max_new_tokens=4, nbest=3):
        assert len(hyps) == 3
        assert all(len(h.tokens) == 4 for h in hyps)


# ----------------------------------------------------------------- sampling


def test_sampling_is_reproducible_with_a_seed() -> None:
    """The same seed gives the same samples; different seeds give different ones."""
    inputs = [[3, 4, 5], [6], [7, 8]]
    for model in (make_ed(seed=16), make_do(seed=16, eos_id=None)):
        a = sample(model, inputs, max_new_tokens=8, temperature=2.0, seed=123)
        b = sample(model, inputs, max_new_tokens=8, temperature=2.0, seed=123)
        assert a == b
        others = [sample(model, inputs, max_new_tokens=8, temperature=2.0, seed=s) for s in (1, 2, 3)]
        assert any(o != a for o in others)


def test_top_k_one_sampling_equals_greedy() -> None:
    """Sampling with top_k=1 always takes the argmax: it equals greedy."""
    inputs = [[3, 4, 5], [6], [7, 8, 9, 10]]
    for model in (make_ed("alibi", seed=17), make_do("rope", seed=17)):
        assert sample(model, inputs, max_new_tokens=8, top_k=1, seed=5) == greedy(model, inputs, max_new_tokens=8)


@pytest.mark.parametrize("top_k, top_p", [(3, None), (None, 0.5), (4, 0.6)])
def test_sampled_tokens_stay_in_the_allowed_set(top_k: int | None, top_p: float | None) -> None:
    """Every token sample() picks lies in the top-k / nucleus of the model's own next-token distribution."""
    model = make_do(seed=18, eos_id=None)
    prompts = [[3, 4, 5], [6, 7], [8]]
    for seed in range(4):
        outputs = sample(model, prompts, max_new_tokens=5, temperature=1.5, top_k=top_k, top_p=top_p, seed=seed)
        with torch.no_grad():
            for prompt, out in zip(prompts, outputs, strict=True):
                assert len(out) == 5
                logits = model(torch.tensor([prompt + out]))[0, len(prompt) - 1 : -1]  # (5, V)
                allowed = torch.isfinite(filter_logits(logits, temperature=1.5, top_k=top_k, top_p=top_p))
                assert allowed[torch.arange(5), torch.tensor(out)].all()


# ------------------------------------------------------------ filter_logits


def test_filter_top_k_keeps_exactly_k() -> None:
    """top_k keeps exactly the k largest logits of every row (others -inf)."""
    torch.manual_seed(19)
    logits = torch.randn(5, 11)
    for k in (1, 3, 10, 11, 50):
        out = filter_logits(logits, top_k=k)
        finite = torch.isfinite(out)
        assert torch.all(finite.sum(-1) == min(k, 11))
        top = logits.topk(min(k, 11), dim=-1).indices
        assert finite.gather(-1, top).all()
        assert torch.equal(out[finite], logits[finite])
    tied = torch.tensor([[0.0, 2.0, 1.0, 1.0, 1.0, -1.0]])  # the 2nd largest value is shared by three
    assert int(torch.isfinite(filter_logits(tied, top_k=2)).sum()) == 2


@pytest.mark.parametrize("top_p, kept", [(0.3, 1), (0.5, 1), (0.7, 2), (0.8, 2), (0.81, 3), (0.95, 3), (0.99, 4)])
def test_filter_top_p_keeps_minimal_nucleus(top_p: float, kept: int) -> None:
    """top_p keeps the smallest set of most likely tokens whose probability reaches top_p."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    order = torch.tensor([2, 0, 3, 1])  # shuffled vocabulary order
    logits = probs.log()[order][None]  # token j has probability probs[order[j]]
    out = filter_logits(logits, top_p=top_p)
    expected = order < kept  # the `kept` most likely tokens
    assert torch.equal(torch.isfinite(out)[0], expected)


def test_filter_temperature_and_errors() -> None:
    """Temperature divides the logits; temperature <= 0 is a ValueError; top_p=1 keeps everything."""
    torch.manual_seed(20)
    logits = torch.randn(2, 7)
    assert torch.allclose(filter_logits(logits, temperature=2.0), logits / 2.0)
    assert torch.isfinite(filter_logits(logits, top_p=1.0)).all()
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError):
            filter_logits(logits, temperature=bad)


def test_filtered_sampling_never_leaves_allowed_set() -> None:
    """Sampling many times from filtered distributions only ever yields allowed tokens."""
    torch.manual_seed(21)
    logits = torch.randn(4, 13)
    g = torch.Generator().manual_seed(0)
    for kwargs in ({"top_k": 3}, {"top_p": 0.6}, {"top_k": 5, "top_p": 0.4}):
        filtered = filter_logits(logits, **kwargs)
        draws = torch.multinomial(filtered.softmax(-1), 500, replacement=True, generator=g)  # (4, 500)
        assert torch.isfinite(filtered.gather(-1, draws)).all()


def test_window_caps_new_tokens_and_refuses_long_inputs() -> None:
    """Positions never reach max_len: new tokens are capped; an over-long input is refused."""
    torch.manual_seed(7)
    config = DecoderOnlyConfig(
        vocab_size=13, d_model=15, n_heads=3, d_ff=7, n_layers=1, max_len=11, positions="learned", dropout=0.0
    )
    model = DecoderOnly(config).eval()
    out = greedy(model, [[3, 4, 5, 6, 7]], max_new_tokens=50)
    assert len(out[0]) == 11 - 5 + 1  # the last token is produced, never fed
    with pytest.raises(ValueError, match="max_len"):
        greedy(model, [[3] * 12], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        beam_search(model, [[3]], beam_size=2, max_new_tokens=0)
    seq2seq = EncoderDecoder(
        EncoderDecoderConfig(
            src_vocab_size=13,
            tgt_vocab_size=13,
            d_model=15,
            n_heads=3,
            d_ff=7,
            n_encoder_layers=1,
            n_decoder_layers=1,
            max_len=7,
            positions="learned",
            dropout=0.0,
            eos_id=12,
        )
    ).eval()
    hyps = beam_search(seq2seq, [[4, 5, 6]], beam_size=2, max_new_tokens=50)
    assert len(hyps[0][0].tokens) <= 7


def test_beam_search_waits_for_a_better_live_beam(monkeypatch) -> None:
    """Improbable early ENDs must not end the search while a live beam can still beat them.

    A scripted decoder (vocabulary pad, bos, END=2, a=3) makes "a a a END" likely and END
    before that improbable but still within the top W of a tiny vocabulary.
    """
    scripted = ScriptedDecoder(lambda tokens: _scripted_row(len(tokens)))
    for width in (2, 3):
        best = beam_search(scripted, [[5], [6, 7]], beam_size=width, max_new_tokens=10)
        assert [hyps[0].tokens for hyps in best] == [[3, 3, 3], [3, 3, 3]]


def _scripted_row(length: int) -> torch.Tensor:
    """Vocabulary pad, bos, END=2, a=3: "a" likely until three have been written, then END."""
    row = torch.full((4,), -20.0)
    row[3], row[2] = (-0.01, -5.0) if length < 3 else (-5.0, -0.01)
    return row


class ScriptedDecoder:
    """A Decoder (qkv.decoding's protocol) whose next-token logits depend only on how many tokens
    a row has written: a mock with known log-probabilities. Its state is each row's tokens."""

    def __init__(self, logits_of, *, vocab_size: int = 4, eos_id: int | None = 2, window: int = 50) -> None:
        self.logits_of, self.vocab_size, self.eos_id, self.window = logits_of, vocab_size, eos_id, window
        self.prompted, self.device = False, torch.device("cpu")

    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        return torch.stack([self.logits_of(r) for r in rows])

    def start(self, inputs):
        rows = [[] for _ in inputs]
        return self._logits(rows), rows

    def step(self, state, tokens):
        rows = [[*r, int(t)] for r, t in zip(state, tokens.tolist(), strict=True)]
        return self._logits(rows), rows

    def feed(self, state, tokens):
        rows = [[*r, *t] for r, t in zip(state, tokens.tolist(), strict=True)]
        return self._logits(rows), rows

    def reorder(self, state, rows, *, within_inputs=False):
        return [list(state[i]) for i in rows.tolist()]

    def reserve(self, state, room):
        return state

    def caps(self, inputs, wanted, prefix):
        return [min(n, self.window) for n in wanted]

    def source_length(self, row):
        return len(row)

    def bytes_needed(self, *, inputs, beam, source, steps):
        return 0


def test_each_prompt_gets_its_own_window_cap() -> None:
    """A long prompt in the batch does not shorten a short prompt's continuation."""
    torch.manual_seed(11)
    config = DecoderOnlyConfig(
        vocab_size=13, d_model=15, n_heads=3, d_ff=7, n_layers=1, max_len=11, positions="learned", dropout=0.0
    )
    model = DecoderOnly(config).eval()
    short, long = [3, 4], [5] * 9
    together = greedy(model, [short, long], max_new_tokens=20)
    assert together == [greedy(model, [short], max_new_tokens=20)[0], greedy(model, [long], max_new_tokens=20)[0]]
    assert [len(t) for t in together] == [10, 3]
    beams = beam_search(model, [short, long], beam_size=2, max_new_tokens=20)
    assert [len(h[0].tokens) for h in beams] == [10, 3]
    assert greedy(model, [], max_new_tokens=3) == [] and beam_search(model, [], beam_size=2, max_new_tokens=3) == []


def test_sliding_continuation_goes_past_the_window() -> None:
    """slide=True: each time the window is full the newest half is re-read from position 0;
    every token equals greedy decoding of exactly that context."""
    torch.manual_seed(5)
    config = DecoderOnlyConfig(vocab_size=13, d_model=15, n_heads=3, d_ff=7, n_layers=1, max_len=11, dropout=0.0)
    model = DecoderOnly(config).eval()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]  # longer than the window: its newest 11 are kept
    out = list(continuation(model, prompt, max_new_tokens=30, choose=most_likely, slide=True))
    assert len(out) == 30
    seen, context, produced = list(prompt), prompt[-11:], 0
    while produced < 30:
        room = min(11 - len(context) + 1, 30 - produced)
        expected = greedy(model, [context], max_new_tokens=room)[0]
        assert out[produced : produced + room] == expected
        seen += expected
        produced += room
        context = seen[-5:]
    # Without sliding, the output stops at the window.
    assert len(list(continuation(model, prompt[:4], max_new_tokens=30, choose=most_likely))) == 8


def test_bfloat16_weights_decode_like_float32(copy_model, lm_model) -> None:
    """A model cast to bfloat16 (``--bf16``), and its copy with packed linear layers (what
    ``--bf16`` loads on the CPU), decode the trained models' clear-margin outputs as float32
    does: greedy and beam search, both families, with padding in the batch."""
    import copy

    for model, inputs in (copy_model, lm_model[:2]):
        half = copy.deepcopy(model).to(torch.bfloat16)
        for copied in (half, packed_linears(half)):
            assert greedy(copied, inputs, max_new_tokens=8) == greedy(model, inputs, max_new_tokens=8)
            beams = beam_search(copied, inputs, beam_size=3, max_new_tokens=8)
            assert [h[0].tokens for h in beams] == [
                h[0].tokens for h in beam_search(model, inputs, beam_size=3, max_new_tokens=8)
            ]


@pytest.mark.parametrize("bf16", [True, False])
def test_int8_linears_decode_like_float32(copy_model, lm_model, bf16: bool) -> None:
    """A model with int8 linear layers (``--int8``) is a copy (the original keeps float32
    weights) and decodes the trained models' clear-margin outputs as float32 does: greedy and
    beam search, both families, with padding in the batch; its vocabulary projection from two
    rows bfloat16, or from 16 float32 (``bf16=False``, a CPU without bfloat16 arithmetic)."""
    for model, inputs in (copy_model, lm_model[:2]):
        quantized = int8_linears(model, bf16=bf16)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        plain = [m for m in quantized.modules() if type(m) is torch.nn.Linear]  # every one replaced
        many = quantized.output.many  # more rows; fewer: float16 with float32 near-ties
        assert plain == ([] if bf16 or isinstance(many, WideLinear) else [many])
        assert greedy(quantized, inputs, max_new_tokens=8) == greedy(model, inputs, max_new_tokens=8)
        beams = beam_search(quantized, inputs, beam_size=3, max_new_tokens=8)
        assert [h[0].tokens for h in beams] == [
            h[0].tokens for h in beam_search(model, inputs, beam_size=3, max_new_tokens=8)
        ]


@pytest.mark.parametrize("attention", ["softmax", "sigmoid"])
@pytest.mark.parametrize("positions", ["sinusoidal", "rope", "alibi"])
def test_decoding_without_masks_equals_all_true_masks(positions: str, attention: str) -> None:
    """The fast path (no mask when nothing is padded: a decoder's start passes None) equals the explicit
    path with all-True masks, step by step with the cache, for both normalizations; sigmoid
    attention's bias counts the keys, so a None mask must count all of them."""
    ed = make_ed(positions, seed=5, attention=attention)
    src = torch.tensor(_random_rows([6, 6], SRC_V, seed=5))  # (B, S), no padding
    memory = ed.encode(src)  # (B, S, D)
    all_true = torch.ones_like(src, dtype=torch.bool)  # (B, S)
    tokens = torch.full((2, 1), BOS)  # (B, 1)
    plain, masked = ed.decode(tokens, memory, src_mask=None), ed.decode(tokens, memory, src_mask=all_true)
    for _ in range(4):
        torch.testing.assert_close(plain.logits, masked.logits, atol=ATOL, rtol=0)
        tokens = plain.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        plain = ed.decode(tokens, memory, src_mask=None, cache=plain.cache)
        masked = ed.decode(tokens, memory, src_mask=all_true, cache=masked.cache)

    lm = make_do(positions, seed=6, attention=attention)
    prompt = torch.tensor(_random_rows([5, 5], V, seed=6))  # (B, P)
    valid = torch.ones_like(prompt, dtype=torch.bool)  # (B, P)
    plain, masked = lm.decode(prompt), lm.decode(prompt, key_mask=valid)
    for step in range(4):
        torch.testing.assert_close(plain.logits[:, -1], masked.logits[:, -1], atol=ATOL, rtol=0)
        tokens = plain.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        valid = torch.cat([valid, torch.ones_like(tokens, dtype=torch.bool)], dim=1)  # (B, P+1)
        position = torch.full((1,), prompt.shape[1] + step)  # (1,)
        plain = lm.decode(tokens, positions=position, cache=plain.cache)
        masked = lm.decode(tokens, key_mask=valid, positions=position, cache=masked.cache)


@pytest.mark.parametrize("positions", ["sinusoidal", "learned", "rope", "alibi"])
def test_growable_cache_equals_concatenated_cache(positions: str) -> None:
    """stream's preallocated self-attention caches (KVBuffer, written in place) give every
    step's logits of the concatenating caches, for both families with left-padded prompts,
    and hold exactly the positions seen."""
    prompts = _random_rows([3, 5, 1], V, seed=8)
    for model in (make_ed(positions, seed=5), make_do(positions, seed=6)):
        with torch.no_grad():
            a, state_a = decoder_for(model).start(prompts)  # (N, V)
            state_b = decoder_for(model).reserve(state_a, 6)
            state_a, state_b = greedy_in_step(decoder_for(model), state_a, decoder_for(model), state_b, a, 6, atol=ATOL)
        self_kv = state_b.cache[0][0]
        assert isinstance(self_kv, KVBuffer) and self_kv.length == state_a.cache[0][0][0].shape[2]
        assert cache_length(state_b.cache) == cache_length(state_a.cache)
        # Reordering rows (beam search) would read the shared buffers' old rows: refused.
        with pytest.raises(TypeError, match="cannot be reordered"):
            decoder_for(model).reorder(state_b, torch.tensor([1, 0, 2]))


@pytest.mark.parametrize(
    ("positions", "overrides"),
    [
        ("sinusoidal", {}),
        ("learned", {"norm_first": False}),
        ("rope", {"n_kv_heads": 1, "activation": "swiglu", "norm": "rmsnorm", "bias": False}),
        (
            "rope",
            {
                "qk_norm": True,
                "sandwich_norm": True,
                "rope_scaling": {"kind": "dynamic", "factor": 2.0, "original_max_len": 7},
            },
        ),
        ("rope", {"sliding_window": 5, "sliding_blocks": [1], "local_rope_base": 100.0, "n_kv_heads": 1}),
    ],
)
@pytest.mark.parametrize("copy_kind", ["model", "for_decoding", "int8"])
def test_row_step_equals_the_explicit_step(positions: str, overrides: dict, copy_kind: str) -> None:
    """A step of prompts without padding over preallocated caches (what ``stream`` decodes: batch 1,
    the chatbot's case) takes the one-row fast path (DecoderOnly.decode_row): every step's logits
    equal ``decode``'s over concatenated caches within 1e-5 (a sliding window shorter than the
    output, dynamic RoPE scaling, qk_norm, sandwich and post-norm, grouped-query heads, the decoding
    copies), the same greedy tokens; the explicit attention path (qkv check), padded prompts and
    ALiBi keep decode."""
    model = make_do(positions, seed=21, n_layers=2, max_len=19, **overrides)
    model = {"model": model, "for_decoding": for_decoding(model, wide=True), "int8": int8_linears(model)}[copy_kind]
    prompts = _random_rows([4, 4], V, seed=21)
    rows = []
    fast = copy.copy(model)  # the same modules; its decode_row counts its calls
    fast.decode_row = lambda *args, **kw: rows.append(1) or DecoderOnly.decode_row(model, *args, **kw)
    with torch.no_grad():
        a, state_a = decoder_for(model).start(prompts)  # (N, V)
        state_b = decoder_for(fast).reserve(state_a, 12)
        state_a, state_b = greedy_in_step(decoder_for(model), state_a, decoder_for(fast), state_b, a, 12, atol=ATOL)
    assert len(rows) == 12 and isinstance(state_b.cache[0][0], KVBuffer)
    assert greedy(fast, prompts, max_new_tokens=12) == greedy(model, prompts, max_new_tokens=12) and len(rows) > 12
    with torch.no_grad():
        _, state = decoder_for(model).start(prompts)
        state = decoder_for(model).reserve(state, 2)
        assert model.decoder.rows_ready(state.cache)
        with attention_path(model, "explicit"):
            assert not model.decoder.rows_ready(state.cache)
        assert not model.decoder.rows_ready(decoder_for(model).start(prompts)[1].cache)  # (k, v) tuples
    with torch.enable_grad():
        assert not model.decoder.rows_ready(state.cache)
    alibi = make_do("alibi", seed=21)
    with torch.no_grad():
        _, state = decoder_for(alibi).start(prompts)
        assert not alibi.decoder.rows_ready(decoder_for(alibi).reserve(state, 2).cache)


@pytest.mark.parametrize(
    ("positions", "overrides"),
    [
        ("sinusoidal", {}),
        ("learned", {"norm_first": False}),
        ("rope", {"n_kv_heads": 1, "activation": "swiglu", "norm": "rmsnorm", "bias": False}),
        ("rope", {"qk_norm": True, "sandwich_norm": True, "output_bias": True}),
    ],
)
@pytest.mark.parametrize("copy_kind", ["model", "for_decoding", "int8"])
def test_encoder_decoder_row_step_equals_the_explicit_step(positions: str, overrides: dict, copy_kind: str) -> None:
    """An encoder-decoder's step over sources without padding (batch 1, or rows of one length) and
    preallocated caches takes the one-row fast path (EncoderDecoder.decode_row, cross-attention to
    the keys and values its start cached): every step's logits equal ``decode``'s over concatenated
    caches within 1e-5 (post-norm, learned, RoPE, grouped-query heads, qk_norm and sandwich norms,
    the decoding copies), the same greedy tokens; padded sources, beam search's caches, the
    explicit attention path (qkv check) and ALiBi keep decode."""
    model = make_ed(positions, seed=22, max_len=19, **overrides)
    model = {"model": model, "for_decoding": for_decoding(model, wide=True), "int8": int8_linears(model)}[copy_kind]
    rows = []
    fast = copy.copy(model)  # the same modules; its decode_row counts its calls
    fast.decode_row = lambda *args, **kw: rows.append(1) or EncoderDecoder.decode_row(model, *args, **kw)
    for sources in (_random_rows([5], SRC_V, seed=22), _random_rows([4, 4], SRC_V, seed=23)):
        rows.clear()
        with torch.no_grad():
            a, state_a = decoder_for(model).start(sources)  # (N, V)
            state_b = decoder_for(fast).reserve(state_a, 12)
            state_a, state_b = greedy_in_step(decoder_for(model), state_a, decoder_for(fast), state_b, a, 12, atol=ATOL)
        assert len(rows) == 12 and isinstance(state_b.cache[0][0], KVBuffer)
        # The cross-attention keys and values start cached: the same tensors, never projected nor copied again.
        assert all(x is y for x, y in zip(state_b.cache[0][1], state_a.cache[0][1], strict=True))
        assert greedy(fast, sources, max_new_tokens=12) == greedy(model, sources, max_new_tokens=12)
        assert len(rows) > 12
    rows.clear()
    padded = _random_rows([5, 3], SRC_V, seed=24)
    assert greedy(fast, padded, max_new_tokens=4) == greedy(model, padded, max_new_tokens=4) and not rows
    assert beam_search(fast, sources, beam_size=2, max_new_tokens=4) and not rows
    with torch.no_grad():
        _, state = decoder_for(model).start(sources)
        ready = decoder_for(model).reserve(state, 2)
        assert model.decoder.rows_ready(ready.cache) and not model.decoder.rows_ready(state.cache)
        with attention_path(model, "explicit"):
            assert not model.decoder.rows_ready(ready.cache)
        shared = decoder_for(model).reorder(state, torch.tensor([0, 0, 1, 1]), within_inputs=True)  # beams
        assert not model.decoder.rows_ready(decoder_for(model).reserve(shared, 2).cache)
    alibi = make_ed("alibi", seed=22)
    with torch.no_grad():
        _, state = decoder_for(alibi).start(sources)
        assert not alibi.decoder.rows_ready(decoder_for(alibi).reserve(state, 2).cache)


def test_decoder_only_logits_where_asked_equal_every_positions() -> None:
    """DecoderOnly.decode(only=...) projects the positions asked for alone: their logits are the
    full call's at those positions (row-major), and its cache is the full call's; a prompt's start
    reads the last position's."""
    model, prompts = make_do("rope", seed=23), _random_rows([5, 2], V, seed=23)
    tokens, valid = (
        torch.tensor([prompts[0], [PAD] * 3 + prompts[1]]),
        torch.tensor([[True] * 5, [False] * 3 + [True] * 2]),
    )
    only = torch.tensor([[False, True, False, False, True], [False, False, False, False, True]])
    with torch.no_grad():
        full = model.decode(tokens, key_mask=valid, positions=(valid.cumsum(1) - 1).clamp(min=0))
        some = model.decode(tokens, key_mask=valid, positions=(valid.cumsum(1) - 1).clamp(min=0), only=only)
        torch.testing.assert_close(some.logits, full.logits[only], atol=ATOL, rtol=0)
        for (a, _), (b, _) in zip(some.cache, full.cache, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        torch.testing.assert_close(decoder_for(model).start(prompts)[0], full.logits[:, -1], atol=ATOL, rtol=0)


def _same_steps(model, fast, prompts: list[list[int]], *, steps: int, atol: float = ATOL) -> None:
    """``fast`` (a decoding copy of ``model``) gives the same logits (within ``atol``) at every
    cached step, both fed ``model``'s choices."""
    (a, state_a), (b, state_b) = decoder_for(model).start(prompts), decoder_for(fast).start(prompts)  # (N, V) each
    for _ in range(steps):
        torch.testing.assert_close(b.float(), a.float(), atol=atol, rtol=0)
        tokens = a.argmax(-1)  # (N,)
        (a, state_a), (b, state_b) = decoder_for(model).step(state_a, tokens), decoder_for(fast).step(state_b, tokens)


def _decode_the_same(model, fast, prompts: list[list[int]], *, steps: int) -> None:
    """``fast`` (a decoding copy of ``model``) gives the same logits at every cached step, and
    the same greedy and beam outputs."""
    _same_steps(model, fast, prompts, steps=steps)
    assert greedy(fast, prompts, max_new_tokens=7) == greedy(model, prompts, max_new_tokens=7)
    beams, fast_beams = (beam_search(m, prompts, beam_size=3, max_new_tokens=7) for m in (model, fast))
    assert [h[0].tokens for h in fast_beams] == [h[0].tokens for h in beams]


@pytest.mark.parametrize("positions", ["sinusoidal", "learned", "rope", "alibi"])
@pytest.mark.parametrize("n_kv_heads", [None, 1])
def test_fused_qkv_equals_separate_projections(positions: str, n_kv_heads: int | None) -> None:
    """for_decoding stacks Wq, Wk, Wv into one product: every step's logits equal the separate
    projections' (cached, with left padding), for both families and grouped-query attention; the
    original model keeps its three projections; a fused attention refuses a context."""
    overrides = {"n_kv_heads": n_kv_heads}
    prompts = _random_rows([3, 5, 1], V, seed=7)
    for model in (make_ed(positions, seed=3, **overrides), make_do(positions, seed=4, **overrides)):
        fast = for_decoding(model)
        assert hasattr(model.decoder.blocks[0].self_attn, "w_q") and model.decoder.blocks[0].self_attn.w_qkv is None
        assert all(not hasattr(b.self_attn, "w_q") for b in fast.decoder.blocks)
        _decode_the_same(model, fast, prompts, steps=6)
    assert for_decoding(fast).state_dict().keys() == fast.state_dict().keys()  # fusing twice: as once
    with pytest.raises(ValueError, match="fuse before quantizing"):
        for_decoding(int8_linears(model))
    attention = fast.decoder.blocks[0].self_attn
    with pytest.raises(ValueError, match="fused for self-attention"):
        attention(torch.zeros(1, 2, attention.w_o.out_features), context=torch.zeros(1, 3, attention.w_o.out_features))


def test_llama_decoding_copies_equal_the_explicit_model(tmp_path) -> None:
    """A Llama-shaped model (RoPE, SwiGLU, RMSNorm, grouped-query heads, no biases) as qkv.load
    prepares it: for_decoding also stacks each gated FFN's W1 and W3 (fuse_gate) and the stack
    rotates each layer's queries and keys in one call by tables computed once per step. Against
    the model given, on the explicit attention path: every cached step's logits within 1e-5 and
    greedy outputs token for token (beam outputs too in fp32), fp32 and int8 (per-row scales: the
    stacked rows quantize as the separate ones did), and bf16 packed within bf16's rounding. The copy is not
    saved."""
    llama = {"activation": "swiglu", "norm": "rmsnorm", "bias": False, "n_kv_heads": 1, "d_ff": 19}
    model, prompts = make_do("rope", seed=9, **llama), _random_rows([3, 5, 1], V, seed=17)
    fast = for_decoding(model, wide=True)
    norms = [m for m in fast.modules() if isinstance(m, torch.nn.RMSNorm)]  # 2 per block and the stack's
    assert len(norms) == 2 * len(fast.decoder.blocks) + 1 and all(type(m) is FusedRMSNorm for m in norms)
    ffn = fast.decoder.blocks[0].ffn
    assert ffn.w_13 is not None and ffn.w_1 is None and ffn.w_3 is None and model.decoder.blocks[0].ffn.w_13 is None
    assert for_decoding(fast).state_dict().keys() == fast.state_dict().keys()  # fusing twice: as once
    with attention_path(model, "explicit"):
        _decode_the_same(model, fast, prompts, steps=6)
        int8, fast_int8 = int8_linears(model), int8_linears(for_decoding(model))
        _same_steps(int8, fast_int8, prompts, steps=4)
        assert greedy(fast_int8, prompts, max_new_tokens=7) == greedy(int8, prompts, max_new_tokens=7)
    if packable():
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        _same_steps(bf16, packed_linears(for_decoding(bf16)), prompts, steps=4, atol=6e-2)  # 2 steps of bf16 at 4-8
    with pytest.raises(ValueError, match="fuse before quantizing"):
        for_decoding(int8_linears(make_do("rope", seed=9, **llama)))
    with pytest.raises(ValueError, match="cannot be saved"):
        save_model(fast, tmp_path / "m")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 7), (1, 7), (3, 5, 7), (2, 3, 5, 7)])
def test_fused_rms_norm_is_nn_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """FusedRMSNorm (for_decoding's norms) gives nn.RMSNorm's outputs: bit for bit from aten's
    kernel (a prompt, per-head (qk_norm) shapes, bfloat16), and for one float32 row (a batch-1
    decoding step, rms_norm_row's four operators) within float32 rounding; with the norm's own
    weight (its state dict is the norm's), a norm without a weight, or with eps=None, the same."""
    torch.manual_seed(3)
    one_row = dtype == torch.float32 and shape[:-1] in ((1, 1), (1,))
    for norm in (torch.nn.RMSNorm(7, eps=1e-6), torch.nn.RMSNorm(7, eps=1e-5, elementwise_affine=False)):
        if norm.weight is not None:
            torch.nn.init.normal_(norm.weight)
        norm = norm.to(dtype)
        fused = FusedRMSNorm(norm)
        x = (torch.randn(shape) * 3).to(dtype)
        if one_row:
            torch.testing.assert_close(fused(x), norm(x), atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(fused(x * 1e-4), norm(x * 1e-4), atol=1e-6, rtol=1e-6)  # ε counts
            assert not torch.equal(fused(x * 1e-4), fused(x) * 1e-4)
        else:
            assert torch.equal(fused(x), norm(x))
        assert fused(x).dtype == dtype and fused(x).shape == x.shape
        assert fused.state_dict().keys() == norm.state_dict().keys() and fused.weight is norm.weight
    no_eps = torch.nn.RMSNorm(7, eps=None)
    x = torch.randn(shape)
    assert torch.equal(FusedRMSNorm(no_eps)(x), no_eps(x))
    traced = torch.compile(FusedRMSNorm(norm), backend="eager", fullgraph=True)  # graphs take nn.RMSNorm's forward
    assert torch.equal(traced(x.to(dtype)), norm(x.to(dtype)))


@pytest.mark.parametrize("tie_output", [True, False])
def test_wide_decoding_copy_equals_the_fused_one(tie_output: bool) -> None:
    """for_decoding(wide=True) stores every widening projection transposed: the same logits at
    every cached step (left padding included) and the same greedy and beam outputs, for both
    families; narrowing layers and the model given are left as they were."""
    prompts = _random_rows([3, 5, 1], V, seed=11)
    for model in (make_ed(seed=5, tie_output=tie_output), make_do("rope", seed=6, tie_output=tie_output)):
        fused, wide = for_decoding(model), for_decoding(model, wide=True)
        assert any(isinstance(m, WideLinear) for m in wide.modules()) and not any(
            isinstance(m, torch.nn.Linear) and m.out_features > m.in_features for m in wide.modules()
        )
        assert any(isinstance(m, torch.nn.Linear) for m in wide.modules())  # narrowing ones stay nn.Linear
        assert not any(isinstance(m, WideLinear) for m in model.modules())
        _decode_the_same(fused, wide, prompts, steps=5)
    if packable(torch.float32):  # the products of many rows: the encoder's and cross-attention's Wk, Wv packed
        ed = for_decoding(make_ed(seed=5, tie_output=tie_output), wide=True)
        assert all(type(m) is not torch.nn.Linear and not isinstance(m, WideLinear) for m in ed.encoder.modules())
        assert all(m.ffn.activated for m in ed.encoder.blocks)  # W1 with the activation inside
        for block in ed.decoder.blocks:
            assert isinstance(block.cross_attn.w_k, PackedLinear) and isinstance(block.cross_attn.w_v, PackedLinear)


@pytest.mark.parametrize("tie_output", [True, False])
def test_decoding_copies_share_no_tensor_with_their_model(tie_output: bool) -> None:
    """The decoding copies (fused, wide, int8) hold none of the model's tensors and leave its
    state as it was (their layers are made from the model's weights, not from a copy of them);
    the wide copy holds a tied vocabulary once, the embedding reading the transposed projection's
    rows, the same rows as the model's embedding (a vocabulary of 37 > d_model: a widening
    projection), and decodes as the fused copy does."""
    ed, do = (
        make_ed(seed=5, tie_output=tie_output, tgt_vocab_size=37),
        make_do("rope", seed=6, tie_output=tie_output, vocab_size=37),
    )
    for model in (ed, do):
        before = {name: t.clone() for name, t in model.state_dict().items()}
        theirs = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        for fast in (for_decoding(model), for_decoding(model, wide=True), int8_linears(for_decoding(model))):
            ours = {t.untyped_storage().data_ptr() for t in [*fast.parameters(), *fast.buffers()]}
            assert ours and not ours & theirs
        assert all(torch.equal(model.state_dict()[name], t) for name, t in before.items())
        wide = for_decoding(model, wide=True)
        embedding, theirs_ = (
            (wide.embed.token, model.embed.token)
            if hasattr(wide, "embed")
            else (wide.tgt_embed.token, model.tgt_embed.token)
        )
        same = embedding.weight.untyped_storage().data_ptr() == wide.output.weight_t.untyped_storage().data_ptr()
        assert isinstance(wide.output, WideLinear) and same == tie_output
        assert torch.equal(embedding.weight, theirs_.weight)
        _decode_the_same(for_decoding(model), wide, _random_rows([3, 5, 1], SRC_V, seed=11), steps=5)


@pytest.mark.skipif(not packable(), reason="this CPU or build has no oneDNN bfloat16 kernels")
def test_packed_linear_equals_the_bf16_product() -> None:
    """PackedLinear gives F.linear's bfloat16 product (any rows, float32 or strided bfloat16 in,
    the input's dtype out, bias or none), and a copy of it (deepcopy packs again) the same."""
    torch.manual_seed(0)
    for bias in (True, False):
        linear = torch.nn.Linear(13, 7, bias=bias)
        packed = PackedLinear(linear)
        w, b = linear.weight.bfloat16(), None if linear.bias is None else linear.bias.bfloat16()
        for x in (torch.randn(1, 13), torch.randn(3, 5, 13), torch.randn(4, 26, dtype=torch.bfloat16)[:, ::2]):
            assert packed(x).dtype == x.dtype
            torch.testing.assert_close(packed(x), F.linear(x.bfloat16(), w, b).to(x.dtype), atol=0, rtol=0)
            torch.testing.assert_close(copy.deepcopy(packed)(x), packed(x), atol=0, rtol=0)


@pytest.mark.skipif(not packable(), reason="this CPU or build has no oneDNN bfloat16 kernels")
@pytest.mark.parametrize("tie_output", [True, False])
def test_packed_bf16_copy_decodes_as_the_bf16_model(tie_output: bool) -> None:
    """packed_linears (what --bf16 loads on the CPU) holds every linear layer packed: the
    bfloat16 model's logits at every cached step, for both families, up to a few bfloat16 steps
    (oneDNN may block a packed product's sums otherwise: 1/128 seen at logits near 0.3); the
    model given keeps its nn.Linear layers."""
    prompts = _random_rows([3, 5, 1], V, seed=13)
    for model in (make_ed(seed=7, tie_output=tie_output), make_do("rope", seed=8, tie_output=tie_output)):
        bf16 = for_decoding(model).to(torch.bfloat16)
        packed = packed_linears(bf16)
        assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
        assert any(isinstance(m, PackedLinear) for m in packed.modules())
        assert not any(isinstance(m, PackedLinear) for m in bf16.modules())
        _same_steps(bf16, packed, prompts, steps=5, atol=3e-2)


@pytest.mark.parametrize("bias", [True, False])
def test_wide_linear_equals_linear_on_one_row_and_many(bias: bool) -> None:
    """WideLinear (the weight stored transposed) gives nn.Linear's output for one decoding row, a
    few, and an encoder's many rows (3-D inputs too), with and without a bias."""
    torch.manual_seed(17)
    linear = torch.nn.Linear(7, 23, bias=bias)
    wide = WideLinear(linear)
    assert (wide.many is not None) == packable(torch.float32)  # from 4 rows: the packed copy's product
    for shape in [(1, 7), (3, 1, 7), (5, 7), (2, 263, 7)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            torch.testing.assert_close(wide(x), linear(x), atol=1e-5, rtol=0)
            torch.testing.assert_close(copy.deepcopy(wide)(x), wide(x), atol=0, rtol=0)


@pytest.mark.skipif(not packable(torch.float32), reason="this build has no oneDNN")
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
def test_packed_float32_first_layer_equals_linear_then_activation(activation: str) -> None:
    """A float32 PackedLinear with the activation inside its product (FeedForward.pack_first, what
    an encoder gets for decoding) gives the feed-forward's output, one row or many, bias or none,
    and a copy of it the same; gated activations are refused."""
    torch.manual_seed(19)
    for bias in (True, False):
        ffn = FeedForward(11, 29, activation=activation, bias=bias).eval()
        packed = copy.deepcopy(ffn)
        packed.pack_first(rows=64)
        assert isinstance(packed.w_1, PackedLinear) and packed.activated
        for shape in [(1, 11), (3, 5, 11), (2, 131, 11)]:
            x = torch.randn(*shape) * 3
            with torch.no_grad():
                torch.testing.assert_close(packed(x), ffn(x), atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(copy.deepcopy(packed)(x), packed(x), atol=0, rtol=0)
    with pytest.raises(ValueError, match="ungated"):
        FeedForward(11, 29, activation="swiglu").pack_first(rows=64)


# ----------------------------------------------------------------- ensembles


def _ref_ensemble_greedy(models, inputs: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy decoding of the mean distribution by full, uncached forward passes of every model."""
    outputs = []
    with torch.no_grad():
        for row in inputs:
            out: list[int] = []
            for _ in range(max_new_tokens):
                if isinstance(models[0], EncoderDecoder):
                    probs = [m(torch.tensor([row]), torch.tensor([[BOS, *out]]))[0, -1].softmax(-1) for m in models]
                else:
                    probs = [m(torch.tensor([row + out]))[0, -1].softmax(-1) for m in models]
                token = int(torch.stack(probs).mean(0).argmax())
                if token == EOS:
                    break
                out.append(token)
            outputs.append(out)
    return outputs


def _perturbed(model, seed: int, scale: float):
    """A copy of ``model`` with Gaussian noise on every weight: a different model of the same shape."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale * p.std().nan_to_num(0.1))
    return other


@pytest.mark.parametrize("family", ["encoder_decoder", "decoder_only"])
def test_ensemble_decodes_the_mean_distribution(family: str, copy_model, lm_model) -> None:
    """An ensemble of one model is that model (greedy, beam, sampling); of the same model
    twice, the same outputs; of different models, greedy equals argmax of the mean of their
    distributions computed without any cache, and the first step's distribution is their mean."""
    a, inputs = (copy_model[0], copy_model[1]) if family == "encoder_decoder" else (lm_model[0], lm_model[1])
    b, c = _perturbed(a, 1, 0.6), _perturbed(a, 2, 0.6)
    alone, one = greedy(a, inputs, max_new_tokens=7), Ensemble((a,))
    assert greedy(one, inputs, max_new_tokens=7) == alone
    assert beam_search(one, inputs, beam_size=3, max_new_tokens=7) == beam_search(
        a, inputs, beam_size=3, max_new_tokens=7
    )
    assert sample(one, inputs, max_new_tokens=7, seed=5) == sample(a, inputs, max_new_tokens=7, seed=5)
    twice = beam_search(Ensemble((a, a)), inputs, beam_size=3, max_new_tokens=7, nbest=2)
    reference = beam_search(a, inputs, beam_size=3, max_new_tokens=7, nbest=2)
    assert [[h.tokens for h in hs] for hs in twice] == [[h.tokens for h in hs] for hs in reference]
    pairs = [(x, y) for hs, rs in zip(twice, reference, strict=True) for x, y in zip(hs, rs, strict=True)]
    assert all(math.isclose(x.score, y.score, abs_tol=1e-5) for x, y in pairs)
    singles = [greedy(m, inputs, max_new_tokens=7) for m in (a, b, c)]
    assert len({str(x) for x in singles}) > 1  # the models disagree: the mean decides
    three = Ensemble((a, b, c))
    assert greedy(three, inputs, max_new_tokens=7) == _ref_ensemble_greedy([a, b, c], inputs, 7)
    logits, _ = decoder_for(three).start(inputs)
    first = [decoder_for(m).start(inputs)[0].log_softmax(-1) for m in (a, b, c)]
    assert torch.allclose(logits.exp(), torch.stack(first).exp().mean(0), atol=1e-6)


def test_ensemble_decoding_copies_and_sliding_window(copy_model) -> None:
    """for_decoding, int8_linears and packed_linears of an ensemble are ensembles of copies of its members,
    decoding as the members' copies ensembled do; continuation slides past the window for an
    ensemble of decoder-only models exactly as for the model it holds."""
    a, inputs = copy_model[0], copy_model[1]
    pair = Ensemble((a, _perturbed(a, 1, 0.6)))
    for convert in (for_decoding, int8_linears, packed_linears):
        converted = convert(pair)
        assert isinstance(converted, Ensemble)
        assert all(x is not y for x, y in zip(converted.models, pair.models, strict=True))
        expected = greedy(Ensemble(tuple(convert(m) for m in pair.models)), inputs, max_new_tokens=7)
        assert greedy(converted, inputs, max_new_tokens=7) == expected
    torch.manual_seed(5)
    config = DecoderOnlyConfig(vocab_size=13, d_model=15, n_heads=3, d_ff=7, n_layers=1, max_len=11, dropout=0.0)
    model = DecoderOnly(config).eval()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]  # longer than the window
    alone = list(continuation(model, prompt, max_new_tokens=30, choose=most_likely, slide=True))
    assert len(alone) == 30
    assert list(continuation(Ensemble((model,)), prompt, max_new_tokens=30, choose=most_likely, slide=True)) == alone


def test_ensemble_refuses_models_that_do_not_fit_together() -> None:
    with pytest.raises(ValueError, match="at least one model"):
        Ensemble(())
    with pytest.raises(ValueError, match="ensemble model 1 is a DecoderOnly, model 0 a EncoderDecoder"):
        Ensemble((make_ed(), make_do()))
    with pytest.raises(ValueError, match="ensemble model 1 has tgt_vocab_size=11, model 0 tgt_vocab_size=13"):
        Ensemble((make_ed(), make_ed(tgt_vocab_size=11)))
    assert Ensemble((make_ed(max_len=40), make_ed(max_len=9))).config.max_len == 9


# ------------------------------------------------------------------- the protocol, by mocks


def _table_logits(tokens: list[int], *, vocab: int = 5, seed: int = 0) -> torch.Tensor:
    """Fixed random logits for every history: a mock decoder with known log-probabilities."""
    g = torch.Generator().manual_seed(hash((seed, *tokens)) % 2**31)
    return torch.randn(vocab, generator=g) * 2.0


def _brute_force(logp_of, *, vocab: int, eos: int, cap: int, length_penalty: float) -> list[tuple[list[int], float]]:
    """Every output of at most ``cap`` tokens (ending at END, or at the cap without it), scored
    as beam search scores a finished hypothesis (log p / length^penalty, END counted), best first."""
    found, frontier = [], [([], 0.0)]
    for step in range(1, cap + 1):
        grown = []
        for tokens, score in frontier:
            logp = logp_of(tokens)
            for t in range(vocab):
                s = score + float(logp[t])
                if t == eos:
                    found.append((tokens, s / step**length_penalty))
                elif step == cap:
                    found.append(([*tokens, t], s / step**length_penalty))
                else:
                    grown.append(([*tokens, t], s))
        frontier = grown
    return sorted(found, key=lambda x: -x[1])


@pytest.mark.parametrize("length_penalty", [0.0, 0.7, 1.0])
def test_beam_search_is_exhaustive_when_the_beam_holds_every_prefix(length_penalty: float) -> None:
    """With a beam as wide as every prefix there is (V^(cap-1)), beam search finds exactly the
    brute-force ranking of every output of a mock decoder: same tokens, same scores."""
    vocab, eos, cap = 5, 2, 3
    decoder = ScriptedDecoder(lambda tokens: _table_logits(tokens, vocab=vocab), vocab_size=vocab, eos_id=eos)
    best = beam_search(
        decoder, [[7]], beam_size=vocab ** (cap - 1), max_new_tokens=cap, length_penalty=length_penalty, nbest=6
    )[0]
    expected = _brute_force(
        lambda t: _table_logits(t, vocab=vocab).log_softmax(-1),
        vocab=vocab,
        eos=eos,
        cap=cap,
        length_penalty=length_penalty,
    )[:6]
    assert [h.tokens for h in best] == [tokens for tokens, _ in expected]
    assert [h.score for h in best] == pytest.approx([score for _, score in expected], abs=1e-5)


def test_beam_one_on_a_mock_decoder_is_greedy_and_the_hook_sees_every_step() -> None:
    """Beam width 1 picks what greedy picks on the mock; ``on_step`` sees one BeamStep per step,
    whose live hypothesis is the output so far, whose parents chain, and whose last step ends it."""
    decoder = ScriptedDecoder(lambda tokens: _table_logits(tokens, seed=3), vocab_size=5, eos_id=None)
    steps = []
    best = beam_search(decoder, [[1]], beam_size=1, max_new_tokens=6, on_step=steps.append)[0][0]
    assert best.tokens == greedy(decoder, [[1]], max_new_tokens=6)[0]
    assert [s.step for s in steps] == list(range(6)) and steps[-1].capped
    assert [s.live[0].tokens for s in steps[:-1]] == [best.tokens[: i + 1] for i in range(5)]
    assert steps[0].live[0].parent is None and all(s.live[0].parent == 0 for s in steps[1:-1])
    assert steps[-1].ended[0].tokens == best.tokens


class NoRepeats:
    """A custom scorer (qkv.decoding's Scorer protocol): a token may not follow itself."""

    weight, partial = 1.0, False

    def start(self, decoder, state, rows, steps):
        return torch.full((len(rows),), -1)  # (N,): each hypothesis' last token (-1: none yet)

    def score(self, last, candidates):
        banned = torch.zeros(len(last), 5)  # (N, V)
        banned[last >= 0, last[last >= 0]] = float("-inf")
        return banned, last

    def advance(self, last, rows, tokens):
        return tokens

    def bytes_needed(self, decoder, *, inputs, beam, source, steps):
        return 0


def test_a_custom_scorer_is_one_class_and_every_search_takes_it() -> None:
    """A scorer written here (no edit to any search) steers greedy and beam search alike; with
    weight 0 it changes nothing. The mock decoder always prefers to repeat its last token."""

    def repeat_last(tokens: list[int]) -> torch.Tensor:
        row = torch.zeros(5)
        row[tokens[-1] if tokens else 3] = 5.0
        return row

    decoder = ScriptedDecoder(repeat_last, vocab_size=5, eos_id=None)
    assert greedy(decoder, [[1]], max_new_tokens=4) == [[3, 3, 3, 3]]
    steered = greedy(decoder, [[1]], max_new_tokens=4, scorers=[NoRepeats()])[0]
    beamed = beam_search(decoder, [[1]], beam_size=3, max_new_tokens=4, scorers=[NoRepeats()])[0][0].tokens
    for out in (steered, beamed):
        assert len(out) == 4 and all(a != b for a, b in itertools.pairwise(out))
    silent = NoRepeats()
    silent.weight = 0.0
    assert beam_search(decoder, [[1]], beam_size=3, max_new_tokens=4, scorers=[silent])[0][0].tokens == [3, 3, 3, 3]


def test_banned_tokens_never_appear_and_bad_ids_are_refused() -> None:
    """BannedTokens keeps its tokens out of every output of a real model, greedy and beam; an id
    outside the vocabulary is refused."""
    from qkv.decoding import BannedTokens

    model = make_ed("rope", seed=6)
    sources = _random_rows([4, 6, 3], SRC_V, seed=6)
    plain = greedy(model, sources, max_new_tokens=8)
    banned = sorted({t for out in plain for t in out})[:3]
    assert banned, "the model wrote nothing to ban"
    for out in greedy(model, sources, max_new_tokens=8, scorers=[BannedTokens(banned)]):
        assert not set(out) & set(banned)
    for hyps in beam_search(model, sources, beam_size=3, max_new_tokens=8, nbest=3, scorers=[BannedTokens(banned)]):
        assert all(not set(h.tokens) & set(banned) for h in hyps)
    with pytest.raises(ValueError, match="banned tokens"):
        greedy(model, sources, max_new_tokens=8, scorers=[BannedTokens([TGT_V])])


@pytest.mark.parametrize(
    ("positions", "overrides"),
    [
        ("sinusoidal", {}),
        ("sinusoidal", {"norm_first": False}),
        ("rope", {"n_kv_heads": 1, "qk_norm": True}),
        ("alibi", {"sandwich_norm": True, "activation": "swiglu"}),
    ],
)
@pytest.mark.parametrize("fused", [False, True])
def test_ragged_encoding_equals_the_padded_one_at_the_real_positions(positions: str, overrides: dict, fused) -> None:
    """The encoder's ragged path (decoding: the padding's rows skip every position-wise product)
    equals the padded computation at every real position, writes zeros at the padding, and a
    batch with padding decodes as its inputs one by one (no padding, so the padded path)."""
    model = make_ed(positions, seed=11, **overrides)
    model = for_decoding(model) if fused else model
    rows = _random_rows([7, 3, 5, 1], SRC_V, seed=11)
    src = torch.tensor([r + [PAD] * (7 - len(r)) for r in rows])  # (B, S)
    valid = src != PAD  # (B, S)
    with torch.no_grad():
        padded = model.encode(src, src_mask=valid)  # (B, S, D)
        ragged = model.encode(src, src_mask=valid, ragged=True)  # (B, S, D)
    assert torch.allclose(ragged[valid], padded[valid], atol=1e-5)
    assert not ragged[~valid].any()
    assert greedy(model, rows, max_new_tokens=6) == [greedy(model, [r], max_new_tokens=6)[0] for r in rows]
