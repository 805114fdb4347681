"""Transformer-TTS (``models/tts.py``), its losses (``training.py``) and synthesis
(``synthesis.py``): the reduction-factor reshapes, padding and causality, cached == uncached
decoding, the stop token and the cap, the guided-attention penalty on a hand-computed case, and
a tiny model that learns one utterance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.audio import FeatureConfig, features
from qkv.checkpoint import load_model, save_model
from qkv.checks import PASS, Probe, causality, teacher_forced
from qkv.losses import guided_attention_loss, guided_attention_weights, tts_loss
from qkv.models.tts import TransformerTTS, TTSConfig, decoder_inputs, group_frames, ungroup_frames
from qkv.synthesis import synthesize
from qkv.training import Trainer
from qkv.vocoder import GriffinLim

M, V, PAD = 13, 17, 0
ATOL = 1e-5


def make_model(seed: int = 0, **overrides) -> TransformerTTS:
    fields = {
        "vocab_size": V,
        "d_model": 16,
        "n_heads": 2,
        "d_ff": 23,
        "n_encoder_layers": 2,
        "n_decoder_layers": 2,
        "dropout": 0.0,
        "prenet_dim": 11,
        "postnet_channels": 7,
        "postnet_layers": 3,
        "reduction": 3,
        "max_len": 64,
        "features": FeatureConfig(n_mels=M),
    }
    fields.update(overrides)
    torch.manual_seed(seed)
    return TransformerTTS(TTSConfig(**fields)).eval()


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 5), st.integers(1, 4), st.integers(1, 7))
def test_reduction_reshapes_round_trip(b, u, r, m) -> None:
    mel = torch.randn(b, u * r, m)
    groups = group_frames(mel, r)
    assert groups.shape == (b, u, r * m)
    assert torch.equal(groups[:, 1, :m], mel[:, r]) if u > 1 else True  # group 1 starts at frame r
    assert torch.equal(ungroup_frames(groups, m), mel)
    inputs = decoder_inputs(mel, r)
    assert inputs.shape == (b, u, m) and not inputs[:, 0].any()  # the go frame
    for step in range(1, u):
        assert torch.equal(inputs[:, step], mel[:, step * r - 1])  # the previous group's last frame
    if r > 1:
        with pytest.raises(ValueError, match="multiple"):
            group_frames(torch.randn(b, u * r + 1, m), r)


def test_padded_text_gives_each_sentence_its_own_frames() -> None:
    model = make_model(dropout=0.0)
    texts = [[3, 4, 5, 6, 7], [8, 9]]
    text = torch.tensor([[3, 4, 5, 6, 7], [8, 9, PAD, PAD, PAD]])
    mel = torch.randn(2, 9, M)
    valid = torch.ones(2, 9, dtype=torch.bool)
    before, after, stop, _ = model(text, text != PAD, mel, valid, prenet_dropout=False)
    for i, ids in enumerate(texts):
        t = torch.tensor([ids])
        b1, a1, s1, _ = model(t, t != PAD, mel[i : i + 1], valid[i : i + 1], prenet_dropout=False)
        assert (before[i] - b1[0]).abs().max() <= ATOL and (stop[i] - s1[0]).abs().max() <= ATOL
        assert (after[i] - a1[0]).abs().max() <= ATOL


def test_decoder_is_causal_over_steps() -> None:
    """Frames edited from step 3 on change no frame or stop logit written before (qkv check's
    causality row, the same function) and do change the later ones."""
    model = make_model()
    frames = torch.randn(5, M)
    probe = Probe([[3, 4, 5]], [frames])
    row = causality(model, probe, cut=3)
    assert row.status == PASS and row.measured <= ATOL  # steps 0-2 never see step 3
    changed = Probe([[3, 4, 5]], [torch.cat([frames[:3], frames[3:] + 1.0])])
    r = model.config.reduction
    with torch.no_grad():
        a, b = teacher_forced(model, probe)[0], teacher_forced(model, changed)[0]
    assert not torch.allclose(a[3 * r :], b[3 * r :], atol=ATOL)


def test_cached_decoding_equals_a_full_pass() -> None:
    model = make_model()
    text = torch.tensor([[3, 4, 5, 6], [7, 8, PAD, PAD]])
    valid = text != PAD
    memory = model.encode(text, valid)
    frames = torch.randn(2, 6, M)
    full = model.decode(frames, memory, memory_valid=valid, prenet_dropout=False, need_weights=True)
    cache, mels, stops = None, [], []
    for step in range(frames.shape[1]):
        out = model.decode(frames[:, step : step + 1], memory, memory_valid=valid, cache=cache, prenet_dropout=False)
        cache = out.cache
        mels.append(out.mel)
        stops.append(out.stop)
    assert (torch.cat(mels, 1) - full.mel).abs().max() <= ATOL
    assert (torch.cat(stops, 1) - full.stop).abs().max() <= ATOL
    assert full.weights[-1].shape == (2, 2, 6, 4)
    assert torch.allclose(full.weights[-1].sum(-1), torch.ones(2, 2, 6), atol=1e-5)
    assert not full.weights[-1][1, :, :, 2:].any()  # padding is never attended


def test_synthesis_in_a_batch_equals_one_by_one_and_is_the_teacher_forced_pass() -> None:
    model = make_model(seed=1)
    texts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    together = synthesize(model, texts, max_frames=20, prenet_dropout=False, alignments=True)
    for ids, one in zip(texts, together, strict=True):
        (alone,) = synthesize(model, [ids], max_frames=20, prenet_dropout=False, alignments=True)
        assert one.mel.shape == alone.mel.shape and (one.mel - alone.mel).abs().max() <= ATOL
        assert one.hit_cap == alone.hit_cap
        assert one.alignment.shape == alone.alignment.shape == (math.ceil(len(one.mel) / 3), len(ids))
    # The frames synthesis wrote, fed back teacher-forced, give the same frames (cached == uncached).
    (first,) = synthesize(model, [texts[0]], max_frames=21, stop_threshold=2.0, prenet_dropout=False)
    assert first.hit_cap and first.mel.shape == (21, M)
    raw = synthesize_raw(model, texts[0], steps=7)
    text = torch.tensor([texts[0]])
    out = model.decode(decoder_inputs(raw, 3), model.encode(text), memory_valid=None, prenet_dropout=False)
    assert (out.mel - raw).abs().max() <= ATOL
    assert (model.refine(raw)[0] - first.mel).abs().max() <= ATOL


def test_attention_window_keeps_each_step_near_the_furthest_peak() -> None:
    model = make_model(seed=2)
    texts = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [8, 9, 10, 11, 12, 13, 14]]

    def run(batch: list[list[int]], window: tuple[int, int] | None) -> list:  # 10 steps: it never stops
        return synthesize(
            model,
            batch,
            max_frames=30,
            stop_threshold=2.0,
            prenet_dropout=False,
            alignments=True,
            attention_window=window,
        )

    free, wide = run(texts, None), run(texts, (11, 11))
    for a, b in zip(free, wide, strict=True):  # a window wider than the text changes nothing
        assert torch.equal(a.mel, b.mel) and torch.equal(a.alignment, b.alignment)
    back, ahead = 1, 2
    held = run(texts, (back, ahead))
    for ids, one in zip(texts, held, strict=True):
        (alone,) = run([ids], (back, ahead))
        assert (one.mel - alone.mel).abs().max() <= ATOL  # each sentence's peak is its own
        support = [torch.nonzero(row > 0).flatten() for row in one.alignment]  # attended positions per step
        assert support[0].max() <= ahead  # the first step: the text's start
        assert all(len(s) and s.max() - s.min() <= back + ahead for s in support)
        lefts = [int(s.min()) for s in support]
        assert lefts == sorted(lefts) and lefts[-1] > 0  # never back, and it moves on
    assert any(not torch.equal(a.mel, b.mel) for a, b in zip(free, held, strict=True))


def synthesize_raw(model: TransformerTTS, ids: list[int], *, steps: int) -> torch.Tensor:
    """The decoder's own frames (before the post-net) over ``steps`` cached steps."""
    text = torch.tensor([ids])
    memory = model.encode(text)
    frame, cache, out_frames = torch.zeros(1, 1, M), None, []
    with torch.no_grad():
        for _ in range(steps):
            out = model.decode(frame, memory, memory_valid=None, cache=cache, prenet_dropout=False)
            cache, frame = out.cache, out.mel[:, -1:]
            out_frames.append(out.mel)
    return torch.cat(out_frames, 1)  # (1, steps·r, M)


def test_stop_token_ends_a_sentence_and_the_cap_is_reported() -> None:
    model = make_model()
    with torch.no_grad():
        model.stop_head.bias.fill_(-30.0)  # never stops
    (never,) = synthesize(model, [[3, 4]], max_frames=10)
    assert never.hit_cap and never.mel.shape[0] == 12  # the cap, rounded up to whole steps of r = 3
    with torch.no_grad():
        model.stop_head.weight.zero_()
        model.stop_head.bias.copy_(torch.tensor([-30.0, 30.0, 30.0]))  # stops at the 2nd frame of a step
    (short,) = synthesize(model, [[3, 4]], max_frames=10)
    assert not short.hit_cap and short.mel.shape[0] == 2
    window = make_model(max_len=2)  # the decoder's window caps too
    with torch.no_grad():
        window.stop_head.bias.fill_(-30.0)
    (capped,) = synthesize(window, [[3]], max_frames=100)
    assert capped.hit_cap and capped.mel.shape[0] == 6


def test_prenet_dropout_stays_on_at_inference_unless_switched_off() -> None:
    """Li et al. (2019) keep the mel pre-net's dropout at inference; eval() must not switch it off."""
    model = make_model(prenet_dropout=0.5)
    assert not model.training
    frames = torch.randn(2, 5, M)
    torch.manual_seed(1)
    first = model.decoder_prenet(frames)  # (B, U, D)
    second = model.decoder_prenet(frames)  # (B, U, D)
    assert not torch.equal(first, second)  # a fresh dropout mask on each call, in eval mode
    assert torch.equal(model.decoder_prenet(frames, always=False), model.decoder_prenet(frames, always=False))
    with torch.no_grad():
        model.stop_head.bias.fill_(-30.0)  # never stops: both runs write the same number of frames
    (a,) = synthesize(model, [[3, 4, 5]], max_frames=9)
    (b,) = synthesize(model, [[3, 4, 5]], max_frames=9)
    assert a.mel.shape == b.mel.shape and not torch.equal(a.mel, b.mel)
    (c,) = synthesize(model, [[3, 4, 5]], max_frames=9, prenet_dropout=False)
    (d,) = synthesize(model, [[3, 4, 5]], max_frames=9, prenet_dropout=False)
    assert torch.equal(c.mel, d.mel)


def test_guided_attention_penalty_on_a_hand_computed_case() -> None:
    w = guided_attention_weights(torch.tensor([2, 1]), torch.tensor([2, 2]), sigma=0.2)
    off = 1 - math.exp(-(0.5**2) / (2 * 0.2**2))
    expected = torch.tensor([[[0.0, off], [off, 0.0]], [[0.0, 0.0], [1 - math.exp(-(0.5**2) / 0.08), 0.0]]])
    assert torch.allclose(w, expected, atol=1e-6)  # the second utterance's text has one position: column 1 is padding
    attention = torch.full((2, 3, 2, 2), 0.5)  # B=2, H=3, U=2, S=2
    loss = guided_attention_loss(attention, torch.tensor([2, 1]), torch.tensor([2, 2]), sigma=0.2)
    assert loss.item() == pytest.approx(0.5 * (2 * off + expected[1, 1, 0].item()) * 3 / ((4 + 2) * 3))
    diagonal = torch.eye(2).expand(2, 3, 2, 2)
    assert guided_attention_loss(diagonal, torch.tensor([2, 2]), torch.tensor([2, 2])).item() == 0.0


def test_config_round_trips_and_refuses_bad_values(tmp_path) -> None:
    model = make_model(n_speakers=2)
    save_model(model, tmp_path / "tts")
    loaded, meta = load_model(tmp_path / "tts")
    assert meta["kind"] == "tts" and loaded.config == model.config
    for overrides, name in [
        ({"reduction": 0}, "reduction"),
        ({"features": FeatureConfig(n_mels=M, normalize=True)}, "normalise"),
        ({"prenet_dropout": 1.0}, "prenet_dropout"),
        ({"positions": "rope"}, "positions"),
        ({"postnet_layers": 1}, "postnet_layers"),
    ]:
        with pytest.raises(ValueError, match=name):
            make_model(**overrides)
    with pytest.raises(ValueError, match="speakers"):
        model.encode(torch.tensor([[3, 4]]))


def test_a_tiny_model_learns_one_utterance() -> None:
    """Mel loss falls by 90% on one sentence; synthesis then stops near the utterance's length."""
    config = FeatureConfig(n_mels=M, n_fft=256, win_length=256, hop_length=128)
    t = torch.arange(int(0.45 * 16000)) / 16000
    wave = torch.sin(2 * math.pi * (300 + 400 * t) * t) * torch.hann_window(len(t))
    target = features(wave, config)  # (T, M)
    frames = target.shape[0] + (-target.shape[0]) % 3
    valid = torch.zeros(1, frames, dtype=torch.bool)
    valid[0, : target.shape[0]] = True
    torch.manual_seed(0)
    model = TransformerTTS(
        TTSConfig(
            vocab_size=V, d_model=32, n_heads=2, d_ff=64, n_encoder_layers=1, n_decoder_layers=2, dropout=0.0,
            prenet_dim=32, prenet_dropout=0.1, postnet_channels=16, postnet_layers=3, reduction=3, max_len=64,
            features=config, mel_mean=float(target.mean()), mel_std=float(target.std()),
        )
    )  # fmt: skip
    mel = torch.zeros(1, frames, M)
    mel[0, : target.shape[0]] = model.scale(target)  # the frames as the model reads and writes them
    text = torch.tensor([[3, 5, 7, 9, 11]])
    trainer = Trainer(model, lr=3e-3, warmup=10, total_steps=150, schedule="cosine", weight_decay=0.0)
    first = None
    for _ in range(150):
        parts = {}

        def step(parts=parts):
            loss, got, n = tts_loss(model, text, text != PAD, mel, valid, guided_weight=1.0)
            parts.update(got)
            return loss, n

        trainer.step([step])
        first = parts["frames"] if first is None else first
    model.eval()
    assert parts["frames"] < 0.1 * first
    torch.manual_seed(1)
    (out,) = synthesize(model, [[3, 5, 7, 9, 11]], max_frames=3 * target.shape[0])
    assert not out.hit_cap and abs(out.mel.shape[0] - target.shape[0]) <= 3
    assert (out.mel - target[: out.mel.shape[0]]).abs().mean() < 0.25 * (target - target.mean()).abs().mean()
    wave_out = GriffinLim(config, iterations=4)(out.mel)  # (N,)
    # N = (T - 1) hops: the utterance's length within the 3 frames allowed above, plus that one
    assert abs(wave_out.numel() - len(wave)) <= 4 * config.hop_length
