"""One cell of benchmarks/peers.py measured against one server: a headless locust run.

Every measurement is a headless locust run (load_tests/locustfile.py) with ``--users`` users,
closed loop, for ``--seconds`` seconds, one batch size (or one batch mix) at a time. Beside
locust's req/s, samples/s and p50/p99 it records the CPU each process group used (server,
locust; in cores) and, from recserve's ``/metrics``, its merged batch size and per-batch
lookup/compute times. ``--rounds N`` measures every server of a cell N times, in order on odd
rounds and reversed on even ones (``round_order``); ``combine_rounds`` gives the medians. A
round whose locust crashed (no final stats), exited non-zero for no failed request, or still
ran a minute after its end measured nothing: its ``error`` says why (``round_stats``).
"""

from __future__ import annotations

import argparse
import statistics
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peers_servers import process_tree

from load_tests.locust_run import LocustRun, locust_outcome, rows_per_second

#: Seconds past the end of its load that a round's locust gets to stop and write its final
#: stats; one still running then is stopped, and the round is an error.
LOCUST_OVERRUN_S = 60.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its descendants (alive ones)."""
    import psutil

    total = 0.0
    for process in process_tree(pid):
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            continue  # it ended between the listing and the reading: its time left with it
    return total


def metric_totals(base_url: str) -> dict[str, float]:
    """Sums and counts of recserve's batching histograms (``/metrics``)."""
    wanted = {
        "recserve_batch_size",
        "recserve_compute_latency_seconds",
        "recserve_embedding_lookup_latency_seconds",
        "recserve_queue_latency_seconds",
    }
    totals: dict[str, float] = {}
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            base = name.split("{", 1)[0]
            for suffix in ("_sum", "_count"):
                if base.endswith(suffix) and base[: -len(suffix)] in wanted:
                    totals[base] = totals.get(base, 0.0) + float(value)
    return totals


@dataclass
class Measurement:
    model: str
    server: str  # "recserve:<variant>", "ceiling", "model-only" or "torchserve"
    batch: str  # the batch sizes as RECSERVE_LT_BATCHES takes them: "64" or "1:6,8:3,64:1"
    encoding: str  # "json" or "binary" (peers.ENCODINGS)
    users: int
    seconds: float
    round: int = 1  # which of --rounds measured it
    requests: int = 0
    failures: int = 0
    rps: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    server_cores: float = 0.0
    locust_cores: float = 0.0
    mean_merged_batch: float | None = None
    lookup_ms_per_batch: float | None = None
    compute_ms_per_batch: float | None = None
    queue_ms_per_request: float | None = None
    samples_per_s: float = 0.0
    error: str = ""

    @property
    def batch_label(self) -> str:
        return batch_label(self.batch)


def combine_rounds(rounds: list[Measurement]) -> Measurement:
    """One server's measurements of one cell, one per round, as one: the median of every rate,
    latency and per-batch figure over the rounds that measured them (a round without locust
    stats, ``error`` set, measured nothing: its 0 req/s would pull the median down), the sum
    of requests and failures, the first error."""
    first = rounds[0]
    combined = Measurement(first.model, first.server, first.batch, first.encoding, first.users,
                           first.seconds, round=0)  # fmt: skip
    combined.requests = sum(m.requests for m in rounds)
    combined.failures = sum(m.failures for m in rounds)
    measured = [m for m in rounds if not m.error]
    for name in (
        "rps", "p50_ms", "p99_ms", "server_cores", "locust_cores", "mean_merged_batch",
        "lookup_ms_per_batch", "compute_ms_per_batch", "queue_ms_per_request", "samples_per_s",
    ):  # fmt: skip
        values = [getattr(m, name) for m in measured if getattr(m, name) is not None]
        if values:
            setattr(combined, name, statistics.median(values))
    combined.error = next((m.error for m in rounds if m.error), "")
    return combined


def batch_label(batch: str) -> str:
    """How reports name a cell's batch sizes: ``"64"``, or ``"mix 1:6,8:3,64:1"``."""
    return batch if batch.isdigit() else f"mix {batch}"


def samples_per_second(rows: list[dict[str, Any]]) -> float:
    """Samples/s of one locust run: each request name's req/s times its batch size (names end
    in `` b<size>``, see load_tests/locustfile.py), summed over the names
    (``load_tests.locust_run.rows_per_second``, the load tests' rows/s)."""
    return round(rows_per_second(rows), 1)


def measure(
    *,
    label: str,
    model: str,
    batch: str,
    encoding: str,
    host: str,
    user_class: str,
    server_pid: int,
    env: dict[str, str],
    args: argparse.Namespace,
    out: Path,
    metrics_url: str | None = None,
    round_number: int = 1,
    seconds: float | None = None,
    check_answers: bool = True,
) -> Measurement:
    """One headless locust run of ``seconds`` (default ``args.seconds``) against one server;
    ``check_answers`` False counts every 200 as a success without reading its answer (the
    ceiling servers answer one fixed prediction to a request of any batch size)."""
    seconds = args.seconds if seconds is None else seconds
    sizes = batch.replace(":", "x").replace(",", "-")
    name = f"{model}-{label.replace(':', '-')}-{encoding}-b{sizes}-r{round_number}"
    run = LocustRun(
        users=args.users,
        spawn_rate=args.users,
        seconds=seconds,
        classes=[user_class],
        host=host,
        csv_prefix=out / "locust" / name,
        log_path=out / "locust" / f"{name}.log",
        env={
            **env,
            "RECSERVE_LT_BATCHES": batch,
            "RECSERVE_LT_CHECK_ANSWERS": "1" if check_answers else "0",
        },
    )
    result = Measurement(model, label, batch, encoding, args.users, seconds, round_number)
    before = metric_totals(metrics_url) if metrics_url else {}
    server_cpu = cpu_seconds(server_pid)
    started, started_unix = time.monotonic(), time.time()
    locust = run.start()
    locust_cpu, pid = 0.0, locust.pid
    try:
        while locust.poll() is None and time.monotonic() - started < seconds + LOCUST_OVERRUN_S:
            locust_cpu = max(locust_cpu, cpu_seconds(pid))
            time.sleep(0.5)
        overran = locust.poll() is None
    finally:
        code = run.stop()
    wall = time.monotonic() - started
    result.server_cores = round((cpu_seconds(server_pid) - server_cpu) / wall, 2)
    result.locust_cores = round(locust_cpu / wall, 2)
    rows, result.error = round_stats(run, code, started_unix, overran)
    run_name = f"r{round_number}" if round_number else "warm-up"
    if result.error:
        print(f"  {run_name} {model} {label}: {result.error}", flush=True)
        return result
    total = next(row for row in rows if row["name"] == "Aggregated")
    result.requests, result.failures = total["requests"], total["failures"]
    result.rps, result.p50_ms, result.p99_ms = total["rps"], total["p50_ms"], total["p99_ms"]
    result.samples_per_s = samples_per_second(rows)
    if metrics_url:
        after = metric_totals(metrics_url)

        def delta(key: str) -> float:
            return after.get(key, 0.0) - before.get(key, 0.0)

        batches = delta("recserve_batch_size_count")
        if batches:
            result.mean_merged_batch = round(delta("recserve_batch_size_sum") / batches, 1)
            result.lookup_ms_per_batch = round(
                1000 * delta("recserve_embedding_lookup_latency_seconds_sum") / batches, 3
            )
            result.compute_ms_per_batch = round(
                1000 * delta("recserve_compute_latency_seconds_sum") / batches, 3
            )
        queued = delta("recserve_queue_latency_seconds_count")
        if queued:
            result.queue_ms_per_request = round(
                1000 * delta("recserve_queue_latency_seconds_sum") / queued, 3
            )
    print(
        f"  {run_name} {model:9s} {result.batch_label:5s} {encoding:6s} {label:24s} "
        f"{result.rps:9.1f} req/s  "
        f"p50 {result.p50_ms} ms  p99 {result.p99_ms} ms  failures {result.failures}  "
        f"server {result.server_cores} cores  locust {result.locust_cores} cores",
        flush=True,
    )
    return result


def round_stats(
    run: LocustRun, returncode: int | None, started_unix: float, overran: bool
) -> tuple[list[dict[str, Any]], str]:
    """The stats rows of one round's locust run (``read_stats``' rows, with ``Aggregated``)
    and why they measure nothing (``""`` when they do): a locust still running
    :data:`LOCUST_OVERRUN_S` after the end of its load (stopped), or one that wrote no final
    stats (it crashed: its per-second CSV misses the end of the run, whatever its numbers),
    or exited non-zero for a reason no failed request or task error explains. Exit code 1
    with failed requests is locust's verdict on the server: the round's numbers stand and its
    failures are reported."""
    final, problems = locust_outcome(run, returncode, started_unix)
    if overran:
        return [], (
            f"locust was still running {LOCUST_OVERRUN_S:g} s after the end of its "
            f"{run.seconds:g} s load and was stopped (exit code {returncode})"
        )
    if final is None:
        return [], problems[0]
    total = next((row for row in final["stats"] if row["name"] == "Aggregated"), None)
    if total is None:
        return [], f"locust's final stats ({run.final_stats_path}) have no Aggregated row"
    if returncode != 0 and not (total["failures"] or final.get("exceptions")):
        return [], problems[0]  # locust_outcome's, with the tail of its log
    return list(final["stats"]), ""


def round_order(runs: list[Any], round_number: int) -> list[Any]:
    """The servers of a cell in the order round ``round_number`` (from 1) measures them: as
    given on odd rounds, reversed on even ones, so a drift in the machine's speed does not
    favour one of them."""
    return list(runs) if round_number % 2 else list(runs[::-1])
