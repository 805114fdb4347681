"""The server's Prometheus metrics (``GET /metrics``, the text format of ``prometheus-client``).

What is here: :class:`Metrics`, one registry per app (two apps in one process never share
counts):
    qkv_requests_total{endpoint, code}     requests answered, by endpoint and status code
    qkv_request_seconds{endpoint}          latency histogram (to the last byte of a stream)
    qkv_batch_requests                     requests per forward pass (histogram)
    qkv_batch_inputs                       inputs (sentences, prompts, texts) per forward pass
    qkv_output_tokens_total{endpoint}      tokens written: rate() of it is tokens/s
    qkv_tokens_per_second                  tokens/s of the latest forward pass (gauge)
    qkv_active_requests                    requests held (waiting, running, streaming)
    qkv_refused_total{reason}              busy (429), rate_limited (429), unauthorized (401),
                                           timeout (504), too_large (413), disconnected

What is not here: when each is counted (``middleware.py``, ``service.py``, ``batching.py``).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    """The metrics of one app (see the module)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("qkv_requests", "Requests answered", ["endpoint", "code"], registry=r)
        self.latency = Histogram(
            "qkv_request_seconds", "Time to answer a request", ["endpoint"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.batch_requests = Histogram(
            "qkv_batch_requests", "Requests per forward pass", buckets=BATCH_BUCKETS, registry=r
        )
        self.batch_inputs = Histogram("qkv_batch_inputs", "Inputs per forward pass", buckets=BATCH_BUCKETS, registry=r)
        self.tokens = Counter("qkv_output_tokens", "Tokens written", ["endpoint"], registry=r)
        self.tokens_per_second = Gauge("qkv_tokens_per_second", "Tokens/s of the latest forward pass", registry=r)
        self.active = Gauge("qkv_active_requests", "Requests held now", registry=r)
        self.refused = Counter("qkv_refused", "Requests refused or dropped", ["reason"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
