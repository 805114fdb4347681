"""The Python examples of the README and the guides in docs/ must run as written."""

from __future__ import annotations

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
EXAMPLES = [
    (f"{page.relative_to(ROOT).as_posix()}#{i}", code)
    for page in PAGES
    for i, code in enumerate(BLOCK.findall(page.read_text(encoding="utf-8")), 1)
]


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


def test_readme_python_example_runs(tmp_path):
    match = BLOCK.search(README.read_text(encoding="utf-8"))
    assert match, "README.md has no ```python block"
    code = match.group(1)
    assert "import qkv" in code or "from qkv" in code
    result = _run(code, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # save_model(gpt, "my-gpt") wrote a model directory in the working directory.
    assert {p.name for p in (tmp_path / "my-gpt").iterdir()} >= {"config.json", "model.safetensors"}


@pytest.mark.parametrize("where,code", EXAMPLES[1:], ids=[w for w, _ in EXAMPLES[1:]])
def test_every_python_example_runs(where, code, tmp_path):
    result = _run(code, tmp_path)
    assert result.returncode == 0, f"{where}: {result.stderr[-3000:]}"
