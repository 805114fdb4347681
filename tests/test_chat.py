"""Chat: the dialogue kept within the window, and `qkv chat` read from a pipe."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import qkv.bundle
import qkv.chat
from qkv.chat import dialogue_context, reply
from qkv.checkpoint import load_model
from qkv.cli.main import main
from qkv.ensemble import Ensemble
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.tasks import load_recipe
from qkv.tasks.lm import train_lm
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
    """--sample --seed gives the same replies twice; the sampling options alone imply --sample."""
    argv = ["chat", "--model", str(chat_model), "--separator", "\\n", "--max-new-tokens", "8"]
    outputs = []
    for _ in range(2):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello there\nhow are you\n"), encoding="utf-8"))
        assert main([*argv, "--sample", "--top-k", "3", "--temperature", "1.5", "--seed", "7"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and len(outputs[0].splitlines()) == 2
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello there\nhow are you\n"), encoding="utf-8"))
    assert main([*argv, "--top-k", "3", "--temperature", "1.5", "--seed", "7"]) == 0
    assert capsys.readouterr().out == outputs[0]


def test_chat_separator_escapes_and_non_ascii_text(chat_model, capsys, monkeypatch) -> None:
    """--separator: only \\n, \\t and \\\\ are escapes; other text (non-ASCII, a final
    backslash) reaches the model as typed, so a reply can stop at it."""
    seen = []

    def fake_reply(bundle, turns, *, separator, **options):
        seen.append(separator)
        return "ok"

    monkeypatch.setattr(qkv.bundle, "reply", fake_reply)  # the library's chat job, which qkv chat calls
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


@pytest.mark.parametrize("max_new_tokens", [8, 30])
def test_decoder_only_chat_keeps_the_dialogue_within_the_window(chat_model, monkeypatch, max_new_tokens) -> None:
    """However long the dialogue grows, the context a decoder-only model is given plus the reply
    it may write fit its window (max_len 17), and the context is the newest turns, whole (but for
    a single turn longer than the room, which keeps its end)."""
    model, meta = load_model(chat_model)
    vocab = Vocabularies.load(chat_model, files=meta["files"])
    window = model.config.max_len
    real = qkv.chat.continuation
    seen: list[tuple[list[int], int]] = []

    def recording(model, prompt, *, max_new_tokens, choose):
        seen.append((list(prompt), max_new_tokens))
        return real(model, prompt, max_new_tokens=max_new_tokens, choose=choose)

    monkeypatch.setattr(qkv.chat, "continuation", recording)
    turns: list[str] = []
    for turn in ["hello there", "how are you", "fine thanks"] * 3:
        turns.append(turn)
        turns.append(reply(model, vocab, turns, separator="\n", max_new_tokens=max_new_tokens))
        prompt, new = seen[-1]
        assert prompt and len(prompt) + new - 1 <= window, (len(prompt), new)
        text = vocab.source.decode(prompt)
        before = turns[:-1]  # the dialogue the reply answered
        whole = {"".join(f"{t}\n" for t in before[i:]) for i in range(len(before))}
        assert text in whole or (len(text) == len(prompt) and f"{before[-1]}\n".endswith(text)), text
    assert len(vocab.source.encode("".join(f"{t}\n" for t in turns))) > window  # it did outgrow the window


def _terminal_chat(model: Path, history: Path, keys: list[bytes]) -> tuple[int, str]:
    """Run ``qkv chat`` in a pseudo-terminal, typing each of ``keys`` at its next "you> " prompt;
    its exit status and everything it wrote."""
    import os
    import pty
    import select
    import subprocess
    import time

    env = {**os.environ, "QKV_CHAT_HISTORY": str(history), "QKV_MALLOC": "default", "TERM": "xterm"}
    main_fd, child_fd = pty.openpty()
    argv = [sys.executable, "-m", "qkv", "chat", "--model", str(model), "--separator", "\\n", "--max-new-tokens", "5"]
    process = subprocess.Popen(argv, stdin=child_fd, stdout=child_fd, stderr=child_fd, env=env, close_fds=True)
    os.close(child_fd)
    out = b""
    sent = 0
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            # The next keys go in once every line typed so far is answered and a new prompt is shown.
            tail = out[out.rfind(b"bot> ") + 1 :] if sent else out
            if keys and out.count(b"bot> ") == sent and b"you> " in tail:
                os.write(main_fd, keys.pop(0))
                sent += 1
            ready, _, _ = select.select([main_fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(main_fd, 4096)
                except OSError:  # the terminal closed: the chat ended
                    break
                if not chunk:
                    break
                out += chunk
            elif process.poll() is not None:
                break
        return process.wait(timeout=30), out.decode("utf-8", "replace")
    finally:
        os.close(main_fd)
        if process.poll() is None:
            process.kill()


def test_interactive_chat_edits_lines_and_keeps_history(chat_model, tmp_path) -> None:
    """In a terminal, qkv chat reads turns with readline: Ctrl-A moves to the start of the line,
    Ctrl-P recalls the previous line, also one typed in an earlier chat (the history file,
    $QKV_CHAT_HISTORY); an empty line ends the chat."""
    pytest.importorskip("readline")
    history = tmp_path / "history"
    # "there", Ctrl-A, "hello ": the line "hello there"; then Ctrl-P (recall it); then an empty line.
    status, out = _terminal_chat(chat_model, history, [b"there\x01hello \r", b"\x10\r", b"\r"])
    assert status == 0, out
    assert out.count("bot> ") == 2, out  # the recalled line was a turn (an empty one ends the chat)
    assert history.read_text().splitlines() == ["hello there"]  # (readline keeps one of two equal lines in a row)
    # A new chat: Ctrl-P at once recalls the line of the chat before.
    status, out = _terminal_chat(chat_model, history, [b"\x10\r", b"fine thanks\r", b"\r"])
    assert status == 0 and out.count("bot> ") == 2, out
    assert history.read_text().splitlines() == ["hello there", "fine thanks"]


def test_a_history_that_cannot_be_read_is_left_as_it_is(tmp_path, monkeypatch, capsys) -> None:
    """An unreadable history file (here a directory) is a note on stderr, and the chat does not
    write over it at the end (that would lose the lines it holds)."""
    pytest.importorskip("readline")
    from qkv.cli.chat import CHAT_HISTORY, _chat_history

    history = tmp_path / "history"
    history.mkdir()
    (history / "kept").write_text("x")
    monkeypatch.setenv(CHAT_HISTORY, str(history))
    _chat_history()()
    assert "cannot read the history" in capsys.readouterr().err
    assert (history / "kept").read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["history"]
