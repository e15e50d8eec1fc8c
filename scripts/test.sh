#!/usr/bin/env bash
# Sets up a fresh virtual environment (.venv) and runs the whole test suite.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
setup_env "[dev]"
exec "$VENV/bin/python" -m pytest -q "$@"
