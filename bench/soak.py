"""Soak (issue 48, section 5): ``qkv serve`` under mixed good and bad clients for minutes, and
whether anything grows.

    python bench/soak.py                         # 10 minutes, 4 good and 2 bad clients
    nice -n 10 python bench/soak.py --minutes 2 --note "2-minute run on a busy machine"

A real ``qkv serve`` starts on a free port of 127.0.0.1 (nothing else is reached) with the tiny
random models of tests/serving.py: a translator, a language model (decoder-only, so OpenAI's
chat API is served too), a classifier, a recognizer, a speech translator and a TTS model. Then,
for ``--minutes``:

- good clients (``--good``), each on its own keep-alive connection, send one request after
  another, round the endpoints: translate, generate, chat, attention, embed, classify, OpenAI
  chat completions (streamed, read to ``data: [DONE]``) and completions, transcription,
  speech translation and speech. Each must be answered 200 (a stream: 200 and ``[DONE]``);
- bad clients (``--bad``) send, round the list in ``BAD``: malformed JSON, wrong types, a
  non-finite number, an unknown model, a body over the limit, HTTP the server cannot parse, a
  stream dropped after its first event, and slowloris-like requests (headers, or a body,
  dribbled a byte at a time until the client gives up after ``--slow-seconds``). Any answer
  but a 5xx is right for them (the 4xx is checked by tests/test_fuzz_api.py).

Sampled every second from /proc/PID: the server's resident memory (VmRSS) and its open file
descriptors. Reported: failures among good requests (must be 0), 5xx to bad ones (must be 0),
RSS growth from just after the warm-up (``--warmup``, default a fifth of the run up to a minute)
to the end (median of the first and last ``WINDOW`` seconds; target at most 5%), open
descriptors of the idle server before and after the load (must not grow), and p50 / p99
latency per endpoint per ``--bucket`` seconds (default a minute). A picture of the three over
time goes to ``--figure`` (default docs/images/soak.png) and the figures to
bench/results/soak.json (bench/record.py) unless ``--no-record``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 15.0  # seconds of samples whose median is the RSS just after the warm-up, and at the end

LM_CHAT = {"model": "lm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
GOOD = {  # endpoint -> (method, path, JSON body or form fields, whether a WAV file is uploaded)
    "translate": ("POST", "/v1/translate", {"model": "de_en", "text": "Ein Hund läuft.", "beam_size": 2}, False),
    "generate": ("POST", "/v1/generate", {"model": "lm", "prompt": "A dog", "max_new_tokens": 3}, False),
    "chat": ("POST", "/v1/chat", {"model": "lm", "messages": ["hello"], "max_new_tokens": 3, "beam_size": 1}, False),
    "attention": ("POST", "/v1/attention", {"model": "de_en", "text": "Ein Hund", "max_new_tokens": 3}, False),
    "embed": ("POST", "/v1/embed", {"model": "acts", "text": "hello"}, False),
    "classify": ("POST", "/v1/classify", {"model": "acts", "text": "Grüße aus 北京"}, False),
    "chat/completions stream": ("POST", "/v1/chat/completions", {**LM_CHAT, "stream": True}, False),
    "completions": ("POST", "/v1/completions", {"model": "lm", "prompt": "A dog", "max_tokens": 3}, False),
    "audio/transcriptions": ("POST", "/v1/audio/transcriptions", {"model": "asr"}, True),
    "audio/translations": ("POST", "/v1/audio/translations", {"model": "st", "response_format": "srt"}, True),
    "audio/speech": ("POST", "/v1/audio/speech", {"model": "tts", "input": "do re mi"}, False),
}
BAD = (
    "malformed JSON",
    "wrong types",
    "non-finite number",
    "unknown model",
    "oversize body",
    "broken HTTP",
    "dropped stream",
    "slow headers",
    "slow body",
)


@dataclass
class Log:
    """What the run saw: good requests (t, endpoint, seconds, failure or None), bad ones
    (kind, outcome), and samples (t, RSS MB, open fds); t in seconds from the load's start."""

    start: float = field(default_factory=time.monotonic)
    good: list[tuple[float, str, float, str | None]] = field(default_factory=list)
    bad: list[tuple[str, str]] = field(default_factory=list)
    samples: list[tuple[float, float, int]] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.start


def resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def good_request(http, name: str, wav: bytes) -> str | None:
    """Send endpoint ``name``'s good request; what was wrong with the answer (None: nothing)."""
    method, path, body, upload = GOOD[name]
    if upload:
        response = await http.request(method, path, data=body, files={"file": ("tone.wav", wav)})
    elif body.get("stream"):
        async with http.stream(method, path, json=body) as response:
            text = (await response.aread()).decode("utf-8", "replace")
        if response.status_code == 200 and not text.rstrip().endswith("data: [DONE]"):
            return f"stream did not end with [DONE]: {text[-120:]!r}"
    else:
        response = await http.request(method, path, json=body)
    if response.status_code != 200:
        return f"{response.status_code} {response.text[:160]}"
    if name == "audio/speech" and len(response.content) < 44:
        return f"speech of {len(response.content)} bytes"
    return None


async def good_client(i: int, url: str, log: Log, end: float, wav: bytes) -> None:
    import httpx

    names = list(GOOD)
    k = i
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while time.monotonic() < end:
            name = names[k % len(names)]
            k += 1
            started = time.monotonic()
            try:
                wrong = await good_request(http, name, wav)
            except httpx.HTTPError as e:
                wrong = f"{type(e).__name__}: {e}"
            log.good.append((started - log.start, name, time.monotonic() - started, wrong))


async def raw(port: int, parts: list[bytes], *, pause: float = 0.0, give_up: float = 30.0) -> str:
    """Write ``parts`` on a fresh connection (``pause`` seconds apart), then read the answer's
    status; 'closed' when the server closed first, 'gave up' when the client did after ``give_up``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(give_up):
            for part in parts:
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(pause)
            line = await reader.readline()
        return line.split()[1].decode() if line.startswith(b"HTTP/") else "closed"
    except TimeoutError:
        return "gave up"
    except (ConnectionError, OSError):
        return "closed"
    finally:
        writer.close()


async def bad_request(http, port: int, kind: str, slow: float) -> str:
    """Send one bad request of ``kind``; the outcome: a status code, 'closed' or 'gave up'."""
    head = b"POST /v1/translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    if kind == "malformed JSON":
        r = await http.post("/v1/translate", content=b'{"model": "de_en", "text": "Ein', headers=JSON)
    elif kind == "wrong types":
        r = await http.post("/v1/generate", json={"model": ["lm"], "prompt": 5, "max_new_tokens": "many"})
    elif kind == "non-finite number":
        body = b'{"model": "de_en", "text": "Ein Hund", "length_penalty": Infinity, "timeout": NaN}'
        r = await http.post("/v1/translate", content=body, headers=JSON)
    elif kind == "unknown model":
        r = await http.post("/v1/chat/completions", json={**LM_CHAT, "model": "nobody"})
    elif kind == "oversize body":
        r = await http.post("/v1/translate", content=b'{"text": "' + b"x" * 300_000 + b'"}', headers=JSON)
    elif kind == "broken HTTP":
        return await raw(port, [b"POST /v1/translate HTTP/1.1\r\nContent-Length: many\r\n\r\n{}"])
    elif kind == "dropped stream":
        body = {**LM_CHAT, "stream": True, "max_tokens": 8}
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_bytes():
                break  # the first event, then the connection is closed with the stream unread
        return str(r.status_code)
    elif kind == "slow headers":
        return await raw(port, [bytes([b]) for b in head], pause=slow / len(head), give_up=slow)
    else:  # slow body: its Content-Length promises more than ever comes
        return await raw(port, [head + b"Content-Length: 64\r\n\r\n", b'{"te', b"xt"], pause=slow, give_up=slow)
    return str(r.status_code)


JSON = {"Content-Type": "application/json"}


async def bad_client(i: int, url: str, port: int, log: Log, end: float, slow: float) -> None:
    import httpx

    k = i
    while time.monotonic() < end:
        kind = BAD[k % len(BAD)]
        k += 1
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:  # a fresh connection each
            try:
                outcome = await bad_request(http, port, kind, slow)
            except httpx.HTTPError as e:
                outcome = type(e).__name__
        log.bad.append((kind, outcome))
        await asyncio.sleep(0.05)


async def sampler(pid: int, log: Log, end: float) -> None:
    while time.monotonic() < end:
        log.samples.append((log.now(), resident_mb(pid), open_fds(pid)))
        await asyncio.sleep(1.0)


async def soak(url: str, pid: int, args, wav: bytes) -> Log:
    log = Log()
    end = log.start + args.minutes * 60
    port = int(url.rsplit(":", 1)[1])
    tasks = [sampler(pid, log, end)]
    tasks += [good_client(i, url, log, end, wav) for i in range(args.good)]
    tasks += [bad_client(i, url, port, log, end, args.slow_seconds) for i in range(args.bad)]
    await asyncio.gather(*tasks)
    return log


async def prime(url: str, wav: bytes) -> list[str]:
    """One good request of every endpoint on a connection then closed; what went wrong."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        found = [(name, await good_request(http, name, wav)) for name in GOOD]
    return [f"{name}: {wrong}" for name, wrong in found if wrong]


def percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def median_between(samples: list[tuple[float, float, int]], lo: float, hi: float) -> float:
    inside = [rss for t, rss, _ in samples if lo <= t <= hi]
    return statistics.median(inside) if inside else float("nan")


def latency_table(log: Log, bucket: float) -> dict[str, list[dict]]:
    """Per endpoint, per ``bucket`` seconds: requests, p50 and p99 of the good requests answered."""
    table: dict[str, list[dict]] = {}
    for name in GOOD:
        rows = []
        last = max((t for t, *_ in log.good), default=0.0)
        for b in range(int(last // bucket) + 1):
            took = [s for t, n, s, wrong in log.good if n == name and not wrong and b * bucket <= t < (b + 1) * bucket]
            if took:
                rows.append(
                    {"from_s": b * bucket, "n": len(took), "p50": percentile(took, 50), "p99": percentile(took, 99)}
                )
        table[name] = rows
    return table


def summary(log: Log, args, idle_before: int, idle_after: int) -> dict:
    seconds = args.minutes * 60
    after_warmup = median_between(log.samples, args.warmup, args.warmup + WINDOW)
    at_end = median_between(log.samples, seconds - WINDOW, seconds)
    loaded = [fds for t, _, fds in log.samples if t >= args.warmup]
    outcomes: dict[str, dict[str, int]] = {}
    for kind, outcome in log.bad:
        outcomes.setdefault(kind, {}).setdefault(outcome, 0)
        outcomes[kind][outcome] += 1
    return {
        "good_requests": len(log.good),
        "good_failed": sum(1 for *_, wrong in log.good if wrong),
        "first_failures": [wrong for *_, wrong in log.good if wrong][:5],
        "good_per_second": round(len(log.good) / seconds, 2),
        "bad_requests": len(log.bad),
        "bad_5xx": sum(1 for _, o in log.bad if o.isdigit() and int(o) >= 500),
        "bad_outcomes": outcomes,
        "rss_mb_after_warmup": round(after_warmup, 1),
        "rss_mb_end": round(at_end, 1),
        "rss_mb_peak": round(max(rss for _, rss, _ in log.samples), 1),
        "rss_growth_pct": round(100 * (at_end - after_warmup) / after_warmup, 2),
        "fds_idle_before": idle_before,
        "fds_idle_after": idle_after,
        "fds_under_load_min": min(loaded, default=0),
        "fds_under_load_max": max(loaded, default=0),
        "latency": latency_table(log, args.bucket),
    }


def draw(log: Log, found: dict, args, path: Path) -> None:
    """RSS, open descriptors and latency over time, one panel each, into ``path`` (atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [t / 60 for t, *_ in log.samples]
    fig, (rss, fds, lat) = plt.subplots(3, 1, figsize=(9, 9), sharex=True, height_ratios=(1, 1, 2))
    rss.plot(minutes, [r for _, r, _ in log.samples], color="tab:blue")
    rss.axvline(args.warmup / 60, color="grey", linestyle=":", label="end of warm-up")
    rss.set_ylabel("server RSS (MB)")
    rss.set_title(
        f"qkv serve, {args.minutes:g} min, {args.good} good + {args.bad} bad clients: "
        f"{found['good_failed']} of {found['good_requests']} good requests failed, RSS {found['rss_growth_pct']:+.1f}%"
    )
    rss.legend(loc="lower right", fontsize=8)
    fds.plot(minutes, [f for *_, f in log.samples], color="tab:green", drawstyle="steps-post")
    fds.set_ylabel("open fds")
    colors = plt.get_cmap("tab20").colors
    for c, name in enumerate(GOOD):
        points = [(t / 60, s * 1000) for t, n, s, wrong in log.good if n == name and not wrong]
        if points:
            xs, ys = zip(*points, strict=True)
            lat.scatter(xs, ys, s=3, alpha=0.25, color=colors[c % 20])
        rows = found["latency"][name]
        if rows:
            edges = [r["from_s"] / 60 for r in rows] + [(rows[-1]["from_s"] + args.bucket) / 60]
            p99 = [r["p99"] * 1000 for r in rows]
            lat.plot(edges, [*p99, p99[-1]], drawstyle="steps-post", color=colors[c % 20], label=name)
    lat.set_yscale("log")
    lat.set_ylabel("latency (ms): dots each request,\nlines p99 per bucket")
    lat.set_xlabel("minutes")
    lat.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.12))  # below: the lines stay clear
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.stem}.part.png")
    fig.savefig(part, dpi=100, bbox_inches="tight")  # the legend below the axes included
    plt.close(fig)
    paletted(part)
    part.replace(path)


def paletted(path: Path) -> None:
    """Rewrite a PNG with a palette of 128 colours: thousands of translucent dots make a full-colour
    picture of some 300 KB, too much for the docs; it looks the same at about a third."""
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=128)
    small.save(path, optimize=True)


def record(found: dict, args) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from record import append_run

    setting = f"{args.good} good + {args.bad} bad clients, {args.minutes:g} min"
    notes = f"{setting}, warm-up {args.warmup:g} s; tiny random models of tests/serving.py. {args.note}".strip()
    latency = {
        name: "; ".join(f"from {r['from_s'] / 60:g} min: p50 {r['p50']:.3f} s, p99 {r['p99']:.3f} s" for r in rows)
        for name, rows in found["latency"].items()
    }
    outcomes = {k: ", ".join(f"{o} ×{n}" for o, n in v.items()) for k, v in found["bad_outcomes"].items()}
    records = [
        {
            "metric": "soak: good requests failed",
            "figure": found["good_failed"],
            "unit": "requests",
            "target": {"max": 0},
            "details": {"good requests": found["good_requests"], "per second": found["good_per_second"]},
            "notes": notes,
        },
        {
            "metric": "soak: bad requests answered 5xx",
            "figure": found["bad_5xx"],
            "unit": "requests",
            "target": {"max": 0},
            "details": {"bad requests": found["bad_requests"], **outcomes},
            "notes": notes,
        },
        {
            "metric": "soak: server RSS growth after warm-up",
            "figure": found["rss_growth_pct"],
            "unit": "%",
            "target": {"max": 5},
            "details": {k: found[k] for k in ("rss_mb_after_warmup", "rss_mb_end", "rss_mb_peak")},
            "notes": notes + f" RSS: medians of the {WINDOW:g} s after the warm-up and of the last {WINDOW:g} s.",
        },
        {
            "metric": "soak: open file descriptors, idle after the load minus before",
            "figure": found["fds_idle_after"] - found["fds_idle_before"],
            "unit": "fds",
            "target": {"max": 0},
            "details": {
                k: found[k] for k in ("fds_idle_before", "fds_idle_after", "fds_under_load_min", "fds_under_load_max")
            },
            "notes": notes,
        },
        {
            "metric": "soak: latency per endpoint",
            "figure": round(max(r["p99"] for rows in found["latency"].values() for r in rows), 3),
            "unit": "s (the highest p99 of any endpoint and bucket)",
            "details": latency,
            "notes": notes,
        },
    ]
    append_run("soak", records)


def idle_fds(pid: int, settle: float = 2.0) -> int:
    """Open descriptors once no client is connected (after ``settle`` seconds for closes to land)."""
    time.sleep(settle)
    return open_fds(pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10, help="how long the load runs (default: 10)")
    parser.add_argument("--good", type=int, default=4, help="concurrent good clients (default: 4)")
    parser.add_argument("--bad", type=int, default=2, help="concurrent bad clients (default: 2)")
    parser.add_argument("--warmup", type=float, help="seconds before RSS is compared (default: a fifth, at most 60)")
    parser.add_argument("--bucket", type=float, default=60, help="seconds per latency percentile (default: 60)")
    parser.add_argument("--slow-seconds", type=float, default=3, help="how long a slow client dribbles (default: 3)")
    parser.add_argument("--figure", type=Path, default=ROOT / "docs" / "images" / "soak.png", help="the picture")
    parser.add_argument("--note", default="", help="what to say about the run in the record's notes")
    parser.add_argument("--no-record", action="store_true", help="print only; append nothing to bench/results")
    args = parser.parse_args(argv)
    if not 0 < args.minutes <= 24 * 60 or not 1 <= args.good <= 64 or not 0 <= args.bad <= 64 or args.bucket <= 0:
        parser.error("--minutes must be in (0, 1440], --good 1..64, --bad 0..64, --bucket > 0")
    args.warmup = min(60.0, args.minutes * 12) if args.warmup is None else args.warmup
    if not 0 <= args.warmup < args.minutes * 60 - WINDOW:
        parser.error(f"--warmup must leave at least {WINDOW:g} s of the run")
    sys.path.insert(0, str(ROOT / "tests"))  # the tiny models and the server harness the tests use
    from serving import Server, tiny_audio_models, tiny_models, tone

    with tempfile.TemporaryDirectory(prefix="qkv-soak-") as tmp:
        folder = Path(tmp)
        (folder / "text").mkdir()
        (folder / "audio").mkdir()
        models = [*tiny_models(folder / "text").values(), *tiny_audio_models(folder / "audio").values()]
        server = Server(models, cwd=folder)
        try:
            pid, wav = server.process.pid, tone(0.5)
            wrong = asyncio.run(prime(server.url, wav))
            if wrong:
                raise SystemExit(f"soak: a good request failed before the load: {wrong}")
            before = idle_fds(pid)
            print(f"soak: {args.minutes:g} min against {server.url} (pid {pid}) ...", file=sys.stderr, flush=True)
            log = asyncio.run(soak(server.url, pid, args, wav))
            found = summary(log, args, before, idle_fds(pid))
            alive = server.process.poll() is None
        finally:
            server.stop()
    print(json.dumps(found, indent=1))
    if not alive:
        print("soak: the server died", file=sys.stderr)
    if not args.no_record:
        record(found, args)  # before the picture: rewriting docs/images/soak.png would mark the commit dirty
    draw(log, found, args, args.figure)
    return 0 if alive and found["good_failed"] == 0 and found["bad_5xx"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
