"""Render docs/results.md from the benchmark records in bench/results/*.json.

    python scripts/render_results.py            # write docs/results.md
    python scripts/render_results.py --check    # exit 1 if docs/results.md is not what it would render

Each bench/results/NAME.json is a JSON list of records, oldest first (bench/record.py writes
them). The page has one section per benchmark: a table with the latest run of each metric
(figure, peer's figure, ratio, target, date, commit, run), the runs behind that table
(command, date, commit, machine), the notes of those runs, and the earlier runs in a
collapsible list. Above them, a table of headline figures: the latest record of each metric in
``HEADLINES`` (or of the run a row pins), beside its peer and target. The output depends on the
records only (no clock, no git), so it is the same on every machine.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "results.md"
REQUIRED = ("metric", "figure", "unit", "command", "commit", "date", "machine")

# Known benchmarks in reading order: (title, what produces the records). Others follow by name.
BENCHMARKS = {
    "demo": ("The built-in demo", "`qkv demo` (numbers written with digits → English words)"),
    "tests": ("The test suite", "`bash .ci/run` from a fresh clone"),
    "lm_shakespeare": ("Language models on Tiny Shakespeare", "`python bench/lm_shakespeare.py`"),
    "dailydialog_chat": ("DailyDialog chatbot (decoder-only)", "`qkv train recipes/dailydialog_chat.yaml`"),
    "dailydialog_bert": ("DailyDialog dialog acts, BERT-style", "`qkv train recipes/dailydialog_{mlm,acts}.yaml`"),
    "mt": ("Translation quality", "`python bench/mt.py DIRECTION`: train from scratch, score the test set"),
    "mt_speed": (
        "Translation speed, side by side",
        "`python bench/mt_speed.py`: qkv against HF Marian and nn.Transformer on the same batches",
    ),
    "lm_speed": (
        "GPT and BERT speed, side by side",
        "`python bench/lm_speed.py`: qkv against HF GPT-2 and BERT on the same batches",
    ),
    "step_profile": (
        "Where a decoding step's time goes",
        "`python bench/step_profile.py`: the base translation model, greedy and beam 5, ms per step by kind of work",
    ),
    "chat_profile": (
        "Where a chat decoding step's time goes",
        "`python bench/chat_profile.py`: SmolLM2-135M-Instruct, batch 1, CPU ms and operators a step",
    ),
    "chat_speed": (
        "Chat model speed on a CPU, side by side",
        "`python bench/chat_speed.py`: SmolLM2-135M-Instruct in qkv, transformers, llama.cpp: a process each",
    ),
    "audio_speed": ("Speech front-end speed", "`python bench/audio_speed.py`"),
    "asr": ("Speech recognition and translation", "`python bench/asr.py CORPUS`: train a recipe, score its test set"),
    "whisper_fsdd": ("Whisper tiny.en on FSDD", "`python bench/whisper_fsdd.py`: the peer of the FSDD figure"),
    "whisper_int8": (
        "Whisper int8 keeping float32's words",
        "`python bench/whisper_int8.py`: qkv int8 against qkv fp32 beside faster-whisper int8 against its fp32",
    ),
    "longform_memory": (
        "Long-form transcription: peak memory by length",
        "`python bench/longform_memory.py`: Whisper tiny.en on 1, 10 and 60 minutes of joined speech "
        "(Multi30k captions spoken by a Piper voice; earlier runs: joined FSDD digits)",
    ),
    "word_times": (
        "Word timestamps",
        "`python bench/word_times.py`: Whisper tiny.en on joined speech whose word times are known, "
        "transformers' word timestamps beside (earlier runs: joined FSDD digits)",
    ),
    "stream_asr": (
        "Streaming speech recognition over a WebSocket",
        "`python bench/stream_asr.py`: Whisper tiny.en hearing joined FSDD digits in real time: delay and WER",
    ),
    "stream_timing": (
        "What word times cost a stream",
        "`python bench/stream_timing.py`: Whisper tiny.en's stream steps, CPU seconds per second of audio, "
        "estimated times beside aligned ones (a separate timer, or the decoding's encoder output shared)",
    ),
    "tts": ("Text-to-speech", "`python bench/tts.py`: qkv ASR of qkv TTS, mel-cepstral distortion, real-time factor"),
    "piper_speed": (
        "Piper voices: qkv's VITS beside onnxruntime",
        "`python bench/piper_speed.py`: the same voice and sentences, each runtime in its own process, "
        "rounds alternating",
    ),
    "tts_quality": (
        "How synthesized speech sounds",
        "`python bench/tts_quality.py`: DNSMOS, Whisper tiny.en's WER, real-time factor and MCD of every engine, "
        "the same held-out sentences",
    ),
    "ddp": (
        "Training on several processes (DDP)",
        "`python bench/ddp.py`: 1 process × 2 threads against 2 processes × 1 thread, Multi30k recipe",
    ),
    "fuzz": (
        "Fuzzing: bad input never crashes",
        "`python bench/fuzz.py`: the properties of `tests/test_fuzz.py` on many more inputs per category",
    ),
    "fuzz_api": (
        "Fuzzing the HTTP API: no request makes a 5xx",
        "`python bench/fuzz_api.py`: the property of `tests/test_fuzz_api.py`, thousands of requests per operation",
    ),
    "soak": (
        "Soak: the server under good and bad clients for minutes",
        "`python bench/soak.py`: RSS, open file descriptors and latency per endpoint over time, failures",
    ),
    "decode_ab": (
        "Decoding speed against the commit before a change",
        "`python bench/decode_ab.py --before CHECKOUT`: each tree in its own process, rounds alternating",
    ),
    "check_trained": (
        "qkv check on trained and imported models",
        "`python bench/check_trained.py`: a short run of the Multi30k and TTS recipes and the imported Whisper "
        "tiny.en, each checked by `qkv check --json` in a process of its own",
    ),
    "probes": ("Probes", "short measurements behind a design choice (A/B runs, quick trials)"),
}


# The headline table: (benchmark, metric, what the row is called), one row per application, showing
# that metric's latest record. A fourth item pins the row to the latest record whose command holds
# it: for a metric whose newest run measured a variant the recipes do not ship.
HEADLINES = [
    ("mt", "Multi30k de→en, test2016: BLEU, lowercased tokenized", "Translation, Multi30k de→en"),
    ("mt", "Multi30k en→de (en-de-lc), test2016: BLEU, lowercased tokenized", "Translation, Multi30k en→de"),
    ("mt", "Tatoeba zh→en, val: sacreBLEU", "Translation, Tatoeba zh→en"),
    ("lm_shakespeare", "shakespeare_char_cpu: validation loss", "GPT, Tiny Shakespeare in 100 s"),
    ("dailydialog_bert", "dialog acts: accuracy, fine-tuned from the MLM encoder", "BERT, DailyDialog dialog acts"),
    ("asr", "FSDD digits, standard test split (300 files): utterances right", "Speech recognition, FSDD digits"),
    ("asr", "FSDD digit strings, held-out speaker: WER (theo)", "Speech recognition, digit strings, unheard speaker"),
    # the character recognizer and LM the recipes ship (a later subword run is on the page below them)
    (
        "asr",
        "espeak-ng English, Multi30k test2016, unseen voices: WER",
        "Speech recognition, espeak-ng English",
        "--out /tmp/asr/speech_en_bf16 ",
    ),
    (
        "asr",
        "espeak-ng English, Multi30k test2016, unseen voices: WER, language model fused (weight 0.5)",
        "… with a language model fused",
        "--model /tmp/asr/speech_en_bf16 --lm /tmp/asr/speech_en_lm2 ",
    ),
    # the budget: both trained, corpus built and test scored in one run of at most 90 minutes
    (
        "asr",
        "espeak-ng English, Multi30k test2016, unseen voices: WER, language model fused (weight 0.5)",
        "… both trained in one run within 90 minutes",
        "speech_en --pipeline ",
    ),
    ("asr", "German speech -> English text, Multi30k test2016: BLEU", "Speech translation, German → English"),
    ("tts", "intelligibility: WER of qkv ASR on qkv TTS, Multi30k test2016", "Text-to-speech, English: ASR WER"),
    (
        "tts",
        "intelligibility: WER of qkv ASR on qkv TTS, FSDD digit strings, every voice",
        "Text-to-speech, six FSDD voices: ASR WER",
    ),
    ("tts", "FSDD voice theo: digits right (1 - WER) of qkv ASR on qkv TTS", "… voice theo: digits right"),
    ("tts", "synthesis real-time factor, batches of 16, Griffin-Lim included", "Text-to-speech real-time factor"),
    ("serve_load", "translate requests/s, 50 clients, beam 5, batching", "Serving, 50 clients"),
]


def load(results: Path = RESULTS) -> dict[str, list[dict]]:
    """Every bench/results/*.json, by benchmark name (the file's stem), records in file order.

    Also read, for records written before bench/record.py: a file holding one record (an object,
    not a list), a record without ``metric`` whose ``name`` is "BENCH: metric", and a bare number
    as ``target`` (a figure to reach: ``{"min": number}``).
    """
    benches = {}
    for path in sorted(results.glob("*.json")):
        runs = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(runs, dict):
            runs = [runs]
        if not isinstance(runs, list):
            raise SystemExit(f"{path}: expected a JSON list of records")
        for i, record in enumerate(runs):
            if not isinstance(record, dict):
                raise SystemExit(f"{path}: record {i} is not an object")
            if "metric" not in record and ": " in str(record.get("name", "")):
                record["metric"] = record["name"].split(": ", 1)[1]
            if _numeric(record.get("target")):
                record["target"] = {"min": record["target"]}
            missing = [f for f in REQUIRED if f not in record]
            if missing:
                raise SystemExit(f"{path}: record {i} lacks {', '.join(missing)}")
        benches[path.stem] = runs
    return benches


def render(benches: dict[str, list[dict]]) -> str:
    order = [n for n in BENCHMARKS if n in benches] + sorted(n for n in benches if n not in BENCHMARKS)
    total = sum(len(r) for r in benches.values())
    out = [
        "# Measured results",
        "",
        "<!-- Rendered by scripts/render_results.py from bench/results/*.json. Do not edit by hand:",
        "     run the benchmark (it appends its records), then `python scripts/render_results.py`. -->",
        "",
        "Every figure on this page comes from a record in [`bench/results/`](../bench/results/): one JSON file per",
        "benchmark, one record per figure and run, oldest first. The benchmarks append their records themselves",
        "(`bench/record.py`), this page is rendered from them (`python scripts/render_results.py`), and",
        "`tests/test_docs.py` checks that it is current. Each table shows the latest run of each metric;",
        "superseded runs stay in the records and are listed under the table.",
        "",
        "Ratio: qkv's figure over the peer's (for times and losses, lower is better). A commit marked † is the",
        "commit that reported the run (records transcribed from the README's measurement log of 2026-11-29 to",
        "2026-12-02); a commit marked + had changes in the working tree.",
        "",
        "## Headlines",
        "",
        "The headline figure of each application, beside the peer measured in the same run or the published",
        "figure it is compared with; each row's run, budget and notes are in its section below. A row shows",
        "what the recipes ship: where a later run measured a variant, that run is in the section, not here.",
        "",
        headline(benches),
        f"{total} records from {len(order)} benchmarks:",
        "",
    ]
    for name in order:
        title = BENCHMARKS.get(name, (name, ""))[0]
        out.append(f"- [{title}](#{_anchor(name, title)}) (`{name}`, {len(benches[name])} records)")
    for name in order:
        out += ["", *_section(name, benches[name])]
    return "\n".join(out).rstrip() + "\n"


def headline(benches: dict[str, list[dict]]) -> str:
    """The headline table: the latest record of each of ``HEADLINES`` (of its pinned run if it names
    one), its peer and its target.

    A benchmark with no records at all is left out; one whose records lack a headline's metric
    (renamed, say) is refused by name."""
    out = ["| what | qkv | beside it | target |", "| --- | --- | --- | --- |"]
    for name, metric, label, *rest in HEADLINES:
        if name not in benches:  # a folder of some benchmarks' records only (tests, --results)
            continue
        pin = rest[0] if rest else ""  # "" is in every command: the metric's latest record
        runs = [r for r in benches[name] if r["metric"] == metric and pin in r["command"] + " "]
        if not runs:
            raise SystemExit(f"render_results.py: HEADLINES names {name!r} metric {metric!r}{pin}, which no record has")
        r = runs[-1]
        out.append(f"| {_cell(label)} | {_cell(_figure(r['figure'], r['unit']))} | {_cell(_peer(r))} | {_target(r)} |")
    return "\n".join(out) + "\n"


def _section(name: str, runs: list[dict]) -> list[str]:
    title, source = BENCHMARKS.get(name, (name, ""))
    latest: dict[str, int] = {}  # metric -> index of its latest record, in order of first appearance
    for i, record in enumerate(runs):
        latest[record["metric"]] = i
    firsts: list[str] = []
    for record in runs:
        if record["metric"] not in firsts:
            firsts.append(record["metric"])
    shown = [latest[m] for m in firsts]
    earlier = [i for i in range(len(runs)) if i not in set(shown)]  # the superseded runs
    counts = {m: sum(1 for r in runs if r["metric"] == m) - 1 for m in firsts}
    keys: list[tuple] = []  # the runs behind the table, numbered in order of appearance
    for i in shown:
        key = _run_key(runs[i])
        if key not in keys:
            keys.append(key)
    out = [f"## {title} (`{name}`)", ""]
    if source:
        out += [f"From {source}.", ""]
    out += [
        "| metric | qkv | peer | ratio | target | date | commit | run | earlier runs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for metric, i in zip(firsts, shown, strict=True):
        r = runs[i]
        out.append(
            "| "
            + " | ".join(
                _cell(c)
                for c in (
                    metric,
                    _figure(r["figure"], r["unit"]),
                    _peer(r),
                    _ratio(r),
                    _target(r),
                    str(r["date"])[:10],
                    _commit(r),
                    f"R{keys.index(_run_key(r)) + 1}",
                    str(counts[metric]) if counts[metric] else "",
                )
            )
            + " |"
        )
    out += ["", "Runs:", ""]
    for k, key in enumerate(keys, 1):
        r = next(runs[i] for i in shown if _run_key(runs[i]) == key)
        out.append(f"- R{k}: {_run_line(r)}")
    notes = []
    for metric, i in zip(firsts, shown, strict=True):
        text = _notes(runs[i])
        if text:
            notes.append(f"- **{_escape(metric)}**: {text}")
    if notes:
        out += ["", "Notes on these runs:", "", *notes]
    if earlier:
        out += ["", "<details>", f"<summary>{len(earlier)} earlier runs</summary>", ""]
        for i in reversed(earlier):  # newest first
            r = runs[i]
            head = f"**{_escape(r['metric'])}**: {_figure(r['figure'], r['unit'])}"
            extra = [x for x in (_peer(r), _ratio(r) and f"ratio {_ratio(r)}", _target(r)) if x]
            if extra:
                head += f" ({'; '.join(extra)})"
            line = f"- {head}. {_run_line(r)}."
            text = _notes(r)
            if text:
                line += f" {text}"
            out.append(line)
        out += ["", "</details>"]
    return out


def _run_key(r: dict) -> tuple:
    return (r["command"], r.get("command_note"), r["commit"], str(r["date"]), _machine(r["machine"]))


def _run_line(r: dict) -> str:
    command = f"`{r['command']}`"
    if r.get("command_note"):
        command += f" ({r['command_note']})"
    return f"{command}, {r['date']}, commit {_commit(r)}, {_machine(r['machine'])}"


def _notes(r: dict) -> str:
    parts = []
    details = r.get("details") or {}
    if details:
        parts.append("; ".join(f"{k} {_number(v)}" for k, v in details.items()) + ".")
    if r.get("notes"):
        parts.append(str(r["notes"]).strip())
    return _escape(" ".join(parts))


def _figure(value, unit: str) -> str:
    return f"{_number(value)}{unit}" if unit == "%" else f"{_number(value)} {unit}".strip()


def _peer(r: dict) -> str:
    if r.get("peer") is None and r.get("peer_figure") is None:
        return ""
    if r.get("peer_figure") is None:
        return str(r["peer"])
    return f"{_number(r['peer_figure'])} ({r['peer']})" if r.get("peer") else _number(r["peer_figure"])


def _ratio(r: dict) -> str:
    a, b = r.get("figure"), r.get("peer_figure")
    if not _numeric(a) or not _numeric(b) or b == 0:
        return ""
    return f"{a / b:.2f}×"


def _target(r: dict) -> str:
    target = r.get("target")
    if not target:
        return ""
    figure = r.get("figure")
    if "min_ratio" in target:
        ratio = figure / r["peer_figure"] if _numeric(figure) and _numeric(r.get("peer_figure")) else None
        goal, met = f"≥ {_number(target['min_ratio'])}× peer", ratio is not None and ratio >= target["min_ratio"]
    elif "min" in target:
        goal, met = f"≥ {_number(target['min'])}", _numeric(figure) and figure >= target["min"]
    elif "max" in target:
        goal, met = f"≤ {_number(target['max'])}", _numeric(figure) and figure <= target["max"]
    else:
        return json.dumps(target, ensure_ascii=False, sort_keys=True)
    return f"{goal}: {'met' if met else '**not met**'}"


def _commit(r: dict) -> str:
    commit = str(r.get("commit") or "unknown")[:7]
    if r.get("dirty"):
        commit += "+"
    if r.get("commit_note"):
        commit += "†"
    return commit


def _machine(m) -> str:
    if not isinstance(m, dict):
        return str(m)
    first = [m[k] if k != "cores" else f"{m[k]} cores" for k in ("cpu", "cores", "platform") if m.get(k)]
    if m.get("torch"):
        first.append(f"torch {m['torch']}")
    rest = [f"{k} {m[k]}" for k in sorted(m) if k not in ("cpu", "cores", "platform", "torch") and m[k]]
    return ", ".join(str(x) for x in first + rest)


def _numeric(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _number(x) -> str:
    if _numeric(x):
        return f"{x:,}"
    return str(x)


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _cell(text: str) -> str:
    return _escape(str(text)).replace("\n", " ")


def _anchor(name: str, title: str) -> str:
    """GitHub's anchor for the heading ``## {title} (`{name}`)``."""
    heading = f"{title} ({name})".lower()
    kept = "".join(c for c in heading if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is not current")
    parser.add_argument("--results", type=Path, default=RESULTS, help="records folder (default bench/results)")
    parser.add_argument("--page", type=Path, default=PAGE, help="page to write or check (default docs/results.md)")
    args = parser.parse_args(argv)
    benches = load(args.results)
    page = render(benches)
    if args.check:
        current = args.page.read_text(encoding="utf-8") if args.page.is_file() else ""
        if current == page:
            return 0
        diff = difflib.unified_diff(
            current.splitlines(), page.splitlines(), str(args.page), "rendered", n=0, lineterm=""
        )
        print("\n".join(list(diff)[:40]), file=sys.stderr)
        print(f"{args.page} is not current: run python scripts/render_results.py", file=sys.stderr)
        return 1
    args.page.parent.mkdir(parents=True, exist_ok=True)
    part = args.page.with_name(args.page.name + ".part")  # atomic: a reader sees the old page or the new one
    part.write_text(page, encoding="utf-8")
    part.replace(args.page)
    print(f"wrote {args.page} ({sum(len(r) for r in benches.values())} records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
