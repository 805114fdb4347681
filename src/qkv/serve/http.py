"""The HTTP layer's own errors in the API's JSON shape.

What is here: :class:`JsonErrorsH11`, uvicorn's h11 protocol answering a request it cannot
parse (broken framing, a request line or headers over h11's 16 KiB, a bad header) with the
API's JSON error (400) instead of uvicorn's plain text; ``qkv serve`` runs uvicorn with it.
Such a request never reaches the app (no route, no key asked, no metrics), but its answer has
an ``X-Request-ID`` and the access log a line, as every other; the answer closes the
connection, as uvicorn's does.

What is not here: errors of requests the app receives (``errors.py``). What cannot be answered
at all is a connection closed before a request line, or one that sends nothing (uvicorn's
keep-alive timeout closes it).
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from qkv.serve.access import request_id
from qkv.serve.middleware import REQUEST_ID, log_access

MALFORMED = "the request is not well-formed HTTP/1.1 (its framing, or headers over 16 KiB)"


def malformed_body() -> bytes:
    """The JSON error a malformed request gets (the shape of ``errors.error_body``)."""
    return json.dumps({"error": {"code": 400, "type": "malformed_request", "message": MALFORMED}}).encode()


class JsonErrorsH11(H11Protocol):
    """uvicorn's h11 protocol, whose answer to a request it cannot parse is JSON."""

    def handle_events(self) -> None:
        """Parse what arrived with an id ready for a request that fails to parse (uvicorn's
        warning and the answer carry it; a request that parses gets its own from the app)."""
        token = REQUEST_ID.set(request_id(None))
        try:
            super().handle_events()
        finally:
            REQUEST_ID.reset(token)

    def send_400_response(self, msg: str) -> None:
        body, rid = malformed_body(), REQUEST_ID.get()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", rid.encode()),
            (b"connection", b"close"),
        ]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body)):
            self.transport.write(self.conn.send(event))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()
        log_access("-", b"-", 400, 0.0, len(body), None, self.client)
