"""bench/joined_speech.py's truth: which frames of Piper's phoneme ids are each word's (on ids and
durations made here), and, with the real voice (slow; skipped when it is absent), that the
words it times are where the speech is."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
ID_MAP = {"^": (1,), "_": (0,), "$": (2,), "a": (3,), "b": (4,), " ": (5,), "c": (6,), ",": (7,), "d": (8,), ".": (9,)}


@pytest.fixture(scope="module")
def bench():
    """bench/joined_speech.py as a module."""
    sys.path.insert(0, str(ROOT / "bench"))
    return importlib.import_module("joined_speech")  # registered: its dataclasses need their module


def test_words_run_from_their_first_phoneme_to_the_pad_after_their_last(bench) -> None:
    phonemes = ["a", "b", " ", "c", ",", " ", "x", "d", "."]  # "x" is not in the map: Piper skips it
    # ids: ^ _ | a _ b _ | ' ' _ | c _ | , _ | ' ' _ | d _ | . _ | $  (19 ids)
    durations = [2, 1, 3, 1, 4, 1, 5, 2, 6, 1, 7, 3, 2, 1, 8, 1, 9, 2, 3]
    before = np.concatenate([[0], np.cumsum(durations)])  # frames before id k
    spans = bench.word_frames(phonemes, durations, ID_MAP)
    assert spans == [(before[2], before[6]), (before[8], before[10]), (before[14], before[16])]
    with pytest.raises(ValueError):
        bench.word_frames(phonemes, durations[:-1], ID_MAP)


def test_a_caption_is_timed_only_when_its_phoneme_words_are_its_words(bench) -> None:
    sentence = (("a", " ", "c", "."), (2, 1, 3, 1, 4, 1, 5, 2, 6, 1, 3))
    clip = bench.Clip("Ab, cd.", np.zeros(10, np.int16), (sentence,), 0.5)
    words = bench.clip_words(clip, ID_MAP)
    assert [(w.text, w.start, w.end) for w in words] == [("Ab,", 1.5, 3.5), ("cd.", 6.0, 9.5)]
    assert bench.clip_words(bench.Clip("Ab cd ef.", clip.samples, (sentence,), 0.5), ID_MAP) == ()
    assert bench.text_words("A man - in 3 hats .") == ["A", "man", "in", "3", "hats"]


@pytest.mark.slow
def test_the_real_voice_times_words_where_its_speech_is(bench) -> None:
    pytest.importorskip("piper", reason="pip install piper-tts (Piper's phonemes)")
    if not bench.VOICE.is_file():
        pytest.skip(f"no {bench.VOICE}: see bench/joined_speech.py's docstring for how to fetch the joe voice")
    speaker = bench.Speaker(bench.VOICE)
    for k, caption in enumerate(["A guy works on a building.", "A dog runs. Two men watch it."]):
        clip = speaker.speak(caption, seed=k)
        words = bench.clip_words(clip, bench.read_id_map(bench.VOICE))
        assert [w.text for w in words] == caption.split()
        starts = [w.start for w in words]
        assert starts == sorted(starts) and all(w.end > w.start for w in words)
        wave = clip.samples.astype(np.float64) / 32767
        rate = bench.RATE
        assert words[-1].end <= len(wave) / rate + 1e-9
        inside = np.concatenate([wave[round(w.start * rate) : round(w.end * rate)] for w in words])
        before = wave[: round(words[0].start * rate)]  # the voice's lead-in: no word yet
        assert np.sqrt(np.mean(inside**2)) > 4 * np.sqrt(np.mean(before**2))
