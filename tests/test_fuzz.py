"""Loading never runs code and bad input never crashes (issue 25 §2); resource limits (§3).

- **No pickle.** No module of qkv unpickles, evaluates or loads code: an AST scan of src/qkv
  finds no ``torch.load``, ``pickle``, ``numpy.load(allow_pickle=True)``, ``marshal``,
  ``shelve``, ``eval``, ``exec`` or unsafe YAML but the one use :data:`ALLOWED` names with its
  reason. Canaries: a model directory whose ``model.safetensors`` is a pickle, one whose
  config.json lists a pickle, and a Hugging Face checkpoint whose ``pytorch_model.bin`` is one,
  each pickle creating a marker file when unpickled, are refused in one line and the marker
  never appears.
- **Fuzzing** (hypothesis, seeded: ``derandomize=True``): six categories of inputs, each drawn
  from valid ones and mutated (:data:`CATEGORIES`): model directories, config.json, recipes,
  tokenizer files, corpora, command lines. Every case ends successfully or with one line (a
  UserError, or exit status 2 with one ``error:`` line) that names the culprit (the file, the
  option), a refusal within :data:`LIMIT_S` seconds; no traceback, no hang (:data:`HANG_S`). ``bench/fuzz.py`` runs
  the same properties with many more examples and records the counts.
- **Resource limits.** ``--max-new-tokens`` in the millions, inputs far longer than the window,
  a beam or a batch whose decoding would not fit in memory (estimated before allocating: the
  batch is split, or refused with the number), a config whose weights would not fit.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import dataclasses
import functools
import io
import json
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from qkv.checkpoint import load_model, save_model
from qkv.cli.main import build_parser, main
from qkv.errors import UserError
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.models.encoder_only import EncoderOnly, EncoderOnlyConfig
from qkv.tokenization import FILE, SPECIALS_FILE, Tokenizer

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 2.0  # a refusal comes within this
HANG_S = 20.0  # any case still running then is stopped (SIGALRM) and counted as a hang
WORK_S = 10.0  # the resource tests' bound on work a tiny model does (a busy shared machine included)
MEMORY_CAP = "1G"  # QKV_MAX_MEMORY while fuzzing: what the memory checks count as available
EXAMPLES = 30  # per category in the suite; bench/fuzz.py runs many more


# ----------------------------------------------------------------------------- no pickle

# The one place qkv may unpickle, and why: (file, call) -> reason.
ALLOWED = {
    ("src/qkv/hf/common.py", "torch.load"): "Hugging Face's pytorch_model.bin is a pickle (a foreign format, "
    "not qkv's); read with weights_only=True, PyTorch's restricted unpickler, which builds tensors and "
    "containers only and refuses any other global (tested: test_import_hf_refuses_a_malicious_pickle)",
}
MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib", "copyreg"}
CALLS = {
    "torch.load",
    "torch.jit.load",
    "eval",
    "exec",
    "compile",
    "__import__",
    "yaml.load",
    "yaml.unsafe_load",
    "yaml.full_load",
    "yaml.load_all",
    "pandas.read_pickle",
    "pd.read_pickle",
}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _safe_loader(call: ast.Call) -> bool:
    """Whether a yaml.load call names only safe loaders (SafeLoader, CSafeLoader) as its Loader."""
    loader = next((k.value for k in call.keywords if k.arg == "Loader"), None)
    names = (
        [_dotted(n).split(".")[-1] for n in ast.walk(loader) if isinstance(n, ast.Attribute | ast.Name)]
        if loader
        else []
    )
    loaders = [n for n in names if n.endswith("Loader")]
    return bool(loaders) and all(n.endswith("SafeLoader") for n in loaders)


def _unsafe_uses(path: Path, where: str) -> list[tuple[str, str, int]]:
    """(file, what, line) of every import of a pickling module and every call that can run code."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [(where, f"import {n}", node.lineno) for n in names if n.split(".")[0] in MODULES]
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name == "yaml.load" and _safe_loader(node):
                continue
            if name in CALLS:
                found.append((where, name, node.lineno))
            elif name in ("np.load", "numpy.load"):
                pickles = [k for k in node.keywords if k.arg == "allow_pickle"]
                if pickles and not (isinstance(pickles[0].value, ast.Constant) and pickles[0].value.value is False):
                    found.append((where, f"{name}(allow_pickle=...)", node.lineno))
    return found


def test_no_module_unpickles_or_runs_code():
    paths = sorted((ROOT / "src" / "qkv").rglob("*.py"))
    found = [u for path in paths for u in _unsafe_uses(path, path.relative_to(ROOT).as_posix())]
    assert {(f, what) for f, what, _ in found} == set(ALLOWED), found
    # The allowed torch.load is the restricted one.
    tree = ast.parse((ROOT / "src/qkv/hf/common.py").read_text(encoding="utf-8"))
    loads = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _dotted(n.func) == "torch.load"]
    assert loads and all(
        any(k.arg == "weights_only" and getattr(k.value, "value", None) is True for k in n.keywords) for n in loads
    )


def test_the_scan_finds_what_it_looks_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import pickle\nfrom marshal import loads\nimport numpy as np\n"
        "torch.load(f)\nnp.load(f, allow_pickle=True)\nnp.load(f)\neval('1')\nmodel.eval()\nyaml.load(s)\n"
        "yaml.load(s, Loader=yaml.CSafeLoader if c else yaml.SafeLoader)\nyaml.load(s, Loader=yaml.Loader)\n"
    )
    found = {what for _, what, _ in _unsafe_uses(probe, "probe.py")}
    assert found == {"import pickle", "import marshal", "torch.load", "np.load(allow_pickle=...)", "eval", "yaml.load"}


class _Marker:
    """Unpickling this creates ``path`` (a stand-in for any code a pickle could run)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def _pickles(marker: Path) -> dict[str, bytes]:
    """A plain pickle and a torch.save file (a zip holding one), each creating ``marker`` when unpickled."""
    buffer = io.BytesIO()
    torch.save({"weight": _Marker(marker)}, buffer)
    return {"pickle": pickle.dumps({"weight": _Marker(marker)}), "torch.save": buffer.getvalue()}


def test_the_marker_pickles_do_run_code(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(_pickles(marker)["pickle"])  # the test's own proof that the payload is live
    assert marker.exists()


@pytest.mark.parametrize("payload", ["pickle", "torch.save"])
def test_a_model_directory_carrying_a_pickle_is_refused_without_running_it(payload, tmp_path):
    marker = tmp_path / "ran"
    bad = _pickles(marker)[payload]
    weights = _copy_base("gpt", tmp_path / "weights")
    (weights / "model.safetensors").write_bytes(bad)
    listed = _copy_base("gpt", tmp_path / "listed")
    (listed / "weights.pkl").write_bytes(bad)
    meta = json.loads((listed / "config.json").read_text())
    meta["files"]["weights.pkl"] = _sha256(listed / "weights.pkl")
    (listed / "config.json").write_text(json.dumps(meta))
    for directory, culprit in ((weights, "model.safetensors"), (listed, "weights.pkl")):
        with pytest.raises(UserError, match="pickle") as refused:
            load_model(directory)
        assert culprit in str(refused.value) and "\n" not in str(refused.value)
        assert "pickle" in _last_error(_cli_stderr("generate", "--model", str(directory), "--prompt", "ab"), culprit)
    assert not marker.exists()


@pytest.mark.parametrize("payload", ["pickle", "torch.save"])
def test_import_hf_refuses_a_malicious_pickle(payload, tmp_path):
    marker = tmp_path / "ran"
    src = tmp_path / "hf"
    src.mkdir()
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 13, "n_embd": 15}
    (src / "config.json").write_text(json.dumps({**config, "n_head": 3, "n_layer": 1, "n_positions": 16}))
    (src / "pytorch_model.bin").write_bytes(_pickles(marker)[payload])
    line = _last_error(_cli_stderr("import-hf", str(src), str(tmp_path / "out")), "pytorch_model.bin")
    assert "weights_only" in line
    assert not marker.exists() and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- the harness


class Hang(BaseException):
    """Raised in a case by SIGALRM after HANG_S seconds."""


class WouldTrain(BaseException):
    """What the stand-ins for long work raise: the command got as far as starting it."""


_WORK = Path(tempfile.mkdtemp(prefix="qkv-fuzz-"))
atexit.register(shutil.rmtree, _WORK, ignore_errors=True)
CHARS = "abcdefghij 0123456789,.?!"


@functools.cache
def bases() -> dict[str, Path]:
    """Tiny valid model directories (window 16, one layer): a decoder-only model, a numbers-task
    encoder-decoder and a two-class encoder-only classifier, each with a character tokenizer."""
    folder = _WORK / "bases"
    folder.mkdir()
    tokenizer = Tokenizer.train_char_level([CHARS])
    files = tokenizer.save(folder / FILE)
    v, block = tokenizer.vocab_size, {"d_model": 15, "n_heads": 3, "d_ff": 7, "max_len": 16, "dropout": 0.0}
    torch.manual_seed(0)
    models = {
        "gpt": (DecoderOnly(DecoderOnlyConfig(vocab_size=v, n_layers=1, **block)), {}),
        "s2s": (
            EncoderDecoder(
                EncoderDecoderConfig(
                    src_vocab_size=v, tgt_vocab_size=v, n_encoder_layers=1, n_decoder_layers=1, **block
                )
            ),
            {"task": "numbers"},
        ),
        "bert": (
            EncoderOnly(EncoderOnlyConfig(vocab_size=v, n_layers=1, n_classes=2, **block)),
            {"task": "classify", "labels": ["no", "yes"]},
        ),
    }
    return {name: save_model(m, folder / name, files=files, extra=extra) for name, (m, extra) in models.items()}


def _copy_base(name: str, to: Path) -> Path:
    shutil.copytree(bases()[name], to)
    return to


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    def ring(signum, frame):
        raise Hang(f"still running after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _stdin(data: bytes) -> Iterator[None]:
    with mock.patch.object(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")):
        yield


@contextlib.contextmanager
def _no_long_work() -> Iterator[None]:
    """Training (each task's parts of a run, which the runner prepares after it has checked
    where the run goes) and the numbers evaluation stand in by :class:`WouldTrain` (a command that
    gets there has accepted its input); everything else runs for real."""
    from qkv import tasks
    from qkv.tasks import numbers

    def would_train(*args, **kwargs):
        raise WouldTrain

    stubs = {name: dataclasses.replace(task, prepare=would_train) for name, task in tasks.TASKS.items()}
    with (
        mock.patch.dict(tasks.TASKS, stubs),
        mock.patch.object(numbers, "train_numbers", would_train),
        mock.patch.object(numbers, "evaluate_numbers", would_train),
    ):
        yield


@dataclasses.dataclass
class Outcome:
    """How a case ended: ``status`` 0 (success) or 2 (refused), ``message`` (stderr of a
    command, a UserError's text), or ``failure`` (what was wrong: a crash, a hang, too slow)."""

    status: int | None = None
    message: str = ""
    failure: str | None = None
    seconds: float = 0.0


def _run(
    call: Callable[[], object],
    *,
    stdin: bytes = b"",
    cwd: Path | None = None,
    memory: str = MEMORY_CAP,
    stubs: bool = True,
) -> Outcome:
    err = io.StringIO()
    start = time.perf_counter()
    here = Path.cwd()
    outcome = Outcome()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with (
            _alarm(HANG_S),
            _stdin(stdin),
            mock.patch.dict(os.environ, {"QKV_MAX_MEMORY": memory, "QKV_PROGRESS": "lines"}),
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(io.StringIO()),
            _no_long_work() if stubs else contextlib.nullcontext(),
        ):
            result = call()
        outcome.status = result if isinstance(result, int) else 0
        outcome.message = err.getvalue()
    except UserError as e:
        outcome.status, outcome.message = 2, str(e)
    except SystemExit as e:
        outcome.status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        outcome.message = err.getvalue()
    except WouldTrain:
        outcome.status, outcome.message = 0, err.getvalue()
    except Hang as e:
        outcome.failure = f"hang: {e}"
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        frames = traceback.extract_tb(e.__traceback__)
        at = next((f for f in reversed(frames) if "/qkv/" in f.filename), frames[-1] if frames else None)
        place = f" at {Path(at.filename).name}:{at.lineno}" if at else ""
        text = (str(e).strip().splitlines() or [""])[0][:200]
        outcome.failure = f"crash: {type(e).__name__}: {text}{place}"
    finally:
        os.chdir(here)
    outcome.seconds = time.perf_counter() - start
    return outcome


def _judge(outcome: Outcome, names: list[str]) -> str | None:
    """None when the case ended as it must; else what was wrong."""
    if outcome.failure is not None:
        return outcome.failure
    if "Traceback" in outcome.message:
        return f"a traceback: {outcome.message[-300:]!r}"
    if outcome.status == 0:
        return None  # work done (its time is the input's: HANG_S bounds it)
    if outcome.seconds > LIMIT_S:
        return f"slow: refused after {outcome.seconds:.2f} s"
    if outcome.status != 2:
        return f"exit status {outcome.status}: {outcome.message[-300:]!r}"
    lines = [line for line in outcome.message.splitlines() if line.strip()]
    errors = [line for line in lines if ": error: " in line] if len(lines) > 1 else lines
    if len(errors) != 1 or errors[0] != lines[-1]:
        return f"not one error line: {outcome.message[-300:]!r}"
    if not any(name and name in errors[0] for name in names):
        return f"names none of {names}: {errors[0][:300]!r}"
    return None


def _verdict(call: Callable[[], object], names: list[str], **kwargs) -> str | None:
    failure = _judge(_run(call, **kwargs), names)
    if failure is not None and failure.startswith("slow:"):  # the machine is shared: a slow refusal is timed again
        failure = _judge(_run(call, **kwargs), names)
    return failure


def _cli(*argv: str) -> Callable[[], int]:
    return lambda: main(list(argv))


def _cli_stderr(*argv: str, stdin: bytes = b"") -> str:
    outcome = _run(_cli(*argv), stdin=stdin)
    assert outcome.failure is None, outcome.failure
    return outcome.message


def _last_error(stderr: str, culprit: str) -> str:
    """The one error line of a refused command, which names ``culprit``."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines and ": error: " in lines[-1] and "Traceback" not in stderr, stderr
    assert sum(": error: " in line for line in lines) == 1, stderr
    assert culprit in lines[-1], (culprit, lines[-1])
    return lines[-1]


# ----------------------------------------------------------------------------- values

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2, 3, 2**31, 2**63, 10**30, -(10**12)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
DEPTHS = st.sampled_from([50, 2_000, 200_000])  # nesting: ordinary, past Python's recursion limit, far past


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


# ----------------------------------------------------------------------------- model directories

TENSOR_DTYPES = [torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.bool, torch.complex64]
MODEL_FILES = ["config.json", "model.safetensors", FILE]

model_edits = st.one_of(
    st.tuples(st.just("delete"), st.sampled_from(MODEL_FILES)),
    st.tuples(st.just("directory"), st.sampled_from(MODEL_FILES)),
    st.tuples(st.just("truncate"), st.sampled_from(MODEL_FILES), st.floats(0, 1)),
    st.tuples(st.just("flip"), st.sampled_from(MODEL_FILES), st.integers(0, 2**20), st.integers(1, 255)),
    st.tuples(st.just("replace"), st.sampled_from(MODEL_FILES), st.binary(max_size=64)),
    st.tuples(st.just("header flip"), st.integers(0, 4096), st.integers(1, 255)),
    st.tuples(st.just("header length"), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("header field"), st.integers(0, 99), st.sampled_from(["dtype", "shape", "data_offsets"]), VALUES),
    st.tuples(st.just("header text"), st.binary(max_size=40)),
    st.tuples(st.just("dtype"), st.integers(0, 99), st.sampled_from(TENSOR_DTYPES)),
    st.tuples(st.just("shape"), st.integers(0, 99), st.lists(st.integers(0, 20), max_size=3)),
    st.tuples(st.just("drop tensor"), st.integers(0, 99)),
    st.tuples(st.just("extra tensor"), st.text(min_size=1, max_size=12)),
    st.tuples(st.just("non-finite"), st.integers(0, 99), st.sampled_from([float("nan"), float("inf")])),
    st.tuples(st.just("hash"), st.sampled_from(["append", "digest", "list missing", "list outside"])),
    st.tuples(st.just("pickle"), st.sampled_from(["model.safetensors", FILE])),
)


def _safetensors_parts(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_safetensors_parts(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def _edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor], list[str]], None]) -> None:
    tensors = load_file(path)
    edit(tensors, sorted(tensors))
    save_file(tensors, path)


def edit_model_directory(directory: Path, edit: tuple) -> None:
    """Apply one mutation (a tuple of :data:`model_edits`) to a model directory."""
    what, *args = edit
    weights = directory / "model.safetensors"
    if what in ("header flip", "header length", "header field", "header text", "dtype", "shape") or what in (
        "drop tensor",
        "extra tensor",
        "non-finite",
    ):
        if not weights.is_file():
            return
        try:
            header, data = _safetensors_parts(weights)
            names = sorted(k for k in header if k != "__metadata__")
            load_file(weights)
        except Exception:
            return  # an earlier edit broke the file: this one has nothing to work on
    if what == "delete":
        path = directory / args[0]
        if path.is_file():
            path.unlink()
    elif what == "directory":
        path = directory / args[0]
        if path.is_file():
            path.unlink()
        path.mkdir(exist_ok=True)
    elif what == "truncate":
        path = directory / args[0]
        if path.is_file():
            raw = path.read_bytes()
            path.write_bytes(raw[: int(len(raw) * args[1])])
    elif what == "flip":
        path = directory / args[0]
        if path.is_file() and path.stat().st_size:
            raw = bytearray(path.read_bytes())
            raw[args[1] % len(raw)] ^= args[2]
            path.write_bytes(bytes(raw))
    elif what == "replace":
        path = directory / args[0]
        if not path.is_dir():
            path.write_bytes(args[1])
    elif what == "header flip":
        raw = bytearray(weights.read_bytes())
        n = int.from_bytes(raw[:8], "little")
        raw[8 + args[0] % n] ^= args[1]
        weights.write_bytes(bytes(raw))
    elif what == "header length":
        weights.write_bytes(args[0].to_bytes(8, "little") + weights.read_bytes()[8:])
    elif what == "header field":
        name = names[args[0] % len(names)]
        header[name][args[1]] = args[2]
        _write_safetensors_parts(weights, header, data)
    elif what == "header text":
        weights.write_bytes(len(args[0]).to_bytes(8, "little") + args[0] + data)
    elif what == "dtype":

        def retype(tensors, names):
            name = names[args[0] % len(names)]
            tensors[name] = tensors[name].to(args[1])

        _edit_tensors(weights, retype)
    elif what == "shape":

        def reshape(tensors, names):
            tensors[names[args[0] % len(names)]] = torch.zeros(args[1])

        _edit_tensors(weights, reshape)
    elif what == "drop tensor":
        _edit_tensors(weights, lambda tensors, names: tensors.pop(names[args[0] % len(names)]))
    elif what == "extra tensor":
        _edit_tensors(weights, lambda tensors, names: tensors.__setitem__(args[0], torch.zeros(2)))
    elif what == "non-finite":

        def spoil(tensors, names):
            tensor = tensors[names[args[0] % len(names)]]
            if tensor.is_floating_point() and tensor.numel():  # an earlier edit may have made it integer
                tensor.view(-1)[0] = args[1]

        _edit_tensors(weights, spoil)
    elif what == "hash":
        config = directory / "config.json"
        try:
            meta = json.loads(config.read_text())
            files = meta["files"]
            assert isinstance(files, dict)
        except Exception:
            return
        if args[0] == "append" and (directory / FILE).is_file():
            with open(directory / FILE, "ab") as f:
                f.write(b" ")
        elif args[0] == "digest":
            files[FILE] = "0" * 64
        elif args[0] == "list missing":
            files["vocab.txt"] = "0" * 64
        else:
            files["../../../../../../proc/self/status"] = "0" * 64
        config.write_text(json.dumps(meta))
    elif what == "pickle":
        path = directory / args[0]
        if not path.is_dir():
            path.write_bytes(_pickles(directory / "ran")["pickle"])


def check_model_directory(base: str, edits: list[tuple]) -> str | None:
    """The property: a mutated model directory is used (``qkv generate``, or ``qkv embed`` for
    the encoder-only one) or refused in one line naming it; a pickle in it is never run."""
    case = Path(tempfile.mkdtemp(dir=_WORK))
    try:
        directory = _copy_base(base, case / "model")
        for edit in edits:
            edit_model_directory(directory, edit)
        return _use_model(directory, case)
    finally:
        shutil.rmtree(case, ignore_errors=True)


def _use_model(directory: Path, case: Path) -> str | None:
    if "bert" in directory.name or _kind(directory) == "encoder_only":
        argv = ["embed", "--model", str(directory), "--output", str(case / "v.jsonl")]
    else:
        argv = ["generate", "--model", str(directory), "--max-new-tokens", "3"]
    failure = _verdict(_cli(*argv), [str(directory)], stdin=b"ab 1\n\nz\n")
    if failure is None and (directory / "ran").exists():
        failure = "a pickle in the model directory was run"
    return failure


def _kind(directory: Path) -> str | None:
    try:
        return json.loads((directory / "config.json").read_text()).get("kind")
    except Exception:
        return None


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(base=st.sampled_from(["gpt", "s2s", "bert"]), edits=st.lists(model_edits, min_size=1, max_size=3))
@example(base="gpt", edits=[("hash", "list outside")])
@example(base="gpt", edits=[("dtype", 0, torch.int64)])
@example(base="s2s", edits=[("non-finite", 3, float("nan"))])
@example(base="gpt", edits=[("header field", 0, "shape", [10**12, 10**12])])
def test_fuzz_model_directories(base, edits):
    assert check_model_directory(base, edits) is None


# ----------------------------------------------------------------------------- config.json

CONFIG_FIELDS = sorted(
    {f.name for c in (DecoderOnlyConfig, EncoderDecoderConfig, EncoderOnlyConfig) for f in dataclasses.fields(c)}
)
config_edits = st.one_of(
    st.tuples(st.just("field"), st.sampled_from(CONFIG_FIELDS) | st.text(max_size=8), VALUES),
    st.tuples(
        st.just("size"),
        st.sampled_from(["vocab_size", "src_vocab_size", "d_model", "n_layers", "max_len", "d_ff", "n_heads"]),
        st.sampled_from([0, -1, -(2**40), 2**31, 10**9, 10**30, 2**63]),
    ),
    st.tuples(st.just("top"), st.sampled_from(["kind", "config", "files", "qkv_version", "labels", "task"]), VALUES),
    st.tuples(st.just("delete"), st.sampled_from(["kind", "config", "files"]) | st.sampled_from(CONFIG_FIELDS)),
    st.tuples(st.just("deep"), DEPTHS),
    st.tuples(
        st.just("text"), st.binary(max_size=40) | st.sampled_from([b"", b"\xff\xfe{}", b"null", b"[]", b"1e999"])
    ),
)


def edit_config(directory: Path, edit: tuple) -> None:
    path = directory / "config.json"
    what, *args = edit
    if what == "deep":
        path.write_text('{"kind": "decoder_only", "config": ' + _deep(args[0]) + "}")
        return
    if what == "text":
        path.write_bytes(args[0])
        return
    try:
        meta = json.loads(path.read_text())
        config = meta["config"]
        assert isinstance(config, dict)
    except Exception:
        return
    if what in ("field", "size"):
        config[args[0]] = args[1]
    elif what == "top":
        meta[args[0]] = args[1]
    elif args[0] in meta:
        del meta[args[0]]
    else:
        config.pop(args[0], None)
    path.write_text(json.dumps(meta))


def check_config(base: str, edits: list[tuple]) -> str | None:
    """The property: a model directory whose config.json was mutated loads, or is refused in one
    line naming it, without allocating what a huge size would ask for."""
    case = Path(tempfile.mkdtemp(dir=_WORK))
    try:
        directory = _copy_base(base, case / "model")
        for edit in edits:
            edit_config(directory, edit)
        failure = _verdict(lambda: load_model(directory), [str(directory)])
        return failure or _use_model(directory, case)
    finally:
        shutil.rmtree(case, ignore_errors=True)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(base=st.sampled_from(["gpt", "s2s", "bert"]), edits=st.lists(config_edits, min_size=1, max_size=3))
@example(base="gpt", edits=[("deep", 200_000)])
@example(base="gpt", edits=[("size", "vocab_size", 10**9)])
@example(base="gpt", edits=[("size", "max_len", 10**9)])
@example(base="s2s", edits=[("field", "n_heads", 2.5)])
@example(base="gpt", edits=[("size", "max_len", 10**30)])  # found: an overflow in decoding
@example(base="bert", edits=[("size", "n_layers", 10**9)])  # found: a hang building a billion layers
@example(base="gpt", edits=[("size", "n_layers", 1000)])  # more layers than the file has tensors
def test_fuzz_config_json(base, edits):
    assert check_config(base, edits) is None


# ----------------------------------------------------------------------------- recipes

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
recipe_edits = st.one_of(
    st.tuples(
        st.just("set"),
        st.sampled_from(["model", "train", "data", "task"]) | st.text(max_size=6),
        st.sampled_from(["steps", "d_model", "n_heads", "lr", "batch_size", "max_len", "seed", "tokenizer"])
        | st.text(max_size=8),
        VALUES,
    ),
    st.tuples(
        st.just("size"),
        st.sampled_from(["model.d_model", "model.n_heads", "model.max_len", "train.steps", "train.batch_size"]),
        st.sampled_from([0, -1, -(10**9), 10**12, 2**63, 10**30, 1.5, float("inf"), float("nan"), "ten", True]),
    ),
    st.tuples(st.just("section"), st.sampled_from(["model", "train", "data", "task"]), VALUES),
    st.tuples(st.just("drop"), st.sampled_from(["model", "train", "data", "task"])),
    st.tuples(st.just("override"), st.text(max_size=30)),
    st.tuples(
        st.just("override"),
        st.sampled_from(["train.steps=", "model.d_model=", "task=", "data.x=", "model=", "=", "train.lr="]).flatmap(
            lambda k: st.text(max_size=10).map(lambda v: k + v)
        ),
    ),
    st.tuples(st.just("deep"), DEPTHS),
    st.tuples(
        st.just("text"), st.binary(max_size=60) | st.sampled_from([b"", b"- a\n- b\n", b"!!python/object:os.system {}"])
    ),
    st.tuples(st.just("alias bomb"), st.integers(3, 9)),
)


def write_recipe(path: Path, source: Path, edits: list[tuple]) -> list[str]:
    """The recipe ``source`` mutated into ``path``; returns the --set items the edits add."""
    data = yaml.safe_load(source.read_text())
    raw: bytes | None = None
    overrides: list[str] = []
    for what, *args in edits:
        if what == "set":
            section = data.setdefault(args[0], {}) if isinstance(data, dict) else None
            if isinstance(section, dict):
                section[args[1]] = args[2]
            elif isinstance(data, dict):
                data[args[0]] = args[2]
        elif what == "size" and isinstance(data, dict):
            section, key = args[0].split(".")
            if isinstance(data.get(section), dict):
                data[section][key] = args[1]
            else:
                data[section] = {key: args[1]}
        elif what == "section" and isinstance(data, dict):
            data[args[0]] = args[1]
        elif what == "drop" and isinstance(data, dict):
            data.pop(args[0], None)
        elif what == "override":
            overrides.append(args[0])
        elif what == "deep":
            raw = f"task: numbers\nmodel: {_deep(args[0])}\n".encode()
        elif what == "text":
            raw = args[0]
        elif what == "alias bomb":
            lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
            lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, args[0])]
            raw = ("\n".join(lines) + f"\nmodel: {{d_model: *a{args[0] - 1}}}\n").encode()
    if raw is None:
        raw = yaml.safe_dump(data, allow_unicode=True).encode()
    path.write_bytes(raw)
    return overrides


def check_recipe(source: Path, edits: list[tuple]) -> str | None:
    """The property: a mutated recipe (and --set items) loads or is refused in one line naming
    the file or the --set item, through qkv.tasks.load_recipe and through ``qkv train``."""
    from qkv.tasks import load_recipe

    case = Path(tempfile.mkdtemp(dir=_WORK))
    try:
        path = case / "recipe.yaml"
        overrides = write_recipe(path, source, edits)
        names = [str(path), "--set", "recipe"]
        failure = _verdict(lambda: load_recipe(path, overrides), names)
        sets = [x for item in overrides for x in ("--set", item)]
        return failure or _verdict(_cli("train", str(path), "--out", str(case / "out"), "--quiet", *sets), names)
    finally:
        shutil.rmtree(case, ignore_errors=True)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(source=st.sampled_from(RECIPES), edits=st.lists(recipe_edits, min_size=1, max_size=3))
@example(source=ROOT / "recipes" / "numbers.yaml", edits=[("deep", 200_000)])
@example(source=ROOT / "recipes" / "numbers.yaml", edits=[("override", "model.d_model=[[[[[[[[[[[[[[[[[[[")])
@example(source=ROOT / "recipes" / "numbers.yaml", edits=[("alias bomb", 9)])
@example(source=ROOT / "recipes" / "numbers.yaml", edits=[("section", "task", [])])  # found: TypeError
@example(
    source=ROOT / "recipes" / "shakespeare_char_cpu.yaml", edits=[("section", "model", {"\r*'": [None]})]
)  # found: two lines
@example(source=ROOT / "recipes" / "numbers.yaml", edits=[("size", "train.seed", 10**30)])
def test_fuzz_recipes(source, edits):
    assert check_recipe(source, edits) is None


# ----------------------------------------------------------------------------- tokenizer files

TEXTS = ["ab c", "", "zz \u00e9\U0001f600 \x00\r\n", "9" * 2000, "<s> <mask> [UNK]"]


@functools.cache
def tokenizer_bases() -> dict[str, Path]:
    folder = _WORK / "tokenizers"
    words = ["the cat sat", "on the mat 12", "a dog ran , far !"] * 5
    made = {
        "char": Tokenizer.train_char_level([CHARS]),
        "word": Tokenizer.train_word_level(words),
        "subword": Tokenizer.train_subword(words, vocab_size=40),
    }
    paths = {}
    for name, tokenizer in made.items():
        (folder / name).mkdir(parents=True)
        tokenizer.save(folder / name / FILE)
        paths[name] = folder / name / FILE
    (folder / "specials").mkdir()
    shutil.copy(paths["word"], folder / "specials" / FILE)
    roles = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>", "add_special_tokens": True}
    (folder / "specials" / SPECIALS_FILE).write_text(json.dumps(roles))
    paths["specials"] = folder / "specials" / FILE
    return paths


tokenizer_edits = st.one_of(
    st.tuples(
        st.just("set"),
        st.sampled_from(["model", "normalizer", "pre_tokenizer", "decoder", "post_processor", "added_tokens"]),
        st.sampled_from(["type", "vocab", "unk_token", "unk_id", "pattern", "merges", "replacement"])
        | st.text(max_size=6),
        VALUES,
    ),
    st.tuples(
        st.just("top"),
        st.sampled_from(["model", "normalizer", "pre_tokenizer", "decoder", "added_tokens", "padding", "truncation"]),
        VALUES,
    ),
    st.tuples(st.just("model type"), st.sampled_from(["BPE", "WordPiece", "WordLevel", "Unigram", "Nope", "", None])),
    st.tuples(st.just("vocab entry"), st.text(max_size=4), VALUES),
    st.tuples(st.just("drop unk"), st.just(None)),
    st.tuples(st.just("specials"), st.dictionaries(st.text(max_size=6), VALUES, max_size=5) | VALUES),
    st.tuples(st.just("specials text"), st.binary(max_size=30)),
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("text"), st.binary(max_size=40)),
    st.tuples(st.just("deep"), DEPTHS),
)


def edit_tokenizer(path: Path, edit: tuple) -> None:
    what, *args = edit
    specials = path.with_name(SPECIALS_FILE)
    if what == "specials":
        specials.write_text(json.dumps(args[0]))
        return
    if what == "specials text":
        specials.write_bytes(args[0])
        return
    if what == "truncate":
        raw = path.read_bytes()
        path.write_bytes(raw[: int(len(raw) * args[0])])
        return
    if what == "text":
        path.write_bytes(args[0])
        return
    if what == "deep":
        path.write_text('{"model": ' + _deep(args[0]) + "}")
        return
    try:
        spec = json.loads(path.read_text())
        assert isinstance(spec, dict)
    except Exception:
        return
    model = spec.get("model") if isinstance(spec.get("model"), dict) else None
    if what == "set":
        node = spec.get(args[0])
        if isinstance(node, dict):
            node[args[1]] = args[2]
        elif isinstance(node, list) and node and isinstance(node[0], dict):
            node[0][args[1]] = args[2]
        else:
            spec[args[0]] = {args[1]: args[2]}
    elif what == "top":
        spec[args[0]] = args[1]
    elif what == "model type" and model is not None:
        model["type"] = args[0]
    elif what == "vocab entry" and model is not None:
        vocab = model.get("vocab")
        if isinstance(vocab, dict):
            vocab[args[0]] = args[1]
        elif isinstance(vocab, list):
            vocab.append([args[0], args[1]])
    elif what == "drop unk" and model is not None:
        vocab = model.get("vocab")
        if isinstance(vocab, dict):
            vocab.pop("<unk>", None)
        model.pop("unk_id", None)
    path.write_text(json.dumps(spec))


def check_tokenizer(base: str, edits: list[tuple]) -> str | None:
    """The property: a mutated tokenizer file (and special_tokens.json) loads and encodes and
    decodes texts, or is refused in one line naming the file."""
    case = Path(tempfile.mkdtemp(dir=_WORK))
    try:
        source = tokenizer_bases()[base]
        for file in source.parent.iterdir():
            shutil.copy(file, case / file.name)
        path = case / FILE
        for edit in edits:
            edit_tokenizer(path, edit)

        def use() -> None:
            tokenizer = Tokenizer.load(path)
            for ids in tokenizer.encode_batch(TEXTS):
                tokenizer.decode(ids)
            tokenizer.tokens(TEXTS[0])
            tokenizer.decode([tokenizer.vocab_size - 1, 0])

        return _verdict(use, [str(path), str(path.with_name(SPECIALS_FILE))])
    finally:
        shutil.rmtree(case, ignore_errors=True)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    base=st.sampled_from(["char", "word", "subword", "specials"]),
    edits=st.lists(tokenizer_edits, min_size=1, max_size=3),
)
@example(base="char", edits=[("drop unk", None)])
@example(base="word", edits=[("model type", "WordPiece")])
@example(base="char", edits=[("deep", 200_000)])
def test_fuzz_tokenizer_files(base, edits):
    assert check_tokenizer(base, edits) is None


# ----------------------------------------------------------------------------- corpora

PIECES = st.one_of(
    st.text(max_size=20),
    st.binary(max_size=8),
    st.sampled_from([b"\x00", b"\r\n", b"\r", b"\n", b"\t", b" __eou__ ", b"\xff\xfe", b"\xef\xbb\xbf", b"\xc3"]),
    st.sampled_from([b"1 2 3 4", b"0", "\u00b2", "\uff11", "\u0663", "\u2028", "\x85", "a\tb", "x\ty\tz"]),
)
CONTENTS = st.tuples(st.lists(PIECES, max_size=12), st.sampled_from([0, 0, 0, 1 << 20])).map(
    lambda drawn: b"".join(p.encode("utf-8") if isinstance(p, str) else p for p in drawn[0]) + b"y" * drawn[1]
)
READERS = [
    "read_lines",
    "read_text",
    "read_parallel tsv",
    "read_parallel pair",
    "read_labelled",
    "read_dailydialog",
    "read_dailydialog act",
    "read_dailydialog emotion",
    "evaluate --hyp --ref",
]


def check_corpus(reader: str, first: bytes | None, second: bytes | None, tokenize: str) -> str | None:
    """The property: a corpus file of any bytes (None: missing; b"": empty) is read or refused
    in one line naming it (file:line where a line is at fault)."""
    from qkv import data

    case = Path(tempfile.mkdtemp(dir=_WORK))
    try:
        a, b = case / "a.txt", case / "b.txt"
        split = {"read_dailydialog act": "act", "read_dailydialog emotion": "emotion"}.get(reader)
        if reader.startswith("read_dailydialog"):
            a, b = case / "dialogues_train.txt", case / f"dialogues_{split or 'act'}_train.txt"
        for path, content in ((a, first), (b, second)):
            if content is not None:
                path.write_bytes(content)
        calls: dict[str, Callable[[], object]] = {
            "read_lines": lambda: data.read_lines(a),
            "read_text": lambda: data.read_text(a),
            "read_parallel tsv": lambda: data.read_parallel(a),
            "read_parallel pair": lambda: data.read_parallel(a, b),
            "read_labelled": lambda: data.read_labelled(a),
            "read_dailydialog": lambda: data.read_dailydialog(case, "train"),
            "read_dailydialog act": lambda: data.read_dailydialog(case, "train", labels="act"),
            "read_dailydialog emotion": lambda: data.read_dailydialog(case, "train", labels="emotion"),
            "evaluate --hyp --ref": _cli("evaluate", "--hyp", str(a), "--ref", str(b), "--tokenize", tokenize),
        }
        return _verdict(calls[reader], [str(a), str(b), str(case)])
    finally:
        shutil.rmtree(case, ignore_errors=True)


OPTIONAL_CONTENT = st.none() | st.just(b"") | CONTENTS


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    reader=st.sampled_from(READERS),
    first=OPTIONAL_CONTENT,
    second=OPTIONAL_CONTENT,
    tokenize=st.sampled_from(["13a", "zh", "intl", "char", "none", "moses"]),
)
@example(
    reader="read_dailydialog act", first=b"hi __eou__ there __eou__\n", second="1 \u00b2\n".encode(), tokenize="13a"
)
@example(reader="read_lines", first=b"a\x00b\r\n\xff\n", second=None, tokenize="13a")
@example(reader="evaluate --hyp --ref", first=b"x" * (1 << 20), second=b"y" * (1 << 20), tokenize="13a")
def test_fuzz_corpora(reader, first, second, tokenize):
    assert check_corpus(reader, first, second, tokenize) is None


# ----------------------------------------------------------------------------- command lines


@functools.cache
def subcommands() -> dict[str, tuple[list[tuple[list[str], bool]], int]]:
    """Each subcommand's options (their spellings, whether they take a value) and positional count."""
    parser = build_parser()
    choices = next(a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict)).choices
    found = {}
    for name, sub in choices.items():
        options = [(a.option_strings, a.nargs != 0) for a in sub._actions if a.option_strings and a.dest != "help"]
        positionals = sum(1 for a in sub._actions if not a.option_strings)
        found[name] = (options, positionals)
    return found


ARGUMENT_VALUES = st.one_of(
    st.sampled_from(["gpt", "s2s", "bert", "missing", "folder", "lines.txt", "junk.bin", "labels.tsv", "-", ""]),
    st.sampled_from(["out", "out.npy", "out.jsonl", "folder/x.txt", "missing/x.txt", "recipe.yaml"]),
    st.sampled_from(["0", "1", "2", "3", "-1", "0.5", "1e309", "inf", "-inf", "nan", "5000000", "9" * 30]),
    st.sampled_from(["13a", "moses", "mean", "cls", "train.steps=2", "model.d_model=1e9", "x=", "--beam"]),
    st.integers(-(10**20), 10**20).map(str),
    st.text(max_size=12),
)


@st.composite
def command_lines(draw) -> list[str]:
    name = draw(st.sampled_from(sorted(subcommands())))
    options, positionals = subcommands()[name]
    argv = [name] + [draw(ARGUMENT_VALUES) for _ in range(positionals)]
    for spellings, takes_value in draw(st.lists(st.sampled_from(options), max_size=5)) if options else []:
        argv.append(draw(st.sampled_from(spellings)))
        if takes_value:
            argv.append(draw(ARGUMENT_VALUES))
    return argv


def _command_folder(case: Path) -> None:
    """What the command lines' values name, in the case's working directory."""
    for name in ("gpt", "s2s", "bert"):
        _copy_base(name, case / name)
    (case / "folder").mkdir()
    (case / "lines.txt").write_text("ab 1\n\n12,345\nz\n")
    (case / "junk.bin").write_bytes(b"\xff\x00\x80junk")
    (case / "labels.tsv").write_text("ab\tyes\ncd\tno\n")
    shutil.copy(ROOT / "recipes" / "numbers.yaml", case / "recipe.yaml")


def check_command_line(argv: list[str], stdin: bytes) -> str | None:
    """The property: any command line, in a folder holding tiny models and files, succeeds or
    ends with one error line naming an option or a value, status 2."""
    case = Path(tempfile.mkdtemp(dir=_WORK))
    try:
        _command_folder(case)
        names = [a for a in argv if len(a) >= 2] + ["--", "<stdin>", "QKV_", "qkv"]
        return _verdict(_cli(*argv), names, stdin=stdin, cwd=case)
    finally:
        shutil.rmtree(case, ignore_errors=True)


@settings(max_examples=EXAMPLES * 2, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(argv=command_lines(), stdin=st.sampled_from([b"", b"ab 1\n\n12,345\n", b"\xff\xfe\n", b"a" * 5000 + b"\n"]))
@example(argv=["generate", "--model", "gpt", "--seed", "9" * 30], stdin=b"ab\n")
@example(argv=["translate", "--model", "s2s", "--max-len-a", "inf"], stdin=b"ab\n")
@example(argv=["generate", "--model", "s2s", "--beam", "5000000"], stdin=b"ab\n")
@example(argv=["chat", "--model", "gpt", "--seed", "-" + "9" * 30], stdin=b"ab\n")
@example(argv=["demo", "--seed", "9" * 30], stdin=b"")
def test_fuzz_command_lines(argv, stdin):
    assert check_command_line(argv, stdin) is None


# What bench/fuzz.py runs: category -> (strategies of the property's arguments, the property).
CATEGORIES: dict[str, tuple[dict[str, st.SearchStrategy], Callable[..., str | None]]] = {
    "model directories": (
        {"base": st.sampled_from(["gpt", "s2s", "bert"]), "edits": st.lists(model_edits, min_size=1, max_size=3)},
        check_model_directory,
    ),
    "config.json": (
        {"base": st.sampled_from(["gpt", "s2s", "bert"]), "edits": st.lists(config_edits, min_size=1, max_size=3)},
        check_config,
    ),
    "recipes (YAML, --set)": (
        {"source": st.sampled_from(RECIPES), "edits": st.lists(recipe_edits, min_size=1, max_size=3)},
        check_recipe,
    ),
    "tokenizer files": (
        {
            "base": st.sampled_from(["char", "word", "subword", "specials"]),
            "edits": st.lists(tokenizer_edits, min_size=1, max_size=3),
        },
        check_tokenizer,
    ),
    "corpora": (
        {
            "reader": st.sampled_from(READERS),
            "first": OPTIONAL_CONTENT,
            "second": OPTIONAL_CONTENT,
            "tokenize": st.sampled_from(["13a", "zh", "intl", "char", "none", "moses"]),
        },
        check_corpus,
    ),
    "command lines": (
        {"argv": command_lines(), "stdin": st.sampled_from([b"", b"ab 1\n\n12,345\n", b"\xff\xfe\n"])},
        check_command_line,
    ),
}


# ----------------------------------------------------------------------------- resource limits


def test_max_new_tokens_in_the_millions_stops_at_the_window():
    for name, argv in (
        ("gpt", ["generate", "--max-new-tokens", "5000000"]),
        ("s2s", ["generate", "--max-new-tokens", "5000000", "--beam", "3"]),
        ("s2s", ["translate", "--max-len-b", "5000000", "--max-len-a", "1000000"]),
        ("gpt", ["chat", "--max-new-tokens", "5000000"]),
    ):
        outcome = _run(_cli(*argv, "--model", str(bases()[name])), stdin=b"ab 1\n12\n")
        assert outcome.failure is None and outcome.status == 0, (argv, outcome)
        assert outcome.seconds < WORK_S, (argv, outcome.seconds)  # 16 steps at most, not millions
        if argv[0] == "generate":
            assert "outputs stop at the model's window (max_len=16)" in outcome.message, outcome.message


def test_a_sentence_far_longer_than_the_window_is_cut_with_a_note():
    line = ("ab 12 " * 20_000).encode() + b"\n"  # 120,000 characters; the window is 16 tokens
    for name, command in (("s2s", "translate"), ("s2s", "generate"), ("gpt", "generate"), ("bert", "embed")):
        argv = [command, "--model", str(bases()[name])]
        if command == "embed":
            argv += ["--output", str(_WORK / "long.jsonl")]
        outcome = _run(_cli(*argv), stdin=line)
        assert outcome.failure is None and outcome.status == 0, (command, outcome)
        assert "window" in outcome.message and outcome.seconds < WORK_S, (command, outcome)


def test_a_beam_that_would_not_fit_in_memory_is_refused_with_the_number():
    stderr = _cli_stderr("generate", "--model", str(bases()["s2s"]), "--beam", "5000000", stdin=b"ab\n")
    line = _last_error(stderr, "beam 5000000")
    assert "GiB of memory" in line and "available" in line


def test_a_batch_that_would_not_fit_is_decoded_in_parts_with_the_same_outputs(monkeypatch):
    from qkv import decoding as generation
    from qkv.checkpoint import load_model

    model, _ = load_model(bases()["s2s"])
    inputs = [[5 + i % 7, 6, 7 + i % 3][: 1 + i % 3] for i in range(40)]
    caps = generation.check_inputs(model, inputs, max_new_tokens=9)
    one = generation.decoding_bytes(model, inputs=1, beam=4, source=3, steps=9)
    whole = generation.beam_search(model, inputs, beam_size=4, max_new_tokens=9, nbest=2)
    greedy = generation.greedy(model, inputs, max_new_tokens=9)
    calls = []
    real = model.encode  # each part of the search reads its sources once
    monkeypatch.setattr(
        model,
        "encode",
        lambda src, src_mask=None, ragged=False: calls.append(len(src)) or real(src, src_mask=src_mask, ragged=ragged),
    )
    # Room for about 7 inputs at a time: the 40 are decoded in 6 parts.
    monkeypatch.setenv("QKV_MAX_MEMORY", str(int(7.5 * one / generation.DECODING_SHARE)))
    assert generation.inputs_per_batch(model, inputs, caps, beam=4) == 7
    parts = generation.beam_search(model, inputs, beam_size=4, max_new_tokens=9, nbest=2)
    assert [[h.tokens for h in hs] for hs in parts] == [[h.tokens for h in hs] for hs in whole]
    scores = [h.score for hs in parts for h in hs]
    assert scores == pytest.approx([h.score for hs in whole for h in hs], abs=1e-5)  # other padding, same search
    assert calls == [7, 7, 7, 7, 7, 5]
    assert generation.greedy(model, inputs, max_new_tokens=9) == greedy


def test_the_decoding_estimate_grows_with_what_decoding_holds():
    from qkv.checkpoint import skeleton
    from qkv.decoding import decoding_bytes

    gpt2 = skeleton("decoder_only", {"vocab_size": 50257, "d_model": 768, "n_heads": 12, "d_ff": 3072, "n_layers": 12})
    small = decoding_bytes(gpt2, inputs=1, beam=1, source=10, steps=10)
    assert small < 2**24  # a prompt and 10 tokens: megabytes
    # 64 prompts of 512 tokens, beam 5, 512 new tokens: the cache alone is 2·2·12·320·1024·768·4 bytes.
    big = decoding_bytes(gpt2, inputs=64, beam=5, source=512, steps=512)
    assert 2 * 2 * 12 * 320 * 1024 * 768 * 4 < big < 2**36
    assert decoding_bytes(gpt2, inputs=2, beam=5, source=512, steps=512) * 32 == pytest.approx(big, rel=0.05)


def test_a_model_whose_weights_would_not_fit_is_refused_before_allocating(monkeypatch, tmp_path):
    from qkv.checkpoint import build_model

    monkeypatch.setenv("QKV_MAX_MEMORY", "1G")
    fields = {"vocab_size": 10**8, "d_model": 64, "n_heads": 4, "d_ff": 64, "n_layers": 1}
    with pytest.raises(UserError, match=r"needs 23\.8 GiB for its weights alone; 1 GiB of memory is available"):
        build_model("decoder_only", fields)
    # A config that claims more than its file holds is refused by the file's header, before building.
    directory = _copy_base("gpt", tmp_path / "big")
    meta = json.loads((directory / "config.json").read_text())
    meta["config"]["vocab_size"] = 10**9
    (directory / "config.json").write_text(json.dumps(meta))
    start = time.perf_counter()
    with pytest.raises(UserError, match="has shape"):
        load_model(directory)
    assert time.perf_counter() - start < LIMIT_S


def test_training_a_model_that_would_not_fit_is_refused_with_the_number(tmp_path):
    recipe = str(ROOT / "recipes" / "numbers.yaml")
    sets = ["--set", "model.d_model=8192", "--set", "model.n_heads=8", "--set", "model.d_ff=32768"]
    outcome = _run(_cli("train", recipe, "--out", str(tmp_path / "m"), "--quiet", *sets), memory="512M", stubs=False)
    assert outcome.status == 2, outcome
    assert "for its weights alone" in outcome.message and "512 MiB" in outcome.message, outcome.message


def test_qkv_max_memory_must_be_a_size(monkeypatch):
    from qkv.memory import available_memory

    monkeypatch.setenv("QKV_MAX_MEMORY", "12G")
    assert available_memory() <= 12 * 2**30
    monkeypatch.setenv("QKV_MAX_MEMORY", "lots")
    with pytest.raises(UserError, match="QKV_MAX_MEMORY='lots'"):
        available_memory()
