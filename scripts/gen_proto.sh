#!/usr/bin/env bash
# Regenerates the committed gRPC/protobuf modules from embedding_store/proto/*.proto.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
for proto in embedding_store/proto/*.proto training/proto/*.proto serving/proto/*.proto; do
  [ -f "$proto" ] || continue
  "$PY" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. "$proto"
done
