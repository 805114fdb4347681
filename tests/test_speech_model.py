"""Tests of the speech encoder-decoder (qkv.models.speech), its decoding (greedy, beam search,
CTC best path, CTC prefix scores and joint CTC/attention beam search in qkv.decoding) and
its losses (qkv.losses.ctc_loss, speech_loss).

Sizes are tiny and mostly prime: D=15 (H=3, K=5; D=16 where Whisper's positions need an even
width), F=11, M=11 mel bins, V=7 tokens (0 pad and CTC blank, 1 BEGIN, 2 END, 3..6 words).
CTC prefix scores are checked against a sum over every alignment (V^T paths, T ≤ 5).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lockstep import greedy_in_step
from qkv.audio import FeatureConfig, pad_features
from qkv.checkpoint import load_model, save_model
from qkv.ctc import CTCPrefixScorer, ctc_best_path, ctc_collapse
from qkv.decoding import (
    LanguageModelScore,
    beam_search,
    ctc_greedy,
    decoder_for,
    greedy,
    joint_scorers,
)
from qkv.decoding_copies import for_decoding, int8_linears
from qkv.ensemble import Ensemble
from qkv.losses import ctc_loss, seq2seq_batch, speech_loss
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.models.speech import SpeechConfig, SpeechEncoderDecoder, whisper_sinusoids

V, M = 7, 11
PAD, BOS, EOS = 0, 1, 2
ATOL = 1e-5


def joint_beam_search(
    model, inputs, *, beam_size, max_new_tokens, nbest=1, ctc_weight=None, lm=None, lm_weight=0.0
) -> list:
    """beam_search with the scorers of joint CTC/attention decoding and shallow fusion."""
    decoder_weight, scorers = joint_scorers(ctc_weight=ctc_weight, lm=lm, lm_weight=lm_weight)
    return beam_search(
        model,
        inputs,
        beam_size=beam_size,
        max_new_tokens=max_new_tokens,
        nbest=nbest,
        decoder_weight=decoder_weight,
        scorers=scorers,
    )


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_config(frontend: str = "conv2d", **overrides) -> SpeechConfig:
    fields = {
        "vocab_size": V,
        "d_model": 15,
        "n_heads": 3,
        "d_ff": 11,
        "n_encoder_layers": 2,
        "n_decoder_layers": 2,
        "dropout": 0.0,
        "max_len": 13,
        "features": FeatureConfig(n_mels=M),
        "frontend": frontend,
    }
    if frontend == "whisper":
        fields.update(
            d_model=16,
            n_heads=4,
            features=FeatureConfig.whisper(n_mels=M),
            encoder_positions="whisper",
            positions="learned",
            activation="gelu",
            scale_embeddings=False,
            key_bias=False,
            ctc=False,
        )
    fields.update(overrides)
    return SpeechConfig(**fields)


def make_model(frontend: str = "conv2d", *, seed: int = 0, **overrides) -> SpeechEncoderDecoder:
    torch.manual_seed(seed)
    return SpeechEncoderDecoder(make_config(frontend, **overrides)).eval()


def _features(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, M, generator=g) for n in lengths]


# ------------------------------------------------------------------------- the model


def test_config_round_trips_through_a_dict_and_refuses_bad_values() -> None:
    """asdict (what config.json holds, the features nested) gives the same config back; a
    Whisper-shaped config is expressible; bad values are refused by name."""
    for frontend in ("conv2d", "whisper"):
        config = make_config(frontend)
        fields = json.loads(json.dumps(dataclasses.asdict(config)))
        assert isinstance(fields["features"], dict)
        assert SpeechConfig(**fields) == config
    assert make_config().blank == PAD and make_config(blank_id=6).blank == 6
    bad = [
        ({"frontend": "conv3d"}, "frontend"),
        ({"positions": "rope"}, "positions"),
        ({"encoder_positions": "learned"}, "encoder_positions"),
        ({"blank_id": EOS}, "blank"),
        ({"blank_id": V}, "blank_id"),
        ({"features": {"n_mels": M, "hop": 3}}, "hop"),
        ({"features": FeatureConfig(n_mels=5)}, "mel bins"),
        ({"encoder_positions": "whisper"}, "even d_model"),
        ({"key_bias": 1}, "key_bias"),
        ({"conv_channels": 0}, "conv_channels"),
    ]
    for overrides, name in bad:
        with pytest.raises(ValueError, match=name):
            make_config(**overrides)


def test_subsampling_lengths() -> None:
    """conv2d: S = ((T - 1) // 2 - 1) // 2 (ESPnet's ×4); whisper: S = ceil(T / 2). The valid
    mask of a padded batch has each utterance's own count, and an utterance too short for one
    output frame is refused."""
    conv, whisper = make_model("conv2d"), make_model("whisper")
    for t in range(7, 40):
        assert int(conv.subsampled(torch.tensor(t))) == ((t - 1) // 2 - 1) // 2
        assert conv.encode(torch.randn(1, t, M))[0].shape == (1, ((t - 1) // 2 - 1) // 2, 15)
    for t in range(1, 40):
        assert int(whisper.subsampled(torch.tensor(t))) == math.ceil(t / 2)
        assert whisper.encode(torch.randn(1, t, M))[0].shape == (1, math.ceil(t / 2), 16)
    lengths = [37, 11, 23]
    for model in (conv, whisper):
        feats, valid = pad_features(_features(lengths))
        _, memory_valid = model.encode(feats, valid)
        assert memory_valid.sum(1).tolist() == model.subsampled(torch.tensor(lengths)).tolist()
    feats, valid = pad_features(_features([20, 5]))
    with pytest.raises(ValueError, match="5 frames"):
        conv.encode(feats, valid)
    with pytest.raises(ValueError, match="at least 7 frames"):
        conv.encode(torch.randn(1, 6, M))
    with pytest.raises(ValueError, match=r"\(B, T, 11\)"):
        conv.encode(torch.randn(1, 20, M + 1))


def test_whisper_front_end_gives_frames_in_one_block() -> None:
    """The whisper front-end's output is (B, S, D) contiguous, not the transposed view of its
    convolutions' (B, D, S): every later elementwise result keeps its input's layout, and each
    norm and product of the encoder would copy it again."""
    model = make_model("whisper")
    feats, valid = pad_features(_features([29, 8]))
    with torch.no_grad():
        frames, _ = model.frontend(feats, valid)
    assert frames.shape == (2, 15, 16) and frames.is_contiguous()


@pytest.mark.parametrize("frames", [167, 168])
def test_whisper_front_end_folds_a_repeated_tail_to_the_same_frames(frames: int) -> None:
    """Whisper pads a short file's audio to 30 s, so its last frames are one column repeated: the
    front-end convolves them once (WhisperConv._folded) and gives the frames of the plain
    convolutions over every frame, each row's run starting elsewhere, T odd and even."""
    from qkv.models.speech import FOLD_MIN, _foldable_tail

    model = make_model("whisper")
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(3, frames, M, generator=g)
    for b, start in enumerate((23, 40, 31)):
        feats[b, start:] = torch.randn(M, generator=g)  # (T - start, M): one column repeated
    x = feats.transpose(1, 2)  # (B, M, T)
    kept, cut = _foldable_tail(x)
    assert kept % 2 == 0 and cut % 2 == 0 and cut >= FOLD_MIN and kept >= 40
    with torch.no_grad():
        folded, valid = model.frontend(feats, torch.ones(3, frames, dtype=torch.bool))
        c = model.frontend
        plain = F.gelu(c.conv_2(F.gelu(c.conv_1(x)))).transpose(1, 2)  # (B, S, D)
    assert folded.shape == plain.shape == (3, (frames + 1) // 2, 16) and bool(valid.all())
    assert (folded - plain).abs().max() <= ATOL
    assert _foldable_tail(torch.randn(3, M, frames, generator=g)) is None  # no run: the plain path


@pytest.mark.parametrize("frontend", ["conv2d", "conv2d_narrow", "whisper"])
def test_padded_batch_gives_each_utterance_its_own_output(frontend: str) -> None:
    """Encoder output over the valid frames, CTC logits and decoder logits of a padded batch
    equal those of each utterance alone (padding features are garbage, not zeros, to prove it).
    conv2d_narrow: the conv2d front-end with fewer channels than D."""
    narrow = {"conv_channels": 7} if frontend == "conv2d_narrow" else {}
    model = make_model(frontend.removesuffix("_narrow"), ctc=True, **narrow)
    utterances = _features([29, 8, 17], seed=1)
    feats, valid = pad_features(utterances)
    feats = feats.masked_fill(~valid[..., None], 7.0)  # padding that must not matter
    tgt = torch.tensor([[BOS, 3, 4, 5], [BOS, 6, 6, 3], [BOS, 5, 3, 4]])
    with torch.no_grad():
        memory, memory_valid = model.encode(feats, valid)
        logits = model.decode(tgt, memory, src_mask=memory_valid).logits
        ctc = model.ctc_logits(memory)
        for b, f in enumerate(utterances):
            alone, alone_valid = model.encode(f[None])
            s = alone.shape[1]
            assert bool(alone_valid.all()) and int(memory_valid[b].sum()) == s
            assert (memory[b, :s] - alone[0]).abs().max() <= ATOL
            assert (ctc[b, :s] - model.ctc_logits(alone)[0]).abs().max() <= ATOL
            alone_logits = model.decode(tgt[b : b + 1], alone, src_mask=None).logits[0]
            assert (logits[b] - alone_logits).abs().max() <= ATOL
            assert (model(f[None], None, tgt[b : b + 1])[0] - alone_logits).abs().max() <= ATOL


def test_whisper_sinusoids_match_transformers() -> None:
    """Whisper's encoder positions: sines then cosines at timescales 10000^(i/(D/2 - 1)),
    as transformers' WhisperEncoder fills embed_positions; not qkv's sinusoidal_halves."""
    whisper = pytest.importorskip("transformers.models.whisper.modeling_whisper")
    from qkv.layers import sinusoidal_encoding

    for length, d in ((1500, 384), (7, 16)):
        ours = whisper_sinusoids(torch.arange(length), d)
        assert (ours - whisper.sinusoids(length, d)).abs().max() <= 1e-4
    halves = sinusoidal_encoding(torch.arange(7), 16, halves=True)
    assert (halves - whisper_sinusoids(torch.arange(7), 16)).abs().max() > 0.01


def test_whisper_layout_has_no_key_biases_and_the_names_an_importer_maps() -> None:
    """frontend="whisper" is two Conv1d (k3, p1, strides 1 and 2); key projections of every
    attention have no bias, the others do; no CTC head; the output is tied."""
    model = make_model("whisper")
    names = dict(model.named_parameters())
    assert names["frontend.conv_1.weight"].shape == (16, M, 3)
    assert names["frontend.conv_2.weight"].shape == (16, 16, 3) and model.frontend.conv_2.stride == (2,)
    assert not any(n.endswith("w_k.bias") for n in names)
    assert any(n.endswith("w_q.bias") for n in names) and any(n.endswith("cross_attn.w_v.bias") for n in names)
    assert model.ctc is None and model.output.weight is model.embed.token.weight
    with pytest.raises(ValueError, match="no CTC head"):
        model.ctc_logits(torch.zeros(1, 3, 16))


def test_decoder_is_causal() -> None:
    """Changing target token j changes no logits before position j."""
    model = make_model()
    feats = torch.randn(2, 23, M)
    tgt = torch.tensor([[BOS, 3, 4, 5, 6], [BOS, 6, 5, 4, 3]])
    with torch.no_grad():
        base = model(feats, None, tgt)
        for j in range(1, 5):
            changed = tgt.clone()
            changed[:, j] = 3 + (changed[:, j] - 2) % 4
            out = model(feats, None, changed)
            assert (out[:, :j] - base[:, :j]).abs().max() <= ATOL
            assert (out[:, j:] - base[:, j:]).abs().max() > ATOL


@pytest.mark.parametrize("frontend", ["conv2d", "whisper"])
def test_cached_decoding_equals_a_full_pass(frontend: str) -> None:
    """One token at a time with the KV cache gives the full pass's logits and cross-attention."""
    model = make_model(frontend)
    feats, valid = pad_features(_features([31, 19], seed=2))
    tgt = torch.tensor([[BOS, 3, 4, 5, 6, 3], [BOS, 6, 5, 4, 3, 6]])
    with torch.no_grad():
        memory, memory_valid = model.encode(feats, valid)
        full = model.decode(tgt, memory, src_mask=memory_valid, need_weights=True)
        cache, steps, weights = None, [], []
        for i in range(tgt.shape[1]):
            out = model.decode(tgt[:, i : i + 1], memory, src_mask=memory_valid, cache=cache, need_weights=True)
            cache = out.cache
            steps.append(out.logits)
            weights.append(out.attention[-1])
    assert (torch.cat(steps, dim=1) - full.logits).abs().max() <= ATOL
    assert (torch.cat(weights, dim=2) - full.attention[-1]).abs().max() <= ATOL


@pytest.mark.parametrize(
    ("frontend", "overrides"), [("whisper", {"norm_first": True}), ("conv2d", {"norm_first": False})]
)
@pytest.mark.parametrize("copy_kind", ["model", "for_decoding", "int8", "int8 float32"])
def test_row_step_equals_the_explicit_step(frontend: str, overrides: dict, copy_kind: str) -> None:
    """A step over one utterance (or utterances of one length) and preallocated caches takes the
    one-row fast path (SpeechEncoderDecoder.decode_row: cross-attention to the keys and values
    the start projected, no masks): every step's logits equal ``decode``'s over concatenated caches
    within 1e-5, for a Whisper-like model (no key biases, learned positions, pre-norm) and a
    post-norm one, and for the decoding copies speech gets (int8: its float decoder, bfloat16
    where native, and float32); padded utterances keep decode."""
    model = make_model(frontend, seed=7, **overrides)
    model = {
        "model": model,
        "for_decoding": for_decoding(model, wide=True),
        "int8": int8_linears(model, float_decoder=True),
        "int8 float32": int8_linears(model, float_decoder=True, bf16=False),
    }[copy_kind]
    rows = []
    fast = copy.copy(model)  # the same modules; its decode_row counts its calls
    fast.decode_row = lambda *args, **kw: rows.append(1) or SpeechEncoderDecoder.decode_row(model, *args, **kw)
    for inputs in (_features([29], seed=7), _features([23, 23], seed=8)):
        rows.clear()
        with torch.no_grad():
            a, state_a = decoder_for(model).start(inputs)  # (N, V)
            state_b = decoder_for(fast).reserve(state_a, 12)
            greedy_in_step(decoder_for(model), state_a, decoder_for(fast), state_b, a, 12, atol=ATOL)
        assert len(rows) == 12
        assert greedy(fast, inputs, max_new_tokens=12) == greedy(model, inputs, max_new_tokens=12)
    rows.clear()
    padded = _features([29, 17], seed=9)
    assert greedy(fast, padded, max_new_tokens=4) == greedy(model, padded, max_new_tokens=4) and not rows


@pytest.mark.parametrize("frontend", ["conv2d", "whisper"])
def test_save_and_load_round_trip(frontend: str, tmp_path: Path) -> None:
    """config.json names the kind and nests the feature config; loading gives the same config,
    the same tensors and the same outputs."""
    model = make_model(frontend, ctc=True)
    save_model(model, tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    assert meta["kind"] == "speech_encoder_decoder"
    assert meta["config"]["features"] == model.config.features.to_dict()
    loaded, _ = load_model(tmp_path / "m", kind="speech_encoder_decoder")
    assert isinstance(loaded, SpeechEncoderDecoder) and loaded.config == model.config
    assert FeatureConfig.from_dict(meta["config"]["features"]) == model.config.features
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert loaded.output.weight is loaded.embed.token.weight
    feats = torch.randn(1, 21, M)
    tgt = torch.tensor([[BOS, 3, 4]])
    with torch.no_grad():
        assert torch.equal(model(feats, None, tgt), loaded(feats, None, tgt))


# ---------------------------------------------------------------------- CTC maths


def _path_log_prob(logp: torch.Tensor, path: tuple[int, ...]) -> float:
    return sum(float(logp[t, label]) for t, label in enumerate(path))


def _brute_force(logp: torch.Tensor, prefix: list[int], *, blank: int, exact: bool) -> float:
    """log of the summed probability of every alignment (V^T paths) whose labels begin with
    ``prefix`` (or, ``exact``, are ``prefix``)."""
    frames, vocab = logp.shape
    total = float("-inf")
    for path in itertools.product(range(vocab), repeat=frames):
        labels = ctc_collapse(path, blank=blank)
        if labels == prefix if exact else labels[: len(prefix)] == prefix:
            total = float(torch.logaddexp(torch.tensor(total), torch.tensor(_path_log_prob(logp, path))))
    return total


def _extend(scorer: CTCPrefixScorer, prefixes, tokens: list[int]):
    """``prefixes`` (one row per hypothesis) each extended by the same tokens, one at a time."""
    n = len(prefixes.inputs)
    for token in tokens:
        cand = torch.full((n, 1), token)
        psi, gamma = scorer.score(prefixes, cand)
        prefixes = scorer.extend(prefixes, psi, gamma, rows=torch.arange(n), candidates=cand, tokens=cand[:, 0])
    return prefixes


def _close(a: float, b: float) -> bool:
    return (a == b == float("-inf")) or abs(a - b) <= 1e-4


def test_ctc_prefix_scores_equal_a_sum_over_every_alignment() -> None:
    """ψ(g + c) of CTCPrefixScorer, for every prefix g of up to 3 labels (repeats included) and
    every candidate, equals the summed probability of the alignments whose labels begin with
    g + c; for END, of those that are exactly g; for the blank, −∞. Two utterances of 5 and 3
    frames in one padded batch, scored together, each over its own frames."""
    blank, eos, vocab = 0, 3, 4  # labels 1 and 2; END is a token the frames may also emit
    g = torch.Generator().manual_seed(3)
    logp = torch.log_softmax(torch.randn(2, 5, vocab, generator=g, dtype=torch.float64), dim=-1)
    lengths = [5, 3]
    valid = torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]
    scorer = CTCPrefixScorer(logp, valid, blank=blank, eos=eos)
    candidates = torch.tensor([[1, 2, eos, blank]] * 2)
    for size in range(4):
        for prefix in itertools.product((1, 2), repeat=size):
            prefixes = _extend(scorer, scorer.initial(torch.tensor([0, 1])), list(prefix))
            psi, _ = scorer.score(prefixes, candidates)
            for b, n in enumerate(lengths):
                frames = logp[b, :n]
                expected_g = 0.0 if not prefix else _brute_force(frames, list(prefix), blank=blank, exact=False)
                assert _close(float(prefixes.score[b]), expected_g), (prefix, b)
                for j, c in enumerate(candidates[b].tolist()):
                    if c == blank:
                        expected = float("-inf")
                    elif c == eos:
                        expected = _brute_force(frames, list(prefix), blank=blank, exact=True)
                    else:
                        expected = _brute_force(frames, [*prefix, c], blank=blank, exact=False)
                    assert _close(float(psi[b, j]), expected), (prefix, c, b, float(psi[b, j]), expected)


def test_ctc_prefix_probability_with_end_is_exp_minus_ctc_loss() -> None:
    """ψ(y + END) = p(y | x) = exp(−ctc_loss) for whole targets, repeats included, in a padded
    batch; training.ctc_loss is the same sum divided by the target tokens."""
    blank, eos = 0, 2
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 11, V, generator=g)
    lengths = torch.tensor([11, 7, 9])
    valid = torch.arange(11)[None, :] < lengths[:, None]
    targets = torch.tensor([[3, 4, 4, 5], [6, 3, 0, 0], [5, 5, 5, 0]])
    target_lengths = torch.tensor([4, 2, 3])
    logp = torch.log_softmax(logits, dim=-1)
    nll = F.ctc_loss(logp.transpose(0, 1), targets, lengths, target_lengths, blank=blank, reduction="none")
    scorer = CTCPrefixScorer(logp, valid, blank=blank, eos=eos)
    for b in range(3):
        y = targets[b, : target_lengths[b]].tolist()
        prefixes = _extend(scorer, scorer.initial(torch.tensor([b])), y)
        psi, _ = scorer.score(prefixes, torch.tensor([[eos]]))
        assert abs(float(psi[0, 0]) + float(nll[b])) <= 1e-4
    loss = ctc_loss(logits, valid, targets, target_lengths, blank=blank)
    assert abs(float(loss) - float(nll.sum()) / 9) <= 1e-5


def test_ctc_best_path() -> None:
    """Repeats merge, blanks drop, a blank between repeats keeps both; padding frames are ignored."""
    assert ctc_collapse([0, 3, 3, 0, 3, 4, 4, 0], blank=0) == [3, 3, 4]
    logits = torch.full((2, 6, V), -5.0)
    for b, path in enumerate([[3, 3, 0, 3, 4, 0], [5, 0, 5, 5, 6, 6]]):
        logits[b, torch.arange(6), torch.tensor(path)] = 5.0
    valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    assert ctc_best_path(logits, valid, blank=0) == [[3, 3, 4], [5, 5]]


# ------------------------------------------------------------------- decoding


def test_joint_decoding_with_weight_zero_equals_attention_only() -> None:
    """ctc_weight=0 runs the CTC scorer with zero weight over the pre-beam candidates and gives
    exactly attention-only beam search: tokens and scores, every beam width, n-best."""
    model = make_model(seed=5)
    inputs = _features([29, 13, 41, 23], seed=5)
    for width in (1, 2, 3, 4):
        plain = beam_search(model, inputs, beam_size=width, max_new_tokens=8, nbest=width)
        joint = joint_beam_search(model, inputs, beam_size=width, max_new_tokens=8, nbest=width, ctc_weight=0.0)
        assert joint == plain


def test_joint_decoding_gives_every_input_a_hypothesis() -> None:
    """Untrained models whose attention rarely ranks END high, on inputs of few frames: every
    input still gets a hypothesis CTC can align (END is always a candidate), of at most as
    many tokens as the encoder has frames. Without END among the candidates, a beam whose
    other candidates had no alignment left ended with nothing (358 of 720 searches here)."""
    for seed in range(5):
        model = make_model(seed=seed)
        inputs = _features([9, 13, 17, 29], seed=seed)
        frames = [int(n) for n in model.subsampled(torch.tensor([f.shape[0] for f in inputs]))]
        for width in (1, 3):
            for weight in (0.3, 1.0):
                found = joint_beam_search(model, inputs, beam_size=width, max_new_tokens=13, ctc_weight=weight)
                assert all(hyps for hyps in found)
                assert all(len(hyps[0].tokens) <= s for hyps, s in zip(found, frames, strict=True))
                assert all(hyps[0].score > float("-inf") for hyps in found)


def make_lm(*, seed: int = 0, max_len: int = 13, vocab_size: int = V) -> DecoderOnly:
    torch.manual_seed(seed)
    config = DecoderOnlyConfig(vocab_size=vocab_size, d_model=15, n_heads=3, d_ff=11, n_layers=2, max_len=max_len)
    return DecoderOnly(config).eval()


def test_fusion_with_weight_zero_equals_no_language_model() -> None:
    """lm_weight=0 reads the LM along every beam and adds nothing: the same tokens and scores
    as no LM, every width, with and without CTC."""
    model, lm = make_model(seed=7), make_lm(seed=8)
    inputs = _features([29, 13, 41], seed=7)
    for width in (1, 3):
        for ctc in (None, 0.3):
            plain = joint_beam_search(model, inputs, beam_size=width, max_new_tokens=8, nbest=width, ctc_weight=ctc)
            fused = joint_beam_search(
                model, inputs, beam_size=width, max_new_tokens=8, nbest=width, ctc_weight=ctc, lm=lm, lm_weight=0.0
            )
            assert fused == plain


def test_ctc_weight_zero_with_a_language_model_equals_no_ctc_with_it() -> None:
    """The CTC pre-beam ranks candidates with the LM's term (ESPnet's "full" pre-beam), so with
    λ = 0 every token the fused search without CTC would keep is a candidate: the same tokens
    and scores, at a weight where the LM changes what is found."""
    model, lm = make_model(seed=7), make_lm(seed=8)
    inputs = _features([29, 13, 41], seed=7)
    for width in (1, 3):
        plain = beam_search(model, inputs, beam_size=width, max_new_tokens=8, nbest=width)
        fused = joint_beam_search(model, inputs, beam_size=width, max_new_tokens=8, nbest=width, lm=lm, lm_weight=3.0)
        assert fused != plain  # the LM matters here
        joint = joint_beam_search(
            model, inputs, beam_size=width, max_new_tokens=8, nbest=width, ctc_weight=0.0, lm=lm, lm_weight=3.0
        )
        assert joint == fused


def test_the_memory_plan_counts_a_fused_language_models_cache(monkeypatch) -> None:
    """inputs_per_batch plans for the LM's cache beside the decoder's (END and every new token
    of every row): a budget that holds 4 inputs without an LM holds fewer with one, and the
    search decoded in those parts finds what one batch finds."""
    from qkv import decoding as generation

    model, lm = make_model(seed=7), make_lm(seed=8)
    inputs = _features([29, 13, 41, 23, 31, 17], seed=7)
    caps = generation.check_inputs(model, inputs, max_new_tokens=8)
    alone = generation.decoding_bytes(model, inputs=1, beam=3, source=41, steps=max(caps))
    fused = alone + generation.decoding_bytes(lm, inputs=1, beam=3, source=1, steps=max(caps))
    whole = joint_beam_search(model, inputs, beam_size=3, max_new_tokens=8, nbest=2, lm=lm, lm_weight=0.5)
    monkeypatch.setenv("QKV_MAX_MEMORY", str(int(4.5 * alone / generation.DECODING_SHARE)))
    assert generation.inputs_per_batch(model, inputs, caps, beam=3) == 4
    fit = generation.inputs_per_batch(model, inputs, caps, beam=3, scorers=[LanguageModelScore(lm, 0.5)])
    assert 1 <= fit < 4 and fit == int(
        int(4.5 * alone / generation.DECODING_SHARE) * generation.DECODING_SHARE // fused
    )
    parts = joint_beam_search(model, inputs, beam_size=3, max_new_tokens=8, nbest=2, lm=lm, lm_weight=0.5)
    assert [[h.tokens for h in hs] for hs in parts] == [[h.tokens for h in hs] for hs in whole]
    scores = [h.score for hs in parts for h in hs]
    assert scores == pytest.approx([h.score for hs in whole for h in hs], abs=1e-5)  # other padding, same search


@pytest.mark.parametrize("weight", [0.5, 2.0])
@torch.no_grad()
def test_fused_greedy_equals_the_explicit_sum_of_log_probabilities(weight: float) -> None:
    """Beam width 1 with an LM is greedy search on log p_decoder + β·log p_LM, each computed
    here from scratch over the whole prefix (no cache; the LM reads END first): the same
    tokens, and the score is that sum over the tokens and END."""
    model, lm = make_model(seed=9), make_lm(seed=10)
    inputs = _features([31, 17], seed=9)
    found = joint_beam_search(model, inputs, beam_size=1, max_new_tokens=12, lm=lm, lm_weight=weight)
    memory, valid = model.encode(*pad_features(inputs))  # (B, S, D), (B, S)
    for b in range(len(inputs)):
        tokens: list[int] = []
        total = 0.0
        for _ in range(12):
            tgt = torch.tensor([[BOS, *tokens]])  # (1, L)
            att = model.decode(tgt, memory[b : b + 1], src_mask=valid[b : b + 1]).logits[0, -1]  # (V,)
            text = lm(torch.tensor([[EOS, *tokens]]))[0, -1]  # (V,)
            logp = torch.log_softmax(att, -1) + weight * torch.log_softmax(text, -1)  # (V,)
            token = int(logp.argmax())
            total += float(logp[token])
            if token == EOS:
                break
            tokens.append(token)
        length = len(tokens) + (token == EOS)  # END counts in the length it is normalized by
        assert found[b][0].tokens == tokens
        assert found[b][0].score == pytest.approx(total / length, abs=1e-4)


def test_a_language_model_that_does_not_fit_is_refused() -> None:
    """Another vocabulary size, or a window shorter than the longest output: ValueError (END
    takes the first position, and the last token chosen is never read)."""
    model, inputs = make_model(seed=7), _features([29], seed=7)
    with pytest.raises(ValueError, match="the language model has 11 tokens, the decoder 7"):
        joint_beam_search(model, inputs, beam_size=2, max_new_tokens=8, lm=make_lm(vocab_size=11), lm_weight=0.3)
    with pytest.raises(ValueError, match=r"window \(7\) is shorter than the outputs \(8\)"):
        joint_beam_search(model, inputs, beam_size=2, max_new_tokens=8, lm=make_lm(max_len=7), lm_weight=0.3)
    joint_beam_search(model, inputs, beam_size=2, max_new_tokens=8, lm=make_lm(max_len=8), lm_weight=0.3)  # fits


def test_speech_decoding_inputs_and_ensembles() -> None:
    """Greedy of a padded batch equals each utterance alone and beam width 1; an ensemble of one
    decodes as its model; for_decoding too; token lists and wrong mel counts are refused."""
    model = make_model(seed=6)
    inputs = _features([19, 37, 11], seed=6)
    batch = greedy(model, inputs, max_new_tokens=6)
    assert batch == [greedy(model, [f], max_new_tokens=6)[0] for f in inputs]
    assert [h[0].tokens for h in beam_search(model, inputs, beam_size=1, max_new_tokens=6)] == batch
    assert greedy(Ensemble((model,)), inputs, max_new_tokens=6) == batch
    assert greedy(for_decoding(model), inputs, max_new_tokens=6) == batch
    joint = joint_beam_search(model, inputs, beam_size=2, max_new_tokens=6, ctc_weight=0.4)
    assert joint == joint_beam_search(Ensemble((model,)), inputs, beam_size=2, max_new_tokens=6, ctc_weight=0.4)
    assert ctc_greedy(Ensemble((model,)), inputs) == ctc_greedy(model, inputs)
    with pytest.raises(ValueError, match="feature tensor"):
        greedy(model, [[3, 4, 5]], max_new_tokens=3)
    with pytest.raises(ValueError, match=r"\(T, 11\)"):
        beam_search(model, [torch.randn(20, M + 2)], beam_size=2, max_new_tokens=3)
    with pytest.raises(ValueError, match="ctc_weight"):
        joint_beam_search(model, inputs, beam_size=2, max_new_tokens=3, ctc_weight=1.5)
    with pytest.raises(ValueError, match="CTC head"):
        joint_beam_search(make_model("whisper"), [torch.randn(9, M)], beam_size=2, max_new_tokens=3, ctc_weight=0.3)
    with pytest.raises(ValueError, match="features"):
        Ensemble((model, make_model(seed=7, features=FeatureConfig(n_mels=M, normalize=True))))


TRANSCRIPTS = [[3, 4, 5], [6, 3], [5, 5, 4]]


@pytest.fixture(scope="module")
def trained() -> tuple[SpeechEncoderDecoder, list[torch.Tensor], list[float]]:
    """A 1+1-layer speech model trained on 3 random feature sequences and their transcripts
    (CTC weight 0.3); returns the model, the utterances and the loss per step."""
    model = make_model(seed=8, n_encoder_layers=1, n_decoder_layers=1).train()
    utterances = _features([31, 43, 37], seed=8)
    feats, valid = pad_features(utterances)
    _, t_in, t_out = seq2seq_batch([([], t) for t in TRANSCRIPTS], pad_id=PAD, bos_id=BOS, eos_id=EOS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(150):
        loss, n = speech_loss(model, feats, valid, t_in, t_out, pad_id=PAD, ctc_weight=0.3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert n == sum(len(t) + 1 for t in TRANSCRIPTS)
    return model.eval(), utterances, losses


def test_a_tiny_model_learns_three_utterances(trained) -> None:
    """The joint loss falls by 90%; greedy, beam search (attention only and joint) and CTC best
    path all return the transcripts."""
    model, utterances, losses = trained
    assert losses[-1] <= 0.1 * losses[0], (losses[0], losses[-1])
    assert greedy(model, utterances, max_new_tokens=6) == TRANSCRIPTS
    assert [h[0].tokens for h in beam_search(model, utterances, beam_size=3, max_new_tokens=6)] == TRANSCRIPTS
    for weight in (0.3, 1.0):
        best = joint_beam_search(model, utterances, beam_size=3, max_new_tokens=6, ctc_weight=weight)
        assert [h[0].tokens for h in best] == TRANSCRIPTS
    assert ctc_greedy(model, utterances) == TRANSCRIPTS


def test_speech_loss_mixes_ctc_and_cross_entropy() -> None:
    """λ = 0: the cross-entropy at the real target tokens; λ = 1: ctc_loss over the transcripts
    without END; between, the mixture; an utterance too short for its transcript counts zero."""
    model = make_model(seed=9)
    feats, valid = pad_features(_features([31, 9, 23], seed=9))  # 9 frames: 1 encoder frame for 2 tokens
    _, t_in, t_out = seq2seq_batch([([], t) for t in TRANSCRIPTS], pad_id=PAD, bos_id=BOS, eos_id=EOS)
    keep = t_out != PAD
    with torch.no_grad():
        memory, memory_valid = model.encode(feats, valid)
        logits = model.decode(t_in, memory, src_mask=memory_valid).logits
        ce = F.cross_entropy(logits[keep], t_out[keep], label_smoothing=0.1)
        targets = torch.tensor([t + [PAD] * (3 - len(t)) for t in TRANSCRIPTS])
        ctc = ctc_loss(model.ctc_logits(memory), memory_valid, targets, torch.tensor([3, 2, 3]), blank=PAD)
        args = (model, feats, valid, t_in, t_out)
        loss_0, n = speech_loss(*args, pad_id=PAD, ctc_weight=0.0, label_smoothing=0.1)
        loss_1, _ = speech_loss(*args, pad_id=PAD, ctc_weight=1.0, label_smoothing=0.1)
        loss_mix, _ = speech_loss(*args, pad_id=PAD, ctc_weight=0.25, label_smoothing=0.1)
    assert n == int(keep.sum())
    assert abs(float(loss_0) - float(ce)) <= ATOL and abs(float(loss_1) - float(ctc)) <= ATOL
    assert abs(float(loss_mix) - (0.25 * float(ctc) + 0.75 * float(ce))) <= ATOL
    assert math.isfinite(float(ctc))
    with pytest.raises(ValueError, match="ctc_weight"):
        speech_loss(*args, pad_id=PAD, ctc_weight=-0.1)


def test_a_joint_hypothesis_scores_attention_and_ctc_of_the_whole_sequence(trained) -> None:
    """The score of a hypothesis that ended with END is ((1 − λ)·log p_attention(y, END) +
    λ·log p_CTC(y)) / (|y| + 1): the per-step CTC gains add up to the whole sequence's CTC
    probability."""
    model, utterances, _ = trained
    weight, checked = 0.4, 0
    found = joint_beam_search(model, utterances, beam_size=3, max_new_tokens=6, nbest=3, ctc_weight=weight)
    for f, hyps in zip(utterances, found, strict=True):
        with torch.no_grad():
            memory, _ = model.encode(f[None])
            ctc_logp = torch.log_softmax(model.ctc_logits(memory)[0], dim=-1)  # (S, V)
            for h in hyps:
                if len(h.tokens) == 6 or not h.tokens:  # finished at the cap, or CTC cannot say END at once
                    continue
                y = torch.tensor(h.tokens)
                logits = model(f[None], None, torch.tensor([[BOS, *h.tokens]]))[0]
                attention = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor([*h.tokens, EOS])[:, None]).sum()
                ctc = -F.ctc_loss(
                    ctc_logp, y, torch.tensor([ctc_logp.shape[0]]), torch.tensor([len(y)]), blank=PAD, reduction="sum"
                )
                expected = ((1 - weight) * float(attention) + weight * float(ctc)) / (len(h.tokens) + 1)
                if math.isfinite(expected):
                    assert abs(h.score - expected) <= 1e-4, (h, expected)
                    checked += 1
    assert checked >= 3
