"""Load on ``qkv serve`` (issue 23, section 4): N concurrent clients translating for a while,
against a server on loopback, with dynamic batching on and then off.

    python bench/serve_load.py --model runs/de_en                      # 50 clients, 60 s per setting
    python bench/serve_load.py --model runs/de_en --clients 50 --seconds 20

For each setting a fresh ``qkv serve --model DIR`` starts on a free port of 127.0.0.1 (nothing
else is reached); the clients (asyncio + httpx, one connection each) send Multi30k test
sentences (``multi30k/test_2016_flickr.de`` under ``$QKV_DATA``, default ``../shared/data``) to
``POST /v1/translate`` one after another, each the moment its previous answer came, for a warm-up
of ``--warmup`` seconds and then the measured ``--seconds``. Reported per setting: requests/s,
p50 / p95 / p99 latency, failed requests (any answer but 200, or none; must be 0), and the
server's resident memory (VmRSS) after the warm-up, half-way and after the load (no growth
expected once the allocator holds what the largest batch needed),
and the mean requests per forward pass from the server's own metrics. The server is stopped
with SIGTERM at the end of each setting; the script stops by itself.

Appends its figures to bench/results/serve_load.json (bench/record.py); ``--no-record`` skips that.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from serving import serving  # noqa: E402


def data_root() -> Path:
    return Path(os.environ.get("QKV_DATA", ROOT.parent / "shared" / "data"))


def sentences(limit: int = 1000) -> list[str]:
    path = data_root() / "multi30k" / "test_2016_flickr.de"
    if not path.is_file():
        raise SystemExit(f"serve_load: {path} not found (set QKV_DATA)")
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()][:limit]


def resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def load(url: str, texts: list[str], *, clients: int, seconds: float, beam: int) -> dict:
    """``clients`` loops of requests for ``seconds``: latencies of the answers, failures."""
    import httpx

    latencies: list[float] = []
    failures: list[str] = []
    end = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client(i: int, http: httpx.AsyncClient) -> None:
        k = i
        while time.monotonic() < end:
            body = {"text": texts[k % len(texts)], "beam_size": beam}
            k += clients
            start = time.monotonic()
            try:
                response = await http.post(f"{url}/v1/translate", json=body)
                if response.status_code != 200:
                    failures.append(f"{response.status_code} {response.text[:200]}")
                    continue
            except httpx.HTTPError as e:
                failures.append(f"{type(e).__name__}: {e}")
                continue
            latencies.append(time.monotonic() - start)

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        await asyncio.gather(*(client(i, http) for i in range(clients)))
    return {"latencies": latencies, "failures": failures, "seconds": time.monotonic() - started}


def batch_mean(url: str) -> float:
    import httpx

    text = httpx.get(f"{url}/metrics").text
    count = float(re.search(r"^qkv_batch_requests_count (\S+)$", text, re.M).group(1))
    total = float(re.search(r"^qkv_batch_requests_sum (\S+)$", text, re.M).group(1))
    return total / max(count, 1)


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else float("nan")


def run_setting(model: str, texts: list[str], args, *, batching: bool) -> dict:
    flags = ["--max-active", "256"] + ([] if batching else ["--no-batching"])
    with serving("serve_load", model, flags, stop=120) as (server, url):
        asyncio.run(load(url, texts, clients=args.clients, seconds=args.warmup, beam=args.beam))
        samples: list[float] = []  # the server's resident memory, every half second of the load
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.5):
                samples.append(resident_mb(server.pid))

        sampler = threading.Thread(target=sample)
        before = resident_mb(server.pid)
        sampler.start()
        try:
            found = asyncio.run(load(url, texts, clients=args.clients, seconds=args.seconds, beam=args.beam))
        finally:
            done.set()
            sampler.join()
        after = resident_mb(server.pid)
        mid = samples[len(samples) // 2] if samples else before
        per_pass = batch_mean(url)
    lat = found["latencies"]
    return {
        "batching": batching,
        "requests": len(lat),
        "requests_per_second": round(len(lat) / found["seconds"], 2),
        "p50_s": round(percentile(lat, 50), 3),
        "p95_s": round(percentile(lat, 95), 3),
        "p99_s": round(percentile(lat, 99), 3),
        "failed": len(found["failures"]),
        "first_failures": found["failures"][:3],
        "rss_mb_before": round(before, 1),
        "rss_mb_mid": round(mid, 1),
        "rss_mb_after": round(after, 1),
        "rss_mb_peak": round(max([before, after, *samples]), 1),
        "requests_per_forward_pass": round(per_pass, 2),
    }


def record(results: list[dict], args, model_note: str) -> None:
    from record import append_run

    on = next(r for r in results if r["batching"])
    off = next((r for r in results if not r["batching"]), None)
    setting = f"{args.clients} clients, beam {args.beam}"
    details = {"batching on": {k: v for k, v in on.items() if k != "first_failures"}}
    if off is not None:
        details["batching off"] = {k: v for k, v in off.items() if k != "first_failures"}
    notes = f"{model_note}; {args.seconds:g} s measured per setting after {args.warmup:g} s of warm-up, loopback"
    records = [
        {
            "metric": f"translate requests/s, {setting}, batching",
            "figure": on["requests_per_second"],
            "unit": "requests/s",
            "peer": "the same server without batching" if off else None,
            "peer_figure": off["requests_per_second"] if off else None,
            "target": {"min_ratio": 1.0} if off else None,
            "details": details,
            "notes": notes,
        },
        {
            "metric": f"translate p95 latency, {setting}, batching",
            "figure": on["p95_s"],
            "unit": "s",
            "peer": "the same server without batching" if off else None,
            "peer_figure": off["p95_s"] if off else None,
            "details": {"p50": on["p50_s"], "p99": on["p99_s"]},
            "notes": notes,
        },
        {
            "metric": f"failed requests, {setting}",
            "figure": sum(r["failed"] for r in results),
            "unit": "requests",
            "target": {"max": 0},
            "details": {"requests": sum(r["requests"] for r in results)},
            "notes": notes,
        },
        {
            "metric": f"server memory growth, second half of the load, {setting}, batching",
            "figure": round(on["rss_mb_after"] - on["rss_mb_mid"], 1),
            "unit": "MB",
            "details": {k: on[k] for k in ("rss_mb_before", "rss_mb_mid", "rss_mb_after", "rss_mb_peak")},
            "notes": notes + "; the allocator (TCMalloc where installed) keeps what the largest batches needed, "
            "so memory rises to a plateau: growth is measured over the second half of the load",
        },
    ]
    append_run("serve_load", records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="runs/de_en", help="a translation model or run (default: runs/de_en)")
    parser.add_argument("--clients", type=int, default=50, help="concurrent clients (default: 50)")
    parser.add_argument("--seconds", type=float, default=60, help="measured seconds per setting (default: 60)")
    parser.add_argument("--warmup", type=float, default=5, help="unmeasured seconds first (default: 5)")
    parser.add_argument("--beam", type=int, default=5, help="beam width of every request (default: 5)")
    parser.add_argument("--only", choices=("on", "off"), help="one setting only (default: batching on, then off)")
    parser.add_argument("--note", default="", help="what the model is, for the record's notes")
    parser.add_argument("--no-record", action="store_true", help="print only; append nothing to bench/results")
    args = parser.parse_args(argv)
    if not 1 <= args.clients <= 1000 or not 0 < args.seconds <= 3600 or args.warmup < 0:
        parser.error("--clients must be 1..1000, --seconds 0..3600, --warmup >= 0")
    if not Path(args.model).is_dir():
        parser.error(f"--model {args.model}: no such directory")
    texts = sentences()
    results = []
    for batching in [args.only == "on"] if args.only else [True, False]:
        print(f"serve_load: batching {'on' if batching else 'off'}: {args.clients} clients, {args.seconds:g} s ...")
        result = run_setting(args.model, texts, args, batching=batching)
        print(json.dumps(result))
        results.append(result)
    if not args.no_record and any(r["batching"] for r in results):
        record(results, args, args.note or f"model {args.model}")
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
