"""``/v1/audio/stream`` of the server's app run by uvicorn on a loopback port, through the
``websockets`` client: the messages of a stream sent a second at a time are the library's own
(``SpeechStream`` over ``decoder_of``, the same chunks), finals in order and never twice, each
with its words and their times (estimates, labelled so, for a model of qkv's own), and the
server closes with 1000 after ``end``; without the API key the handshake is refused (401); the
key among the offered subprotocols (as a browser sends it) is let in, the server answering with
the plain ``qkv`` one, and a wrong or unencoded one refused (401; Chromium's own WebSocket:
tests/test_serve_browser.py); bad frames and limits get a JSON error and a 1003 or 1008 close,
and the server goes on."""

from __future__ import annotations

import json
import time
from itertools import pairwise
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import qkv
from qkv.serve.settings import Settings
from serving import LocalServer, key_protocol, tiny_audio_models

websockets = pytest.importorskip("websockets", reason="the stream is tested with websockets (pip install -e .[dev])")
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

KEY = "stream-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
IDLE, MAX_BUFFERED = 2, 2  # seconds


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_audio_models(tmp_path_factory.mktemp("stream_models"))["asr"]


@pytest.fixture(scope="module")
def server(model, one_thread):  # the tiny model's steps on one thread (a shared machine's cores are busy)
    limits = {"stream_idle_seconds": IDLE, "stream_max_buffered_seconds": MAX_BUFFERED}
    s = LocalServer(model, Settings(api_keys=(KEY,), **limits))
    yield s
    s.stop()


def ws_url(server: LocalServer, query: str = "") -> str:
    return server.url.replace("http://", "ws://") + "/v1/audio/stream" + query


def pcm(seconds: float, seed: int) -> np.ndarray:
    """``seconds`` of noisy tone as 16 kHz s16le samples."""
    g = np.random.default_rng(seed)
    n = round(seconds * 16000)
    wave = 0.3 * np.sin(np.arange(n) * 0.05) + g.normal(0, 0.05, n)
    return (np.clip(wave, -1, 1) * 32767).round().astype("<i2")


def library_messages(model: Path, samples: np.ndarray) -> list[dict]:
    """What the library's stream says of ``samples`` fed a second at a time, as the server's messages."""
    from qkv.speech_streaming import SpeechStream, decoder_of

    stream, out = SpeechStream(decoder_of(qkv.load(model)), sample_rate=16000), []
    for i in range(0, len(samples), 16000):
        stream.insert(torch.from_numpy(samples[i : i + 16000].astype(np.float32) / 32768.0))
        update = stream.step()
        if update.committed:
            out.append({"type": "final", "text": update.text})
        out.append({"type": "partial", "text": update.partial_text})
    update = stream.finish()
    return out + ([{"type": "final", "text": update.text}] if update.committed else [])


def test_a_stream_says_what_the_library_says(server, model) -> None:
    samples = pcm(4.0, 1)
    said = []
    with connect(ws_url(server), additional_headers=AUTH) as client:
        for i in range(0, len(samples), 16000):
            client.send(samples[i : i + 16000].tobytes())
            while True:  # a second of audio: one step, its final (if any), then its partial
                said.append(json.loads(client.recv(timeout=60)))
                if said[-1]["type"] == "partial":
                    break
        client.send(json.dumps({"type": "end"}))
        said += [json.loads(message) for message in client]  # the last finals, until the server closes
        assert client.close_code == 1000
    finals = [m for m in said if m["type"] == "final"]
    assert finals and [{"type": m["type"], "text": m["text"]} for m in said] == library_messages(model, samples)
    assert all(0 <= m["start"] <= m["end"] <= 4.0 + 1e-3 for m in finals)
    assert all(a["end"] <= b["start"] for a, b in pairwise(finals))  # in order, never twice
    for m in finals:  # each word and its times; a model of qkv's own has no alignment: estimates, labelled
        assert " ".join(w["word"] for w in m["words"]) == m["text"] and m["timing"] == "estimated"
        assert (m["words"][0]["start"], m["words"][-1]["end"]) == (m["start"], m["end"])
        assert all(a["end"] <= b["start"] and b["start"] <= b["end"] for a, b in pairwise(m["words"]))


def test_the_handshake_needs_the_key(server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        with pytest.raises(InvalidStatus) as refused:
            connect(ws_url(server), additional_headers=headers)
        assert refused.value.response.status_code == 401
        assert json.loads(refused.value.response.body)["error"]["type"] == "unauthorized"


def test_a_browser_offers_the_key_among_its_subprotocols(server) -> None:
    with connect(ws_url(server), subprotocols=["qkv", key_protocol(KEY)]) as client:
        assert client.subprotocol == "qkv"  # the plain one: the key is never sent back
        client.send(pcm(1.0, 6).tobytes())
        client.send(json.dumps({"type": "end"}))
        assert all(json.loads(m)["type"] in ("partial", "final") for m in client) and client.close_code == 1000
    unencoded = "qkv.bearer." + KEY  # the key as it is, not in base64url: not a key the server knows
    for offered in (
        ["qkv", key_protocol("wrong-key-0123456789")],
        ["qkv", unencoded],
        ["qkv", "qkv.bearer.%%"],
        ["qkv"],
    ):
        with pytest.raises(InvalidStatus) as refused:
            connect(ws_url(server), subprotocols=offered)
        assert refused.value.response.status_code == 401, offered
        assert "subprotocols" in json.loads(refused.value.response.body)["error"]["message"]


def refusal(server, send, query: str = "") -> tuple[dict, int]:
    """The error message and the close code of a stream after ``send(client)``."""
    with connect(ws_url(server, query), additional_headers=AUTH) as client:
        send(client)
        message = json.loads(client.recv(timeout=30))
        with pytest.raises(ConnectionClosed):
            client.recv(timeout=30)
        return message, client.close_code


def test_bad_frames_and_limits_close_the_stream_not_the_server(server) -> None:
    cases = [
        (lambda client: client.send(b"\x00\x01\x02"), "", 1003, "invalid_audio"),
        (lambda client: client.send("hello"), "", 1003, "invalid_message"),
        (lambda client: client.send(bytes(256 * 1024 + 2)), "", 1008, "too_large"),
        (lambda client: client.send(pcm(MAX_BUFFERED + 1, 2).tobytes()), "", 1008, "too_fast"),
        (lambda client: None, "", 1008, "idle"),
        (lambda client: None, "?model=nope", 1008, "unknown_model"),
        (lambda client: None, "?language=de", 1008, "invalid_request"),
        (lambda client: None, "?timing=exact", 1008, "invalid_request"),
    ]
    for send, query, code, kind in cases:
        began = time.monotonic()
        message, closed = refusal(server, send, query)
        assert message["type"] == "error" and message["error"]["type"] == kind, message
        assert closed == code, (kind, closed)
        if kind == "idle":
            assert IDLE - 0.1 <= time.monotonic() - began < IDLE + 10
    with connect(ws_url(server), additional_headers=AUTH) as client:  # a client that leaves mid-stream
        client.send(pcm(1.5, 3).tobytes())
    assert httpx.get(f"{server.url}/health").status_code == 200
    with connect(ws_url(server), additional_headers=AUTH) as client:
        client.send(pcm(1.0, 4).tobytes())
        client.send(json.dumps({"type": "end"}))
        assert all(json.loads(m)["type"] in ("partial", "final") for m in client) and client.close_code == 1000
