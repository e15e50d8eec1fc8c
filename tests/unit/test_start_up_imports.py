"""A parameter-server shard is numpy and numba only: its process must not import torch, which
cost each shard ~1 s of CPU at start (``embedding_store.nonfinite``, imported for checkpoint
dumps and loads, imported it at the top), paid by every cluster start and shard restart."""

from __future__ import annotations

from tests.unit.python_script import run_python


def test_a_parameter_server_process_does_not_import_torch():
    result = run_python(
        "import sys\n"
        "from embedding_store import commands, ps_process\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    assert result.stdout.strip() == "[]", result.stdout[:2000]


_FAKE_WORKER_CLI = """
import sys
from concurrent import futures

import grpc

from embedding_store.cli import main
from embedding_store.proto import embedding_tier_pb2 as pb, embedding_tier_pb2_grpc as pb_grpc


class Worker(pb_grpc.EmbeddingWorkerServicer):
    def Status(self, request, context):
        shard = pb.ShardStatusResponse(rows=3, capacity=10, serving=True)
        return pb.WorkerStatusResponse(shard_status=[shard], pending_backward=1)

    def Clear(self, request, context):
        return pb.ClearResponse()


server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
pb_grpc.add_EmbeddingWorkerServicer_to_server(Worker(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
try:
    for action in ("status", "clear"):
        code = main(["embedding-tier", action, "--worker", f"127.0.0.1:{port}"])
        print(f"exit {code}")
    try:
        main(["embedding-tier", "--help"])
    except SystemExit as stop:
        print(f"help exit {stop.code}")
finally:
    server.stop(None)
print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))
"""


def test_the_embedding_tier_command_does_not_import_torch():
    """``recserve embedding-tier status|clear`` (and ``--help``) answer through the worker's
    client, which builds plain results: torch (~1 s of CPU per call) is not imported."""
    result = run_python(_FAKE_WORKER_CLI)
    lines = result.stdout.strip().splitlines()
    assert lines[:5] == [
        "shard 0: 3 rows of 10, idle, checkpoint none",
        "worker: idle",
        "pending backward: 1, pending gradient batches: 0, non-finite rows skipped: 0",
        "exit 0",
        "cleared every shard",
    ], result.stdout[:2000]
    assert lines[5] == "exit 0" and "help exit 0" in lines
    assert lines[-1] == "[]", result.stdout[-2000:]
