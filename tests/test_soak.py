"""The soak benchmark's judgement (bench/soak.py) on made-up runs: memory that grows is caught,
memory that stays is passed, latency percentiles are per endpoint and bucket, a 5xx to a bad client
counts, and the records render with their targets. No server is started (the benchmark itself is
the run: ``python bench/soak.py``)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module(path: Path, name: str, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def soak(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import record

    monkeypatch.setattr(record, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["bench/soak.py", "--minutes", "2"])
    return _module(ROOT / "bench" / "soak.py", "bench_soak", monkeypatch)


ARGS = types.SimpleNamespace(minutes=2, warmup=24.0, bucket=60.0, good=4, bad=2, note="made up")


def _log(soak, rss_at):
    """A made-up 2-minute run: a sample a second with RSS ``rss_at(t)`` and 11 descriptors, two
    endpoints answered (translate always 0.1 s, chat 0.2 s then 0.4 s in the second minute)."""
    log = soak.Log()
    log.samples = [(float(t), rss_at(t), 11) for t in range(121)]
    for t in range(0, 120, 2):
        log.good.append((t + 0.5, "translate", 0.1, None))
        log.good.append((t + 0.7, "chat", 0.2 if t < 60 else 0.4, None))
    log.good.append((3.0, "chat", 9.0, "500 internal_error"))  # a failure: counted, not timed
    log.bad = [("slow body", "gave up"), ("oversize body", "413"), ("wrong types", "500")]
    return log


def test_growing_memory_fails_and_flat_memory_passes(soak, tmp_path, monkeypatch):
    growing = soak.summary(_log(soak, lambda t: 300 + 0.25 * t), ARGS, 7, 7)  # +30 MB over the load
    flat = soak.summary(_log(soak, lambda t: 300 + (5 if t > 10 else 0)), ARGS, 7, 9)
    assert growing["rss_growth_pct"] > 5 and flat["rss_growth_pct"] == 0
    assert growing["good_failed"] == 1 and growing["bad_5xx"] == 1
    assert growing["bad_outcomes"]["slow body"] == {"gave up": 1}

    soak.record(growing, ARGS)
    render = _module(ROOT / "scripts" / "render_results.py", "render_soak", monkeypatch)
    records = {r["metric"]: r for r in render.load(tmp_path)["soak"]}
    assert records["soak: server RSS growth after warm-up"]["figure"] == growing["rss_growth_pct"]
    page = render.render(render.load(tmp_path))
    row = next(line for line in page.splitlines() if line.startswith("| soak: server RSS growth"))
    assert "**not met**" in row
    fds = records["soak: open file descriptors, idle after the load minus before"]
    assert fds["figure"] == 0


def test_latency_is_per_endpoint_and_minute(soak):
    table = soak.latency_table(_log(soak, lambda t: 300.0), 60.0)
    assert [r["n"] for r in table["chat"]] == [30, 30]  # the failed request is left out
    assert [r["p50"] for r in table["chat"]] == pytest.approx([0.2, 0.4])
    assert [r["p99"] for r in table["translate"]] == pytest.approx([0.1, 0.1])
    assert table["audio/speech"] == []  # an endpoint nobody called has no rows
