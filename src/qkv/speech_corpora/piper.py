"""Speech spoken by a natural (published, neural) voice: :func:`piper_corpus`, Multi30k's English
captions (train, val, test2016) spoken by one :class:`Teacher`, a Piper voice as qkv runs it
(``tasks/piper_teacher.py`` makes one), cached like the espeak-ng corpora (``cache.py``: the
same entry layout, manifests and FLAC at 16 kHz), with the voice's source and licence written
beside the audio (``README.md`` in the entry).

Sentences are spoken one at a time by default, each with its noise drawn from a generator
seeded by (seed, split, index), so the corpus of the first 200 sentences is a prefix of the one
of 12,000 (a caption of two sentences is spoken as a batch of two); so a larger corpus reuses
the audio of a smaller one already cached (:func:`earlier_speech`: same voice, seed, texts and
tools) and speaks only the sentences it adds, which lets the corpus grow a slice at a time across
sessions. ``batch_size`` > 1 speaks
sentences of similar length together (a batch's noise seeded by its first sentence), which pays
where the hardware is wide (a GPU), not on 2 CPU cores, where 8 at once spoke 0.65 sentences a
second against 0.62 one by one (docs/tts.md); and in a padded batch the HiFi-GAN generator's
convolutions, which no mask stops, reach into the padding, so the last few milliseconds of each
sentence but the longest differ from the sentence spoken alone. The voice's rate (22,050 Hz for
Piper's medium voices) is resampled to 16 kHz with ``soxr``.

The teacher is passed in, not loaded here: loading a voice needs the model and the ONNX reader,
which sit above this package (``pyproject.toml``'s layers); so this module needs neither torch
nor piper-tts, and its tests use a voice of sine tones.

What is not here: loading a Piper voice and speaking a batch with it (``tasks/piper_teacher.py``),
espeak-ng's corpora (``espeak.py``), the cache's layout (``cache.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from qkv.data import read_lines, resolve
from qkv.errors import UserError
from qkv.files import sha256_file
from qkv.progress import progress
from qkv.speech_corpora.cache import SAMPLE_RATE, cache_root, cached_corpus
from qkv.speech_corpora.espeak import MULTI30K_SPLITS
from qkv.speech_corpora.manifests import Corpus, Utterance
from qkv.speech_corpora.pool import check_count, check_seed

BATCH_SIZE = 1  # sentences spoken at once (the module docstring says why one)
NOTICE_FILE = "README.md"  # the voice's source and licence, in the cache entry beside the audio


class Teacher(Protocol):
    """A voice that speaks texts: what :func:`piper_corpus` needs of it.

    Attributes:
        name: the voice's name (letters, digits, ``-``, ``_``, ``.``), part of the corpus's name.
        sample_rate: the rate of the waveforms it returns (Hz).
        key: everything that determines its speech (its files' SHA-256, its scales, versions),
            JSON-serialisable: part of the corpus's cache key.
        notice: Markdown naming the voice's source and licence, written beside the audio.
    """

    name: str
    sample_rate: int
    key: Mapping
    notice: str

    def speak(self, texts: Sequence[str], seed: int) -> list[np.ndarray]:
        """Each text spoken, in order: float waveforms (N,) within [-1, 1] at ``sample_rate``;
        its random draws from ``seed`` alone."""
        ...


def batch_seed(seed: int, split: str, index: int) -> int:
    """The noise seed of the batch whose first sentence is ``index`` of ``split``, from (seed,
    split, index), below 2**63 (any torch generator takes it)."""
    digest = hashlib.sha256(f"qkv piper/{seed}/{split}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def length_sorted_batches(texts: Sequence[str], size: int) -> list[list[int]]:
    """The texts' indices in batches of ``size``, shortest texts first (ties in index order):
    similar lengths together, so little of a batch is padding."""
    order = sorted(range(len(texts)), key=lambda i: (len(texts[i]), i))
    return [order[i : i + size] for i in range(0, len(order), size)]


def at_corpus_rate(wave: np.ndarray, rate: int) -> np.ndarray:
    """A float waveform at ``rate`` resampled to the corpora's 16 kHz (``soxr``'s default high
    quality) and clipped to [-1, 1] (resampling can overshoot a peak of 1 by a little).
    Shapes: (N,) -> (N · 16000 / rate,)."""
    import soxr

    wave = np.asarray(wave, dtype=np.float32)
    if rate != SAMPLE_RATE:
        wave = soxr.resample(wave, rate, SAMPLE_RATE).astype(np.float32)
    return np.clip(wave, -1.0, 1.0)


def _multi30k_english(folder: Path, limits: Mapping[str, int | None]) -> tuple[dict, dict]:
    """Each split's first ``limits[split]`` English captions (None: all; white space runs made
    one space) and the SHA-256 of each file read."""
    texts, files = {}, {}
    for split, sentences in limits.items():
        source = resolve(folder / f"{MULTI30K_SPLITS[split]}.en")
        lines = read_lines(source)
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                raise UserError(f"{source}:{number}: empty line (every line must hold a sentence)")
        texts[split] = [" ".join(line.split()) for line in lines[:sentences]]
        files[source.name] = sha256_file(source)
    return texts, files


def _check(
    teacher: Teacher, splits: Sequence[str], limits: tuple[int | None, int | None], seed: int, batch_size: int
) -> None:
    for what, count in zip(("sentences", "held_out_sentences"), limits, strict=True):
        if count is not None:
            check_count(what, count)
    check_seed(seed)
    check_count("batch_size", batch_size)
    unknown = [s for s in splits if s not in MULTI30K_SPLITS]
    if isinstance(splits, str) or not splits or unknown:
        raise UserError(f"splits must be a non-empty list of {', '.join(MULTI30K_SPLITS)}, got {splits!r}")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", teacher.name):
        raise UserError(f"a voice's name must be letters, digits, '-', '_' or '.', got {teacher.name!r}")


def piper_corpus(
    teacher: Teacher,
    *,
    sentences: int | None = None,
    held_out_sentences: int | None = None,
    splits: Sequence[str] = tuple(MULTI30K_SPLITS),
    seed: int = 0,
    batch_size: int = BATCH_SIZE,
    cache: str | Path | None = None,
    data_dir: str | Path | None = None,
) -> Corpus:
    """Multi30k's English captions spoken by ``teacher``, built once and cached: ``splits`` of
    "train" (29,000), "val" (1,014) and "test" (test2016, 1,000), the speaker the voice's name.

    ``sentences``: only the first that many of each split (None: all); ``held_out_sentences``:
    only the first that many of "val" and "test" (None: as ``sentences``), so a corpus of a few
    thousand training sentences need not speak a thousand held-out ones. ``seed``: the voice's
    noise (each batch's from (seed, split, its first sentence)). ``batch_size``: sentences
    spoken at once, shortest first (the module docstring says when more than one pays).
    ``data_dir``: the ``multi30k`` folder, default ``$QKV_DATA/multi30k``. The entry's
    ``README.md`` holds the teacher's notice (source and licence).
    """
    _check(teacher, splits, (sentences, held_out_sentences), seed, batch_size)
    import soundfile
    import soxr

    folder = Path(data_dir).expanduser() if data_dir is not None else Path("multi30k")
    held_out = sentences if held_out_sentences is None else held_out_sentences
    texts, files = _multi30k_english(folder, {s: sentences if s == "train" else held_out for s in splits})
    name = f"piper-{teacher.name}-multi30k-en"
    key = {
        "inputs": files,
        "settings": {
            "sentences": sentences,
            "held_out_sentences": held_out_sentences,
            "splits": list(splits),
            "seed": seed,
            "batch_size": batch_size,
            "sample_rate": SAMPLE_RATE,
        },
        "voice": dict(teacher.key),
        "tools": {
            "soxr": soxr.__version__,
            "libsndfile": soundfile.__libsndfile_version__,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        },
    }

    def build(tmp: Path) -> dict[str, list[Utterance]]:
        (tmp / NOTICE_FILE).write_text(teacher.notice.rstrip() + "\n", encoding="utf-8")
        # Only one sentence at a time is a prefix of every larger corpus (the module docstring).
        before = earlier_speech(_entries(cache), name, key) if batch_size == 1 else {}
        total = sum(len(t) for t in texts.values())
        bar = progress(total, desc=f"Piper voice {teacher.name}: Multi30k en", unit="utterance")
        try:
            return {
                split: _spoken(teacher, split, said, tmp, seed, batch_size, bar, before.get(split, {}))
                for split, said in texts.items()
            }
        finally:
            bar.close()

    return cached_corpus(name, key, cache, build)


def _entries(cache: str | Path | None) -> Path:
    """The folder of the speech cache's entries (``cache.py``'s layout)."""
    return (Path(cache).expanduser() if cache is not None else cache_root()) / "speech"


def _same_speech(key: Mapping) -> dict:
    """What of a corpus's key decides each sentence's audio: all but how many sentences of
    which splits (and which Multi30k files those splits read)."""
    settings = {
        k: v for k, v in key.get("settings", {}).items() if k not in ("sentences", "held_out_sentences", "splits")
    }
    return {**{k: v for k, v in key.items() if k != "inputs"}, "settings": settings}


def earlier_speech(folder: Path, name: str, key: Mapping) -> dict[str, dict[int, Utterance]]:
    """Per split, the sentences (by index) already spoken into a finished cache entry under
    ``folder`` of the corpus ``name`` whose key differs from ``key`` only in its sizes (the same
    voice, seed, tools and Multi30k files): what a larger corpus need not speak again."""
    found: dict[str, dict[int, Utterance]] = {}
    for meta_file in sorted(folder.glob(f"{name}-*/corpus.json")):
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        theirs = {k: v for k, v in meta.get("key", {}).items() if k in key}  # not the cache's own fields
        if theirs.get("settings", {}).get("batch_size") != 1 or _same_speech(theirs) != _same_speech(key):
            continue
        if any(key["inputs"].get(f, digest) != digest for f, digest in theirs.get("inputs", {}).items()):
            continue  # a Multi30k file changed since
        for split, utterances in Corpus.load(meta_file.parent).splits.items():
            found.setdefault(split, {}).update(enumerate(utterances))
    return found


def _reused(u: Utterance, path: Path) -> Utterance:
    """``u``'s audio at ``path`` (a hard link where the file system allows, else a copy)."""
    try:
        os.link(u.path, path)
    except OSError:
        shutil.copyfile(u.path, path)
    return Utterance(path, u.text, u.speaker, u.seconds)


def _spoken(
    teacher: Teacher,
    split: str,
    texts: list[str],
    tmp: Path,
    seed: int,
    batch_size: int,
    bar,
    before: Mapping[int, Utterance],
) -> list[Utterance]:
    """One split's texts spoken in length-sorted batches into ``tmp/audio/SPLIT/NNNNNN.flac``,
    as utterances in the texts' order; a batch of one whose sentence is in ``before`` (the same
    text, spoken into an earlier corpus) is reused instead."""
    import soundfile

    folder = tmp / "audio" / split
    folder.mkdir(parents=True)
    out: list[Utterance | None] = [None] * len(texts)
    for rows in length_sorted_batches(texts, batch_size):
        old = before.get(rows[0]) if len(rows) == 1 else None
        if old is not None and old.text == texts[rows[0]]:
            out[rows[0]] = _reused(old, folder / f"{rows[0]:06d}.flac")
            bar.update(1)
            continue
        waves = teacher.speak([texts[i] for i in rows], batch_seed(seed, split, rows[0]))
        if len(waves) != len(rows):
            raise ValueError(f"the voice {teacher.name} returned {len(waves)} waveforms for {len(rows)} texts")
        for i, wave in zip(rows, waves, strict=True):
            wave = at_corpus_rate(wave, teacher.sample_rate)
            if wave.size == 0:
                raise UserError(f"the voice {teacher.name} said nothing for {texts[i]!r}")
            path = folder / f"{i:06d}.flac"
            soundfile.write(path, wave, SAMPLE_RATE, subtype="PCM_16", format="FLAC")
            out[i] = Utterance(path, texts[i], teacher.name, wave.size / SAMPLE_RATE)
        bar.update(len(rows))
    return out  # type: ignore[return-value]: every index was in one batch
