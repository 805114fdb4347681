"""Training never loses work: every task resumes exactly after SIGKILL, SIGTERM and Ctrl-C save a
checkpoint and say how to resume, kills during saves never leave a partial checkpoint, a full
disk leaves the previous checkpoint whole, and a non-finite loss stops (or skips) by name.

Real processes killed for real: ``python -m qkv train`` in a subprocess, then ``--resume``."""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from qkv import runner
from qkv.checkpoint import read_meta
from qkv.errors import UserError
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.runs import load_checkpoint, save_checkpoint
from qkv.tasks import TASKS, load_recipe
from qkv.training import Checkpointing, FitConfig, Trainer, fit
from speech_data import tiny_asr_overrides, tone_corpus

ROOT = Path(__file__).resolve().parents[1]
KILLS_PER_TASK = 3  # 7 cases: 21 kills at random steps, 21 endings equal to the uninterrupted run's
STEPS, SAVE_EVERY = 23, 3  # the runs of _corpus
TINY = ["model.d_model=16", "model.d_ff=32", "model.n_heads=2", "model.dropout=0.1", f"train.save_every={SAVE_EVERY}"]


def _corpus(tmp: Path) -> dict[str, list[str]]:
    """Tiny data of each task, written to ``tmp``, and the recipe overrides that read it."""
    rng = random.Random(7)
    words = "the a dog cat runs sleeps red big small house tree sees".split()
    sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 7))) for _ in range(211)]
    (tmp / "text.txt").write_text("\n".join(sentences) + "\n")
    (tmp / "labels.tsv").write_text("".join(f"{s}\t{'dog' if 'dog' in s else 'other'}\n" for s in sentences))
    tones = tone_corpus(tmp / "tones", utterances=6)
    return {
        "numbers": ["task=numbers", *TINY, f"train.steps={STEPS}", "train.batch_size=8", "data.eval_examples=5"],
        # gradient accumulation and a moving average of the weights, both resumed exactly
        "numbers_accumulate_ema": ["task=numbers", *TINY, f"train.steps={STEPS}", "train.batch_size=8",
                                   "data.eval_examples=5", "train.accumulate=3", "train.ema_decay=0.9"],
        "lm": ["task=lm", *TINY, f"data.text={tmp / 'text.txt'}", "model.n_layers=1", "model.max_len=16",
               f"train.steps={STEPS}", "train.batch_size=4"],
        "mlm": ["task=mlm", *TINY, "data.dailydialog=null", f"data.sentences={tmp / 'text.txt'}", "data.vocab_size=40",
                "model.n_layers=1", "model.max_len=16", f"train.steps={STEPS}", "train.batch_size=8"],
        "classify": ["task=classify", *TINY, "data.dailydialog=null", f"data.train_tsv={tmp / 'labels.tsv'}",
                     "data.vocab_size=40", "model.n_layers=1", "model.max_len=16", f"train.steps={STEPS}",
                     "train.batch_size=8"],
        "asr": [*tiny_asr_overrides(tones), *TINY, "model.n_encoder_layers=1", f"train.steps={STEPS}",
                "train.batch_frames=200", "train.spec_augment=true", "data.test_limit=2"],
        "tts": ["task=tts", "data.corpus=manifests", f"data.train={tones}", f"data.test={tones}", *TINY,
                "model.n_encoder_layers=1", "model.n_decoder_layers=1", "model.prenet_dim=8", "model.postnet_layers=2",
                "model.postnet_channels=4", "model.max_len=40", "model.features.n_mels=23", f"train.steps={STEPS}",
                "train.batch_frames=200", "data.test_sentences=1"],
    }  # fmt: skip


def _recipe(out: Path, overrides: list[str]) -> Path:
    """A recipe file naming only the task (the overrides say the rest), beside ``out``."""
    task = next(o.split("=", 1)[1] for o in overrides if o.startswith("task="))
    path = out.parent / f"{task}.yaml"
    path.write_text(f"task: {task}\n")
    return path


def _argv(out: Path, overrides: list[str], *extra: str) -> list[str]:
    sets = [item for o in overrides if not o.startswith("task=") for item in ("--set", o)]
    return [sys.executable, "-m", "qkv", "train", str(_recipe(out, overrides)), "--out", str(out), "--quiet",
            *sets, *extra]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "QKV_MALLOC": "default", "PYTHONPATH": str(ROOT / "src")}


def _wait_for(path: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"the run ended before {path} appeared: {process.stderr.read()}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _checkpoint_steps(last: Path) -> int | None:
    """The steps the checkpoint ``last`` holds (None where there is none: before the first save,
    or for the moment between a save's two renames)."""
    try:
        return json.loads((last / "trainer.json").read_text())["progress"]["steps"]
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def _resumable_steps(out: Path) -> int | None:
    """The steps of the checkpoint --resume continues a killed run from: ``last``, or the previous
    one a kill between a save's two renames left as ``.last.old`` (in ``out``, or in the run folder
    the final save had moved aside), as ``recipes.start_run`` finds them."""
    aside = out.with_name(f".{out.name}.old")
    for last in (out / "last", out / ".last.old", aside / "last", aside / ".last.old"):
        if (steps := _checkpoint_steps(last)) is not None:
            return steps
    return None


def _killed_mid_run(out: Path, overrides: list[str], rng: random.Random) -> int | None:
    """Start a run and SIGKILL it at a random moment after a checkpoint of a random step, then
    return the steps its checkpoint holds. A kill that came after the run finished (a fast
    machine) is tried again, at the first checkpoint, without waiting."""
    for target, pause in ((rng.choice(range(SAVE_EVERY, STEPS, SAVE_EVERY)), rng.uniform(0, 0.1)), (1, 0.0)):
        shutil.rmtree(out, ignore_errors=True)
        process = subprocess.Popen(_argv(out, overrides), env=_env(), stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while (_checkpoint_steps(out / "last") or 0) < target and process.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.005)
        time.sleep(pause)  # mid-step or mid-save
        process.kill()
        _, err = process.communicate()
        assert process.returncode in (-signal.SIGKILL, 0), err  # killed, or it had finished
        if not (out / "config.json").exists():  # unfinished: the kill landed mid-run
            return _resumable_steps(out)
    pytest.fail("every kill came after the run had finished: nothing was interrupted")


# Two tasks in the default run (one text, one speech: the checkpoint and resume code is shared); the
# others, 10-37 s each, run with `pytest -m slow` (the suite's 10-minute budget).
@pytest.mark.parametrize(
    "case",
    [
        "numbers",
        *(
            pytest.param(c, marks=pytest.mark.slow)
            for c in ("tts", "numbers_accumulate_ema", "lm", "mlm", "classify", "asr")
        ),
    ],
)
def test_sigkill_at_random_steps_then_resume_ends_identically(tmp_path, case):
    """Each kill lands mid-run (a checkpoint, no finished model), the resumed run takes only the
    steps after its checkpoint's (optimizer steps counted), and it ends as the uninterrupted run."""
    overrides = _corpus(tmp_path)[case]
    recipe = load_recipe(None, overrides)
    task = recipe.task
    taken = []
    counting = register_optimizer_step_post_hook(lambda *_: taken.append(1))
    try:
        reference = runner.train(TASKS[task], recipe, tmp_path / "reference", progress=False)
        assert len(taken) == STEPS  # the count counts the steps
        rng = random.Random(case)
        for kill in range(KILLS_PER_TASK):
            out = tmp_path / f"run{kill}"
            saved = _killed_mid_run(out, overrides, rng)
            assert saved is not None and 0 < saved < STEPS and saved % SAVE_EVERY == 0, saved
            taken.clear()
            resumed = runner.train(TASKS[task], recipe, out, progress=False, resume=True)
            assert len(taken) == STEPS - saved, f"kill {kill}: resumed from step {saved}, took {len(taken)} steps"
            assert resumed["losses"] == reference["losses"], f"kill {kill}: the loss log differs"
            assert _same(resumed["model"], reference["model"]), f"kill {kill}: the weights differ"
            assert not (out / "last").exists()  # the finished model directory replaced the checkpoint
            assert read_meta(out)["kind"] == read_meta(tmp_path / "reference")["kind"]
    finally:
        counting.remove()


def test_sigterm_saves_says_how_to_resume_and_resume_ends_identically(tmp_path):
    overrides = [*_corpus(tmp_path)["numbers"], "train.steps=500", "train.save_every=100"]
    recipe = load_recipe(None, overrides)
    out = tmp_path / "run"
    process = subprocess.Popen(_argv(out, overrides, "--json"), env=_env(), stderr=subprocess.PIPE, text=True,
                               stdout=subprocess.PIPE)  # fmt: skip
    _wait_for(out / "last" / "trainer.json", process)  # training is under way (step 100), however fast the machine
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "stopped by SIGTERM after step" in lines[-1] and "--resume" in lines[-1], err
    assert "Traceback" not in err
    steps = json.loads((out / "last" / "trainer.json").read_text())["progress"]["steps"]
    assert 100 <= steps < 500
    resumed = runner.train(TASKS["numbers"], recipe, out, progress=False, resume=True)
    reference = runner.train(TASKS["numbers"], recipe, tmp_path / "reference", progress=False)
    assert resumed["losses"] == reference["losses"] and _same(resumed["model"], reference["model"])


def test_second_ctrl_c_stops_at_once_without_corrupting(tmp_path):
    overrides = [*_corpus(tmp_path)["numbers"], "train.steps=100000", "train.save_every=5"]
    out = tmp_path / "run"
    process = subprocess.Popen(_argv(out, overrides), env=_env(), stderr=subprocess.PIPE, text=True)
    _wait_for(out / "last" / "trainer.json", process)
    process.send_signal(signal.SIGINT)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    read_meta(out / "last")  # whole: every file matches its recorded SHA-256


def test_kills_during_saves_never_leave_a_partial_checkpoint(tmp_path):
    """80 SIGKILLs at random moments while a child process saves checkpoints in a loop: after
    each, the checkpoint loads whole, and is the previous one or the new one."""
    model = _tiny_gpt()
    trainer = Trainer(model, lr=0.1, warmup=1, total_steps=10)
    last = tmp_path / "last"
    with torch.no_grad():  # version 0's weights too say which save they are (a kill may land before any other)
        next(model.parameters()).fill_(0)
    began = time.perf_counter()
    save_checkpoint(model, last, files={}, extra={"version": 0}, trainer=trainer, progress={"version": 0})
    one_save = time.perf_counter() - began
    rng = random.Random(0)
    versions = set()
    for kill in range(80):
        # The child says when each save has finished; the parent waits for 0-2 of them, then kills at
        # a random moment of the next save (or the one after): timed from the child's own progress,
        # so a loaded machine (slow fork, slow saves) moves the kills with it instead of before them.
        done_before_kill = kill % 3
        ready, said = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: save new versions until killed
            try:
                os.close(ready)
                os.write(said, b"s")  # started
                for version in range(kill * 1000 + 1, kill * 1000 + 1000):
                    with torch.no_grad():
                        next(model.parameters()).fill_(version)
                    save_checkpoint(
                        model,
                        last,
                        files={},
                        extra={"version": version},
                        trainer=trainer,
                        progress={"version": version},
                    )
                    os.write(said, b".")
            finally:
                os._exit(0)
        os.close(said)
        for _ in range(1 + done_before_kill):
            assert os.read(ready, 1)
        time.sleep(rng.uniform(0, 2 * one_save))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready)
        if not last.exists():  # killed between the two renames: the previous one waits as .last.old
            os.replace(tmp_path / ".last.old", last)
        loaded = _tiny_gpt()
        version = load_checkpoint(last, Trainer(loaded, lr=0.1, warmup=1, total_steps=10))["version"]
        # The weights, the training state and the config of one and the same save:
        assert read_meta(last)["version"] == version
        assert torch.all(next(loaded.parameters()) == version)
        # Never older than the last save the child finished; never one it had not begun.
        latest_done = kill * 1000 + done_before_kill if done_before_kill else max(versions, default=0)
        assert latest_done <= version <= kill * 1000 + 999
        versions.add(version)
    # The kills landed at many different moments: every kill after a finished save reads a version
    # of its own, and the kills before one read the previous or the new.
    assert len(versions) > 50
    # The trainer's state is staged beside the checkpoint (not in /tmp): what killed saves left
    # of it, the next save removes.
    save_checkpoint(model, last, files={}, extra={"version": -1}, trainer=trainer, progress={"version": -1})
    assert not (tmp_path / ".last.state").exists() and read_meta(last)["version"] == -1
    assert all(p.name == "last" or p.name.startswith(".last.") for p in tmp_path.iterdir())


def _tiny_gpt() -> DecoderOnly:
    return DecoderOnly(DecoderOnlyConfig(vocab_size=37, d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=8))


def _fsize_limit(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE as on Linux")
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    overrides = [*_corpus(tmp_path)["numbers"], "train.steps=400", "train.save_every=2"]
    out = tmp_path / "run"
    # First a run stopped after some checkpoints; then a resumed run that cannot write a file
    # as large as a checkpoint's (a file-size limit: real writes failing for real).
    process = subprocess.Popen(_argv(out, overrides), env=_env(), stderr=subprocess.PIPE, text=True)
    _wait_for(out / "last" / "trainer.json", process)
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)
    before = json.loads((out / "last" / "trainer.json").read_text())["progress"]["steps"]
    result = subprocess.run(_argv(out, overrides, "--resume"), env=_env(), capture_output=True, text=True,
                            timeout=120, preexec_fn=_fsize_limit(8192), check=False)  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot write" in lines[0] and "intact" in lines[0], result.stderr
    read_meta(out / "last")
    assert json.loads((out / "last" / "trainer.json").read_text())["progress"]["steps"] == before


class _Exploding(nn.Module):
    """A model whose middle layer overflows on the step ``bad``."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.first, self.middle, self.last = nn.Linear(3, 5), nn.Linear(5, 5), nn.Linear(5, 2)
        self.bad, self.step = bad, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.step == self.bad:
            h = h * float("inf")
        return self.last(self.middle(h))


def _loss(model: _Exploding, step: int) -> tuple[torch.Tensor, int]:
    model.step = step
    return model(torch.ones(2, 3)).pow(2).mean(), 2


def test_nonfinite_loss_stops_naming_step_module_and_last_checkpoint(tmp_path):
    model = _Exploding(bad=7)
    saved = []

    def save(trainer, result):
        saved.append(result.steps)
        return str(tmp_path / f"checkpoint-{result.steps}")

    with pytest.raises(UserError) as error:
        fit(
            model,
            _loss,
            FitConfig(steps=20, lr=0.01, warmup=1),
            progress=False,
            checkpoint=Checkpointing(save=save, every=3),
        )
    message = str(error.value)
    assert message.startswith("step 8: the ") and "first non-finite output: middle" in message
    assert "the last checkpoint: " + str(tmp_path / "checkpoint-6") in message
    assert "train.on_nonfinite=skip" in message


def test_nonfinite_step_skipped_leaves_the_weights_as_they_were():
    model = _Exploding(bad=4)
    before = {}

    def loss(m, step):
        if step == 4:
            before.update({k: v.clone() for k, v in m.state_dict().items()})
        return _loss(m, step)

    weights_after = {}
    real_step = Trainer.step

    def step(self, batches):
        out = real_step(self, batches)
        if self.steps == 5:
            weights_after.update({k: v.clone() for k, v in self.model.state_dict().items()})
        return out

    Trainer.step = step
    try:
        result = fit(model, loss, FitConfig(steps=9, lr=0.01, warmup=1, on_nonfinite="skip"), progress=False)
    finally:
        Trainer.step = real_step
    assert result.steps == 9 and not torch.isfinite(torch.tensor(result.losses[4]))
    assert all(torch.equal(before[k], weights_after[k]) for k in before)  # the bad step changed nothing
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_resume_refuses_a_changed_recipe_and_a_fresh_run_refuses_an_unfinished_one(tmp_path):
    overrides = _corpus(tmp_path)["numbers"]
    out = tmp_path / "run"
    process = subprocess.Popen(_argv(out, [*overrides, "train.steps=100000"]), env=_env(), stderr=subprocess.PIPE,
                               text=True)  # fmt: skip
    _wait_for(out / "last" / "trainer.json", process)
    process.kill()
    process.wait()
    recipe = load_recipe(None, [*overrides, "train.steps=100000", "train.lr=0.5"])
    with pytest.raises(UserError, match=r"--resume: the recipe differs .* in train\.lr"):
        runner.train(TASKS["numbers"], recipe, out, progress=False, resume=True)
    with pytest.raises(UserError, match=r"unfinished run .*--resume"):
        runner.train(TASKS["numbers"], recipe, out, progress=False)
    with pytest.raises(UserError, match="holds no unfinished run"):
        runner.train(TASKS["numbers"], recipe, tmp_path / "nothing", progress=False, resume=True)
