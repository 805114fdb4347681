"""The Python examples of the README and the guides in docs/ must run as written."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
# An example that talks to a running `qkv serve` says, in a comment just above it, which test
# runs the same calls against a real server: <!-- against a server: tests/test_x.py -->
SERVED = re.compile(r"<!-- against a server: (tests/[\w.]+) -->\n```python\n(.*?)```", re.S)
EXAMPLES = [
    (f"{page.relative_to(ROOT).as_posix()}#{i}", code)
    for page in PAGES
    for i, code in enumerate(BLOCK.findall(page.read_text(encoding="utf-8")), 1)
]
AGAINST_A_SERVER = {code: test for page in PAGES for test, code in SERVED.findall(page.read_text(encoding="utf-8"))}


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    # bench/ on the path as it is for a script in bench/ (the benchmark-record example imports record)
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": path},
    )


def demo_model(directory: Path) -> Path:
    """A tiny numbers model (random weights, the demo's kind of tokenizer) saved where
    ``bash scripts/demo.sh`` saves its own: ``directory/qkv-demo/model``."""
    import torch

    from qkv.checkpoint import save_model
    from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
    from qkv.tasks.numbers import numbers_pairs
    from qkv.tokenization import Tokenizer

    tokenizer = Tokenizer.train_word_level(text for pair in numbers_pairs(500, seed=0, held_out=False) for text in pair)
    v = tokenizer.vocab_size
    specials = {"pad_id": tokenizer.pad_id, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
    torch.manual_seed(0)
    model = EncoderDecoder(
        EncoderDecoderConfig(
            src_vocab_size=v, tgt_vocab_size=v, d_model=15, n_heads=3, d_ff=7, n_encoder_layers=1,
            n_decoder_layers=1, max_len=23, **specials,
        )
    )  # fmt: skip
    tokenizer.save(directory / "tokenizer.json")
    return save_model(model, directory / "qkv-demo" / "model", files={"tokenizer.json": directory / "tokenizer.json"})


def test_readme_python_example_runs(tmp_path):
    """The README's first Python example, as written, on a model where the demo saves its own:
    it prints one text per number."""
    match = BLOCK.search(README.read_text(encoding="utf-8"))
    assert match, "README.md has no ```python block"
    code = match.group(1)
    assert 'qkv.load("qkv-demo/model")' in code and "import qkv" in code
    demo_model(tmp_path)
    result = _run(code, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = ast.literal_eval(result.stdout.strip())
    numbers = ast.literal_eval(re.search(r"translate\((\[.*?\])\)", code).group(1))
    assert isinstance(printed, list) and len(printed) == len(numbers) and all(isinstance(t, str) for t in printed)


@pytest.mark.parametrize("where,code", EXAMPLES[1:], ids=[w for w, _ in EXAMPLES[1:]])
def test_every_python_example_runs(where, code, tmp_path):
    """Each example runs as written beside a demo model (``qkv-demo/model``, as after
    ``bash scripts/demo.sh``); one for a running server is checked against the test that makes
    the same client calls of a real ``qkv serve``."""
    if code in AGAINST_A_SERVER:
        test = (ROOT / AGAINST_A_SERVER[code]).read_text(encoding="utf-8")
        calls = set(re.findall(r"client(?:\.\w+)+\(", code))
        assert calls and all(call in test for call in calls), f"{where}: {AGAINST_A_SERVER[code]} lacks {calls}"
        return
    demo_model(tmp_path)
    result = _run(code, tmp_path)
    assert result.returncode == 0, f"{where}: {result.stderr[-3000:]}"
    if 'save_model(gpt, "my-gpt")' in code:  # the README's models example wrote a model directory here
        assert {p.name for p in (tmp_path / "my-gpt").iterdir()} >= {"config.json", "model.safetensors"}
