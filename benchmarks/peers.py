"""recserve against TorchServe on the same models, the same payloads and the same locust profile.

Both servers get the trained Adult model and the synthetic Criteo-like model
(load_tests/synthetic_model.py). recserve runs ``recserve serve`` (one process per model, flags
per ``--variant``); TorchServe 0.12 runs from its own venv (``--ts-venv``) with
benchmarks/peers_handler.py, ``--ts-workers`` workers per model and TorchServe batching
(``--ts-batch-size`` / ``--ts-max-batch-delay-ms``). Every measurement is a headless locust run
(load_tests/locustfile.py: ``KServeJsonUser`` against recserve's ``/v2/models/model/infer``,
``TorchServeJsonUser`` against TorchServe's ``/predictions/<model>``) with ``--users`` users,
closed loop, for ``--seconds`` seconds, one batch size at a time; both users send
byte-identical KServe v2 JSON bodies (same pool, same seed). recserve and TorchServe runs
alternate for every (model, batch size, encoding), so a noisy neighbour hits both alike.

Before a model's first cell every server gets an unrecorded run per encoding
(``--warmup-seconds``): TorchServe's JVM is much slower cold. ``--rounds N`` measures every
server of a cell N times, in order on odd rounds and reversed on even ones; the report gives
the medians and each round's ratio. SIGTERM stops every process started here.

``--mix SIZE:WEIGHT,...`` (repeatable) adds cells whose requests draw their batch size from
that mix, as load_tests/ does (``--mix 1:6,8:3,64:1`` is the load tests' default profile);
their samples/s add up each size's own req/s times that size.

``--encodings json,binary`` adds the KServe v2 binary tensor extension (default: ``json``
only): ``KServeBinaryUser`` against recserve and ``TorchServeBinaryUser`` against TorchServe
send the same binary bodies (``Inference-Header-Content-Length`` header, binary outputs asked
for), and peers_handler.py answers them in binary too. Every row of the report names its
encoding, and each ratio pairs recserve and TorchServe of the same model, batch and encoding.

    /work/venv/bin/python benchmarks/peers.py --out /tmp/peers

Reports ``peers.md`` / ``peers.csv`` / ``peers.json`` in ``--out``: req/s, samples/s, p50/p99
and the ratios recserve / TorchServe, the CPU each process group used (server, TorchServe,
locust; in cores), recserve's merged batch size and per-batch lookup/compute times from its
``/metrics``, and a prediction cross-check per encoding (the same request answered by both;
``ok`` when they agree to ``CROSS_CHECK_TOLERANCE``).

With ``--ceiling-workers N`` (default 2; 0 skips it) every cell also measures
benchmarks/ceiling_server.py: uvicorn with N processes answering the same requests with a fixed
response and no work at all, under the same locust user. Its req/s bounds what any Python
server on uvicorn can reach here, reported as a ratio to TorchServe next to recserve's. It is
measured for every encoding (it drops binary bodies as it drops JSON ones and always answers
its fixed JSON response).

With ``--model-only-workers N`` (default 0: skip it) every cell also measures the same server
paying for the model's dense model as if requests were merged into calls of 1024 rows, and for
nothing else (``model-only``, see benchmarks/ceiling_server.py): at most what a Python server
on uvicorn that runs this model can reach here. Its latencies mean nothing.

The load generator shares the machine with the servers; its own CPU use is in the report.
Every process is started here and ended by PID; every run is bounded by ``--seconds``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import numpy as np
from machine_info import describe_machine

from load_tests import traffic
from load_tests.locust_run import LocustRun, read_stats
from load_tests.stack import ServeProcess, stop_process, subprocess_env, workers_of

HANDLER = Path(__file__).resolve().with_name("peers_handler.py")
CEILING_CHECKPOINT_ENV = "RECSERVE_CEILING_CHECKPOINT"  # benchmarks/ceiling_server.py reads it
TS_VERSION = "import ts; print(ts.__version__)"
ADULT_TRAIN = REPO_ROOT / "examples" / "adult_income" / "train.py"
#: Wire encodings (``--encodings``) -> locust user class against recserve / TorchServe.
RECSERVE_USERS = {"json": "KServeJsonUser", "binary": "KServeBinaryUser"}
TORCHSERVE_USERS = {"json": "TorchServeJsonUser", "binary": "TorchServeBinaryUser"}
ENCODINGS = tuple(RECSERVE_USERS)
HEADER_LENGTH = "Inference-Header-Content-Length"
#: Largest |recserve - TorchServe| prediction difference the cross-check accepts.
CROSS_CHECK_TOLERANCE = 1e-5


# --------------------------------------------------------------------------- helpers
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def http_json(url: str, body: bytes | None = None, timeout: float = 30.0) -> Any:
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"} if body else {}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def process_tree(pid: int) -> list[Any]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its descendants (alive ones)."""
    import psutil

    total = 0.0
    for process in process_tree(pid):
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
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


def machine_description() -> dict:
    """The machine and this venv's packages. TorchServe runs from its own venv
    (``--ts-venv``): its version is the report's ``torchserve.version``, not listed here,
    where it would read "not installed"."""
    return describe_machine("torch", "numpy", "locust")


# --------------------------------------------------------------------------- checkpoints
def adult_checkpoint(out: Path, given: Path | None) -> Path:
    if given is not None:
        return given.absolute()
    target = out / "checkpoints" / "adult"
    if not (target / "DONE").exists():
        subprocess.run(
            [sys.executable, str(ADULT_TRAIN), "--checkpoint-dir", str(target), "--overwrite"],
            cwd=REPO_ROOT,
            env=subprocess_env(),
            check=True,
            timeout=600,
        )
    return target


def synthetic_checkpoint(out: Path, given: Path | None) -> Path:
    if given is not None:
        return given.absolute()
    from load_tests.synthetic_model import build_synthetic_checkpoint

    target = out / "checkpoints" / "synthetic"
    if not (target / "DONE").exists():
        build_synthetic_checkpoint(target, overwrite=True)
    return target


def handler_bundle(checkpoint: Path, model_name: str, output_transform: str) -> dict[str, Any]:
    """What peers_handler.py needs from the checkpoint's manifests."""
    from embedding_store import checkpoint as embedding_checkpoint
    from embedding_store import model_checkpoint

    manifest = model_checkpoint.read_manifest(checkpoint)
    config = embedding_checkpoint.read_manifest(manifest.embeddings_directory).embedding_config
    slots = []
    for feature in manifest.signature.id_features:
        slot = config.slot(feature.name)
        if not slot.embedding_summation or slot.hash_stack_config.hash_stack_rounds:
            raise SystemExit(
                f"slot {feature.name}: the TorchServe handler supports summed slots without "
                "hash stacking only"
            )
        slots.append(
            {
                "name": feature.name,
                "single_id": feature.single_id,
                "dim": slot.dim,
                "prefix": config.index_prefix(feature.name),
                "mask": config.id_mask,
                "sqrt_scaling": slot.sqrt_scaling,
            }
        )
    return {
        "model_name": model_name,
        "output_transform": output_transform,
        "embeddings_dir": str(manifest.embeddings_directory.absolute()),
        "id_slots": slots,
        "dense_inputs": [
            {"name": f.name, "sample_shape": list(f.sample_shape)}
            for f in manifest.signature.non_id_features
        ],
    }


# --------------------------------------------------------------------------- TorchServe
@dataclass
class TorchServe:
    """TorchServe from its own venv, serving every model with peers_handler.py."""

    venv: Path
    root: Path
    workers: int
    batch_size: int
    max_batch_delay_ms: int
    models: dict[str, tuple[Path, dict[str, Any]]] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    inference: str = ""
    management: str = ""
    pids: set[int] = field(default_factory=set)

    def archive(self) -> None:
        store = self.root / "model_store"
        store.mkdir(parents=True, exist_ok=True)
        for name, (checkpoint, bundle) in self.models.items():
            staging = self.root / "build" / name
            staging.mkdir(parents=True, exist_ok=True)
            shutil.copy(checkpoint / "jit_dense.pt", staging / "jit_dense.pt")
            (staging / "recserve_bundle.json").write_text(json.dumps(bundle, indent=2))
            command = [
                str(self.venv / "bin" / "torch-model-archiver"),
                "--model-name",
                name,
                "--version",
                "1.0",
                "--serialized-file",
                str(staging / "jit_dense.pt"),
                "--handler",
                str(HANDLER),
                "--extra-files",
                str(staging / "recserve_bundle.json"),
                "--export-path",
                str(store),
                "--archive-format",
                "no-archive",
                "--force",
            ]
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)

    def start(self, timeout: float = 300.0) -> TorchServe:
        self.archive()
        ports = [free_port() for _ in range(3)]
        self.inference = f"http://127.0.0.1:{ports[0]}"
        self.management = f"http://127.0.0.1:{ports[1]}"
        models = {
            name: {
                "1.0": {
                    "defaultVersion": True,
                    "marName": name,
                    "minWorkers": self.workers,
                    "maxWorkers": self.workers,
                    "batchSize": self.batch_size,
                    "maxBatchDelay": self.max_batch_delay_ms,
                    "responseTimeout": 120,
                }
            }
            for name in self.models
        }
        config = self.root / "config.properties"
        config.write_text(
            "\n".join(
                [
                    f"inference_address={self.inference}",
                    f"management_address={self.management}",
                    f"metrics_address=http://127.0.0.1:{ports[2]}",
                    f"model_store={self.root / 'model_store'}",
                    f"load_models={','.join(self.models)}",
                    f"default_workers_per_model={self.workers}",
                    "disable_token_authorization=true",
                    "install_py_dep_per_model=false",
                    "disable_system_metrics=true",
                    "job_queue_size=1000",
                    f"models={json.dumps(models)}",
                    "",
                ]
            )
        )
        temporary = self.root / "tmp"  # TorchServe keeps its PID file in TMPDIR: ours alone
        temporary.mkdir(exist_ok=True)
        env = dict(os.environ)
        env.update(
            {
                "TMPDIR": str(temporary),
                "PATH": f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
                "OMP_NUM_THREADS": "1",
                "LOG_LOCATION": str(self.root / "logs"),
                "METRICS_LOCATION": str(self.root / "logs"),
            }
        )
        env.pop("PYTHONPATH", None)
        command = [
            str(self.venv / "bin" / "torchserve"),
            "--start",
            "--foreground",
            "--ncs",
            "--ts-config",
            str(config),
            "--model-store",
            str(self.root / "model_store"),
            "--disable-token-auth",
        ]
        with open(self.root / "torchserve.log", "wb") as log:
            self.process = subprocess.Popen(
                command, cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._remember_pids()
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"torchserve exited with {self.process.returncode}:\n"
                    + (self.root / "torchserve.log").read_text(errors="replace")[-3000:]
                )
            if self.ready():
                return self
            time.sleep(1.0)
        raise RuntimeError(
            f"TorchServe models not ready after {timeout:.0f} s:\n"
            + (self.root / "torchserve.log").read_text(errors="replace")[-3000:]
        )

    def ready(self) -> bool:
        try:
            for name in self.models:
                status = http_json(f"{self.management}/models/{name}", timeout=5)
                workers = status[0].get("workers", [])
                if sum(w.get("status") == "READY" for w in workers) < self.workers:
                    return False
            return True
        except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError):
            return False

    def _remember_pids(self) -> None:
        if self.process is not None:
            self.pids.update(p.pid for p in process_tree(self.process.pid))

    def stop(self) -> None:
        """SIGTERM the Java frontend (it stops its workers), then the launcher; SIGKILL what
        is left of the processes started here, by PID."""
        import psutil

        if self.process is None:
            return
        self._remember_pids()
        for process in process_tree(self.process.pid)[1:2]:  # the Java frontend
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            stop_process(self.process, grace=10)
        for pid in sorted(self.pids):
            try:
                process = psutil.Process(pid)
                process.wait(timeout=5)
            except psutil.TimeoutExpired:
                process.kill()
            except psutil.Error:
                pass


# --------------------------------------------------------------------------- measuring
@dataclass
class Measurement:
    model: str
    server: str  # "recserve:<variant>", "ceiling", "model-only" or "torchserve"
    batch: str  # the batch sizes as RECSERVE_LT_BATCHES takes them: "64" or "1:6,8:3,64:1"
    encoding: str  # "json" or "binary" (ENCODINGS)
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
    latency and per-batch figure, the sum of requests and failures, the first error."""
    first = rounds[0]
    combined = Measurement(first.model, first.server, first.batch, first.encoding, first.users,
                           first.seconds, round=0)  # fmt: skip
    combined.requests = sum(m.requests for m in rounds)
    combined.failures = sum(m.failures for m in rounds)
    for name in (
        "rps", "p50_ms", "p99_ms", "server_cores", "locust_cores", "mean_merged_batch",
        "lookup_ms_per_batch", "compute_ms_per_batch", "queue_ms_per_request", "samples_per_s",
    ):  # fmt: skip
        values = [getattr(m, name) for m in rounds if getattr(m, name) is not None]
        if values:
            setattr(combined, name, statistics.median(values))
    combined.error = next((m.error for m in rounds if m.error), "")
    return combined


def batch_label(batch: str) -> str:
    """How reports name a cell's batch sizes: ``"64"``, or ``"mix 1:6,8:3,64:1"``."""
    return batch if batch.isdigit() else f"mix {batch}"


def samples_per_second(rows: list[dict[str, Any]]) -> float:
    """Samples/s of one locust run: each request name's req/s times its batch size (names end
    in `` b<size>``, see load_tests/locustfile.py), summed over the names."""
    total = 0.0
    for row in rows:
        name, _, size = row["name"].rpartition(" b")
        if row["name"] != "Aggregated" and name and size.isdigit():
            total += row["rps"] * int(size)
    return round(total, 1)


@dataclass
class CeilingServer:
    """benchmarks/ceiling_server.py under uvicorn (``workers`` processes) on a free port; with
    a ``checkpoint``, the model-only server of that checkpoint."""

    workers: int
    log_path: Path
    checkpoint: Path | None = None
    process: subprocess.Popen | None = None
    http: str = ""

    def start(self, timeout: float = 60.0) -> CeilingServer:
        port = free_port()
        command = [
            sys.executable, "-m", "uvicorn", "ceiling_server:app", "--app-dir",
            str(Path(__file__).resolve().parent), "--host", "127.0.0.1", "--port", str(port),
            "--workers", str(self.workers), "--no-access-log", "--log-level", "warning",
        ]  # fmt: skip
        env = dict(os.environ)
        if self.checkpoint is not None:
            env[CEILING_CHECKPOINT_ENV] = str(self.checkpoint)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.http = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ceiling server exited: {self.log_path.read_text()[-2000:]}")
            try:
                http_json(f"{self.http}/v2/live", None, timeout=2.0)
                return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"ceiling server did not answer within {timeout:g} s")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self) -> None:
        stop_process(self.process)


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
) -> Measurement:
    """One headless locust run of ``seconds`` (default ``args.seconds``) against one server."""
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
        env={**env, "RECSERVE_LT_BATCHES": batch},
    )
    result = Measurement(model, label, batch, encoding, args.users, seconds, round_number)
    before = metric_totals(metrics_url) if metrics_url else {}
    server_cpu = cpu_seconds(server_pid)
    started = time.monotonic()
    locust = run.start()
    locust_cpu, pid = 0.0, locust.pid
    try:
        while locust.poll() is None and time.monotonic() - started < seconds + 60:
            locust_cpu = max(locust_cpu, cpu_seconds(pid))
            time.sleep(0.5)
    finally:
        stop_process(locust)
    wall = time.monotonic() - started
    result.server_cores = round((cpu_seconds(server_pid) - server_cpu) / wall, 2)
    result.locust_cores = round(locust_cpu / wall, 2)
    try:
        rows = read_stats(run.csv_prefix)
        total = next(row for row in rows if row["name"] == "Aggregated")
    except (OSError, StopIteration) as error:
        result.error = f"no locust stats: {error!r}"
        return result
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
    run_name = f"r{round_number}" if round_number else "warm-up"
    print(
        f"  {run_name} {model:9s} {result.batch_label:5s} {encoding:6s} {label:24s} "
        f"{result.rps:9.1f} req/s  "
        f"p50 {result.p50_ms} ms  p99 {result.p99_ms} ms  failures {result.failures}  "
        f"server {result.server_cores} cores  locust {result.locust_cores} cores",
        flush=True,
    )
    return result


def round_order(runs: list[Any], round_number: int) -> list[Any]:
    """The servers of a cell in the order round ``round_number`` (from 1) measures them: as
    given on odd rounds, reversed on even ones, so a drift in the machine's speed does not
    favour one of them."""
    return list(runs) if round_number % 2 else list(runs[::-1])


def multi_process(flags: str) -> bool:
    """Whether ``recserve serve`` flags run more than one serving process (``--workers N``
    or ``--workers=N``, the last one given, as the server reads them)."""
    return workers_of(shlex.split(flags)) > 1


def infer(url: str, arrays: dict[str, np.ndarray], encoding: str) -> tuple[dict, np.ndarray]:
    """POST one KServe v2 request of ``arrays`` in ``encoding``: (the answer's JSON part, its
    ``prediction`` values)."""
    if encoding == "binary":
        body, length = traffic.encode_kserve_binary(arrays)
        headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(length)}
    else:
        body, headers = traffic.encode_kserve_json(arrays), {"Content-Type": "application/json"}
    request = urllib.request.Request(url, data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=30.0) as response:
        answer, header_length = response.read(), response.headers.get(HEADER_LENGTH)
    if encoding == "binary" and header_length is None:
        raise ValueError(f"a binary request was answered without {HEADER_LENGTH}")
    return decode_answer(answer, header_length)


def decode_answer(body: bytes, header_length: str | None) -> tuple[dict, np.ndarray]:
    """A KServe v2 infer answer, JSON or binary extension (``header_length`` given): (its JSON
    part, the ``prediction`` output as float64); raises ValueError if binary sizes are off."""
    if header_length is None:
        document = json.loads(body)
        output = next(o for o in document["outputs"] if o["name"] == "prediction")
        return document, np.asarray(output["data"], dtype=np.float64)
    size = int(header_length)
    document = json.loads(body[:size])
    offset, values = size, None
    for output in document["outputs"]:
        nbytes = (output.get("parameters") or {}).get("binary_data_size")
        if nbytes is None:
            array = np.asarray(output["data"], dtype=np.float64)
        else:
            if output["datatype"] != "FP32" or nbytes != 4 * int(np.prod(output["shape"])):
                raise ValueError(f"output {output['name']!r}: {nbytes} bytes for {output}")
            array = np.frombuffer(body, "<f4", count=nbytes // 4, offset=offset)
            offset += nbytes
        if output["name"] == "prediction":
            values = array.astype(np.float64)
    if offset != len(body) or values is None:
        raise ValueError(f"binary answer of {len(body)} bytes: {offset} claimed, {document}")
    return document, values


def cross_check(
    recserve_url: str,
    torchserve_url: str,
    model: str,
    arrays: dict[str, np.ndarray],
    encoding: str = "json",
) -> dict[str, Any]:
    """The same KServe v2 request (``encoding``) to both servers: predictions must agree."""
    try:
        ours, a = infer(f"{recserve_url}/v2/models/model/infer", arrays, encoding)
        _, b = infer(f"{torchserve_url}/predictions/{model}", arrays, encoding)
        difference = float(np.max(np.abs(a - b))) if len(a) == len(b) else None
        return {
            "samples": len(a),
            "max_abs_diff": difference,
            "unknown_ids": ours.get("parameters", {}).get("unknown_ids"),
            "ok": difference is not None and difference <= CROSS_CHECK_TOLERANCE,
        }
    except Exception as error:
        return {"error": repr(error), "ok": False}


# --------------------------------------------------------------------------- report
def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 2)


#: The reference servers of benchmarks/ceiling_server.py, as report tables name them.
REFERENCES = {"ceiling": "no-work ceiling", "model-only": "model-only"}


def reference_table(by_key: dict[tuple[str, str, str, str], Measurement]) -> list[str]:
    """Markdown lines comparing each cell's reference servers (``REFERENCES``) with TorchServe
    and with the best recserve variant of the cell (median req/s); none if none was measured."""
    cells = list(dict.fromkeys(
        (m.model, m.batch, m.encoding) for m in by_key.values() if m.server in REFERENCES
    ))  # fmt: skip
    if not cells:
        return []
    measured = [label for label in REFERENCES if any(key[1] == label for key in by_key)]
    header = "| model | batch | encoding |"
    for label in measured:
        name = REFERENCES[label]
        header += f" {name} req/s | {name} / TorchServe | best recserve / {name} |"
    lines = ["", header, "|---|---:|---|" + "---:|---:|---:|" * len(measured)]
    for model, batch, encoding in cells:
        peer = by_key.get((model, "torchserve", batch, encoding))
        best = max(
            (m.rps for m in by_key.values()
             if m.server.startswith("recserve:") and (m.model, m.batch, m.encoding)
             == (model, batch, encoding)),
            default=None,
        )  # fmt: skip
        line = f"| {model} | {batch_label(batch)} | {encoding} |"
        for label in measured:
            reference = by_key.get((model, label, batch, encoding))
            if reference is None:
                line += " - | - | - |"
                continue
            line += (
                f" {reference.rps:.0f} | {ratio(reference.rps, peer.rps if peer else None)} | "
                f"{ratio(best, reference.rps)} |"
            )
        lines.append(line)
    return lines


def report(
    out: Path,
    measurements: list[Measurement],
    variants: dict[str, str],
    info: dict[str, Any],
) -> str:
    with open(out / "peers.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(Measurement.__dataclass_fields__))
        writer.writeheader()
        for m in measurements:
            writer.writerow(m.__dict__)
    # With --rounds, each server of a cell was measured once per round: the tables give the
    # medians, and the ratio of each round's pair shows how far one run can be trusted.
    rounds: dict[tuple[str, str, str, str], list[Measurement]] = {}
    for m in measurements:
        rounds.setdefault((m.model, m.server, m.batch, m.encoding), []).append(m)
    by_key = {key: combine_rounds(runs) for key, runs in rounds.items()}
    lines = [
        "| model | batch | encoding | recserve flags | recserve req/s | TorchServe req/s | "
        "rps ratio | rps ratio per round | recserve p99 ms | TorchServe p99 ms | p99 ratio | "
        "goal (>= 2x, p99 <=) |",
        "|---|---:|---|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    verdicts = []
    for key, m in by_key.items():
        if not m.server.startswith("recserve:"):
            continue
        peer_key = (m.model, "torchserve", m.batch, m.encoding)
        peer = by_key.get(peer_key)
        peer_rounds = {p.round: p for p in rounds.get(peer_key, [])}
        per_round = " / ".join(
            str(ratio(r.rps, peer_rounds[r.round].rps))
            for r in rounds[key]
            if r.round in peer_rounds
        )
        rps_ratio = ratio(m.rps, peer.rps if peer else None)
        p99_ratio = ratio(m.p99_ms, peer.p99_ms if peer else None)
        met = rps_ratio is not None and p99_ratio is not None and rps_ratio >= 2 and p99_ratio <= 1
        if peer is not None:
            verdicts.append(met)
        variant = m.server.split(":", 1)[1]
        flags = variants.get(variant) or "(defaults)"
        lines.append(
            f"| {m.model} | {m.batch_label} | {m.encoding} | {variant}: `{flags}` | {m.rps:.0f} | "
            f"{peer.rps if peer else float('nan'):.0f} | {rps_ratio} | {per_round or '-'} | "
            f"{m.p99_ms} | "
            f"{peer.p99_ms if peer else '-'} | {p99_ratio} | {'met' if met else 'not met'} |"
        )
    lines += reference_table(by_key)
    lines += [
        "",
        "| model | batch | encoding | server | round | req/s | samples/s | p50 ms | p99 ms | "
        "failures | server cores | locust cores | merged batch | lookup ms/batch | "
        "compute ms/batch | queue ms/req |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in measurements:
        lines.append(
            f"| {m.model} | {m.batch_label} | {m.encoding} | {m.server} | {m.round} | "
            f"{m.rps:.0f} | "
            f"{m.samples_per_s:.0f} | "
            f"{m.p50_ms} | {m.p99_ms} | {m.failures} | {m.server_cores} | {m.locust_cores} | "
            f"{_dash(m.mean_merged_batch)} | {_dash(m.lookup_ms_per_batch)} | "
            f"{_dash(m.compute_ms_per_batch)} | {_dash(m.queue_ms_per_request)} |"
        )
    summary = "\n".join(lines)
    info["goal_met_everywhere"] = bool(verdicts) and all(verdicts)
    (out / "peers.json").write_text(
        json.dumps(
            {**info, "measurements": [m.__dict__ for m in measurements]}, indent=2, default=str
        )
    )
    (out / "peers.md").write_text(
        f"# recserve vs TorchServe\n\n```\n{json.dumps(info, indent=2, default=str)}\n```\n\n"
        f"{summary}\n"
    )
    return summary


def _dash(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


# --------------------------------------------------------------------------- main
def batches_argument(text: str) -> list[int]:
    """``--batches``: a comma list of batch sizes >= 1, in order, without repeats."""
    try:
        sizes = list(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    except ValueError:
        sizes = [0]
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(
            f"bad batch sizes {text!r}: use a comma list of integers >= 1"
        )
    return sizes


def mix_argument(text: str) -> str:
    """``--mix``: a batch mix SIZE:WEIGHT,... as load_tests/ reads it, normalized."""
    try:
        sizes, weights = traffic.parse_batch_mix(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bad batch mix {text!r}: use SIZE:WEIGHT,... with sizes >= 1 and weights > 0"
        ) from None
    return ",".join(f"{size}:{weight:g}" for size, weight in zip(sizes, weights))


def encodings_argument(text: str) -> list[str]:
    """``--encodings``: a comma list of ENCODINGS, in order, without repeats."""
    names = list(dict.fromkeys(e.strip() for e in text.split(",") if e.strip()))
    unknown = [e for e in names if e not in ENCODINGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown encoding(s) {', '.join(unknown) or repr(text)}: use a comma list of "
            f"{', '.join(ENCODINGS)}"
        )
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("peers-out"))
    parser.add_argument("--models", default="adult,synthetic")
    parser.add_argument("--adult-checkpoint", type=Path, default=None)
    parser.add_argument("--synthetic-checkpoint", type=Path, default=None)
    parser.add_argument(
        "--batches",
        type=batches_argument,
        default="1,64",
        help="batch sizes, one cell each: a comma list of sizes (may be empty with --mix); "
        "default: 1,64",
    )
    parser.add_argument(
        "--mix",
        action="append",
        type=mix_argument,
        default=[],
        help="a cell whose requests draw their batch size from SIZE:WEIGHT,... (repeatable); "
        "1:6,8:3,64:1 is the load tests' default profile",
    )
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        default=10.0,
        help="an unrecorded locust run per server and encoding before a model's first cell "
        "(0: none; default 10)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every server of every cell this many times, alternating their order; "
        "the tables give medians and each round's ratio (default 1)",
    )
    parser.add_argument(
        "--encodings",
        type=encodings_argument,
        default="json",
        help="wire encodings to measure, a comma list of json (KServe v2 JSON) and binary "
        "(KServe v2 binary tensor extension); default: json",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=None,
        help='recserve flag set NAME="FLAGS" (repeatable); default: default=""',
    )
    parser.add_argument("--ts-venv", type=Path, default=Path("/work/ts-venv"))
    parser.add_argument("--ts-workers", type=int, default=2)
    parser.add_argument("--ts-batch-size", type=int, default=16)
    parser.add_argument("--ts-max-batch-delay-ms", type=int, default=5)
    parser.add_argument("--skip-torchserve", action="store_true")
    parser.add_argument(
        "--ceiling-workers",
        type=int,
        default=2,
        help="uvicorn processes of the no-work ceiling server (0: skip it)",
    )
    parser.add_argument(
        "--model-only-workers",
        type=int,
        default=0,
        help="uvicorn processes of the model-only server, which pays for the dense model on "
        "merged batches and for nothing else (0, the default: skip it)",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.users <= 512 or not 0 < args.seconds <= 600 or not 1 <= args.rounds <= 10:
        parser.error("bounded runs only: 1..512 users, at most 600 s per run, 1..10 rounds")
    for flag, workers in (("--ceiling-workers", args.ceiling_workers),
                          ("--model-only-workers", args.model_only_workers)):  # fmt: skip
        if not 0 <= workers <= 8:
            parser.error(f"{flag} must be within 0..8, got {workers}")
    if not 0 <= args.warmup_seconds <= 120:
        parser.error(f"--warmup-seconds must be within 0..120, got {args.warmup_seconds:g}")
    if not args.batches and not args.mix:
        parser.error("nothing to measure: give --batches or --mix")
    return args


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # unwinds: every server started is stopped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.skip_torchserve and not (args.ts_venv / "bin" / "torchserve").exists():
        # A comparison without its peer would only print nan ratios.
        print(
            f"peers.py: error: --ts-venv {args.ts_venv} has no bin/torchserve: make that venv "
            "(docs/BENCHMARKS.md, 'TorchServe') or give --skip-torchserve",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    out = args.out.absolute()
    (out / "locust").mkdir(parents=True, exist_ok=True)
    variants = dict(v.partition("=")[::2] for v in (args.variant or ["default="]))
    batches = [str(size) for size in args.batches] + args.mix
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    checkpoints = {}
    for name in names:
        if name == "adult":
            checkpoints[name] = adult_checkpoint(out, args.adult_checkpoint)
        elif name == "synthetic":
            checkpoints[name] = synthetic_checkpoint(out, args.synthetic_checkpoint)
        else:
            raise SystemExit(f"unknown model {name!r}: adult or synthetic")
    info: dict[str, Any] = {
        "machine": machine_description(),
        "users": args.users,
        "seconds_per_run": args.seconds,
        "rounds": args.rounds,
        "warmup_seconds_per_server_and_encoding": args.warmup_seconds,
        "batches": batches,
        "encodings": args.encodings,
        "variants": variants,
        "torchserve": {
            "venv": str(args.ts_venv),
            "workers": args.ts_workers,
            "batch_size": args.ts_batch_size,
            "max_batch_delay_ms": args.ts_max_batch_delay_ms,
        },
        "ceiling_workers": args.ceiling_workers,
        "model_only_workers": args.model_only_workers,
        "checkpoints": {k: str(v) for k, v in checkpoints.items()},
    }
    torchserve: TorchServe | None = None
    measurements: list[Measurement] = []
    try:
        if not args.skip_torchserve:
            torchserve = TorchServe(
                args.ts_venv,
                out / "torchserve",
                args.ts_workers,
                args.ts_batch_size,
                args.ts_max_batch_delay_ms,
                {
                    name: (path, handler_bundle(path, name, "sigmoid"))
                    for name, path in checkpoints.items()
                },
            )
            (out / "torchserve").mkdir(parents=True, exist_ok=True)
            try:
                version = subprocess.run(
                    [str(args.ts_venv / "bin" / "python"), "-c", TS_VERSION],
                    capture_output=True,
                    text=True,
                    timeout=60,
                ).stdout.strip()
                info["torchserve"]["version"] = version
                started = time.monotonic()
                torchserve.start()
                info["torchserve"]["startup_s"] = round(time.monotonic() - started, 1)
            except Exception as error:
                info["torchserve"]["error"] = f"{type(error).__name__}: {error}"
                print(f"TorchServe could not start: {error}", file=sys.stderr)
                torchserve.stop()
                torchserve = None
        for name, checkpoint in checkpoints.items():
            servers: dict[str, ServeProcess] = {}
            ceilings: dict[str, CeilingServer] = {}
            try:
                if args.ceiling_workers > 0:
                    ceilings["ceiling"] = CeilingServer(
                        args.ceiling_workers, out / f"ceiling-{name}.log"
                    ).start()
                if args.model_only_workers > 0:
                    ceilings["model-only"] = CeilingServer(
                        args.model_only_workers, out / f"model-only-{name}.log", checkpoint
                    ).start()
                for variant, flags in variants.items():
                    servers[variant] = ServeProcess(
                        checkpoint,
                        out / f"serve-{name}-{variant}.log",
                        extra_args=["--output-transform", "sigmoid", *shlex.split(flags)],
                    ).start()
                first = next(iter(servers.values()))
                metadata = traffic.fetch_metadata(first.http, "model")
                metadata_file = out / f"{name}-metadata.json"
                metadata_file.write_text(json.dumps(metadata))
                vocab = out / f"{name}-vocab.npz"
                traffic.save_vocab(traffic.vocab_from_checkpoint(checkpoint), vocab)
                env = {
                    "RECSERVE_LT_MODEL": "model",
                    "RECSERVE_LT_TS_MODEL": name,
                    "RECSERVE_LT_METADATA_FILE": str(metadata_file),
                    "RECSERVE_LT_VOCAB": str(vocab),
                    "RECSERVE_LT_SEED": "7",
                }
                if torchserve is not None:
                    inputs = traffic.ModelInputs.from_metadata(metadata)
                    generator = traffic.TrafficGenerator(
                        inputs, traffic.TrafficProfile(seed=3), traffic.load_vocab(vocab)
                    )
                    arrays = generator.arrays(64)
                    for encoding in args.encodings:
                        check = cross_check(
                            first.http, torchserve.inference, name, arrays, encoding
                        )
                        info.setdefault("cross_check", {}).setdefault(name, {})[encoding] = check
                        print(f"{name}: cross-check {encoding} {check}", flush=True)

                def server_runs(encoding: str) -> list[dict[str, Any]]:
                    """measure() arguments of every server of a cell in ``encoding``."""
                    runs = [
                        dict(
                            label=f"recserve:{variant}",
                            host=server.http,
                            user_class=RECSERVE_USERS[encoding],
                            server_pid=server.pid,
                            # /metrics of one process only: skip with --workers > 1
                            metrics_url=(None if multi_process(variants[variant]) else server.http),
                        )
                        for variant, server in servers.items()
                    ]
                    runs += [
                        dict(
                            label=label,
                            host=ceiling.http,
                            user_class=RECSERVE_USERS[encoding],
                            server_pid=ceiling.pid,
                        )
                        for label, ceiling in ceilings.items()
                    ]
                    if torchserve is not None:
                        runs.append(
                            dict(
                                label="torchserve",
                                host=torchserve.inference,
                                user_class=TORCHSERVE_USERS[encoding],
                                server_pid=torchserve.process.pid,
                            )
                        )
                    return runs

                common = dict(model=name, env=env, args=args, out=out)
                if args.warmup_seconds > 0:
                    # TorchServe's JVM and every server's first code paths warm up under load:
                    # measured cold, TorchServe's first cell ran at ~55% of its later speed.
                    for encoding in args.encodings:
                        for run in server_runs(encoding):
                            measure(
                                **run,
                                **common,
                                batch=batches[0],
                                encoding=encoding,
                                round_number=0,
                                seconds=args.warmup_seconds,
                            )
                for batch in batches:
                    for encoding in args.encodings:
                        # Every server of this cell: the same model, batch size, encoding, load
                        # and output.
                        runs = server_runs(encoding)
                        for round_number in range(1, args.rounds + 1):
                            for run in round_order(runs, round_number):
                                measurements.append(
                                    measure(
                                        **run,
                                        **common,
                                        batch=batch,
                                        encoding=encoding,
                                        round_number=round_number,
                                    )
                                )
            finally:
                for server in servers.values():
                    server.stop()
                for ceiling in ceilings.values():
                    ceiling.stop()
    finally:
        if torchserve is not None:
            torchserve.stop()
    info["loadavg_at_end"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
    summary = report(out, measurements, variants, info)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
