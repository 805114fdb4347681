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


def test_distinct_repeats_the_orders_first_captions_after_new_silences(bench, tmp_path, monkeypatch) -> None:
    """``distinct=N``: the file is the seed's order cut to its first N captions, again and again,
    each pass after new silences; the stretch before the first repeat is the file without it.
    Captions ready in the cache (one word each, its own length), so nothing is spoken."""
    pytest.importorskip("piper", reason="pip install piper-tts (its version keys the cache)")
    import json

    voice = tmp_path / "voice.onnx"
    voice.write_bytes(b"not a model: never loaded, every caption is cached")
    voice.with_name("voice.onnx.json").write_text(json.dumps({"phoneme_id_map": ID_MAP}))
    (tmp_path / "multi30k").mkdir()
    texts = [f"word{k}" for k in range(7)]
    (tmp_path / "multi30k" / bench.CAPTIONS).write_text("\n".join(texts) + "\n")
    monkeypatch.setenv("QKV_CACHE", str(tmp_path / "cache"))
    folder = bench.cache_folder(voice)
    for k, text in enumerate(texts):
        sentence = (("a",), (1, 1, 2 + k, 1, 1))  # ^ _ a _ $: one word
        bench.save_clip(folder, k, bench.Clip(text, np.full(1600 * (k + 1), k, np.int16), (sentence,), 0.01))

    def said(distinct: int | None) -> list[tuple[str, int]]:
        found = bench.pieces(0.4, 3, voice, tmp_path / "multi30k", distinct=distinct)
        return [(p.words[0].text, p.gap) for p in found]

    whole, three = said(None), said(3)
    first = [text for text, _ in three[:3]]
    assert len(set(first)) == 3 and [text for text, _ in three] == first * (len(three) // 3) + first[: len(three) % 3]
    assert three[:3] == whole[:3] and sorted(text for text, _ in whole[:7]) == texts  # without: all 7 first
    passes = [[gap for _, gap in three[i : i + 3]] for i in range(0, len(three) - 2, 3)]
    assert len(passes) > 2 and len({tuple(p) for p in passes}) == len(passes)  # new silences each pass


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
