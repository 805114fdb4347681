"""The server's API, with httpx: in-process (Starlette's TestClient, an httpx client over the
ASGI app) for every endpoint, limit and error; one real ``qkv serve`` on a loopback port for
Server-Sent Events over the wire, a full server (429), a client that disconnects mid-stream and
SIGTERM; the dynamic batcher on its own; what the server computes equals what the library (and
so the command line) computes for the same input."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from qkv.chat import reply
from qkv.cli.main import main
from qkv.decoding import beam_search
from qkv.embedding import sentence_embeddings
from qkv.inspection import attention_maps, beam_trace
from qkv.seq2seq import translate
from qkv.serve.app import create_app
from qkv.serve.batching import Batcher, Job
from qkv.serve.models import load_served
from qkv.serve.settings import Settings
from qkv.tasks.bert import predict_labels
from serving import Server, sse_events, tiny_models

LIMITS = Settings(max_body_bytes=4096, max_chars=200, max_texts=4, max_new_tokens=40, max_beam=5, timeout_s=20)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def served(paths):
    return load_served([str(p) for p in paths.values()])


@pytest.fixture(scope="module")
def client(served):
    with TestClient(create_app(served, LIMITS)) as c:
        yield c


def error(response, code: int, kind: str | None = None) -> str:
    """The JSON error's message, after checking its status and shape."""
    assert response.status_code == code, response.text
    body = response.json()["error"]
    assert body["code"] == code and body["message"]
    if kind is not None:
        assert body["type"] == kind, body
    return body["message"]


# ----------------------------------------------------------------------------- the service


def test_models_health_and_page(client):
    models = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
    assert {n: m["kind"] for n, m in models.items()} == {
        "de_en": "encoder_decoder",
        "lm": "decoder_only",
        "acts": "encoder_only",
    }
    assert models["de_en"]["endpoints"] == ["/v1/translate", "/v1/chat", "/v1/attention"]
    assert models["acts"]["labels"] == ["inform", "question"] and models["lm"]["window"] == 17
    assert models["de_en"]["layers"] == {"encoder": 2, "decoder": 2} and models["de_en"]["heads"] == 3
    assert all(m["example"] and m["task"] is None for m in models.values())  # saved by hand: no recipe
    assert client.get("/health").json() == {"status": "ok", "models": 3, "active": 0, "waiting": 0}
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/app.js">' in page.text and "cdn" not in page.text.lower()
    assert client.get("/app.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/style.css").status_code == 200
    schema = client.get("/openapi.json").json()
    assert {"/v1/translate", "/v1/generate", "/v1/chat", "/v1/embed", "/v1/classify", "/v1/attention"} <= set(
        schema["paths"]
    )


def test_translate_is_the_library_translation(client, served):
    texts = ["Ein Hund läuft über die Wiese.", "你好世界", ""]
    got = client.post("/v1/translate", json={"text": texts, "beam_size": 3, "nbest": 2, "length_penalty": 0.6})
    assert got.status_code == 200, got.text
    m = served["de_en"]
    want = translate(m.model, m.vocab, texts, beam_size=3, nbest=2, length_penalty=0.6)
    assert got.json()["model"] == "de_en"
    for found, hyps in zip(got.json()["translations"], want, strict=True):
        assert [h["text"] for h in found] == [h.text for h in hyps if h.score != float("-inf")]
        assert [h["score"] for h in found] == pytest.approx([h.score for h in hyps if h.score != float("-inf")])
    one = client.post("/v1/translate", json={"text": texts[0], "beam_size": 3, "nbest": 2, "length_penalty": 0.6})
    (alone,) = one.json()["translations"]  # unpadded: the same outputs, scores equal up to rounding
    assert [h["text"] for h in alone] == [h["text"] for h in got.json()["translations"][0]]
    assert [h["score"] for h in alone] == pytest.approx([h["score"] for h in got.json()["translations"][0]])


def test_generate_is_greedy_continuation_and_streams_the_same_text(client, served):
    m = served["lm"]
    whole = client.post("/v1/generate", json={"prompt": "Grüße aus", "max_new_tokens": 6}).json()
    prompt = m.vocab.source.encode("Grüße aus")
    (ids,) = beam_search(m.model, [prompt], beam_size=1, max_new_tokens=6)[0][:1]
    assert whole["text"] == m.vocab.target.decode([*prompt, *ids.tokens])[len("Grüße aus") :]
    assert whole["tokens"] == len(ids.tokens)
    # Past the window (17 tokens): the stream slides on, and the last event holds the whole text.
    body = {"prompt": "Grüße aus 北京", "max_new_tokens": 30, "stream": True}
    streamed = client.post("/v1/generate", json=body)
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert [e for e, _ in events[:-1]] == ["token"] * (len(events) - 1) and events[-1][0] == "done"
    done = json.loads(events[-1][1])
    assert done["text"] == "".join(json.loads(d)["text"] for _, d in events[:-1])
    alone = client.post("/v1/generate", json={**body, "stream": False}).json()
    assert alone["text"] == done["text"] and alone["tokens"] == done["tokens"]


def test_the_stream_is_what_qkv_generate_prints(client, paths, capsys):
    """The command and the server stream through one library function (streaming.continuation_text)."""
    body = {"model": "lm", "prompt": "Grüße aus 北京", "max_new_tokens": 30, "stream": True}
    done = json.loads(sse_events(client.post("/v1/generate", json=body).text)[-1][1])
    assert main(["generate", "--model", str(paths["lm"]), "--prompt", body["prompt"], "--max-new-tokens", "30"]) == 0
    assert capsys.readouterr().out == done["text"] + "\n"


def test_sampling_with_a_seed_is_reproducible(client):
    body = {"prompt": "A dog", "max_new_tokens": 8, "temperature": 1.5, "top_k": 20, "seed": 7}
    first = client.post("/v1/generate", json=body).json()["text"]
    assert client.post("/v1/generate", json=body).json()["text"] == first
    streamed = client.post("/v1/generate", json={**body, "stream": True})
    assert json.loads(sse_events(streamed.text)[-1][1])["text"] == first


@pytest.mark.parametrize("name", ["de_en", "lm"])
def test_chat_is_the_library_reply(client, served, name):
    m = served[name]
    turns = ["Grüße aus 北京", "你好"]
    got = client.post("/v1/chat", json={"model": name, "messages": turns, "max_new_tokens": 5, "beam_size": 2})
    assert got.status_code == 200, got.text
    assert got.json()["reply"] == reply(m.model, m.vocab, turns, separator=" __eou__ ", max_new_tokens=5, beam_size=2)


def test_embed_and_classify_are_the_library_ones(client, served):
    m = served["acts"]
    texts = ["Ein Hund.", "你好世界", "A dog runs"]
    got = client.post("/v1/embed", json={"text": texts, "pooling": "max", "normalize": True}).json()
    want, _ = sentence_embeddings(m.model, m.vocab.source, texts, pooling="max", normalize=True)
    assert torch.allclose(torch.tensor(got["embeddings"]), want, atol=1e-6)
    assert "max pooling, normalized" in got["settings"]
    labels = client.post("/v1/classify", json={"text": texts}).json()["labels"]
    assert labels == predict_labels(m.model, m.vocab.source, texts, labels=["inform", "question"])


def test_every_job_answers_what_the_commands_job_function_answers(client, paths):
    """The server and the command line share one library function per job (qkv.bundle's), on
    a model loaded apart by qkv.load as a command loads it."""
    import qkv
    from qkv.bundle import Sampling, continued, embeddings, reply, translations

    de_en, lm, acts = (qkv.load(paths[n]) for n in ("de_en", "lm", "acts"))
    texts = ["Ein Hund läuft.", "你好"]
    got = client.post("/v1/translate", json={"text": texts, "beam_size": 2, "nbest": 2}).json()["translations"]
    want = translations(de_en, texts, beam_size=2, nbest=2, max_len_a=1.5, max_len_b=10)
    assert [[h["text"] for h in hyps] for hyps in got] == [[h.text for h in hyps] for hyps in want]
    body = {"model": "lm", "prompt": "A dog", "max_new_tokens": 12, "top_k": 5, "seed": 3}
    drawn = "".join(continued(lm, "A dog", max_new_tokens=12, sampling=Sampling(top_k=5, seed=3)))
    assert client.post("/v1/generate", json=body).json()["text"] == drawn
    chat = {"model": "de_en", "messages": ["hello", "你好"], "max_new_tokens": 6, "beam_size": 2}
    assert client.post("/v1/chat", json=chat).json()["reply"] == reply(
        de_en, chat["messages"], max_new_tokens=6, beam_size=2
    )
    vectors = client.post("/v1/embed", json={"text": texts, "pooling": "cls"}).json()["embeddings"]
    assert torch.allclose(torch.tensor(vectors), embeddings(acts, texts, pooling="cls").vectors, atol=1e-6)


def test_attention_of_an_encoder_decoder_every_layer_and_head(client, served):
    m = served["de_en"]
    text = "Grüße aus 北京"
    got = client.post("/v1/attention", json={"model": "de_en", "text": text, "beam_size": 3, "trace": True})
    assert got.status_code == 200, got.text
    view = got.json()
    src = m.vocab.source.encode(text)
    best = translate(m.model, m.vocab, [text], beam_size=3, max_len_a=1.5, max_len_b=10)[0][0]
    assert view["output"] == best.text and view["trace"]["hypotheses"][0]["text"] == best.text
    s, t = len(src), len(best.tokens) + 1
    assert view["source_tokens"] == [m.vocab.source.id_to_token(i) for i in src]
    assert len(view["target_tokens"]) == len(view["predicted_tokens"]) == t
    assert view["target_tokens"][0] == "<s>" and view["predicted_tokens"][-1] == "</s>"
    assert (view["layers"], view["heads"]) == (2, 3)
    encoder, decoder, cross = (torch.tensor(view[k]) for k in ("encoder", "decoder", "cross"))
    assert encoder.shape == (2, 3, s, s) and decoder.shape == (2, 3, t, t) and cross.shape == (2, 3, t, s)
    for maps in (encoder, decoder, cross):
        assert torch.allclose(maps.sum(-1), torch.ones(maps.shape[:-1]), atol=1e-3)  # every row a distribution
    assert decoder.triu(1).abs().max() == 0  # masked: no step sees a later one
    # The model served the request on its fused path; the maps are the explicit path's, and
    # equal the cross-attention the decoder itself returns.
    want = attention_maps(m.model, src, best.tokens)
    assert torch.allclose(cross, torch.stack(want.cross), atol=1e-4)
    mem = m.model.encode(torch.tensor([src]))
    out = m.model.decode(torch.tensor([[1, *best.tokens]]), mem, src_mask=None, need_weights=True)
    assert torch.allclose(cross[-1], out.attention[-1][0], atol=1e-4)
    hooked = [x for x in m.model.modules() if x._forward_hooks or x._forward_pre_hooks]
    assert not hooked  # the hooks that forced the explicit path are gone


def test_attention_of_the_other_kinds(client, served):
    lm = client.post("/v1/attention", json={"model": "lm", "text": "A dog", "max_new_tokens": 4}).json()
    t = len(lm["target_tokens"])
    assert lm["encoder"] is None and lm["cross"] is None and t == len(lm["predicted_tokens"]) <= 5 + 4
    assert torch.tensor(lm["decoder"]).shape == (2, 3, t, t)
    given = client.post("/v1/attention", json={"model": "lm", "text": "A dog", "output": " runs"}).json()
    assert "".join(given["target_tokens"]) == "A dog runs"
    bert = client.post("/v1/attention", json={"model": "acts", "text": "你好"}).json()
    assert bert["source_tokens"] == ["<s>", "你", "好", "</s>"] and torch.tensor(bert["encoder"]).shape == (2, 3, 4, 4)


def test_the_beam_trace_is_beam_search(served):
    m = served["de_en"]
    for text in ("Ein Hund", "你好世界", "0123"):
        src = m.vocab.source.encode(text)
        for beam in (1, 2, 4):
            traced = beam_trace(m.model, src, beam_size=beam, max_new_tokens=12, length_penalty=0.6)
            found = beam_search(m.model, [src], beam_size=beam, max_new_tokens=12, length_penalty=0.6, nbest=beam)[0]
            assert [h.tokens for h in traced.hypotheses[:beam]] == [h.tokens for h in found]
            assert [h.score for h in traced.hypotheses[:beam]] == pytest.approx([h.score for h in found])
            for step in traced.steps:
                assert len(step.live) <= beam and all(h.score > float("-inf") for h in step.live)
                assert step.step == 0 or all(h.parent is not None for h in step.live)


# ----------------------------------------------------------------------------- limits and errors


def test_body_too_large_is_413(client):
    error(client.post("/v1/translate", json={"text": "x" * 5000}), 413, "too_large")

    def chunked():  # no Content-Length: the body is counted as it arrives
        for _ in range(10):
            yield b" " * 1000

    error(client.post("/v1/translate", content=chunked(), headers={"content-type": "application/json"}), 413)


@pytest.mark.parametrize(
    ("path", "body", "kind", "says"),
    [
        ("/v1/translate", {"text": "x" * 201}, "too_long", "201 characters; at most 200"),
        ("/v1/translate", {"text": "x" * 98, "beam_size": 1}, "too_long", "98 tokens"),  # the model's window is 97
        ("/v1/translate", {"text": ["a"] * 5, "beam_size": 1}, "too_many", "5 texts in one request; at most 4"),
        ("/v1/translate", {"text": "a", "beam_size": 6}, "too_many", "beam_size 6"),
        ("/v1/translate", {"text": "a", "beam_size": 2, "nbest": 3}, "invalid_request", "nbest 3"),
        ("/v1/translate", {"text": "a", "beam_size": 0}, "invalid_request", "beam_size"),
        ("/v1/translate", {"text": "a", "max_len_a": 0, "max_len_b": 0}, "invalid_request", "no room for a token"),
        ("/v1/translate", {"text": "a", "speed": "fast"}, "invalid_request", "speed"),
        ("/v1/translate", {"model": "lm", "text": "a"}, "wrong_model", "does not answer /v1/translate"),
        ("/v1/generate", {"prompt": "a", "max_new_tokens": 41}, "too_many", "max_new_tokens 41"),
        ("/v1/generate", {"prompt": "a", "top_p": 1.5}, "invalid_request", "top_p"),
        ("/v1/chat", {"messages": ["a"]}, "model_required", "several models"),
        ("/v1/embed", {"text": "a", "pooling": "median"}, "invalid_request", "pooling"),
        ("/v1/attention", {"model": "lm", "text": "a", "trace": True}, "invalid_request", "encoder-decoder"),
        ("/v1/translate", "not json", "invalid_request", None),
    ],
)
def test_bad_requests_are_422_naming_the_problem(client, path, body, kind, says):
    response = client.post(path, json=body) if isinstance(body, dict) else client.post(path, content=body)
    message = error(response, 422, kind)
    assert says is None or says in message, message


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/translate", '{"text": "a", "length_penalty": Infinity}', "length_penalty"),
        ("/v1/translate", '{"text": "a", "timeout": NaN}', "timeout"),
        ("/v1/translate", '{"text": "a", "max_len_a": 1e999}', "max_len_a"),
        ("/v1/chat", '{"model": "lm", "messages": ["a"], "seed": 123456789012345678901234567890}', "seed"),
        ("/v1/generate", '{"prompt": "a", "top_k": 18446744073709551616}', "top_k"),
        ("/v1/generate", '{"prompt": "a", "max_new_tokens": -Infinity}', "max_new_tokens"),
        ("/v1/translate", '{"text": ["a", "\\ud800"]}', "text"),
        ("/v1/chat", '{"model": "lm", "messages": ["\\udfff"]}', "messages"),
    ],
)
def test_non_finite_numbers_huge_integers_and_lone_surrogates_are_422(client, path, body, field):
    """JSON's Infinity and NaN, integers past what the code holds, and text UTF-8 cannot write
    are refused, naming the field (they were 500s: the error copied the value and failed)."""
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    message = error(response, 422, "invalid_request")
    assert message.startswith(f"{field}:"), message
    assert response.content.isascii() and "Infinity" not in response.text and "NaN" not in response.text


def test_an_error_never_copies_what_the_client_sent(client):
    huge = "\u00e9" * 3000 + "\x00"
    for body in ({"text": "a", huge: 1}, {"text": "a", "model": "x" * 255 + "\x00"}, {"text": [huge] * 3}):
        response = client.post("/v1/translate", json=body)
        assert response.status_code in (404, 413, 422) and len(response.content) < 1500, response.text[:300]
        assert huge[:50] not in response.text and "\x00" not in response.text
    message = error(client.post("/v1/translate", json={"text": "a", "model": "é" * 100}), 404, "unknown_model")
    assert "\\xe9" in message and "(100 characters)" in message  # described: ASCII, cut, its length said


def test_unknown_model_route_and_method(client):
    assert "no model named '/etc/passwd'" in error(
        client.post("/v1/translate", json={"model": "/etc/passwd", "text": "a"}), 404, "unknown_model"
    )
    error(client.get("/v1/nothing"), 404, "not_found")
    error(client.get("/../../etc/passwd"), 404)
    error(client.get("/v1/translate"), 405)


def test_timeout_is_504(client):
    error(client.post("/v1/translate", json={"text": "Ein Hund", "timeout": 1e-6}), 504, "timeout")
    streamed = client.post("/v1/generate", json={"prompt": "a", "stream": True, "max_new_tokens": 40, "timeout": 1e-6})
    (name, data), *_ = sse_events(streamed.text)
    assert name == "error" and json.loads(data)["error"]["code"] == 504


def test_a_full_server_is_429_with_retry_after(served):
    with TestClient(create_app(served, Settings(max_active=0))) as c:
        response = c.post("/v1/translate", json={"text": "a"})
        error(response, 429, "busy")
        assert int(response.headers["retry-after"]) >= 1
        assert c.get("/health").status_code == 200  # health, models and metrics take no slot


def test_metrics(client):
    client.post("/v1/translate", json={"text": "Ein Hund"})
    client.post("/v1/translate", json={"text": "x" * 201})
    text = client.get("/metrics").text
    assert 'qkv_requests_total{code="200",endpoint="/v1/translate"}' in text
    assert 'qkv_requests_total{code="422",endpoint="/v1/translate"}' in text
    assert 'qkv_request_seconds_bucket{endpoint="/v1/translate",le="0.005"}' in text
    assert "qkv_batch_requests_count" in text and "qkv_batch_inputs_sum" in text
    assert 'qkv_output_tokens_total{endpoint="translate"}' in text and "qkv_tokens_per_second" in text
    assert "qkv_active_requests 0.0" in text


# ----------------------------------------------------------------------------- the batcher


def test_jobs_that_arrive_together_share_one_call():
    calls: list[list] = []

    def run(inputs):
        calls.append(list(inputs))
        return [x * 10 for x in inputs]

    async def scenario(enabled: bool):
        batcher = Batcher(enabled=enabled, wait_s=0.05, max_cost=5)
        jobs = [batcher.submit(Job(run, [i, i + 100], key="k", cost=2), timeout=5) for i in range(3)]
        other = batcher.submit(Job(run, [7], key="other"), timeout=5)
        results = await asyncio.gather(*jobs, other)
        await batcher.stop()
        return results

    results = asyncio.run(scenario(True))
    assert results == [[0, 1000], [10, 1010], [20, 1020], [70]]
    assert calls == [[0, 100, 1, 101], [2, 102], [7]]  # within the budget of 5: two jobs of cost 2
    calls.clear()
    assert asyncio.run(scenario(False)) == results and len(calls) == 4


def test_a_request_waits_no_longer_than_its_own_timeout():
    release = threading.Event()

    def slow(inputs):
        release.wait(5)
        return inputs

    async def scenario():
        batcher = Batcher(wait_s=0)
        stuck = asyncio.ensure_future(batcher.submit(Job(slow, [1]), timeout=5))
        await asyncio.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await batcher.submit(Job(lambda x: x, [2]), timeout=0.2)
        waited = time.monotonic() - start
        release.set()
        assert await stuck == [1]
        assert await batcher.submit(Job(lambda x: x, [3]), timeout=5) == [3]  # the dropped one did not run
        await batcher.stop()
        return waited

    assert asyncio.run(scenario()) < 1.0


def test_requests_arriving_together_share_a_forward_pass(served):
    """Eight translations sent at once are answered as they would be alone, in fewer passes."""
    settings = Settings(batch_wait_ms=200)
    texts = ["Ein Hund", "你好", "A dog runs", "Grüße", "0123", "die Wiese", "北京", "läuft"]
    with TestClient(create_app(served, settings)) as c:
        alone = [c.post("/v1/translate", json={"text": t, "beam_size": 2}).json() for t in texts]
        before = _histogram(c.get("/metrics").text, "qkv_batch_requests")
        found: dict[int, dict] = {}
        threads = [
            threading.Thread(
                target=lambda i=i: found.__setitem__(
                    i, c.post("/v1/translate", json={"text": texts[i], "beam_size": 2}).json()
                )
            )
            for i in range(len(texts))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = _histogram(c.get("/metrics").text, "qkv_batch_requests")
    for i, one in enumerate(alone):  # batched with others: the same outputs, scores equal up to rounding
        assert [h["text"] for h in found[i]["translations"][0]] == [h["text"] for h in one["translations"][0]]
        assert found[i]["translations"][0][0]["score"] == pytest.approx(one["translations"][0][0]["score"], abs=1e-4)
    passes, requests = after[0] - before[0], after[1] - before[1]
    assert requests == len(texts) and passes < len(texts)


def _histogram(text: str, name: str) -> tuple[float, float]:
    """(count, sum) of a Prometheus histogram in the text format."""
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith(f"{name}_"))
    return float(values[f"{name}_count"]), float(values[f"{name}_sum"])


# ----------------------------------------------------------------------------- the command


def test_serve_missing_model_is_one_line(capsys, tmp_path):
    assert main(["serve", "--model", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qkv serve: error:") and "nothing" in err[0]


def test_serve_port_in_use_is_one_line(capsys, paths):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(paths["de_en"]), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"port {port} on 127.0.0.1 is in use" in err[0]


# ----------------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def server(paths, tmp_path_factory):
    """qkv serve with one slot, a long generation allowed, and a short graceful-shutdown wait."""
    s = Server([paths["de_en"], paths["lm"]], "--max-active", "1", "--max-new-tokens", "100000", "--timeout", "30",
               cwd=tmp_path_factory.mktemp("server"))  # fmt: skip
    yield s
    s.stop()


def _first_event(lines) -> tuple[str, dict]:
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            return name, json.loads(line[len("data: ") :])
    raise AssertionError("no event")


def _wait_idle(url: str, seconds: float = 10) -> float:
    start = time.monotonic()
    while httpx.get(f"{url}/health").json()["active"]:
        assert time.monotonic() - start < seconds, "the slot was not freed"
        time.sleep(0.05)
    return time.monotonic() - start


def test_real_server_streams_events_and_answers_429_when_full(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        one = c.post("/v1/translate", json={"text": "Ein Hund", "beam_size": 2})
        assert one.status_code == 200
        # Long enough that it still holds the slot when the next request arrives (60 tokens took ~50 ms).
        body = {"model": "lm", "prompt": "A dog", "max_new_tokens": 1000, "stream": True}
        with c.stream("POST", "/v1/generate", json=body) as events:
            assert events.headers["content-type"].startswith("text/event-stream")
            lines = events.iter_lines()
            assert _first_event(lines)[0] == "token"  # the first piece arrives before the end
            busy = httpx.post(f"{server.url}/v1/translate", json={"text": "a"})  # the one slot is the stream's
            error(busy, 429, "busy")
            assert int(busy.headers["retry-after"]) >= 1
            text = "\n".join(lines) + "\n"
        assert "event: done" in text
    _wait_idle(server.url)


def test_a_client_that_disconnects_frees_its_slot(server):
    body = {"model": "lm", "prompt": "A dog", "max_new_tokens": 100000, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as c, c.stream("POST", "/v1/generate", json=body) as events:
        assert _first_event(events.iter_lines())[0] == "token"
    # 100,000 tokens would take minutes: the slot is free at once because the client left.
    assert _wait_idle(server.url) < 5
    assert httpx.post(f"{server.url}/v1/translate", json={"text": "a"}).status_code == 200
    assert 'qkv_refused_total{reason="disconnected"} 1.0' in httpx.get(f"{server.url}/metrics").text


def _raw(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as bytes on a new connection; the answer's status, headers and body."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    return int(status.split()[1]), headers, body


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000,  # headers over 16 KiB, and no end
        b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
        b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        b"GET /he alth HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
)
def test_malformed_http_gets_the_json_error(server, request_bytes):
    """A request uvicorn cannot parse is answered 400 in the API's JSON shape, and the server lives on."""
    status, headers, body = _raw(server.url, request_bytes)
    assert status == 400 and headers["content-type"] == "application/json", (status, headers, body)
    assert len(headers["x-request-id"]) == 32  # its line in the access log carries it too
    err = json.loads(body)["error"]
    assert err["code"] == 400 and err["type"] == "malformed_request" and "HTTP" in err["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_sigterm_lets_the_request_in_flight_finish(server):
    """Last: it stops the module's server."""
    s = server
    body = {"model": "lm", "prompt": "A dog", "max_new_tokens": 400, "stream": True}
    with httpx.Client(base_url=s.url, timeout=60) as c, c.stream("POST", "/v1/generate", json=body) as events:
        lines = events.iter_lines()
        assert _first_event(lines)[0] == "token"
        s.terminate()
        rest = "\n".join(lines)
    assert "event: done" in rest and '"tokens": 400' in rest  # every token arrived after SIGTERM
    code, err = s.stop()
    assert code == 0 and "qkv serve: stopped" in err, err
