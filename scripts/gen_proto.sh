#!/usr/bin/env bash
# Regenerates the committed gRPC/protobuf modules from embedding_store/proto/*.proto.
set -euo pipefail
cd "$(dirname "$0")/.."
# Needs grpcio-tools==1.80.0 (protobuf 6.31 gencode, which runtime protobuf 6.x reads):
#   python3 -m venv /tmp/protoc && /tmp/protoc/bin/pip install grpcio-tools==1.80.0
#   PYTHON=/tmp/protoc/bin/python bash scripts/gen_proto.sh
PY="${PYTHON:-.venv/bin/python}"
for proto in embedding_store/proto/*.proto training/proto/*.proto serving/proto/*.proto; do
  [ -f "$proto" ] || continue
  "$PY" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. "$proto"
done
