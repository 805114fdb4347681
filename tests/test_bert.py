"""Encoder-only (BERT) tasks: masking, masked-LM pretraining, classification, DailyDialog, ``qkv embed``.

Tiny prime-sized models on synthetic sentences; a fake DailyDialog folder for its quirks.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from qkv.checkpoint import read_meta
from qkv.cli.main import main
from qkv.data import read_dailydialog, read_labelled
from qkv.embedding import sentence_embeddings
from qkv.errors import UserError
from qkv.evaluation import accuracy, macro_f1
from qkv.losses import IGNORE, mask_tokens
from qkv.models.encoder_only import EncoderOnly, EncoderOnlyConfig
from qkv.tasks import load_recipe
from qkv.tasks.bert import predict_labels, train_classifier, train_mlm
from qkv.tokenization import FILE, Tokenizer

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
TINY = {"d_model": 15, "n_heads": 3, "d_ff": 7, "n_layers": 1, "max_len": 13, "dropout": 0.0}
FILLER = "the a cat dog sat ran on under mat log big small red blue".split()
CLASSES = {"apple": "fruit", "hammer": "tool"}  # the word a sentence holds decides its label
# Masked-LM sentences: fixed phrases, so a masked word can be told from its neighbours.
PHRASES = ["the cat sat on the mat", "a dog ran under a log", "a big red apple", "the small blue hammer"]


def _sentence(rng: random.Random, word: str) -> str:
    words = [rng.choice(FILLER) for _ in range(rng.randint(2, 6))]
    words.insert(rng.randint(0, len(words)), word)
    return " ".join(words)


def _tsv(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        word = rng.choice(sorted(CLASSES))
        lines.append(f"{_sentence(rng, word)}\t{CLASSES[word]}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _tiny(**train) -> list[str]:
    settings = {"steps": 80, "batch_size": 16, "lr": 0.01, "warmup": 5, **train}
    return [f"model.{k}={v}" for k, v in TINY.items()] + [f"train.{k}={v}" for k, v in settings.items()]


@pytest.fixture(scope="module")
def mlm(tmp_path_factory):
    """A tiny masked-LM trained by train_mlm on synthetic sentences: (root, summary)."""
    root = tmp_path_factory.mktemp("bert")
    rng = random.Random(0)
    text = root / "sentences.txt"
    text.write_text("\n".join(" ".join(rng.sample(PHRASES, rng.randint(1, 2))) for _ in range(400)) + "\n")
    overrides = ["data.dailydialog=null", f"data.sentences={text}", "data.vocab_size=40", *_tiny(steps=150)]
    summary = train_mlm(load_recipe(None, ["task=mlm", *overrides]), root / "mlm", progress=False)
    return root, summary


# ------------------------------------------------------------------- masking


def test_mask_tokens_proportions() -> None:
    """15% of the maskable tokens are selected; of those 80% masked, 10% random, 10% kept;
    padding and special tokens never; labels hold the originals there and IGNORE elsewhere."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1005, (211, 401), generator=generator)  # (B, S)
    ids[:, 0], ids[:, 200] = 1, 2  # specials
    ids[::2, 300:] = 0  # padding
    maskable = ~torch.isin(ids, torch.tensor([0, 1, 2]))
    random_ids = torch.arange(5, 1005)
    inputs, labels = mask_tokens(
        ids, maskable=maskable, mask_id=4, random_ids=random_ids, generator=generator, rate=0.15
    )
    selected = labels != IGNORE
    assert not selected[~maskable].any()
    assert torch.equal(labels[selected], ids[selected])
    assert torch.equal(inputs[~selected], ids[~selected])
    assert selected.sum() / maskable.sum() == pytest.approx(0.15, abs=0.005)
    n = int(selected.sum())
    masked = (inputs[selected] == 4).sum() / n
    replaced = ((inputs[selected] != 4) & (inputs[selected] != ids[selected])).sum() / n
    kept = (inputs[selected] == ids[selected]).sum() / n
    assert (masked, replaced, kept) == (
        pytest.approx(0.8, abs=0.015),
        pytest.approx(0.1, abs=0.012),
        pytest.approx(0.1, abs=0.012),
    )
    assert torch.isin(inputs[selected & (inputs != 4)], random_ids).all()
    again = mask_tokens(
        ids, maskable=maskable, mask_id=4, random_ids=random_ids, generator=torch.Generator().manual_seed(1)
    )
    same = mask_tokens(
        ids, maskable=maskable, mask_id=4, random_ids=random_ids, generator=torch.Generator().manual_seed(1)
    )
    assert all(torch.equal(a, b) for a, b in zip(again, same, strict=True))


def test_mask_token_is_added_after_every_other_id() -> None:
    """add_mask appends <mask>; ordinary text encodes as before; it survives save and load."""
    tokenizer = Tokenizer.train_subword(["the cat sat on the mat", "a dog ran"] * 10, vocab_size=23)
    before, size = tokenizer.encode("the cat ran"), tokenizer.vocab_size
    assert tokenizer.mask_id is None
    assert tokenizer.add_mask().mask_id == size and tokenizer.vocab_size == size + 1
    assert tokenizer.add_mask().vocab_size == size + 1  # once only
    assert tokenizer.encode("the cat ran") == before
    assert size in tokenizer.encode("the <mask> ran")


def test_mlm_logits_at_selected_positions_equal_the_full_ones() -> None:
    """forward(only=...) gives the rows of the full logits at the selected positions."""
    torch.manual_seed(0)
    model = EncoderOnly(EncoderOnlyConfig(vocab_size=17, **TINY)).eval()
    tokens = torch.randint(1, 17, (3, 7))  # (B, S)
    only = torch.rand(3, 7) < 0.4
    assert torch.allclose(model(tokens, only=only), model(tokens)[only], atol=1e-6)


# ------------------------------------------------------------------- metrics


def test_accuracy_and_macro_f1_by_hand() -> None:
    gold = ["a", "a", "b", "b", "c"]
    predicted = ["a", "b", "b", "b", "a"]
    assert accuracy(predicted, gold) == pytest.approx(3 / 5)
    # F1: a = 2·1/(2·1+1+1) = 0.5; b = 2·2/(2·2+1+0) = 0.8; c = 0 (never predicted right).
    assert macro_f1(predicted, gold) == pytest.approx((0.5 + 0.8 + 0.0) / 3)
    # A class only predicted counts too: a = 2/3, b = 0.
    assert macro_f1(["a", "b"], ["a", "a"]) == pytest.approx(1 / 3)
    assert macro_f1(gold, gold) == 1.0 and accuracy([], []) == 0.0 and macro_f1([], []) == 0.0
    with pytest.raises(ValueError):
        accuracy(["a"], ["a", "b"])


# ------------------------------------------------------------------- masked LM


def test_mlm_loss_falls_and_the_model_directory_has_a_mask(mlm) -> None:
    root, summary = mlm
    losses = summary["losses"]
    assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:10]) / 10
    vocab = summary["tokenizer"].vocab_size
    assert summary["valid_masked"] > 0 and summary["valid_loss"] < 0.5 * math.log(vocab)
    assert 0.0 <= summary["valid_accuracy"] <= 1.0
    meta = read_meta(root / "mlm")
    assert meta["kind"] == "encoder_only" and meta["task"] == "mlm"
    assert meta["valid_loss"] == pytest.approx(summary["valid_loss"])
    tokenizer = Tokenizer.load(root / "mlm" / FILE)
    assert tokenizer.mask_id == vocab - 1 == meta["config"]["vocab_size"] - 1


# ------------------------------------------------------------------- classification


def test_classifier_from_scratch_beats_chance(tmp_path) -> None:
    """apple -> fruit, hammer -> tool: learned; labels saved by name; predict_labels maps back."""
    train, valid = _tsv(tmp_path / "train.tsv", 300, 1), _tsv(tmp_path / "valid.tsv", 41, 2)
    overrides = ["data.dailydialog=null", f"data.train_tsv={train}", f"data.valid_tsv={valid}", "data.vocab_size=40"]
    recipe = load_recipe(None, ["task=classify", *overrides, *_tiny(steps=60)])
    summary = train_classifier(recipe, tmp_path / "cls", progress=False)
    assert summary["accuracy"] >= 0.9 > summary["majority"]["accuracy"]
    assert summary["macro_f1"] > summary["majority"]["macro_f1"]
    assert summary["labels"] == ["fruit", "tool"] and summary["init"] is None
    meta = read_meta(tmp_path / "cls")
    assert meta["labels"] == ["fruit", "tool"] and meta["task"] == "classify"
    found = predict_labels(summary["model"], summary["tokenizer"], ["a big hammer", "red apple"], labels=meta["labels"])
    assert found == ["tool", "fruit"]


def test_evaluate_scores_a_classifier_as_training_did(tmp_path, capsys) -> None:
    """qkv evaluate --model CLS --tsv: on the validation file, the accuracy and macro-F1 that
    training reported; a label the model does not know is refused with file:line."""
    train, valid = _tsv(tmp_path / "train.tsv", 120, 5), _tsv(tmp_path / "valid.tsv", 29, 6)
    overrides = ["data.dailydialog=null", f"data.train_tsv={train}", f"data.valid_tsv={valid}", "data.vocab_size=40"]
    summary = train_classifier(
        load_recipe(None, ["task=classify", *overrides, *_tiny(steps=8)]), tmp_path / "cls", progress=False
    )
    assert main(["evaluate", "--model", str(tmp_path / "cls"), "--tsv", str(valid), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    gold = [label for _, label in read_labelled(valid)]
    assert result["examples"] == len(gold) == 29
    assert result["accuracy"] == round(summary["accuracy"], 4) == round(accuracy(summary["predictions"], gold), 4)
    assert result["macro_f1"] == round(summary["macro_f1"], 4) == round(macro_f1(summary["predictions"], gold), 4)

    unknown = tmp_path / "unknown.tsv"
    unknown.write_text("a red apple\tfruit\nthe carrot\tvegetable\n")
    assert main(["evaluate", "--model", str(tmp_path / "cls"), "--tsv", str(unknown)]) == 2
    err = capsys.readouterr().err
    assert err == f"qkv evaluate: error: {unknown}:2: label 'vegetable' is not one of the model's: fruit, tool\n"
    assert main(["evaluate", "--model", str(tmp_path / "cls")]) == 2
    assert "give --tsv FILE" in capsys.readouterr().err

    # A class head without label names is refused for that reason, not as "no class head".
    nameless = tmp_path / "nameless"
    shutil.copytree(tmp_path / "cls", nameless)
    config = json.loads((nameless / "config.json").read_text())
    del config["labels"]
    (nameless / "config.json").write_text(json.dumps(config))
    assert main(["evaluate", "--model", str(nameless), "--tsv", str(valid)]) == 2
    assert "its 2 classes have no label names" in capsys.readouterr().err


def test_classifier_fine_tuned_from_the_mlm_model(mlm, tmp_path) -> None:
    """train.init: the pretrained encoder and its tokenizer; a different tokenizer or
    architecture is refused, naming both."""
    root, _ = mlm
    train = _tsv(tmp_path / "train.tsv", 200, 3)
    base = ["task=classify", "data.dailydialog=null", f"data.train_tsv={train}", f"train.init={root / 'mlm'}"]
    summary = train_classifier(load_recipe(None, [*base, *_tiny(steps=40)]), tmp_path / "ft", progress=False)
    assert summary["init"] == str(root / "mlm") and summary["vocabulary"] == f"the tokenizer of {root / 'mlm'}"
    assert summary["accuracy"] > summary["majority"]["accuracy"]
    pretrained = dict(summary["tokenizer"].backend.get_vocab())
    assert pretrained == Tokenizer.load(root / "mlm" / FILE).backend.get_vocab()

    other = Tokenizer.train_subword(["something else entirely", "other words here"] * 9, vocab_size=30)
    other.save(tmp_path / "other.json")
    with pytest.raises(UserError, match="is not the tokenizer"):
        train_classifier(
            load_recipe(None, [*base, f"data.tokenizer={tmp_path / 'other.json'}", *_tiny(steps=2)]),
            tmp_path / "bad",
            progress=False,
        )
    with pytest.raises(UserError, match="d_model=15"):
        train_classifier(
            load_recipe(None, [*base, *_tiny(steps=2), "model.d_model=21"]), tmp_path / "bad", progress=False
        )


def test_tsv_errors_name_file_and_line(tmp_path, capsys) -> None:
    cases = {"no tab here": "expected text<TAB>label", "\tfruit": "text is empty", "some text\t ": "label is empty"}
    for i, (line, message) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.tsv"
        path.write_text(f"a red apple\tfruit\n{line}\nhammer\ttool\n")
        with pytest.raises(UserError, match=rf"bad{i}\.tsv:2: .*{message}"):
            read_labelled(path)
    argv = ["train", str(RECIPES / "dailydialog_acts.yaml"), "--out", str(tmp_path / "m"), "--quiet"]
    argv += ["--set", "data.dailydialog=null", "--set", f"data.train_tsv={tmp_path / 'bad0.tsv'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad0.tsv:2" in err


# ------------------------------------------------------------------- DailyDialog


def _dailydialog(folder: Path) -> Path:
    """A DailyDialog-shaped folder: line 3 of the training split has 3 utterances, 2 labels."""
    folder.mkdir()
    train = [
        "Hi , how are you ? __eou__ Fine , thanks . __eou__",
        "Close the door . __eou__ I will do it . __eou__ Thanks . __eou__",
        "Is it raining ? __eou__ Yes . __eou__ Take an umbrella . __eou__",
        "Where is the apple ? __eou__ On the table . __eou__",
    ]
    acts = ["2 1", "3 4 1", "2 1", "2 1"]
    valid = ["What time is it ? __eou__ Five . __eou__", "Sit down . __eou__ Sure . __eou__"]
    (folder / "dialogues_train.txt").write_text("\n".join(train) + "\n")
    (folder / "dialogues_act_train.txt").write_text("\n".join(f"{a} " for a in acts) + "\n")
    (folder / "dialogues_validation.txt").write_text("\n".join(valid) + "\n")
    (folder / "dialogues_act_validation.txt").write_text("2 1 \n3 4 \n")
    return folder


def test_dailydialog_loader_reports_a_misaligned_dialogue(tmp_path) -> None:
    folder = _dailydialog(tmp_path / "dd")
    dialogues, problems = read_dailydialog(folder, "train", labels="act")
    assert len(dialogues) == 3 and len(problems) == 1
    assert "dialogues_train.txt:3: 3 utterances but 2 act labels" in problems[0]
    assert dialogues[0] == [("Hi , how are you ?", "question"), ("Fine , thanks .", "inform")]
    assert dialogues[1][2] == ("Thanks .", "inform") and dialogues[1][1][1] == "commissive"
    texts, none = read_dailydialog(folder, "train")  # the text alone is never misaligned
    assert len(texts) == 4 and none == [] and texts[2][2] == ("Take an umbrella .", None)
    (folder / "dialogues_act_validation.txt").write_text("2 1 \n3 9 \n")
    _, problems = read_dailydialog(folder, "validation", labels="act")
    assert len(problems) == 1 and "dialogues_act_validation.txt:2: '9' is not a act label" in problems[0]
    (folder / "dialogues_act_validation.txt").write_text("2 1 \n")
    with pytest.raises(UserError, match=r"has 2 lines but .* has 1"):
        read_dailydialog(folder, "validation", labels="act")


def test_dailydialog_classifier_and_mlm_through_the_cli(tmp_path, capsys) -> None:
    """The shipped recipes run on a fake DailyDialog folder; the skipped line is named on stderr."""
    folder = _dailydialog(tmp_path / "dd")
    tiny = [f"--set=model.{k}={v}" for k, v in TINY.items()] + ["--set=train.steps=3", "--set=data.vocab_size=60"]
    tiny += ["--set=train.seconds=null", f"--set=data.dailydialog_dir={folder}", "--quiet", "--json"]
    mlm_dir = tmp_path / "mlm"
    assert main(["train", str(RECIPES / "dailydialog_mlm.yaml"), "--out", str(mlm_dir), *tiny]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["task"] == "mlm" and "valid_loss" in result and "valid_accuracy" in result
    assert result["masked_tokens_per_second"] > 0  # its loss is over the masked tokens only
    argv = ["train", str(RECIPES / "dailydialog_acts.yaml"), "--out", str(tmp_path / "acts"), *tiny]
    assert main([*argv, f"--set=train.init={mlm_dir}", "--set=data.context=true"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["task"] == "classify" and result["skipped"] == 1 and result["majority"]["label"] == "inform"
    assert result["examples_per_second"] > 0 and "tokens_per_second" not in result  # one loss term per example
    assert "dialogues_train.txt:3" in err
    assert read_meta(tmp_path / "acts")["labels"] == ["inform", "question", "directive", "commissive"]


def test_recipe_data_sources_are_checked() -> None:
    for path in ("dailydialog_mlm.yaml", "dailydialog_acts.yaml"):
        assert load_recipe(RECIPES / path).model["d_model"] == 256
    with pytest.raises(UserError, match="exclude each other"):
        load_recipe(None, ["task=mlm", "data.sentences=x.txt"])
    with pytest.raises(UserError, match=r"set data\.sentences"):
        load_recipe(None, ["task=mlm", "data.dailydialog=null"])
    with pytest.raises(UserError, match="act or emotion"):
        load_recipe(None, ["task=classify", "data.dailydialog=text"])
    with pytest.raises(UserError, match=r"data\.context needs"):
        load_recipe(None, ["task=classify", "data.dailydialog=null", "data.train_tsv=x.tsv", "data.context=true"])
    with pytest.raises(UserError, match=r"data\.mask_rate"):
        load_recipe(None, ["task=mlm", "data.mask_rate=1.5"])


# ------------------------------------------------------------------- qkv embed


def test_embed_npy_jsonl_normalize_and_padding_invariance(mlm, tmp_path, capsys) -> None:
    root, summary = mlm
    model = str(root / "mlm")
    short, long = "a red apple", "the big dog sat on the small red mat under a log"
    (tmp_path / "in.txt").write_text(f"{short}\n\n{long}\n")
    assert (
        main(["embed", "--model", model, "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "v.npy")]) == 0
    )
    vectors = np.load(tmp_path / "v.npy")
    assert vectors.shape == (3, TINY["d_model"]) and vectors.dtype == np.float32
    assert not vectors[1].any()  # an empty line: a zero row
    argv = ["embed", "--model", model, "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "v.jsonl")]
    assert main([*argv, "--normalize"]) == 0
    rows = [json.loads(line)["embedding"] for line in (tmp_path / "v.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(len(r) == TINY["d_model"] for r in rows)
    norms = np.linalg.norm(np.array(rows), axis=1)
    assert norms[0] == pytest.approx(1.0, abs=1e-5) and norms[2] == pytest.approx(1.0, abs=1e-5) and norms[1] == 0
    # Alone, or padded in one batch beside a longer sentence: the same vector.
    (tmp_path / "one.txt").write_text(f"{short}\n")
    argv = ["embed", "--model", model, "--input", str(tmp_path / "one.txt"), "--output", str(tmp_path / "one.npy")]
    assert main(argv) == 0
    assert np.abs(np.load(tmp_path / "one.npy")[0] - vectors[0]).max() < 1e-5
    batched, _ = sentence_embeddings(summary["model"], summary["tokenizer"], [short, long], batch_size=2)
    alone, _ = sentence_embeddings(summary["model"], summary["tokenizer"], [short], batch_size=2)
    assert (batched[0] - alone[0]).abs().max() < 1e-5
    capsys.readouterr()
    assert main(["embed", "--model", model, "--input", str(tmp_path / "in.txt"), "--output", "v.txt"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ".npy" in err


def test_embed_help_and_wrong_model_kind(capsys, tmp_path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["embed", "--help"])
    assert exit_info.value.code == 0 and "example" in capsys.readouterr().out
    from qkv.checkpoint import save_model
    from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig

    save_model(DecoderOnly(DecoderOnlyConfig(vocab_size=13, **TINY)), tmp_path / "gpt")
    argv = ["embed", "--model", str(tmp_path / "gpt"), "--output", str(tmp_path / "x.npy")]
    assert main(argv) == 2
    assert "encoder_only" in capsys.readouterr().err
