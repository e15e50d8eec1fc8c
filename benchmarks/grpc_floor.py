"""What Python gRPC costs by itself: one unary call with the embedding tier's message sizes.

A bytes-in / bytes-out handler (no protobuf, no work) on 127.0.0.1, in a child process;
the client calls it one call after the other. Measured per answer size (1 KB; 0.44 MB, a
shard's batch-1024 answer; 1.7 MB, the worker's batch-1024 answer of 26 slots x dim 16) for
the sync server and client (what recserve's services use) and for ``grpc.aio`` on both ends:
wall ms per call, client and server CPU ms per call (``time.process_time`` and
``/proc/PID/stat``), and the aio / sync ratio of calls per second.

This is the floor under ``benchmarks/embedding_tier.py``'s remote path (one 1.7 MB call plus
two 0.44 MB calls per lookup). Every loop is bounded (``--calls``); the child is killed by
its PID (``Popen.kill``). Run: ``python benchmarks/grpc_floor.py [--calls 400]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

REQUEST_BYTES = 200_000  # a batch-1024 request of 26 single-ID slots
ANSWER_BYTES = {"1KB": 1_000, "0.44MB": 440_000, "1.7MB": 1_700_000}
OPTIONS = [
    ("grpc.max_send_message_length", 1 << 28),
    ("grpc.max_receive_message_length", 1 << 28),
]
WARMUP_CALLS = 20


def _identity(payload: bytes) -> bytes:
    return payload


def _handler(answer: bytes):
    return grpc.method_handlers_generic_handler(
        "bench.Floor",
        {
            "Call": grpc.unary_unary_rpc_method_handler(
                (lambda request, context: answer), _identity, _identity
            )
        },
    )


def _aio_handler(answer: bytes):
    async def call(request: bytes, context) -> bytes:
        return answer

    return grpc.method_handlers_generic_handler(
        "bench.Floor", {"Call": grpc.unary_unary_rpc_method_handler(call, _identity, _identity)}
    )


def _serve(kind: str, answer: bytes, port: int, lifetime_s: float) -> None:
    """Child process: serve until killed (at most ``lifetime_s``)."""
    if kind == "sync":
        server = grpc.server(ThreadPoolExecutor(max_workers=4), options=OPTIONS)
        server.add_generic_rpc_handlers((_handler(answer),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination(timeout=lifetime_s)
        return

    async def run() -> None:
        server = grpc.aio.server(options=OPTIONS)
        server.add_generic_rpc_handlers((_aio_handler(answer),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination(timeout=lifetime_s)

    asyncio.run(run())


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_ready(port: int, timeout_s: float = 20.0) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)


def measure(kind: str, answer_bytes: int, calls: int) -> dict:
    """One server kind and answer size: per-call wall and CPU of both ends."""
    port = _free_port()
    # A fresh interpreter, not a fork: gRPC's threads do not survive fork().
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, str(answer_bytes), str(port)]
    )
    pid = child.pid
    try:
        _wait_ready(port)
        request = os.urandom(REQUEST_BYTES)
        target = f"127.0.0.1:{port}"
        if kind == "sync":
            with grpc.insecure_channel(target, options=OPTIONS) as channel:
                call = channel.unary_unary("/bench.Floor/Call", _identity, _identity)
                for _ in range(WARMUP_CALLS):
                    call(request, timeout=30)
                server0, client0 = _cpu_seconds(pid), time.process_time()
                wall0 = time.perf_counter()
                for _ in range(calls):
                    call(request, timeout=30)
                wall = time.perf_counter() - wall0
        else:

            async def run() -> tuple[float, float, float]:
                async with grpc.aio.insecure_channel(target, options=OPTIONS) as channel:
                    call = channel.unary_unary("/bench.Floor/Call", _identity, _identity)
                    for _ in range(WARMUP_CALLS):
                        await call(request, timeout=30)
                    start = (_cpu_seconds(pid), time.process_time(), time.perf_counter())
                    for _ in range(calls):
                        await call(request, timeout=30)
                    return start

            server0, client0, wall0 = asyncio.run(run())
            wall = time.perf_counter() - wall0
        client = time.process_time() - client0
        server = _cpu_seconds(pid) - server0
    finally:
        child.kill()
        child.wait(timeout=30)
    return {
        "server": kind,
        "answer_bytes": answer_bytes,
        "calls": calls,
        "calls_per_s": calls / wall,
        "wall_ms": wall / calls * 1e3,
        "client_cpu_ms": client / calls * 1e3,
        "server_cpu_ms": server / calls * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400, help="timed calls per measurement")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--serve", nargs=3, metavar=("KIND", "BYTES", "PORT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.serve:  # the child process of measure()
        kind, size, port = args.serve
        _serve(kind, os.urandom(int(size)), int(port), lifetime_s=300.0)
        return
    if not 10 <= args.calls <= 100_000:
        parser.error("--calls must be in 10..100000")
    results = []
    print(f"python {platform.python_version()}, grpcio {grpc.__version__}, nproc {os.cpu_count()}")
    print(
        "| answer | server/client | calls/s | wall ms | client CPU ms | server CPU ms | vs sync |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, size in ANSWER_BYTES.items():
        sync = measure("sync", size, args.calls)
        aio = measure("aio", size, args.calls)
        for row in (sync, aio):
            row["answer"] = label
            ratio = row["calls_per_s"] / sync["calls_per_s"]
            print(
                f"| {label} | {row['server']} | {row['calls_per_s']:.0f} | {row['wall_ms']:.2f} "
                f"| {row['client_cpu_ms']:.2f} | {row['server_cpu_ms']:.2f} | {ratio:.2f} |",
                flush=True,
            )
            results.append(row)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"load_average_1m": os.getloadavg()[0], "results": results}, out, indent=1)


if __name__ == "__main__":
    sys.exit(main())
