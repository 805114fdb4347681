"""Voice activity (``qkv.vad``) and long audio for speech models of qkv's own.

Tone bursts with silences at known times: the pure steps on level sequences made here, the
pieces of a waveform and of the same file read a block at a time, and a tiny random speech
model transcribing a long input piece by piece (each piece's text is what the model hears in
that piece alone, its times where the piece is).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

import qkv
from qkv import bundle as bundles
from qkv.audio import FeatureConfig
from qkv.audio_stream import AudioSource
from qkv.checkpoint import save_model
from qkv.cli.main import main
from qkv.errors import OptionError
from qkv.models.speech import SpeechConfig, SpeechEncoderDecoder
from qkv.tokenization import FILE, Tokenizer
from qkv.vad import (
    Vad,
    bridge_and_drop,
    frame_levels,
    hysteresis,
    piece_waves,
    runs,
    speech_pieces,
    split_long,
    widen,
)

RATE = 16000


def bursts(spans: list[tuple[float, float]], seconds: float, *, level: float = 0.3, seed: int = 0) -> np.ndarray:
    """``seconds`` of faint noise (−80 dBFS) with a 440 Hz tone over each (start, end) span."""
    g = np.random.default_rng(seed)
    wave = g.normal(0, 1e-4, int(seconds * RATE))
    for start, end in spans:
        t = np.arange(int(start * RATE), int(end * RATE))
        wave[t] += level * np.sin(2 * np.pi * 440 * t / RATE)
    return wave.astype(np.float32)


def test_frame_levels_are_decibels_of_mean_power() -> None:
    wave = np.concatenate([np.full(160, 0.1), np.zeros(160), np.full(100, 1.0)])  # the last frame is not whole
    assert np.allclose(frame_levels(wave, 160), [-20.0, -100.0])


def test_hysteresis_starts_above_on_and_lasts_above_off() -> None:
    levels = np.array([-60, -38, -30, -38, -42, -50, -38, -20, -60], dtype=float)
    assert hysteresis(levels, on=-35, off=-45).tolist() == [0, 0, 1, 1, 1, 0, 0, 1, 0]
    assert runs(hysteresis(levels, on=-35, off=-45)) == [(2, 5), (7, 8)]


def test_short_silences_are_bridged_and_short_speech_dropped() -> None:
    stretches = [(10, 50), (55, 90), (200, 203), (300, 340)]
    assert bridge_and_drop(stretches, min_gap=10, min_length=5) == [(10, 90), (300, 340)]
    assert bridge_and_drop(stretches, min_gap=5, min_length=0) == stretches  # a gap of 5 is not under 5


def test_widening_stops_at_the_ends_and_midway_to_a_neighbour() -> None:
    assert widen([(3, 10), (14, 20), (60, 98)], pad=5, frames=100) == [(0, 12), (12, 25), (55, 100)]


def test_long_speech_is_cut_at_its_quietest_frame() -> None:
    levels = np.full(250, -10.0)
    levels[[70, 160]] = -30.0  # two dips
    assert split_long([(0, 250)], levels, longest=100) == [(0, 70), (70, 160), (160, 250)]
    assert all(e - s <= 100 for s, e in split_long([(0, 250)], np.full(250, -10.0), longest=100))


def test_pieces_of_tone_bursts_at_known_times(tmp_path: Path) -> None:
    """Three bursts and a click: a piece a burst (the 0.1 s gap bridged), at the bursts' times
    widened by the pad; the click (20 ms) dropped; the file read in blocks gives the same."""
    spans = [(0.5, 1.2), (1.3, 1.6), (2.5, 3.1), (4.0, 4.02)]
    wave = bursts(spans, 5.0)
    pieces = speech_pieces(AudioSource.of_wave(wave, RATE), Vad(pad=0.1))
    assert [t / RATE for piece in pieces for t in piece] == pytest.approx([0.4, 1.7, 2.4, 3.2], abs=0.011)
    path = tmp_path / "bursts.wav"
    soundfile.write(path, wave, RATE, subtype="FLOAT")
    assert speech_pieces(AudioSource.of_file(path, RATE), Vad(pad=0.1)) == pieces
    quiet = bursts([(1.0, 2.0)], 3.0, level=0.3) + bursts([(0.2, 0.5)], 3.0, level=0.003, seed=1)  # 40 dB down
    found = speech_pieces(AudioSource.of_wave(quiet, RATE), Vad(pad=0))
    assert [t / RATE for piece in found for t in piece] == pytest.approx([1.0, 2.0], abs=0.011)
    assert speech_pieces(AudioSource.of_wave(np.zeros(RATE, dtype=np.float32), RATE)) == []


def test_piece_waves_are_the_pieces_samples(tmp_path: Path) -> None:
    """Each piece's samples are the source's [start, end), wherever the blocks the source is
    read in begin and end: pieces within a block, across blocks, and past several blocks."""
    from qkv.audio import BLOCK_FRAMES

    g = np.random.default_rng(2)
    wave = g.normal(0, 0.1, 3 * BLOCK_FRAMES + 123).astype(np.float32)
    pieces = [(5, 90), (BLOCK_FRAMES - 10, BLOCK_FRAMES + 10), (2 * BLOCK_FRAMES + 7, 3 * BLOCK_FRAMES + 100)]
    path = tmp_path / "noise.wav"
    soundfile.write(path, wave, RATE, subtype="FLOAT")
    for source in (AudioSource.of_wave(wave, RATE), AudioSource.of_file(path, RATE)):
        got = list(piece_waves(source, pieces))
        assert [(s, e) for s, e, _ in got] == pieces
        assert all(np.array_equal(w.numpy(), wave[s:e]) for s, e, w in got)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="off_db <= on_db"):
        Vad(on_db=-50, off_db=-40)
    with pytest.raises(ValueError, match="min_silence"):
        Vad(min_silence=-1)


FSDD = Path(os.environ.get("QKV_DATA", "/work/shared/data")) / "fsdd" / "recordings"


def test_silero_finds_the_spoken_digits_and_leaves_threads_alone() -> None:
    """Three FSDD digits, 8 kHz resampled, with 1 s silences between: a piece on each, within the
    pad and two of its 32 ms steps of where it was put; torch's threads as they were (the
    package's import sets them to 1); tone bursts, which the energy detector finds, are no
    speech to Silero."""
    pytest.importorskip("silero_vad", reason="pip install silero-vad")
    if not FSDD.is_dir():
        pytest.skip(f"no FSDD recordings in {FSDD}")
    from qkv.audio import load_audio

    clips = [load_audio(FSDD / f"{d}_jackson_0.wav").numpy() for d in (3, 7, 9)]
    parts, spans, at = [np.zeros(RATE, dtype=np.float32)], [], RATE
    for clip in clips:
        parts += [clip, np.zeros(RATE, dtype=np.float32)]
        spans.append((at / RATE, (at + len(clip)) / RATE))
        at += len(clip) + RATE
    threads = torch.get_num_threads()
    vad = Vad(detector="silero", pad=0.03)
    pieces = speech_pieces(AudioSource.of_wave(np.concatenate(parts), RATE), vad)
    assert torch.get_num_threads() == threads
    assert len(pieces) == len(spans)
    for (s, e), (start, end) in zip(pieces, spans, strict=True):
        assert start - 0.1 <= s / RATE < e / RATE <= end + 0.1, (s / RATE, e / RATE, start, end)
    tones = bursts([(0.5, 1.2), (2.5, 3.1)], 4.0)  # speech to the energy detector, not to Silero
    assert (
        speech_pieces(AudioSource.of_wave(tones, RATE), vad) == []
        and len(speech_pieces(AudioSource.of_wave(tones, RATE))) == 2
    )


@pytest.fixture(scope="module")
def asr_dir(tmp_path_factory) -> Path:
    """A tiny random speech model of qkv's own with a character tokenizer."""
    root = tmp_path_factory.mktemp("vad")
    tokenizer = Tokenizer.train_char_level(["do re mi fa so la ti"])
    tokenizer.save(root / FILE)
    ids = {"pad_id": tokenizer.pad_id, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
    torch.manual_seed(0)
    config = SpeechConfig(
        vocab_size=tokenizer.vocab_size, n_encoder_layers=1, n_decoder_layers=1, max_len=7, d_model=15,
        n_heads=3, d_ff=7, dropout=0.0, features=FeatureConfig(n_mels=13), **ids,
    )  # fmt: skip
    return save_model(SpeechEncoderDecoder(config), root / "asr", files={FILE: root / FILE})


def test_long_input_is_transcribed_piece_by_piece(asr_dir: Path, tmp_path: Path, capsys) -> None:
    m = qkv.load(asr_dir)
    wave = bursts([(0.3, 0.8), (1.6, 2.0), (2.9, 3.3)], 3.6, seed=2)
    vad = Vad(max_seconds=1.0, pad=0.05)
    (found,) = bundles.transcriptions(m, [wave], bundles.TranscriptionOptions(beam_size=1, vad=vad))
    pieces = speech_pieces(AudioSource.of_wave(wave, RATE), vad)
    assert len(pieces) == 3
    alone = [m.transcribe(wave[s:e], beam_size=1) for s, e in pieces]
    heard = [(s, e, text) for (s, e), text in zip(pieces, alone, strict=True) if text]
    assert [(seg.start, seg.end, seg.text) for seg in found.segments] == [(s / RATE, e / RATE, t) for s, e, t in heard]
    assert found.text == " ".join(t for _, _, t in heard)
    (short,) = bundles.transcriptions(
        m, [wave], bundles.TranscriptionOptions(beam_size=1)
    )  # under the default 30 s: one piece, as before
    assert len(short.segments) == 1 and short.segments[0].end == pytest.approx(3.6)
    with pytest.raises(OptionError, match="voice activity"):
        bundles.transcriptions(m, [wave], bundles.TranscriptionOptions(require=["do"], vad=vad))
    path = tmp_path / "long.wav"
    soundfile.write(path, wave, RATE, subtype="FLOAT")
    before = torch.get_num_threads()
    try:
        code = main(["transcribe", "--model", str(asr_dir), str(path), "--quiet", "--beam", "1", "--threads", "1"])
        assert code == 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert capsys.readouterr().out.startswith(f"{path}\t")


@pytest.mark.parametrize("command", ["transcribe", "speak", "translate"])
def test_threads_is_in_the_help(command: str, capsys) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    assert "--threads" in text and f"qkv {command} " in text and "--threads 2" in text
