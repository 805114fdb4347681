"""The README's Python example must run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs(tmp_path):
    match = re.search(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert match, "README.md has no ```python block"
    code = match.group(1)
    assert "import qkv" in code or "from qkv" in code
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # save_model(gpt, "my-gpt") wrote a model directory in the working directory.
    assert {p.name for p in (tmp_path / "my-gpt").iterdir()} >= {"config.json", "model.safetensors"}
