#!/usr/bin/env bash
# Fresh machine -> trained model answering predictions: creates .venv, installs torch==2.13.0
# first and then recserve, trains the Adult example (embedded), serves it over HTTP and gRPC,
# and sends sample predictions. The server keeps running until Ctrl-C (pass --exit to stop).
# Usage: bash scripts/quickstart.sh [--exit] [--http-port 8000] [--grpc-port 8001]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
setup_env ""
exec "$VENV/bin/python" -m examples.adult_income.quickstart "$@"
