"""The import layers are enforced: `lint-imports` (pyproject.toml's contracts) passes on the
package, and an import that runs up the layers fails it, naming the import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e .[dev])")


def _lint(root: Path) -> subprocess.CompletedProcess:
    # lint-imports finds the package on sys.path: point it at the copy under test.
    env = {"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_layers_kept():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("models/encoder_only.py", "import qkv.training", "qkv.models.encoder_only -> qkv.training"),
        ("attention.py", "import qkv.checkpoint", "qkv.attention -> qkv.checkpoint"),
        ("tokenization.py", "import qkv.tasks.numbers", "qkv.tokenization -> qkv.tasks.numbers"),
    ],
)
def test_upward_import_is_named(tmp_path, module, line, broken):
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / "src" / "qkv" / module
    path.write_text(path.read_text() + f"\n{line}  # an import that runs up the layers\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and broken in result.stdout, result.stdout[-2000:]
