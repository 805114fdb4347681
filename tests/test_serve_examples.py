"""The example input the server offers for each model (``GET /v1/models``'s ``example``, the page's
placeholder): in the language the model's recipe reads, one its tokenizer reads without an unknown
token, the numbers task's digits; and the language a recipe's training files name."""

from __future__ import annotations

import dataclasses

import pytest

from qkv.serve.examples import SENTENCES, example_input, source_language
from qkv.serve.models import Served, load_served
from serving import tiny_models


@pytest.mark.parametrize(
    ("train", "reverse", "language"),
    [
        (["multi30k/train.de", "multi30k/train.en"], False, "de"),
        (["multi30k/train.de", "multi30k/train.en"], True, "en"),
        (["tatoeba-zh-en/train.tsv"], False, "zh"),
        (["tatoeba-zh-en/train.tsv"], True, "en"),
        ("corpus/en_fr.tsv", False, "en"),
        (["data/pairs.tsv"], False, None),
        (["a/train.txt2", "a/train.txt3"], False, None),
        (None, False, None),
    ],
)
def test_the_source_language_a_recipe_names(train, reverse, language):
    assert source_language(train, reverse=reverse) == language


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict[str, Served]:
    return load_served([str(p) for p in tiny_models(tmp_path_factory.mktemp("examples")).values()])


def _as_trained(served: Served, task: str, data: dict | None = None) -> Served:
    """``served`` as if ``qkv train`` had made it with ``task`` and a recipe's ``data``."""
    meta = {**served.bundle.meta, "task": task, "recipe": {"data": data or {}}}
    return dataclasses.replace(served, bundle=dataclasses.replace(served.bundle, meta=meta))


def _readable(served: Served, text: str) -> bool:
    ids = served.vocab.source.encode(text)
    return bool(ids) and served.vocab.source.unk_id not in ids and len(ids) <= served.window


def test_every_model_gets_an_example_it_can_read(served):
    for model in served.values():
        assert _readable(model, example_input(model)), model.name


def test_an_example_in_the_language_the_recipe_reads(served):
    pair = ["multi30k/train.de", "multi30k/train.en"]
    de_en = _as_trained(served["de_en"], "translation", {"train": pair})
    en_de = _as_trained(served["de_en"], "translation", {"train": pair, "reverse": True})
    assert (example_input(de_en), example_input(en_de)) == (SENTENCES["de"], SENTENCES["en"])
    assert example_input(_as_trained(served["de_en"], "numbers")) == "52,017"
    # The tiny tokenizer lacks most of the Chinese sentence's characters: another one it can read.
    zh_en = _as_trained(served["de_en"], "translation", {"train": ["tatoeba-zh-en/train.tsv"]})
    assert not _readable(zh_en, SENTENCES["zh"])
    assert example_input(zh_en) != SENTENCES["zh"] and _readable(zh_en, example_input(zh_en))
