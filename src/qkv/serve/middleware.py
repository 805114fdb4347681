"""The ASGI middleware around the app: what every request passes before and after its route.

What is here, outermost first (``app.create_app`` stacks them):
    :class:`Observe`    a request id (``X-Request-ID`` on every answer, in every log line), the
                        metrics (status, latency to the last byte), one access-log line per
                        request, and a bug answered as the JSON 500 (logged with its traceback)
    CORS                Starlette's, only when origins are named (``Settings.cors_origins``)
    :class:`Gate`       the API key (401) and the rate limit (429 with Retry-After) of every
                        path but ``/health``: routes, the page, ``/docs``, ``/metrics``, unknown paths,
                        and WebSocket handshakes (``/v1/audio/stream``: refused before it opens; the
                        key in the header or, from a browser, among the subprotocols)
    :class:`BodyLimit`  a body over the limit: 413, read no further
and :class:`RequestIdFilter`, which puts the request id into every log record of the request.

What is not here: who may call and how often, as logic (``access.py``); the routes (``routes/``);
the errors' shape (``errors.py``).
"""

from __future__ import annotations

import contextvars
import logging
import time

from qkv.serve.access import KEY_PROTOCOL, PROTOCOL, Keys, RateLimiter, protocol_key, request_id
from qkv.serve.errors import error_response
from qkv.serve.metrics import Metrics

ACCESS = "qkv.access"  # the scope's entry Observe gives the middleware inside to fill (the key's id)
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("qkv_request_id", default="-")
ACCESS_LOG = logging.getLogger("qkv.serve.access")
LOG = logging.getLogger("qkv.serve")
FORM_ROOM = 64 * 1024  # an upload's body: its file, and this much for the form's other fields and part headers
ENDPOINT_PATHS = (  # the paths the metrics count by name; any other is "other"
    "/v1/translate",
    "/v1/generate",
    "/v1/chat",
    "/v1/embed",
    "/v1/classify",
    "/v1/attention",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/audio/speech",
    "/v1/models",
    "/health",
    "/metrics",
    "/",
)


class RequestIdFilter(logging.Filter):
    """Gives every log record ``request_id``: the id of the request being answered ("-": none)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


def header(scope, name: bytes) -> str | None:
    """A request header's value (the first of that name), as Latin-1 text; None when absent."""
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def log_access(method: str, target: bytes, status: int, seconds: float, size: int, key: str | None, client) -> None:
    """One access-log line: method, path (as sent, percent-encoded: no control character gets
    into the log), status, duration, bytes of the answer's body, the key's id (never the key),
    the client's address."""
    path = target.decode("ascii", "backslashreplace")[:200]
    address = client[0] if client else "-"
    ACCESS_LOG.info(
        "%s %s %d %.1f ms %d B key=%s client=%s", method, path, status, 1000 * seconds, size, key or "-", address
    )


class Observe:
    """The outermost middleware (see the module)."""

    def __init__(self, app, *, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = request_id(header(scope, b"x-request-id"))
        token = REQUEST_ID.set(rid)
        scope[ACCESS] = access = {"key": None}
        start, answered = time.perf_counter(), {"status": 500, "size": 0, "started": False}

        async def sending(message):
            if message["type"] == "http.response.start":
                answered["status"], answered["started"] = message["status"], True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            elif message["type"] == "http.response.body":
                answered["size"] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as e:
            LOG.error("%s %s: %s", scope["method"], scope["path"], type(e).__name__, exc_info=e)
            if answered["started"]:
                raise  # mid-answer: uvicorn closes the connection
            bug = error_response(
                500, "internal_error", f"the server failed on this request (id {rid}); its log says why"
            )
            await bug(scope, receive, sending)
        finally:
            seconds = time.perf_counter() - start
            endpoint = scope["path"] if scope["path"] in ENDPOINT_PATHS else "other"
            self.metrics.requests.labels(endpoint, str(answered["status"])).inc()
            self.metrics.latency.labels(endpoint).observe(seconds)
            target = scope.get("raw_path") or scope["path"].encode()
            log_access(
                scope["method"],
                target,
                answered["status"],
                seconds,
                answered["size"],
                access["key"],
                scope.get("client"),
            )
            REQUEST_ID.reset(token)


NEEDS_KEY = "this server needs an API key: send the header 'Authorization: Bearer KEY' with a key it knows"
NEEDS_KEY_WS = (
    f"{NEEDS_KEY} (a browser's WebSocket, which cannot: offer the subprotocols '{PROTOCOL}' and "
    f"'{KEY_PROTOCOL}' followed by the key in base64url)"
)


def authorization(scope) -> str | None:
    """The credentials a request carries: its ``Authorization`` header, else (a WebSocket's
    handshake) the key among its subprotocols, as a Bearer header would say it."""
    given = header(scope, b"authorization")
    if given is None and scope["type"] == "websocket":
        key = protocol_key(scope.get("subprotocols", ()))
        given = None if key is None else f"Bearer {key}"
    return given


class Gate:
    """Who may pass: with keys, a request must carry one (401 otherwise, ``WWW-Authenticate:
    Bearer``; a WebSocket's may be among its subprotocols, :func:`authorization`); with a rate
    limit, a key (without keys, a client address) may make that many requests a minute (429 and
    Retry-After beyond). ``/health`` always passes, for a load balancer's checks: it tells only
    that the server is up and how busy."""

    OPEN = "/health"

    def __init__(self, app, *, keys: Keys, limiter: RateLimiter | None, metrics: Metrics) -> None:
        self.app, self.keys, self.limiter, self.metrics = app, keys, limiter, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope["path"] == self.OPEN:
            return await self.app(scope, receive, send)
        refuse = refusing_handshake(scope, send) if scope["type"] == "websocket" else send
        identity = scope["client"][0] if scope.get("client") else "-"
        if self.keys:
            name = self.keys.match(authorization(scope))
            if name is None:
                self.metrics.refused.labels("unauthorized").inc()
                message = NEEDS_KEY_WS if scope["type"] == "websocket" else NEEDS_KEY
                answer = error_response(401, "unauthorized", message, {"WWW-Authenticate": "Bearer"})
                return await answer(scope, receive, refuse)
            scope.get(ACCESS, {})["key"] = name
            identity = f"key {name}"
        wait = self.limiter.take(identity) if self.limiter is not None else 0
        if wait:
            self.metrics.refused.labels("rate_limited").inc()
            message = f"over the rate limit of {self.limiter.size:g} requests a minute; retry in {wait} s"
            answer = error_response(429, "rate_limited", message, {"Retry-After": str(wait)})
            return await answer(scope, receive, refuse)
        await self.app(scope, receive, send)


def refusing_handshake(scope, send):
    """A WebSocket's ``send`` through which the gate's HTTP answers refuse the handshake: as
    themselves where the server takes the ASGI denial-response extension (uvicorn with
    ``websockets``: the client reads the 401 or 429 and its JSON), else as a close, which the
    server answers 403."""
    if "websocket.http.response" in scope.get("extensions", {}):
        return send  # Starlette's responses send websocket.http.response.* themselves

    async def closing(message):
        if message["type"] == "websocket.http.response.start":  # as Starlette's responses name it
            await send({"type": "websocket.close", "code": 1008})

    return closing


class BodyLimit:
    """Refuses a body over ``limit`` bytes, stated (Content-Length) or sent: 413, read no further.
    The paths of ``uploads`` take files of up to ``upload_limit`` bytes: bodies of that and
    :data:`FORM_ROOM` more, for the form's other fields."""

    def __init__(
        self, app, *, limit: int, metrics: Metrics, uploads: tuple[str, ...] = (), upload_limit: int = 0
    ) -> None:
        self.app, self.limit, self.metrics = app, limit, metrics
        self.uploads, self.upload_limit = uploads, upload_limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        upload = scope["path"] in self.uploads
        limit = self.upload_limit + FORM_ROOM if upload else self.limit
        stated = header(scope, b"content-length")
        size = int(stated) if stated is not None and stated.isdigit() else None
        body = None if size is not None and size > limit else await self._body(receive, limit)
        if body is None:
            self.metrics.refused.labels("too_large").inc()
            said = f"is {size} bytes" if size is not None and size > limit else f"is over {limit} bytes"
            takes = f"files of at most {self.upload_limit} bytes" if upload else f"at most {limit} bytes"
            answer = error_response(413, "too_large", f"the request body {said}; the server takes {takes}")
            return await answer(scope, receive, send)
        given = [False]

        async def replay():
            if not given[0]:
                given[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: http.disconnect when the client leaves

        await self.app(scope, replay, send)

    @staticmethod
    async def _body(receive, limit: int) -> bytes | None:
        """The whole request body, or None when more than ``limit`` bytes are sent."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left: the app sees an empty body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return None
            if not message.get("more_body", False):
                break
        return b"".join(chunks)
