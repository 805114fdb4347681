"""Language modelling (character-level and subword): tokenizer, data paths, loss, the lm recipe and its CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qkv.checkpoint import load_model
from qkv.cli.main import main
from qkv.data import read_text, resolve
from qkv.decoding import continuation, most_likely
from qkv.errors import UserError
from qkv.evaluation import lm_loss, span_loss
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.tasks import load_recipe
from qkv.tasks.lm import reply_spans, token_stream, train_lm
from qkv.tokenization import Tokenizer

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "shakespeare_char_cpu.yaml")
TINY = {"d_model": 15, "n_heads": 3, "d_ff": 7, "n_layers": 1, "max_len": 11}


def test_char_tokenizer_round_trip() -> None:
    """One id per character (spaces and newlines too); decoding gives the text back."""
    text = "To be, or not\nto be: that is\n\nthe question."
    tokenizer = Tokenizer.train_char_level([text])
    assert tokenizer.vocab_size == len(set(text)) + 4
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_lm_loss_equals_a_window_by_window_reference() -> None:
    """Every token but the first is predicted once, from the tokens before it in its window."""
    torch.manual_seed(3)
    model = DecoderOnly(DecoderOnlyConfig(vocab_size=13, dropout=0.0, positions="learned", **TINY)).eval()
    ids = torch.randint(0, 13, (29,))
    context = 5
    total = 0.0
    for start in range(0, 28, context):
        x = ids[start : min(start + context, 28)]
        y = ids[start + 1 : start + 1 + len(x)]
        total += F.cross_entropy(model(x[None])[0], y, reduction="sum").item()
    assert lm_loss(model, ids, context=context, batch_size=2) == pytest.approx(total / 28, rel=1e-5)


def test_data_paths_and_utf8_errors(tmp_path, monkeypatch) -> None:
    """Paths resolve as given or under $QKV_DATA; a missing file and bad bytes are UserErrors."""
    (tmp_path / "corpus").mkdir()
    text = tmp_path / "corpus" / "a.txt"
    text.write_bytes("first line\nsecond \xe9\n".encode() + b"third \xff\n")
    monkeypatch.setenv("QKV_DATA", str(tmp_path))
    assert resolve("corpus/a.txt") == tmp_path / "corpus" / "a.txt"
    assert resolve(text) == text
    with pytest.raises(UserError, match="QKV_DATA"):
        resolve("corpus/missing.txt")
    with pytest.raises(UserError, match=r"a\.txt:3"):
        read_text(text)


@pytest.fixture(scope="module")
def trained_lm(tmp_path_factory):
    """A tiny character model trained on a patterned text through the lm recipe."""
    root = tmp_path_factory.mktemp("lm")
    text = root / "text.txt"
    text.write_text("the cat sat on the mat.\n" * 150)
    overrides = [f"data.text={text}", "train.steps=150", "train.batch_size=8", "train.lr=0.01"]
    overrides += [f"model.{k}={v}" for k, v in TINY.items()]
    recipe = load_recipe(RECIPE, overrides)
    summary = train_lm(recipe, root / "model", progress=False)
    return root, summary


def test_lm_recipe_learns_the_text(trained_lm) -> None:
    """Training loss falls and validation loss ends far below a uniform guess."""
    _, summary = trained_lm
    losses = summary["losses"]
    assert sum(losses[-10:]) / 10 < 0.3 * sum(losses[:10]) / 10
    assert summary["val_loss"] < 0.3 * math.log(summary["tokenizer"].vocab_size)


def test_lm_cli_train_evaluate_generate(trained_lm, tmp_path, capsys) -> None:
    """train prints val_loss=; evaluate --text agrees with it on the same text; generate continues a prompt."""
    root, _ = trained_lm
    text = root / "text.txt"
    out = tmp_path / "m"
    argv = ["train", RECIPE, "--out", str(out), "--quiet", f"--set=data.text={text}"]
    argv += ["--set=train.steps=20", "--set=train.batch_size=4"] + [f"--set=model.{k}={v}" for k, v in TINY.items()]
    assert main(argv) == 0
    line = capsys.readouterr().out
    assert "val_loss=" in line
    val_loss = float(line.split("val_loss=")[1].split()[0])

    val_text = tmp_path / "val.txt"
    full = text.read_text()
    val_text.write_text(full[int(len(full) * 0.9) :])
    assert main(["evaluate", "--model", str(out), "--text", str(val_text), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["loss"] == pytest.approx(val_loss, abs=1e-3)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-3)

    assert main(["generate", "--model", str(root / "model"), "--prompt", "the cat", "--max-new-tokens", "9"]) == 0
    continuation = capsys.readouterr().out.rstrip("\n")
    assert 0 < len(continuation) <= 9


def test_lm_recipe_errors(capsys, tmp_path) -> None:
    """A missing text file is one line naming it; evaluate --text refuses a model of another kind."""
    argv = ["train", RECIPE, "--out", str(tmp_path / "m"), "--quiet"]
    assert main([*argv, "--set", "data.text=no/such/file.txt"]) == 2
    assert "no/such/file.txt" in capsys.readouterr().err
    assert main(["evaluate", "--model", str(tmp_path / "none"), "--text", "x.txt"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_streamed_prompt_equals_batched_generation(trained_lm, capsys, monkeypatch) -> None:
    """--prompt on a language model streams; its text equals the batched path's for the same input."""
    import io
    import sys

    root, _ = trained_lm
    model = str(root / "model")
    window = json.loads((root / "model" / "config.json").read_text())["config"]["max_len"]
    room = window - len("the m") + 1
    assert main(["generate", "--model", model, "--prompt", "the m", "--max-new-tokens", str(room)]) == 0
    streamed = capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"the m\n"), encoding="utf-8"))
    assert main(["generate", "--model", model, "--max-new-tokens", str(room)]) == 0
    batched = capsys.readouterr().out
    # The batched path writes one output per line: newlines inside an output become \n.
    assert batched == streamed[:-1].replace("\\", "\\\\").replace("\n", "\\n") + "\n"
    # Past the window, the stream slides on (generation.continuation); the batched path stops there.
    assert main(["generate", "--model", model, "--prompt", "the m", "--max-new-tokens", str(room + 9)]) == 0
    assert len(capsys.readouterr().out) == len(streamed) + 9
    assert main(["generate", "--model", model, "--prompt", "the", "--sample", "--seed", "5", "--top-k", "3"]) == 0
    first = capsys.readouterr().out
    assert main(["generate", "--model", model, "--prompt", "the", "--sample", "--seed", "5", "--top-k", "3"]) == 0
    assert first == capsys.readouterr().out


def test_lm_recipe_user_errors(capsys, tmp_path) -> None:
    """data.text naming a directory, and numbers written as 1e-3, are handled in one line / accepted."""
    argv = ["train", RECIPE, "--out", str(tmp_path / "m"), "--quiet"]
    assert main([*argv, "--set", f"data.text={tmp_path}"]) == 2
    assert "directory" in capsys.readouterr().err
    recipe = load_recipe(RECIPE, ["train.lr=3e-4", "model.norm_eps=1e-6"])
    assert recipe.train.lr == pytest.approx(3e-4) and recipe.model["norm_eps"] == pytest.approx(1e-6)


def test_dialogue_lm_with_subword_lines_and_a_validation_file(tmp_path, capsys) -> None:
    """documents=lines: every dialogue ends with END; subword pieces; a separate validation file;
    the trained model chats, replying up to the turn separator."""
    turns = ["hello , how are you ?", "fine , thanks . and you ?", "good . see you later .", "bye !"]
    train = tmp_path / "train.txt"
    train.write_text("\n".join(" __eou__ ".join(turns[i:] + turns[:i]) + " __eou__" for i in range(4)) * 20 + "\n")
    valid = tmp_path / "valid.txt"
    valid.write_text(" __eou__ ".join(turns) + " __eou__\n")
    overrides = [
        f"data.text={train}",
        f"data.valid_text={valid}",
        "data.documents=lines",
        "data.tokenizer=subword",
        "data.vocab_size=40",
        "train.steps=60",
        "train.lr=0.01",
        "train.batch_size=8",
        *(f"model.{k}={v}" for k, v in {**TINY, "max_len": 23}.items()),
    ]
    summary = train_lm(load_recipe(RECIPE, overrides), tmp_path / "chat", progress=False)
    tokenizer = summary["tokenizer"]
    assert summary["val_tokens"] == len(tokenizer.encode(valid.read_text().strip())) + 1  # + END
    assert summary["val_loss"] < math.log(tokenizer.vocab_size)


def test_subword_lm_on_running_text_keeps_line_breaks(tmp_path, capsys) -> None:
    """data.tokenizer=subword on one text stream: the vocabulary keeps newlines as pieces, the
    stream is the whole text's pieces, and qkv generate prints a continuation that, joined to
    the prompt, is the decoding of prompt + new ids (its first "▁word" keeps its space)."""
    text = tmp_path / "verse.txt"
    text.write_text("ROMEO:\nthe cat sat on the mat.\n\nJULIET:\nthe dog sat on the cat.\n" * 30)
    overrides = [
        f"data.text={text}",
        "data.tokenizer=subword",
        "data.vocab_size=30",
        "train.steps=40",
        "train.lr=0.01",
        "train.batch_size=8",
        *(f"model.{k}={v}" for k, v in {**TINY, "max_len": 17}.items()),
    ]
    summary = train_lm(load_recipe(RECIPE, overrides), tmp_path / "m", progress=False)
    tokenizer = summary["tokenizer"]
    valid = text.read_text()[int(len(text.read_text()) * 0.9) :]
    assert summary["val_tokens"] == len(tokenizer.encode(valid))
    assert tokenizer.decode(tokenizer.encode(valid)) == valid
    prompt = "ROMEO:\nthe"
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", prompt, "--max-new-tokens", "9"]) == 0
    printed = capsys.readouterr().out
    model, _ = load_model(tmp_path / "m")
    ids = list(continuation(model, tokenizer.encode(prompt), max_new_tokens=9, choose=most_likely, slide=True))
    assert tokenizer.id_to_token(ids[0]).startswith("▁")  # the case decoding the new ids alone got wrong
    assert prompt + printed == tokenizer.decode([*tokenizer.encode(prompt), *ids]) + "\n"


def test_evaluate_text_reads_documents_as_training_did(tmp_path, capsys) -> None:
    """A model trained with documents=lines: qkv evaluate --text on the validation file gives the
    validation loss of training (every line a document ending with END). A model whose
    config.json has no recipe (imported, older) reads the file as one stream, as before."""
    turns = ["hello , how are you ?", "fine , thanks . and you ?", "good . see you later .", "bye !"]
    train = tmp_path / "train.txt"
    train.write_text("\n".join(" __eou__ ".join(turns[i:] + turns[:i]) for i in range(4)) * 10 + "\n")
    valid = tmp_path / "valid.txt"
    valid.write_text("bye ! __eou__ hello , how are you ?\n\nfine , thanks . __eou__ good .\nsee you later .\n")
    overrides = [f"data.text={train}", f"data.valid_text={valid}", "data.documents=lines", "train.steps=5"]
    summary = train_lm(
        load_recipe(RECIPE, [*overrides, *(f"model.{k}={v}" for k, v in TINY.items())]), tmp_path / "m", progress=False
    )
    assert main(["evaluate", "--model", str(tmp_path / "m"), "--text", str(valid), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == summary["val_tokens"] == len(valid.read_text().replace("\n", "")) + 3  # 3 ENDs
    assert result["loss"] == pytest.approx(summary["val_loss"], abs=1e-4)

    config = tmp_path / "m" / "config.json"
    meta = json.loads(config.read_text())
    del meta["recipe"]
    config.write_text(json.dumps(meta))
    assert main(["evaluate", "--model", str(tmp_path / "m"), "--text", str(valid), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == len(valid.read_text())  # newlines are tokens


def test_dailydialog_documents_report_misaligned_labels(tmp_path, capsys) -> None:
    """documents=dailydialog: dialogues of both splits, each ending with END; a dialogue whose
    act labels do not line up is reported (file:line) and its text still used."""
    folder = tmp_path / "dd"
    folder.mkdir()
    dialogue = "hello , how are you ? __eou__ fine , thanks . __eou__ bye ! __eou__"
    for split, n in (("train", 30), ("validation", 2)):
        (folder / f"dialogues_{split}.txt").write_text(f"{dialogue}\n" * n)
        acts = ["2 1 4"] * n
        if split == "train":
            acts[6] = "2 1"  # one label short, as DailyDialog's line 7852
        (folder / f"dialogues_act_{split}.txt").write_text("\n".join(acts) + "\n")
    argv = ["train", RECIPE, "--out", str(tmp_path / "m"), "--quiet", "--json"]
    settings = [f"data.text={folder}", "data.documents=dailydialog", "data.tokenizer=subword", "data.vocab_size=30"]
    settings += ["train.steps=3", *(f"model.{k}={v}" for k, v in TINY.items())]
    for item in settings:
        argv += ["--set", item]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "dialogues_train.txt:7: 3 utterances but 2 act labels" in captured.err
    assert "its text is still used" in captured.err
    result = json.loads(captured.out.splitlines()[-1])
    assert result["val_loss"] > 0 and result["reply_loss"] > 0
    plain = [str(tmp_path / "m2") if a == str(tmp_path / "m") else a for a in argv if a != "--json"]
    assert main(plain) == 0  # without --json: the summary line names the replies scored
    assert "reply_loss=" in capsys.readouterr().out.splitlines()[-1]


def test_span_loss_equals_a_window_by_window_reference() -> None:
    """Each span's tokens are predicted from the context tokens before its end, at most the
    window: the same as running each window alone (spans at the stream's start included)."""
    torch.manual_seed(7)
    model = DecoderOnly(DecoderOnlyConfig(vocab_size=13, dropout=0.0, positions="learned", **TINY)).eval()
    ids = torch.randint(0, 13, (31,))
    spans, context = [(1, 4), (5, 9), (12, 17), (20, 31), (29, 30)], 11
    total, count = 0.0, 0
    for start, end in spans:
        first = max(0, end - 1 - context)
        logits = model(ids[first : end - 1][None])[0]  # (T, V)
        total += F.cross_entropy(logits[start - 1 - first :], ids[start:end], reduction="sum").item()
        count += end - start
    loss, scored = span_loss(model, ids, spans, context=context, batch_size=2)
    assert scored == count and loss == pytest.approx(total / count, rel=1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        span_loss(model, ids, [(3, 20)], context=context)


def test_reply_spans_are_the_replies_with_their_end_marker() -> None:
    """Every utterance but a dialogue's first, with its " __eou__", located in the dialogue
    token stream; the stream's length comes back to check against."""
    dialogues = [["hello , how are you ?", "fine , thanks .", "bye !"], ["good morning .", "morning !"]]
    tokenizer = Tokenizer.train_subword([" __eou__ ".join(d) + " __eou__" for d in dialogues] * 5, vocab_size=40)
    docs = [" __eou__ ".join(d) + " __eou__" for d in dialogues]
    ids = token_stream(tokenizer, docs, documents="dailydialog")
    spans, length = reply_spans(tokenizer, dialogues, context=40)
    assert length == len(ids)
    texts = [tokenizer.decode(ids[a:b].tolist()) for a, b in spans]
    assert texts == ["fine , thanks . __eou__", "bye ! __eou__", "morning ! __eou__"]
    assert reply_spans(tokenizer, dialogues, context=9)[0] == [s for s in spans if s[1] - s[0] <= 9] != spans
