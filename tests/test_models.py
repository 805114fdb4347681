"""Tests of the three model families: shapes, causality, padding, variants, configs, tying, training.

Sizes are tiny and mostly prime: D=15 (H=3, K=5; D=18, K=6 where RoPE needs an even head
width), F=11, source vocabulary 17, target vocabulary 13, S=7, T=5.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F

from qkv.attention import MultiHeadAttention
from qkv.blocks import DecoderStack, EncoderStack
from qkv.layers import FeedForward
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.models.encoder_only import EncoderOnly, EncoderOnlyConfig

B, S, T = 3, 7, 5
SRC_V, TGT_V, V = 17, 13, 13
PAD = 0
POSITIONS = ("sinusoidal", "sinusoidal_halves", "learned", "rope", "alibi", "none")
FAMILIES = ("encoder_decoder", "encoder_only", "decoder_only")
ATOL = 1e-5


def _block(positions: str = "sinusoidal", **overrides) -> dict:
    d_model = 18 if positions == "rope" else 15
    fields = {"d_model": d_model, "n_heads": 3, "d_ff": 11, "dropout": 0.0, "max_len": 32, "positions": positions}
    fields.update(overrides)
    return fields


def ed_config(positions: str = "sinusoidal", **overrides) -> EncoderDecoderConfig:
    fields = {"src_vocab_size": SRC_V, "tgt_vocab_size": TGT_V, "n_encoder_layers": 2, "n_decoder_layers": 2}
    fields.update(overrides)
    return EncoderDecoderConfig(**_block(positions, **fields))


def eo_config(positions: str = "sinusoidal", **overrides) -> EncoderOnlyConfig:
    fields = {"vocab_size": V, "n_layers": 2, "n_classes": 3}
    fields.update(overrides)
    return EncoderOnlyConfig(**_block(positions, **fields))


def do_config(positions: str = "sinusoidal", **overrides) -> DecoderOnlyConfig:
    fields = {"vocab_size": V, "n_layers": 2}
    fields.update(overrides)
    return DecoderOnlyConfig(**_block(positions, **fields))


def build(family: str, positions: str = "sinusoidal", **overrides):
    if family == "encoder_decoder":
        return EncoderDecoder(ed_config(positions, **overrides)).eval()
    if family == "encoder_only":
        return EncoderOnly(eo_config(positions, **overrides)).eval()
    return DecoderOnly(do_config(positions, **overrides)).eval()


def _tokens(b: int, n: int, vocab: int) -> torch.Tensor:
    """Random tokens that avoid the special ids 0, 1, 2."""
    return torch.randint(3, vocab, (b, n))


def _run(model) -> torch.Tensor:
    """One forward pass of any family on a random batch (with some right padding where supported)."""
    if isinstance(model, EncoderDecoder):
        src = _tokens(B, S, SRC_V)
        src[1, 4:] = PAD
        return model(src, _tokens(B, T, TGT_V))
    if isinstance(model, EncoderOnly):
        x = _tokens(B, S, V)
        x[2, 3:] = PAD
        return torch.cat([model(x).flatten(), model.classify(x).flatten()])
    return model(_tokens(B, T, V))


# ------------------------------------------------------------------------ shapes


def test_encoder_decoder_shapes() -> None:
    """Encoder output has the source length; logits are (B, T, V_tgt); decode with weights gives (B, H, T, S)."""
    torch.manual_seed(0)
    model = build("encoder_decoder")
    src, tgt = _tokens(B, S, SRC_V), _tokens(B, T, TGT_V)
    memory = model.encode(src)
    assert memory.shape == (B, S, 15)
    assert model(src, tgt).shape == (B, T, TGT_V)
    out = model.decode(tgt, memory, src_mask=src != PAD, need_weights=True)
    assert out.logits.shape == (B, T, TGT_V)
    assert len(out.attention) == 2 and all(w.shape == (B, 3, T, S) for w in out.attention)
    assert len(out.cache) == 2


def test_encoder_only_shapes() -> None:
    """Encoder-only: encode (B, S, D), masked-LM logits (B, S, V), classify (B, n_classes)."""
    torch.manual_seed(0)
    model = build("encoder_only")
    x = _tokens(B, S, V)
    assert model.encode(x).shape == (B, S, 15)
    assert model(x).shape == (B, S, V)
    assert model.classify(x).shape == (B, 3)
    with pytest.raises(ValueError):
        build("encoder_only", n_classes=0).classify(x)


def test_decoder_only_shapes() -> None:
    """Decoder-only: logits (B, T, V); the cache holds T positions of G kv heads."""
    torch.manual_seed(0)
    model = build("decoder_only", n_kv_heads=1)
    x = _tokens(B, T, V)
    assert model(x).shape == (B, T, V)
    out = model.decode(x, need_weights=True)
    assert out.cache[0][0][0].shape == (B, 1, T, 5)
    assert out.attention[0].shape == (B, 3, T, T)


def test_cross_attention_weights_ignore_source_padding() -> None:
    """Cross-attention weights: rows sum to 1 and padded source keys get weight exactly 0."""
    torch.manual_seed(1)
    model = build("encoder_decoder")
    src = _tokens(B, S, SRC_V)
    src[0, 3:] = PAD
    src_mask = src != PAD
    out = model.decode(_tokens(B, T, TGT_V), model.encode(src), src_mask=src_mask, need_weights=True)
    for w in out.attention:
        assert torch.all(w[0, :, :, 3:] == 0.0)
        assert torch.allclose(w.sum(-1), torch.ones(B, 3, T), atol=ATOL)


# --------------------------------------------------------------------- causality


@pytest.mark.parametrize("positions", POSITIONS)
def test_decoder_only_is_causal(positions: str) -> None:
    """Decoder-only: changing tokens at positions >= t leaves the logits at positions < t unchanged."""
    torch.manual_seed(2)
    model = build("decoder_only", positions)
    x = _tokens(B, T, V)
    logits = model(x)
    for t in range(1, T):
        edited = x.clone()
        edited[:, t:] = _tokens(B, T - t, V)
        edited[:, t] = (x[:, t] - 3 + 1) % (V - 3) + 3  # surely different at position t
        out = model(edited)
        assert (out[:, :t] - logits[:, :t]).abs().max() <= ATOL
        assert (out[:, t:] - logits[:, t:]).abs().max() > 1e-4  # the future itself did change


@pytest.mark.parametrize("positions", POSITIONS)
def test_encoder_decoder_decoder_is_causal(positions: str) -> None:
    """Encoder-decoder: changing target tokens at positions >= t leaves the logits at positions < t unchanged."""
    torch.manual_seed(3)
    model = build("encoder_decoder", positions)
    src, tgt = _tokens(B, S, SRC_V), _tokens(B, T, TGT_V)
    logits = model(src, tgt)
    for t in range(1, T):
        edited = tgt.clone()
        edited[:, t:] = _tokens(B, T - t, TGT_V)
        edited[:, t] = (tgt[:, t] - 3 + 1) % (TGT_V - 3) + 3  # surely different at position t
        out = model(src, edited)
        assert (out[:, :t] - logits[:, :t]).abs().max() <= ATOL
        assert (out[:, t:] - logits[:, t:]).abs().max() > 1e-4


def test_encoder_is_bidirectional() -> None:
    """The encoder is not causal: changing the last source token changes the first position's output."""
    torch.manual_seed(4)
    model = build("encoder_only")
    x = _tokens(1, S, V)
    edited = x.clone()
    edited[0, -1] = 3 if x[0, -1] != 3 else 4
    assert (model.encode(x)[0, 0] - model.encode(edited)[0, 0]).abs().max() > 1e-4


# ----------------------------------------------------------------------- padding


@pytest.mark.parametrize("positions", POSITIONS)
def test_encoder_decoder_source_padding_invariance(positions: str) -> None:
    """A right-padded source gives the same decoder logits as the same source unpadded."""
    torch.manual_seed(5)
    model = build("encoder_decoder", positions)
    lengths = [S, 4, 2]
    src = _tokens(B, S, SRC_V)
    for i, n in enumerate(lengths):
        src[i, n:] = PAD
    tgt = _tokens(B, T, TGT_V)
    batched = model(src, tgt)
    for i, n in enumerate(lengths):
        alone = model(src[i : i + 1, :n], tgt[i : i + 1])
        assert (batched[i : i + 1] - alone).abs().max() <= ATOL
    # what the masked positions hold does not matter; unmasked, the same tokens do
    garbage = src.clone()
    garbage[1, 4:] = 5
    src_mask = src != PAD
    memory = model.encode(garbage, src_mask=src_mask)
    assert (model.decode(tgt, memory, src_mask=src_mask).logits - batched).abs().max() <= ATOL
    assert (model(garbage, tgt)[1] - batched[1]).abs().max() > 1e-4


@pytest.mark.parametrize("positions", POSITIONS)
def test_encoder_only_padding_invariance(positions: str) -> None:
    """Encoder-only: padded vs unpadded encode() agree on the real positions; mean-pooled classify too."""
    torch.manual_seed(6)
    model = build("encoder_only", positions, pooling="mean")
    lengths = [S, 5, 3]
    x = _tokens(B, S, V)
    for i, n in enumerate(lengths):
        x[i, n:] = PAD
    hidden, classes, mlm = model.encode(x), model.classify(x), model(x)
    for i, n in enumerate(lengths):
        alone = x[i : i + 1, :n]
        assert (hidden[i, :n] - model.encode(alone)[0]).abs().max() <= ATOL
        assert (mlm[i, :n] - model(alone)[0]).abs().max() <= ATOL
        assert (classes[i] - model.classify(alone)[0]).abs().max() <= ATOL


def test_encoder_only_first_pooling_is_first_token() -> None:
    """pooling='first' classifies from the first token's state and is unchanged by right padding."""
    torch.manual_seed(7)
    model = build("encoder_only", pooling="first")
    x = _tokens(2, S, V)
    x[1, 4:] = PAD
    expected = model.classifier(model.encode(x)[:, 0])
    assert torch.allclose(model.classify(x), expected, atol=ATOL)
    assert torch.allclose(model.classify(x)[1], model.classify(x[1:, :4])[0], atol=ATOL)


@pytest.mark.parametrize("positions", POSITIONS)
def test_decoder_only_left_padding_invariance(positions: str) -> None:
    """Decoder-only: a left-padded prompt (key_mask + per-row positions) gives the unpadded logits."""
    torch.manual_seed(8)
    model = build("decoder_only", positions)
    lengths = [T, 3, 1]
    x = _tokens(B, T, V)
    valid = torch.arange(T)[None, :] >= (T - torch.tensor(lengths))[:, None]  # left padding
    x = x.masked_fill(~valid, PAD)
    positions_ = (valid.long().cumsum(1) - 1).clamp(min=0)
    out = model.decode(x, key_mask=valid, positions=positions_).logits
    assert torch.isfinite(out).all()
    for i, n in enumerate(lengths):
        alone = model(x[i : i + 1, T - n :])
        assert (out[i, T - n :] - alone[0]).abs().max() <= ATOL


# ---------------------------------------------------------------------- variants


RELATIVE = ("rope", "alibi", "none")  # schemes that see only how far apart two tokens are


def _stacks(model) -> list:
    return [m for m in model.modules() if isinstance(m, (EncoderStack, DecoderStack))]


def _first_block_output(model) -> torch.Tensor:
    """What the first block of the model's first stack returns in :func:`_run`. Shapes: (B, S, D)."""
    outputs = []
    hook = _stacks(model)[0].blocks[0].register_forward_hook(lambda m, i, o: outputs.append(o))
    with torch.no_grad():
        _run(model)
    hook.remove()
    return outputs[0][0] if isinstance(outputs[0], tuple) else outputs[0]


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("positions", POSITIONS)
def test_positions_and_norm_placement_run(positions: str, norm_first: bool) -> None:
    """Every positions scheme, pre- and post-norm, builds and runs for each family without NaN;
    grads flow. Each does what it says: a decoder-only model with a relative scheme (or none)
    gives the same logits when every position is shifted, an absolute one does not; an encoder
    without positions is permutation-equivariant, with any scheme it is not. Post-norm leaves
    every block's output normalised (LayerNorm(x + Sublayer(x))) and the stacks without a final
    norm; pre-norm's blocks return the raw residual stream and the stacks end with a norm."""
    torch.manual_seed(9)
    for family in FAMILIES:
        model = build(family, positions, norm_first=norm_first).train()
        out = _run(model)
        assert torch.isfinite(out).all()
        out.square().mean().backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        h = _first_block_output(model.eval())  # (B, S, D)
        normalised = (h.mean(-1).abs().max() < 1e-4) & ((h.var(-1, unbiased=False) - 1).abs().max() < 1e-3)
        assert bool(normalised) == (not norm_first), family
        final = [isinstance(stack.norm, torch.nn.LayerNorm) for stack in _stacks(model)]
        assert final == [norm_first] * len(final), family
    model = build("decoder_only", positions, norm_first=norm_first)
    x = _tokens(B, T, V)
    with torch.no_grad():
        shifted = (model.decode(x, positions=torch.arange(T) + 7).logits - model(x)).abs().max()
    assert (shifted <= ATOL) == (positions in RELATIVE), float(shifted)
    model = build("encoder_only", positions, norm_first=norm_first)
    x, order = _tokens(B, S, V), torch.randperm(S, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        moved = (model.encode(x[:, order]) - model.encode(x)[:, order]).abs().max()
    assert (moved <= ATOL) == (positions == "none"), float(moved)


def test_each_positions_scheme_computes_something_of_its_own() -> None:
    """The same weights under each positions scheme give six different outputs: no scheme falls back
    on another (the sinusoidal layouts, learned positions, RoPE and ALiBi each change the logits)."""
    torch.manual_seed(13)
    for family in FAMILIES:
        reference = build(family, "learned", d_model=18).state_dict()  # learned: the most weights
        outs = {}
        for positions in POSITIONS:
            model = build(family, positions, d_model=18)
            missing, unexpected = model.load_state_dict(reference, strict=False)
            assert not missing and all(".position." in key for key in unexpected), (missing, unexpected)
            torch.manual_seed(0)
            outs[positions] = _run(model)
        for a, b in itertools.combinations(POSITIONS, 2):
            assert (outs[a] - outs[b]).abs().max() > 1e-3, (family, a, b)


ACTIVATION_OF = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
}


def _ffn_by_hand(ffn: FeedForward, x: torch.Tensor, activation: str) -> torch.Tensor:
    """FFN(x) = W2·act(W1·x) (Vaswani et al., eq. 2), or W2·(silu(W1·x) ⊙ W3·x) for SwiGLU
    (Shazeer, 2020, eq. 6), from the module's weights."""
    h = x @ ffn.w_1.weight.T + ffn.w_1.bias  # (B, T, F)
    if activation == "swiglu":
        h = F.silu(h) * (x @ ffn.w_3.weight.T + ffn.w_3.bias)  # (B, T, F)
    else:
        h = ACTIVATION_OF[activation](h)
    return h @ ffn.w_2.weight.T + ffn.w_2.bias  # (B, T, D)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu", "swiglu"])
def test_activations_and_norms_run(activation: str, norm: str) -> None:
    """Every activation x norm builds and runs for each family without NaN (also with GQA and
    sigmoid attention), and is the one asked for: every feed-forward network computes its
    activation's formula (by hand here, and none of the others'), every norm is of the kind
    asked for, every attention has the heads and normalisation asked for."""
    torch.manual_seed(10)
    x = 3 * torch.randn(B, T, 15)  # (B, T, D): wide enough that GELU and its tanh form differ
    norm_type, other_type = (
        (torch.nn.LayerNorm, torch.nn.RMSNorm) if norm == "layernorm" else (torch.nn.RMSNorm, torch.nn.LayerNorm)
    )
    for family in FAMILIES:
        for extra in ({}, {"n_kv_heads": 1, "attention": "sigmoid"}):
            model = build(family, activation=activation, norm=norm, **extra)
            assert torch.isfinite(_run(model)).all()
            ffns = [m for m in model.modules() if isinstance(m, FeedForward)]
            assert ffns and all((m.w_3 is not None) == (activation == "swiglu") for m in ffns)
            with torch.no_grad():
                for ffn in ffns:
                    out = ffn(x)
                    assert (out - _ffn_by_hand(ffn, x, activation)).abs().max() <= ATOL
                    for other in set(ACTIVATION_OF) - {activation} if activation != "swiglu" else ():
                        assert (out - _ffn_by_hand(ffn, x, other)).abs().max() > 10 * ATOL, (activation, other)
            norms = [m for m in model.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))]
            assert norms and all(isinstance(m, norm_type) and not isinstance(m, other_type) for m in norms)
            attentions = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
            assert attentions and all(
                (m.n_kv_heads, m.normalization) == (extra.get("n_kv_heads", 3), extra.get("attention", "softmax"))
                for m in attentions
            )


def test_swiglu_has_gate_and_rmsnorm_is_used() -> None:
    """activation='swiglu' adds the third (gate) matrix; norm='rmsnorm' builds RMSNorm modules."""
    model = build("decoder_only", activation="swiglu", norm="rmsnorm")
    block = model.decoder.blocks[0]
    assert block.ffn.w_3 is not None and block.ffn.w_3.weight.shape == (11, 15)
    assert isinstance(block.norm_1, torch.nn.RMSNorm)
    assert build("decoder_only").decoder.blocks[0].ffn.w_3 is None


def test_encoder_only_bert_options() -> None:
    """embedding_norm adds a norm after the embeddings; pooler is dense + tanh before the classifier;
    mlm_head=False builds no MLM head and refuses forward, while encode and classify still work."""
    torch.manual_seed(12)
    model = build("encoder_only", embedding_norm=True, pooler=True, mlm_head=False)
    assert model.embed_norm is not None and model.pooler is not None and model.mlm_output is None
    x = _tokens(B, S, V)
    with pytest.raises(ValueError, match="mlm_head"):
        model(x)
    h = model.encode(x)
    expected = model.classifier(torch.tanh(model.pooler(h[:, 0])))
    assert (model.classify(x) - expected).abs().max() <= ATOL
    assert not any(name.startswith("mlm_") for name in model.state_dict())


def test_encoder_decoder_output_bias_starts_at_zero() -> None:
    """output_bias gives the (tied) output projection a bias of its own, initialised to zero."""
    model = build("encoder_decoder", output_bias=True)
    assert model.output.weight is model.tgt_embed.token.weight
    assert model.output.bias is not None and torch.equal(model.output.bias, torch.zeros(TGT_V))
    assert build("encoder_decoder").output.bias is None


def test_dropout_active_in_train_only() -> None:
    """With dropout > 0, train() outputs are random and eval() outputs are deterministic."""
    torch.manual_seed(11)
    model = build("decoder_only", dropout=0.3, attention_dropout=0.2)
    x = _tokens(B, T, V)
    assert torch.equal(model(x), model(x))
    model.train()
    assert not torch.allclose(model(x), model(x))


@pytest.mark.parametrize("attention", ["softmax", "sigmoid"])
@pytest.mark.parametrize("positions", ["alibi", "rope"])
def test_models_run_in_bfloat16(positions: str, attention: str) -> None:
    """A model cast with .to(torch.bfloat16) runs (forward and decode with weights) and returns bf16 logits."""
    torch.manual_seed(17)
    model = build("decoder_only", positions, attention=attention).to(torch.bfloat16)
    x = _tokens(B, T, V)
    logits = model(x)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    weights = model.decode(x, need_weights=True).attention
    assert torch.isfinite(weights[0]).all()


def test_learned_positions_beyond_max_len_raise() -> None:
    """Learned positions cannot go beyond max_len."""
    model = build("decoder_only", "learned", max_len=6)
    model(_tokens(1, 6, V))
    with pytest.raises(ValueError):
        model(_tokens(1, 7, V))


# -------------------------------------------------------------------- validation


BAD_BLOCK_FIELDS = [
    {"positions": "foo"},
    {"activation": "tanh"},
    {"norm": "batchnorm"},
    {"attention": "linear"},
    {"d_model": 16},  # not divisible by n_heads=3
    {"positions": "rope", "d_model": 15},  # head width 5 is odd
    {"n_kv_heads": 2},  # 3 heads do not divide into 2 groups
    {"dropout": 1.0},
    {"attention_dropout": -0.1},
    {"d_ff": 0},
    {"max_len": -1},
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bad", BAD_BLOCK_FIELDS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_bad_block_config_raises(family: str, bad: dict) -> None:
    """Bad shared block settings raise ValueError in every family's config."""
    bad = dict(bad)
    positions = bad.pop("positions", "sinusoidal")
    make = {"encoder_decoder": ed_config, "encoder_only": eo_config, "decoder_only": do_config}[family]
    with pytest.raises(ValueError):
        make(positions, **bad)


@pytest.mark.parametrize(
    "make, bad",
    [
        (ed_config, {"share_embeddings": True}),  # src 17 != tgt 13
        (ed_config, {"pad_id": TGT_V}),
        (ed_config, {"eos_id": -1}),
        (eo_config, {"pooling": "max"}),
        (eo_config, {"pad_id": V}),
        (do_config, {"eos_id": V}),
    ],
)
def test_bad_family_config_raises(make, bad: dict) -> None:
    """Family-specific checks: shared embeddings need one vocabulary; special ids inside it; known pooling."""
    with pytest.raises(ValueError):
        make(**bad)


def test_configs_are_frozen() -> None:
    """Configs are immutable dataclasses."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        do_config().d_model = 30  # type: ignore[misc]


# ---------------------------------------------------------------------- tying


def test_encoder_decoder_only_selects_positions() -> None:
    """``only`` gives the logits of the selected positions, as computed for all of them."""
    model = build("encoder_decoder")
    src, tgt = _tokens(B, S, SRC_V), _tokens(B, T, TGT_V)
    only = torch.rand(B, T) < 0.6  # (B, T)
    full = model(src, tgt)  # (B, T, V)
    picked = model(src, tgt, only=only)  # (N, V)
    assert picked.shape == (int(only.sum()), TGT_V)
    torch.testing.assert_close(picked, full[only], atol=ATOL, rtol=0)


def test_encoder_decoder_tied_and_shared_embeddings() -> None:
    """tie_output makes the output the target embedding; share_embeddings makes one embedding module."""
    model = EncoderDecoder(ed_config(src_vocab_size=TGT_V, share_embeddings=True, tie_output=True))
    assert model.src_embed is model.tgt_embed
    assert model.output.weight is model.tgt_embed.token.weight
    assert model.output.weight.data_ptr() == model.src_embed.token.weight.data_ptr()
    untied = EncoderDecoder(ed_config(tie_output=False))
    assert untied.src_embed is not untied.tgt_embed
    assert untied.output.weight.data_ptr() != untied.tgt_embed.token.weight.data_ptr()
    tied = EncoderDecoder(ed_config())
    assert tied.output.weight.data_ptr() == tied.tgt_embed.token.weight.data_ptr()
    assert tied.src_embed.token.weight.data_ptr() != tied.tgt_embed.token.weight.data_ptr()


def test_decoder_and_encoder_only_tied_output() -> None:
    """Decoder-only LM head and encoder-only MLM projection share the token embedding when tied."""
    do = DecoderOnly(do_config(tie_output=True))
    assert do.output.weight.data_ptr() == do.embed.token.weight.data_ptr()
    untied = DecoderOnly(do_config(tie_output=False))
    assert untied.output.weight.data_ptr() != untied.embed.token.weight.data_ptr()
    eo = EncoderOnly(eo_config(tie_output=True))
    assert eo.mlm_output.weight.data_ptr() == eo.embed.token.weight.data_ptr()


def test_tied_weights_stay_tied_through_training() -> None:
    """An optimizer step on a tied model updates one tensor: output and embedding remain identical."""
    torch.manual_seed(12)
    model = DecoderOnly(do_config()).train()
    n_unique = len({p.data_ptr() for p in model.parameters()})
    assert n_unique == len(list(model.parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = _tokens(B, T, V)
    F.cross_entropy(model(x).reshape(-1, V), x.reshape(-1)).backward()
    opt.step()
    assert torch.equal(model.output.weight, model.embed.token.weight)


# --------------------------------------------------------------------- training


def _overfit(model, loss_fn, steps: int) -> tuple[float, float]:
    """Train on a fixed batch with AdamW; return the first and the last loss."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(steps):
        loss = loss_fn()
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return first, loss_fn().item()


def test_encoder_decoder_overfits() -> None:
    """Encoder-decoder memorizes a fixed batch (teacher forcing): loss falls to <= 10% of the start."""
    torch.manual_seed(13)
    model = build("encoder_decoder")
    src, tgt = _tokens(B, S, SRC_V), _tokens(B, T + 2, TGT_V)
    src[1, 5:] = PAD

    def loss_fn():
        return F.cross_entropy(model(src, tgt[:, :-1]).reshape(-1, TGT_V), tgt[:, 1:].reshape(-1))

    first, last = _overfit(model, loss_fn, 120)
    assert last <= 0.1 * first


def test_decoder_only_overfits() -> None:
    """Decoder-only memorizes next tokens of a fixed batch: loss falls to <= 10% of the start."""
    torch.manual_seed(14)
    model = build("decoder_only")
    x = _tokens(B, T + 2, V)

    def loss_fn():
        return F.cross_entropy(model(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1))

    first, last = _overfit(model, loss_fn, 120)
    assert last <= 0.1 * first


def test_encoder_only_overfits_mlm_and_classification() -> None:
    """Encoder-only memorizes masked-LM targets and sequence labels: both losses fall to <= 10%."""
    torch.manual_seed(15)
    model = build("encoder_only")
    x = _tokens(B, S, V)
    x[2, 4:] = PAD
    labels = torch.tensor([0, 2, 1])

    def mlm_loss():
        return F.cross_entropy(model(x).reshape(-1, V), x.reshape(-1))

    def cls_loss():
        return F.cross_entropy(model.classify(x), labels)

    first, last = _overfit(model, mlm_loss, 100)
    assert last <= 0.1 * first
    first, last = _overfit(model, cls_loss, 60)
    assert last <= 0.1 * first


def test_sigmoid_attention_trains() -> None:
    """Decoder-only with sigmoid attention memorizes a fixed batch as well: loss falls to <= 10%."""
    torch.manual_seed(16)
    model = build("decoder_only", attention="sigmoid")
    x = _tokens(B, T + 2, V)

    def loss_fn():
        return F.cross_entropy(model(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1))

    first, last = _overfit(model, loss_fn, 120)
    assert last <= 0.1 * first


# ------------------------------------------------------------ dropout (layers.dropout)


@pytest.mark.parametrize("p", [0.1, 0.2, 0.3, 0.5])
def test_dropout_keeps_one_minus_p_and_is_unbiased(p):
    from qkv.layers import dropout

    torch.manual_seed(0)
    x = torch.ones(211, 307)  # odd size: the last 64-bit draw is partly used
    y = dropout(x, p)
    kept = (y != 0).double().mean().item()
    # 64,777 elements: the binomial standard deviation of the kept fraction is below 0.002
    assert abs(kept - (1 - p)) < 0.01
    assert abs(y.double().mean().item() - 1.0) < 0.02  # inverted scaling: E[y] = x
    assert torch.allclose(y[y != 0], torch.full_like(y[y != 0], 1 / (1 - p)), rtol=1e-4)


def test_dropout_gradient_is_the_same_mask_and_eval_is_identity():
    from qkv.layers import Dropout

    torch.manual_seed(1)
    layer = Dropout(0.3)
    x = torch.randn(5, 7, 11, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    # d(sum y)/dx is scale where kept and 0 where dropped: the forward's own mask
    assert torch.equal(x.grad != 0, y != 0)
    assert torch.allclose(y[y != 0], (x * x.grad)[y != 0], atol=1e-6)
    layer.eval()
    assert layer(x) is x


def test_dropout_is_seeded_by_torch_and_bf16_keeps_dtype():
    from qkv.layers import dropout

    x = torch.randn(13, 17)
    torch.manual_seed(7)
    a = dropout(x, 0.2)
    torch.manual_seed(7)
    b = dropout(x, 0.2)
    assert torch.equal(a, b)
    assert not torch.equal(a, dropout(x, 0.2))  # the generator moved on
    assert dropout(x.bfloat16(), 0.2).dtype == torch.bfloat16
    assert torch.equal(dropout(x, 0.0), x) and torch.equal(dropout(x, 1.0), torch.zeros_like(x))


def test_dropout_rejects_p_outside_0_1_and_p_near_1_drops_everything():
    from qkv.layers import Dropout, dropout

    x = torch.randn(4, 5)
    for p in (-0.1, 1.5):
        with pytest.raises(ValueError, match="dropout"):
            dropout(x, p)
        with pytest.raises(ValueError, match="dropout"):
            Dropout(p)
    assert torch.equal(dropout(x, 0.999995), torch.zeros_like(x))  # p' rounds to 1
