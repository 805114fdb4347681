"""The vocoder: mel -> linear by pseudo-inverse, fast Griffin-Lim against librosa (the same
waveform from the same zero phase; spectral convergence against ``mel_to_audio``), the round
trip through the features, determinism, the refusals, and WAV files (rates, peak, atomicity).

Everything is small (1 s at 16 kHz, one thread), so the file runs in a few seconds."""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import pytest
import soundfile
import torch

from qkv import files
from qkv.audio import FeatureConfig, features, mel_filterbank
from qkv.errors import UserError
from qkv.vocoder import GriffinLim, Vocoder, griffin_lim, mel_to_linear, write_wav

CONFIG = FeatureConfig()  # 16 kHz, n_fft 400, win 400, hop 160, 80 mels
RATE = CONFIG.sample_rate
STFT = dict(n_fft=CONFIG.n_fft, hop_length=CONFIG.hop_length, win_length=CONFIG.win_length)
DB = 10 / np.log(10)  # dB per nat of power


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def glide(seconds: float = 1.0, rate: int = RATE) -> np.ndarray:
    """Five harmonics of a pitch gliding from 150 to 250 Hz, amplitude 0.5/k: (N,) float32."""
    t = np.arange(round(seconds * rate)) / rate
    phase = 2 * np.pi * np.cumsum(150 + 100 * t / seconds) / rate
    return sum((0.5 / k) * np.sin(k * phase) for k in range(1, 6)).astype(np.float32)


def magnitude(y: np.ndarray) -> np.ndarray:
    """|STFT| of audio.py's analysis, by librosa: (E, T)."""
    librosa = pytest.importorskip("librosa")
    return np.abs(librosa.stft(y, center=True, pad_mode="constant", window="hann", **STFT))


def spectral_convergence(target: np.ndarray, y: np.ndarray) -> float:
    """SC = ||S − |STFT(y)| ||_F / ||S||_F over the frames both have (Sturmel & Daudet, 2011)."""
    rebuilt = magnitude(y)
    frames = min(target.shape[1], rebuilt.shape[1])
    return float(np.linalg.norm(target[:, :frames] - rebuilt[:, :frames]) / np.linalg.norm(target[:, :frames]))


# ---------------------------------------------------------------------------------------------
# Mel -> linear
# ---------------------------------------------------------------------------------------------


def test_mel_to_linear_of_a_smooth_spectrogram_gives_back_its_mel() -> None:
    fb = mel_filterbank(CONFIG.n_mels, CONFIG.n_fft, RATE).double()  # (E, M)
    g = torch.Generator().manual_seed(0)
    hz = torch.linspace(0, RATE / 2, CONFIG.n_freqs, dtype=torch.float64)  # (E,)
    shift = 6 * torch.rand(12, 1, generator=g, dtype=torch.float64)  # (T, 1)
    power = (1 + 0.5 * torch.sin(hz / 700 + shift)) / (1 + (hz / 400) ** 2)  # (T, E): a known linear power
    mel = power @ fb  # (T, M)
    linear = mel_to_linear(mel.log().float(), CONFIG)  # (T, E)
    assert linear.shape == (12, CONFIG.n_freqs) and linear.dtype == torch.float32
    linear = linear.double()
    assert (linear >= 0).all()
    np.testing.assert_allclose((linear.square() @ fb).numpy(), mel.numpy(), rtol=1e-4)


def test_mel_to_linear_of_speechlike_frames_is_close_where_loud_and_never_negative() -> None:
    """A real STFT: the pseudo-inverse goes negative where the mel is ~100 dB below the peak and
    is clamped there, so only the loud bins come back exactly."""
    fb = mel_filterbank(CONFIG.n_mels, CONFIG.n_fft, RATE).double()  # (E, M)
    log_mel = features(glide(0.3), CONFIG).double()  # (T, M)
    linear = mel_to_linear(log_mel[None].float(), CONFIG)  # (1, T, E): a batch dimension passes through
    assert linear.shape == (1, log_mel.shape[0], CONFIG.n_freqs)
    assert (linear >= 0).all()
    error = ((linear[0].double().square() @ fb).clamp(min=1e-10).log() - log_mel).abs()  # (T, M) nats
    peak = log_mel.max(1, keepdim=True).values  # (T, 1)
    within_10_db = log_mel > peak - 10 / DB
    within_30_db = log_mel > peak - 30 / DB
    assert error[within_10_db].max() < 1e-3  # measured 4e-7
    assert error[within_30_db].mean() < 0.02  # measured 0.0067 nats (0.03 dB)


def test_mel_to_linear_refuses_the_wrong_number_of_mel_bins() -> None:
    with pytest.raises(UserError, match="expects 80 mel bins"):
        mel_to_linear(torch.zeros(5, 64), CONFIG)


# ---------------------------------------------------------------------------------------------
# Griffin-Lim
# ---------------------------------------------------------------------------------------------


def test_griffin_lim_from_zero_phase_is_librosas() -> None:
    """Same start (zero phase), same 32 momentum steps: the same waveform, to float32 rounding."""
    librosa = pytest.importorskip("librosa")
    target = magnitude(glide(0.5))  # (E, T)
    theirs = librosa.griffinlim(target, n_iter=32, momentum=0.99, init=None, center=True, pad_mode="constant", **STFT)
    ours = griffin_lim(torch.from_numpy(target.T.copy()), CONFIG, iterations=32, momentum=0.99, generator=None)
    assert ours.shape == theirs.shape == ((target.shape[1] - 1) * CONFIG.hop_length,)
    assert ours.dtype == torch.float32
    np.testing.assert_allclose(ours.numpy(), theirs, atol=1e-2)  # measured 1.4e-3 at peak 1.1
    assert spectral_convergence(target, ours.numpy()) == pytest.approx(spectral_convergence(target, theirs), rel=1e-3)


def test_griffin_lim_vocoder_against_librosa_mel_to_audio(monkeypatch) -> None:
    """Our vocoder (pseudo-inverse + clamp, seeded random phase) against librosa's mel_to_audio
    (NNLS, random phase, seeded here), both on the log-mel of a 1 s harmonic glide, scored by
    spectral convergence against the signal's true STFT magnitude. Measured: ours 0.068,
    librosa 0.081 (seeds 0-3: ours 0.068-0.073, librosa 0.077-0.089)."""
    librosa = pytest.importorskip("librosa")
    import librosa.feature.inverse as inverse

    # mel_to_audio draws its initial phase from an unseeded generator; seed it for a steady test
    monkeypatch.setattr(inverse, "griffinlim", functools.partial(librosa.griffinlim, random_state=0))
    y = glide(1.0)
    log_mel = features(y, CONFIG)  # (T, M)
    theirs = librosa.feature.inverse.mel_to_audio(
        np.exp(log_mel.numpy()).T,  # (M, T) mel power
        sr=RATE,
        n_iter=32,
        power=2.0,
        htk=False,
        norm="slaney",
        fmin=CONFIG.f_min,
        fmax=CONFIG.f_max,
        window="hann",
        center=True,
        pad_mode="constant",
        **STFT,
    )
    vocoder = GriffinLim(CONFIG)
    ours = vocoder(log_mel)
    assert isinstance(vocoder, Vocoder) and vocoder.sample_rate == RATE
    assert ours.shape == (y.size,) == theirs.shape
    target = magnitude(y)
    sc_ours, sc_theirs = spectral_convergence(target, ours.numpy()), spectral_convergence(target, theirs)
    assert sc_ours <= 1.1 * sc_theirs, (sc_ours, sc_theirs)
    assert sc_ours < 0.1


def test_round_trip_through_the_features() -> None:
    """features -> GriffinLim -> features: the loud bins come back within a fraction of a dB."""
    log_mel = features(glide(0.5), CONFIG)  # (T, M)
    again = features(GriffinLim(CONFIG)(log_mel), CONFIG)  # (T, M)
    assert again.shape == log_mel.shape
    loud = log_mel > log_mel.max() - 40 / DB  # within 40 dB of the utterance's peak
    error = (again - log_mel).abs()[loud]
    assert error.mean() < 0.35  # measured 0.24 nats (1.1 dB); 4.0 at worst, in single bins


def test_same_seed_same_samples_and_batches_are_rows() -> None:
    log_mel = features(glide(0.2), CONFIG)  # (T, M)
    a, b = GriffinLim(CONFIG, seed=3), GriffinLim(CONFIG, seed=3)
    first = a(log_mel)
    assert torch.equal(first, a(log_mel)) and torch.equal(first, b(log_mel))
    assert first.shape == ((log_mel.shape[0] - 1) * CONFIG.hop_length,)
    assert not torch.equal(first, GriffinLim(CONFIG, seed=4)(log_mel))
    batch = GriffinLim(CONFIG, iterations=4)(torch.stack([log_mel, log_mel - 2.0]))  # (2, N)
    assert batch.shape == (2, first.numel()) and batch.dtype == torch.float32
    assert torch.isfinite(batch).all()


def test_griffin_lim_length_and_original_algorithm() -> None:
    target = torch.from_numpy(magnitude(glide(0.2)).T.copy())  # (T, E)
    g = torch.Generator().manual_seed(0)
    natural = griffin_lim(target, CONFIG, iterations=2, generator=g)
    assert natural.shape == ((target.shape[0] - 1) * CONFIG.hop_length,)
    for length in (3000, 3300):  # cut, or padded with zeros
        g = torch.Generator().manual_seed(0)
        longer_or_shorter = griffin_lim(target, CONFIG, iterations=2, generator=g, length=length)
        assert longer_or_shorter.shape == (length,)
        shared = min(length, natural.numel())
        torch.testing.assert_close(longer_or_shorter[:shared], natural[:shared])
    plain = griffin_lim(target, CONFIG, iterations=8, momentum=0.0)  # Griffin & Lim (1984)
    fast = griffin_lim(target, CONFIG, iterations=8, momentum=0.99)
    assert spectral_convergence(target.T.numpy(), fast.numpy()) < spectral_convergence(target.T.numpy(), plain.numpy())


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (FeatureConfig(normalize=True), "un-normalised log-mels"),
        (FeatureConfig.whisper(), "not 'whisper'"),
    ],
)
def test_vocoder_refuses_features_it_cannot_invert(config, message) -> None:
    with pytest.raises(UserError, match=message) as caught:
        GriffinLim(config)
    assert "\n" not in str(caught.value)


def test_vocoder_refuses_bad_frames_and_settings() -> None:
    vocoder = GriffinLim(CONFIG, iterations=1)
    for frames, message in [
        (torch.zeros(1, 80), "at least 2 frames"),
        (torch.zeros(80), r"\(T, M\) or \(B, T, M\)"),
        (torch.full((4, 80), float("nan")), "non-finite"),
        (torch.zeros(4, 40), "expects 80 mel bins"),
    ]:
        with pytest.raises(UserError, match=message):
            vocoder(frames)
    with pytest.raises(UserError, match="momentum"):
        GriffinLim(CONFIG, momentum=-0.5)
    with pytest.raises(UserError, match="iterations"):
        GriffinLim(CONFIG, iterations=2.5)


# ---------------------------------------------------------------------------------------------
# WAV files
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [16_000, 22_050])
def test_write_wav_at_16_and_22_khz(tmp_path, rate) -> None:
    y = 0.5 * glide(0.25)  # peak ~0.5: kept as it is, never scaled up
    path = write_wav(tmp_path / "out" / f"{rate}.wav", torch.from_numpy(y), RATE, rate=rate)
    data, read_rate = soundfile.read(str(path), dtype="float32")
    info = soundfile.info(str(path))
    assert read_rate == rate and info.subtype == "PCM_16" and info.channels == 1
    assert data.shape == (math.floor(y.size * rate / RATE + 0.5),)  # 4000 -> 5513 at 22.05 kHz
    assert abs(np.abs(data).max() - np.abs(y).max()) < 0.02
    if rate == RATE:
        np.testing.assert_allclose(data, y, atol=1 / 32767)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary file left


def test_write_wav_scales_a_loud_waveform_down_and_never_clips(tmp_path) -> None:
    y = 3.0 * glide(0.1)
    path = write_wav(tmp_path / "loud.wav", y, RATE)
    data, _ = soundfile.read(str(path), dtype="int16")
    assert np.abs(data.astype(np.int32)).max() == 32767  # peak at full scale, not past it
    np.testing.assert_allclose(data / 32767, y / np.abs(y).max(), atol=1 / 32767)  # the shape kept


def test_write_wav_is_atomic(tmp_path, monkeypatch) -> None:
    path = tmp_path / "speech.wav"
    path.write_bytes(b"previous")

    def fail(src, dst):
        raise OSError(5, "Input/output error")  # the rename fails after the temporary file is written

    monkeypatch.setattr(files.os, "replace", fail)
    with pytest.raises(OSError):
        write_wav(path, glide(0.1), RATE)
    assert path.read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["speech.wav"]


@pytest.mark.parametrize(
    ("waveform", "rate", "message"),
    [
        (np.zeros(0, dtype=np.float32), None, "no samples"),
        (np.array([0.1, np.nan], dtype=np.float32), None, "non-finite"),
        (np.array([0.1, np.inf], dtype=np.float32), None, "non-finite"),
        (np.zeros((2, 10), dtype=np.float32), None, r"shape \(N,\)"),
        (np.zeros(10, dtype=np.float32), 44_100, "16000 or 22050 Hz"),
        (np.array(["a", "b"]), None, "real numbers"),
    ],
)
def test_write_wav_refuses_bad_input_on_one_line(tmp_path, waveform, rate, message) -> None:
    path = tmp_path / "bad.wav"
    with pytest.raises(UserError, match=message) as caught:
        write_wav(path, waveform, RATE, rate=rate)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)
    assert not path.exists()


def test_write_wav_needs_a_wav_rate_when_the_model_has_another(tmp_path) -> None:
    with pytest.raises(UserError, match="not 24000"):
        write_wav(tmp_path / "x.wav", np.zeros(10, dtype=np.float32), 24_000)
    path = write_wav(tmp_path / "x.wav", 0.1 * np.ones(2400, dtype=np.float32), 24_000, rate=16_000)
    assert soundfile.info(str(path)).frames == 1600
