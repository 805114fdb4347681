"""Progress reports: a bar on a terminal; sparse plain lines in a log, never carriage-return frames."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from tqdm import tqdm

from qkv.errors import UserError
from qkv.progress import Lines, progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_every_percent_and_at_close():
    out, clock = io.StringIO(), Clock()
    bar = Lines(97, desc="qkv x", unit="step", every_seconds=1e9, every_percent=25, stream=out, clock=clock)
    for _ in range(97):
        clock.now += 0.5
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    # Each 25% crossed prints once (at steps 25, 49, 73, 97); close adds nothing after the last line.
    assert [line.split(": ")[1].split(" ")[0] for line in lines] == ["25/97", "49/97", "73/97", "97/97"]
    assert "\r" not in out.getvalue() and all(line.startswith("qkv x: ") for line in lines)
    assert "97/97 steps" in lines[-1] and "2 step/s" in lines[-1]


def test_lines_every_seconds_with_postfix_and_eta():
    out, clock = io.StringIO(), Clock()
    bar = Lines(1009, desc="qkv y", unit="step", every_seconds=30, every_percent=100, stream=out, clock=clock)
    for _ in range(200):
        clock.now += 1.0
        bar.update(1)
        bar.set_postfix({"loss": "1.234"}, lr="3e-4")
    lines = out.getvalue().splitlines()
    assert len(lines) == 6  # at 30, 60, ..., 180 s
    assert lines[0].endswith("; loss=1.234, lr=3e-4") and "0:30 elapsed" in lines[0] and "left" in lines[0]
    bar.close()  # the last state, not printed yet
    assert len(out.getvalue().splitlines()) == 7 and "200/1009" in out.getvalue().splitlines()[-1]


def test_terminal_gets_a_bar_and_a_log_gets_lines(monkeypatch):
    monkeypatch.delenv("QKV_PROGRESS", raising=False)
    assert isinstance(progress(5, desc="d", unit="u", stream=Terminal()), tqdm)
    assert isinstance(progress(5, desc="d", unit="u", stream=io.StringIO()), Lines)
    monkeypatch.setenv("QKV_PROGRESS", "lines")
    assert isinstance(progress(5, desc="d", unit="u", stream=Terminal()), Lines)
    monkeypatch.setenv("QKV_PROGRESS", "bar")
    assert isinstance(progress(5, desc="d", unit="u", stream=io.StringIO()), tqdm)
    disabled = progress(5, desc="d", unit="u", disable=True, stream=io.StringIO())
    assert isinstance(disabled, tqdm) and disabled.disable


@pytest.mark.parametrize(
    ("name", "value"), [("QKV_PROGRESS", "fancy"), ("QKV_PROGRESS_SECONDS", "0"), ("QKV_PROGRESS_PERCENT", "ten")]
)
def test_bad_settings_named(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match=name):
        progress(5, desc="d", unit="u", stream=io.StringIO())


def test_training_log_off_terminal_is_a_few_plain_lines(tmp_path):
    log = tmp_path / "train.log"
    argv = [
        sys.executable,
        "-m",
        "qkv",
        "train",
        "recipes/numbers.yaml",
        "--out",
        str(tmp_path / "m"),
        "--set",
        "train.steps=31",
        "--set",
        "train.batch_size=8",
        "--set",
        "model.d_model=16",
        "--set",
        "model.d_ff=32",
        "--set",
        "model.n_heads=2",
        "--set",
        "data.eval_examples=11",
    ]
    with log.open("w") as err:
        result = subprocess.run(
            argv,
            stderr=err,
            stdout=subprocess.PIPE,
            text=True,
            timeout=300,
            check=False,
            # percent lines only: how many time-based lines a busy machine adds is not the question
            env={"QKV_MALLOC": "default", "PATH": "/usr/bin:/bin", "QKV_PROGRESS_SECONDS": "1e6"},
        )
    assert result.returncode == 0, log.read_text()[-2000:]
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith("qkv numbers: ")]
    assert "\r" not in text
    assert len(lines) == 10 and "31/31 steps (100%)" in lines[-1]  # one per 10%
    assert "trained 31 steps" in result.stdout  # the one-line summary
