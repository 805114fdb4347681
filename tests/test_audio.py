"""Audio front-end: reading and refusing files, resampling, log-mel and Whisper features (against
librosa and transformers), CMVN, SpecAugment, padding and the feature settings."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from qkv.audio import (
    FeatureConfig,
    batch_features,
    cmvn,
    features,
    hz_to_mel,
    load_audio,
    load_many,
    mel_filterbank,
    mel_to_hz,
    pad_features,
    spec_augment,
)
from qkv.errors import UserError

DATA = Path(os.environ.get("QKV_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data")
GEORGE = DATA / "fsdd" / "recordings" / "0_george_0.wav"
SUBTYPES = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "ogg": ("OGG", "VORBIS")}


def tone(freq: float, seconds: float, rate: int, amplitude: float = 0.5) -> np.ndarray:
    return (amplitude * np.sin(2 * np.pi * freq * np.arange(round(seconds * rate)) / rate)).astype(np.float32)


def chirp(seconds: float, rate: int = 16000) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * (100 * t + 2000 * t**2 / seconds))).astype(np.float32)  # 100 Hz -> 4.1 kHz


def noise(seconds: float, rate: int = 16000, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(round(seconds * rate))).astype(np.float32)


def write(path: Path, data: np.ndarray, rate: int) -> Path:
    fmt, subtype = SUBTYPES[path.suffix[1:]]
    soundfile.write(str(path), data, rate, format=fmt, subtype=subtype)
    return path


def peak_hz(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(x.size)))
    return float(np.fft.rfftfreq(x.size, 1 / rate)[spectrum.argmax()])


# ---------------------------------------------------------------------------------------------
# Reading files
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("ext", "rate"), [("wav", 8000), ("flac", 22050), ("ogg", 44100), ("wav", 16000)])
def test_load_resamples_to_16k_and_keeps_a_sines_frequency(tmp_path, ext, rate) -> None:
    path = write(tmp_path / f"a.{ext}", tone(1000.0, 0.5, rate), rate)
    x = load_audio(path)
    assert x.dtype == torch.float32 and x.dim() == 1
    assert abs(x.numel() - 8000) <= 1  # 0.5 s at 16 kHz
    assert abs(peak_hz(x.numpy(), 16000) - 1000.0) <= 16000 / x.numel()  # within one FFT bin
    assert abs(float(x.abs().max()) - 0.5) < 0.02


def test_stereo_is_mixed_to_mono(tmp_path) -> None:
    left, right = tone(440.0, 0.25, 16000), tone(1500.0, 0.25, 16000, amplitude=0.3)
    soundfile.write(str(tmp_path / "s.wav"), np.stack([left, right], 1), 16000, subtype="FLOAT")
    torch.testing.assert_close(load_audio(tmp_path / "s.wav"), torch.from_numpy((left + right) / 2))
    # at 44.1 kHz, resampled: both tones survive the mix
    loud = np.stack([tone(440.0, 0.5, 44100), tone(1500.0, 0.5, 44100)], 1)
    x = load_audio(write(tmp_path / "s.flac", loud, 44100)).numpy()
    spectrum, freqs = np.abs(np.fft.rfft(x)), np.fft.rfftfreq(x.size, 1 / 16000)
    top_two = sorted(freqs[np.argsort(spectrum)[-2:]])
    assert top_two == pytest.approx([440.0, 1500.0], abs=2.0)


def _bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Every kind of bad file, with the reason its message must give."""
    (tmp_path / "empty.wav").write_bytes(b"")
    (tmp_path / "text.wav").write_text("this is not audio\n")
    soundfile.write(str(tmp_path / "zero_length.wav"), np.zeros(0, np.float32), 16000)
    soundfile.write(str(tmp_path / "all_zero.wav"), np.zeros(8000, np.float32), 16000)
    soundfile.write(str(tmp_path / "long.flac"), tone(300.0, 3.0, 8000), 8000)
    return {
        "empty": (tmp_path / "empty.wav", r"empty file \(0 bytes\)"),
        "text": (tmp_path / "text.wav", r"not readable as audio \(Format not recognised\)"),
        "zero_length": (tmp_path / "zero_length.wav", r"no audio in it \(0 samples\)"),
        "all_zero": (tmp_path / "all_zero.wav", r"silent \(every sample is zero\)"),
        "long": (tmp_path / "long.flac", r"3\.0 s long, over the limit of 2 s"),
        "missing": (tmp_path / "missing.ogg", "no such file"),
    }


@pytest.mark.parametrize("kind", ["empty", "text", "zero_length", "all_zero", "long", "missing"])
def test_each_bad_file_is_refused_on_one_line_naming_it(tmp_path, kind) -> None:
    path, reason = _bad_files(tmp_path)[kind]
    with pytest.raises(UserError, match=f"^{re.escape(str(path))}: {reason}$") as err:
        load_audio(path, max_seconds=2.0)
    assert "\n" not in str(err.value)


def test_a_quiet_file_is_silent_below_the_threshold(tmp_path) -> None:
    path = write(tmp_path / "quiet.wav", tone(500.0, 0.2, 16000, amplitude=3e-5), 16000)  # ~1 LSB of 16 bits
    with pytest.raises(UserError, match=r"quiet\.wav: silent \(peak -9\d\.\d dBFS\)"):
        load_audio(path)
    assert load_audio(path, silence_db=-120.0).numel() == 3200


def test_load_many_stops_at_the_first_bad_file_or_names_them_all(tmp_path) -> None:
    bad = _bad_files(tmp_path)
    good = [write(tmp_path / f"g{i}.{ext}", tone(200.0 * (i + 1), 0.3, 22050), 22050) for i, ext in enumerate(SUBTYPES)]
    paths = [good[0], bad["empty"][0], good[1], bad["text"][0], bad["zero_length"][0]]
    paths += [bad["all_zero"][0], good[2], bad["long"][0], bad["missing"][0]]
    with pytest.raises(UserError, match=f"^{re.escape(str(bad['empty'][0]))}: empty file"):
        load_many(paths, max_seconds=2.0)
    read, refused = load_many(paths, max_seconds=2.0, skip_bad=True)
    assert [p for p, _ in read] == good
    assert all(abs(x.numel() - 4800) <= 1 for _, x in read)
    order = ["empty", "text", "zero_length", "all_zero", "long", "missing"]
    assert [p for p, _ in refused] == [bad[k][0] for k in order]
    for (_, reason), kind in zip(refused, order, strict=True):
        assert re.fullmatch(bad[kind][1], reason), (kind, reason)
    again, none = load_many(good)  # nothing bad: the same waveforms, and an empty list
    assert none == [] and [p for p, _ in again] == good
    for (_, x), (_, y) in zip(again, read, strict=True):
        torch.testing.assert_close(x, y)


# ---------------------------------------------------------------------------------------------
# Mel scale, log-mel and Whisper features
# ---------------------------------------------------------------------------------------------


def test_slaney_mel_scale_and_filterbank_match_librosa() -> None:
    librosa = pytest.importorskip("librosa")
    hz = torch.tensor([0.0, 200.0, 999.0, 1000.0, 1001.0, 4000.0, 8000.0, 22050.0], dtype=torch.float64)
    np.testing.assert_allclose(hz_to_mel(hz).numpy(), librosa.hz_to_mel(hz.numpy(), htk=False), rtol=1e-12)
    np.testing.assert_allclose(mel_to_hz(hz_to_mel(hz)).numpy(), hz.numpy(), rtol=1e-12)
    for n_mels, n_fft, rate, f_min, f_max in [
        (80, 400, 16000, 0.0, None),
        (128, 400, 16000, 0.0, None),
        (40, 512, 22050, 60.0, 7600.0),
    ]:
        ours = mel_filterbank(n_mels, n_fft, rate, f_min=f_min, f_max=f_max)
        theirs = librosa.filters.mel(
            sr=rate, n_fft=n_fft, n_mels=n_mels, fmin=f_min, fmax=f_max, htk=False, norm="slaney"
        )
        assert ours.shape == (n_fft // 2 + 1, n_mels)
        np.testing.assert_allclose(ours.numpy().T, theirs, rtol=1e-5, atol=1e-8)


def _librosa_log_mel(y: np.ndarray, c: FeatureConfig) -> np.ndarray:
    librosa = pytest.importorskip("librosa")
    mel = librosa.feature.melspectrogram(
        y=y,
        sr=c.sample_rate,
        n_fft=c.n_fft,
        hop_length=c.hop_length,
        win_length=c.win_length,
        window="hann",
        center=True,
        pad_mode="constant",
        power=2.0,
        n_mels=c.n_mels,
        fmin=c.f_min,
        fmax=c.f_max,
        htk=False,
        norm="slaney",
    )
    return np.log(np.maximum(mel, 1e-10)).T  # (T, M)


@pytest.mark.parametrize("signal", ["chirp", "noise", "tones", "short"])
@pytest.mark.parametrize(
    "config",
    [FeatureConfig(), FeatureConfig(n_mels=64, n_fft=512, win_length=400, hop_length=160, f_min=20.0, f_max=7600.0)],
    ids=["default", "n_fft512"],
)
def test_log_mel_matches_librosa(signal, config) -> None:
    y = {
        "chirp": chirp(1.3),
        "noise": noise(0.7),
        "tones": tone(300.0, 1.0, 16000) + tone(2500.0, 1.0, 16000, 0.1) + noise(1.0, seed=1) * 0.01,
        "short": noise(0.035, seed=2),  # 560 samples: 4 frames, mostly padding
    }[signal]
    ours = features(torch.from_numpy(y), config).numpy()  # (T, M)
    theirs = _librosa_log_mel(y, config)
    assert ours.shape == theirs.shape == (config.frames(y.size), config.n_mels)
    within_60_db = theirs >= theirs.max() - 6 * np.log(10)  # 60 dB of power = 6 decades
    assert np.abs(ours - theirs)[within_60_db].max() <= 1e-3


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("seconds", [0.9, 31.0])  # padded to 30 s, and trimmed to it
def test_whisper_features_match_transformers(n_mels, seconds) -> None:
    from transformers import WhisperFeatureExtractor

    y = chirp(seconds) + noise(seconds, seed=3)
    ours = features(torch.from_numpy(y), FeatureConfig.whisper(n_mels)).numpy()  # (T, M)
    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    theirs = extractor(y, sampling_rate=16000, return_tensors="np")["input_features"][0].T  # (T, M)
    assert ours.shape == theirs.shape == (3000, n_mels)
    assert np.abs(ours - theirs).max() <= 1e-5


def test_whisper_features_of_mostly_silent_windows_match_transformers() -> None:
    """Whisper's features compute the STFT only as far as the audio is not zero (the rest of the
    30-s window is exactly silent frames): the same as transformers' whole STFT at every length,
    sound ending on and beside a hop, zeros inside the audio, in a batch of unequal lengths, and
    for digital silence alone."""
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=80)
    gap = np.concatenate([noise(0.2, seed=4), np.zeros(3001, np.float32), noise(0.1, seed=5)])
    waves = [noise(n / 16000, seed=n) for n in (1, 159, 160, 161, 16000, 479_839)] + [gap, np.zeros(800, np.float32)]
    batch, _ = batch_features([torch.from_numpy(w) for w in waves], FeatureConfig.whisper())  # (B, T, M)
    for b, w in enumerate(waves):
        theirs = extractor(w, sampling_rate=16000, return_tensors="np")["input_features"][0].T  # (T, M)
        ours = features(torch.from_numpy(w), FeatureConfig.whisper()).numpy()  # (T, M)
        assert np.abs(ours - theirs).max() <= 1e-5
        assert np.abs(batch[b].numpy() - theirs).max() <= 1e-5


def test_frame_count_and_batch_equals_one_by_one() -> None:
    c = FeatureConfig()
    waves = [noise(n / 16000, seed=n) for n in (1, 159, 160, 161, 4000, 12345)]
    for w in waves:
        assert features(w, c).shape == (1 + w.size // 160, 80)
    feats, valid = batch_features([torch.from_numpy(w) for w in waves], c)
    assert feats.shape == (6, 1 + 12345 // 160, 80)
    assert valid.sum(1).tolist() == [1 + w.size // 160 for w in waves]
    for b, w in enumerate(waves):
        n = int(valid[b].sum())
        torch.testing.assert_close(feats[b, :n], features(w, c), atol=1e-4, rtol=1e-5)
        assert (feats[b, n:] == 0).all()
    normed, _ = batch_features([torch.from_numpy(w) for w in waves[3:]], FeatureConfig(normalize=True))
    torch.testing.assert_close(normed[2], features(waves[5], FeatureConfig(normalize=True)), atol=1e-4, rtol=1e-4)
    whisper, valid = batch_features([waves[0], waves[4]], FeatureConfig.whisper())
    assert whisper.shape == (2, 3000, 80) and bool(valid.all())
    normed = features(waves[4], FeatureConfig(kind="whisper", normalize=True))
    torch.testing.assert_close(normed, cmvn(whisper[1]), atol=1e-4, rtol=1e-4)


def test_the_floor_clamps_only_what_is_below_it() -> None:
    """A higher floor (what TTS targets use) is the default features clamped at ln(floor): nothing
    above it moves; digital silence, which sits at ln 1e-10 by default, rises to it."""
    w = np.concatenate([np.zeros(1601, dtype=np.float32), noise(0.3, seed=7)])  # silence, then sound
    base, floored = features(w, FeatureConfig()), features(w, FeatureConfig(floor=1e-6))
    assert bool((base < np.log(1e-6)).any()) and bool((base > np.log(1e-6)).any())  # both sides exercised
    torch.testing.assert_close(floored, base.clamp(min=float(np.log(1e-6))))
    for bad in (0.0, 1.0, -1e-6, True):
        with pytest.raises(ValueError, match="floor"):
            FeatureConfig(floor=bad)
    with pytest.raises(ValueError, match="whisper features fix their floor"):
        FeatureConfig(kind="whisper", floor=1e-6)


def test_features_refuse_non_mono_or_empty_waveforms() -> None:
    with pytest.raises(ValueError, match=r"mono waveform of shape \(N,\)"):
        features(torch.zeros(2, 100), FeatureConfig())
    with pytest.raises(ValueError, match="no samples"):
        features(torch.zeros(0), FeatureConfig())


@pytest.mark.skipif(not GEORGE.is_file(), reason="FSDD not found under QKV_DATA")
def test_a_real_recording() -> None:
    """0_george_0.wav: 2,384 samples of 8 kHz speech -> 4,768 at 16 kHz -> 30 frames."""
    samples = soundfile.info(str(GEORGE)).frames
    x = load_audio(GEORGE)
    assert x.numel() == 2 * samples
    for config in (FeatureConfig(), FeatureConfig(normalize=True), FeatureConfig.whisper()):
        f = features(x, config)
        assert f.shape == (config.frames(x.numel()), config.n_mels) and bool(torch.isfinite(f).all())
    ours = features(x, FeatureConfig()).numpy()
    assert ours.shape[0] == 1 + 2 * samples // 160
    theirs = _librosa_log_mel(x.numpy(), FeatureConfig())  # real speech agrees with librosa too
    assert np.abs(ours - theirs)[theirs >= theirs.max() - 6 * np.log(10)].max() <= 1e-3


# ---------------------------------------------------------------------------------------------
# CMVN, SpecAugment, padding, settings
# ---------------------------------------------------------------------------------------------


def test_cmvn_normalises_over_valid_frames_and_ignores_padding() -> None:
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(3, 50, 8, generator=g) * 4 + 7
    lengths = torch.tensor([50, 31, 2])
    valid = torch.arange(50)[None, :] < lengths[:, None]  # (B, T)
    out = cmvn(feats, valid)
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(out[b, :n].mean(0), torch.zeros(8), atol=1e-5, rtol=0)
        torch.testing.assert_close(out[b, :n].std(0, unbiased=False), torch.ones(8), atol=1e-3, rtol=0)
        assert (out[b, n:] == 0).all()
    garbage = feats.masked_fill(~valid[..., None], 1e6)
    torch.testing.assert_close(cmvn(garbage, valid), out)
    torch.testing.assert_close(cmvn(feats[1, :31]), out[1, :31])  # (T, M), every frame valid
    assert bool(torch.isfinite(cmvn(torch.ones(5, 3))).all())  # a constant bin gives 0, not NaN


def _masked(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked mel bins and frames of an all-ones input masked with 0: (M,), (T,)."""
    zero = out == 0
    return zero.all(0), zero.all(1)


def _runs(flags: torch.Tensor) -> list[int]:
    """Lengths of the runs of True."""
    runs, n = [], 0
    for f in [*flags.tolist(), False]:
        if f:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_spec_augment_masks_within_bounds() -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        length = int(torch.randint(5, 60, (), generator=g))
        x = torch.ones(60, 40)
        valid = torch.arange(60) < length
        out = spec_augment(x, g, valid=valid, freq_masks=1, freq_width=7, time_masks=1, time_width=10, time_ratio=0.2)
        assert (out[length:] == 1).all()  # padding untouched
        assert ((out == 0) | (out == 1)).all()
        bins, frames = _masked(out[:length])
        assert sum(_runs(bins)) <= 7 and len(_runs(bins)) <= 1
        assert len(_runs(frames)) <= 1 and sum(_runs(frames)) <= min(10, int(0.2 * length))
        # every zero is explained by one frequency mask or one time mask
        assert ((out[:length] == 1) | bins[None, :] | frames[:, None]).all()
    # several masks: at most m·width of each axis masked
    x = torch.ones(4, 200, 80)
    out = spec_augment(x, g, freq_masks=2, freq_width=27, time_masks=2, time_width=100)
    for row in out:
        bins, frames = _masked(row)
        assert int(bins.sum()) <= 54 and int(frames.sum()) <= 200 and len(_runs(bins)) <= 2 and len(_runs(frames)) <= 2


def test_spec_augment_is_reproducible_and_leaves_its_input() -> None:
    x = torch.randn(2, 120, 80, generator=torch.Generator().manual_seed(0))
    before = x.clone()
    valid = torch.arange(120)[None, :] < torch.tensor([[120], [70]])
    a = spec_augment(x, torch.Generator().manual_seed(5), valid=valid, time_warp=10)
    b = spec_augment(x, torch.Generator().manual_seed(5), valid=valid, time_warp=10)
    c = spec_augment(x, torch.Generator().manual_seed(6), valid=valid, time_warp=10)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c)
    torch.testing.assert_close(x, before, rtol=0, atol=0)
    torch.testing.assert_close(a[1, 70:], x[1, 70:], rtol=0, atol=0)


def test_time_warp_stretches_monotonically_and_keeps_the_ends() -> None:
    ramp = torch.arange(80, dtype=torch.float32)[:, None].repeat(1, 3)  # frame t holds t
    g = torch.Generator().manual_seed(2)
    changed = 0
    for _ in range(20):
        out = spec_augment(ramp, g, freq_masks=0, time_masks=0, time_warp=20)
        assert out[0, 0] == 0 and out[-1, 0] == 79
        assert (out[1:, 0] >= out[:-1, 0] - 1e-4).all()
        changed += not torch.equal(out, ramp)
    assert changed > 0
    torch.testing.assert_close(spec_augment(ramp, g, freq_masks=0, time_masks=0), ramp)


def test_pad_features_shapes_and_mask() -> None:
    feats = [torch.full((n, 4), float(n)) for n in (3, 7, 1)]
    padded, valid = pad_features(feats)
    assert padded.shape == (3, 7, 4) and valid.shape == (3, 7) and valid.dtype == torch.bool
    assert valid.sum(1).tolist() == [3, 7, 1]
    for b, f in enumerate(feats):
        torch.testing.assert_close(padded[b, : len(f)], f)
        assert (padded[b, len(f) :] == 0).all()
    assert (pad_features(feats, value=-1.0)[0][2, 1:] == -1).all()
    with pytest.raises(ValueError, match="every feature tensor"):
        pad_features([torch.zeros(3, 4), torch.zeros(3, 5)])


def test_feature_config_round_trips_through_json() -> None:
    for config in (FeatureConfig(), FeatureConfig.whisper(128), FeatureConfig(n_mels=40, f_max=7600.0, normalize=True)):
        data = json.loads(json.dumps(config.to_dict()))
        assert FeatureConfig.from_dict(data) == config
    assert FeatureConfig.from_dict({"n_mels": 64}) == FeatureConfig(n_mels=64)
    with pytest.raises(UserError, match=r"unknown setting.*n_melz"):
        FeatureConfig.from_dict({"n_melz": 64})
    with pytest.raises(UserError, match="feature config: kind must be one of logmel, whisper"):
        FeatureConfig.from_dict({"kind": "mfcc"})
    with pytest.raises(UserError, match="hop_length must be a positive integer"):
        FeatureConfig.from_dict({"hop_length": 0})
    with pytest.raises(UserError, match="win_length 512 is longer than n_fft 400"):
        FeatureConfig.from_dict({"win_length": 512})
    with pytest.raises(ValueError, match="f_max"):
        FeatureConfig(f_max=9000.0)
