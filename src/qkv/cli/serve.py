"""``qkv serve``: the models behind an HTTP API, and a page that shows their attention.

What is here: the command's arguments (``add_parser``) beside its handler, which loads the
models, binds the socket (a port in use is a user error) and runs uvicorn on the app of
``qkv.serve.app`` until SIGTERM or Ctrl-C (requests in flight finish first).
"""

from __future__ import annotations

import argparse
import errno
import signal
import socket
import sys

from qkv.cli.common import add_precision, number, positive_int
from qkv.errors import UserError
from qkv.serve.settings import Settings

EPILOG_SERVE = """examples:
  qkv serve --model runs/de_en                       # then open http://127.0.0.1:8000/
  qkv serve --model runs/de_en --model runs/shakespeare --port 8080
  curl -s localhost:8000/v1/translate -H 'content-type: application/json' -d '{"text": "Ein Hund läuft."}'

The server binds 127.0.0.1 (this machine only) unless --host says otherwise. Endpoints, limits
and metrics: docs/serving.md; the API's schema: http://127.0.0.1:8000/docs.
"""

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; a port in use or a host that is not here is a UserError."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is in use; choose another with --port") from None
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from qkv.serve.app import create_app
    from qkv.serve.http import JsonErrorsH11
    from qkv.serve.models import load_served

    served = load_served(args.model, bf16=args.bf16, int8=args.int8)
    settings = Settings(
        max_body_bytes=args.max_body_kb * 1024,
        max_chars=args.max_chars,
        max_texts=args.max_texts,
        max_new_tokens=args.max_new_tokens,
        max_beam=args.max_beam,
        max_active=args.max_active,
        timeout_s=args.timeout,
        batching=not args.no_batching,
        batch_wait_ms=args.batch_wait_ms,
        max_batch_tokens=args.max_batch_tokens,
    )
    sock = bind(args.host, args.port)
    port = sock.getsockname()[1]
    where = f"[{args.host}]" if ":" in args.host else args.host
    names = ", ".join(f"{m.name} ({m.kind})" for m in served.values())
    print(f"qkv serve: http://{where}:{port}/ serving {names}; Ctrl-C or SIGTERM stops it", file=sys.stderr, flush=True)
    if args.host not in LOOPBACK:
        print(f"qkv serve: note: listening on {args.host}: reachable from other machines", file=sys.stderr)
    config = uvicorn.Config(
        create_app(served, settings),
        http=JsonErrorsH11,  # a request uvicorn cannot parse gets the API's JSON error
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(args.timeout) + 5,  # requests in flight finish, streams too
    )
    # uvicorn stops on SIGTERM once every request in flight has finished, then raises the signal
    # again for the handler it found: a SIGTERM is how a server is told to stop, so that one ignores it.
    before = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, before)
    print("qkv serve: stopped", file=sys.stderr)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``serve`` command's arguments."""
    raw = argparse.RawDescriptionHelpFormatter
    defaults = Settings()
    p = sub.add_parser(
        "serve",
        help="serve models over HTTP: a JSON API, metrics, and a page that shows the attention",
        description="Serve one or more models (model or training-run directories) over HTTP: POST /v1/translate, "
        "/v1/generate (streamed as Server-Sent Events), /v1/chat, /v1/embed, /v1/classify and /v1/attention (every "
        "attention map, the beam search's trace); GET /v1/models, /health, /metrics (Prometheus) and the page at /. "
        "Requests that arrive within --batch-wait-ms share one forward pass. Every limit is a JSON error: a body "
        "too large 413, a bad or too long input 422, a full server 429 (Retry-After), a timeout 504.",
        epilog=EPILOG_SERVE,
        formatter_class=raw,
    )
    p.add_argument("--model", action="append", required=True, metavar="DIR", help="a model to serve (repeat for more)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument(
        "--port",
        type=number(int, lambda v: 0 <= v < 65536, "a port from 0 to 65535"),
        default=8000,
        help="port to listen on (default: %(default)s; 0: any free port)",
    )
    p.add_argument(
        "--timeout",
        type=number(float, lambda v: v > 0, "a positive number of seconds"),
        default=defaults.timeout_s,
        help="longest wait for an answer, in seconds (default: %(default)s; 504 beyond)",
    )
    p.add_argument(
        "--max-active",
        type=positive_int,
        default=defaults.max_active,
        help="requests held at once: waiting, running or streaming (default: %(default)s; 429 beyond)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=defaults.max_new_tokens,
        help="(default: %(default)s; 422 beyond)",
    )
    p.add_argument(
        "--max-beam", type=positive_int, default=defaults.max_beam, help="(default: %(default)s; 422 beyond)"
    )
    p.add_argument(
        "--max-texts",
        type=positive_int,
        default=defaults.max_texts,
        help="texts per request (default: %(default)s; 422 beyond)",
    )
    p.add_argument(
        "--max-chars",
        type=positive_int,
        default=defaults.max_chars,
        help="characters per text (default: %(default)s; 422 beyond)",
    )
    p.add_argument(
        "--max-body-kb",
        type=positive_int,
        default=defaults.max_body_bytes // 1024,
        help="request body size in KiB (default: %(default)s; 413 beyond)",
    )
    p.add_argument(
        "--batch-wait-ms",
        type=number(float, lambda v: v >= 0, "a number >= 0"),
        default=defaults.batch_wait_ms,
        help="how long a request waits for others to share its forward pass (default: %(default)s)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=positive_int,
        default=defaults.max_batch_tokens,
        help="a forward pass's budget: source tokens x beam width (default: %(default)s)",
    )
    p.add_argument("--no-batching", action="store_true", help="one request per forward pass (to compare)")
    add_precision(p)
    p.set_defaults(run=cmd_serve)
