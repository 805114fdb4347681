"""Speech corpora that qkv builds itself: real digits (FSDD) and synthetic captions (espeak-ng, or a Piper voice),
cached, deterministic to the byte, built in parallel on every core with progress.

What is here, bottom up (a module imports only the ones above it):
  * ``manifests.py``: :class:`Utterance` (an audio file, its transcript, its speaker, its length
    and, for speech translation, the ``target`` text), :class:`Corpus` (named splits of
    utterances) and :func:`read_manifest`;
  * ``pool.py``: the worker pool every build runs on (one worker per core by default, progress)
    and the checks of the settings every builder takes;
  * ``cache.py``: :func:`cache_root` and the building of one cache entry per corpus and key,
    atomically and under a lock (the entry's layout is described there);
  * ``fsdd.py``: :func:`fsdd_digits` (FSDD's standard split, listed in place) and
    :func:`fsdd_digit_strings` (strings of 1–7 digits, one speaker held out);
  * ``espeak.py``: :func:`espeak_corpus` (Multi30k's captions spoken by ``espeak-ng``) and
    :func:`espeak_phonemes` (texts in IPA phonemes);
  * ``piper.py``: :func:`piper_corpus` (Multi30k's English captions spoken by a natural voice, a
    :class:`Teacher` the caller passes in; the voice's licence kept beside the audio).

This file only re-exports the public names, so ``from qkv.speech_corpora import X`` is the way
in; nothing runs at import. The tools (``espeak-ng``, ``sox``) are needed only to build: without
them qkv imports and runs, and building a corpus that needs one is a one-line UserError naming it.

What is not here: reading audio and features (``audio.py``), tokenizing transcripts, batching.
"""

from qkv.speech_corpora.cache import CACHE_ENV, FORMAT, SAMPLE_RATE, cache_root
from qkv.speech_corpora.espeak import (
    ESPEAK_VOICES,
    MULTI30K_SPLITS,
    PITCHES,
    SPEEDS,
    TEST_VARIANTS,
    TRAIN_VARIANTS,
    espeak_corpus,
    espeak_phonemes,
)
from qkv.speech_corpora.fsdd import (
    DIGIT_STRING_LENGTHS,
    DIGIT_WORDS,
    FSDD_TEST_INDICES,
    SILENCE_SECONDS,
    fsdd_digit_strings,
    fsdd_digits,
    valid_speeds,
)
from qkv.speech_corpora.manifests import MANIFEST_COLUMNS, Corpus, Utterance, read_manifest
from qkv.speech_corpora.piper import Teacher, piper_corpus
from qkv.speech_corpora.pool import STALL_ENV

__all__ = [
    "CACHE_ENV",
    "DIGIT_STRING_LENGTHS",
    "DIGIT_WORDS",
    "ESPEAK_VOICES",
    "FORMAT",
    "FSDD_TEST_INDICES",
    "MANIFEST_COLUMNS",
    "MULTI30K_SPLITS",
    "PITCHES",
    "SAMPLE_RATE",
    "SILENCE_SECONDS",
    "SPEEDS",
    "STALL_ENV",
    "TEST_VARIANTS",
    "TRAIN_VARIANTS",
    "Corpus",
    "Teacher",
    "Utterance",
    "cache_root",
    "espeak_corpus",
    "espeak_phonemes",
    "fsdd_digit_strings",
    "fsdd_digits",
    "piper_corpus",
    "read_manifest",
    "valid_speeds",
]
