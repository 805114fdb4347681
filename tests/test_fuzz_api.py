"""Nothing a client sends makes the server answer 5xx: schema-driven fuzzing of the whole API.

Schemathesis reads the app's own ``/openapi.json`` and, through hypothesis, draws requests for
every operation in it: bodies that fit the schema (positive) and bodies that break it in every
way the schema allows (negative: wrong types, missing and unknown fields, numbers out of range,
bytes that are not JSON). Each is sent to the app in-process; the property is that its answer
is below 500 and, when it is not a 200, the API's JSON error with that code. After each
operation's batch, a good request of every endpoint is answered 200 (the model thread and the
batcher are alive). Seeded (``derandomize``): the same requests every run.

:func:`fuzz_api` is the harness; ``bench/fuzz_api.py`` runs it at length (thousands of requests
per operation, against a real ``qkv serve`` too) and records the counts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest
from fastapi.testclient import TestClient

from qkv.serve.app import create_app
from qkv.serve.models import load_served
from qkv.serve.settings import Settings
from serving import tiny_audio_models, tiny_models, tone

schemathesis = pytest.importorskip("schemathesis", reason="the API fuzz needs schemathesis (pip install -e .[dev])")

# Small limits: every drawn request is cheap for the tiny models, and the limits are fuzzed too.
LIMITS = Settings(max_chars=40, max_texts=3, max_new_tokens=8, max_beam=3, timeout_s=20)
EXAMPLES = 20  # drawn requests per operation and mode in the suite (bench/fuzz_api.py: thousands)
GOOD = {  # a request of every endpoint that must be answered 200 after each batch
    ("GET", "/health"): None,
    ("GET", "/v1/models"): None,
    ("GET", "/v1/models/{model}"): None,  # sent as /v1/models/lm
    ("POST", "/v1/translate"): {"model": "de_en", "text": "Ein Hund", "beam_size": 2},
    ("POST", "/v1/generate"): {"model": "lm", "prompt": "A dog", "max_new_tokens": 3},
    ("POST", "/v1/chat"): {"model": "lm", "messages": ["hello"], "max_new_tokens": 3, "beam_size": 1},
    ("POST", "/v1/embed"): {"model": "acts", "text": "hello"},
    ("POST", "/v1/classify"): {"model": "acts", "text": "hello"},
    ("POST", "/v1/attention"): {"model": "de_en", "text": "Ein Hund", "max_new_tokens": 3},
    ("POST", "/v1/chat/completions"): {"model": "lm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    ("POST", "/v1/completions"): {"model": "lm", "prompt": "A dog", "max_tokens": 3},
    ("POST", "/v1/audio/transcriptions"): {"model": "asr"},  # with a file (UPLOADS)
    ("POST", "/v1/audio/translations"): {"model": "st", "response_format": "srt"},
    ("POST", "/v1/audio/speech"): {"model": "tts", "input": "do re mi"},
    ("POST", "/v1/audio/attention"): {"model": "asr", "start": "0", "end": "0.5", "tokens": "5,6"},
    ("POST", "/v1/audio/speech/attention"): {"model": "tts", "input": "do re mi"},
    ("POST", "/v1/chat/attention"): {"model": "lm", "messages": [{"role": "user", "content": "hi"}], "answer": "a dog"},
}
UPLOADS = (  # multipart forms: a good one has a file
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/audio/attention",
)


# Values a careless or hostile client writes that a schema's generator does not: non-finite
# numbers (json.dumps writes them as Infinity and NaN, which json.loads reads back), integers
# past 64 bits, lone surrogates, NUL, long and deep values, the wrong kind of container.
NASTY = (
    float("inf"),
    float("-inf"),
    float("nan"),
    1e308,
    5e-324,
    -0.0,
    2**31,
    2**63,
    2**64,
    -(2**63) - 1,
    10**40,
    -1,
    0,
    "\ud800",
    "a\udfffb",
    "\x00",
    "🙂" * 300,
    "x" * 5000,
    [],
    {},
    None,
    True,
    [["nested"]],
    ["\ud800"],
    [float("nan")],
)


@dataclass
class Counts:
    """One operation's requests: how many, by status code, how many broke the property, and
    the first of those (why, the request)."""

    sent: int = 0
    failed: int = 0
    codes: dict[int, int] = field(default_factory=dict)
    failures: list[tuple[str, str]] = field(default_factory=list)


def send(client: httpx.Client, kwargs: dict) -> httpx.Response:
    """Send a drawn request (schemathesis' transport arguments) with ``client``. The JSON body is
    written here, non-finite numbers and all, as a careless client would write it."""
    headers = {k: str(v) for k, v in (kwargs.get("headers") or {}).items()}
    content = kwargs.get("data")
    if "json" in kwargs:
        content = json.dumps(kwargs["json"]).encode()
        headers.setdefault("Content-Type", "application/json")
    path = httpx.URL(kwargs["url"]).raw_path.decode("ascii")
    files = kwargs.get("files")
    if files:  # a multipart form: httpx writes it, with its own boundary in the Content-Type
        headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}
        content = None
        files = textual(files)
    return client.request(
        kwargs["method"], path, headers=headers, params=kwargs.get("params"), content=content, files=files
    )


def textual(files: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    """A drawn multipart form, ``(name, (filename, value, ...))`` each, with its integer values
    written as text, as a form field is on the wire (schemathesis leaves them ints for
    ``requests``, which writes them; httpx cannot)."""
    return [(name, (part[0], str(part[1]), *part[2:]) if isinstance(part[1], int) else part) for name, part in files]


def judged(response: httpx.Response, body: object) -> str | None:
    """Why an answer to ``body`` breaks the property (None: it keeps it): a 5xx (but the 504 of
    a request that set its own ``timeout``: the deadline it chose passed), or an error not in
    the JSON shape."""
    code = response.status_code
    own_deadline = isinstance(body, dict) and isinstance(body.get("timeout"), int | float)
    if code >= 500 and not (code == 504 and own_deadline):
        return f"{code}: {response.text[:200]}"
    if code == 200:
        return None
    try:
        error = response.json()["error"]
        assert error["code"] == code and isinstance(error["message"], str) and error["type"]
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"{code} not the JSON error shape: {response.text[:200]}"
    return None


def good_requests(client: httpx.Client) -> list[str]:
    """The good request of every endpoint, sent; what went wrong (empty: every one answered 200)."""
    wrong = []
    for (method, path), body in GOOD.items():
        if path in UPLOADS:
            response = client.request(method, path, data=body, files={"file": ("tone.wav", tone(0.5))})
        else:
            response = client.request(method, path.format(model="lm"), json=body)
        if response.status_code != 200:
            wrong.append(f"{method} {path}: {response.status_code} {response.text[:200]}")
    return wrong


def fields_of(openapi: dict, path: str) -> list[str]:
    """The names of the fields of ``path``'s JSON request body in the schema ``openapi`` (none: [];
    a multipart form's fields are drawn by schemathesis alone)."""
    body = openapi["paths"][path].get("post", {}).get("requestBody")
    if body is None or "application/json" not in body["content"]:
        return []
    name = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    return sorted(openapi["components"]["schemas"][name]["properties"])


def _fuzz_operation(
    operation,
    negative: bool,
    client: httpx.Client,
    counts: Counts,
    *,
    models: list[str],
    examples: int,
    seed: int,
    show: int,
) -> None:
    """Send ``examples`` requests drawn for ``operation`` (``negative``: breaking its schema),
    counted in ``counts``: a third as drawn, a third naming one of ``models`` (or none) and
    asking for little work (to go past the 404 and the limits, to the model), a third with one
    field set to a :data:`NASTY` value."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seeded
    from hypothesis import strategies as st
    from hypothesis.errors import Unsatisfiable

    mode = schemathesis.GenerationMode.NEGATIVE if negative else schemathesis.GenerationMode.POSITIVE
    cases = operation.as_strategy(generation_mode=mode)
    fields = fields_of(operation.schema.raw_schema, operation.path)
    nasty = st.tuples(st.sampled_from(fields), st.sampled_from(NASTY)).map(lambda kv: dict([kv]))
    within = {
        "max_new_tokens": st.integers(1, 8),
        "max_tokens": st.integers(1, 8),
        "beam_size": st.integers(1, 3),
    }  # past the limits to the work
    served = st.fixed_dictionaries(
        {"model": st.sampled_from([None, *models])} | {k: within[k] for k in within if k in fields}
    )
    mutations = st.one_of(st.just({}), served, nasty) if fields else st.just({})

    def one(case, mutation) -> None:
        kwargs = case.as_transport_kwargs(base_url="http://qkv")
        if isinstance(kwargs.get("json"), dict):
            kwargs["json"] = {**kwargs["json"], **mutation}
        response = send(client, kwargs)
        counts.sent += 1
        counts.codes[response.status_code] = counts.codes.get(response.status_code, 0) + 1
        failure = judged(response, kwargs.get("json"))
        counts.failed += failure is not None
        if failure is not None and len(counts.failures) < show:
            counts.failures.append((failure, repr({k: kwargs.get(k) for k in ("json", "data")})[:300]))

    quiet = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    try:
        seeded(seed)(quiet(given(case=cases, mutation=mutations)(one)))()
    except Unsatisfiable:  # an operation with no parameters has no request that breaks its schema
        if not negative:
            raise


def fuzz_api(
    client: httpx.Client,
    *,
    examples: int,
    seed: int = 0,
    show: int = 3,
    on_batch: Callable[[str, Counts], None] | None = None,
) -> tuple[dict[str, Counts], list[str]]:
    """Fuzz every operation of ``client``'s ``/openapi.json`` with ``examples`` positive and
    ``examples`` negative requests; per operation, its counts (the first ``show`` failures kept);
    and what the good requests after each batch got wrong. ``on_batch(name, counts)`` after each."""
    schema = schemathesis.openapi.from_dict(client.get("/openapi.json").json())
    models = [m["name"] for m in client.get("/v1/models").json()["models"]]
    found: dict[str, Counts] = {}
    alive: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        name = f"{operation.method.upper()} {operation.path}"
        counts = found.setdefault(name, Counts())
        for negative in (False, True):
            _fuzz_operation(operation, negative, client, counts, models=models, examples=examples, seed=seed, show=show)
        alive += [f"after {name}: {w}" for w in good_requests(client)]
        if on_batch is not None:
            on_batch(name, counts)
    return found, alive


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    models = [*tiny_models(tmp_path_factory.mktemp("fuzz_api")).values()]
    models += tiny_audio_models(tmp_path_factory.mktemp("fuzz_audio")).values()
    served = load_served([str(p) for p in models])
    with TestClient(create_app(served, LIMITS), raise_server_exceptions=False) as c:
        yield c


def test_no_request_drawn_from_the_schema_makes_a_5xx(client):
    found, alive = fuzz_api(client, examples=EXAMPLES, seed=0)
    assert set(found) == {f"{m} {p}" for m, p in GOOD}  # every operation of the schema, and only those
    failures = {name: (c.failed, c.failures) for name, c in found.items() if c.failed}
    assert not failures, failures
    assert not alive, alive
    for name, counts in found.items():  # an operation with a body: both modes drew their requests
        assert name.startswith("GET") or counts.sent >= 2 * EXAMPLES - 5, (name, counts.sent)
    refused = sum(n for c in found.values() for code, n in c.codes.items() if code == 422)
    answered = sum(c.codes.get(200, 0) for c in found.values())
    assert refused and answered  # both kinds were drawn: bad requests refused, good ones answered
