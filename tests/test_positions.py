"""Tests of qkv.positions: RoPE (a rotation whose scores depend on position differences only, its
three-operator form equal to the textbook's) and ALiBi's slopes and bias.

Sizes are small and mostly prime (B=2, H=3, T=5) so that a swapped axis cannot go unnoticed.
"""

from __future__ import annotations

import pytest
import torch

from qkv.positions import (
    RopeScaling,
    alibi_bias,
    alibi_slopes,
    rope_apply,
    rope_apply_rolled,
    rope_cos_sin,
    rope_rotate,
    rope_turn,
)

B, H, T = 2, 3, 5
TOL = 1e-5


def test_rope_scores_depend_only_on_position_difference() -> None:
    """RoPE: q·k after rotation depends only on p - p' (shifting both positions keeps the score)."""
    torch.manual_seed(6)
    k_width = 6
    q = torch.randn(1, H, 1, k_width, dtype=torch.float64)
    k = torch.randn(1, H, 1, k_width, dtype=torch.float64)
    for p, p2 in [(0, 3), (4, 1), (7, 7), (2, 11)]:
        base = (rope_rotate(q, torch.tensor([p])) * rope_rotate(k, torch.tensor([p2]))).sum(-1)
        for shift in (1, 5, 13):
            shifted = (rope_rotate(q, torch.tensor([p + shift])) * rope_rotate(k, torch.tensor([p2 + shift]))).sum(-1)
            assert torch.allclose(base, shifted, atol=1e-10)
    # not trivially constant: a different difference gives a different score
    a = (rope_rotate(q, torch.tensor([0])) * rope_rotate(k, torch.tensor([1]))).sum(-1)
    b = (rope_rotate(q, torch.tensor([0])) * rope_rotate(k, torch.tensor([4]))).sum(-1)
    assert not torch.allclose(a, b)


def test_rope_preserves_norm_and_position_zero_is_identity() -> None:
    """RoPE is a rotation: norms are kept; position 0 leaves the vector unchanged; (B, T) positions work."""
    torch.manual_seed(7)
    x = torch.randn(B, H, T, 6)
    positions = torch.tensor([[0, 1, 2, 3, 4], [3, 5, 8, 13, 21]])  # (B, T)
    y = rope_rotate(x, positions)
    assert y.shape == x.shape
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=TOL)
    assert torch.allclose(y[0, :, 0], x[0, :, 0], atol=TOL)
    assert not torch.allclose(y[0, :, 1], x[0, :, 1])
    # a (T,) position vector equals the same positions given per row
    same = rope_rotate(x, torch.arange(T))
    assert torch.allclose(same[0], y[0], atol=TOL)


@pytest.mark.parametrize("scaling", [None, RopeScaling("yarn", 3.0, original_max_len=7)])
def test_rope_in_three_operators_equals_the_textbook_rotation(scaling) -> None:
    """rope_apply_rolled with rope_turn's tables (what attention runs: x·cos + roll(x)·signed sin)
    rotates as rope_apply with rope_cos_sin's (x·cos + rotate_half(x)·sin), YaRN's scaled tables
    included; and rotating stacked query and key heads in one call equals rotating each."""
    torch.manual_seed(8)
    x = torch.randn(B, 5, T, 10, dtype=torch.float64)  # (B, H + G, T, K)
    positions = torch.tensor([[0, 1, 2, 3, 4], [3, 5, 8, 13, 21]])  # (B, T)
    tables = {"width": 10, "dtype": torch.float64, "device": "cpu", "base": 13.0, "scaling": scaling}
    rolled = rope_apply_rolled(x, *rope_turn(positions, **tables))
    torch.testing.assert_close(rolled, rope_apply(x, *rope_cos_sin(positions, **tables)), atol=1e-12, rtol=0)
    q, k = x.split([3, 2], dim=1)
    each = torch.cat(
        [rope_apply(q, *rope_cos_sin(positions, **tables)), rope_apply(k, *rope_cos_sin(positions, **tables))], 1
    )
    torch.testing.assert_close(rolled, each, atol=1e-12, rtol=0)
    assert not torch.allclose(rolled, x)


def test_alibi_slopes_power_of_two() -> None:
    """alibi_slopes(8) is 2^-1 ... 2^-8 (Press et al.)."""
    expected = torch.tensor([2.0**-i for i in range(1, 9)])
    assert torch.allclose(alibi_slopes(8), expected, rtol=1e-6, atol=0)


def test_alibi_slopes_not_power_of_two() -> None:
    """alibi_slopes(6): 6 slopes, the first 4 those of alibi_slopes(4), then every other one of 8."""
    slopes = alibi_slopes(6)
    assert slopes.shape == (6,)
    assert torch.allclose(slopes[:4], alibi_slopes(4))
    assert torch.allclose(slopes[4:], alibi_slopes(8)[0::2][:2])
    assert alibi_slopes(3).shape == (3,)


def test_alibi_bias_values() -> None:
    """ALiBi bias is slope·(j - i) for causal and -slope·|i - j| otherwise, with queries at the end."""
    slopes = alibi_slopes(H)
    causal = alibi_bias(H, 2, 4, causal=True)
    assert causal.shape == (1, H, 2, 4)
    # query 0 sits at position 2: distances to keys 0..3 are -2, -1, 0, 1
    assert torch.allclose(causal[0, :, 0], slopes[:, None] * torch.tensor([-2.0, -1.0, 0.0, 1.0]))
    sym = alibi_bias(H, 4, 4, causal=False)
    assert torch.allclose(sym, sym.transpose(-1, -2))
    assert torch.all(sym <= 0)
