#!/usr/bin/env bash
# Install (first time), check formatting and lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff format --check src tests bench
.venv/bin/ruff check src tests bench
.venv/bin/lint-imports --no-cache   # the import layers (pyproject.toml [tool.importlinter])
# Two files at a time on two cores (pytest-xdist; tests/conftest.py: how many workers, their threads,
# which files first): a file's tests stay on one worker, its module fixtures built once. One file
# named, or -n 0, runs in this process as plain pytest does.
exec .venv/bin/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder "$@"
