"""``/v1/audio/stream`` of the server's app run by uvicorn on a loopback port, through the
``websockets`` client: the messages of a stream sent a second at a time are the library's own
(``SpeechStream`` over ``decoder_of``, the same chunks), finals in order and never twice, and
the server closes with 1000 after ``end``; without the API key the handshake is refused (401);
bad frames and limits get a JSON error and a 1003 or 1008 close, and the server goes on."""

from __future__ import annotations

import json
import threading
import time
from itertools import pairwise
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import qkv
from qkv.serve.settings import Settings
from serving import free_port, tiny_audio_models

websockets = pytest.importorskip("websockets", reason="the stream is tested with websockets (pip install -e .[dev])")
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

KEY = "stream-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
IDLE, MAX_BUFFERED = 2, 2  # seconds


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_audio_models(tmp_path_factory.mktemp("stream_models"))["asr"]


class LocalServer:
    """The app (``create_app``, as ``qkv serve`` builds it) served by uvicorn on a free loopback
    port in a thread of this process: a real socket, without a second process's start-up."""

    def __init__(self, model: Path, settings: Settings) -> None:
        import uvicorn

        from qkv.serve.app import create_app
        from qkv.serve.models import load_served

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(load_served([str(model)]), settings)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(model):
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's steps on one thread (a shared machine's cores are busy)
    limits = {"stream_idle_seconds": IDLE, "stream_max_buffered_seconds": MAX_BUFFERED}
    s = LocalServer(model, Settings(api_keys=(KEY,), **limits))
    yield s
    s.stop()
    torch.set_num_threads(before)


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
    assert [{"type": m["type"], "text": m["text"]} for m in said] == library_messages(model, samples)
    assert all(0 <= m["start"] <= m["end"] <= 4.0 + 1e-3 for m in finals)
    assert all(a["end"] <= b["start"] for a, b in pairwise(finals))  # in order, never twice


def test_the_handshake_needs_the_key(server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        with pytest.raises(InvalidStatus) as refused:
            connect(ws_url(server), additional_headers=headers)
        assert refused.value.response.status_code == 401
        assert json.loads(refused.value.response.body)["error"]["type"] == "unauthorized"


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
