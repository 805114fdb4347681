"""Chat: the dialogue kept within the window, and `qkv chat` read from a pipe."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import qkv.chat
from qkv.chat import dialogue_context, reply
from qkv.checkpoint import load_model
from qkv.cli import main
from qkv.generation import Ensemble
from qkv.lm import train_lm
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.recipes import load_recipe
from qkv.tokenization import Tokenizer, Vocabularies

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "shakespeare_char_cpu.yaml")


def test_dialogue_context_keeps_the_newest_turns_that_fit() -> None:
    tokenizer = Tokenizer.train_char_level(["abcdefghij |"])
    turns = ["abc", "defg", "hij"]
    assert tokenizer.decode(dialogue_context(turns, tokenizer, room=100, separator="|")) == "abc|defg|hij|"
    assert tokenizer.decode(dialogue_context(turns, tokenizer, room=9, separator="|")) == "defg|hij|"
    assert tokenizer.decode(dialogue_context(turns, tokenizer, room=3, separator="|")) == "ij|"
    with pytest.raises(ValueError):
        dialogue_context(turns, tokenizer, room=0, separator="|")


def test_a_tokenizer_that_ends_sources_ends_the_dialogue_once(monkeypatch) -> None:
    """A converted Marian tokenizer adds END to every text it encodes: the dialogue's turns are
    encoded without it, and an encoder-decoder's source ends with exactly one END, within the
    window."""
    from tokenizers import processors

    tokenizer = Tokenizer.train_char_level(["abcdefghij |"])
    plain = dialogue_context(["abc", "defg"], tokenizer, room=100, separator="|")
    tokenizer.backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", tokenizer.eos_id)]
    )
    tokenizer.add_special_tokens = True
    assert tokenizer.encode("abc")[-1] == tokenizer.eos_id  # the tokenizer does add END
    assert dialogue_context(["abc", "defg"], tokenizer, room=100, separator="|") == plain
    seen = []

    def fake_beam_search(model, inputs, *, beam_size, max_new_tokens):
        seen.append(inputs[0])
        return [[SimpleNamespace(tokens=[])]]

    monkeypatch.setattr(qkv.chat, "beam_search", fake_beam_search)
    config = EncoderDecoderConfig(
        src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size, d_model=6, n_heads=2, d_ff=5,
        n_encoder_layers=1, n_decoder_layers=1, max_len=7,
        pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
    )  # fmt: skip
    model = EncoderDecoder(config)
    reply(model, tokenizer, ["abc", "defg"], separator="|", max_new_tokens=3)
    assert seen == [[*plain[-5:], tokenizer.eos_id]]  # "defg|" (the newest turn that fits), one END
    assert seen[0].count(tokenizer.eos_id) == 1


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    text = root / "dialogue.txt"
    text.write_text("hello there\nhow are you\nfine thanks\n" * 60)
    overrides = [f"data.text={text}", "train.steps=60", "train.batch_size=8", "train.lr=0.01"]
    overrides += ["model.d_model=15", "model.n_heads=3", "model.d_ff=7", "model.n_layers=1", "model.max_len=17"]
    train_lm(load_recipe(RECIPE, overrides), root / "model", progress=False)
    return root / "model"


def test_chat_from_a_pipe_answers_each_turn(chat_model, capsys, monkeypatch) -> None:
    """One reply line per input line, even when the dialogue outgrows the 17-token window."""
    lines = "hello there\nhow are you\nhello there\nhow are you\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines.encode()), encoding="utf-8"))
    assert main(["chat", "--model", str(chat_model), "--separator", "\\n", "--max-new-tokens", "12"]) == 0
    replies = capsys.readouterr().out.splitlines()
    assert len(replies) == 4
    assert all(len(r) <= 12 for r in replies)


def test_an_ensemble_of_one_chats_as_its_model(chat_model) -> None:
    """reply() takes an ensemble as it takes a model: decoder-only members continue the dialogue."""
    model, meta = load_model(chat_model)
    tokenizer = Vocabularies.load(chat_model, files=meta["files"])
    turns = ["hello there", "how are you"]
    alone = reply(model, tokenizer, turns, separator="\n", max_new_tokens=12)
    assert alone and reply(Ensemble((model,)), tokenizer, turns, separator="\n", max_new_tokens=12) == alone


def test_chat_with_an_encoder_decoder(tmp_path, capsys, monkeypatch) -> None:
    """An encoder-decoder reads the dialogue as its source; one reply line per turn."""
    import torch

    from qkv.checkpoint import save_model
    from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
    from qkv.tokenization import FILE

    tokenizer = Tokenizer.train_word_level(["hello there how are you fine thanks"])
    tokenizer.save(tmp_path / FILE)
    torch.manual_seed(5)
    v = tokenizer.vocab_size
    config = EncoderDecoderConfig(
        src_vocab_size=v, tgt_vocab_size=v, d_model=15, n_heads=3, d_ff=7, n_encoder_layers=1, n_decoder_layers=1,
        max_len=11, dropout=0.0,
    )  # fmt: skip
    save_model(EncoderDecoder(config), tmp_path / "m", files={FILE: tmp_path / FILE})
    lines = "hello there\nhow are you\nfine thanks\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines.encode()), encoding="utf-8"))
    assert main(["chat", "--model", str(tmp_path / "m"), "--max-new-tokens", "4"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_chat_sampling_is_reproducible_with_a_seed(chat_model, capsys, monkeypatch) -> None:
    """--sample --seed gives the same replies twice; sampling options without --sample are refused."""
    argv = ["chat", "--model", str(chat_model), "--separator", "\\n", "--max-new-tokens", "8"]
    outputs = []
    for _ in range(2):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello there\nhow are you\n"), encoding="utf-8"))
        assert main([*argv, "--sample", "--top-k", "3", "--temperature", "1.5", "--seed", "7"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and len(outputs[0].splitlines()) == 2
    assert main([*argv, "--top-p", "0.9"]) == 2
    assert "only apply with --sample" in capsys.readouterr().err


def test_chat_separator_escapes_and_non_ascii_text(chat_model, capsys, monkeypatch) -> None:
    """--separator: only \\n, \\t and \\\\ are escapes; other text (non-ASCII, a final
    backslash) reaches the model as typed, so a reply can stop at it."""
    seen = []

    def fake_reply(model, tokenizer, turns, *, separator, **options):
        seen.append(separator)
        return "ok"

    monkeypatch.setattr(qkv.chat, "reply", fake_reply)
    cases = {"。": "。", " __eou__ ": " __eou__ ", "\\n": "\n", "a\\tb": "a\tb", "\\\\n": "\\n", "x\\": "x\\"}
    cases["\\d é"] = "\\d é"
    for given, meant in cases.items():
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello\n"), encoding="utf-8"))
        assert main(["chat", "--model", str(chat_model), "--separator", given]) == 0, given
        assert seen.pop() == meant
    capsys.readouterr()


def test_chat_names_the_stdin_line_with_invalid_utf8(chat_model, capsys, monkeypatch) -> None:
    """Bytes that are not UTF-8 on a later line: the turns before are answered, then one line
    naming the line, exit status 2."""
    raw = b"hello there\nhow \xff are you\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8"))
    assert main(["chat", "--model", str(chat_model), "--separator", "\\n", "--max-new-tokens", "4"]) == 2
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 1
    assert captured.err.startswith("qkv chat: error: <stdin>:2: not valid UTF-8") and captured.err.count("\n") == 1
