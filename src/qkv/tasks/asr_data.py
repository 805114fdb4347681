"""The speech task's data (``tasks/asr.py``): the recipe's ``data`` section (:class:`AsrData`), its
corpus (:func:`load_corpus`: FSDD's digits or digit strings, Multi30k spoken by espeak-ng, or the
user's manifests), the validation split, the text a model learns to write for an utterance and
every utterance's log-mel features, computed once and kept in float16.

What is not here: building and caching the corpora (``speech_corpora/``), the features
themselves (``audio.py``), batching, the model, training and decoding (``tasks/asr.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from qkv.audio import FeatureConfig, features, load_audio
from qkv.errors import UserError
from qkv.evaluation import normalize_transcript
from qkv.progress import progress as progress_bar
from qkv.speech_corpora import (
    Corpus,
    Utterance,
    espeak_corpus,
    fsdd_digit_strings,
    fsdd_digits,
    read_manifest,
)

CORPORA = ("fsdd_digits", "fsdd_digit_strings", "espeak_en", "espeak_de", "manifests")


@dataclasses.dataclass(frozen=True)
class AsrData:
    """Speech recognition's corpus and vocabulary (``data``)."""

    corpus: str = "fsdd_digits"
    translate: bool = False  # espeak_de: English text out (speech translation); else the transcript
    normalize: bool = True  # train on normalize_transcript(text): lowercase, no punctuation
    held_out: str = "theo"  # fsdd_digit_strings: the speaker only the test set holds
    train_utterances: int = 6000  # fsdd_digit_strings
    test_utterances: int = 500  # fsdd_digit_strings
    speed_perturb: Sequence[float] = (1.0,)  # fsdd_digit_strings: each training string at one of these speeds
    sentences: int | None = None  # espeak corpora: the first N sentences of every split (null: all)
    corpus_seed: int = 0
    train: str | None = None  # manifests: train.tsv (path, seconds, speaker, text[, target])
    test: str | None = None  # manifests: test.tsv
    valid: str | None = None  # manifests: valid.tsv, the validation split train.valid_every decodes (null: none)
    tokenizer: str = "char"  # "char", "subword" (a unigram vocabulary of vocab_size) or a tokenizer.json
    vocab_size: int = 1000
    eval_batch_size: int = 32
    test_limit: int | None = None  # decode only the first N test utterances (null: all)
    valid_limit: int | None = (
        200  # validation (train.valid_every) decodes the first N validation utterances (null: all)
    )


def load_corpus(data: AsrData) -> tuple[Corpus, str]:
    """The recipe's corpus (built and cached where it must be) and the name of its test split."""
    kind = data.corpus
    if kind == "fsdd_digits":
        return fsdd_digits(), "test"
    if kind == "fsdd_digit_strings":
        corpus = fsdd_digit_strings(
            held_out=str(data.held_out),
            train_utterances=int(data.train_utterances),
            test_utterances=int(data.test_utterances),
            seed=int(data.corpus_seed),
            speeds=tuple(float(f) for f in data.speed_perturb),
        )
        return corpus, "test"
    if kind in ("espeak_en", "espeak_de"):
        corpus = espeak_corpus(language=kind[-2:], sentences=data.sentences, seed=int(data.corpus_seed))
        return corpus, "test"
    splits = {"train": read_manifest(data.train), "test": read_manifest(data.test)}
    if data.valid is not None:
        splits["val"] = read_manifest(data.valid)
    return Corpus("manifests", Path(data.train).parent, splits), "test"


def validation_split(corpus: Corpus, data: AsrData) -> list[Utterance]:
    """The utterances validation (``train.valid_every``) scores: the first ``data.valid_limit`` of
    the corpus's validation split ("val"); a corpus without one is refused."""
    if "val" not in corpus.splits:
        how = "set data.valid (a manifest)" if corpus.name == "manifests" else "use a corpus that has one"
        raise UserError(f"train.valid_every: the {corpus.name} corpus has no validation split; {how}")
    return corpus["val"][: data.valid_limit]


def output_text(u: Utterance, *, translate: bool, normalize: bool) -> str:
    """What the model learns to write for ``u``: the transcript, or with ``translate`` the
    target text (as written: translations are scored by BLEU, cased); ``normalize`` applies
    :func:`~qkv.evaluation.normalize_transcript` to a transcript."""
    if translate:
        if u.target is None:
            raise UserError(f"{u.path}: data.translate needs a target text for every utterance")
        return u.target
    return normalize_transcript(u.text) if normalize else u.text


def compute_features(
    utterances: Sequence[Utterance], config: FeatureConfig, *, progress: bool, desc: str
) -> list[Tensor]:
    """Every utterance's features, (T_u, M) float16 each (half the memory of float32; the
    features are normalised log-mels, well within float16's range and precision)."""
    out = []
    bar = progress_bar(total=len(utterances), desc=desc, unit="utt", disable=not progress)
    for u in utterances:
        wave = load_audio(u.path, sample_rate=config.sample_rate, max_seconds=None)
        out.append(features(wave, config).to(torch.float16))
        bar.update(1)
    bar.close()
    return out
