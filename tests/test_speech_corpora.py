"""Speech corpora: FSDD's standard split, digit strings (content, determinism, a build killed
midway) and espeak-ng captions (determinism, held-out variants, German with English targets, a
missing tool). Built corpora are tiny and come from small stand-ins for FSDD and Multi30k."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile

from qkv.errors import UserError
from qkv.speech_corpora import (
    DIGIT_WORDS,
    SAMPLE_RATE,
    STALL_ENV,
    TEST_VARIANTS,
    TRAIN_VARIANTS,
    Corpus,
    espeak_corpus,
    fsdd_digit_strings,
    fsdd_digits,
    read_manifest,
)

DATA = Path(os.environ.get("QKV_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data")
SPEAKERS = ("ann", "bob", "cy")
TONE = 300.0  # digit d is a tone of TONE + 100 d Hz in the stand-in FSDD
HAS_ESPEAK = shutil.which("espeak-ng") is not None and shutil.which("sox") is not None
needs_espeak = pytest.mark.skipif(not HAS_ESPEAK, reason="espeak-ng and sox are not installed")


@pytest.fixture(scope="module")
def fake_fsdd(tmp_path_factory) -> Path:
    """FSDD's layout, 3 speakers x 10 digits x 3 recordings at 8 kHz; each digit a tone of its own."""
    folder = tmp_path_factory.mktemp("fsdd")
    (folder / "recordings").mkdir()
    for s, speaker in enumerate(SPEAKERS):
        for digit in range(10):
            for index in range(3):
                seconds = 0.15 + 0.05 * index + 0.01 * s
                t = np.arange(round(seconds * 8000)) / 8000
                wave = 0.5 * np.sin(2 * np.pi * (TONE + 100 * digit) * t)
                soundfile.write(folder / "recordings" / f"{digit}_{speaker}_{index}.wav", wave, 8000, subtype="PCM_16")
    return folder


def heard_digits(path: Path) -> list[int]:
    """The digits in a digit string of the stand-in FSDD: loud stretches of 10 ms frames, each
    named by its strongest frequency."""
    audio, rate = soundfile.read(path)
    assert rate == SAMPLE_RATE
    frames = audio[: len(audio) // 160 * 160].reshape(-1, 160)
    loud = np.sqrt(np.mean(frames**2, axis=1)) > 0.1
    digits, start = [], None
    for i, flag in enumerate([*loud, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            segment = frames[start + 1 : i - 1].ravel()  # without the edges
            spectrum = np.abs(np.fft.rfft(segment))
            frequency = np.argmax(spectrum) * rate / len(segment)
            digits.append(round((frequency - TONE) / 100))
            start = None
    return digits


def files_of(corpus: Corpus) -> dict[str, bytes]:
    return {
        p.relative_to(corpus.root).as_posix(): p.read_bytes() for p in sorted(corpus.root.rglob("*")) if p.is_file()
    }


def same_bytes(a: Corpus, b: Corpus) -> None:
    fa, fb = files_of(a), files_of(b)
    assert sorted(fa) == sorted(fb)
    assert [name for name in fa if fa[name] != fb[name]] == []


# ---------------------------------------------------------------------------------------------
# FSDD
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not (DATA / "fsdd" / "recordings").is_dir(), reason="FSDD is not in the data folder")
def test_fsdd_standard_split() -> None:
    corpus = fsdd_digits(DATA / "fsdd")
    assert (len(corpus["train"]), len(corpus["test"])) == (2700, 300)
    test_indices = {int(u.path.stem.split("_")[2]) for u in corpus["test"]}
    assert test_indices == set(range(5))
    assert min(int(u.path.stem.split("_")[2]) for u in corpus["train"]) == 5
    assert {u.speaker for u in corpus["test"]} == {u.speaker for u in corpus["train"]}
    for u in corpus["test"][:50]:
        assert u.text == DIGIT_WORDS[int(u.path.name[0])]
        assert 0.1 < u.seconds < 2.5


def test_digit_strings_say_their_transcript_and_hold_the_speaker_out(fake_fsdd, tmp_path) -> None:
    corpus = fsdd_digit_strings(
        held_out="bob", train_utterances=12, test_utterances=5, seed=3, cache=tmp_path, data_dir=fake_fsdd
    )
    assert (len(corpus["train"]), len(corpus["test"])) == (12, 5)
    assert {u.speaker for u in corpus["test"]} == {"bob"}
    assert {u.speaker for u in corpus["train"]} <= {"ann", "cy"}
    for u in corpus["train"] + corpus["test"]:
        words = u.text.split()
        assert 1 <= len(words) <= 7
        assert heard_digits(u.path) == [DIGIT_WORDS.index(w) for w in words]
        assert soundfile.info(u.path).frames == round(u.seconds * SAMPLE_RATE)
        assert (len(words) + 1) * 0.05 + len(words) * 0.15 <= u.seconds <= (len(words) + 1) * 0.4 + len(words) * 0.3
    assert Corpus.load(corpus.root).splits == corpus.splits
    with pytest.raises(UserError, match="held_out speaker 'zed' is not in FSDD"):
        fsdd_digit_strings(held_out="zed", train_utterances=1, test_utterances=1, seed=0, data_dir=fake_fsdd)
    # No speaker held out (text-to-speech in every voice): any speaker in either split.
    every = fsdd_digit_strings(
        held_out=None, train_utterances=30, test_utterances=12, seed=3, cache=tmp_path, data_dir=fake_fsdd
    )
    assert {u.speaker for u in every["train"]} == {u.speaker for u in every["test"]} == {"ann", "bob", "cy"}


def test_digit_strings_same_bytes_whatever_the_workers(fake_fsdd, tmp_path) -> None:
    settings = dict(held_out="cy", train_utterances=9, test_utterances=4, seed=5, data_dir=fake_fsdd)
    one = fsdd_digit_strings(**settings, cache=tmp_path / "a", workers=1)
    two = fsdd_digit_strings(**settings, cache=tmp_path / "b", workers=2)
    same_bytes(one, two)
    assert fsdd_digit_strings(**settings, cache=tmp_path / "a").root == one.root  # from the cache
    other = fsdd_digit_strings(**{**settings, "seed": 6}, cache=tmp_path / "a")
    assert other.root != one.root and [u.text for u in other["train"]] != [u.text for u in one["train"]]


def test_speed_perturbation_shortens_training_strings_only(fake_fsdd, tmp_path) -> None:
    settings = dict(held_out="cy", train_utterances=7, test_utterances=3, seed=2, data_dir=fake_fsdd, workers=1)
    plain = fsdd_digit_strings(**settings, cache=tmp_path)
    assert fsdd_digit_strings(**settings, speeds=[1.0], cache=tmp_path).root == plain.root  # the key as before
    fast = fsdd_digit_strings(**settings, speeds=(1.25,), cache=tmp_path)
    assert fast.root != plain.root
    assert [u.text for u in fast["train"]] == [u.text for u in plain["train"]]  # the same strings, sped up
    for f, p in zip(fast["train"], plain["train"], strict=True):
        assert abs(f.seconds - p.seconds / 1.25) <= 2 / SAMPLE_RATE
    for f, p in zip(fast["test"], plain["test"], strict=True):  # the test strings untouched
        assert f.path.read_bytes() == p.path.read_bytes()
    mixed = fsdd_digit_strings(**settings, speeds=(0.8, 1.0, 1.25), cache=tmp_path)
    ratios = {round(p.seconds / m.seconds, 2) for m, p in zip(mixed["train"], plain["train"], strict=True)}
    assert ratios <= {0.8, 1.0, 1.25} and len(ratios) > 1
    for bad in ((), (0.3,), (1.0, True)):
        with pytest.raises(UserError, match="speeds must be"):
            fsdd_digit_strings(**settings, speeds=bad, cache=tmp_path)


def test_a_build_killed_midway_is_never_used_and_is_rebuilt(fake_fsdd, tmp_path) -> None:
    cache = tmp_path / "cache"
    script = (
        "from qkv.speech_corpora import fsdd_digit_strings; "
        f"fsdd_digit_strings(held_out='ann', train_utterances=12, test_utterances=3, seed=1, "
        f"cache={str(cache)!r}, data_dir={str(fake_fsdd)!r}, workers=2)"
    )
    env = {**os.environ, STALL_ENV: "4"}
    child = subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not any(len(list(d.rglob("*.flac"))) >= 4 for d in (cache / "speech").glob(".fsdd-*")):
            assert child.poll() is None and time.monotonic() < deadline, "the build did not start writing"
            time.sleep(0.05)
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the build and its workers
        child.wait()
    speech = cache / "speech"
    assert [p.name for p in speech.iterdir() if p.is_dir() and not p.name.startswith(".")] == []  # no entry
    assert any(p.name.startswith(".fsdd-digit-strings-") for p in speech.iterdir())  # the partial build

    settings = dict(held_out="ann", train_utterances=12, test_utterances=3, seed=1, data_dir=fake_fsdd, workers=1)
    rebuilt = fsdd_digit_strings(**settings, cache=cache)
    assert not [p.name for p in speech.iterdir() if p.name.startswith(".")]  # the partial build removed
    assert (len(rebuilt["train"]), len(rebuilt["test"])) == (12, 3)
    same_bytes(rebuilt, fsdd_digit_strings(**settings, cache=tmp_path / "clean"))

    (rebuilt.root / "corpus.json").unlink()  # an entry without its last file is incomplete: built again
    again = fsdd_digit_strings(**settings, cache=cache)
    assert (again.root / "corpus.json").is_file()
    same_bytes(again, rebuilt)


def test_read_manifest_names_the_line(tmp_path) -> None:
    (tmp_path / "m.tsv").write_text("path\tseconds\tspeaker\ttext\na.flac\t1.5\tx\tone\nb.flac\tlong\tx\ttwo\n")
    with pytest.raises(UserError, match=r"m.tsv:3: seconds 'long' is not a number"):
        read_manifest(tmp_path / "m.tsv")
    (tmp_path / "m.tsv").write_text("file\ttext\n")
    with pytest.raises(UserError, match=r"m.tsv:1: expected the header"):
        read_manifest(tmp_path / "m.tsv")


# ---------------------------------------------------------------------------------------------
# espeak-ng
# ---------------------------------------------------------------------------------------------

ENGLISH = {
    "train": ["A dog runs on the beach.", "Two men are playing  chess.", "A girl\tin a red coat."],
    "val": ["A man rides a bike."],
    "test_2016_flickr": ["People are walking."],
}
GERMAN = {
    "train": ["Ein Hund rennt am Strand.", "Zwei Männer spielen Schach.", "Ein Mädchen in einem roten Mantel."],
    "val": ["Ein Mann fährt Fahrrad."],
    "test_2016_flickr": ["Leute gehen spazieren."],
}


@pytest.fixture(scope="module")
def fake_multi30k(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("multi30k")
    for language, texts in (("en", ENGLISH), ("de", GERMAN)):
        for stem, lines in texts.items():
            (folder / f"{stem}.{language}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


@needs_espeak
def test_espeak_same_bytes_and_test_variants_never_trained_on(fake_multi30k, tmp_path) -> None:
    one = espeak_corpus(language="en", seed=2, cache=tmp_path / "a", data_dir=fake_multi30k, workers=1)
    two = espeak_corpus(language="en", seed=2, cache=tmp_path / "b", data_dir=fake_multi30k, workers=2)
    same_bytes(one, two)
    assert [u.text for u in one["train"]] == [
        "A dog runs on the beach.",
        "Two men are playing chess.",
        "A girl in a red coat.",
    ]
    assert [len(one[s]) for s in ("train", "val", "test")] == [3, 1, 1]
    for split in ("train", "val", "test"):
        variants = TRAIN_VARIANTS if split == "train" else TEST_VARIANTS
        for u in one[split]:
            assert u.speaker.split("+")[1] in variants and u.target is None
            assert soundfile.info(u.path).samplerate == SAMPLE_RATE
            assert 0.5 < u.seconds < 10
    assert not set(TRAIN_VARIANTS) & set(TEST_VARIANTS)
    with pytest.raises(UserError, match="test_variants must differ from train_variants; both hold m1"):
        espeak_corpus(language="en", train_variants=["m1", "m2"], test_variants=["m1"], data_dir=fake_multi30k)
    with pytest.raises(UserError, match="espeak-ng has no variant 'nobody'"):
        espeak_corpus(language="en", test_variants=["nobody"], data_dir=fake_multi30k, cache=tmp_path)


@needs_espeak
def test_german_speech_carries_the_english_targets(fake_multi30k, tmp_path) -> None:
    corpus = espeak_corpus(language="de", sentences=2, seed=0, cache=tmp_path, data_dir=fake_multi30k)
    english = ["A dog runs on the beach.", "Two men are playing chess."]  # white space runs made one space
    assert [(u.text, u.target) for u in corpus["train"]] == list(zip(GERMAN["train"][:2], english, strict=True))
    assert [(u.text, u.target) for u in corpus["test"]] == [("Leute gehen spazieren.", "People are walking.")]
    assert all(u.speaker.startswith("de+") for s in corpus.splits for u in corpus[s])
    assert (corpus.root / "train.tsv").read_text(encoding="utf-8").startswith("path\tseconds\tspeaker\ttext\ttarget\n")
    assert Corpus.load(corpus.root).splits == corpus.splits


def test_missing_tools_are_named_only_when_needed(fake_fsdd, fake_multi30k, tmp_path, monkeypatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(UserError, match=r"^espeak-ng not found on PATH.*apt-get install espeak-ng sox") as error:
        espeak_corpus(language="en", cache=tmp_path, data_dir=fake_multi30k)
    assert "\n" not in str(error.value)
    if shutil.which("espeak-ng", path=os.defpath + ":/usr/bin"):
        (bin_dir / "espeak-ng").symlink_to(shutil.which("espeak-ng", path=os.defpath + ":/usr/bin"))
        with pytest.raises(UserError, match=r"^sox not found on PATH"):
            espeak_corpus(language="en", cache=tmp_path, data_dir=fake_multi30k)
    built = fsdd_digit_strings(  # FSDD needs neither tool
        held_out="ann", train_utterances=2, test_utterances=1, seed=0, cache=tmp_path, data_dir=fake_fsdd, workers=1
    )
    assert len(built["train"]) == 2


def test_sample_rate_is_the_features_rate() -> None:
    from qkv.audio import SAMPLE_RATE as FEATURES_RATE

    assert SAMPLE_RATE == FEATURES_RATE
