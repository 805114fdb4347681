"""Continuous batching: requests that join and leave a running decoding between its steps.

What is proven: on tiny random decoder-only models (Llama-like: RoPE, SwiGLU, RMSNorm, grouped
-query attention; Mistral-like with a sliding window; GPT-like with learned positions), every
group of rows decoded in a :class:`~qkv.decoding.Continuous` decoding gets, step by step, the
logits and greedy tokens it gets decoded alone (``decoding.stream``), while groups join at
later steps (longer and shorter prompts than the running cache) and leave early (at their cap,
or by the caller); a model that cannot regroup rows is refused. Through the real server on a
socket and the real ``openai`` client: two streamed chats, the second sent once the first streams, the second
joining the first's running batch, both equal their answers asked alone.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
import torch

from qkv.checkpoint import save_model
from qkv.decoding import DONE, Continuous, most_likely, stream
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.tokenization import FILE, Tokenizer
from serving import CHARACTERS, Server

LLAMA = {"positions": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "n_kv_heads": 1}
FAMILIES = {
    "llama": LLAMA,
    "mistral": {**LLAMA, "sliding_window": 5},
    "gpt": {"positions": "learned"},
}


def shaken(config: DecoderOnlyConfig, seed: int) -> DecoderOnly:
    """A random model whose weights are shaken so that it writes varied tokens (a fresh one
    repeats one), ready for decoding."""
    torch.manual_seed(seed)
    model = DecoderOnly(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * (0.5 if p.dim() > 1 else 0.1))
    return model


def tiny(family: str) -> DecoderOnly:
    config = DecoderOnlyConfig(
        vocab_size=53, n_layers=2, max_len=61, d_model=18, n_heads=3, d_ff=23, dropout=0.0, eos_id=2,
        **FAMILIES[family],
    )  # fmt: skip
    return shaken(config, seed=7)


def recorded(log: list[torch.Tensor]):
    """Greedy, keeping every step's logits. Shapes: (n, V) -> (n,)."""

    def choose(logits: torch.Tensor) -> torch.Tensor:
        log.append(logits.clone())
        return most_likely(logits)

    return choose


def alone(model: DecoderOnly, prompts: list[list[int]], cap: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tokens (n,) and logits (n, V) of every step of ``prompts`` decoded as their own batch."""
    logits: list[torch.Tensor] = []
    return list(stream(model, prompts, max_new_tokens=cap, choose=recorded(logits))), logits


PROMPTS = {  # name: (prompts of the group, cap, the step at which it joins)
    "a": ([[5, 9, 14, 3, 22, 7, 30]], 12, 0),
    "b": ([[11, 4]], 4, 0),  # leaves early, at its cap
    "c": ([[8, 17, 25, 40, 6, 12, 33, 19, 27, 44, 10, 15, 21, 36, 9, 4, 50, 13]], 9, 3),  # longer than the cache
    "d": ([[31, 3, 20], [45]], 10, 6),  # one request of two rows, after b has left
    "e": ([[7, 7, 26, 39, 12]], 20, 6),  # its caller leaves after 5 steps
}


@pytest.mark.parametrize("family", FAMILIES)
def test_groups_that_join_and_leave_decode_as_they_do_alone(family: str) -> None:
    model = tiny(family)
    decoding = Continuous(model)
    groups, tokens, logits = {}, {name: [] for name in PROMPTS}, {name: [] for name in PROMPTS}
    step = 0
    while step == 0 or decoding.groups:
        for name, (prompts, cap, at) in PROMPTS.items():
            if at == step:
                groups[name] = decoding.join(prompts, max_new_tokens=cap, choose=recorded(logits[name]))
        if step == 5 + PROMPTS["e"][2]:
            decoding.leave(groups["e"])
        for group, chosen in decoding.step():
            tokens[next(n for n, g in groups.items() if g is group)].append(chosen)
        step += 1
    assert step > max(at for _, _, at in PROMPTS.values()) + 5
    for name, (prompts, cap, _) in PROMPTS.items():
        solo_tokens, solo_logits = alone(model, prompts, cap)
        n = len(tokens[name])
        assert n == (5 if name == "e" else len(solo_tokens)), name
        assert torch.equal(torch.stack(tokens[name]), torch.stack(solo_tokens[:n])), name
        assert (torch.stack(logits[name]) - torch.stack(solo_logits[:n])).abs().max() <= 1e-4, name
    assert len(tokens["b"]) == 4 and DONE not in torch.stack(tokens["b"])  # b left at its cap, before a


def test_a_model_that_cannot_regroup_is_refused() -> None:
    config = EncoderDecoderConfig(
        src_vocab_size=7, tgt_vocab_size=7, n_encoder_layers=1, n_decoder_layers=1, d_model=6, n_heads=2, d_ff=5
    )
    with pytest.raises(ValueError, match="regroup"):
        Continuous(EncoderDecoder(config))


# ------------------------------------------------------------------------ through the server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``qkv serve`` of a random language model wide enough (a step takes a millisecond or more)
    and answers long enough (300 tokens) that a request sent once another streams finds it decoding."""
    root = tmp_path_factory.mktemp("continuous")
    tokenizer = Tokenizer.train_char_level([CHARACTERS + "abcdefghijklmnopqrstuvwxyz:|?_"])
    tokenizer.save(root / FILE)
    template = root / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}|{% endfor %}", encoding="utf-8")
    config = DecoderOnlyConfig(
        vocab_size=tokenizer.vocab_size, n_layers=3, max_len=331, d_model=138, n_heads=3, d_ff=367, dropout=0.0,
        pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=None, **LLAMA,
    )  # fmt: skip
    files = {FILE: root / FILE, "chat_template.jinja": template}
    path = save_model(shaken(config, seed=1), root / "talk", files=files)
    served = Server([path], "--max-new-tokens", "300", cwd=root)
    yield served
    served.stop()


def joined_pairs(server: Server) -> int:
    """How many times a request joined a decoding of one other (qkv_batch_requests' bucket 2 less 1)."""
    text = httpx.get(f"{server.url}/metrics").text
    bucket = {m[0]: float(m[1]) for m in re.findall(r'qkv_batch_requests_bucket\{le="([\d.]+)"\} ([\d.e+]+)', text)}
    return int(bucket["2.0"] - bucket["1.0"])


def test_a_chat_joins_a_running_batch_and_both_answer_as_alone(server) -> None:
    """A long chat, and a short one sent once the long one's first piece has streamed (it is
    decoding: a fixed delay raced its 300 steps on a loaded machine): the short one joins the long
    one's batch, ends (its stream closed) while the long one goes on, and both answer as they do alone."""
    openai = pytest.importorskip("openai", reason="needs the openai client (pip install -e .[dev])")
    asks = (("Hello there, über 北京?", 300), ("A dog runs", 40))

    async def chat(
        client, question: str, tokens: int, *, after: asyncio.Event | None = None, started: asyncio.Event | None = None
    ) -> tuple[str, str | None, float]:
        if after is not None:
            await after.wait()
        chunks = await client.chat.completions.create(
            model="talk",
            messages=[{"role": "user", "content": question}],
            max_tokens=tokens,
            temperature=0,
            stream=True,
        )
        text, finish = "", None
        async for chunk in chunks:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
            if started is not None and text:
                started.set()
        return text, finish, time.monotonic()

    async def run() -> tuple[list, list]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as client:
            solo = [await chat(client, q, n) for q, n in asks]
            decoding = asyncio.Event()  # set by the long chat's first streamed piece
            together = await asyncio.gather(
                chat(client, *asks[0], started=decoding), chat(client, *asks[1], after=decoding)
            )
            return solo, list(together)

    before = joined_pairs(server)
    solo, together = asyncio.run(run())
    assert joined_pairs(server) == before + 1  # the short one joined the long one while it decoded
    assert [t[:2] for t in together] == [t[:2] for t in solo]
    assert all(finish == "length" and len(text) > 20 for text, finish, _ in solo)
    assert together[1][2] < together[0][2]  # the short one's stream ended first
