"""What Python gRPC costs by itself: one unary call with the embedding tier's message sizes.

A bytes-in / bytes-out handler (no protobuf, no work) on 127.0.0.1, in a child process;
the client calls it one call after the other. Measured per answer size (1 KB; 0.44 MB, a
shard's batch-1024 answer; 1.7 MB, the worker's batch-1024 answer of 26 slots x dim 16) for
the sync server and client (what recserve's services use) and for ``grpc.aio`` on both ends:
wall ms per call, client and server CPU ms per call (``time.process_time`` and
``/proc/PID/stat``), and the aio / sync ratio of calls per second.

This is the floor under ``benchmarks/embedding_tier.py``'s remote path (one 1.7 MB call plus
two 0.44 MB calls per lookup). The ``topology`` measurement (skip with ``--no-topology``)
builds that path with the same do-nothing handlers: a relay process (standing for the
embedding worker: sync server, shard 0 called on the handler thread, shard 1 from a pool
thread, as ``EmbeddingWorker._for_each_shard`` does) in front of two shard processes. Its
calls/s times 26,624 IDs is the most a batch-1024 lookup through a Python gRPC worker and two
shards could reach on this machine if the worker and the shards did no work at all; it is
reported as a ratio to the in-process core (``InProcessEmbeddingTier``, 2 shards, the
workload of ``benchmarks/embedding_tier.py``) measured in the same run, from 1 and from 2
client threads.

Every loop is bounded (``--calls``, ``--seconds``); children are killed by their PIDs
(``Popen.kill``). Run: ``python benchmarks/grpc_floor.py [--calls 400] [--seconds 4]``.
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
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # load_tests/ is not installed
from load_tests.stack import sigterm_exits

REQUEST_BYTES = 200_000  # a batch-1024 request of 26 single-ID slots
ANSWER_BYTES = {"1KB": 1_000, "0.44MB": 440_000, "1.7MB": 1_700_000}
OPTIONS = [
    ("grpc.max_send_message_length", 1 << 28),
    ("grpc.max_receive_message_length", 1 << 28),
]
WARMUP_CALLS = 20
# The topology: client -> relay (the worker) -> 2 shards, batch-1024 message sizes.
TOPOLOGY_SHARDS = 2
SHARD_REQUEST_BYTES = 56_000  # ~6,800 unique uint64 IDs per shard
SHARD_ANSWER_BYTES = ANSWER_BYTES["0.44MB"]
RELAY_ANSWER_BYTES = ANSWER_BYTES["1.7MB"]
IDS_PER_LOOKUP = 26 * 1024
MAX_TIMED_CALLS = 100_000


def _identity(payload: bytes) -> bytes:
    return payload


def _handler(answer: bytes) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "bench.Floor",
        {
            "Call": grpc.unary_unary_rpc_method_handler(
                (lambda request, context: answer), _identity, _identity
            )
        },
    )


def _aio_handler(answer: bytes) -> grpc.GenericRpcHandler:
    async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
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


def _relay(port: int, shard_ports: list[int], lifetime_s: float) -> None:
    """Child process: the worker's message flow with no work. Each call fans a
    ``SHARD_REQUEST_BYTES`` request out to every shard (shard 0 on the handler thread, the
    others from a pool) and answers ``RELAY_ANSWER_BYTES``; serves until killed."""
    channels = [grpc.insecure_channel(f"127.0.0.1:{p}", options=OPTIONS) for p in shard_ports]
    shard_calls = [c.unary_unary("/bench.Floor/Call", _identity, _identity) for c in channels]
    fan_out = ThreadPoolExecutor(max_workers=max(2, len(shard_calls)))
    shard_request = os.urandom(SHARD_REQUEST_BYTES)
    answer = os.urandom(RELAY_ANSWER_BYTES)

    def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
        pending = [fan_out.submit(call, shard_request, timeout=30) for call in shard_calls[1:]]
        shard_calls[0](shard_request, timeout=30)
        for future in pending:
            future.result()
        return answer

    handler = grpc.method_handlers_generic_handler(
        "bench.Floor", {"Call": grpc.unary_unary_rpc_method_handler(handle, _identity, _identity)}
    )
    server = grpc.server(ThreadPoolExecutor(max_workers=8), options=OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination(timeout=lifetime_s)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _usage(pid: int) -> tuple[float, float, float]:
    """(wall clock, this process's CPU, ``pid``'s CPU), in seconds: read before and after a
    timed window."""
    return time.perf_counter(), time.process_time(), _cpu_seconds(pid)


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
    child = _spawn("--serve", kind, str(answer_bytes), str(port))
    pid = child.pid
    try:
        _wait_ready(port)
        request = os.urandom(REQUEST_BYTES)
        target = f"127.0.0.1:{port}"
        # The timed window ends with the last answer, inside the channel: closing it (and,
        # for aio, the event loop's teardown) is no part of a call's cost.
        if kind == "sync":
            with grpc.insecure_channel(target, options=OPTIONS) as channel:
                call = channel.unary_unary("/bench.Floor/Call", _identity, _identity)
                for _ in range(WARMUP_CALLS):
                    call(request, timeout=30)
                start = _usage(pid)
                for _ in range(calls):
                    call(request, timeout=30)
                end = _usage(pid)
        else:

            async def run() -> tuple[tuple[float, float, float], tuple[float, float, float]]:
                async with grpc.aio.insecure_channel(target, options=OPTIONS) as channel:
                    call = channel.unary_unary("/bench.Floor/Call", _identity, _identity)
                    for _ in range(WARMUP_CALLS):
                        await call(request, timeout=30)
                    start = _usage(pid)
                    for _ in range(calls):
                        await call(request, timeout=30)
                    return start, _usage(pid)

            start, end = asyncio.run(run())
        wall, client, server = (after - before for after, before in zip(end, start, strict=True))
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


def _timed_calls(fn: Callable[[], object], threads: int, seconds: float) -> tuple[int, float]:
    """Call ``fn()`` from ``threads`` threads for ``seconds`` (at most MAX_TIMED_CALLS calls
    in all): (calls, elapsed seconds)."""
    count = [0] * threads
    deadline = time.perf_counter() + seconds
    budget = MAX_TIMED_CALLS // threads

    def loop(slot: int) -> None:
        while count[slot] < budget and time.perf_counter() < deadline:
            fn()
            count[slot] += 1

    start = time.perf_counter()
    workers = [threading.Thread(target=loop, args=(slot,), daemon=True) for slot in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=seconds + 60)
    if any(worker.is_alive() for worker in workers):
        raise RuntimeError("a client thread did not finish within its time bound")
    return sum(count), time.perf_counter() - start


def _spawn(*args: str) -> subprocess.Popen:
    # A fresh interpreter, not a fork: gRPC's threads do not survive fork().
    return subprocess.Popen([sys.executable, __file__, *args])


def in_process_lookups_per_s(threads: int, seconds: float) -> float:
    """Batch-1024 eval lookups/s of ``InProcessEmbeddingTier`` (2 shards, every ID inserted
    first), the workload and baseline of ``benchmarks/embedding_tier.py``."""
    import numpy as np
    import torch
    import yaml
    from embedding_tier import (
        CAPACITY,
        DIM,
        NUM_SHARDS,
        OPTIMIZER,
        SLOT_NAMES,
        make_batches,
        preload,
    )

    from embedding_store.config import load_embedding_config
    from embedding_store.tier import InProcessEmbeddingTier

    torch.set_num_threads(1)
    batches = make_batches(np.random.default_rng(0), 1024, 32)
    with tempfile.TemporaryDirectory(prefix="recserve-floor-") as tmp:
        path = Path(tmp) / "embedding_config.yml"
        path.write_text(yaml.safe_dump({"slots_config": {n: {"dim": DIM} for n in SLOT_NAMES}}))
        config = load_embedding_config(path)
    tier = InProcessEmbeddingTier(
        config, capacity=CAPACITY, num_shards=NUM_SHARDS, optimizer=OPTIMIZER
    )
    preload(tier, np.random.default_rng(1))
    cursor = iter(range(10**9))

    def lookup() -> None:
        tier.lookup(batches[next(cursor) % len(batches)], train=False)

    for _ in range(WARMUP_CALLS):
        lookup()
    calls, elapsed = _timed_calls(lookup, threads, seconds)
    return calls / elapsed


def measure_topology(threads: int, seconds: float) -> dict:
    """Client -> relay -> 2 shards, batch-1024 sizes, no work anywhere: calls/s, wall and
    CPU ms per call of every process."""
    shard_ports = [_free_port() for _ in range(TOPOLOGY_SHARDS)]
    relay_port = _free_port()
    children = [_spawn("--serve", "sync", str(SHARD_ANSWER_BYTES), str(p)) for p in shard_ports]
    try:
        for port in shard_ports:
            _wait_ready(port)
        children.append(_spawn("--relay", str(relay_port), ",".join(map(str, shard_ports))))
        _wait_ready(relay_port)
        request = os.urandom(REQUEST_BYTES)
        with grpc.insecure_channel(f"127.0.0.1:{relay_port}", options=OPTIONS) as channel:
            call = channel.unary_unary("/bench.Floor/Call", _identity, _identity)
            for _ in range(WARMUP_CALLS):
                call(request, timeout=30)
            pids = [child.pid for child in children]
            cpu0 = [_cpu_seconds(pid) for pid in pids]
            client0 = time.process_time()
            calls, elapsed = _timed_calls(lambda: call(request, timeout=30), threads, seconds)
            client = time.process_time() - client0
            cpu = [_cpu_seconds(pid) - before for pid, before in zip(pids, cpu0, strict=True)]
    finally:
        for child in children:
            child.kill()
            child.wait(timeout=30)
    return {
        "threads": threads,
        "calls": calls,
        "calls_per_s": calls / elapsed,
        "wall_ms": elapsed / calls * 1e3 * threads,
        "client_cpu_ms": client / calls * 1e3,
        "relay_cpu_ms": cpu[-1] / calls * 1e3,
        "shards_cpu_ms": sum(cpu[:-1]) / calls * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400, help="timed calls per measurement")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--seconds", type=float, default=4.0, help="time per topology / in-process measurement"
    )
    parser.add_argument("--no-topology", action="store_true", help="skip the topology part")
    parser.add_argument(
        "--serve", nargs=3, metavar=("KIND", "BYTES", "PORT"), help=argparse.SUPPRESS
    )
    parser.add_argument("--relay", nargs=2, metavar=("PORT", "SHARD_PORTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:  # a child process of measure() or measure_topology()
        kind, size, port = args.serve
        _serve(kind, os.urandom(int(size)), int(port), lifetime_s=300.0)
        return
    if args.relay:  # a child process of measure_topology()
        port, shard_ports = args.relay
        _relay(int(port), [int(p) for p in shard_ports.split(",")], lifetime_s=300.0)
        return
    if not 10 <= args.calls <= 100_000:
        parser.error("--calls must be in 10..100000")
    if not 0.5 <= args.seconds <= 120:
        parser.error("--seconds must be in 0.5..120")
    # SIGTERM (``timeout``, a CI job's end) unwinds as SystemExit(143): the servers started
    # here are killed by the measurements' ``finally`` (they used to live on, up to 300 s).
    with sigterm_exits():
        benchmark(args)


def benchmark(args: argparse.Namespace) -> None:
    """Every measurement of the command line ``args``, printed (and written to ``--json``)."""
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
    topology = []
    if not args.no_topology:
        print(
            "\ntopology: client -> relay -> 2 shards (0.2 MB -> 2 x 56 KB -> 2 x 0.44 MB -> "
            "1.7 MB), no work; ceiling in IDs/s = calls/s x 26,624"
        )
        print(
            "| client threads | calls/s | wall ms | client / relay / shards CPU ms "
            "| ceiling IDs/s | in-process IDs/s | ceiling / in-process |"
        )
        print("|---:|---:|---:|---|---:|---:|---:|")
        for threads in (1, 2):
            row = measure_topology(threads, args.seconds)
            in_process = in_process_lookups_per_s(threads, args.seconds) * IDS_PER_LOOKUP
            row["ceiling_ids_per_s"] = row["calls_per_s"] * IDS_PER_LOOKUP
            row["in_process_ids_per_s"] = in_process
            row["ratio"] = row["ceiling_ids_per_s"] / in_process
            print(
                f"| {threads} | {row['calls_per_s']:.0f} | {row['wall_ms']:.2f} "
                f"| {row['client_cpu_ms']:.2f} / {row['relay_cpu_ms']:.2f} / "
                f"{row['shards_cpu_ms']:.2f} | {row['ceiling_ids_per_s'] / 1e6:.2f}M "
                f"| {in_process / 1e6:.2f}M | {row['ratio']:.2f} |",
                flush=True,
            )
            topology.append(row)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"load_average_1m": os.getloadavg()[0], "results": results, "topology": topology},
                out,
                indent=1,
            )


if __name__ == "__main__":
    main()
