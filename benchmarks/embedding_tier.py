"""Embedding tier over gRPC (worker -> 2 parameter-server shards on loopback) vs in-process.

Workload (same as ``benchmarks/embedding_core.py``): 26 ID slots with one ID per sample each,
dim 16, 1M distinct IDs in all (26 vocabularies of ~38.5k), Zipf-distributed (s = 1.05),
batch 64 and 1024.

Two tiers hold the same rows (every ID inserted first by train lookups, Adagrad configured):

- ``remote``: a :class:`LocalCluster` (2 ``embedding-parameter-server`` processes + 1
  ``embedding-worker`` process, all on 127.0.0.1) reached through ``RemoteEmbeddingWorker``;
- ``in-process``: ``InProcessEmbeddingTier`` with 2 shards in this process;
- ``direct`` (skip with ``--no-direct``): the worker core in this process
  (``RemoteShardTier``) over the cluster's 2 shards, i.e. without the worker hop.

Measured for each, per batch size:

- ``eval``: lookups with ``train=False`` from one client, one call after the other: IDs/s,
  samples/s and p50/p99 latency per call; then from ``--threads`` concurrent client threads.
- ``train``: lookup with ``train=True`` + ``backward`` with a gradient for every slot. Remotely
  ``backward`` only queues the gradients (the worker pushes them asynchronously); the timed
  window ends with a ``flush``, so the rate includes applying every gradient.

Each measurement alternates between the tiers in ``--rounds`` rounds (drifting load from other
work hits all alike). Also reported: the CPU time per call of every process (this one; the
worker and the shards from /proc), which depends much less than throughput on other work
sharing the machine. torch runs with ``--torch-threads`` (default 1) here and in the cluster's
processes: two intra-op threads on two busy cores stall for milliseconds per op.

Every loop is bounded in time and count; the cluster is always torn down (only the processes
it started). Run: ``python benchmarks/embedding_tier.py [--seconds 3] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import yaml

# The workload of benchmarks/embedding_core.py: 26 slots, dim 16, 1M Zipf(1.05) IDs.
from embedding_core import DIM, DISTINCT_IDS, NUM_SLOTS, VOCAB, zipf_ids
from machine_info import describe_machine

from embedding_store.batch import Batch, IDTypeFeatureWithSingleID
from embedding_store.cli_types import positive_float, positive_int
from embedding_store.config import load_embedding_config
from embedding_store.launcher import LocalCluster, ManagedProcess
from embedding_store.optimizers import Adagrad
from embedding_store.remote_tier import RemoteShardTier
from embedding_store.tier import EmbeddingTier, InProcessEmbeddingTier
from embedding_store.worker_client import RemoteEmbeddingWorker

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # load_tests/ is not installed
from load_tests.stack import sigterm_exits

NUM_SHARDS = 2
CAPACITY = 1_000_000  # rows per shard; each holds ~500k
BATCH_SIZES = (64, 1024)
BATCHES_PER_SIZE = 32
PRELOAD_CHUNK = 8192  # samples per preload lookup (26 * 8192 IDs, ~13 MB answer)
MAX_CALLS = 200_000
OPTIMIZER = Adagrad(lr=0.01)
SLOT_NAMES = [f"slot_{i:02d}" for i in range(NUM_SLOTS)]


def make_batches(rng: np.random.Generator, batch_size: int, count: int) -> list[Batch]:
    ids = zipf_ids(rng, count * NUM_SLOTS * batch_size, VOCAB).reshape(count, NUM_SLOTS, batch_size)
    return [
        Batch(
            [
                IDTypeFeatureWithSingleID(n, np.ascontiguousarray(b[i]))
                for i, n in enumerate(SLOT_NAMES)
            ],
            requires_grad=False,
        )
        for b in ids
    ]


def percentile_ms(latencies: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(latencies), q) * 1e3) if latencies else float("nan")


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU time (user + system, all threads) used so far by this process and by ``pids``."""
    ticks = os.sysconf("SC_CLK_TCK")
    used = {"client": time.process_time()}
    for name, pid in pids.items():
        try:
            # Fields after the command name (which may hold spaces): utime and stime are the
            # 12th and 13th of them.
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            used[name] = (int(fields[11]) + int(fields[12])) / ticks
        except (OSError, IndexError, ValueError):
            used[name] = float("nan")
    return used


def measure(
    fn: Callable[[int], None],
    num_inputs: int,
    seconds: float,
    *,
    threads: int = 1,
    finish: Callable[[], None] | None = None,
    pids: dict[str, int] | None = None,
) -> dict:
    """Call ``fn(i)`` for ``seconds`` (at most MAX_CALLS calls) from ``threads`` threads.

    Returns calls, elapsed seconds, per-call latencies and the CPU seconds each process
    (this one, and ``pids``) used meanwhile; ``finish`` (e.g. a flush) runs inside the timed
    window after the last call.
    """
    fn(0)  # warm-up (JIT, caches, connections)
    if finish:
        finish()
    cpu_before = cpu_seconds(pids or {})
    latencies: list[list[float]] = [[] for _ in range(threads)]
    counter = iter(range(MAX_CALLS))
    lock = threading.Lock()
    errors: list[BaseException] = []
    start = time.perf_counter()
    deadline = start + seconds

    def loop(slot: int) -> None:
        mine = latencies[slot]
        try:
            while time.perf_counter() < deadline:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                t0 = time.perf_counter()
                fn(i % num_inputs)
                mine.append(time.perf_counter() - t0)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    if threads == 1:
        loop(0)
    else:
        workers = [threading.Thread(target=loop, args=(t,), daemon=True) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=seconds + 120)
        if any(w.is_alive() for w in workers):
            raise RuntimeError("a client thread did not finish within its time bound")
    if errors:
        raise errors[0]
    if finish:
        finish()
    elapsed = time.perf_counter() - start
    cpu_after = cpu_seconds(pids or {})
    flat = [x for per_thread in latencies for x in per_thread]
    cpu = {name: cpu_after[name] - cpu_before[name] for name in cpu_after}
    return {"calls": len(flat), "seconds": elapsed, "latencies": flat, "cpu": cpu}


def summarize(raw: dict, batch_size: int) -> dict:
    ids_per_call = NUM_SLOTS * batch_size
    calls, elapsed = raw["calls"], raw["seconds"]
    return {
        "calls": calls,
        "ids_per_s": ids_per_call * calls / elapsed,
        "samples_per_s": batch_size * calls / elapsed,
        "p50_ms": percentile_ms(raw["latencies"], 50),
        "p99_ms": percentile_ms(raw["latencies"], 99),
        # CPU milliseconds per call, by process (10 ms clock ticks for the cluster's).
        "cpu_ms_per_call": {k: 1e3 * v / max(calls, 1) for k, v in raw["cpu"].items()},
    }


def started_pid(managed: ManagedProcess) -> int:
    """The pid of a process of a started :class:`LocalCluster`."""
    if managed.process is None:
        raise RuntimeError(f"{managed.name} was not started")
    return managed.process.pid


def preload(tier: EmbeddingTier | RemoteEmbeddingWorker, rng: np.random.Generator) -> None:
    """Insert every ID of every slot with train lookups in large batches (IDs shuffled)."""
    order = rng.permutation(VOCAB).astype(np.uint64)
    for start in range(0, VOCAB, PRELOAD_CHUNK):
        ids = order[start : start + PRELOAD_CHUNK]
        tier.lookup([IDTypeFeatureWithSingleID(n, ids) for n in SLOT_NAMES], train=True)
    # The forward contexts of these lookups simply expire (no gradients for the preload).


def run_both(
    tiers: dict, batches: dict[int, list[Batch]], args: argparse.Namespace, pids: dict
) -> dict:
    """Every measurement on every tier, in ``args.rounds`` interleaved rounds (so drifting
    background load hits all tiers alike): {tier: {batch size: {measurement: summary}}}."""
    results: dict[str, dict[int, dict]] = {name: {} for name in tiers}
    for batch_size, inputs in batches.items():
        grads = {n: torch.full((batch_size, DIM), 1e-4) for n in SLOT_NAMES}
        kinds = [("eval", 1, False)]
        if args.threads > 1:
            kinds.append((f"eval_{args.threads}_threads", args.threads, False))
        kinds.append(("train", 1, True))
        for kind, threads, train in kinds:
            raws: dict[str, list[dict]] = {name: [] for name in tiers}
            for _ in range(args.rounds):
                for name, tier in tiers.items():

                    def evaluate(i: int) -> None:
                        tier.lookup(inputs[i], train=False)

                    def train_step(i: int) -> None:
                        result = tier.lookup(inputs[i], train=True)
                        tier.backward(result.ref, grads)

                    raws[name].append(
                        measure(
                            train_step if train else evaluate,
                            len(inputs),
                            args.seconds / args.rounds,
                            threads=threads,
                            finish=tier.flush if train else None,
                            pids=pids.get(name, {}),
                        )
                    )
            for name, parts in raws.items():
                merged = {
                    "calls": sum(p["calls"] for p in parts),
                    "seconds": sum(p["seconds"] for p in parts),
                    "latencies": [x for p in parts for x in p["latencies"]],
                    "cpu": {k: sum(p["cpu"][k] for p in parts) for k in parts[0]["cpu"]},
                }
                results[name].setdefault(batch_size, {})[kind] = summarize(merged, batch_size)
    return results


def versions() -> dict:
    info = describe_machine("torch", "grpcio", "numpy")
    info["torch_threads"] = torch.get_num_threads()
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; argparse error (exit 2) before the cluster starts for a value that
    would measure nothing (0 seconds: 0 calls, a ratio of 0 / 0 after the whole run) or run
    unbounded."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=positive_float, default=3.0, help="time per measurement")
    parser.add_argument("--threads", type=int, default=2, help="concurrent client threads")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds per measurement (each tier gets --seconds in all)",
    )
    parser.add_argument(
        "--torch-threads",
        type=positive_int,
        default=1,
        help="torch intra-op threads, here and in the cluster's processes (OMP_NUM_THREADS)",
    )
    parser.add_argument(
        "--no-direct",
        dest="direct",
        action="store_false",
        help="skip the worker-core-in-this-process measurement (RemoteShardTier)",
    )
    parser.add_argument("--log-dir", default=None, help="cluster logs (default: a temp dir)")
    args = parser.parse_args(argv)
    if not 1 <= args.threads <= 16:
        parser.error("--threads must be in 1..16")
    if not 1 <= args.rounds <= 100:
        parser.error("--rounds must be in 1..100")
    if args.seconds > 600:
        parser.error(f"--seconds must be at most 600, got {args.seconds:g}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print its results. SIGTERM (``timeout``, a CI job's end) unwinds
    it as SystemExit(143), so the cluster started here is stopped: it used to live on."""
    with sigterm_exits():
        benchmark(argv)


def benchmark(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    load_before = os.getloadavg()[0]
    cluster_env = {"OMP_NUM_THREADS": str(args.torch_threads)}

    rng = np.random.default_rng(0)
    batches = {b: make_batches(rng, b, BATCHES_PER_SIZE) for b in BATCH_SIZES}

    with tempfile.TemporaryDirectory(prefix="recserve-bench-") as tmp:
        root = Path(tmp)
        embedding_path = root / "embedding_config.yml"
        embedding_path.write_text(
            yaml.safe_dump({"slots_config": {n: {"dim": DIM} for n in SLOT_NAMES}})
        )
        global_path = root / "global_config.yml"
        global_path.write_text(
            yaml.safe_dump({"embedding_parameter_server_config": {"capacity": CAPACITY}})
        )
        config = load_embedding_config(embedding_path)

        local = InProcessEmbeddingTier(
            config, capacity=CAPACITY, num_shards=NUM_SHARDS, optimizer=OPTIMIZER
        )
        t0 = time.perf_counter()
        preload(local, np.random.default_rng(1))
        local_preload_s = time.perf_counter() - t0

        cluster = LocalCluster(
            embedding_path,
            global_path,
            num_shards=NUM_SHARDS,
            num_workers=1,
            log_dir=args.log_dir or root / "logs",
            extra_env=cluster_env,
        )
        try:
            cluster.start(timeout=120)
            with RemoteEmbeddingWorker(cluster.worker_addresses[0], config, timeout=120) as remote:
                remote.configure(optimizer=OPTIMIZER)
                t0 = time.perf_counter()
                preload(remote, np.random.default_rng(1))
                remote_preload_s = time.perf_counter() - t0
                status = remote.status()
                # Same rows on both sides: the first eval batch must pool to the same values.
                same = all(
                    torch.allclose(a.embeddings, b.embeddings, atol=1e-6)
                    for size in BATCH_SIZES
                    for a, b in zip(
                        remote.lookup(batches[size][0], train=False).slots,
                        local.lookup(batches[size][0], train=False).slots,
                    )
                )
                shard_pids = {f"shard{i}": started_pid(s) for i, s in enumerate(cluster.shards)}
                pids = {
                    "remote": {"worker": started_pid(cluster.workers[0]), **shard_pids},
                    "direct": shard_pids,
                }
                tiers = {"in_process": local, "remote": remote}
                if args.direct:
                    direct = RemoteShardTier(config, cluster.ps_addresses)
                    tiers["direct"] = direct
                try:
                    results = run_both(tiers, batches, args, pids)
                finally:
                    if args.direct:
                        direct.close()
        finally:
            cluster.stop()
    local_results, remote_results = results["in_process"], results["remote"]

    info = versions()
    print(
        f"machine: {info['cpu']}, nproc {info['nproc']}, python {info['python']}, "
        f"torch {info['torch']} ({info['torch_threads']} thread(s)), grpcio {info['grpcio']}, "
        f"load average (1 min) {load_before:.2f} before, {info['load_average_1m']:.2f} after"
    )
    print(
        f"preload {DISTINCT_IDS:,} IDs: in-process {local_preload_s:.1f} s, remote "
        f"{remote_preload_s:.1f} s; rows per shard {list(status.rows_per_shard)}; "
        f"remote eval == in-process eval: {same}"
    )
    header = (
        f"{'batch':>5} {'measurement':<14} {'remote IDs/s':>13} {'samples/s':>10} "
        f"{'p50 ms':>7} {'p99 ms':>7} | {'in-proc IDs/s':>13} {'p50 ms':>7} {'p99 ms':>7} "
        f"| {'ratio':>5}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for size in BATCH_SIZES:
        for kind in remote_results[size]:
            r, lo = remote_results[size][kind], local_results[size][kind]
            ratio = r["ids_per_s"] / lo["ids_per_s"]
            print(
                f"{size:>5} {kind:<14} {r['ids_per_s'] / 1e6:>11.2f}M {r['samples_per_s']:>10,.0f} "
                f"{r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} | {lo['ids_per_s'] / 1e6:>11.2f}M "
                f"{lo['p50_ms']:>7.2f} {lo['p99_ms']:>7.2f} | {ratio:>5.2f}"
            )
            rows.append(
                {
                    "batch_size": size,
                    "measurement": kind,
                    "remote": r,
                    "in_process": lo,
                    "ratio": ratio,
                }
            )
    print("\nCPU ms per call (all threads of each process; cluster processes in 10 ms ticks):")
    print(
        f"{'batch':>5} {'measurement':<14} {'in-proc':>8} | {'remote:':<7} {'client':>7} "
        f"{'worker':>7} {'shards':>7} {'total':>7}"
    )
    for size in BATCH_SIZES:
        for kind in remote_results[size]:
            r = remote_results[size][kind]["cpu_ms_per_call"]
            lo = local_results[size][kind]["cpu_ms_per_call"]["client"]
            shards = sum(v for k, v in r.items() if k.startswith("shard"))
            print(
                f"{size:>5} {kind:<14} {lo:>8.2f} | {'':<7} {r['client']:>7.2f} "
                f"{r['worker']:>7.2f} {shards:>7.2f} {sum(r.values()):>7.2f}"
            )
    if "direct" in results:
        print(
            "\nWorker core in this process, the same 2 shards over gRPC (RemoteShardTier; one "
            "hop less):"
        )
        print(
            f"{'batch':>5} {'measurement':<14} {'IDs/s':>13} {'p50 ms':>7} {'p99 ms':>7} "
            f"{'CPU ms/call':>11} | {'ratio':>5}"
        )
        for size in BATCH_SIZES:
            for kind, d in results["direct"][size].items():
                ratio = d["ids_per_s"] / local_results[size][kind]["ids_per_s"]
                print(
                    f"{size:>5} {kind:<14} {d['ids_per_s'] / 1e6:>11.2f}M {d['p50_ms']:>7.2f} "
                    f"{d['p99_ms']:>7.2f} {sum(d['cpu_ms_per_call'].values()):>11.2f} | "
                    f"{ratio:>5.2f}"
                )
                rows.append(
                    {
                        "batch_size": size,
                        "measurement": f"direct_{kind}",
                        "remote": d,
                        "in_process": local_results[size][kind],
                        "ratio": ratio,
                    }
                )
    goal = remote_results[1024]["eval"]["ids_per_s"] / local_results[1024]["eval"]["ids_per_s"]
    print(
        f"goal (batch 1024 eval, remote >= 0.4x in-process): {goal:.2f}x -> "
        f"{'met' if goal >= 0.4 else 'NOT met'}"
    )
    print(
        json.dumps(
            {
                "benchmark": "embedding_tier",
                "machine": {**info, "load_average_1m_before": load_before},
                "seconds": args.seconds,
                "threads": args.threads,
                "rounds": args.rounds,
                "torch_threads": args.torch_threads,
                "slots": NUM_SLOTS,
                "dim": DIM,
                "distinct_ids": DISTINCT_IDS,
                "shards": NUM_SHARDS,
                "remote_matches_in_process": same,
                "goal_ratio_batch_1024_eval": goal,
                "results": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
