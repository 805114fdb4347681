"""``qkv --help`` and every ``qkv COMMAND --help`` answer without importing PyTorch.

The command line's parsers live in light modules; a command's heavy modules (the bundle,
the models, torch) are imported by its handler only when it runs. Each test runs Python in a
subprocess (this test process has torch loaded already) and asks which modules it imported,
rather than timing it: a timing assertion on a shared machine would fail at random.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

HEAVY = ("torch", "numpy", "soundfile", "safetensors", "tokenizers", "fastapi", "uvicorn")

# Every command's --help, in one fresh interpreter: the commands, and every module it imported.
PROBE = """
import contextlib, io, json, sys
from qkv.cli.main import build_parser, main
commands = list(build_parser()._subparsers._group_actions[0].choices)
for command in commands:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            main([command, "--help"])
        except SystemExit as e:
            assert e.code == 0, (command, e.code)
    assert out.getvalue().startswith(f"usage: qkv {command}"), command
print(json.dumps({"commands": commands, "modules": sorted(sys.modules)}))
"""


def imported(importtime_log: str) -> set[str]:
    """The modules named in a ``python -X importtime`` log (its lines: 'import time: us | us | name')."""
    return {m.group(1) for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", importtime_log, re.M)}


def test_qkv_help_imports_no_torch():
    # The real entry point, allocator restart included (-X importtime is kept across it).
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "qkv", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage: qkv" in result.stdout
    modules = imported(result.stderr)
    assert "qkv.cli.main" in modules  # the log is read right
    assert not {m for m in modules if m.split(".")[0] in HEAVY}


def test_every_command_help_imports_no_torch():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    found = json.loads(result.stdout)
    assert {"train", "speak", "transcribe", "embed", "serve", "import-hf"} <= set(found["commands"])
    assert "qkv.cli.speak" in found["modules"]
    assert [m for m in found["modules"] if m.split(".")[0] in HEAVY] == []


def test_embed_poolings_match_the_library():
    # qkv embed writes the choices out (so its parser needs no torch); they must be the library's.
    from qkv.cli.main import build_parser
    from qkv.embedding import POOLINGS

    embed = build_parser()._subparsers._group_actions[0].choices["embed"]
    pooling = next(a for a in embed._actions if a.dest == "pooling")
    assert tuple(pooling.choices) == POOLINGS
