"""``qkv serve``: the models behind an HTTP API, and a page that shows their attention.

What is here: the command's arguments (``add_parser``) beside its handler, which gathers the
API keys (``--api-key``, ``--api-key-file``, ``QKV_API_KEY``; a host beyond the loopback
without one is refused unless ``--insecure-no-auth``), loads the models, binds the socket (a
port in use is a user error), sends the log (the access log's line per request, errors) to
stderr with each request's id, and runs uvicorn on the app of ``qkv.serve.app`` until SIGTERM
or Ctrl-C (requests in flight finish first).
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from qkv.cli.common import add_precision, number, positive_int
from qkv.errors import UserError
from qkv.serve.settings import Settings

if TYPE_CHECKING:
    from qkv.serve.models import Served

EPILOG_SERVE = """examples:
  qkv serve --model runs/de_en                       # then open http://127.0.0.1:8000/
  qkv serve --model runs/de_en --model runs/shakespeare --port 8080
  curl -s localhost:8000/v1/translate -H 'content-type: application/json' -d '{"text": "Ein Hund läuft."}'
  qkv serve --model models/smollm2                   # then OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
  qkv serve --model models/whisper-tiny --model voices/joe     # speech in and out, OpenAI's audio API
  curl -s localhost:8000/v1/audio/transcriptions -F file=@talk.wav -F response_format=srt
  qkv serve --model models/whisper-base --multilingual   # each 30 s window's language detected

The server binds 127.0.0.1 (this machine only) unless --host says otherwise; beyond this
machine it needs an API key (--api-key-file FILE, or QKV_API_KEY) unless --insecure-no-auth.
Endpoints, limits, keys and metrics: docs/serving.md; the API's schema: http://127.0.0.1:8000/docs.
"""

KEY = re.compile(r"[\x21-\x7e]{16,}")  # visible ASCII, no spaces: safe in a header; 16 or more
ORIGIN = re.compile(r"\*|https?://[^/\s]+")
KEY_ENV = "QKV_API_KEY"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s id=%(request_id)s %(message)s"


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (127.0.0.0/8, ::1, localhost)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The keys of ``--api-key``, the lines of ``--api-key-file`` (blank lines and # comments
    left out) and ``QKV_API_KEY``, each checked (never shown in an error), in order, once each."""
    found = [(k, "--api-key") for k in args.api_key]
    if args.api_key_file is not None:
        path = Path(args.api_key_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--api-key-file {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        found += [(line.strip(), f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip()[:1] not in ("", "#")]
    if os.environ.get(KEY_ENV):
        found.append((os.environ[KEY_ENV].strip(), KEY_ENV))
    for key, where in found:
        if not KEY.fullmatch(key):
            raise UserError(
                f"{where}: an API key is 16 or more visible ASCII characters, no spaces "
                "(make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
    return tuple(dict.fromkeys(k for k, _ in found))


def check_access(args: argparse.Namespace, keys: tuple[str, ...]) -> None:
    """Refuse, in one line, a host beyond the loopback without a key (unless the user means it)
    and an origin that is not one."""
    if not keys and not args.insecure_no_auth and not is_loopback(args.host):
        raise UserError(
            f"--host {args.host} is reachable from other machines: give an API key (--api-key-file, "
            f"{KEY_ENV} or --api-key), or --insecure-no-auth to serve without one"
        )
    for origin in args.cors_origin:
        if not ORIGIN.fullmatch(origin):
            raise UserError(f"--cors-origin {origin!r}: an origin is scheme://host[:port] (no path), or *")


def log_to_stderr(*, access_log: bool) -> None:
    """The server's log on stderr, each line with its request's id: the access log (one line
    per request, unless ``access_log`` is False), the server's errors, uvicorn's warnings."""
    from qkv.serve.middleware import RequestIdFilter

    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%Y-%m-%dT%H:%M:%S"))
    for name, level in (("qkv.serve", logging.INFO), ("uvicorn.error", logging.WARNING)):
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.setLevel(level)
        logger.propagate = False
    logging.getLogger("qkv.serve.access").setLevel(logging.INFO if access_log else logging.WARNING)


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

    from qkv.serve.access import key_id
    from qkv.serve.app import create_app
    from qkv.serve.http import JsonErrorsH11
    from qkv.serve.models import load_served

    keys = api_keys(args)
    check_access(args, keys)
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
        api_keys=keys,
        rate_limit=args.rate_limit,
        cors_origins=tuple(args.cors_origin),
        max_upload_bytes=args.max_upload_mb * 1024 * 1024,
        max_audio_seconds=args.max_audio_seconds,
        max_speech_chars=args.max_speech_chars,
        multilingual=multilingual(args, served),
        stream_max_buffered_seconds=args.stream_max_buffered_seconds,
        stream_idle_seconds=args.stream_idle_seconds,
    )
    sock = bind(args.host, args.port)
    port = sock.getsockname()[1]
    where = f"[{args.host}]" if ":" in args.host else args.host
    names = ", ".join(f"{m.name} ({m.kind})" for m in served.values())
    print(f"qkv serve: http://{where}:{port}/ serving {names}; Ctrl-C or SIGTERM stops it", file=sys.stderr, flush=True)
    if keys:
        ids = ", ".join(key_id(k) for k in keys)
        print(f"qkv serve: every path but /health needs an API key; the keys' ids (in the log): {ids}", file=sys.stderr)
    if not is_loopback(args.host):
        unguarded = "" if keys else ", with no key asked (--insecure-no-auth)"
        print(f"qkv serve: note: listening on {args.host}: reachable from other machines{unguarded}", file=sys.stderr)
    log_to_stderr(access_log=not args.no_access_log)
    config = uvicorn.Config(
        create_app(served, settings),
        http=JsonErrorsH11,  # a request uvicorn cannot parse gets the API's JSON error
        log_config=None,  # the log is log_to_stderr's: every line with its request's id
        log_level="warning",
        access_log=False,  # uvicorn's own; the server writes its access log itself
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
    """The ``serve`` command's arguments: where it listens, its limits, its batching, audio and
    speech streams, and who may call it (the help lists them in that order)."""
    p = sub.add_parser(
        "serve",
        help="serve models over HTTP: a JSON API, metrics, and a page that shows the attention",
        description="Serve one or more models (model or training-run directories) over HTTP: POST /v1/translate, "
        "/v1/generate (streamed as Server-Sent Events), /v1/chat, /v1/embed, /v1/classify and /v1/attention (every "
        "attention map, the beam search's trace); OpenAI's API for language models (POST /v1/chat/completions and "
        "/v1/completions, streamed too: the openai client works against it) and for speech and TTS models "
        "(/v1/audio/transcriptions, /v1/audio/translations, /v1/audio/speech), speech heard as it is spoken over a "
        "WebSocket (/v1/audio/stream); GET /v1/models, /health, /metrics "
        "(Prometheus) and the page at /. "
        "Requests that arrive within --batch-wait-ms share one forward pass. Every limit is a JSON error: no API key "
        "401 (with --api-key), a body too large 413, a bad or too long input 422, a full server or one over "
        "--rate-limit 429 (Retry-After), a timeout 504.",
        epilog=EPILOG_SERVE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = Settings()
    _add_listening(p)
    _add_limits(p, defaults)
    _add_batching(p, defaults)
    sound = p.add_argument_group("audio (speech and TTS models)")
    _add_audio(sound, defaults)
    _add_stream(sound, defaults)
    _add_access(p.add_argument_group("who may call it"), defaults)
    add_precision(p)
    p.set_defaults(run=cmd_serve)


def _add_listening(p: argparse.ArgumentParser) -> None:
    """The models and where the server listens."""
    p.add_argument("--model", action="append", required=True, metavar="DIR", help="a model to serve (repeat for more)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument(
        "--port",
        type=number(int, lambda v: 0 <= v < 65536, "a port from 0 to 65535"),
        default=8000,
        help="port to listen on (default: %(default)s; 0: any free port)",
    )


def _add_limits(p: argparse.ArgumentParser, defaults: Settings) -> None:
    """What one request may ask and how long it may wait (each a 4xx or 504 beyond)."""
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


def _add_batching(p: argparse.ArgumentParser, defaults: Settings) -> None:
    """How requests share forward passes."""
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


def _add_audio(sound: argparse._ArgumentGroup, defaults: Settings) -> None:
    """The limits of audio in (transcription) and out (speech)."""
    sound.add_argument(
        "--max-upload-mb",
        type=positive_int,
        default=defaults.max_upload_bytes // (1024 * 1024),
        help="an audio file to transcribe, in MiB (default: %(default)s; 413 beyond)",
    )
    sound.add_argument(
        "--max-audio-seconds",
        type=number(float, lambda v: v > 0, "a positive number of seconds"),
        default=defaults.max_audio_seconds,
        help="longest audio transcribed (default: %(default)s; an imported Whisper: its 30 s chunk; 422 beyond)",
    )
    sound.add_argument(
        "--max-speech-chars",
        type=positive_int,
        default=defaults.max_speech_chars,
        help="longest text /v1/audio/speech speaks (default: %(default)s; 422 beyond)",
    )
    sound.add_argument(
        "--multilingual",
        action="store_true",
        help="a multilingual Whisper given no language detects each 30 s window's language (as qkv transcribe "
        "--multilingual), not the first window's alone; a request's multilingual field overrides it",
    )


def multilingual(args: argparse.Namespace, served: dict[str, Served]) -> bool:
    """``--multilingual``, refused in one line where no model served is a multilingual Whisper
    (there would be nothing to detect)."""
    whispers = [m.bundle.whisper for m in served.values() if m.bundle.whisper is not None]
    if args.multilingual and not any(w.multilingual for w in whispers):
        raise UserError("--multilingual detects each window's language: no model served is a multilingual Whisper")
    return args.multilingual


def _add_stream(sound: argparse._ArgumentGroup, defaults: Settings) -> None:
    """The limits of speech heard as it is spoken (/v1/audio/stream)."""
    seconds = number(float, lambda v: v > 0, "a positive number of seconds")
    sound.add_argument(
        "--stream-max-buffered-seconds",
        type=seconds,
        default=defaults.stream_max_buffered_seconds,
        help="audio a /v1/audio/stream client may send ahead of the decoding (default: %(default)s; closed beyond)",
    )
    sound.add_argument(
        "--stream-idle-seconds",
        type=seconds,
        default=defaults.stream_idle_seconds,
        help="a /v1/audio/stream that receives nothing this long is closed (default: %(default)s)",
    )


def _add_access(access: argparse._ArgumentGroup, defaults: Settings) -> None:
    """API keys, the rate limit, the origins whose pages may call, and the access log."""
    access.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a key every request but GET /health must carry as 'Authorization: Bearer KEY' (repeat for more; "
        f"others can read a command line: prefer --api-key-file or {KEY_ENV})",
    )
    access.add_argument("--api-key-file", metavar="FILE", help="a file of API keys, one a line (# comments allowed)")
    access.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve a --host beyond this machine without any key: whoever reaches the port may use the models",
    )
    access.add_argument(
        "--rate-limit",
        type=number(float, lambda v: v >= 0, "a number of requests a minute, >= 0"),
        default=defaults.rate_limit,
        metavar="N",
        help="requests a minute per key (without keys: per client address), in bursts of as many; 429 and "
        "Retry-After beyond (default: 0, no limit)",
    )
    access.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="an origin whose pages may call the API from a browser, e.g. https://example.org (repeat for more; "
        "default: none, CORS off)",
    )
    access.add_argument("--no-access-log", action="store_true", help="no line per request on stderr")
