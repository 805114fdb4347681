"""Audio read a block at a time (``qkv.audio_stream``): a file's samples as ``load_audio``
reads them, and Whisper's log-mel a window at a time equal, bit for bit, to the whole file's
(``audio.whisper_log_mel``), across chunk and block boundaries, at the file's ends and after a
window that goes back. A 2.5-second chunk keeps the STFTs small; the 10-second file spans
several of ``audio.BLOCK_FRAMES``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from qkv.audio import BLOCK_FRAMES, FeatureConfig, load_audio, whisper_log_mel
from qkv.audio_stream import AudioSource, WhisperFrames
from qkv.errors import UserError

RATE = 16000
CHUNK = FeatureConfig(kind="whisper", n_mels=23, n_fft=400, win_length=400, hop_length=160, chunk_seconds=2.5)


def speechlike(seconds: float, seed: int, rate: int = RATE) -> np.ndarray:
    g = np.random.default_rng(seed)
    n = int(seconds * rate)
    t = np.arange(n) / rate
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 0.7 * t)  # louder and softer, so the maximum is somewhere
    return (envelope * (0.3 * np.sin(2 * np.pi * 300 * t) + g.normal(0, 0.05, n))).astype(np.float32)


@pytest.fixture(scope="module")
def ten_seconds(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stream") / "ten.wav"
    soundfile.write(path, speechlike(10.013, 0), RATE, subtype="FLOAT")  # not a whole number of frames
    return path


def test_a_source_reads_the_samples_load_audio_reads(ten_seconds: Path) -> None:
    source = AudioSource.of_file(ten_seconds, RATE)
    wave = load_audio(ten_seconds, sample_rate=RATE, max_seconds=None)
    assert wave.numel() > 2 * BLOCK_FRAMES and max(len(b) for b in source.blocks()) <= BLOCK_FRAMES
    assert torch.equal(source.whole(), wave) and source.samples == wave.numel()
    assert torch.equal(source.head(1000), wave[:1000]) and source.seconds == pytest.approx(10.013)
    with pytest.raises(UserError, match="over the limit of 5 s"):
        AudioSource.of_file(ten_seconds, RATE, max_seconds=5)


def test_a_resampled_source_is_close_to_load_audio(tmp_path: Path) -> None:
    """soxr's streaming resampler, block by block, beside its one-shot resampling of the whole file."""
    path = tmp_path / "fast.wav"
    soundfile.write(path, speechlike(6.0, 1, rate=22050), 22050, subtype="FLOAT")
    streamed = AudioSource.of_file(path, RATE).whole()
    whole = load_audio(path, sample_rate=RATE, max_seconds=None)
    assert abs(streamed.numel() - whole.numel()) <= 1
    n = min(streamed.numel(), whole.numel())
    assert torch.allclose(streamed[:n], whole[:n], atol=1e-4)


@pytest.mark.parametrize("pad_seconds", [1.0, 0.0])
def test_windows_equal_the_whole_files_log_mel(ten_seconds: Path, pad_seconds: float) -> None:
    wave = load_audio(ten_seconds, sample_rate=RATE, max_seconds=None)
    whole = whisper_log_mel(wave, CHUNK, pad_seconds=pad_seconds)  # (T, M)
    frames = WhisperFrames(AudioSource.of_file(ten_seconds, RATE), CHUNK, pad_seconds=pad_seconds)
    assert frames.frames == whole.shape[0] and torch.equal((frames.peak + 4.0) / 4.0, whole.max())
    t = whole.shape[0]
    for first, count in [(0, 250), (37, 250), (237, 263), (700, 250), (400, 7), (t - 250, 250), (t - 1, 1)]:
        assert torch.equal(frames.window(first, count), whole[first : first + count]), (first, count)
    in_memory = WhisperFrames(AudioSource.of_wave(wave, RATE), CHUNK, pad_seconds=pad_seconds)
    assert torch.equal(in_memory.window(590, 250), whole[590:840])
    with pytest.raises(ValueError, match="not within"):
        frames.window(t - 5, 10)
