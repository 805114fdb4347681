"""``/v1/generate`` and ``/v1/chat`` on continuous batching, in-process with the real app and a
tiny random language model: requests sent at once, streamed and whole, greedy, of different
lengths, are decoded in one running batch (the batch-size histogram sees it), and each answer is
the one it gets alone, which is the library's; what the batch cannot hold (a chat whose separator
is only spaces) is still the library's answer."""

from __future__ import annotations

import json
import re
import threading

import pytest

import qkv
from qkv.bundle import continued, reply
from qkv.serve.models import load_served
from qkv.serve.settings import Settings
from serving import app_client, sse_events, tiny_models

# A wait long enough for every request sent at once to arrive before the batch starts.
TOGETHER = Settings(batch_wait_ms=500, max_new_tokens=40, timeout_s=60)
GENERATIONS = [
    {"prompt": "A dog", "max_new_tokens": 8},
    {"prompt": "Grüße aus", "max_new_tokens": 6, "stream": True},
    {"prompt": "北京", "max_new_tokens": 11},
    {"prompt": "", "max_new_tokens": 5, "stream": True},
]
CHAT = {"messages": ["hello", "你好"], "max_new_tokens": 5}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("one_batcher"))["lm"]


@pytest.fixture(scope="module")
def served(lm):
    return load_served([str(lm)])


@pytest.fixture(scope="module")
def client(served):
    with app_client(served, TOGETHER) as c:
        yield c


@pytest.fixture(scope="module")
def alone_client(served):
    """The default wait (5 ms): a request sent alone starts at once."""
    with app_client(served, Settings(max_new_tokens=40, timeout_s=60)) as c:
        yield c


def answer(client, path: str, body: dict) -> tuple[str, int | None]:
    """A request's text (and tokens: a generation's), streamed or whole."""
    got = client.post(path, json=body)
    assert got.status_code == 200, got.text
    if path == "/v1/chat":
        return got.json()["reply"], None
    if body.get("stream"):
        *pieces, (name, done) = sse_events(got.text)
        done = json.loads(done)
        assert name == "done" and done["text"] == "".join(json.loads(d)["text"] for _, d in pieces)
        return done["text"], done["tokens"]
    return got.json()["text"], got.json()["tokens"]


def batched(client) -> int:
    """How many times requests joined a decoding that held more than one (qkv_batch_requests'
    observations above 1)."""
    text = client.get("/metrics").text
    bucket = {m[0]: float(m[1]) for m in re.findall(r'qkv_batch_requests_bucket\{le="([^"]+)"\} ([\d.e+]+)', text)}
    return int(bucket["+Inf"] - bucket["1.0"])


def test_concurrent_generations_are_decoded_together_each_as_alone(client, alone_client, lm) -> None:
    asked = [("/v1/generate", body) for body in GENERATIONS] + [("/v1/chat", CHAT)]
    alone = [answer(alone_client, path, body) for path, body in asked]
    before = batched(client)
    together: dict[int, tuple[str, int | None]] = {}
    threads = [
        threading.Thread(target=lambda i=i, path=path, body=body: together.__setitem__(i, answer(client, path, body)))
        for i, (path, body) in enumerate(asked)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert batched(client) > before  # at least one step decoded several of them as one batch
    assert [together[i] for i in range(len(asked))] == alone
    bundle = qkv.load(lm)
    for body, (text, tokens) in zip(GENERATIONS, alone[:-1], strict=True):  # alone: the library's answer
        assert text == "".join(continued(bundle, body["prompt"], max_new_tokens=body["max_new_tokens"]))
        assert tokens <= body["max_new_tokens"]
    assert alone[-1][0] == reply(bundle, CHAT["messages"], max_new_tokens=5)


@pytest.mark.parametrize("separator", [" ", "\n", " | "])
def test_a_chat_with_any_separator_is_the_librarys(alone_client, lm, separator) -> None:
    """A separator of spaces only is cut where the raw text holds it, as ``qkv chat`` cuts it
    (decoded alone); another is decoded in the batch, stopped at its text."""
    body = {"messages": ["hello", "A dog"], "max_new_tokens": 8, "separator": separator}
    got = alone_client.post("/v1/chat", json=body)
    assert got.status_code == 200, got.text
    assert got.json()["reply"] == reply(qkv.load(lm), body["messages"], separator=separator, max_new_tokens=8)
