"""Start a recserve serving stack on loopback, load it with locust, write a summary.

Embedded tier (one ``recserve serve`` process holding the embeddings)::

    python load_tests/run.py --checkpoint runs/adult --users 16 --seconds 60 --out lt-out

Remote tier (LocalCluster: 2 parameter servers in Infer mode loading the checkpoint's
embeddings read-only + 1 embedding worker; ``recserve serve --embedding-workers``)::

    python load_tests/run.py --synthetic --tier remote --users 16 --seconds 60 --out lt-out

Soak (bounded): ``--soak --minutes 10`` samples the RSS of every process of the stack (the
server, and in the remote tier each parameter server and the embedding worker), writes a new
checkpoint version into the served directory (atomically: staged copy, then rename) and
reloads it via ``POST /admin/reload`` half-way, and fails unless no request failed and every
process's memory is flat. A server run with ``--serve-args "--workers N ..."`` refuses that
POST (it would reach one process of N), so such a soak needs ``--watch-seconds S`` in
``--serve-args`` (refused up front without it) and reloads through the watcher: it publishes
the new version into the watched ``--checkpoint`` and polls ``/metrics`` (at most 120 s plus
two ``--watch-seconds``) until
``recserve_model_info`` reads 1 for it and 0 for the old version (every process moved). Its
RSS is sampled per process: ``server`` (the supervisor holding the ports) and each serving
process ``server.1`` .. ``server.N``, each judged on its own by the rule below:

* samples of the warm-up (the first 10% of the run, at least min(10 s, 20%)) are left out, and
  so are those of the ``RELOAD_SETTLE_S`` (60 s) after the reload starts: the server loads the
  new model next to the old one, then closes the old one and hands its memory back (a margin
  for a slow load and for the allocator);
* the rest splits into segments (before the reload; after it settled), each judged on its own:
  its growth rate is the Theil-Sen slope (median of the pairwise slopes) of each half of the
  segment, and the *sustained* rate is the smaller of the two halves (a leak grows in both; a
  one-off allocator step of a few MB only in one);
* a segment fails when its sustained rate exceeds max(``MAX_GROWTH_MB_PER_MIN`` (1 MB/min),
  ``GROWTH_FLOOR_MB`` (20 MB) / the soak's minutes): 2 MB/min for a 10-minute soak, 40 MB/min
  for a 30 s one; and the reload fails memory when the settled level after it is more than
  ``GROWTH_FLOOR_MB`` above the level before it (an old model never released);
* a soak too short for a judged segment of 6 samples is no verdict: a failure.

Final numbers come from locust's own totals, written by the locustfile when locust quits
(``locust_final.json``): locust's ``--csv`` stats file is rewritten once a second and not at
shutdown. A locust that exits non-zero or writes no final stats fails the run, with the tail of
``locust.log``; outputs of an earlier run in ``--out`` are deleted before anything starts.

Output in ``--out``: ``summary.md``, ``summary.csv`` (rps, p50, p95, p99, failures per request
name and aggregated), ``summary.json``, ``latency.png`` (latency percentiles over a trailing
~10 s window and throughput over time, plus RSS in soak mode), ``rss.csv`` (soak), locust's
``locust_*`` files and the logs of every process. Exit status: 0 when every check passed, 1
when one failed (request failures, a locust failure, a process of the stack that died, no
throughput, memory growth, a failed reload), 2 when the stack could not start (bad arguments,
a missing checkpoint, locust not installed), 130 on Ctrl-C and 143 on SIGTERM.

Every process is started here and ended by its PID, also on Ctrl-C and SIGTERM; loads are
bounded by ``--users`` and ``--seconds`` (``--minutes`` with ``--soak``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import json
import math
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from load_tests import traffic  # noqa: E402

if TYPE_CHECKING:
    from embedding_store.launcher import LocalCluster

LOCUSTFILE = Path(__file__).resolve().with_name("locustfile.py")
USER_CLASSES = {
    "binary": "KServeBinaryUser",
    "json": "KServeJsonUser",
    "friendly": "FriendlyJsonUser",
    "grpc": "GrpcUser",
    "torchserve": "TorchServeJsonUser",
    "torchserve-binary": "TorchServeBinaryUser",
}
#: The request-name prefix of each user class in locust's stats (load_tests/locustfile.py).
REQUEST_LABELS = {
    "KServeBinaryUser": "v2-binary",
    "KServeJsonUser": "v2-json",
    "FriendlyJsonUser": "v1-predict",
    "GrpcUser": "v2-grpc",
    "TorchServeJsonUser": "torchserve-json",
    "TorchServeBinaryUser": "torchserve-binary",
}
_SERVING_LINE = re.compile(
    r"HTTP listening on (?P<http_host>[^\s,]+):(?P<http_port>\d+), "
    r"gRPC listening on (?P<grpc_host>[^\s,]+):(?P<grpc_port>\d+)"
)
MB = 1024 * 1024
#: The Adult example's preprocessor (README): it reads raw Adult rows on the friendly route.
ADULT_PREPROCESSOR = "examples.adult_income.preprocess:instances_to_batch"
ADULT_ROWS = REPO_ROOT / "examples" / "adult_income" / "data" / "test.csv.gz"
#: Seconds after a reload starts whose RSS samples the memory verdict leaves out: both models
#: are resident while the new one loads and warms up; the old one is freed once it is swapped
#: out (serving.service.PredictionService.reload).
RELOAD_SETTLE_S = 60.0
MAX_GROWTH_MB_PER_MIN = 1.0
GROWTH_FLOOR_MB = 20.0
#: Samples per half-segment in a Theil-Sen fit (pairs grow as n**2; more add nothing).
_FIT_SAMPLES = 200


def subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def stop_process(process: subprocess.Popen | None, grace: float = 15.0) -> int | None:
    """SIGTERM by PID, then SIGKILL after ``grace`` seconds; returns the exit code."""
    if process is None:
        return None
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=grace)
    return process.returncode


# --------------------------------------------------------------------------- the server
@dataclass
class ServeProcess:
    """``recserve serve`` as a subprocess; ``start()`` waits for its listening line."""

    checkpoint: Path
    log_path: Path
    model_name: str = "model"
    embedding_workers: str = ""
    extra_args: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = None
    http: str = ""
    grpc: str = ""

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "embedding_store.cli",
            "serve",
            "--checkpoint",
            str(self.checkpoint),
            "--model-name",
            self.model_name,
            "--host",
            "127.0.0.1",
            "--http-port",
            "0",
            "--grpc-port",
            "0",
            *(["--embedding-workers", self.embedding_workers] if self.embedding_workers else []),
            *self.extra_args,
        ]

    def start(self, timeout: float = 120.0) -> ServeProcess:
        """Start the server and wait until it listens and is ready. On any failure or
        interruption (Ctrl-C, SIGTERM) before that, the process is stopped before raising: the
        caller holds no handle to it yet."""
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command(),
                cwd=REPO_ROOT,
                env=subprocess_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                match = _SERVING_LINE.search(self.log_path.read_text(errors="replace"))
                if match:
                    self.http = f"http://{match['http_host']}:{match['http_port']}"
                    self.grpc = f"{match['grpc_host']}:{match['grpc_port']}"
                    self.wait_ready(max(deadline - time.monotonic(), 1.0))
                    return self
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"recserve serve exited with {self.process.returncode}:\n"
                        f"{_tail(self.log_path)}"
                    )
                time.sleep(0.1)
            raise RuntimeError(f"recserve serve did not listen within {timeout:.0f} s")
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.http}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"recserve serve exited with {self.process.returncode} before it was "
                    f"ready:\n{_tail(self.log_path)}"
                )
            time.sleep(0.1)
        raise RuntimeError(f"{self.http} is not ready after {timeout:.0f} s")

    @property
    def pid(self) -> int:
        return self.process.pid if self.process else -1

    def reload(self, timeout: float = 120.0) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.http}/admin/reload",
            data=json.dumps({"checkpoint": None}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def stop(self) -> int | None:
        return stop_process(self.process)


# --------------------------------------------------------------------------- remote tier
def start_remote_tier(checkpoint: Path, out: Path) -> LocalCluster:
    """LocalCluster (2 PS in Infer mode loading ``checkpoint/embeddings`` + 1 worker)."""
    import yaml

    from embedding_store.launcher import LocalCluster

    manifest = json.loads((checkpoint / "embeddings" / "embedding_manifest.json").read_text())
    rows = sum(int(entry["rows"]) for entry in manifest["files"])
    embedding_config = out / "embedding_config.yml"
    embedding_config.write_text(yaml.safe_dump(manifest["embedding_config"], sort_keys=False))
    global_config = out / "global_config.infer.yml"
    global_config.write_text(
        yaml.safe_dump(
            {
                "common_config": {
                    "job_type": "Infer",
                    "infer_config": {
                        "embedding_checkpoint": str((checkpoint / "embeddings").absolute())
                    },
                },
                "embedding_parameter_server_config": {"capacity": max(2 * rows, 1024)},
            },
            sort_keys=False,
        )
    )
    cluster = LocalCluster(
        embedding_config,
        global_config,
        num_shards=2,
        num_workers=1,
        log_dir=out / "cluster",
        extra_env={"PYTHONPATH": subprocess_env()["PYTHONPATH"], "OMP_NUM_THREADS": "1"},
    )
    return cluster.start(timeout=120)


# --------------------------------------------------------------------------- checkpoints
def publish_new_version(served: Path) -> str:
    """Write a new version of the checkpoint in ``served`` into ``served`` itself: a staged
    copy with a fresh manifest version, moved into place by rename. Returns the version."""
    from embedding_store.checkpoint import publish_directory

    staging = served.with_name(f".{served.name}.staging-{uuid.uuid4().hex[:8]}")
    shutil.copytree(served, staging)
    manifest_path = staging / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["step"] = int(manifest.get("step", 0)) + 1
    manifest["version"] = f"{manifest['step']:08d}-{uuid.uuid4().hex[:8]}"
    manifest["created_unix"] = time.time()
    temporary = manifest_path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(manifest, indent=2))
    os.replace(temporary, manifest_path)
    publish_directory(staging, served, overwrite=True)
    return str(manifest["version"])


def checkpoint_version(served: Path) -> str:
    """The version in the manifest of the checkpoint directory ``served``."""
    return str(json.loads((served / "manifest.json").read_text())["version"])


def served_versions(http: str, model: str, timeout: float = 5.0) -> dict[str, float]:
    """``recserve_model_info`` of ``model`` in ``http``'s ``/metrics``, by version. A
    ``--workers`` server answers for all its processes: a version reads 1 while any process
    serves it and 0 once none does (prometheus_client's ``livemax``)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{http}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    return {
        sample.labels["version"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "recserve_model_info"
        for sample in family.samples
        if sample.labels.get("model") == model and "version" in sample.labels
    }


def reload_through_watcher(
    server: ServeProcess, served: Path, *, timeout: float = 120.0, poll: float = 0.5
) -> dict[str, Any]:
    """The soak's reload of a ``recserve serve --workers N --watch-seconds S`` server, which
    refuses ``POST /admin/reload`` (it would reach one process of N): publish a new version
    into ``served`` (the watched ``--checkpoint``), then poll ``/metrics`` until
    ``recserve_model_info`` reads 1 for the new version and 0 for the old one, i.e. every
    process serves the new one. RuntimeError when that takes more than ``timeout`` seconds
    or the server exits meanwhile."""
    previous = checkpoint_version(served)
    version = publish_new_version(served)
    deadline = time.monotonic() + timeout
    seen: dict[str, float] | str = "no answer yet"
    while True:
        try:
            seen = served_versions(server.http, server.model_name)
        except (OSError, ValueError) as error:  # URLError is an OSError
            seen = f"/metrics: {error!r}"
        if isinstance(seen, dict) and seen.get(version) == 1 and seen.get(previous, 0) == 0:
            return {"ok": True, "via": "watcher", "published": version, "version": version,
                    "previous_version": previous}  # fmt: skip
        if server.process is not None and server.process.poll() is not None:
            raise RuntimeError(
                f"recserve serve exited with {server.process.returncode} while reloading "
                f"version {version}"
            )
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"the --watch-seconds watcher did not serve version {version} in every "
                f"process within {timeout:.0f} s (recserve_model_info must read 1 for it and "
                f"0 for {previous}; /metrics read {seen}); see {server.log_path}"
            )
        time.sleep(poll)


# --------------------------------------------------------------------------- memory
def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` alone (psutil when installed, else /proc/PID/status): the
    processes of a ``recserve serve --workers N`` server are sampled one by one
    (:func:`child_pids`), so that the one that grows is named and each is judged on its own."""
    try:
        import psutil

        try:
            return int(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            return None
    except ImportError:
        pass
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def child_pids(pid: int) -> list[int]:
    """The direct child processes of ``pid`` in start order (psutil, else
    /proc/PID/task/*/children): the serving processes of ``recserve serve --workers N``."""
    try:
        import psutil

        try:
            children = psutil.Process(pid).children()
        except psutil.Error:
            return []
        started: list[tuple[float, int]] = []
        for child in children:
            with contextlib.suppress(psutil.Error):
                started.append((child.create_time(), child.pid))
        return [child for _, child in sorted(started)]
    except ImportError:
        pass  # no psutil (locust brings it, a bare install may not): read /proc instead
    found: list[int] = []
    for listing in sorted(Path(f"/proc/{pid}/task").glob("*/children")):
        with contextlib.suppress(OSError, ValueError):
            found += [int(text) for text in listing.read_text().split()]
    return sorted(set(found))


def server_pids(pid: int, workers: int, timeout: float = 30.0) -> dict[str, int]:
    """The RSS columns of a ``recserve serve`` process: ``server`` (the process itself; with
    ``--workers N`` the supervisor, which holds the ports) and, with ``workers`` > 1, each
    serving process as ``server.1`` .. ``server.N`` in start order. Waits up to ``timeout``
    for all N to exist (they are started before any of them listens)."""
    pids = {"server": pid}
    if workers <= 1:
        return pids
    deadline = time.monotonic() + timeout
    children = child_pids(pid)
    while len(children) < workers and time.monotonic() < deadline:
        time.sleep(0.1)
        children = child_pids(pid)
    pids.update({f"server.{index}": child for index, child in enumerate(children, 1)})
    return pids


class RssSampler(threading.Thread):
    """Samples the RSS of named PIDs every ``interval`` seconds until stopped."""

    def __init__(self, pids: dict[str, int], interval: float) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.pids = pids
        self.interval = interval
        self.samples: list[dict[str, float]] = []
        self.started_at = time.monotonic()
        self._halt = threading.Event()

    def run(self) -> None:
        while True:
            sample: dict[str, float] = {
                "t_s": round(time.monotonic() - self.started_at, 3),
                "unix": time.time(),
            }
            for name, pid in self.pids.items():
                value = rss_bytes(pid)
                sample[f"{name}_rss_mb"] = round(value / MB, 2) if value is not None else -1.0
            self.samples.append(sample)
            if self._halt.wait(self.interval):
                return

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


def theil_sen_slope(times: np.ndarray, values: np.ndarray) -> float | None:
    """Median of the pairwise slopes (value units per time unit); None under 2 samples.

    Robust to outliers and to a step covering less than ~29% of the pairs; at most
    ``_FIT_SAMPLES`` evenly spaced samples are used (the pairs grow as n**2)."""
    times, values = np.asarray(times, np.float64), np.asarray(values, np.float64)
    if len(times) > _FIT_SAMPLES:
        keep = np.linspace(0, len(times) - 1, _FIT_SAMPLES).round().astype(np.int64)
        times, values = times[keep], values[keep]
    first, second = np.triu_indices(len(times), k=1)
    elapsed = times[second] - times[first]
    usable = elapsed > 0
    if not usable.any():
        return None
    return float(np.median((values[second] - values[first])[usable] / elapsed[usable]))


@dataclass
class MemoryVerdict:
    """The memory verdict of one process (see the module docstring for the rule)."""

    process: str
    samples: int  # judged: after warm-up, outside the reload's settling window
    warmup_s: float
    baseline_mb: float  # median of the first quarter of the judged samples
    last_mb: float  # median of the last quarter
    slope_mb_per_min: float | None  # Theil-Sen over each segment's pairs (for the report)
    sustained_mb_per_min: float | None  # worst segment's smaller half-segment slope
    allowed_mb_per_min: float
    reload_step_mb: float | None  # settled level after the reload minus the level before it
    allowed_step_mb: float
    passed: bool
    reason: str


def memory_verdict(
    times: list[float],
    rss_mb: list[float],
    *,
    warmup_s: float,
    run_s: float,
    reload_s: float | None = None,
    settle_s: float = RELOAD_SETTLE_S,
    max_rate_mb_per_min: float = MAX_GROWTH_MB_PER_MIN,
    floor_mb: float = GROWTH_FLOOR_MB,
    process: str = "server",
) -> MemoryVerdict:
    """Flat memory of one process: RSS samples (``times`` in seconds since sampling began,
    ``rss_mb``; negative = no sample) judged as the module docstring says. ``reload_s``: when
    the reload started, on the same clock; ``run_s``: the soak's length."""
    t = np.asarray(times, np.float64)
    v = np.asarray(rss_mb, np.float64)
    kept = (v >= 0) & (t >= warmup_s)
    if reload_s is None:
        masks = [kept]
    else:
        masks = [kept & (t < reload_s), kept & (t >= reload_s + settle_s)]
    segments = [(t[mask], v[mask]) for mask in masks]
    judged = [(st, sv) for st, sv in segments if len(st) >= 6]
    allowed = max(max_rate_mb_per_min, floor_mb / max(run_s / 60.0, 1e-9))
    values = np.concatenate([sv for _, sv in judged]) if judged else np.zeros(0)
    quarter = max(len(values) // 4, 1)
    baseline = float(np.median(values[:quarter])) if len(values) else 0.0
    last = float(np.median(values[-quarter:])) if len(values) else 0.0

    slopes, sustained = [], []
    for st, sv in judged:
        slopes.append(theil_sen_slope(st, sv))
        half = len(st) // 2
        halves = [theil_sen_slope(st[:half], sv[:half]), theil_sen_slope(st[half:], sv[half:])]
        valid = [h for h in halves if h is not None]
        if valid:
            sustained.append(min(valid))
    per_min = [60.0 * x for x in slopes if x is not None]
    slope = round(float(np.median(per_min)), 2) if per_min else None
    worst = round(60.0 * max(sustained), 2) if sustained else None

    step = None
    if reload_s is not None and all(len(st) >= 6 for st, _ in segments):
        (_, before), (_, after) = segments
        q_before, q_after = max(len(before) // 4, 2), max(len(after) // 4, 2)
        step = round(float(np.median(after[:q_after]) - np.median(before[-q_before:])), 1)

    if not judged:
        passed, reason = False, f"too few samples after warm-up ({int(kept.sum())})"
    elif worst is not None and worst > allowed:
        passed = False
        reason = f"grows {worst:g} MB/min in both halves of a segment (allowed {allowed:.1f})"
    elif step is not None and step > floor_mb:
        passed, reason = False, f"{step:g} MB more after the reload settled (allowed {floor_mb:g})"
    else:
        passed, reason = True, "flat"
    return MemoryVerdict(
        process=process,
        samples=len(values),
        warmup_s=round(warmup_s, 2),
        baseline_mb=round(baseline, 1),
        last_mb=round(last, 1),
        slope_mb_per_min=slope,
        sustained_mb_per_min=worst,
        allowed_mb_per_min=round(allowed, 2),
        reload_step_mb=step,
        allowed_step_mb=floor_mb,
        passed=passed,
        reason=reason,
    )


def memory_verdicts(
    samples: list[dict[str, float]], *, warmup_s: float, run_s: float, reload_s: float | None
) -> dict[str, MemoryVerdict]:
    """:func:`memory_verdict` of every process sampled by :class:`RssSampler` (each
    ``<name>_rss_mb`` column: the server, and the parameter servers and embedding worker of
    the remote tier): any of them growing fails the soak."""
    columns = samples[0] if samples else {}
    names = [key[: -len("_rss_mb")] for key in columns if key.endswith("_rss_mb")]
    times = [s["t_s"] for s in samples]
    return {
        name: memory_verdict(
            times,
            [s[f"{name}_rss_mb"] for s in samples],
            warmup_s=warmup_s,
            run_s=run_s,
            reload_s=reload_s,
            process=name,
        )
        for name in names
    }


# --------------------------------------------------------------------------- locust
def locust_installed() -> bool:
    """Whether ``python -m locust`` can run here (the same interpreter runs it)."""
    return importlib.util.find_spec("locust") is not None


#: Files that one locust run writes next to its ``--csv`` prefix.
LOCUST_OUTPUTS = (
    "_stats.csv",
    "_stats_history.csv",
    "_failures.csv",
    "_exceptions.csv",
    "_final.json",
)


@dataclass
class LocustRun:
    users: int
    spawn_rate: float
    seconds: float
    classes: list[str]
    host: str
    csv_prefix: Path
    log_path: Path
    env: dict[str, str]
    processes: int = 1
    process: subprocess.Popen | None = field(default=None, init=False, repr=False)

    @property
    def final_stats_path(self) -> Path:
        """Where the locustfile writes the run's final stats when locust quits."""
        return Path(f"{self.csv_prefix}_final.json")

    def command(self) -> list[str]:
        args = [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(LOCUSTFILE),
            "--headless",
            "-u",
            str(self.users),
            "-r",
            str(self.spawn_rate),
            "-t",
            f"{max(round(self.seconds), 1)}s",
            "--host",
            self.host,
            "--csv",
            str(self.csv_prefix),
            # Without it the history's percentiles are cumulative since the start of the run.
            "--csv-full-history",
            "--only-summary",
            "--stop-timeout",
            "5",
            "--loglevel",
            "WARNING",
        ]
        if self.processes > 1:
            args += ["--processes", str(self.processes)]
        return [*args, *self.classes]

    def clear_outputs(self) -> None:
        """Delete an earlier run's files at this prefix: what is read afterwards is this run's."""
        for suffix in LOCUST_OUTPUTS:
            Path(f"{self.csv_prefix}{suffix}").unlink(missing_ok=True)

    def start(self) -> subprocess.Popen:
        self.clear_outputs()
        env = {**self.env, "RECSERVE_LT_FINAL_STATS": str(self.final_stats_path)}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command(),
                cwd=REPO_ROOT,
                env=subprocess_env(env),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self.process


def _number(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def read_final_stats(path: Path) -> dict[str, Any] | None:
    """The locustfile's final stats (``exit_code``, ``written_unix``, ``stats`` rows as
    :func:`read_stats` returns them, ``errors``, ``exceptions``); None when absent or torn."""
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) and "stats" in document else None


def read_stats(csv_prefix: Path) -> list[dict[str, Any]]:
    """Rows of a locust run: name, requests, failures, rps, p50/p95/p99 (ms), avg, max.

    From ``<prefix>_final.json`` (written when locust quits, complete) when there is one, else
    from locust's ``<prefix>_stats.csv``, which locust rewrites once a second and not at
    shutdown (its last second is missing)."""
    final = read_final_stats(Path(f"{csv_prefix}_final.json"))
    if final is not None:
        return list(final["stats"])
    rows = []
    with open(f"{csv_prefix}_stats.csv", newline="") as handle:
        for row in csv.DictReader(handle):
            rows.append(
                {
                    "type": row["Type"],
                    "name": row["Name"],
                    "requests": int(row["Request Count"]),
                    "failures": int(row["Failure Count"]),
                    "rps": round(float(row["Requests/s"]), 2),
                    "p50_ms": _number(row["50%"]),
                    "p95_ms": _number(row["95%"]),
                    "p99_ms": _number(row["99%"]),
                    "avg_ms": round(float(row["Average Response Time"]), 2),
                    "max_ms": round(float(row["Max Response Time"]), 2),
                }
            )
    return rows


def locust_outcome(
    run: LocustRun, returncode: int | None, started_unix: float
) -> tuple[dict[str, Any] | None, list[str]]:
    """This run's final stats (None when locust wrote none, or an earlier run's) and what
    went wrong with locust itself: a non-zero exit, missing stats (with the log's tail)."""
    final = read_final_stats(run.final_stats_path)
    if final is not None and float(final.get("written_unix", 0.0)) < started_unix:
        final = None  # not this run's: never report an earlier run's numbers
    problems = []
    if final is None:
        problems.append(
            f"locust exited with code {returncode} and wrote no final stats "
            f"({run.final_stats_path.name}); {run.log_path}:\n{_tail(run.log_path, 20)}"
        )
    elif returncode != 0:
        total = next((r for r in final["stats"] if r["name"] == "Aggregated"), {})
        explained = total.get("failures") or final.get("exceptions")
        problems.append(
            f"locust exited with code {returncode}"
            + ("" if explained else f"; {run.log_path}:\n{_tail(run.log_path, 20)}")
        )
    return final, problems


def read_history(csv_prefix: Path) -> list[dict[str, float]]:
    """The aggregated rows of ``<prefix>_stats_history.csv`` (one per second).

    ``rps`` and ``failures_per_s`` are this interval's own rates, from the growth of locust's
    cumulative counts since the row before. (locust's ``Requests/s`` column is a trailing
    10-second average that reads 0 for the first seconds of a run.) The percentiles are the
    history's: with ``--csv-full-history`` (:meth:`LocustRun.command`) locust's "current"
    ones, over the trailing ~10 s window (``CURRENT_RESPONSE_TIME_PERCENTILE_WINDOW``; 0,
    read as NaN, until that window has data); without the flag locust writes percentiles
    cumulative since the start of the run, which flatten any change over time.
    """
    rows: list[dict[str, float]] = []
    path = Path(f"{csv_prefix}_stats_history.csv")
    if not path.exists():
        return rows
    previous: tuple[float, int, int] | None = None
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            if row["Name"] != "Aggregated":
                continue
            unix = float(row["Timestamp"])
            requests, failures = int(row["Total Request Count"]), int(row["Total Failure Count"])
            rps = failures_per_s = 0.0
            if previous is not None and unix > previous[0]:
                elapsed = unix - previous[0]
                rps = (requests - previous[1]) / elapsed
                failures_per_s = (failures - previous[2]) / elapsed
            previous = (unix, requests, failures)
            rows.append(
                {
                    "unix": unix,
                    "users": float(row["User Count"]),
                    "rps": rps,
                    "failures_per_s": failures_per_s,
                    "p50_ms": _number(row["50%"]) or float("nan"),
                    "p95_ms": _number(row["95%"]) or float("nan"),
                    "p99_ms": _number(row["99%"]) or float("nan"),
                }
            )
    return rows


def plot(
    path: Path,
    history: list[dict[str, float]],
    *,
    title: str,
    rss: list[dict[str, float]] | None = None,
    marks: list[tuple[float, str]] = (),
) -> None:
    """Latency percentiles and throughput over time (and RSS when given) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if rss else 1
    figure, axes = plt.subplots(panels, 1, figsize=(10, 4 * panels), squeeze=False)
    start = history[0]["unix"] if history else (rss[0]["unix"] if rss else 0.0)
    ax = axes[0][0]
    if history:
        t = [row["unix"] - start for row in history]
        for key, style in (("p50_ms", "-"), ("p95_ms", "--"), ("p99_ms", ":")):
            ax.plot(t, [row[key] for row in history], style, label=key.replace("_ms", ""))
        ax.set_ylabel("latency ms (trailing ~10 s window)")
        steady = [row["p99_ms"] for row in history[len(history) // 10 :] if row["p99_ms"] > 0]
        if steady:  # the start-up window would flatten everything else
            ax.set_ylim(0, max(steady) * 1.3)
        twin = ax.twinx()
        twin.plot(t, [row["rps"] for row in history], color="grey", alpha=0.6, label="req/s")
        twin.set_ylabel("requests/s")
        twin.legend(loc="upper right")
    ax.set_xlabel("seconds")
    ax.set_title(title)
    if history:  # no history (locust failed): nothing to label
        ax.legend(loc="upper left")
    for unix, label in marks:
        for row in axes:
            row[0].axvline(unix - start, color="red", alpha=0.5)
        ax.annotate(label, (unix - start, ax.get_ylim()[1]), color="red", fontsize=8)
    if rss:
        ax2 = axes[1][0]
        for key in [k for k in rss[0] if k.endswith("_rss_mb")]:
            ax2.plot(
                [s["unix"] - start for s in rss], [s[key] for s in rss], label=key[: -len("_mb")]
            )
        ax2.set_xlabel("seconds")
        ax2.set_ylabel("RSS (MB)")
        ax2.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# --------------------------------------------------------------------------- reports
#: What a run writes into ``--out`` besides locust's files: deleted before a run starts, so a
#: reused folder never shows an earlier run's verdict.
REPORT_FILES = ("summary.md", "summary.csv", "summary.json", "latency.png", "rss.csv")


def write_summary(out: Path, result: dict[str, Any]) -> None:
    rows = result["stats"]
    with open(out / "summary.csv", "w", newline="") as handle:
        writer = csv.DictWriter(
            handle,
            fieldnames=["name", "requests", "failures", "rps", "p50_ms", "p95_ms", "p99_ms"],
            extrasaction="ignore",
        )
        writer.writeheader()
        writer.writerows(rows)
    (out / "summary.json").write_text(json.dumps(result, indent=2, default=str))
    lines = [
        "# recserve load test",
        "",
        f"- model: {result['model']} ({result['inputs']})",
        f"- checkpoint: `{result['checkpoint']}`, tier: {result['tier']}",
        f"- users: {result['users']} ({', '.join(result['classes'])}), "
        f"{result['seconds']:.0f} s, batch mix {result['batches']}, seed {result.get('seed')}",
        f"- serve flags: `{' '.join(result['serve_args']) or '(defaults)'}`",
        f"- verdict: **{'PASS' if result['passed'] else 'FAIL'}** ({result['verdict']})",
        "",
        "| request | requests | failures | req/s | p50 ms | p95 ms | p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        name = row["name"] if row["name"] != "Aggregated" else "**all**"
        lines.append(
            f"| {name} | {row['requests']} | {row['failures']} | {row['rps']:.1f} | "
            f"{_ms(row['p50_ms'])} | {_ms(row['p95_ms'])} | {_ms(row['p99_ms'])} |"
        )
    soak = result.get("soak")
    if soak:
        lines += ["", "## Soak", "", f"- reload at {soak['reload_at_s']:.1f} s: {soak['reload']}"]
        pids = soak.get("pids", {})
        for memory in soak["memory"].values():
            step = memory["reload_step_mb"]
            pid = pids.get(memory["process"])
            lines.append(
                f"- {memory['process']}{'' if pid is None else f' (pid {pid})'} RSS: "
                f"{memory['baseline_mb']} MB -> {memory['last_mb']} "
                f"MB, slope {memory['slope_mb_per_min']} MB/min, sustained "
                f"{memory['sustained_mb_per_min']} MB/min (allowed "
                f"{memory['allowed_mb_per_min']}), after the reload "
                f"{'-' if step is None else f'{step:+g} MB'}, {memory['samples']} samples "
                f"after {memory['warmup_s']:.1f} s warm-up: "
                + ("**flat**" if memory["passed"] else f"**GROWING** ({memory['reason']})")
            )
        lines.append("- series: `rss.csv`")
    lines += ["", "Latency over time: `latency.png`; locust CSVs: `locust_*.csv`.", ""]
    (out / "summary.md").write_text("\n".join(lines))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


# --------------------------------------------------------------------------- main
def serve_option(serve_args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``recserve serve`` flags (the last one given), if any."""
    value = None
    for index, arg in enumerate(serve_args):
        if arg == flag and index + 1 < len(serve_args):
            value = serve_args[index + 1]
        elif arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
    return value


def preprocessor_of(serve_args: list[str]) -> str | None:
    """The ``--preprocessor`` of ``recserve serve`` flags, if any."""
    return serve_option(serve_args, "--preprocessor")


def workers_of(serve_args: list[str]) -> int:
    """The ``--workers`` of ``recserve serve`` flags (1 when absent or not a number: the
    server then refuses it itself)."""
    try:
        return int(serve_option(serve_args, "--workers") or 1)
    except ValueError:
        return 1


def watcher_reload_timeout(serve_args: list[str]) -> float:
    """Seconds the soak waits for a ``--workers`` server's watcher to serve a new version:
    120, plus two of its ``--watch-seconds`` looks (it looks only every that many seconds)."""
    return 120.0 + 2 * watch_seconds_of(serve_args)


def watch_seconds_of(serve_args: list[str]) -> float:
    """The ``--watch-seconds`` of ``recserve serve`` flags (0, off, when absent)."""
    try:
        value = float(serve_option(serve_args, "--watch-seconds") or 0.0)
    except ValueError:
        return 0.0
    return value if math.isfinite(value) else 0.0


def finite_float(text: str) -> float:
    """argparse type: a finite number (NaN compares false with every bound, so a range check
    alone would let it through to fail after the stack started)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked before anything starts (argparse error: exit 2)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, help="recserve checkpoint to serve")
    source.add_argument(
        "--synthetic", action="store_true", help="build and serve a synthetic Criteo-like model"
    )
    parser.add_argument(
        "--tier",
        choices=["embedded", "remote"],
        default="embedded",
        help="embedded: one server process; remote: 2 PS shards + 1 embedding worker + server",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("load-test-out"),
        help="folder for summary.csv/.md, the latency plot, locust CSVs and server logs",
    )
    parser.add_argument("--users", type=int, default=4, help="concurrent locust users")
    parser.add_argument(
        "--spawn-rate", type=finite_float, default=None, help="users/s (default: all at once)"
    )
    parser.add_argument(
        "--seconds",
        type=finite_float,
        default=None,
        help="load duration (default 10; not with --soak)",
    )
    parser.add_argument(
        "--user-classes",
        default="binary,json,friendly,grpc",
        help=f"comma-separated, from {', '.join(USER_CLASSES)}",
    )
    parser.add_argument("--batches", default="1:6,8:3,64:1", help="batch mix SIZE:WEIGHT,...")
    parser.add_argument(
        "--unknown-share", type=finite_float, default=0.02, help="share of IDs the model never saw"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="traffic seed (RECSERVE_LT_SEED), to repeat a run's requests; default: random, "
        "reported in the summary",
    )
    parser.add_argument("--model-name", default="model", help="served model name")
    parser.add_argument(
        "--serve-args", default="", help='extra `recserve serve` flags, e.g. "--max-batch-size 64"'
    )
    parser.add_argument(
        "--friendly-rows",
        type=Path,
        default=None,
        help="CSV or JSON-lines file of raw rows (.gz too) for the friendly user, for a server "
        f"with a --preprocessor (default with {ADULT_PREPROCESSOR}: {ADULT_ROWS.name})",
    )
    parser.add_argument(
        "--locust-processes", type=int, default=1, help="locust worker processes (--processes)"
    )
    parser.add_argument("--soak", action="store_true", help="memory + reload soak")
    parser.add_argument(
        "--minutes", type=finite_float, default=None, help="soak duration (default 10; --soak only)"
    )
    parser.add_argument("--rss-interval", type=finite_float, default=None, help="seconds (soak)")
    args = parser.parse_args(argv)
    if args.soak and args.seconds is not None:
        parser.error("--soak runs for --minutes; --seconds is the length of a load run")
    if not args.soak and args.minutes is not None:
        parser.error("--minutes is the length of a --soak; a load run takes --seconds")
    args.seconds = 10.0 if args.seconds is None else args.seconds
    args.minutes = 10.0 if args.minutes is None else args.minutes
    if args.users < 1 or args.seconds <= 0 or args.minutes <= 0:
        parser.error("--users, --seconds and --minutes must be positive")
    if args.users > 1000 or args.seconds > 3600 or args.minutes > 120:
        parser.error("bounded runs only: at most 1000 users, 3600 s, 120 minutes")
    if args.spawn_rate is not None and args.spawn_rate <= 0:
        parser.error(f"--spawn-rate must be > 0 users per second, got {args.spawn_rate}")
    if not 1 <= args.locust_processes <= 64:
        parser.error(f"--locust-processes must be in 1..64, got {args.locust_processes}")
    if args.rss_interval is not None and not 0 < args.rss_interval <= 60:
        parser.error(f"--rss-interval must be in (0, 60] seconds, got {args.rss_interval}")
    if args.seed is not None and args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.checkpoint is not None and not args.checkpoint.is_dir():
        parser.error(f"--checkpoint {args.checkpoint}: no such directory")
    try:
        traffic.parse_batch_mix(args.batches)
    except ValueError as error:  # int("x") too: checked before any process starts
        parser.error(f"--batches {args.batches!r}: {error}")
    if not 0.0 <= args.unknown_share < 1.0:
        parser.error(f"--unknown-share must be in [0, 1), got {args.unknown_share}")
    names = args.user_classes.split(",")
    unknown = set(names) - set(USER_CLASSES)
    if unknown:
        parser.error(f"unknown user classes {sorted(unknown)}")
    if args.users < len(set(names)):
        parser.error(
            f"--users {args.users} is fewer than the {len(set(names))} user classes "
            f"({args.user_classes}): locust starts whole users, so some class would send "
            "nothing"
        )
    try:
        serve_args = shlex.split(args.serve_args)
    except ValueError as error:
        parser.error(f"--serve-args {args.serve_args!r}: {error}")
    if args.soak and workers_of(serve_args) > 1 and watch_seconds_of(serve_args) <= 0:
        parser.error(
            f"--serve-args runs --workers {workers_of(serve_args)}: such a server refuses "
            "POST /admin/reload (it would reach one process of them), so the soak reloads "
            'through its watcher: add --watch-seconds S to --serve-args (e.g. "--workers '
            f'{workers_of(serve_args)} --watch-seconds 1")'
        )
    preprocessor = preprocessor_of(serve_args)
    if args.friendly_rows is None and preprocessor == ADULT_PREPROCESSOR:
        args.friendly_rows = ADULT_ROWS  # what that preprocessor reads: raw Adult rows
    if "friendly" in names and preprocessor and args.friendly_rows is None:
        parser.error(
            f"--serve-args has --preprocessor {preprocessor}: the friendly route then takes "
            "the preprocessor's raw rows, not slot IDs; pass --friendly-rows FILE (CSV or "
            "JSON lines of such rows) or leave friendly out of --user-classes"
        )
    if args.friendly_rows is not None and not args.friendly_rows.is_file():
        parser.error(f"--friendly-rows {args.friendly_rows}: no such file")
    return args


def silent_classes(classes: list[str], stats: list[dict[str, Any]]) -> list[str]:
    """The user classes of ``classes`` without a single request in locust's ``stats`` rows
    (request names start with the class's label: ``v2-binary b64``)."""
    sent = {row["name"].split(" ", 1)[0] for row in stats if row["requests"] > 0}
    return [name for name in classes if REQUEST_LABELS.get(name, name) not in sent]


def stats_problems(stats: list[dict[str, Any]], classes: list[str], csv_prefix: Path) -> list[str]:
    """What fails a run in locust's final ``stats`` rows: any failed request, no throughput, a
    user class of ``classes`` that sent nothing, and errors raised in locust tasks."""
    problems = []
    total = next(row for row in stats if row["name"] == "Aggregated")
    if total["failures"]:
        problems.append(f"{total['failures']} failed requests")
    if total["rps"] <= 0:
        problems.append("no throughput")
    silent = silent_classes(classes, stats)
    if silent:
        problems.append(f"user classes {silent} sent no requests")
    problems.extend(f"locust task error: {line}" for line in task_exceptions(csv_prefix))
    return problems


def soak_problems(verdicts: dict[str, MemoryVerdict], reload: dict[str, Any]) -> list[str]:
    """What fails a soak: each process whose memory is not flat, and a failed reload."""
    problems = [
        f"{name} RSS: {verdict.reason}" for name, verdict in verdicts.items() if not verdict.passed
    ]
    if not reload.get("ok"):
        problems.append(f"reload failed: {reload}")
    return problems


def task_exceptions(csv_prefix: Path) -> list[str]:
    """Errors raised inside locust tasks: they are not request failures, so the stats alone
    would not show them. From the final stats when locust wrote them, else from
    ``<prefix>_exceptions.csv`` (rewritten once a second: the last second is missing)."""
    final = read_final_stats(Path(f"{csv_prefix}_final.json"))
    if final is not None:
        return [f"{e['count']} x {e['msg'].strip()[:200]}" for e in final.get("exceptions", [])]
    path = Path(f"{csv_prefix}_exceptions.csv")
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        return [
            f"{row.get('Count', '?')} x {row.get('Message', '').strip()[:200]}"
            for row in csv.DictReader(handle)
        ]


def dead_processes(processes: dict[str, tuple[subprocess.Popen | None, Path]]) -> list[str]:
    """Which of the stack's processes (name -> (process, log)) have exited, with their exit
    code and log tail: a server that died is the cause, its requests' failures the symptom."""
    return [
        f"{name} (pid {process.pid}) died during the run with exit code {process.returncode}; "
        f"{log}:\n{_tail(log, 15)}"
        for name, (process, log) in processes.items()
        if process is not None and process.poll() is not None
    ]


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) in the main thread, so ``finally`` blocks stop every
    process started here (without it, SIGTERM ends this process alone and orphans them). A
    second SIGTERM during that cleanup is ignored rather than cutting it short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not locust_installed():
        print(
            f"error: locust is not importable by {sys.executable} (pip install locust); "
            "nothing was started",
            file=sys.stderr,
        )
        return 2
    try:
        with sigterm_exits():
            return _run(args)
    except KeyboardInterrupt:
        print("interrupted: every process started was stopped", file=sys.stderr)
        return 130


def _wait_while_running(
    locust: subprocess.Popen, until: float, stack: dict[str, tuple[subprocess.Popen | None, Path]]
) -> bool:
    """Wait until ``locust`` exits or the monotonic clock passes ``until``; stop locust early
    (it still writes its final stats) when a process of the stack dies. True if one died."""
    while locust.poll() is None and time.monotonic() < until:
        if dead_processes(stack):
            stop_process(locust)
            return True
        time.sleep(0.2)
    return bool(dead_processes(stack))


def _run(args: argparse.Namespace) -> int:
    out = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    # A failed run must not leave an earlier run's verdict or numbers behind.
    for name in [*REPORT_FILES, *(f"locust{suffix}" for suffix in LOCUST_OUTPUTS)]:
        (out / name).unlink(missing_ok=True)
    seconds = args.minutes * 60.0 if args.soak else args.seconds
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    serve_args = shlex.split(args.serve_args)
    cluster = None
    server: ServeProcess | None = None
    run: LocustRun | None = None
    sampler: RssSampler | None = None
    try:
        try:
            if args.synthetic:
                from load_tests.synthetic_model import build_synthetic_checkpoint

                checkpoint = out / "synthetic-checkpoint"
                if not (checkpoint / "DONE").exists():
                    build_synthetic_checkpoint(checkpoint, overwrite=True)
            else:
                checkpoint = args.checkpoint.absolute()
            served = checkpoint
            if args.soak:  # reload writes new versions here: serve a copy, never the original
                served = out / "served-checkpoint"
                shutil.rmtree(served, ignore_errors=True)
                shutil.copytree(checkpoint, served)
            vocab_path = out / "vocab.npz"
            traffic.save_vocab(traffic.vocab_from_checkpoint(served), vocab_path)
            if args.tier == "remote":
                cluster = start_remote_tier(served, out)
            # Held before start(): an interruption while it waits still finds the process.
            server = ServeProcess(
                served,
                out / "serve.log",
                model_name=args.model_name,
                embedding_workers=",".join(cluster.worker_addresses) if cluster else "",
                extra_args=serve_args,
            )
            server.start()
            metadata = traffic.fetch_metadata(server.http, args.model_name)
            inputs = traffic.ModelInputs.from_metadata(metadata)
        except Exception as error:
            print(f"error: the stack did not start: {error}", file=sys.stderr)
            return 2
        classes = [USER_CLASSES[name] for name in args.user_classes.split(",")]
        env = {
            "RECSERVE_LT_MODEL": args.model_name,
            "RECSERVE_LT_GRPC": server.grpc,
            "RECSERVE_LT_VOCAB": str(vocab_path),
            "RECSERVE_LT_BATCHES": args.batches,
            "RECSERVE_LT_UNKNOWN": str(args.unknown_share),
            "RECSERVE_LT_SEED": str(seed),
        }
        if args.friendly_rows is not None:
            env["RECSERVE_LT_ROWS"] = str(args.friendly_rows.absolute())
        run = LocustRun(
            users=args.users,
            spawn_rate=args.spawn_rate or args.users,
            seconds=seconds,
            classes=classes,
            host=server.http,
            csv_prefix=out / "locust",
            log_path=out / "locust.log",
            env=env,
            processes=args.locust_processes,
        )
        # One RSS column per process: with --workers N, the supervisor and each serving
        # process (server.1 .. server.N), each judged on its own.
        workers = workers_of(serve_args)
        pids = server_pids(server.pid, workers)
        stack: dict[str, tuple[subprocess.Popen | None, Path]] = {
            "recserve serve": (server.process, server.log_path)
        }
        if cluster is not None:
            for process in [*cluster.shards, *cluster.workers]:
                pids[process.name.replace(" ", "_")] = process.process.pid
                stack[process.name] = (process.process, process.log_path)
        interval = args.rss_interval or (max(0.25, min(seconds / 200.0, 5.0)) if args.soak else 1)
        sampler = RssSampler(pids, interval)
        sampler.start()
        started = time.monotonic()
        started_unix = time.time()
        locust = run.start()
        deadline = started + seconds + 90
        soak: dict[str, Any] | None = None
        marks: list[tuple[float, str]] = []
        reload_s: float | None = None
        died = False
        if args.soak:
            died = _wait_while_running(locust, started + seconds / 2.0, stack)
            if not died and locust.poll() is None:
                reload_unix = time.time()
                reload_s = time.monotonic() - sampler.started_at
                try:
                    if workers > 1:  # POST /admin/reload is refused: the watcher reloads
                        reload_result: dict[str, Any] = reload_through_watcher(
                            server, served, timeout=watcher_reload_timeout(serve_args)
                        )
                    else:
                        version = publish_new_version(served)
                        answer = server.reload()
                        reload_result = {
                            "ok": answer.get("version") == version,
                            "published": version,
                            **answer,
                        }
                    reload_result["seconds"] = round(time.time() - reload_unix, 3)
                except Exception as error:  # report it; the verdict fails
                    reload_result = {"ok": False, "error": repr(error)}
                marks.append((reload_unix, "reload"))
                soak = {"reload_at_s": reload_unix - started_unix, "reload": reload_result}
            else:
                soak = {"reload_at_s": -1.0, "reload": {"ok": False, "error": "not reached"}}
        if not died:
            died = _wait_while_running(locust, deadline, stack)
        if locust.poll() is None:  # past the deadline: SIGTERM, locust still writes its stats
            stop_process(locust)
        sampler.stop()
        final, problems = locust_outcome(run, locust.returncode, started_unix)
        problems[:0] = dead_processes(stack)  # the cause before its symptoms
        stats = list(final["stats"]) if final is not None else []
        history = read_history(run.csv_prefix)
        if final is not None:
            problems.extend(stats_problems(stats, classes, run.csv_prefix))
        if soak is not None:
            samples = sampler.samples
            if samples:
                with open(out / "rss.csv", "w", newline="") as handle:
                    writer = csv.DictWriter(handle, fieldnames=list(samples[0]))
                    writer.writeheader()
                    writer.writerows(samples)
            verdicts = memory_verdicts(
                samples,
                warmup_s=max(0.1 * seconds, min(10.0, 0.2 * seconds)),
                run_s=seconds,
                reload_s=reload_s,
            )
            soak["pids"] = dict(pids)
            soak["memory"] = {name: asdict(verdict) for name, verdict in verdicts.items()}
            problems.extend(soak_problems(verdicts, soak["reload"]))
        plot(
            out / "latency.png",
            history,
            title=f"recserve {args.tier}, {args.users} users ({args.user_classes})",
            rss=sampler.samples if args.soak else None,
            marks=marks,
        )
        result = {
            "model": args.model_name,
            "inputs": traffic.describe(inputs),
            "checkpoint": str(checkpoint),
            "tier": args.tier,
            "users": args.users,
            "classes": classes,
            "seconds": seconds,
            "batches": args.batches,
            "seed": seed,
            "friendly_rows": str(args.friendly_rows) if args.friendly_rows else None,
            "serve_args": serve_args,
            "locust_command": " ".join(run.command()),
            "locust_exit_code": locust.returncode,
            "stats": stats,
            "soak": soak,
            "passed": not problems,
            "verdict": "; ".join(problems) or "no failures" + (", memory flat" if soak else ""),
        }
        write_summary(out, result)
        print((out / "summary.md").read_text())
        return 0 if not problems else 1
    finally:  # each step on its own, so one failure does not leave processes behind
        for cleanup in (
            sampler.stop if sampler is not None else None,
            (lambda: stop_process(run.process)) if run is not None else None,
            server.stop if server is not None else None,
            cluster.stop if cluster is not None else None,
        ):
            if cleanup is None:
                continue
            try:
                cleanup()
            except Exception as error:  # keep cleaning up
                print(f"warning: cleanup failed: {error!r}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
