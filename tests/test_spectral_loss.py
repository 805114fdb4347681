"""The waveform losses a vocoder is trained with (spectral_loss.py) and the mel vocoder's loss
through its frozen generator (tasks/vocoder.py): zero for identical signals, positive and
growing with the difference otherwise, and gradients that reach the adapter, never the generator.

Tiny prime-sized signals and voices (the tiny voice of test_mel_vocoder.py: 517 Hz, hop 6).
"""

from __future__ import annotations

import pytest
import torch

from qkv.models.mel_vocoder import MelVocoder, MelVocoderConfig, latent_frames
from qkv.models.vits import VitsConfig
from qkv.spectral_loss import MelLossConfig, mel_l1_loss, multi_resolution_stft_loss
from qkv.tasks.vocoder import LossWeights, Pair, pair_losses, train_adapter

SMALL = ((31, 7, 23), (61, 13, 53))  # (FFT size, hop, window): prime hops and windows
MEL = MelLossConfig(sample_rate=517, n_fft=61, hop=13, n_mels=11, f_max=250.0)


def signals(seed: int = 0, n: int = 2, length: int = 1031) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(length) / 517
    tone = torch.sin(2 * torch.pi * 41 * t)[None] * torch.rand(n, 1, generator=g)
    return 0.5 * tone + 0.1 * torch.randn(n, length, generator=g)  # (B, Y)


@pytest.mark.parametrize(
    "loss", [lambda a, b: multi_resolution_stft_loss(a, b, SMALL), lambda a, b: mel_l1_loss(a, b, MEL)]
)
def test_waveform_losses_are_zero_for_the_same_signal_and_grow_with_the_difference(loss):
    target = signals()
    noise = torch.randn(target.shape, generator=torch.Generator().manual_seed(1))
    assert float(loss(target.clone(), target)) == 0.0
    values = [float(loss(target + level * noise, target)) for level in (0.01, 0.1, 1.0)]
    assert 0 < values[0] < values[1] < values[2]
    assert float(loss(signals(seed=2), target)) > 0  # another signal altogether
    assert float(loss(2 * target, target)) > 0  # louder is not the same
    with pytest.raises(ValueError, match="shape"):
        loss(target[:, :-1], target)


def test_the_default_resolutions_read_a_short_segment():
    """Parallel WaveGAN's three resolutions (FFT sizes up to 2048) on fewer samples than one window."""
    target = signals(length=997)
    assert float(multi_resolution_stft_loss(target, target)) == 0.0
    assert float(multi_resolution_stft_loss(target.flip(-1), target)) > 0


def tiny_vocoder() -> MelVocoder:
    voice = VitsConfig(
        n_symbols=11, hidden=6, inter_channels=5, filter_channels=7, n_heads=2, n_layers=1, window=2,
        dp_filter_channels=5, flow_couplings=1, flow_layers=1, flow_kernel_size=3, resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1, 2),), upsample_rates=(3, 2), upsample_kernel_sizes=(7, 4),
        upsample_initial_channel=8, sample_rate=517,
    )  # fmt: skip
    torch.manual_seed(0)
    config = MelVocoderConfig(
        voice, n_mels=7, mel_sample_rate=600, mel_hop=6, mel_mean=-3, mel_std=2, channels=5, layers=2
    )
    return MelVocoder(config)


WEIGHTS = LossWeights(latent=1.0, stft=1.0, mel=1.0, segment=11)


def test_the_loss_through_the_generator_is_zero_at_the_recordings_latent_and_positive_elsewhere():
    vocoder = tiny_vocoder()
    mel = torch.randn(23, 7) - 3
    with torch.no_grad():
        own = vocoder.adapter(mel[None])[0]  # (C, Z): a latent the adapter gives exactly
        same = pair_losses(vocoder, Pair(mel, own), WEIGHTS, start=3)
        other = pair_losses(vocoder, Pair(mel, own + 0.3 * torch.randn(own.shape)), WEIGHTS, start=3)
        latent_only = pair_losses(vocoder, Pair(mel, own), LossWeights())
    assert all(float(v) > 0 for v in other.values())
    assert float(other["total"]) == pytest.approx(float(other["latent"] + other["stft"] + other["mel"]), rel=1e-6)
    assert set(same) == {"latent", "stft", "mel", "total"} and all(float(v) == 0.0 for v in same.values())
    assert set(latent_only) == {"latent", "total"}  # the generator is not run


def test_the_generator_says_the_same_whether_or_not_autograd_records_it():
    """At inference it sums in place; under autograd it may not, and must give the same waveform."""
    vocoder = tiny_vocoder()
    z = torch.randn(2, 5, 13)  # (B, latent, Z)
    with torch.no_grad():
        fast = vocoder.generator(z)  # (B, 1, Y)
    recorded = vocoder.generator(z.clone().requires_grad_())
    assert recorded.requires_grad and torch.allclose(recorded.detach(), fast, atol=1e-6)


def test_training_moves_the_adapter_and_never_the_generator():
    vocoder = tiny_vocoder()
    generator = {k: v.clone() for k, v in vocoder.generator.state_dict().items()}
    adapter = {k: v.clone() for k, v in vocoder.adapter.state_dict().items()}
    pairs = []
    for frames in (19, 29):
        mel = torch.randn(frames, 7).cumsum(0) / 5 - 3
        pairs.append(Pair(mel, torch.randn(5, latent_frames(frames, vocoder.config))))
    terms = pair_losses(vocoder, pairs[0], LossWeights(latent=0.0, stft=1.0, mel=1.0, segment=7), start=2)
    terms["total"].backward()  # the waveform terms alone: a gradient only through the generator
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in vocoder.adapter.parameters())
    vocoder.zero_grad(set_to_none=True)
    seen = []
    done = train_adapter(
        vocoder, pairs, steps=3, weights=WEIGHTS, batch=2, lr=1e-2, every=1, on_step=lambda *a: seen.append(a)
    )
    assert done["steps"] == 3 and [s[0] for s in seen] == [1, 2, 3] and set(done["loss"]) == set(terms)
    assert all(p.grad is None and not p.requires_grad for p in vocoder.generator.parameters())
    assert all(torch.equal(v, generator[k]) for k, v in vocoder.generator.state_dict().items())
    assert any(not torch.equal(v, adapter[k]) for k, v in vocoder.adapter.state_dict().items())


def test_loss_weights_refuse_nonsense():
    for bad in (dict(latent=-1.0), dict(latent=0.0), dict(stft=1.0, segment=0)):
        with pytest.raises(ValueError):
            LossWeights(**bad)
