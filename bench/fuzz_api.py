"""Fuzzing the HTTP API at length: the property of tests/test_fuzz_api.py, thousands of requests per operation.

    python bench/fuzz_api.py                          # 2,000 per operation and mode, against a real qkv serve
    python bench/fuzz_api.py --examples 200 --in-process

Every operation of the server's ``/openapi.json`` gets ``--examples`` requests that fit its
schema and as many that break it (Schemathesis, through hypothesis, seeded with ``--seed``), a
third of them naming a served model and a third carrying a value no schema generator writes
(Infinity, NaN, integers past 64 bits, lone surrogates: ``NASTY`` in the test). The server is
``qkv serve`` on a loopback port with the tiny models of tests/serving.py and the test's
limits (``--in-process``: the app itself, through Starlette's test client). No answer may be a
5xx (but the 504 of a request that set its own short ``timeout``), every error must be the JSON
error shape, the server must live throughout, and after each operation's batch a good request of
every endpoint must be answered 200.

The table (operation, requests, failures, answers by status) is printed, and the run appends
its records to bench/results/fuzz_api.json through bench/record.py (requests sent, and failures,
whose target is 0), unless ``--no-record``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_property():
    """tests/test_fuzz_api.py as a module: its harness (``fuzz_api``) and limits."""
    sys.path.insert(0, str(ROOT / "tests"))  # its helpers (serving.py)
    spec = importlib.util.spec_from_file_location("qkv_fuzz_api", ROOT / "tests" / "test_fuzz_api.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def server_options(limits) -> list[str]:
    """The ``qkv serve`` options of the test's limits."""
    return [
        "--max-chars", str(limits.max_chars),
        "--max-texts", str(limits.max_texts),
        "--max-new-tokens", str(limits.max_new_tokens),
        "--max-beam", str(limits.max_beam),
        "--timeout", str(limits.timeout_s),
    ]  # fmt: skip


def run(prop, *, examples: int, seed: int, show: int, in_process: bool, folder: Path):
    """Fuzz the API (a real server unless ``in_process``); the counts per operation, what the good
    requests got wrong, and whether the server was alive at the end."""
    import httpx

    from serving import Server, tiny_audio_models, tiny_models

    (folder / "text").mkdir()
    (folder / "audio").mkdir()
    paths = {**tiny_models(folder / "text"), **tiny_audio_models(folder / "audio")}  # the test's models

    def report(name, counts) -> None:
        print(f"{name}: {counts.sent} requests, {counts.failed} failures", file=sys.stderr, flush=True)

    if in_process:
        from fastapi.testclient import TestClient

        served = prop.load_served([str(p) for p in paths.values()])
        with TestClient(prop.create_app(served, prop.LIMITS), raise_server_exceptions=False) as client:
            found, wrong = prop.fuzz_api(client, examples=examples, seed=seed, show=show, on_batch=report)
        return found, wrong, True
    server = Server(list(paths.values()), *server_options(prop.LIMITS), cwd=folder)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            found, wrong = prop.fuzz_api(client, examples=examples, seed=seed, show=show, on_batch=report)
        alive = server.process.poll() is None
    finally:
        server.stop()
    return found, wrong, alive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Fuzz qkv serve's whole API from its /openapi.json (Schemathesis): no 5xx, every error JSON, "
        "the server alive; print and record the counts.",
        epilog="example: python bench/fuzz_api.py --examples 300",
    )
    parser.add_argument("--examples", type=int, default=2000, help="requests per operation and mode (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--show", type=int, default=3, help="failures printed per operation (default 3)")
    parser.add_argument("--in-process", action="store_true", help="fuzz the app in this process, not a real server")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/results/fuzz_api.json")
    args = parser.parse_args(argv)
    prop = load_property()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qkv-fuzz-api-") as folder:
        found, wrong, alive = run(
            prop,
            examples=args.examples,
            seed=args.seed,
            show=args.show,
            in_process=args.in_process,
            folder=Path(folder),
        )
    seconds = time.perf_counter() - start
    width = max(len(n) for n in found)
    print(f"{'operation':<{width}}  {'requests':>8}  {'failures':>8}  answers by status")
    for name, counts in found.items():
        codes = ", ".join(f"{code}: {n}" for code, n in sorted(counts.codes.items()))
        print(f"{name:<{width}}  {counts.sent:>8}  {counts.failed:>8}  {codes}")
        for failure, request in counts.failures:
            print(f"  FAILED {failure}\n    on {request}")
    sent, failed = sum(c.sent for c in found.values()), sum(c.failed for c in found.values())
    print(f"{'total':<{width}}  {sent:>8}  {failed:>8}  ({seconds:.0f} s; server alive: {alive})")
    for line in wrong:
        print(f"  GOOD REQUEST FAILED {line}")
    if not args.no_record:
        _record(found, wrong, alive, examples=args.examples, seed=args.seed, in_process=args.in_process)
    return 1 if failed or wrong or not alive else 0


def _record(found: dict, wrong: list[str], alive: bool, *, examples: int, seed: int, in_process: bool) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from record import append_run  # bench/record.py, beside this script

    target = "in-process app" if in_process else "qkv serve on a loopback port"
    records = []
    for name, counts in found.items():
        details = {"seed": seed, "examples per mode": examples, "target": target}
        records.append({"metric": f"{name}: requests", "figure": counts.sent, "unit": "requests", "details": details})
        records.append(
            {
                "metric": f"{name}: failures",
                "figure": counts.failed,
                "unit": "failures",
                "target": {"max": 0},
                "details": {"answers by status": {str(k): v for k, v in sorted(counts.codes.items())}},
                "notes": "; ".join(f for f, _ in counts.failures),
            }
        )
    records.append(
        {
            "metric": "good requests failed after a batch",
            "figure": len(wrong) + (0 if alive else 1),
            "unit": "failures",
            "target": {"max": 0},
            "details": {"server alive at the end": alive, "target": target},
            "notes": "; ".join(wrong[:3]),
        }
    )
    append_run("fuzz_api", records)


if __name__ == "__main__":
    sys.exit(main())
