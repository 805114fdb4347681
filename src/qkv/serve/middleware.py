"""The ASGI middleware around the app: what every request passes before and after its route.

What is here: :class:`Guard`, which refuses a body over the limit (413, read no further) and
counts every answer (status, latency to its last byte) in the metrics.

What is not here: the routes (``routes/``), the errors' shape (``errors.py``).
"""

from __future__ import annotations

import time

from qkv.serve.errors import error_response
from qkv.serve.metrics import Metrics
from qkv.serve.settings import Settings

ENDPOINT_PATHS = (  # the paths the metrics count by name; any other is "other"
    "/v1/translate",
    "/v1/generate",
    "/v1/chat",
    "/v1/embed",
    "/v1/classify",
    "/v1/attention",
    "/v1/models",
    "/health",
    "/metrics",
    "/",
)


class Guard:
    """ASGI middleware around the app: refuses a body over ``max_body_bytes`` (413, read no
    further), and counts every answer (status, latency to its last byte) in the metrics."""

    def __init__(self, app, *, settings: Settings, metrics: Metrics) -> None:
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINT_PATHS else "other"
        start = time.perf_counter()
        status = [500]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            body = await self._body(scope, receive)
            if body is None:
                self.metrics.refused.labels("too_large").inc()
                limit = self.settings.max_body_bytes
                answer = error_response(413, "too_large", f"the request body is over {limit} bytes")
                return await answer(scope, receive, sending)
            given = [False]

            async def replay():
                if not given[0]:
                    given[0] = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()  # after the body: http.disconnect when the client leaves

            await self.app(scope, replay, sending)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

    async def _body(self, scope, receive) -> bytes | None:
        """The whole request body, or None when it is over the limit (stated or sent)."""
        limit = self.settings.max_body_bytes
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return None
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
