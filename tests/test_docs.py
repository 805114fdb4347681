"""The README and the guides in docs/ cannot drift from the code.

- docs/results.md is what scripts/render_results.py renders from bench/results/*.json;
- every example command in a ```bash block runs or parses: `qkv SUB ...` with the real parser
  (and `qkv SUB --help` in a subprocess), recipes it names load with its --set items,
  `python bench/X.py ...` with the script's own parser (and `--help`), `bash scripts/X.sh ...`
  with the parser of the command the script runs; the numbers-task examples run for real on a
  tiny model, and `qkv evaluate --hyp --ref` on tiny files;
- a figure quoted in a guide or a recipe's comment is a figure of docs/results.md, and the README
  quotes none;
- every relative link resolves (files, and #anchors to headings).

A line is left out only with a trailing `# doc-test: skip (why)` comment; there are at most
MAX_SKIPS of those, each with its reason.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS_PAGE = ROOT / "docs" / "results.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
GUIDES = [p for p in PAGES if p not in (README, RESULTS_PAGE)]
SKIP = re.compile(r"#\s*doc-test:\s*skip\b(.*)$")
MAX_SKIPS = 3
# Programs a ```bash line may start with besides the checked ones (qkv, python bench/..., bash scripts/...).
OTHER_PROGRAMS = {".", "source", "echo", "printf", "cat", "tensorboard", "curl"}
TIMEOUT = 300


# ----------------------------------------------------------------------------- the commands


def _doc_lines() -> list[tuple[str, int, str]]:
    """(page, line number, text) of every line inside a ```bash block of the README and the guides."""
    found = []
    for page in PAGES:
        inside = False
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith("```"):
                inside = line.strip() == "```bash" if not inside else False
                continue
            if inside and line.strip() and not line.strip().startswith("#"):
                found.append((page.relative_to(ROOT).as_posix(), number, line.strip()))
    return found


def _segments(line: str) -> list[list[str]]:
    """The commands of a shell line: split at pipes, redirections (and their targets) and comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    segments, current, tokens = [], [], list(lexer)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in ("|", "&&", ";", "||"):
            segments.append(current)
            current = []
        elif token in ("<", ">", ">>", "<<<", "2>"):
            i += 1  # the file it names
        else:
            current.append(token)
        i += 1
    segments.append(current)
    return [s for s in segments if s]


def _commands() -> tuple[list[tuple[str, list[str]]], list[tuple[str, str]], dict[str, str]]:
    """([(where, argv)] of the commands to check, [(where, reason)] of the lines marked skip,
    {where: the whole line})."""
    commands, skipped, lines = [], [], {}
    for page, number, line in _doc_lines():
        where = f"{page}:{number}"
        mark = SKIP.search(line)
        if mark:
            skipped.append((where, mark.group(1).strip(" ()")))
            continue
        for argv in _segments(line):
            commands.append((f"{where}: {shlex.join(argv)}", argv))
            lines[commands[-1][0]] = line
    return commands, skipped, lines


COMMANDS, SKIPPED, LINES = _commands()
QKV = [(w, a[1:]) for w, a in COMMANDS if a[0] == "qkv"]
BENCH = [(w, a[1:]) for w, a in COMMANDS if a[:1] == ["python"] and a[1:2] and a[1].startswith("bench/")]
SCRIPTS = [(w, a[1:]) for w, a in COMMANDS if a[:1] == ["bash"] and a[1:2] and a[1].startswith("scripts/")]
CHECKED = {w for w, _ in QKV + BENCH + SCRIPTS}


def test_the_docs_have_commands_and_few_skips():
    assert len(QKV) >= 20 and BENCH and SCRIPTS, (len(QKV), BENCH, SCRIPTS)
    assert len(SKIPPED) <= MAX_SKIPS, SKIPPED
    for where, reason in SKIPPED:
        assert len(reason) >= 10, f"{where}: a skipped line must say why"


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_command_is_a_known_program(where, argv):
    assert where in CHECKED or argv[0] in OTHER_PROGRAMS, f"{where}: unknown program {argv[0]!r} (add it to the test)"


@cache
def _parser():
    """The qkv command's argparse parser, wherever the command line package builds it."""
    for name in ("qkv.cli.main", "qkv.cli"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "build_parser"):
            return module.build_parser()
    pytest.fail("found no build_parser() in qkv.cli.main or qkv.cli")


def _parse(argv: list[str]):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return _parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"qkv {shlex.join(argv)}: the parser refused it (exit {e.code}): {err.getvalue().strip()}")


def _repo_paths(argv: list[str]) -> list[str]:
    """Arguments that name a file of this repository (recipes/..., bench/..., scripts/..., docs/...)."""
    prefixes = ("recipes/", "bench/", "scripts/", "docs/", "src/", "tests/")
    return [a for a in argv if a.startswith(prefixes)]


@pytest.mark.parametrize("where,argv", QKV, ids=[w for w, _ in QKV])
def test_qkv_commands_parse(where, argv):
    args = _parse(argv)
    for path in _repo_paths(argv):
        assert (ROOT / path).exists(), f"{where}: {path} does not exist"
    if argv[0] == "train":
        _check_recipe(where, args.recipe, args.set)


def _check_recipe(where: str, recipe: str, overrides: list[str]) -> None:
    """The recipe loads with the command's --set items (an unknown key or a bad value fails)."""
    assert (ROOT / recipe).is_file(), f"{where}: no recipe {recipe}"
    try:
        load = importlib.import_module("qkv.tasks").load_recipe
    except (ImportError, AttributeError):
        load = importlib.import_module("qkv.recipes").load_recipe
    errors = importlib.import_module("qkv.errors")
    try:
        load(ROOT / recipe, overrides)
    except errors.UserError as e:
        pytest.fail(f"{where}: {e}")


SUBCOMMANDS = sorted({argv[0] for _, argv in QKV})


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_qkv_subcommand_help(sub):
    done = _run([sys.executable, "-m", "qkv", sub, "--help"], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: qkv" in done.stdout


SCRIPT_NAMES = sorted({argv[0] for _, argv in BENCH})

# Runs a bench script with each of the argument lists it is given (its --help, the docs' commands),
# each up to its argument parsing, with its own parser, then stops; writes what each run printed
# and its exit status as JSON. One process a script, not one a command: a script's imports (torch,
# transformers) are its cost, and 67 processes were 210 of this file's 484 s (a contended 2-core
# machine) where 23 import the same.
PARSE_ONLY = """
import argparse, contextlib, io, json, runpy, sys, traceback
parse = argparse.ArgumentParser.parse_args
def parse_only(self, *args, **kwargs):
    parse(self, *args, **kwargs)
    print("doc-test: arguments parsed")
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parse_only
script, runs, into, results = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], []
for argv in runs:
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [script, *argv]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
with open(into, "w") as f:
    json.dump(results, f)
"""


@cache
def _bench_runs(script: str) -> dict[tuple[str, ...], dict]:
    """What ``python SCRIPT --help`` and each of the docs' commands of SCRIPT (parsed only) printed
    and returned, by argument list."""
    runs = [["--help"], *(argv[1:] for _, argv in BENCH if argv[0] == script)]
    with tempfile.TemporaryDirectory() as folder:
        results = Path(folder) / "results.json"
        done = _run([sys.executable, "-c", PARSE_ONLY, script, json.dumps(runs), str(results)], cwd=ROOT)
        assert results.is_file(), f"{script}: {done.stderr[-2000:]}"
        return {tuple(argv): result for argv, result in zip(runs, json.loads(results.read_text()), strict=True)}


@pytest.mark.parametrize("script", SCRIPT_NAMES)
def test_bench_script_help(script):
    assert (ROOT / script).is_file(), f"{script} does not exist"
    done = _bench_runs(script)[("--help",)]
    assert done["returncode"] == 0, done["stderr"][-2000:]
    assert "usage:" in done["stdout"]


@pytest.mark.parametrize("where,argv", BENCH, ids=[w for w, _ in BENCH])
def test_bench_commands_parse(where, argv):
    assert (ROOT / argv[0]).is_file(), f"{where}: {argv[0]} does not exist"
    done = _bench_runs(argv[0])[tuple(argv[1:])]
    assert done["returncode"] == 0 and "doc-test: arguments parsed" in done["stdout"], (
        f"{where}: {done['stderr'][-2000:]}"
    )
    for path in _repo_paths(argv[1:]):
        assert (ROOT / path).exists(), f"{where}: {path} does not exist"


@pytest.mark.parametrize("where,argv", SCRIPTS, ids=[w for w, _ in SCRIPTS])
def test_script_commands(where, argv):
    script = ROOT / argv[0]
    assert script.is_file(), f"{where}: {argv[0]} does not exist"
    # A script that ends by running a qkv command passes its arguments on: they must parse.
    last = script.read_text(encoding="utf-8").strip().splitlines()[-1]
    runs = re.fullmatch(r'exec \.venv/bin/qkv (\S+) "\$@"', last)
    if runs:
        _parse([runs.group(1), *argv[1:]])
    else:
        assert not argv[1:], f"{where}: {argv[0]} takes no arguments the test can check"


# ----------------------------------------------------------------------------- real runs


def _run(argv: list[str], *, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        argv, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=TIMEOUT, check=False, env=env
    )


TINY = [
    *("--set", "train.steps=5", "--set", "data.eval_examples=5", "--set", "decode.beam_size=2"),
    *("--set", "model.d_model=15", "--set", "model.n_heads=3", "--set", "model.d_ff=7"),
    *("--set", "model.n_encoder_layers=1", "--set", "model.n_decoder_layers=1"),
]
DEMO_MODEL = "qkv-demo/model"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder holding a tiny numbers model where the docs' examples expect the demo's."""
    folder = tmp_path_factory.mktemp("docs")
    recipe = str(ROOT / "recipes" / "numbers.yaml")
    done = _run([sys.executable, "-m", "qkv", "train", recipe, "--out", DEMO_MODEL, "--quiet", *TINY], cwd=folder)
    assert done.returncode == 0, done.stderr[-2000:]
    return folder


def _numbers_commands() -> list[tuple[str, list[str]]]:
    """The documented commands of the numbers task: `qkv train recipes/numbers.yaml` and any on the demo model."""
    chosen, seen = [], set()
    for where, argv in QKV:
        if (argv[:2] == ["train", "recipes/numbers.yaml"] or DEMO_MODEL in argv) and tuple(argv) not in seen:
            chosen.append((where, argv))  # a command written twice in the guides runs once
            seen.add(tuple(argv))
    return chosen


NUMBERS = _numbers_commands()


@pytest.mark.parametrize("where,argv", NUMBERS, ids=[w for w, _ in NUMBERS])
def test_numbers_examples_run(where, argv, workdir):
    argv = list(argv)
    if argv[0] == "train":  # the same command, on a tiny model for a few steps
        argv = ["train", str(ROOT / argv[1]), *argv[2:], "--quiet", *TINY]
    if argv[0] == "evaluate":
        argv += ["--examples", "5"]
    done = _run([sys.executable, "-m", "qkv", *argv], cwd=workdir, stdin=_stdin(LINES[where]))
    assert done.returncode == 0, f"{where}: {done.stderr[-2000:]}"
    assert done.stdout.strip(), where


def _stdin(line: str) -> str | None:
    """What `echo TEXT | ...` or `printf 'TEXT' | ...` at the start of a line feeds the command."""
    first = _segments(line)[0]
    if first[0] == "echo":
        return " ".join(first[1:]) + "\n"
    if first[0] == "printf":
        return first[1].replace("\\n", "\n")
    return None


EVALUATE_FILES = [
    (w, a) for w, a in QKV if a[0] == "evaluate" and "--hyp" in a and "--ref" in a and "$" not in " ".join(a)
]


@pytest.mark.parametrize("where,argv", EVALUATE_FILES, ids=[w for w, _ in EVALUATE_FILES])
def test_evaluate_examples_run(where, argv, tmp_path):
    hyp, ref = argv[argv.index("--hyp") + 1], argv[argv.index("--ref") + 1]
    (tmp_path / hyp).write_text("a dog runs on the grass .\ntwo men talk .\n", encoding="utf-8")
    (tmp_path / ref).write_text("a dog runs on the grass .\ntwo men are talking .\n", encoding="utf-8")
    done = _run([sys.executable, "-m", "qkv", *argv], cwd=tmp_path)
    assert done.returncode == 0, f"{where}: {done.stderr[-2000:]}"
    if "--json" in argv:
        assert 0 < json.loads(done.stdout.strip().splitlines()[-1])["bleu"] <= 100


# ----------------------------------------------------------------------------- the results page


def test_results_page_is_current():
    done = _run([sys.executable, str(ROOT / "scripts" / "render_results.py"), "--check"], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]


def _render_module():
    """scripts/render_results.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("render_results", ROOT / "scripts" / "render_results.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    return render


def test_the_headline_table_is_each_headlines_latest_record():
    """A newer record replaces its row on the results page; a headline no record has is refused by
    name (not rendered as a blank row)."""
    render = _render_module()
    benches = render.load()
    name, metric, label = render.HEADLINES[0]
    newer = {**benches[name][-1], "metric": metric, "figure": 99.25, "peer": None, "peer_figure": None}
    page = render.render({**benches, name: [*benches[name], newer]})
    row = next(line for line in page.splitlines() if line.startswith(f"| {label} |"))
    assert "99.25" in row
    with pytest.raises(SystemExit, match="no record has"):
        render.headline({**benches, name: [r for r in benches[name] if r["metric"] != metric]})


def test_a_pinned_headline_shows_its_run_not_a_newer_variant():
    """A headline naming a run (a piece of its command) keeps showing that run's latest record when a
    newer record of the same metric is a different run; a newer record of the pinned run replaces it."""
    render = _render_module()
    benches = render.load()
    name, metric, label, pin = next(h for h in render.HEADLINES if len(h) == 4)

    def row(runs):
        page = render.headline({**benches, name: runs})
        return next(line for line in page.splitlines() if line.startswith(f"| {label} |"))

    pinned = [r for r in benches[name] if r["metric"] == metric and pin in r["command"] + " "][-1]
    other = {**pinned, "command": "python bench/other.py", "figure": 99.25, "peer": None, "peer_figure": None}
    assert "99.25" not in row([*benches[name], other])
    assert "99.25" in row([*benches[name], {**other, "command": pinned["command"]}])
    with pytest.raises(SystemExit, match="no record has"):
        render.headline({**benches, name: [r for r in benches[name] if pin not in r["command"] + " "]})


NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
# A measured figure: a number with a unit of measurement after it (not "32 × 128", a shape), a
# decimal percentage, or a decimal with a score named before it ("chrF 66.41", "scored 40.50").
# Integers with % (15% of the tokens) are settings.
FIGURE = re.compile(
    rf"(?<![\w.,/-])(?P<a>{NUMBER})\s?(?:×(?!\s?\d)|BLEU\b|(?:target |new |masked )?tokens/s|sentences/s|nats\b)"
    rf"|(?<![\w.,/-])(?P<b>\d+\.\d+)%"
    rf"|\b(?:BLEU|sacreBLEU|chrF|perplexity|val(?:idation)? loss|scored?|reach(?:ed|es)?)\s(?P<c>\d+\.\d+)"
)


def _prose(page: Path) -> str:
    """The page without its code blocks and inline code."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _figures(text: str) -> list[str]:
    return [m.group("a") or m.group("b") or m.group("c") for m in FIGURE.finditer(text)]


def _value(number: str) -> float:
    return float(number.replace(",", ""))


def test_the_readme_quotes_no_figures():
    found = _figures(_prose(README))
    assert not found, f"README.md quotes measured figures {found}: link to docs/results.md instead"
    assert "docs/results.md" in README.read_text(encoding="utf-8")


RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_figures_in_recipe_comments_come_from_the_records(recipe):
    """A recipe's comments quote what it measured; those figures are on the results page too, so a
    re-measured recipe whose comment was not brought up to date fails here."""
    known = {_value(n) for n in re.findall(NUMBER, RESULTS_PAGE.read_text(encoding="utf-8"))}
    lines = recipe.read_text(encoding="utf-8").splitlines()
    comments = "\n".join(line.split("#", 1)[1] for line in lines if "#" in line)
    missing = [n for n in _figures(comments) if _value(n) not in known]
    assert not missing, f"{recipe.name} quotes figures in its comments that no record holds: {missing}"


@pytest.mark.parametrize("page", GUIDES, ids=[p.name for p in GUIDES])
def test_figures_in_guides_come_from_the_records(page):
    """Every measured figure a guide quotes is on the rendered results page (so in a record)."""
    known = {_value(n) for n in re.findall(NUMBER, RESULTS_PAGE.read_text(encoding="utf-8"))}
    missing = [n for n in _figures(_prose(page)) if _value(n) not in known]
    assert not missing, f"{page.name} quotes figures that no record holds: {missing}"


# ----------------------------------------------------------------------------- links

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    anchors = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip().lower().replace("`", "")
            anchors.add("".join(c for c in heading if c.isalnum() or c in " -_").replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: link to {target}: {file} does not exist"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{page.name}: link to {target}: no such heading in {file.name}"


def test_the_picture_is_small():
    picture = ROOT / "docs" / "images" / "cross_attention.png"
    assert picture.is_file() and picture.stat().st_size < 200_000


# ----------------------------------------------------------------------------- benchmark records


def _bench(name: str, monkeypatch, tmp_path):
    """bench/NAME.py as a module, its records going to tmp_path instead of bench/results."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    record = importlib.import_module("record")
    monkeypatch.setattr(record, "RESULTS", tmp_path)
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rendered(tmp_path: Path, name: str) -> list[dict]:
    module = _render_module()
    module.render(module.load(tmp_path))  # renders without error
    return module.load(tmp_path)[name]


def _known_metrics(name: str) -> set[str]:
    return {r["metric"] for r in json.loads((ROOT / "bench" / "results" / f"{name}.json").read_text())}


def test_record_append_fills_in_the_run(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    record = importlib.import_module("record")
    first = record.append("x", {"metric": "m", "figure": 1.5, "unit": "s"}, results=tmp_path)
    record.append_run(
        "x", [{"metric": "m", "figure": 2, "unit": "s"}, {"metric": "n", "figure": 3, "unit": "s"}], results=tmp_path
    )
    runs = json.loads((tmp_path / "x.json").read_text())
    assert [r["figure"] for r in runs] == [1.5, 2, 3]
    assert runs[1]["date"] == runs[2]["date"] and runs[1]["commit"] == runs[2]["commit"]
    assert set(first) >= {
        "name",
        "metric",
        "figure",
        "unit",
        "peer",
        "peer_figure",
        "target",
        "command",
        "commit",
        "date",
        "machine",
        "notes",
    }
    assert len(first["commit"]) == 40 and first["date"].endswith("Z")
    assert first["machine"]["cores"] >= 1 and first["machine"]["cpu"]
    with pytest.raises(ValueError, match="figure"):
        record.append("x", {"metric": "m", "unit": "s"}, results=tmp_path)


def test_mt_speed_records_continue_the_existing_metrics(monkeypatch, tmp_path):
    bench = _bench("mt_speed", monkeypatch, tmp_path)
    train = {
        "what": "train small bf16",
        "qkv": 6000,
        "marian": 4000,
        "nn.Transformer": 3500,
        "ratio_vs_faster_peer": 1.5,
    }
    decode = {
        "what": "decode base greedy batch 1",
        "qkv": 100,
        "hf": 90,
        "ratio": 1.11,
        "qkv_bf16": 200,
        "hf_bf16": 150,
        "qkv_int8": 300,
        "hf_int8": 190,
    }
    bench._record([train, decode])
    runs = _rendered(tmp_path, "mt_speed")
    assert {r["metric"] for r in runs} <= _known_metrics("mt_speed")
    assert runs[0]["peer_figure"] == 4000 and runs[0]["target"] == {"min_ratio": 1.3}
    assert [r["figure"] for r in runs[1:]] == [100, 200, 300] and runs[2]["details"] == {"HF bf16": 150}


def test_mt_speed_batch_1_records_hold_ctranslate2_and_the_roofline(monkeypatch, tmp_path):
    bench = _bench("mt_speed", monkeypatch, tmp_path)
    row = {"what": "decode base greedy batch 1", "qkv": 160, "hf": 130, "qkv_bf16": 180, "hf_bf16": 120}
    row |= {"qkv_int8": 340, "hf_int8": 150, "CTranslate2 fp32": 80, "CTranslate2 int8": 140}
    row |= {"roofline": {"fp32": 240, "bf16": 480, "int8": 960}, "bandwidth GB/s": 28.1}
    bench._record([row], notes="contended")
    runs = _rendered(tmp_path, "mt_speed")
    assert {r["metric"] for r in runs} <= _known_metrics("mt_speed")
    fp32, int8 = runs[0], runs[2]
    assert fp32["details"]["CTranslate2 fp32"] == 80 and fp32["details"]["share of the roofline, %"] == 67
    assert int8["details"]["CTranslate2 int8"] == 140 and int8["details"]["roofline tokens/s"] == 960
    assert int8["notes"] == "contended"


def test_mt_speed_times_each_engine_in_interleaved_processes_and_records_medians(monkeypatch, tmp_path):
    bench = _bench("mt_speed", monkeypatch, tmp_path)
    started = []
    figures = {"qkv int8": [190.0, 210.0, 170.0], "HF fp32": [70.0, 50.0, 60.0]}

    def process(engine, size_name, args):  # a child's rates: batch 1 only, the next figure of the engine's list
        started.append(engine)
        if engine == "CTranslate2 int8":
            return None  # failed (not installed, say): not started again
        return {"1x1": figures[engine][sum(e == engine for e in started) - 1]}

    monkeypatch.setattr(bench, "engine_process", process)
    monkeypatch.setattr(bench, "bandwidth", lambda n_bytes: 13.0e9)
    args = argparse.Namespace(repeats=3, engines=["qkv int8", "HF fp32", "CTranslate2 int8"])
    row = bench.decode_rows("tiny", args)[0]
    assert started == ["qkv int8", "HF fp32", "CTranslate2 int8", "qkv int8", "HF fp32", "qkv int8", "HF fp32"]
    assert (row["qkv int8"], row["spread"]["qkv int8"], row["processes"]["qkv int8"]) == (190.0, [170.0, 210.0], 3)
    assert row["hf"] == 60.0 and "CTranslate2 int8" not in row
    bench._record([row])
    int8 = next(r for r in _rendered(tmp_path, "mt_speed") if r["metric"] == "decode tiny int8 greedy batch 1")
    assert (int8["figure"], int8["peer_figure"]) == (190.0, 60.0)
    assert int8["details"]["min-max"] == [170.0, 210.0] and int8["details"]["HF fp32 min-max"] == [50.0, 70.0]
    assert int8["details"]["processes"] == 3


def test_chat_speed_records_put_each_figure_beside_transformers_fp32(monkeypatch, tmp_path):
    bench = _bench("chat_speed", monkeypatch, tmp_path)

    def engine(prompt: float, generated: float, tokens: list[list[int]]) -> dict:
        return {"rates": {"1": {"prompt": prompt, "generated": generated}}, "tokens": tokens, "peak_rss": 2**30}

    figures = {
        "qkv fp32": engine(900.0, 60.0, [[1, 2, 3, 4], [5, 6, 7, 8]]),
        "qkv int8": engine(1500.0, 120.0, [[1, 2, 9, 4], [5, 6, 7, 8]]),
        "transformers fp32": engine(600.0, 30.0, [[1, 2, 3, 4], [5, 6, 7, 8]]),
    }
    args = argparse.Namespace(agree_prompts=2, agree_new=4, agree_batch=1)
    bench._record(bench.report(figures, args), notes="contended", threads=2)
    runs = {r["metric"]: r for r in _rendered(tmp_path, "chat_speed")}
    int8 = runs["SmolLM2-135M qkv int8 batch 1: generated tokens/s"]
    assert (int8["figure"], int8["peer_figure"], int8["target"]) == (120.0, 30.0, {"min_ratio": 1.5})
    assert runs["SmolLM2-135M transformers fp32 batch 1: prompt tokens/s"]["peer_figure"] is None
    drift = runs["SmolLM2-135M qkv int8 vs qkv fp32: greedy tokens the same"]
    assert drift["figure"] == 87.5
    assert drift["details"] == {"share before the first difference, %": 75.0, "prompts per run": 1}
    assert drift["notes"].startswith("contended")


def test_lm_speed_records_continue_the_existing_metrics(monkeypatch, tmp_path):
    bench = _bench("lm_speed", monkeypatch, tmp_path)
    rows = [
        ("GPT train fp32 (B64 x T256)", 2000, 1800),
        ("GPT generate fp32 batch 1 (255 new)", 200, 170),
        ("GPT generate bf16 weights batch 1", 260, 210),
        ("GPT generate qkv bf16 / HF fp32 batch 1", 260, 170),
        ("GPT generate qkv int8 / HF fp32 batch 1", 700, 170),
        ("BERT encode bf16 (32 x 128)", 480, 400),
    ]
    bench._record([{"what": w, "qkv": a, "hf": b, "ratio": round(a / b, 2)} for w, a, b in rows])
    runs = _rendered(tmp_path, "lm_speed")
    assert {r["metric"] for r in runs} <= _known_metrics("lm_speed")
    assert len(runs) == 5 and runs[2]["details"] == {"HF bf16": 210} and runs[2]["peer_figure"] == 170


def test_lm_shakespeare_records_continue_the_existing_metrics(monkeypatch, tmp_path):
    bench = _bench("lm_shakespeare", monkeypatch, tmp_path)
    result = {"val_loss": 1.81, "steps": 2000, "tokens_per_second": 9000}
    bench._record("recipes/shakespeare_char_cpu.yaml", result, 95.0, same=True)
    bench._record("recipes/shakespeare_char.yaml", result, 1000.0, same=False)
    runs = _rendered(tmp_path, "lm_shakespeare")
    assert {r["metric"] for r in runs} <= _known_metrics("lm_shakespeare")
    assert [(r["figure"], r["unit"]) for r in runs] == [
        (1.81, "nats/char"),
        (95.0, "s"),
        (1.81, "nats/char"),
        (16.7, "min"),
    ]


def test_mt_records_continue_the_existing_metrics(monkeypatch, tmp_path):
    bench = _bench("mt", monkeypatch, tmp_path)
    result = {
        "chrf": 66.4,
        "sacrebleu": 40.1,
        "train_seconds": 4200.0,
        "tokens_per_second": 12000,
        "wall_seconds": 4800.0,
        "translate_seconds": 30.0,
        "final_checkpoint": "best",
        "epochs": 57,
    }
    for direction, (_, _, tok_ref, _, _, (target, anchor)) in bench.BENCHES.items():
        bench._record(direction, result, 42.0, target=target, anchor=anchor, table=tok_ref is not None)
    ensemble = {**result, "final_checkpoint": ["best", "averaged"], "epochs": [57, 57], "member_bleu": [40.3, 41.6]}
    target, anchor = bench.BENCHES["en-de-lc"][-1]
    bench._record("en-de-lc", ensemble, 42.03, target=target, anchor=anchor, table=True)
    runs = _rendered(tmp_path, "mt")
    assert {r["metric"] for r in runs} <= _known_metrics("mt")
    de_en, zh_en = (next(r for r in runs if r["metric"].startswith(s)) for s in ("Multi30k de", "Tatoeba zh"))
    assert de_en["peer_figure"] == 36.5 and de_en["target"] == {"min": 38.0} and de_en["details"]["sacreBLEU"] == 40.1
    assert zh_en["peer_figure"] == 26.95 and "sacreBLEU" not in zh_en["details"]
    assert runs[-1]["metric"].endswith("ensemble of 2") and runs[-1]["details"]["member 1"] == 41.6


def test_asr_pipelines_load_and_fit_their_90_minutes(monkeypatch, tmp_path):
    """bench/asr.py --pipeline: every stage is a recipe that loads with its overrides, a "{name}"
    in an override names an earlier stage, and the training budgets leave a quarter hour of the
    90 minutes for building the corpus, its features and scoring (the bench measures the rest)."""
    from qkv.tasks import load_recipe

    bench = _bench("asr", monkeypatch, tmp_path)
    assert set(bench.PIPELINES) <= set(bench.BENCHES)
    for name, stages in bench.PIPELINES.items():
        done: dict[str, str] = {}
        budget = 0.0
        for stage, recipe_name, overrides in stages:
            names = set(re.findall(r"\{(\w+)\}", " ".join(overrides)))
            assert names <= set(done), f"{name}: stage {stage} uses a later stage's directory"
            recipe = load_recipe(ROOT / "recipes" / f"{recipe_name}.yaml", [o.format(**done) for o in overrides])
            budget += recipe.train.seconds
            done[stage] = str(tmp_path / stage)
        assert budget <= (90 - 15) * 60, f"{name}: {budget / 60:.0f} min of training leaves too little of 90"
    # --set: every stage's, or one stage's (STAGE:KEY=VALUE); a colon in a value names no stage.
    items = ["train.seconds=30", "lm:train.seconds=9", "asr:data.test_limit=5", "data.tokenizer=c:/x"]
    assert bench.stage_sets("lm", items) == ["train.seconds=30", "train.seconds=9", "data.tokenizer=c:/x"]
