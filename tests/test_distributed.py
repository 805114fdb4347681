"""Training on several processes (torch.distributed, gloo on this CPU, 2 workers started by
torchrun): one step on 2 workers is one step on the whole batch for every model family (speech and
TTS included), under DDP and FSDP, and the speech tasks train on 2 workers as on one; a 2-worker
run killed with SIGKILL resumes to the uninterrupted run's weights, also on
another number of workers; torchrun's --max-restarts continues after a worker is killed; and the
workers agree on validation and early stopping.

Real processes: ``python -m torch.distributed.run`` and ``python -m qkv train --nproc 2``,
killed for real."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from distributed_cases import FAMILIES, ROWS, SETTINGS, case
from qkv import distributed
from qkv.checkpoint import load_model, read_meta
from qkv.training import Trainer
from test_translation import _overrides as translation_overrides

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 180
NUMBERS = ["model.d_model=16", "model.d_ff=32", "model.n_heads=2", "model.dropout=0.1", "train.steps=40",
           "train.batch_size=9", "data.eval_examples=5", "train.save_every=4", "train.warmup=5"]  # fmt: skip


def _env() -> dict[str, str]:
    # PYTHONFAULTHANDLER: a worker that aborts (SIGABRT, seen rarely in CI) prints where each thread was.
    env = {"QKV_MALLOC": "default", "PYTHONFAULTHANDLER": "1", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}"}
    return {**os.environ, **env}


def _train(out: Path, sets: list[str], *extra: str, task: str = "numbers") -> list[str]:
    recipe = out.parent / f"{task}.yaml"
    recipe.write_text(f"task: {task}\n")
    return [sys.executable, "-m", "qkv", "train", str(recipe), "--out", str(out), "--quiet",
            *[x for s in sets for x in ("--set", s)], *extra]  # fmt: skip


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)


def _children(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        below = [p for p, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def _wait_for_checkpoint(out: Path, process: subprocess.Popen, at_least: int) -> None:
    """Until OUT/last holds a checkpoint of at least ``at_least`` steps."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        try:
            if json.loads((out / "last" / "trainer.json").read_text())["trainer"]["steps"] >= at_least:
                return
        except (OSError, ValueError, KeyError):
            pass
        assert process.poll() is None, (out.parent / f"{out.name}.log").read_text()[-3000:]
        time.sleep(0.05)
    raise AssertionError("no checkpoint in time")


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    model, _ = load_model(directory)
    return model.state_dict()


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_without_torchrun_nothing_is_distributed() -> None:
    """One process: no group, every row is this worker's, sums are the values themselves."""
    assert distributed.world() == distributed.World(0, 1, 0) and distributed.world().main
    assert distributed.start({"WORLD_SIZE": "1"}) == distributed.World()
    assert distributed.share(5) == ([0, 1, 2, 3, 4], True)
    assert distributed.all_sum([2.0, 3.5]) == [2.0, 3.5] and distributed.all_max([1.0]) == [1.0]
    assert distributed.sharded_map(lambda xs: [x * 2 for x in xs], [1, 2, 3]) == [2, 4, 6]
    model, _ = case("decoder_only")
    assert distributed.wrap(model, "fsdp") is model and distributed.plain_copy(model) is model
    assert not distributed.restarted({}) and distributed.restarted({distributed.RESTART_COUNT: "1"})


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_one_step_on_two_workers_equals_one_process_on_the_whole_batch(tmp_path, parallel) -> None:
    """For each family: the weights after one AdamW step on 2 workers (4 and 3 rows of a 7-row
    batch) equal one process's step on all 7 rows within 1e-6, and so does the loss."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            str(ROOT / "tests" / "distributed_cases.py"), parallel, str(tmp_path)]  # fmt: skip
    done = _run(argv)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = json.loads((tmp_path / "losses.json").read_text())
    for family in FAMILIES:
        model, loss = case(family)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        value, _ = Trainer(model, **SETTINGS).step([lambda model=model, loss=loss: loss(model, list(range(ROWS)))])
        after = model.state_dict()
        assert _max_difference(after, before) > 1e-3  # the step moved the weights: the comparison means something
        assert _max_difference(load_file(tmp_path / f"{family}.safetensors"), after) <= 1e-6, family
        assert abs(losses[family] - value) <= 1e-6, family


def _kill_when_saved(argv: list[str], out: Path, at_least: int, *, only_rank: int | None = None) -> subprocess.Popen:
    """Start ``argv``; once OUT/last has ``at_least`` steps, SIGKILL every process of the run
    (launcher and workers) or, with ``only_rank``, that worker alone. Returns the process."""
    with open(out.parent / f"{out.name}.log", "w") as log:  # the process keeps its own copy of the file
        process = subprocess.Popen(argv, env=_env(), stdout=log, stderr=subprocess.STDOUT, text=True)
    _wait_for_checkpoint(out, process, at_least)
    workers = _children(process.pid)
    if only_rank is None:
        for pid in [process.pid, *workers]:
            os.kill(pid, signal.SIGKILL)
    else:
        (victim,) = [pid for pid in workers if _rank_of(pid) == only_rank]
        os.kill(victim, signal.SIGKILL)
    return process


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 2-worker numbers run."""
    out = tmp_path_factory.mktemp("reference") / "run"
    done = _run(_train(out, NUMBERS, "--nproc", "2"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_meta(out)["recipe"]["train"]["steps"] == 40
    return out


@pytest.mark.slow  # ~30 s each (real workers killed and resumed): `pytest -m slow`
def test_two_workers_killed_resume_exactly_and_on_another_number_of_workers(tmp_path, reference) -> None:
    """SIGKILL of a 2-worker run, --resume on 2 workers: the uninterrupted run's weights exactly.
    Killed again and resumed on 1 worker: the same data order continues (the same steps), equal
    within floating-point order."""
    killed = tmp_path / "killed"
    process = _kill_when_saved(_train(killed, NUMBERS, "--nproc", "2"), killed, at_least=8)
    process.wait(timeout=TIMEOUT)
    assert (killed / "last").is_dir() and not (killed / "model.safetensors").exists()
    done = _run(_train(killed, NUMBERS, "--nproc", "2", "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert _max_difference(_weights(killed), _weights(reference)) == 0.0

    # Without dropout (whose draws depend on how rows fall to workers) and biases (a key bias's
    # true gradient is zero, so AdamW moves it by ±lr on rounding noise: distributed_cases.py),
    # 2 workers then 1 is the uninterrupted 2-worker run up to floating-point order.
    sets = [*NUMBERS, "model.dropout=0.0", "model.bias=false"]
    uninterrupted = _run(_train(tmp_path / "two", sets, "--nproc", "2"))
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    other = tmp_path / "other"
    process = _kill_when_saved(_train(other, sets, "--nproc", "2"), other, at_least=8)
    process.wait(timeout=TIMEOUT)
    done = _run(_train(other, sets, "--resume", "--json"))  # one process now
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1])["steps"] == 40
    assert _max_difference(_weights(other), _weights(tmp_path / "two")) <= 1e-4


def test_a_killed_worker_is_restarted_by_torchrun_and_training_continues(tmp_path, reference) -> None:
    """--max-restarts 1: rank 1 killed after a checkpoint; torchrun restarts the group, which
    continues from that checkpoint (exact resume: the uninterrupted run's weights)."""
    out = tmp_path / "restarted"
    process = _kill_when_saved(_train(out, NUMBERS, "--nproc", "2", "--max-restarts", "1"), out, 8, only_rank=1)
    try:
        process.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:  # a hung restart: leave no worker behind, say what it printed
        for pid in [*_children(process.pid), process.pid]:
            os.kill(pid, signal.SIGKILL)
        raise AssertionError((tmp_path / "restarted.log").read_text()[-3000:]) from None
    assert process.returncode == 0, (tmp_path / "restarted.log").read_text()[-3000:]
    assert _max_difference(_weights(out), _weights(reference)) == 0.0


def test_workers_agree_on_validation_and_stop_at_the_same_epoch(tmp_path) -> None:
    """Translation on 2 workers: each decodes half the validation set, all score the same list,
    so early stopping ends every worker at the same epoch (a disagreement would hang or fail)."""
    sets = [*translation_overrides(tmp_path, epochs=6), "train.patience=1", "train.lr=0.002"]
    run = tmp_path / "run"
    done = _run(_train(run, sets, "--nproc", "2", task="translation"))
    assert done.returncode == 0, done.stderr[-3000:]
    meta = json.loads((run / "run.json").read_text())
    assert len(meta["history"]) >= 1 and meta["stopped_by"] in ("patience", "epochs")
    assert all(0.0 <= h["valid_bleu"] <= 100.0 for h in meta["history"])


def test_user_mistakes_with_workers_get_one_line(tmp_path) -> None:
    """--nproc 0, more workers than the machine has cores (or GPUs), an unknown train.parallel or
    train.device, and train.device cuda without a GPU are refused in one line, exit 2, before
    any worker starts or any data is read."""
    for extra, sets, said in (
        (["--nproc", "0"], NUMBERS, "--nproc must be a positive integer"),
        (["--nproc", "4096"], NUMBERS, "--nproc 4096: this machine has"),
        (["--nproc", "2"], [*NUMBERS, "train.parallel=zero"], "train.parallel must be one of ddp, fsdp"),
        ([], [*NUMBERS, "train.device=tpu"], "train.device must be one of auto, cpu, cuda"),
    ):
        done = _run(_train(tmp_path / "x", sets, *extra))
        assert done.returncode == 2 and said in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    if not torch.cuda.is_available():
        done = _run(_train(tmp_path / "x", [*NUMBERS, "train.device=cuda"]))
        assert done.returncode == 2 and "train.device is cuda, but this torch sees no CUDA GPU" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


@pytest.mark.slow  # ~30 s each (real workers killed and resumed): `pytest -m slow`
def test_fsdp_checkpoints_are_sharded_and_resume_on_any_number_of_workers(tmp_path) -> None:
    """Under FSDP every worker writes its own shards (torch.distributed.checkpoint, safetensors):
    last/ holds one file per worker and no whole model.safetensors, and load_model reads it as an
    ordinary model (the conversion: equal to the weights gathered at the end). A 2-worker FSDP run
    killed with SIGKILL resumes on 2 FSDP workers to the uninterrupted run's weights exactly, and
    on one process without FSDP within 1e-4."""
    # with a moving average of the weights (train.ema_decay): sharded and resumed as the moments are
    sets = [*NUMBERS, "model.dropout=0.0", "model.bias=false", "train.ema_decay=0.9", "train.parallel=fsdp"]
    reference = tmp_path / "fsdp"
    done = _run(_train(reference, sets, "--nproc", "2"))
    assert done.returncode == 0, done.stderr[-3000:]

    out = tmp_path / "killed"
    process = _kill_when_saved(_train(out, sets, "--nproc", "2"), out, at_least=8)
    process.wait(timeout=TIMEOUT)
    last = out / "last"
    shards = sorted(last.glob("*.safetensors"))
    assert [p.name for p in shards] == [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)]
    assert read_meta(last)["sharded"] == 2
    # The conversion against the files themselves: each worker's rows of every weight, put
    # where the header's offsets say, make the whole tensors load_model returns.
    whole = _weights(last)
    assembled = {name: torch.full_like(t, float("nan")) for name, t in whole.items()}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            offsets = json.loads(f.metadata()["DCP_SHARDING_INFO"])
            for key in f.keys():
                name = key.removeprefix("model.")
                if key.startswith("model.") and name in assembled:
                    piece = f.get_tensor(key)
                    start = offsets[key]["saved_offsets"][0] if piece.dim() else 0
                    assembled[name][start : start + len(piece)] = piece
    stored = {name for name in whole if not torch.isnan(assembled[name]).any()}
    assert _max_difference({k: whole[k] for k in stored}, {k: assembled[k] for k in stored}) == 0.0
    for name in set(whole) - stored:  # tied weights are stored once, under the first name
        assert any(torch.equal(whole[name], assembled[k]) for k in stored), name
    shutil.copytree(out, tmp_path / "copy")
    done = _run(_train(out, sets, "--nproc", "2", "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert _max_difference(_weights(out), _weights(reference)) == 0.0
    one = tmp_path / "copy"
    done = _run(_train(one, [*sets[:-1], "train.parallel=ddp"], "--resume"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert _max_difference(_weights(one), _weights(reference)) <= 1e-4


@pytest.mark.parametrize("task", ["asr", pytest.param("tts", marks=pytest.mark.slow)])  # both share the speech path
def test_speech_and_tts_tasks_train_on_two_workers_as_on_one(tmp_path, task) -> None:
    """qkv train --nproc 2 on the speech tasks themselves (their step losses: each worker's
    share of a batch, its part of the whole batch's loss): a few steps end with one process's
    weights, up to floating-point order. No dropout or SpecAugment, whose draws depend on how
    rows fall to workers; no biases (a key bias's zero gradient, distributed_cases.py)."""
    from speech_data import tiny_asr_overrides, tone_corpus
    from test_tts_task import TINY_TTS

    manifest = tone_corpus(tmp_path / "tones", utterances=7)
    if task == "asr":
        sets = [*tiny_asr_overrides(manifest), "model.key_bias=false", "data.test_limit=1"]
    else:
        sets = [*TINY_TTS, f"data.train={manifest}", f"data.test={manifest}", "model.prenet_dropout=0.0"]
        sets += ["data.test_sentences=1"]
    sets = [s for s in sets if not s.startswith(("task=", "train.steps="))]
    sets += ["train.steps=4", "model.dropout=0.0", "model.bias=false", "train.batch_frames=100000"]
    one, two = tmp_path / "one", tmp_path / "two"
    for out, extra in ((one, []), (two, ["--nproc", "2"])):
        done = _run(_train(out, sets, *extra, task=task))
        assert done.returncode == 0, done.stderr[-3000:]
    assert _max_difference(_weights(two), _weights(one)) <= 1e-4
