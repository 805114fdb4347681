"""A ``qkv serve`` for a benchmark (bench/serve_load.py, bench/chat_batching.py, bench/stream_asr.py):
started in a subprocess on a free port of 127.0.0.1 (nothing else is reached) from this checkout's
``src``, waited for until ``/health`` answers, and stopped with SIGTERM (requests in flight finish).

What is not here: the load each benchmark puts on it, and the tests' server (tests/serving.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    who: str, model: str | Path, flags: Sequence[str] = (), *, threads: int | None = None, wait: float = 120
) -> tuple[subprocess.Popen, str]:
    """``qkv serve --model MODEL --host 127.0.0.1 --port P --no-access-log FLAGS`` and its URL once
    it answers ``/health`` (within ``wait`` seconds, else it is killed); ``threads``: its
    ``OMP_NUM_THREADS``. ``who`` (the benchmark) begins the one-line error of a server that
    exits or does not start. Its stderr is a pipe, read only when it fails."""
    import httpx

    port = free_port()
    argv = [sys.executable, "-m", "qkv", "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--no-access-log", *flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    server = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"{who}: qkv serve exited {server.returncode}: {server.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit(f"{who}: qkv serve did not start within {wait:g} s")


def stop_server(server: subprocess.Popen, *, wait: float = 60) -> None:
    """SIGTERM, then ``wait`` seconds for the requests in flight to finish; killed after that."""
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        server.kill()


@contextmanager
def serving(
    who: str,
    model: str | Path,
    flags: Sequence[str] = (),
    *,
    threads: int | None = None,
    wait: float = 120,
    stop: float = 60,
) -> Iterator[tuple[subprocess.Popen, str]]:
    """:func:`start_server`'s server and URL for the ``with`` block, then :func:`stop_server` (``stop`` seconds)."""
    server, url = start_server(who, model, flags, threads=threads, wait=wait)
    try:
        yield server, url
    finally:
        stop_server(server, wait=stop)
