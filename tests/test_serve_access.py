"""The server beyond the loopback: API keys on every path but /health (no prefix left open), rate
limits, a request id in every answer and log line, one access-log line per request (never the
key), CORS only when asked, a bug answered as JSON; the command's refusals; a real ``qkv serve``
with keys from a file."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi.testclient import TestClient
from starlette.routing import Route

from qkv.cli.main import main
from qkv.serve import jobs
from qkv.serve.access import Keys, RateLimiter, key_id
from qkv.serve.app import create_app
from qkv.serve.middleware import RequestIdFilter
from qkv.serve.models import load_served
from qkv.serve.settings import Settings
from serving import Server, tiny_models

KEY, OTHER = "k3y-Of-the-first-client-0123456789", "another-key-for-client-two-abcdef"
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD")
# Paths no route of the schema has: the page's files, FastAPI's pages, near-misses of /health.
OTHER_PATHS = (
    "/",
    "/app.js",
    "/style.css",
    "/microphone.js",
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
    "/openapi.json",
    "/metrics",
    "/v1/nothing",
    "/health/",
    "/health/x",
    "//health",
    "/HEALTH",
    "/v1/models/",
    "/%2e%2e/etc/passwd",
    "/health%00",
)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("access"))


@pytest.fixture(scope="module")
def served(paths):
    return load_served([str(p) for p in paths.values()])


@pytest.fixture(scope="module")
def locked(served):
    with TestClient(create_app(served, Settings(api_keys=(KEY, OTHER))), raise_server_exceptions=False) as c:
        yield c


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def every_path(client: TestClient) -> set[str]:
    """Every path of the app: its routes (in the schema or not) and the schema's own."""
    routes = {r.path for r in client.app.routes if isinstance(r, Route)}
    return routes | set(client.get("/openapi.json", headers=bearer(KEY)).json()["paths"]) | set(OTHER_PATHS)


# ----------------------------------------------------------------------------- keys


def test_every_path_but_health_answers_401_without_the_key(locked):
    found = every_path(locked)
    assert {"/v1/translate", "/v1/attention", "/docs", "/metrics", "/", "/openapi.json"} <= found
    for path in sorted(found - {"/health"}):
        for method in METHODS:
            for headers in ({}, bearer("wrong-key-of-sixteen-chars"), {"Authorization": f"Basic {KEY}"}):
                response = locked.request(method, path, headers=headers)
                assert response.status_code == 401, (method, path, headers, response.status_code)
                assert response.headers["www-authenticate"] == "Bearer"
                if method != "HEAD":
                    assert response.json()["error"]["type"] == "unauthorized" and KEY not in response.text
    assert locked.get("/health").status_code == 200  # a load balancer's check needs no key


def test_the_key_opens_every_path_and_either_key_does(locked):
    for key in (KEY, OTHER):
        for path in ("/v1/models", "/", "/docs", "/metrics", "/openapi.json"):
            assert locked.get(path, headers=bearer(key)).status_code == 200, path
        body = {"model": "de_en", "text": "Ein Hund", "beam_size": 2}
        assert locked.post("/v1/translate", json=body, headers=bearer(key)).status_code == 200
    assert locked.get("/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200  # any case
    assert locked.get("/v1/nothing", headers=bearer(KEY)).status_code == 404  # past the gate: the router's answer


def test_keys_match_only_themselves_and_are_named_by_an_id():
    keys = Keys((KEY, OTHER))
    assert keys.match(f"Bearer {KEY}") == key_id(KEY) and keys.match(f"Bearer {OTHER}") == key_id(OTHER)
    for wrong in (None, "", KEY, f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"Token {KEY}", "Bearer", "Bearer \ud800"):
        assert keys.match(wrong) is None, wrong
    assert len(key_id(KEY)) == 8 and key_id(KEY) not in KEY and key_id(KEY) != key_id(OTHER)
    assert not Keys(()) and Keys((KEY,))
    assert KEY not in repr(Settings(api_keys=(KEY,)))


# ----------------------------------------------------------------------------- rate limits


def test_the_rate_limiter_is_a_token_bucket():
    now = [0.0]
    limiter = RateLimiter(3, clock=lambda: now[0])  # 3 a minute: one every 20 s, bursts of 3
    assert [limiter.take("a") for _ in range(3)] == [0, 0, 0]
    assert limiter.take("a") == 20 and limiter.take("b") == 0  # each identity its own bucket
    now[0] = 19.0
    assert limiter.take("a") == 1
    now[0] = 20.0
    assert limiter.take("a") == 0 and limiter.take("a") == 20
    now[0] = 1000.0  # a long idle time refills to the burst, no further
    assert [limiter.take("a") for _ in range(4)] == [0, 0, 0, 20]


def test_over_the_rate_limit_is_429_with_retry_after_per_key(served):
    settings = Settings(api_keys=(KEY, OTHER), rate_limit=2)
    with TestClient(create_app(served, settings)) as c:
        assert [c.get("/v1/models", headers=bearer(KEY)).status_code for _ in range(2)] == [200, 200]
        over = c.get("/v1/models", headers=bearer(KEY))
        assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limited"
        assert int(over.headers["retry-after"]) == 30  # 2 a minute: the next token in 30 s
        assert c.get("/v1/models", headers=bearer(OTHER)).status_code == 200  # the other key's own bucket
        assert all(c.get("/health").status_code == 200 for _ in range(5))  # never limited
        assert 'qkv_refused_total{reason="rate_limited"} 1.0' in c.get("/metrics", headers=bearer(OTHER)).text


def test_without_keys_the_limit_is_per_client_address(served):
    with TestClient(create_app(served, Settings(rate_limit=1))) as c:
        assert c.get("/v1/models").status_code == 200 and c.get("/v1/models").status_code == 429


# ----------------------------------------------------------------------------- request ids and the access log


def test_every_answer_has_a_request_id_and_one_access_line(locked, caplog):
    caplog.set_level(logging.INFO, logger="qkv.serve.access")
    caplog.handler.addFilter(RequestIdFilter())  # as qkv serve's handler has it
    answers = [
        locked.get("/v1/models", headers={**bearer(KEY), "X-Request-ID": "client-id.42"}),
        locked.get("/v1/models", headers={**bearer(KEY), "X-Request-ID": "bad id\twith tab"}),
        locked.get("/v1/models"),  # 401
        locked.post("/v1/translate", json={"text": "x" * 300_000}, headers=bearer(KEY)),  # 413
        locked.post("/v1/translate", json={"text": 1}, headers=bearer(KEY)),  # 422
        locked.get("/health"),
        locked.post("/v1/generate", json={"prompt": "A", "stream": True, "max_new_tokens": 3}, headers=bearer(KEY)),
    ]
    ids = [a.headers["x-request-id"] for a in answers]
    assert [a.status_code for a in answers] == [200, 200, 401, 413, 422, 200, 200]
    assert ids[0] == "client-id.42" and len(set(ids)) == len(ids) and "\t" not in ids[1]
    lines = [r for r in caplog.records if r.name == "qkv.serve.access"]
    assert len(lines) == len(answers)
    for record, answer, rid in zip(lines, answers, ids, strict=True):
        line = record.getMessage()
        assert record.request_id == rid and f" {answer.status_code} " in line and " ms " in line
        assert f" {len(answer.content)} B " in line and KEY not in line
    assert f"key={key_id(KEY)}" in lines[0].getMessage() and "key=-" in lines[2].getMessage()
    assert lines[0].getMessage().startswith("GET /v1/models 200 ")


def test_a_bug_is_a_json_500_with_its_request_id_in_the_log(served, monkeypatch, caplog):
    def broken(served, texts):
        raise RuntimeError("a bug")

    monkeypatch.setattr(jobs, "classify", broken)
    caplog.set_level(logging.INFO, logger="qkv.serve")
    caplog.handler.addFilter(RequestIdFilter())
    with TestClient(create_app(served, Settings()), raise_server_exceptions=False) as c:
        response = c.post("/v1/classify", json={"text": "a"}, headers={"X-Request-ID": "the-bug"})
    assert response.status_code == 500 and response.headers["x-request-id"] == "the-bug"
    error = response.json()["error"]
    assert error["type"] == "internal_error" and "the-bug" in error["message"] and "a bug" not in error["message"]
    (logged,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert logged.request_id == "the-bug" and logged.exc_info[0] is RuntimeError


# ----------------------------------------------------------------------------- CORS


def test_cors_is_off_unless_origins_are_named(locked, served):
    origin = {"Origin": "https://example.org"}
    plain = locked.get("/v1/models", headers={**bearer(KEY), **origin})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
    preflight = {**origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    assert locked.options("/v1/translate", headers=preflight).status_code == 401  # no CORS: the gate answers
    settings = Settings(api_keys=(KEY,), cors_origins=("https://example.org",))
    with TestClient(create_app(served, settings)) as c:
        allowed = c.options("/v1/translate", headers=preflight)
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://example.org"
        assert allowed.content == b"OK"  # a preflight's answer holds no data
        other = c.options("/v1/translate", headers={**preflight, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        unauthorized = c.get("/v1/models", headers=origin)  # the page can read why it was refused
        assert unauthorized.status_code == 401 and unauthorized.headers["access-control-allow-origin"]
        assert c.get("/v1/models", headers={**bearer(KEY), **origin}).status_code == 200


# ----------------------------------------------------------------------------- the command


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["--host", "0.0.0.0"], {}, "--host 0.0.0.0 is reachable from other machines"),
        (["--host", "192.0.2.1"], {}, "give an API key"),
        (["--api-key", "short"], {}, "--api-key: an API key is 16 or more"),
        (["--api-key", "has a space in it, sixteen"], {}, "no spaces"),
        ([], {"QKV_API_KEY": "tiny"}, "QKV_API_KEY: an API key"),
        (["--api-key-file", "/nonexistent/keys"], {}, "--api-key-file /nonexistent/keys: cannot read it"),
        (["--cors-origin", "https://example.org/path"], {}, "--cors-origin"),
    ],
)
def test_serve_refuses_in_one_line(paths, capsys, monkeypatch, argv, env, says):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "--model", str(paths["de_en"]), "--port", "0", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert "short" not in err[0] and "tiny" not in err[0]  # a refused key is never shown


def test_a_real_server_with_keys_from_a_file_logs_each_request_once(paths, tmp_path, monkeypatch):
    monkeypatch.delenv("QKV_API_KEY", raising=False)
    keys = tmp_path / "keys"
    keys.write_text(f"# the clients' keys\n{KEY}\n\n{OTHER}\n")
    server = Server([paths["de_en"]], "--api-key-file", str(keys), cwd=tmp_path, env={"QKV_API_KEY": ""})
    try:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        ok = httpx.post(f"{server.url}/v1/translate", json={"text": "Ein Hund"}, headers=bearer(OTHER))
        assert ok.status_code == 200 and httpx.get(f"{server.url}/health").status_code == 200
    finally:
        code, log = server.stop()
    assert code == 0 and KEY not in log and OTHER not in log
    assert f"the keys' ids (in the log): {key_id(KEY)}, {key_id(OTHER)}" in log
    access = [line for line in log.splitlines() if "qkv.serve.access" in line]
    assert len(access) >= 3 and all(" id=" in line for line in access)
    (translated,) = [line for line in access if "POST /v1/translate 200" in line]
    assert f"id={ok.headers['x-request-id']} " in translated and f"key={key_id(OTHER)}" in translated
