#!/usr/bin/env bash
# Install (first time), check formatting and lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff format --check src tests bench
.venv/bin/ruff check src tests bench
.venv/bin/lint-imports --no-cache   # the import layers (pyproject.toml [tool.importlinter])
exec .venv/bin/python -m pytest -q "$@"
