"""Tests of qkv.attention: masks, the explicit and fused attention paths (with ALiBi's bias), MHA.
RoPE and ALiBi themselves: test_positions.py.

Sizes are small and mostly prime (B=2, H=3, T=5, S=7, K=5) so that a swapped axis cannot
go unnoticed.
"""

from __future__ import annotations

import math

import pytest
import torch

from qkv.attention import (
    MultiHeadAttention,
    _explicit_is_faster,
    attention_explicit,
    attention_fused,
    causal_mask,
    padding_mask,
    repeat_kv_heads,
)
from qkv.kv_cache import KVBuffer
from qkv.positions import alibi_bias

B, H, T, S, K = 2, 3, 5, 7, 5
TOL = 1e-5


def _qkv(t: int = T, s: int = S, *, h: int = H, k: int = K) -> tuple[torch.Tensor, ...]:
    q = torch.randn(B, h, t, k, requires_grad=True)
    key = torch.randn(B, h, s, k, requires_grad=True)
    v = torch.randn(B, h, s, k, requires_grad=True)
    return q, key, v


def _padding(lengths: list[int], s: int) -> torch.Tensor:
    """(B, 1, 1, S) key mask with the first ``lengths[b]`` keys of row b real."""
    valid = torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]  # (B, S)
    return padding_mask(valid)


def _grads(out: torch.Tensor, weight: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad((out * weight).sum(), tensors))


def _cases() -> dict[str, tuple[int, int, torch.Tensor | None, torch.Tensor | None]]:
    """name -> (t, s, mask, bias)."""
    return {
        "plain": (T, T, None, None),
        "causal": (T, T, causal_mask(T, T), None),
        "padded": (T, T, _padding([T, 3], T), None),
        "cross": (T, S, None, None),
        "cross_padded": (T, S, _padding([S, 4], S), None),
        "alibi": (T, T, None, alibi_bias(H, T, T, causal=True)),
        "alibi_causal_padded": (
            T,
            T,
            causal_mask(T, T)[None, None] & _padding([T, 4], T),
            alibi_bias(H, T, T, causal=True),
        ),
        "alibi_cross_padded": (T, S, _padding([6, S], S), alibi_bias(H, T, S, causal=False)),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_explicit_equals_fused_forward_and_backward(case: str) -> None:
    """Explicit (textbook) and fused (SDPA) attention agree in fp32, outputs and gradients."""
    torch.manual_seed(0)
    t, s, mask, bias = _cases()[case]
    q, k, v = _qkv(t, s)
    out_e, _ = attention_explicit(q, k, v, mask=mask, bias=bias)
    out_f = attention_fused(q, k, v, mask=mask, bias=bias)
    assert out_e.shape == out_f.shape == (B, H, t, K)
    assert (out_e - out_f).abs().max() <= TOL
    weight = torch.randn_like(out_e)
    for ge, gf in zip(_grads(out_e, weight, q, k, v), _grads(out_f, weight, q, k, v), strict=True):
        assert torch.isfinite(ge).all() and torch.isfinite(gf).all()
        assert (ge - gf).abs().max() <= TOL


@pytest.mark.parametrize("case", ["causal", "alibi_cross_padded"])
def test_fused_shares_kv_heads_like_repeating_them(case: str) -> None:
    """Grouped-query attention: the fused kernel given G = 1 key/value head for H query heads
    equals explicit attention on the head repeated H times, outputs and gradients."""
    torch.manual_seed(2)
    t, s, mask, bias = _cases()[case]
    q = torch.randn(B, H, t, K, requires_grad=True)
    k, v = (torch.randn(B, 1, s, K, requires_grad=True) for _ in range(2))  # (B, G=1, S, K)
    out_f = attention_fused(q, k, v, mask=mask, bias=bias)
    out_e, _ = attention_explicit(q, k.expand(B, H, s, K), v.expand(B, H, s, K), mask=mask, bias=bias)
    assert (out_e - out_f).abs().max() <= TOL
    weight = torch.randn_like(out_e)
    for ge, gf in zip(_grads(out_e, weight, q, k, v), _grads(out_f, weight, q, k, v), strict=True):
        assert (ge - gf).abs().max() <= TOL


def test_bf16_training_of_short_sequences_takes_the_explicit_path() -> None:
    """The path choice (_explicit_is_faster): explicit only for bf16 with gradients and at most
    128 keys; there MultiHeadAttention's output and gradients equal the fused kernel's (within
    bf16 rounding), so the choice changes speed, not results."""
    torch.manual_seed(3)
    q, k = torch.randn(B, H, T, K, requires_grad=True), torch.randn(B, H, 129, K)
    assert not _explicit_is_faster(q, k[:, :, :S])  # fp32
    qb = q.detach().bfloat16().requires_grad_()
    assert _explicit_is_faster(qb, k[:, :, :S].bfloat16())
    assert not _explicit_is_faster(qb, k.bfloat16())  # 129 keys: the fused kernel is as fast
    with torch.no_grad():
        assert not _explicit_is_faster(qb, k[:, :, :S].bfloat16())  # inference
    mha = _mha(n_kv_heads=1).bfloat16().train()
    x = torch.randn(B, T, H * K, dtype=torch.bfloat16, requires_grad=True)
    mask = causal_mask(T, T)
    out, _, _ = mha(x, mask=mask)  # explicit (chosen)
    (grad_explicit,) = torch.autograd.grad(out.float().sum(), x)
    # The fused kernel on the same projections, by hand.
    qf = mha._split(mha.w_q(x), H)
    kf, vf = mha._split(mha.w_k(x), 1), mha._split(mha.w_v(x), 1)
    fused = attention_fused(qf, kf, vf, mask=mask)  # (B, H, T, K)
    ref = mha.w_o(fused.transpose(1, 2).reshape(B, T, H * K))
    (grad_fused,) = torch.autograd.grad(ref.float().sum(), x)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(grad_explicit.float(), grad_fused.float(), atol=5e-2, rtol=5e-2)


def test_a_bf16_decoding_step_attends_as_float32_rounded() -> None:
    """One bfloat16 query row over many keys (a decoding step: the fused kernel runs in float32
    there, faster) gives float32's attention rounded to bfloat16, the most exact bfloat16 answer,
    grouped-query heads and padded keys included; within bfloat16 rounding of the textbook path."""
    torch.manual_seed(11)
    s = 67
    q = torch.randn(B, H, 1, K, dtype=torch.bfloat16)  # (B, H, 1, K)
    k, v = torch.randn(B, 1, s, K, dtype=torch.bfloat16), torch.randn(B, 1, s, K, dtype=torch.bfloat16)
    mask = _padding([61, s], s)  # (B, 1, 1, S)
    with torch.no_grad():
        out = attention_fused(q, k, v, mask=mask)  # (B, H, 1, K)
        wide = attention_fused(q.float(), k.float(), v.float(), mask=mask)  # (B, H, 1, K)
        textbook, _ = attention_explicit(q, *repeat_kv_heads(k, v, H), mask=mask)  # (B, H, 1, K)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, wide.bfloat16(), atol=0, rtol=0)
    torch.testing.assert_close(out.float(), textbook.float(), atol=2e-2, rtol=2e-2)


def test_explicit_matches_hand_computation() -> None:
    """The explicit path is softmax(QKᵀ/√K + bias, masked)·V, computed here by hand."""
    torch.manual_seed(1)
    q, k, v = (x.detach() for x in _qkv(T, S))
    mask = _padding([S, 4], S)
    bias = alibi_bias(H, T, S, causal=False)
    scores = torch.einsum("bhtk,bhsk->bhts", q, k) / math.sqrt(K) + bias
    scores = scores.masked_fill(~mask, float("-inf"))
    expected = torch.einsum("bhts,bhsk->bhtk", scores.softmax(-1), v)
    out, _ = attention_explicit(q, k, v, mask=mask, bias=bias)
    assert (out - expected).abs().max() <= TOL


def test_softmax_weights_rows_sum_to_one_and_masked_are_zero() -> None:
    """Softmax weights: each row with an allowed key sums to 1; forbidden keys get exactly 0."""
    torch.manual_seed(2)
    q, k, v = _qkv(T, S)
    mask = causal_mask(T, S)[None, None] & _padding([S, 3], S)  # (B, 1, T, S)
    _, weights = attention_explicit(q, k, v, mask=mask)
    assert weights.shape == (B, H, T, S)
    full = mask.expand(B, H, T, S)
    assert torch.all(weights[~full] == 0.0)
    row_sums = weights.sum(-1)  # (B, H, T)
    has_key = full.any(-1)
    assert has_key.all()
    assert torch.allclose(row_sums, torch.ones_like(row_sums), atol=TOL)


@pytest.mark.parametrize("with_bias", [False, True])
def test_fully_masked_query_row_is_zero_and_finite(with_bias: bool) -> None:
    """A query row that may attend to nothing: zero output, zero weights, no NaN (fwd/bwd), both paths."""
    torch.manual_seed(3)
    q, k, v = _qkv(T, S)
    mask = torch.ones(B, 1, T, S, dtype=torch.bool)
    mask[0, :, 2] = False  # row 2 of batch 0 sees no key
    mask[1, :, 4, 3:] = False  # an ordinary partly masked row
    bias = alibi_bias(H, T, S, causal=False) if with_bias else None
    out_e, weights = attention_explicit(q, k, v, mask=mask, bias=bias)
    out_f = attention_fused(q, k, v, mask=mask, bias=bias)
    for out in (out_e, out_f):
        assert torch.isfinite(out).all()
        assert torch.all(out[0, :, 2] == 0.0)
    assert torch.all(weights[0, :, 2] == 0.0)
    assert (out_e - out_f).abs().max() <= TOL
    weight = torch.randn_like(out_e)
    for out in (out_e, out_f):
        grads = _grads(out, weight, q, k, v)
        assert all(torch.isfinite(g).all() for g in grads)
        assert torch.all(grads[0][0, :, 2] == 0.0)  # nothing flows back into the dead query


def test_sigmoid_weights_match_hand_computation() -> None:
    """Sigmoid normalization: A' = sigmoid(QKᵀ/√K - log n) with n the number of keys."""
    torch.manual_seed(4)
    q, k, v = (x.detach() for x in _qkv(T, S))
    out, weights = attention_explicit(q, k, v, normalization="sigmoid")
    expected = torch.sigmoid(q @ k.transpose(-2, -1) / math.sqrt(K) - math.log(S))
    assert (weights - expected).abs().max() <= TOL
    assert (out - expected @ v).abs().max() <= TOL


def test_sigmoid_masked_uses_allowed_key_count_and_no_nan() -> None:
    """Sigmoid with a mask: masked keys weigh 0, n counts allowed keys, fully masked rows are zero, no NaN."""
    torch.manual_seed(5)
    q, k, v = _qkv(T, S)
    mask = causal_mask(T, S)[None, None].expand(B, 1, T, S).clone()
    mask[1, :, 0] = False  # a fully masked row
    out, weights = attention_explicit(q, k, v, mask=mask, normalization="sigmoid")
    full = mask.expand(B, H, T, S)
    assert torch.all(weights[~full] == 0.0)
    n = full.sum(-1, keepdim=True).clamp(min=1).float()
    scores = q @ k.transpose(-2, -1) / math.sqrt(K)
    expected = torch.sigmoid(scores - n.log()).masked_fill(~full, 0.0)
    assert (weights - expected).abs().max() <= TOL
    assert torch.all(out[1, :, 0] == 0.0)
    grads = _grads(out, torch.randn_like(out), q, k, v)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("normalization", ["softmax", "sigmoid"])
def test_explicit_with_alibi_in_bfloat16(normalization: str) -> None:
    """The explicit path accepts bf16 q/k/v with an fp32 ALiBi bias (a model cast to bf16)."""
    torch.manual_seed(12)
    q, k, v = (x.detach().bfloat16() for x in _qkv(T, T))
    bias = alibi_bias(H, T, T, causal=True)  # fp32, as DecoderStack builds it for a bf16 model
    mask = causal_mask(T, T)
    out, weights = attention_explicit(q, k, v, mask=mask, bias=bias, normalization=normalization)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert torch.all(weights[..., ~mask] == 0)
    if normalization == "softmax":
        fused = attention_fused(q, k, v, mask=mask, bias=bias)
        assert (out.float() - fused.float()).abs().max() <= 3e-2


def test_unknown_normalization_raises() -> None:
    """An unknown normalization name is a ValueError, for the function and the module."""
    q, k, v = _qkv()
    with pytest.raises(ValueError):
        attention_explicit(q, k, v, normalization="relu")
    with pytest.raises(ValueError):
        MultiHeadAttention(H * K, H, normalization="relu")


def test_causal_mask_with_cache_is_bottom_rows() -> None:
    """causal_mask(t, s) for t < s is the last t rows of the full lower triangle causal_mask(s, s)."""
    full = causal_mask(S, S)
    assert torch.equal(full, torch.ones(S, S, dtype=torch.bool).tril())
    for t in (1, 3, S):
        assert torch.equal(causal_mask(t, S), full[S - t :])


def test_padding_mask_shape() -> None:
    """padding_mask broadcasts a (B, S) validity over heads and queries: (B, 1, 1, S)."""
    valid = torch.tensor([[True, True, False], [True, False, False]])
    mask = padding_mask(valid)
    assert mask.shape == (2, 1, 1, 3)
    assert torch.equal(mask[:, 0, 0], valid)


# ------------------------------------------------------------- multi-head attention


def _mha(**kwargs) -> MultiHeadAttention:
    return MultiHeadAttention(H * K, H, **kwargs).eval()


@pytest.mark.parametrize("n_kv_heads", [None, 1, 3])
@pytest.mark.parametrize("cross", [False, True])
def test_mha_weights_path_equals_fused_path(n_kv_heads: int | None, cross: bool) -> None:
    """MultiHeadAttention: need_weights=True (explicit) and False (fused) give equal outputs, incl. GQA."""
    torch.manual_seed(8)
    mha = _mha(n_kv_heads=n_kv_heads)
    x = torch.randn(B, T, H * K)
    context = torch.randn(B, S, H * K) if cross else None
    s = S if cross else T
    mask = _padding([s, s - 2], s)
    out_w, cache_w, weights = mha(x, context=context, mask=mask, need_weights=True)
    out_f, cache_f, none = mha(x, context=context, mask=mask)
    assert none is None
    assert out_w.shape == out_f.shape == (B, T, H * K)
    assert weights.shape == (B, H, T, s)
    g = n_kv_heads or H
    assert cache_w[0].shape == (B, g, s, K)
    assert torch.equal(cache_w[0], cache_f[0]) and torch.equal(cache_w[1], cache_f[1])
    assert (out_w - out_f).abs().max() <= TOL


@pytest.mark.parametrize("n_kv_heads", [None, 1])
@pytest.mark.parametrize("t", [1, 2])
def test_cross_keys_shared_by_beams_equal_repeated_keys(n_kv_heads: int | None, t: int) -> None:
    """Cross-attention keys and values of B inputs given for B·W rows (each input's W consecutive
    beams share them) give every row the output of keys and values repeated W times, on the
    fused path (grouped: W·T queries per input) and the explicit one (need_weights), padding
    masked per input; the cache returned keeps the B rows."""
    torch.manual_seed(9)
    w = 3
    mha = _mha(n_kv_heads=n_kv_heads).eval()
    x = torch.randn(B * w, t, H * K)
    context = torch.randn(B, S, H * K)
    mask = _padding([S, S - 2], S)  # (B, 1, 1, S)
    with torch.no_grad():
        _, shared, _ = mha(x[:B], context=context)  # (B, G, S, K) twice
        repeated = tuple(c.repeat_interleave(w, dim=0) for c in shared)  # (B·W, G, S, K) twice
        expected, _, _ = mha(x, context=context, cache=repeated, mask=mask.repeat_interleave(w, dim=0))
        fused, cache, _ = mha(x, context=context, cache=shared, mask=mask)
        explicit, _, weights = mha(x, context=context, cache=shared, mask=mask, need_weights=True)
    assert cache[0].shape[0] == B and weights.shape == (B * w, H, t, S)
    torch.testing.assert_close(fused, expected, atol=TOL, rtol=0)
    torch.testing.assert_close(explicit, expected, atol=TOL, rtol=0)
    for need_weights in (False, True):
        with pytest.raises(ValueError, match="cannot share"):
            mha(x[:-1], context=context, cache=shared, mask=mask, need_weights=need_weights)


@pytest.mark.parametrize(("n_kv_heads", "bias", "rope"), [(None, True, False), (1, False, True), (3, True, True)])
def test_stacked_projections_equal_three_products(monkeypatch, n_kv_heads: int | None, bias: bool, rope: bool) -> None:
    """Self-attention over many rows computes Q, K, V as one product of [Wq; Wk; Wv]: outputs,
    cache and every gradient (input and the three weights) equal the three separate products."""
    import qkv.attention as attention

    torch.manual_seed(10)
    mha = MultiHeadAttention(H * 6, H, n_kv_heads=n_kv_heads, bias=bias, rope=rope)  # RoPE: even head width
    x = torch.randn(B, T, H * 6)
    positions = torch.arange(T)
    mask = causal_mask(T, T)[None, None]
    results = []
    for rows in (B * T + 1, B * T):  # above B*T: three products; at B*T: one stacked product
        monkeypatch.setattr(attention, "STACK_MIN_ROWS", rows)
        assert mha._stack_projections(x) == (rows == B * T)
        mha.zero_grad()
        xi = x.clone().requires_grad_(True)
        out, cache, _ = mha(xi, mask=mask, positions=positions)
        (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
        grads = [xi.grad] + [getattr(mha, n).weight.grad.clone() for n in ("w_q", "w_k", "w_v")]
        results.append((out, *cache, *grads))
    for separate, stacked in zip(*results, strict=True):
        assert (separate - stacked).abs().max() <= TOL


@pytest.mark.parametrize("n_kv_heads", [None, 1])
def test_key_bias_false_leaves_wk_without_a_bias(monkeypatch, n_kv_heads: int | None) -> None:
    """key_bias=False (Whisper's k_proj): Wk has no bias, Wq, Wv, Wo keep theirs. A key bias adds
    q·b to every score of a query alike, so softmax cancels it: the module equals one with any
    key bias. The stacked Q/K/V product and fuse_qkv (zeros in Wk's place) equal the three
    products; without ``bias`` there are no biases at all."""
    import qkv.attention as attention

    torch.manual_seed(12)
    plain = _mha(n_kv_heads=n_kv_heads, key_bias=False)
    assert plain.w_k.bias is None and all(getattr(plain, n).bias is not None for n in ("w_q", "w_v", "w_o"))
    with_bias = _mha(n_kv_heads=n_kv_heads)
    with torch.no_grad():
        for name in ("w_q", "w_k", "w_v", "w_o"):
            getattr(with_bias, name).weight.copy_(getattr(plain, name).weight)
            if name != "w_k":
                getattr(with_bias, name).bias.copy_(getattr(plain, name).bias)
        with_bias.w_k.bias.normal_()
    x, context = torch.randn(B, T, H * K), torch.randn(B, S, H * K)
    mask = causal_mask(T, T)
    out, (k, _), _ = plain(x, mask=mask)
    assert (out - with_bias(x, mask=mask)[0]).abs().max() <= TOL
    assert (plain(x, context=context)[0] - with_bias(x, context=context)[0]).abs().max() <= TOL
    monkeypatch.setattr(attention, "STACK_MIN_ROWS", 1)
    stacked, (k_stacked, _), _ = plain(x, mask=mask)
    assert (stacked - out).abs().max() <= TOL and (k_stacked - k).abs().max() <= TOL
    plain.fuse_qkv()
    assert (plain(x, mask=mask)[0] - out).abs().max() <= TOL
    bare = _mha(bias=False, key_bias=False)
    assert all(getattr(bare, n).bias is None for n in ("w_q", "w_k", "w_v", "w_o"))


def test_gqa_equals_mha_with_repeated_kv_heads() -> None:
    """GQA with G=1 kv head equals full MHA whose k/v projections repeat that head for every query head."""
    torch.manual_seed(9)
    d = H * K
    gqa = _mha(n_kv_heads=1)
    full = _mha()
    with torch.no_grad():
        full.w_q.load_state_dict(gqa.w_q.state_dict())
        full.w_o.load_state_dict(gqa.w_o.state_dict())
        for name in ("w_k", "w_v"):
            src, dst = getattr(gqa, name), getattr(full, name)
            dst.weight.copy_(src.weight.repeat(H, 1))  # (H*K, D): the one head, H times
            dst.bias.copy_(src.bias.repeat(H))
    x = torch.randn(B, T, d)
    mask = causal_mask(T, T)
    out_g, _, _ = gqa(x, mask=mask)
    out_f, _, _ = full(x, mask=mask)
    assert (out_g - out_f).abs().max() <= TOL


def test_gqa_head_grouping() -> None:
    """GQA with G=3 of H=6 heads: query head h uses kv head h // 2 (checked against a manual repeat)."""
    torch.manual_seed(10)
    h, g, k_width = 6, 3, 5
    gqa = MultiHeadAttention(h * k_width, h, n_kv_heads=g).eval()
    x = torch.randn(B, T, h * k_width)
    out, (kc, vc), weights = gqa(x, need_weights=True)
    q = gqa._split(gqa.w_q(x), h)
    kr, vr = kc.repeat_interleave(h // g, dim=1), vc.repeat_interleave(h // g, dim=1)
    ref, ref_w = attention_explicit(q, kr, vr)
    assert torch.allclose(weights, ref_w, atol=TOL)
    ref_out = gqa.w_o(ref.transpose(1, 2).reshape(B, T, h * k_width))
    assert torch.allclose(out, ref_out, atol=TOL)


def test_mha_self_attention_cache_equals_full() -> None:
    """Self-attention one token at a time with the KV cache equals one causal pass (RoPE on)."""
    torch.manual_seed(11)
    mha = MultiHeadAttention(18, 3, rope=True).eval()
    x = torch.randn(B, T, 18)
    full, _, _ = mha(x, mask=causal_mask(T, T), positions=torch.arange(T))
    cache, steps = None, []
    for i in range(T):
        out, cache, _ = mha(x[:, i : i + 1], mask=causal_mask(1, i + 1), positions=torch.tensor([i]), cache=cache)
        steps.append(out)
    assert cache[0].shape == (B, 3, T, 6)
    assert (torch.cat(steps, dim=1) - full).abs().max() <= TOL


@pytest.mark.parametrize("n_kv_heads", [None, 1])
def test_cross_attention_cache_is_each_heads_projection_in_one_block(n_kv_heads: int | None) -> None:
    """context_cache holds context·Wk and context·Wv split into heads, each head's S rows one
    contiguous block (what every decoding step reads); attending through that cache equals
    attending to the context itself."""
    torch.manual_seed(13)
    mha = MultiHeadAttention(15, 3, n_kv_heads=n_kv_heads).eval()
    g = n_kv_heads or 3
    x, context = torch.randn(B, T, 15), torch.randn(B, S, 15)
    with torch.no_grad():
        k, v = mha.context_cache(context)
        assert k.shape == v.shape == (B, g, S, 5) and k.is_contiguous() and v.is_contiguous()
        assert (k - mha.w_k(context).view(B, S, g, 5).transpose(1, 2)).abs().max() <= TOL
        assert (v - mha.w_v(context).view(B, S, g, 5).transpose(1, 2)).abs().max() <= TOL
        direct, cache, _ = mha(x, context=context)
        cached, _, _ = mha(x, context=context, cache=(k, v))
    assert cache[0].is_contiguous() and (cached - direct).abs().max() <= TOL


@pytest.mark.parametrize("n_kv_heads", [None, 1])
def test_kv_buffer_equals_concatenated_cache(n_kv_heads: int | None) -> None:
    """A preallocated KVBuffer, written in place, gives the outputs and keys/values of the
    concatenating cache at every step (RoPE, grouped-query); appending twice to one buffer
    state, or past its capacity, is refused, and so are tensors that autograd tracks (the
    in-place writes would corrupt saved tensors) and a cross-attention context."""
    torch.manual_seed(13)
    mha = MultiHeadAttention(18, 3, n_kv_heads=n_kv_heads, rope=True).eval()
    x = torch.randn(B, T, 18)
    _, tracked, _ = mha(x[:, :2], mask=causal_mask(2, 2), positions=torch.arange(2))
    with pytest.raises(RuntimeError, match="for inference"):
        KVBuffer.holding(tracked, capacity=T)
    with torch.no_grad():
        _kv_buffer_steps(mha, x)


def _kv_buffer_steps(mha: MultiHeadAttention, x: torch.Tensor) -> None:
    _, tuple_cache, _ = mha(x[:, :2], mask=causal_mask(2, 2), positions=torch.arange(2))
    buffer = KVBuffer.holding(tuple_cache, capacity=T)
    for i in range(2, T):
        step = {"mask": causal_mask(1, i + 1), "positions": torch.tensor([i])}
        a, tuple_cache, _ = mha(x[:, i : i + 1], cache=tuple_cache, **step)
        previous = buffer
        b, buffer, _ = mha(x[:, i : i + 1], cache=buffer, **step)
        # Equal up to rounding: under no_grad the fused kernel reads the buffer's strided view
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        assert buffer.length == i + 1
        assert torch.equal(buffer.k[:, :, : i + 1], tuple_cache[0])
        assert torch.equal(buffer.v[:, :, : i + 1], tuple_cache[1])
    with pytest.raises(RuntimeError, match="appended to already"):
        mha(x[:, :1], cache=previous, mask=causal_mask(1, T), positions=torch.tensor([T - 1]))
    with pytest.raises(ValueError, match="KV buffer full"):
        mha(x[:, :1], cache=buffer, mask=causal_mask(1, T + 1), positions=torch.tensor([T]))
    with pytest.raises(ValueError, match="self-attention cache"):
        mha(x[:, :1], context=x, cache=buffer)


def test_mha_rejects_bad_shapes() -> None:
    """d_model must divide by n_heads and n_heads by n_kv_heads."""
    with pytest.raises(ValueError):
        MultiHeadAttention(16, 3)
    with pytest.raises(ValueError):
        MultiHeadAttention(15, 3, n_kv_heads=2)


def test_explicit_attention_dropout_drops_the_weights_not_the_returned_weights():
    """Dropout on A' is layers.dropout's mask (same seed, same draws), applied before A'·V;
    p = 0 is the plain output, p = 1 a zero output; the returned A' is undropped."""
    from qkv.layers import keep_mask

    q, k, v = _qkv()
    plain, weights = attention_explicit(q, k, v)
    torch.manual_seed(3)
    out, returned = attention_explicit(q, k, v, dropout=0.3)
    torch.manual_seed(3)
    keep, scale = keep_mask(weights.shape, 0.3)
    torch.testing.assert_close(out, (weights * keep * scale) @ v, rtol=TOL, atol=TOL)
    torch.testing.assert_close(returned, weights)
    assert not torch.allclose(out, plain)
    torch.testing.assert_close(attention_explicit(q, k, v, dropout=0.0)[0], plain)
    assert torch.equal(attention_explicit(q, k, v, dropout=1.0)[0], torch.zeros_like(plain))


def test_a_bad_attention_dropout_fails_when_the_module_is_built():
    with pytest.raises(ValueError, match="dropout must be in"):
        MultiHeadAttention(6, 2, dropout=1.5)
