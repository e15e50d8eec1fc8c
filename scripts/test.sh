#!/usr/bin/env bash
# Sets up a fresh virtual environment and runs the whole test suite.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RECSERVE_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first, pinned: an unpinned torch would pull gigabytes of CUDA packages.
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[dev]"
exec "$VENV/bin/python" -m pytest -q "$@"
