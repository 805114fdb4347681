#!/usr/bin/env bash
# Create .venv (Python >= 3.10) and install qkv with its test tools into it; as root with apt,
# also the system package libtcmalloc-minimal4 (optional, for speed). Idempotent:
# a second run only reinstalls when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "qkv setup: $PY not found; install Python 3.10 or newer" >&2
  exit 2
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "qkv setup: $("$PY" --version 2>&1) is too old; qkv needs Python 3.10 or newer" >&2
  exit 2
fi

if [ ! -x .venv/bin/python ]; then
  if ! "$PY" -m venv .venv 2>/dev/null; then
    # Debian/Ubuntu ship venv separately.
    rm -rf .venv
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
      "$PY" -m venv .venv
    else
      echo "qkv setup: '$PY -m venv' failed; install the venv module (e.g. apt-get install python3-venv)" >&2
      exit 2
    fi
  fi
fi

# TCMalloc: qkv commands restart on it when it is installed (src/qkv/memory.py: CPU training
# runs up to 1.7x faster than on glibc's malloc). Optional: without it qkv tunes glibc instead.
# Found where qkv itself looks (memory.tcmalloc_path, standard library only: no venv needed).
has_tcmalloc() { PYTHONPATH=src "$PY" -B -c 'import sys; from qkv.memory import tcmalloc_path; sys.exit(tcmalloc_path() is None)'; }
if ! has_tcmalloc; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; }; } \
      || echo "qkv setup: could not install libtcmalloc-minimal4; qkv runs on glibc's malloc (slower)" >&2
  else
    echo "qkv setup: for up to 1.7x faster CPU training, install TCMalloc (apt-get install libtcmalloc-minimal4)" >&2
  fi
fi

# espeak-ng and sox: they speak and convert the synthetic speech corpora (src/qkv/speech_corpora/).
# Optional: qkv runs without them and names the missing one when such a corpus must be built.
if ! command -v espeak-ng >/dev/null 2>&1 || ! command -v sox >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get install -y -qq espeak-ng sox >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq espeak-ng sox >/dev/null; }; } \
      || echo "qkv setup: could not install espeak-ng and sox; the synthetic speech corpora cannot be built" >&2
  else
    echo "qkv setup: to build the synthetic speech corpora (espeak_corpus), install espeak-ng and sox (apt-get install espeak-ng sox)" >&2
  fi
fi

# Chromium: tests/test_serve_browser.py drives Debian's chromium headless (through Playwright) to
# test the page qkv serve shows; a CJK font lets it draw Chinese. Optional: without a browser those
# tests are skipped, saying so.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get install -y -qq chromium fonts-wqy-microhei >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq chromium fonts-wqy-microhei >/dev/null; }; } \
      || echo "qkv setup: could not install chromium; the browser tests of qkv serve will be skipped" >&2
  else
    echo "qkv setup: for the browser tests of qkv serve's page, install Chromium (apt-get install chromium)" >&2
  fi
fi

stamp=.venv/.qkv-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-64)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch is pinned: on the project's machines 2.13.0 is a local CPU wheel; other specs download GBs.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
