"""What the server's tests share (tests/test_serve_api.py, tests/test_serve_browser.py,
tests/test_serve_constraints.py, tests/test_serve_generation_batching.py): tiny models saved as
model directories, a real ``qkv serve`` in a subprocess on a free loopback port, and the app
in-process (:func:`app_client`); torch on one thread: conftest.py's ``one_thread``."""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import torch

from qkv.checkpoint import save_model
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.models.encoder_only import EncoderOnly, EncoderOnlyConfig
from qkv.serve.settings import Settings
from qkv.tokenization import FILE, Tokenizer

if TYPE_CHECKING:  # the app is imported where it is used, as LocalServer does: serving.py imports light
    from fastapi.testclient import TestClient

    from qkv.serve.models import Served

ROOT = Path(__file__).resolve().parents[1]
# The Chromium the page's tests drive through Playwright (Debian's, which scripts/setup.sh installs; None: skip).
CHROMIUM = next(
    (p for p in (os.environ.get("QKV_CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser")) if p),
    None,
)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-background-networking"]
# German and Chinese among the characters, so texts in both round-trip through every endpoint.
CHARACTERS = "Ein Hund läuft über die Wiese. Grüße aus 北京, 你好世界! A dog runs on the grass: 0123456789"


def tiny_models(root: Path) -> dict[str, Path]:
    """Random tiny models of the three kinds with one character tokenizer: an encoder-decoder
    (``de_en``), a language model with a 17-token window (``lm``), and an encoder-only
    classifier (``acts``, labels in config.json as ``qkv train`` saves them)."""
    tokenizer = Tokenizer.train_char_level([CHARACTERS])
    tokenizer.save(root / FILE)
    files = {FILE: root / FILE}
    v = tokenizer.vocab_size
    specials = {"pad_id": tokenizer.pad_id, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
    torch.manual_seed(0)
    small = {"d_model": 15, "n_heads": 3, "d_ff": 7, "dropout": 0.0}
    seq2seq = EncoderDecoder(
        EncoderDecoderConfig(
            src_vocab_size=v, tgt_vocab_size=v, n_encoder_layers=2, n_decoder_layers=2, max_len=97, **small, **specials
        )
    )
    lm = DecoderOnly(DecoderOnlyConfig(vocab_size=v, n_layers=2, max_len=17, **small, **specials))
    bert = EncoderOnly(
        EncoderOnlyConfig(
            vocab_size=v, n_layers=2, max_len=41, n_classes=2, mlm_head=False, pad_id=tokenizer.pad_id, **small
        )
    )
    return {
        "de_en": save_model(seq2seq, root / "de_en", files=files),
        "lm": save_model(lm, root / "lm", files=files),
        "acts": save_model(bert, root / "acts", files=files, extra={"labels": ["inform", "question"]}),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``qkv serve`` in a subprocess on a free loopback port; ``url`` once it answers /health."""

    def __init__(self, models: list[Path], *options: str, cwd: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "qkv", "serve", "--port", str(self.port)]
        for model in models:
            argv += ["--model", str(model)]
        environ = {**os.environ, **(env or {})}
        environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
        environ["OMP_NUM_THREADS"] = "1"  # a shared machine: one core per server is plenty for tiny models
        # The log (a line per request) goes to a file: a pipe nobody reads would fill and stop the server.
        self.log = Path(cwd) / f"serve-{self.port}.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [*argv, *options], cwd=cwd, env=environ, stdout=subprocess.DEVNULL, stderr=log, text=True
            )
        deadline = time.monotonic() + 90
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"qkv serve exited {self.process.returncode}: {self.stderr()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("qkv serve did not answer /health within 90 s")
            time.sleep(0.2)

    def stderr(self) -> str:
        """What the server has written to stderr so far (its log)."""
        return self.log.read_text(encoding="utf-8", errors="replace")

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def stop(self) -> tuple[int, str]:
        """Stop it (SIGTERM, then kill after 30 s); its exit status and stderr."""
        if self.process.poll() is None:
            self.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return self.process.returncode, self.stderr()


@contextmanager
def app_client(served: dict[str, Served], settings: Settings) -> Iterator[TestClient]:
    """The real app (``create_app``, as ``qkv serve`` builds it) over models already loaded
    (``load_served``), in-process through a TestClient whose block the app's lifespan spans."""
    from fastapi.testclient import TestClient

    from qkv.serve.app import create_app

    with TestClient(create_app(served, settings)) as client:
        yield client


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


def key_protocol(key: str) -> str:
    """The WebSocket subprotocol that carries ``key``: ``qkv.bearer.`` and the key in base64url, unpadded."""
    return "qkv.bearer." + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def sse_events(text: str) -> list[tuple[str, str]]:
    """(event, data) of every Server-Sent Event in ``text``; every event ends with a blank line."""
    assert text.endswith("\n\n"), text[-200:]
    found = []
    for block in text.split("\n\n")[:-1]:
        match = re.fullmatch(r"event: (\w+)\ndata: (.*)", block, flags=re.S)
        assert match, block
        found.append((match.group(1), match.group(2)))
    return found


def tiny_audio_models(root: Path) -> dict[str, Path]:
    """Random tiny speech and TTS models of qkv's own with one character tokenizer: a recognizer
    (``asr``, 19 mel bins, a 13-token window), a speech translator (``st``: its recipe says
    ``data.translate``, as recipes/speech_de_en.yaml) and a Transformer-TTS (``tts``, 16 kHz)."""
    from qkv.audio import FeatureConfig
    from qkv.models.speech import SpeechConfig, SpeechEncoderDecoder
    from qkv.models.tts import TransformerTTS, TTSConfig

    tokenizer = Tokenizer.train_char_level(["ein hund läuft. a dog runs, do re mi: 0123456789"])
    tokenizer.save(root / FILE)
    files = {FILE: root / FILE}
    v = tokenizer.vocab_size
    ids = {"pad_id": tokenizer.pad_id, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
    small = {"d_model": 15, "n_heads": 3, "d_ff": 7, "dropout": 0.0}
    speech = {"vocab_size": v, "n_encoder_layers": 1, "n_decoder_layers": 1, "max_len": 13, **small, **ids}
    torch.manual_seed(2)  # a seed whose recognizer and translator both write something for tone(0.5)
    asr = SpeechEncoderDecoder(SpeechConfig(features=FeatureConfig(n_mels=19), **speech))
    st = SpeechEncoderDecoder(SpeechConfig(features=FeatureConfig(n_mels=19), **speech))
    tts = TransformerTTS(
        TTSConfig(
            vocab_size=v, n_encoder_layers=1, n_decoder_layers=1, max_len=11, prenet_dim=11, postnet_channels=7,
            postnet_layers=2, reduction=3, features=FeatureConfig(n_mels=19), pad_id=tokenizer.pad_id,
            d_model=16, n_heads=2, d_ff=23, dropout=0.0,
        )
    )  # fmt: skip
    translates = {"recipe": {"task": "asr", "data": {"corpus": "espeak_de", "translate": True}}}
    return {
        "asr": save_model(asr, root / "asr", files=files),
        "st": save_model(st, root / "st", files=files, extra=translates),
        "tts": save_model(tts, root / "tts", files=files),
    }


def tone(seconds: float, rate: int = 16000) -> bytes:
    """A rising tone of ``seconds`` as the bytes of a 16-bit WAV file at ``rate``."""
    import io

    import numpy as np
    import soundfile

    t = np.arange(round(seconds * rate)) / rate
    out = io.BytesIO()
    soundfile.write(out, 0.3 * np.sin(2 * np.pi * (200 + 400 * t) * t), rate, format="WAV", subtype="PCM_16")
    return out.getvalue()
