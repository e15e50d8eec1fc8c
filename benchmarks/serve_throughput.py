"""``recserve serve`` throughput and latency vs the same model called in-process.

Against a ``recserve serve`` subprocess of the UCI Adult checkpoint (trained here, 1 epoch, when
``--checkpoint`` is not given; sigmoid outputs, default dynamic batching: 256 samples / 2 ms),
``--clients`` client threads (default 8) send requests back to back for ``--seconds`` per slice:

- ``http``: KServe v2 REST with the binary tensor extension (inputs and output binary) over one
  raw ``http.client`` keep-alive connection per thread;
- ``grpc``: KServe v2 ``ModelInfer`` with ``raw_input_contents`` through
  :class:`serving.grpc_frontend.InferenceStub`, one channel per thread;
- ``in-process`` (the baseline): ``LoadedModel.infer`` on the same batches in one thread of this
  process, one torch thread like the server (validation, codecs, batching, transport excluded).

Batch sizes 1 and 64 (``--batch-sizes``); 16 different batches of real test rows are cycled.
Each slice interleaves every (batch size, mode) pair, ``--rounds`` times; rps is the median over
rounds, latency percentiles pool every request. Ratios are served / in-process.

Per served mode it also reports CPU microseconds per request of the server process
(``/proc/PID/stat``) and of this process (the client threads, ``time.process_time``), pooled
over the rounds: client and server share the machine's cores, and these say which of the two
a mode's rate is bound by (the server's CPU per request over HTTP vs gRPC, say) where rps alone
cannot.

Run: ``python benchmarks/serve_throughput.py [--checkpoint DIR] [--seconds 3] [--rounds 2]
[--clients 8]``.
Clients and server share the machine's cores (and the client threads one GIL).
"""

from __future__ import annotations

import sys
from pathlib import Path

# The repository root, for the example's feature definitions (examples/ is not installed).
_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(_ROOT))

import argparse
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import grpc
import numpy as np
import torch
from google.protobuf.message import Message
from machine_info import describe_machine

from embedding_store.batch import Batch
from embedding_store.cli_types import non_negative_float, positive_float, positive_int
from examples.adult_income import features
from load_tests.stack import sigterm_exits
from serving.grpc_frontend import InferenceStub
from serving.model import LoadedModel, load_model
from serving.proto import V2

MODEL = "model"
DISTINCT_BATCHES = 16
_SERVING_LINE = re.compile(r"HTTP listening on ([^\s,]+):(\d+), gRPC listening on ([^\s,]+):(\d+)")


# --------------------------------------------------------------------------- requests
def _arrays(batch: Batch) -> list[tuple[str, str, np.ndarray]]:
    out = [
        (f.name, "UINT64", np.ascontiguousarray(f.values, dtype="<u8"))
        for f in batch.id_type_features
    ]
    for dense in batch.non_id_type_features:
        if dense.name is None:
            raise ValueError("every dense feature of a request needs a name")
        out.append((dense.name, "FP32", np.ascontiguousarray(dense.data, dtype="<f4")))
    return out


def http_binary_body(batch: Batch) -> tuple[bytes, str]:
    """(body, Inference-Header-Content-Length) of a binary-extension infer request."""
    arrays = _arrays(batch)
    header = {
        "inputs": [
            {
                "name": name,
                "datatype": datatype,
                "shape": list(array.shape),
                "parameters": {"binary_data_size": array.nbytes},
            }
            for name, datatype, array in arrays
        ],
        "outputs": [{"name": "prediction", "parameters": {"binary_data": True}}],
    }
    encoded = json.dumps(header).encode()
    return encoded + b"".join(a.tobytes() for _, _, a in arrays), str(len(encoded))


def grpc_request(batch: Batch) -> Message:
    arrays = _arrays(batch)
    request = V2.ModelInferRequest(model_name=MODEL)
    for name, datatype, array in arrays:
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, datatype
        tensor.shape.extend(array.shape)
        request.raw_input_contents.append(array.tobytes())
    return request


# --------------------------------------------------------------------------- measurement
@dataclass
class Stats:
    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    rps_per_round: list[float] = field(default_factory=list)
    #: CPU seconds of the server process and of this one (the clients) during the slices.
    server_cpu: float = 0.0
    client_cpu: float = 0.0


def cpu_seconds_of_stat(stat: str, ticks_per_second: int) -> float:
    """User + system CPU seconds from the text of ``/proc/PID/stat`` (fields 14 and 15; the
    command name, field 2, is in parentheses and may hold spaces and parentheses itself)."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / ticks_per_second


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (every thread) so far."""
    with open(f"/proc/{pid}/stat") as stat:
        return cpu_seconds_of_stat(stat.read(), os.sysconf("SC_CLK_TCK"))


def per_request_us(cpu_seconds: float, requests: int) -> float:
    """CPU microseconds per request; NaN when no request was made."""
    return cpu_seconds / requests * 1e6 if requests else float("nan")


def _http_client(
    address: tuple[str, int],
    bodies: list[tuple[bytes, str]],
    batch_size: int,
    stop_at: float,
    out: Stats,
) -> None:
    """One client thread: binary-extension requests back to back until ``stop_at``. A
    request that fails in transport (refused, reset, timed out) is an error like a wrong
    answer, and the next one opens a new connection: an exception must not end the thread,
    which took its requests and errors with it (a server that died read as 0 errors)."""
    connection = http.client.HTTPConnection(*address, timeout=30)
    latencies, errors, i = [], 0, 0
    headers = {"Content-Type": "application/octet-stream"}
    try:
        while time.perf_counter() < stop_at:
            body, header_length = bodies[i % len(bodies)]
            i += 1
            headers["Inference-Header-Content-Length"] = header_length
            started = time.perf_counter()
            try:
                connection.request("POST", f"/v2/models/{MODEL}/infer", body=body, headers=headers)
                response = connection.getresponse()
                payload = response.read()
                json_size = int(response.getheader("Inference-Header-Content-Length") or -1)
                ok = response.status == 200 and len(payload) - json_size == 4 * batch_size
            except (OSError, http.client.HTTPException, ValueError):
                connection.close()  # reopened by the next request
                ok = False
            latencies.append(time.perf_counter() - started)
            errors += not ok
    finally:
        connection.close()
        out.latencies.extend(latencies)
        out.errors += errors


def _grpc_client(
    target: str, requests: list[Message], batch_size: int, stop_at: float, out: Stats
) -> None:
    with grpc.insecure_channel(target) as channel:
        infer = InferenceStub(channel).ModelInfer
        latencies, errors, i = [], 0, 0
        while time.perf_counter() < stop_at:
            request = requests[i % len(requests)]
            i += 1
            started = time.perf_counter()
            try:
                response = infer(request, timeout=30)
                contents = response.raw_output_contents
                ok = len(contents) == 1 and len(contents[0]) == 4 * batch_size
            except grpc.RpcError:
                ok = False
            latencies.append(time.perf_counter() - started)
            errors += not ok
    out.latencies.extend(latencies)
    out.errors += errors


def run_clients(
    target: tuple[str, int] | str,
    function: Callable[..., None],
    payloads: list,
    batch_size: int,
    clients: int,
    seconds: float,
) -> Stats:
    """``clients`` threads calling back to back for ``seconds``: (requests, errors, latencies)."""
    local = Stats()
    stop_at = time.perf_counter() + seconds
    threads = [
        threading.Thread(target=function, args=(target, payloads, batch_size, stop_at, local))
        for _ in range(clients)
    ]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    local.seconds = time.perf_counter() - started
    local.requests = len(local.latencies)
    return local


def run_in_process(model: LoadedModel, batches: list[Batch], seconds: float) -> Stats:
    local = Stats()
    stop_at = time.perf_counter() + seconds
    i = 0
    started = time.perf_counter()
    while time.perf_counter() < stop_at:
        t = time.perf_counter()
        model.infer(batches[i % len(batches)])
        local.latencies.append(time.perf_counter() - t)
        i += 1
    local.seconds = time.perf_counter() - started
    local.requests = len(local.latencies)
    return local


# --------------------------------------------------------------------------- setup
def train_checkpoint(directory: Path) -> Path:
    print(f"training a 1-epoch Adult checkpoint into {directory} ...", file=sys.stderr)
    subprocess.run(
        [
            sys.executable,
            str(_ROOT / "examples" / "adult_income" / "train.py"),
            "--checkpoint-dir",
            str(directory),
            "--epochs",
            "1",
        ],
        check=True,
        cwd=_ROOT,
        stdout=sys.stderr,
    )
    return directory


def start_server(
    checkpoint: Path, log_path: Path, server_threads: int, queue_delay_ms: float
) -> tuple[subprocess.Popen[bytes], tuple[str, int], str]:
    env = dict(os.environ, PYTHONPATH=str(_ROOT))
    args = [
        sys.executable,
        "-m",
        "embedding_store.cli",
        "serve",
        "--checkpoint",
        str(checkpoint),
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        "--output-transform",
        "sigmoid",
        "--threads",
        str(server_threads),
        "--max-queue-delay-ms",
        str(queue_delay_ms),
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(args, cwd=_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:  # the caller holds no handle yet: whatever ends the wait stops the server here
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            match = _SERVING_LINE.search(log_path.read_text(errors="replace"))
            if match:
                return process, (match[1], int(match[2])), f"{match[3]}:{match[4]}"
            if process.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"recserve serve did not start:\n{log_path.read_text()[-3000:]}")
    except BaseException:  # Ctrl-C and SIGTERM (SystemExit) too
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
        raise


def machine() -> dict:
    return describe_machine("torch", "grpcio", "numpy")


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) * 1000 if values else float("nan")


#: The largest batch size: DISTINCT_BATCHES of it must come from the Adult test set (16,281
#: rows), or a mode would have no request to send.
MAX_BATCH_SIZE = 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; argparse error (exit 2) before anything starts for a value that
    would measure nothing (0 rounds, seconds, clients; a batch size with no test batch) or
    run unbounded."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: train one")
    parser.add_argument(
        "--seconds", type=positive_float, default=3.0, help="per mode, batch and round"
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=2,
        help="rounds over every mode and batch (default 2)",
    )
    parser.add_argument("--clients", type=positive_int, default=8, help="concurrent client threads")
    parser.add_argument(
        "--batch-sizes",
        type=positive_int,
        nargs="+",
        default=[1, 64],
        help="rows per request, one measurement each (default 1 64)",
    )
    parser.add_argument(
        "--server-threads", type=positive_int, default=1, help="torch threads (both)"
    )
    parser.add_argument(
        "--max-queue-delay-ms",
        type=non_negative_float,
        default=2.0,
        help="the server's batching window",
    )
    args = parser.parse_args(argv)
    if args.seconds > 600 or args.rounds > 100 or args.clients > 256:
        parser.error("bounded runs only: at most 600 --seconds, 100 --rounds, 256 --clients")
    if max(args.batch_sizes) > MAX_BATCH_SIZE:
        parser.error(
            f"--batch-sizes: at most {MAX_BATCH_SIZE} ({DISTINCT_BATCHES} batches of Adult "
            f"test rows each), got {max(args.batch_sizes)}"
        )
    if args.checkpoint is not None and not args.checkpoint.is_dir():
        parser.error(f"--checkpoint {args.checkpoint}: no such directory")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print its results. SIGTERM (``timeout``, a CI job's end) unwinds
    it as SystemExit(143), so the server started here is stopped: it used to live on."""
    with sigterm_exits():
        benchmark(argv)


def benchmark(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    torch.set_num_threads(args.server_threads)
    with tempfile.TemporaryDirectory(prefix="recserve-bench-") as scratch:
        checkpoint = args.checkpoint or train_checkpoint(Path(scratch) / "adult")
        model = load_model(checkpoint, name=MODEL, output_transform="sigmoid")
        process, http_address, grpc_target = start_server(
            checkpoint, Path(scratch) / "serve.log", args.server_threads, args.max_queue_delay_ms
        )
        try:
            results = measure(args, model, http_address, grpc_target, process.pid)
        finally:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
            model.close()
        report(args, checkpoint, results)


def measure(
    args: argparse.Namespace,
    model: LoadedModel,
    http_address: tuple[str, int],
    grpc_target: str,
    server_pid: int,
) -> dict[tuple[int, str], Stats]:
    payloads: dict[int, dict[str, list[Any]]] = {}
    for batch_size in args.batch_sizes:
        batches = list(
            islice(
                features.read_batches(features.TEST_PATH, batch_size, requires_grad=False),
                DISTINCT_BATCHES,
            )
        )
        batches = [b for b in batches if b.batch_size == batch_size]
        payloads[batch_size] = {
            "in-process": batches,
            "http": [http_binary_body(b) for b in batches],
            "grpc": [grpc_request(b) for b in batches],
        }
    modes = ("in-process", "http", "grpc")
    results = {(b, m): Stats() for b in args.batch_sizes for m in modes}

    def once(batch_size: int, mode: str, seconds: float) -> Stats:
        data = payloads[batch_size][mode]
        if mode == "in-process":
            return run_in_process(model, data, seconds)
        server_before, client_before = process_cpu_seconds(server_pid), time.process_time()
        if mode == "http":
            local = run_clients(http_address, _http_client, data, batch_size, args.clients, seconds)
        else:
            local = run_clients(grpc_target, _grpc_client, data, batch_size, args.clients, seconds)
        local.server_cpu = process_cpu_seconds(server_pid) - server_before
        local.client_cpu = time.process_time() - client_before
        return local

    for batch_size in args.batch_sizes:  # warm-up: connections, TorchScript, caches
        for mode in modes:
            once(batch_size, mode, 0.5)
    for round_index in range(args.rounds):
        for batch_size in args.batch_sizes:
            for mode in modes:
                local = once(batch_size, mode, args.seconds)
                total = results[(batch_size, mode)]
                total.requests += local.requests
                total.errors += local.errors
                total.seconds += local.seconds
                total.latencies.extend(local.latencies)
                total.server_cpu += local.server_cpu
                total.client_cpu += local.client_cpu
                total.rps_per_round.append(local.requests / local.seconds)
                print(
                    f"round {round_index + 1}/{args.rounds} batch {batch_size:>3} {mode:>10}: "
                    f"{local.requests / local.seconds:9.1f} rps",
                    file=sys.stderr,
                )
    return results


def _cpu_cell(us: float | None) -> str:
    return f"{'-':>13}" if us is None else f"{us:>13.0f}"


def report(
    args: argparse.Namespace, checkpoint: Path, results: dict[tuple[int, str], Stats]
) -> None:
    rows: list[dict[str, Any]] = []
    for (batch_size, mode), stats in results.items():
        rps = statistics.median(stats.rps_per_round)
        base = statistics.median(results[(batch_size, "in-process")].rps_per_round)
        base_p50 = percentile(results[(batch_size, "in-process")].latencies, 50)
        rows.append(
            {
                "batch_size": batch_size,
                "mode": mode,
                "clients": 1 if mode == "in-process" else args.clients,
                "rps": rps,
                "samples_per_s": rps * batch_size,
                "p50_ms": percentile(stats.latencies, 50),
                "p99_ms": percentile(stats.latencies, 99),
                "requests": stats.requests,
                "errors": stats.errors,
                "rps_vs_in_process": rps / base,
                "p50_vs_in_process": percentile(stats.latencies, 50) / base_p50,
                # Served modes only (the in-process baseline has no server).
                "server_cpu_us_per_request": per_request_us(stats.server_cpu, stats.requests)
                if mode != "in-process"
                else None,
                "client_cpu_us_per_request": per_request_us(stats.client_cpu, stats.requests)
                if mode != "in-process"
                else None,
            }
        )
    header = (
        f"{'batch':>5} {'mode':>10} {'clients':>7} {'rps':>9} {'samples/s':>10} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'errors':>6} {'rps/inproc':>10} {'p50/inproc':>10} "
        f"{'server us/req':>13} {'client us/req':>13}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['batch_size']:>5} {r['mode']:>10} {r['clients']:>7} {r['rps']:>9.1f} "
            f"{r['samples_per_s']:>10.0f} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} "
            f"{r['errors']:>6} {r['rps_vs_in_process']:>10.3f} {r['p50_vs_in_process']:>10.1f} "
            f"{_cpu_cell(r['server_cpu_us_per_request'])} "
            f"{_cpu_cell(r['client_cpu_us_per_request'])}"
        )
    print(
        json.dumps(
            {
                "benchmark": "serving",
                "checkpoint": str(checkpoint),
                "seconds": args.seconds,
                "rounds": args.rounds,
                "clients": args.clients,
                "server_threads": args.server_threads,
                "max_queue_delay_ms": args.max_queue_delay_ms,
                "machine": machine(),
                "results": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
