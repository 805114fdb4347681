#!/usr/bin/env bash
# Install (first time) and run the demo: train the built-in task, print results, draw attention.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/qkv demo "$@"
