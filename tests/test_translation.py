"""The translation task on a tiny synthetic parallel corpus: recipe, training, BLEU, the model directory."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from qkv.checkpoint import read_meta
from qkv.cli import main
from qkv.errors import UserError
from qkv.recipes import load_recipe, train_translation

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "multi30k_de_en.yaml")
WORDS = {"ein": "a", "hund": "dog", "katze": "cat", "läuft": "runs", "schläft": "sleeps", "rot": "red", "groß": "big"}
TINY = {"d_model": 15, "n_heads": 3, "d_ff": 7, "n_encoder_layers": 1, "n_decoder_layers": 1, "max_len": 13}


def _corpus(root: Path, n: int, seed: int) -> tuple[str, str]:
    """Word-by-word 'German' -> 'English' pairs as two aligned files."""
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        words = [rng.choice(sorted(WORDS)) for _ in range(rng.randint(2, 5))]
        src.append(" ".join(words))
        tgt.append(" ".join(WORDS[w] for w in words))
    (root / f"{seed}.de").write_text("\n".join(src) + "\n")
    (root / f"{seed}.en").write_text("\n".join(tgt) + "\n")
    return str(root / f"{seed}.de"), str(root / f"{seed}.en")


def _overrides(tmp_path: Path, steps: int) -> list[str]:
    train = _corpus(tmp_path, 300, seed=1)
    valid = _corpus(tmp_path, 20, seed=2)
    return [
        f"data.train={list(train)}",
        f"data.valid={list(valid)}",
        "data.vocab_size=40",
        "data.beam_size=2",
        f"train.steps={steps}",
        "train.max_tokens=400",
        "train.warmup=10",
        "train.lr=0.01",
        *(f"model.{k}={v}" for k, v in TINY.items()),
    ]


def test_translation_recipe_trains_and_scores(tmp_path) -> None:
    """Loss falls; validation BLEU and chrF come with sacreBLEU's signature; the directory says so."""
    recipe = load_recipe(RECIPE, _overrides(tmp_path, steps=80))
    summary = train_translation(recipe, tmp_path / "model", progress=False)
    losses = summary["losses"]
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
    assert 0.0 <= summary["bleu"] <= 100.0 and 0.0 <= summary["chrf"] <= 100.0
    assert "nrefs:1" in summary["bleu_signature"]
    assert len(summary["hypotheses"]) == 20
    meta = read_meta(tmp_path / "model")
    assert meta["task"] == "translation" and meta["valid_scores"]["bleu"] == summary["bleu"]


def test_translation_cli_and_generate(tmp_path, capsys) -> None:
    """qkv train --json reports BLEU; the saved model translates stdin line by line."""
    out = tmp_path / "m"
    argv = ["train", RECIPE, "--out", str(out), "--quiet", "--json"]
    for item in _overrides(tmp_path, steps=10):
        argv += ["--set", item]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"bleu", "chrf", "bleu_signature", "over_long_pairs"} <= result.keys()
    assert main(["generate", "--model", str(out), "--prompt", "ein hund", "--max-new-tokens", "5"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_translation_recipe_errors(tmp_path) -> None:
    with pytest.raises(UserError, match=r"data\.train"):
        load_recipe(RECIPE, ["data.train=[a, b, c]"])
    with pytest.raises(UserError, match=r"data\.long"):
        load_recipe(RECIPE, ["data.long=ignore"])
