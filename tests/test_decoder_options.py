"""The decoder options imported Llama-family checkpoints need, each on its own: sliding-window
layers, per-head query/key norms, sandwich norms, GEGLU, a head width of its own, biases on Wq, Wk,
Wv alone, a score scale, a RoPE base and its scalings, and the sliding layers' own RoPE; and that
their defaults leave a model as it was.

Sizes are tiny and mostly prime: D=18 (H=3, K=6), F=11, vocabulary 13, T up to 11.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from qkv.attention import MultiHeadAttention, attention_explicit, attention_fused
from qkv.blocks import DecoderBlock
from qkv.layers import FeedForward
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.positions import Rope, RopeScaling, rope_cos_sin, rope_frequencies

V = 13
BASE = {"d_model": 18, "n_heads": 3, "d_ff": 11, "vocab_size": V, "dropout": 0.0, "positions": "rope", "max_len": 32}


def model(**fields) -> DecoderOnly:
    torch.manual_seed(0)
    built = DecoderOnly(DecoderOnlyConfig(**{**BASE, "n_layers": 2, **fields})).eval()
    with torch.no_grad():  # norms and biases off their initial 1 and 0
        for p in built.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    return built


def test_defaults_leave_a_model_as_it_was() -> None:
    """A config without the new fields (an old config.json) is the config with their defaults,
    and its model has no parameter the options add."""
    new = {"head_dim", "qkv_bias", "qk_norm", "attention_scale", "sandwich_norm", "rope_base", "rope_scaling"}
    new |= {"sliding_window", "sliding_blocks", "local_rope_base"}
    config = DecoderOnlyConfig(**{**BASE, "n_layers": 2})
    assert new <= {f.name for f in dataclasses.fields(config)}
    old = {k: v for k, v in dataclasses.asdict(config).items() if k not in new}
    assert DecoderOnlyConfig(**old) == config
    names = list(DecoderOnly(config).state_dict())
    assert not [n for n in names if "q_norm" in n or "k_norm" in n or "post_norm" in n]
    assert len(names) == len(DecoderOnly(DecoderOnlyConfig(**old)).state_dict())


def test_sliding_window_sees_only_the_newest_positions() -> None:
    """A sliding layer's position t reads positions t - window + 1 .. t: tokens before them
    change nothing there, one inside changes it; a layer without a window sees them all."""
    window, t = 4, 10
    sliding = model(n_layers=1, sliding_window=window)
    full = model(n_layers=1)
    tokens = torch.randint(0, V, (1, t + 1), generator=torch.Generator().manual_seed(1))
    early, inside = tokens.clone(), tokens.clone()
    early[0, : t - window + 1] = (early[0, : t - window + 1] + 1) % V  # all before the window
    inside[0, t - window + 1] = (inside[0, t - window + 1] + 1) % V  # the oldest in the window
    with torch.no_grad():
        assert torch.allclose(sliding(tokens)[0, t], sliding(early)[0, t], atol=1e-6)
        assert not torch.allclose(sliding(tokens)[0, t], sliding(inside)[0, t], atol=1e-3)
        assert not torch.allclose(full(tokens)[0, t], full(early)[0, t], atol=1e-3)


@pytest.mark.parametrize("blocks", [None, (0,)])
def test_sliding_window_with_a_cache_equals_one_forward(blocks) -> None:
    """Decoding one token at a time past the window (the step's mask is built for the window)
    gives the logits of one forward over the whole sequence, with every layer or one sliding."""
    m = model(sliding_window=3, sliding_blocks=blocks)
    assert [b.window for b in m.decoder.blocks] == ([3, 3] if blocks is None else [3, None])
    tokens = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = m.decode(tokens).logits
        out = m.decode(tokens[:, :2])
        steps = [out.logits]
        for i in range(2, 9):
            out = m.decode(tokens[:, i : i + 1], cache=out.cache)
            steps.append(out.logits)
    assert torch.allclose(torch.cat(steps, dim=1), whole, atol=1e-5)


def test_local_rope_base_rotates_the_sliding_layers_alone() -> None:
    """Sliding layers rotate with their own base, unscaled; the others with the config's."""
    scaling = {"kind": "linear", "factor": 2.0}
    m = model(n_layers=3, sliding_window=4, sliding_blocks=[0, 2], local_rope_base=100.0, rope_scaling=scaling)
    ropes = [b.self_attn.rope for b in m.decoder.blocks]
    assert [(r.base, r.scaling) for r in ropes] == [(100.0, None), (10000.0, RopeScaling("linear", 2.0)), (100.0, None)]
    with pytest.raises(ValueError, match="need a sliding_window"):
        DecoderOnlyConfig(**{**BASE, "n_layers": 2, "local_rope_base": 100.0})


def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys() -> None:
    """Per-head RMS-normalised queries and keys: scaling Wq and Wk leaves the output as it was
    (without the norm it changes), and the gains are per head width K."""
    x = torch.randn(2, 7, 18)
    positions = torch.arange(7)
    for qk_norm in (True, False):
        torch.manual_seed(3)
        mha = MultiHeadAttention(18, 3, bias=False, rope=True, qk_norm=qk_norm, norm_eps=1e-12).eval()
        with torch.no_grad():
            before, _, _ = mha(x, positions=positions)
            mha.w_q.weight.mul_(7.0)
            mha.w_k.weight.mul_(0.2)
            after, _, _ = mha(x, positions=positions)
        assert torch.allclose(before, after, atol=1e-5) == qk_norm
    assert mha.q_norm is None and MultiHeadAttention(18, 3, qk_norm=True).q_norm.weight.shape == (6,)


def test_sandwich_norm_normalises_each_sub_layer_output() -> None:
    """x + Norm(Sublayer(Norm(x))): with every post-norm gain at zero the blocks add nothing, so
    the logits are the final norm of the embeddings; with gains they are not."""
    m = model(norm="rmsnorm", sandwich_norm=True)
    tokens = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        bare = m.output(m.decoder.norm(m.embed(tokens, torch.arange(6))))
        assert not torch.allclose(m(tokens), bare, atol=1e-3)
        for block in m.decoder.blocks:
            block.post_norm_1.weight.zero_()
            block.post_norm_3.weight.zero_()
        assert torch.allclose(m(tokens), bare, atol=1e-6)
    assert isinstance(m.decoder.blocks[0], DecoderBlock) and isinstance(
        m.decoder.blocks[0].post_norm_1, torch.nn.RMSNorm
    )
    with pytest.raises(ValueError, match="sandwich_norm needs pre-norm"):
        DecoderOnlyConfig(**{**BASE, "n_layers": 1, "sandwich_norm": True, "norm_first": False})


def test_geglu_is_the_tanh_gelu_gate() -> None:
    """GEGLU (Shazeer, 2020, eq. 5, with the tanh GELU): W2·(gelu_tanh(W1·x) ⊙ W3·x)."""
    torch.manual_seed(5)
    ffn = FeedForward(18, 11, activation="geglu_tanh")
    x = 3 * torch.randn(2, 5, 18)
    h = F.gelu(x @ ffn.w_1.weight.T + ffn.w_1.bias, approximate="tanh") * (x @ ffn.w_3.weight.T + ffn.w_3.bias)
    with torch.no_grad():
        assert torch.allclose(ffn(x), h @ ffn.w_2.weight.T + ffn.w_2.bias, atol=1e-5)
        silu = F.silu(x @ ffn.w_1.weight.T + ffn.w_1.bias) * (x @ ffn.w_3.weight.T + ffn.w_3.bias)
        assert not torch.allclose(ffn(x), silu @ ffn.w_2.weight.T + ffn.w_2.bias, atol=1e-3)


def test_head_dim_and_biases_on_wq_wk_wv_alone() -> None:
    """head_dim sets K apart from D/H (projections of H·K); qkv_bias puts biases on Wq, Wk, Wv
    and nowhere else (Qwen2)."""
    m = model(head_dim=8, n_kv_heads=1, bias=False, qkv_bias=True)
    attention = m.decoder.blocks[0].self_attn
    assert attention.w_q.weight.shape == (3 * 8, 18) and attention.w_k.weight.shape == (8, 18)
    assert attention.w_o.weight.shape == (18, 3 * 8)
    assert all(p.bias is not None for p in (attention.w_q, attention.w_k, attention.w_v))
    assert attention.w_o.bias is None and m.decoder.blocks[0].ffn.w_1.bias is None
    assert torch.isfinite(m(torch.randint(0, V, (2, 5)))).all()
    with pytest.raises(ValueError, match="even head width"):
        DecoderOnlyConfig(**{**BASE, "n_layers": 1, "head_dim": 7})


def test_attention_scale_replaces_one_over_root_k() -> None:
    """Scores Q·Kᵀ·s: the explicit path is softmax(Q·Kᵀ·s)·V by hand, the fused one equals it."""
    torch.manual_seed(6)
    q, k, v = torch.randn(2, 3, 5, 6), torch.randn(2, 3, 7, 6), torch.randn(2, 3, 7, 6)
    out, weights = attention_explicit(q, k, v, scale=0.3)
    by_hand = torch.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1)
    assert torch.allclose(weights, by_hand, atol=1e-6) and torch.allclose(out, by_hand @ v, atol=1e-5)
    assert torch.allclose(attention_fused(q, k, v, scale=0.3), out, atol=1e-5)
    assert not torch.allclose(attention_explicit(q, k, v)[0], out, atol=1e-3)


def test_linear_rope_scaling_is_positions_divided_by_the_factor() -> None:
    """Linear interpolation (Chen et al., 2023): angles at position p scaled by s are those at p/s;
    a larger base turns more slowly."""
    positions = torch.arange(11)
    scaled = rope_cos_sin(positions, width=6, dtype=torch.float32, device="cpu", scaling=RopeScaling("linear", 4.0))
    plain = rope_cos_sin(positions / 4.0, width=6, dtype=torch.float32, device="cpu")
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(scaled, plain, strict=True))
    slow, fast = (rope_cos_sin(positions, width=6, dtype=torch.float32, device="cpu", base=b)[1] for b in (1e6, 10.0))
    assert slow[..., 1].abs().sum() < fast[..., 1].abs().sum()


@pytest.mark.parametrize("scaling", [None, RopeScaling("linear", 3.0), RopeScaling("yarn", 4.0, 7)])
def test_rope_tables_are_the_angles_of_rope_frequencies_call_after_call(scaling) -> None:
    """cos and sin equal the textbook's pos·θᵢ from :func:`rope_frequencies` (each angle twice),
    on a first call and on later ones with other positions (the frequencies are computed once per
    settings), under inference mode, and a model trained after that still gets gradients."""
    for positions, mode in ((torch.arange(7), torch.inference_mode), (torch.tensor([[5, 2, 3]]), torch.no_grad)):
        with mode():
            cos, sin = rope_cos_sin(positions, width=10, dtype=torch.float64, device="cpu", base=13.0, scaling=scaling)
        inv_freq, factor = rope_frequencies(10, base=13.0, scaling=scaling)  # (5,)
        angles = positions.double()[..., None] * inv_freq.double()  # (B, T, 5) or (T, 5)
        expected = torch.cat([angles, angles], -1).reshape(-1, 1, positions.shape[-1], 10)  # (B, 1, T, K)
        assert torch.allclose(cos, expected.cos() * factor, atol=1e-6)
        assert torch.allclose(sin, expected.sin() * factor, atol=1e-6)
    attention = MultiHeadAttention(10, 1, rope=Rope(13.0, scaling))
    out, _, _ = attention(torch.randn(1, 7, 10), positions=torch.arange(7))
    out.sum().backward()
    assert all(p.grad is not None for p in attention.parameters())


def test_yarn_scales_cos_and_sin_by_its_attention_factor() -> None:
    """YaRN's eq. 21: cos and sin scaled by 0.1·ln(s) + 1 unless given; at position 0 that is cos."""
    cos, _ = rope_cos_sin(
        torch.arange(3), width=6, dtype=torch.float32, device="cpu", scaling=RopeScaling("yarn", 4.0, 8)
    )
    assert torch.allclose(cos[0, 0, 0], torch.full((6,), 0.1 * math.log(4.0) + 1), atol=1e-6)
    given = rope_cos_sin(
        torch.arange(3),
        width=6,
        dtype=torch.float32,
        device="cpu",
        scaling=RopeScaling("yarn", 4.0, 8, attention_factor=2.0),
    )
    assert torch.allclose(given[0][0, 0, 0], torch.full((6,), 2.0))


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "longrope", "factor": 2.0},
        {"kind": "yarn", "factor": 2.0},
        {"kind": "linear", "factor": 0.0},
        {"kind": "llama3", "factor": 8.0, "original_max_len": 8, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
    ],
)
def test_bad_rope_scaling_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match="rope"):
        DecoderOnlyConfig(**{**BASE, "n_layers": 1, "rope_scaling": bad})
