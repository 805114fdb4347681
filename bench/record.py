"""Benchmark records: every run of a benchmark adds one record per figure to
``bench/results/NAME.json`` (a JSON list, oldest first), and ``docs/results.md`` is rendered
from those files by ``scripts/render_results.py``. Figures are never copied into the docs by hand.

A record::

    {"name": "mt_speed", "metric": "train small bf16", "figure": 6409, "unit": "target tokens/s",
     "peer": "the faster of HF Marian and nn.Transformer", "peer_figure": 4298,
     "target": {"min_ratio": 1.3}, "details": {"HF Marian": 4298}, "notes": "...",
     "command": "python bench/mt_speed.py --only train", "commit": "3b713ef...",
     "date": "2026-12-02T12:10:00Z", "machine": {"platform": ..., "cpu": ..., "cores": 2}}

``target`` is null or one of ``{"min": x}`` / ``{"max": x}`` (the figure itself) or
``{"min_ratio": r}`` (figure / peer_figure). :func:`append` (one figure) and :func:`append_run`
(the figures of one run) fill in ``commit``, ``date``, ``machine`` and ``command`` (what was
run: ``sys.argv``) and replace the file atomically.
Superseded runs stay in the file; the page shows the latest run of each metric.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def append(name: str, record: dict, *, results: Path | None = None) -> dict:
    """Add ``record`` (a run's figure of metric ``record["metric"]``) to ``results/NAME.json``.

    Fields the caller leaves out are filled in: ``commit`` (``git rev-parse HEAD``, with
    ``"dirty": true`` when tracked files differ from it), ``date`` (UTC, ISO 8601), ``machine``
    (platform, CPU model, cores, and the torch version and allocator where the benchmark loaded
    them; keys the caller gives are kept), ``command`` (``sys.argv``), ``peer``, ``peer_figure``
    and ``target`` (null) and ``notes`` (empty). Returns the full record.
    """
    return append_run(name, [record], results=results)[0]


def append_run(name: str, records: list[dict], *, results: Path | None = None) -> list[dict]:
    """Add several figures of one run at once: the same commit, date, machine and command.

    ``results``: the folder (default :data:`RESULTS`, bench/results, read at each call).
    """
    commit, dirty = git_commit()
    stamp = {
        "command": command_line(),
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if dirty:
        stamp["dirty"] = True
    here = machine()
    full = []
    for record in records:
        missing = [f for f in ("metric", "figure", "unit") if f not in record]
        if missing:
            raise ValueError(f"record for {name}: missing {', '.join(missing)}")
        full.append(
            {
                "name": name,
                "peer": None,
                "peer_figure": None,
                "target": None,
                **stamp,
                "notes": "",
                **record,
                "machine": {**here, **record.get("machine", {})},
            }
        )
    path = (results or RESULTS) / f"{name}.json"
    runs = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
    if not isinstance(runs, list):
        raise ValueError(f"{path}: expected a JSON list of records")
    _write_atomic(path, json.dumps([*runs, *full], indent=1, ensure_ascii=False) + "\n")
    return full


def command_line() -> str:
    """What was run, as a user would type it again: ``python bench/mt.py de-en --set ...``."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def git_commit() -> tuple[str | None, bool]:
    """(HEAD's commit, whether the working tree differs from it); (None, False) outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None, False
    return head, bool(status.strip())


def machine() -> dict:
    """Platform, CPU model (from /proc/cpuinfo where there is one) and core count."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count()}
    torch = sys.modules.get("torch")  # only what the benchmark has imported itself
    if torch is not None:
        info["torch"] = torch.__version__
    memory = sys.modules.get("qkv.memory")
    if memory is not None:
        info["allocator"] = memory.allocator()
    return info


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
