"""Who may call the server and how often: API keys, rate limits, request ids.

What is here, as plain logic the middleware (``middleware.py``) applies:
:class:`Keys` (the API keys a request may carry as ``Authorization: Bearer KEY``, compared in
constant time; a key is named in logs by :func:`key_id`, never itself), :func:`protocol_key`
(the key a browser's WebSocket carries among its subprotocols, as it cannot set a header:
:data:`KEY_PROTOCOL` and the key in base64url, beside :data:`PROTOCOL`), :class:`RateLimiter`
(a token bucket per key, or per client address without keys: 429 with Retry-After beyond it)
and :func:`request_id` (the id in every response's ``X-Request-ID`` and every log line: the
client's own when it is a plain short one, else a new one).

What is not here: HTTP (``middleware.py``), the options (``qkv.cli.serve``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import re
import time
import uuid
from collections.abc import Callable, Sequence

SAFE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_CLIENTS = 10_000  # buckets kept at most; beyond, the full (idle) ones are forgotten
# A browser's WebSocket cannot set Authorization; it can offer subprotocols (RFC 6455 section
# 4.1), tokens of RFC 7230's characters, which a key may go beyond (any visible ASCII): the key
# goes base64url-encoded after KEY_PROTOCOL (as Kubernetes' "base64url.bearer.authorization.k8s.io."),
# beside PROTOCOL, the one the server selects (a browser fails a handshake whose answer selects
# none of those it offered; the key is never sent back).
PROTOCOL = "qkv"
KEY_PROTOCOL = "qkv.bearer."


def key_id(key: str) -> str:
    """A key's name in logs and messages: the first 8 hex digits of its SHA-256 (the key
    cannot be read back from it)."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


class Keys:
    """The API keys a server accepts (none: every request is let in)."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.digests = [(hashlib.sha256(k.encode()).digest(), key_id(k)) for k in keys]

    def __bool__(self) -> bool:
        return bool(self.digests)

    def match(self, authorization: str | None) -> str | None:
        """The id of the key an ``Authorization`` header carries (``Bearer KEY``), or None.
        Every key is compared, each in constant time (``hmac.compare_digest`` of SHA-256
        digests, all of one length), so the time taken says nothing of how close a guess was."""
        scheme, _, given = (authorization or "").partition(" ")
        digest = hashlib.sha256(given.strip().encode(errors="replace")).digest()
        found = None
        for known, name in self.digests:
            if hmac.compare_digest(digest, known) and scheme.lower() == "bearer":
                found = name
        return found


def protocol_key(offered: Sequence[str]) -> str | None:
    """The key among a WebSocket's offered subprotocols: the first :data:`KEY_PROTOCOL` one's,
    base64url-decoded (padding optional); None when there is none or it is not base64url text."""
    for protocol in offered:
        if protocol.startswith(KEY_PROTOCOL):
            code = protocol[len(KEY_PROTOCOL) :]
            try:
                return base64.b64decode(code + "=" * (-len(code) % 4), altchars=b"-_", validate=True).decode()
            except ValueError:  # binascii.Error and UnicodeDecodeError are ValueErrors
                return None
    return None


class RateLimiter:
    """At most ``per_minute`` requests a minute per identity, in bursts of up to ``per_minute``:
    a token bucket of that size, refilled at ``per_minute / 60`` tokens a second (the
    classic traffic-shaping rule, as in nginx's ``limit_req``)."""

    def __init__(self, per_minute: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.size, self.rate, self.clock = per_minute, per_minute / 60, clock
        self.buckets: dict[str, tuple[float, float]] = {}  # identity -> (tokens, when counted)

    def take(self, identity: str) -> int:
        """Take one request's token: 0 when there is one, else the whole seconds until there is."""
        now = self.clock()
        tokens, then = self.buckets.get(identity, (self.size, now))
        tokens = min(self.size, tokens + (now - then) * self.rate)
        if tokens >= 1:
            self.buckets[identity] = (tokens - 1, now)
            self._forget(now)
            return 0
        self.buckets[identity] = (tokens, now)
        return max(1, math.ceil((1 - tokens) / self.rate))

    def _forget(self, now: float) -> None:
        """Bound the memory: past :data:`MAX_CLIENTS` identities, drop those whose bucket is full again."""
        if len(self.buckets) > MAX_CLIENTS:
            self.buckets = {
                who: (tokens, then)
                for who, (tokens, then) in self.buckets.items()
                if tokens + (now - then) * self.rate < self.size
            }


def request_id(given: str | None) -> str:
    """The request's id: the client's ``X-Request-ID`` when it is 1 to 64 letters, digits, dots,
    dashes or underscores (safe in a header and a log line), else a new random one."""
    if given is not None and SAFE_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex
