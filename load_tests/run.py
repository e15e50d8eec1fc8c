"""Start a recserve serving stack on loopback, load it with locust, write a summary.

Embedded tier (one ``recserve serve`` process holding the embeddings)::

    python load_tests/run.py --checkpoint runs/adult --users 16 --seconds 60 --out lt-out

Remote tier (LocalCluster: 2 parameter servers in Infer mode loading the checkpoint's
embeddings read-only + 1 embedding worker; ``recserve serve --embedding-workers``)::

    python load_tests/run.py --synthetic --tier remote --users 16 --seconds 60 --out lt-out

Soak (bounded): ``--soak --minutes 10`` samples the server's RSS, writes a new checkpoint
version into the served directory (atomically: staged copy, then rename) and reloads it via
``POST /admin/reload`` half-way, and fails unless memory stays flat (last-quarter median RSS
within +15% or +50 MB of the first-quarter median after warm-up, whichever is larger) and no
request failed.

Output in ``--out``: ``summary.md``, ``summary.csv`` (rps, p50, p95, p99, failures per request
name and aggregated), ``summary.json``, ``latency.png`` (latency percentiles and throughput over
time, plus RSS in soak mode), ``rss.csv`` (soak), locust's ``locust_*.csv`` and the logs of
every process. Exit status: 0 when every check passed, 1 when one failed (request failures,
no throughput, memory growth, a failed reload), 2 when the stack could not start.

Every process is started here and ended by its PID; loads are bounded by ``--users`` and
``--seconds`` (``--minutes`` with ``--soak``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

    def start(self, timeout: float = 120.0) -> ServeProcess:
        args = [
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
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                args, cwd=REPO_ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT
            )
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
                    f"recserve serve exited with {self.process.returncode}:\n{_tail(self.log_path)}"
                )
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"recserve serve did not listen within {timeout:.0f} s")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.http}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
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


# --------------------------------------------------------------------------- memory
def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` plus its child processes (``recserve serve --workers``)
    with psutil when installed, else of ``pid`` alone from /proc/PID/status."""
    try:
        import psutil

        try:
            process = psutil.Process(pid)
            total = process.memory_info().rss
            for child in process.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    total += child.memory_info().rss
            return int(total)
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


@dataclass
class MemoryVerdict:
    first_quarter_median_mb: float
    last_quarter_median_mb: float
    growth_mb: float
    growth_pct: float
    allowed_mb: float
    warmup_s: float
    samples: int
    passed: bool


def memory_verdict(
    times: list[float],
    rss_mb: list[float],
    *,
    warmup_s: float,
    max_growth_pct: float = 15.0,
    max_growth_mb: float = 50.0,
) -> MemoryVerdict:
    """Flat memory: median RSS of the last quarter (after ``warmup_s``) is at most the
    first quarter's median plus max(``max_growth_pct`` %, ``max_growth_mb``)."""
    kept = [v for t, v in zip(times, rss_mb) if t >= warmup_s and v >= 0]
    if len(kept) < 4:
        kept = [v for v in rss_mb if v >= 0]
    if len(kept) < 4:
        return MemoryVerdict(0, 0, 0, 0, 0, warmup_s, len(kept), False)
    quarter = max(len(kept) // 4, 1)
    first = statistics.median(kept[:quarter])
    last = statistics.median(kept[-quarter:])
    allowed = max(first * max_growth_pct / 100.0, max_growth_mb)
    growth = last - first
    return MemoryVerdict(
        first_quarter_median_mb=round(first, 1),
        last_quarter_median_mb=round(last, 1),
        growth_mb=round(growth, 1),
        growth_pct=round(100.0 * growth / first, 2) if first else 0.0,
        allowed_mb=round(allowed, 1),
        warmup_s=warmup_s,
        samples=len(kept),
        passed=growth <= allowed,
    )


# --------------------------------------------------------------------------- locust
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
            "--only-summary",
            "--stop-timeout",
            "5",
            "--loglevel",
            "WARNING",
        ]
        if self.processes > 1:
            args += ["--processes", str(self.processes)]
        return [*args, *self.classes]

    def start(self) -> subprocess.Popen:
        with open(self.log_path, "wb") as log:
            return subprocess.Popen(
                self.command(),
                cwd=REPO_ROOT,
                env=subprocess_env(self.env),
                stdout=log,
                stderr=subprocess.STDOUT,
            )


def _number(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def read_stats(csv_prefix: Path) -> list[dict[str, Any]]:
    """Rows of locust's ``<prefix>_stats.csv``: name, requests, failures, rps, p50/p95/p99."""
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


def read_history(csv_prefix: Path) -> list[dict[str, float]]:
    """The aggregated rows of ``<prefix>_stats_history.csv`` (one per second).

    ``rps`` and ``failures_per_s`` are this interval's own rates, from the growth of locust's
    cumulative counts since the row before. (locust's ``Requests/s`` column is a trailing
    10-second average that reads 0 for the first seconds of a run.) The percentiles are locust's
    current-response-time ones, over its trailing window.
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
        ax.set_ylabel("latency ms (locust stats history)")
        steady = [row["p99_ms"] for row in history[len(history) // 10 :] if row["p99_ms"] > 0]
        if steady:  # the start-up window would flatten everything else
            ax.set_ylim(0, max(steady) * 1.3)
        twin = ax.twinx()
        twin.plot(t, [row["rps"] for row in history], color="grey", alpha=0.6, label="req/s")
        twin.set_ylabel("requests/s")
        twin.legend(loc="upper right")
    ax.set_xlabel("seconds")
    ax.set_title(title)
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
        f"{result['seconds']:.0f} s, batch mix {result['batches']}",
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
        memory = soak["memory"]
        lines += [
            "",
            "## Soak",
            "",
            f"- reload at {soak['reload_at_s']:.1f} s: {soak['reload']}",
            f"- server RSS: first-quarter median {memory['first_quarter_median_mb']} MB, "
            f"last-quarter median {memory['last_quarter_median_mb']} MB, growth "
            f"{memory['growth_mb']} MB ({memory['growth_pct']} %), allowed "
            f"{memory['allowed_mb']} MB, {memory['samples']} samples after "
            f"{memory['warmup_s']:.1f} s warm-up: **{'flat' if memory['passed'] else 'GROWING'}**",
            "- series: `rss.csv`",
        ]
    lines += ["", "Latency over time: `latency.png`; locust CSVs: `locust_*.csv`.", ""]
    (out / "summary.md").write_text("\n".join(lines))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    parser.add_argument("--spawn-rate", type=float, default=None, help="default: all at once")
    parser.add_argument("--seconds", type=float, default=10.0, help="load duration")
    parser.add_argument(
        "--user-classes",
        default="binary,json,friendly,grpc",
        help=f"comma-separated, from {', '.join(USER_CLASSES)}",
    )
    parser.add_argument("--batches", default="1:6,8:3,64:1", help="batch mix SIZE:WEIGHT,...")
    parser.add_argument(
        "--unknown-share", type=float, default=0.02, help="share of IDs the model never saw"
    )
    parser.add_argument("--model-name", default="model", help="served model name")
    parser.add_argument(
        "--serve-args", default="", help='extra `recserve serve` flags, e.g. "--max-batch-size 64"'
    )
    parser.add_argument(
        "--locust-processes", type=int, default=1, help="locust worker processes (--processes)"
    )
    parser.add_argument("--soak", action="store_true", help="memory + reload soak")
    parser.add_argument("--minutes", type=float, default=10.0, help="soak duration")
    parser.add_argument("--rss-interval", type=float, default=None, help="seconds (soak)")
    args = parser.parse_args(argv)
    if args.users < 1 or args.seconds <= 0 or args.minutes <= 0:
        parser.error("--users, --seconds and --minutes must be positive")
    if args.users > 1000 or args.seconds > 3600 or args.minutes > 120:
        parser.error("bounded runs only: at most 1000 users, 3600 s, 120 minutes")
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
    return args


def silent_classes(classes: list[str], stats: list[dict[str, Any]]) -> list[str]:
    """The user classes of ``classes`` without a single request in locust's ``stats`` rows
    (request names start with the class's label: ``v2-binary b64``)."""
    sent = {row["name"].split(" ", 1)[0] for row in stats if row["requests"] > 0}
    return [name for name in classes if REQUEST_LABELS.get(name, name) not in sent]


def task_exceptions(csv_prefix: Path) -> list[str]:
    """Errors raised inside locust tasks (``<prefix>_exceptions.csv``): they are not request
    failures, so the stats alone would not show them."""
    path = Path(f"{csv_prefix}_exceptions.csv")
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        return [
            f"{row.get('Count', '?')} x {row.get('Message', '').strip()[:200]}"
            for row in csv.DictReader(handle)
        ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    seconds = args.minutes * 60.0 if args.soak else args.seconds
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

    cluster = None
    server: ServeProcess | None = None
    locust: subprocess.Popen | None = None
    sampler: RssSampler | None = None
    serve_args = shlex.split(args.serve_args)
    try:
        try:
            if args.tier == "remote":
                cluster = start_remote_tier(served, out)
            server = ServeProcess(
                served,
                out / "serve.log",
                model_name=args.model_name,
                embedding_workers=",".join(cluster.worker_addresses) if cluster else "",
                extra_args=serve_args,
            ).start()
            metadata = traffic.fetch_metadata(server.http, args.model_name)
        except Exception as error:
            print(f"error: the stack did not start: {error}", file=sys.stderr)
            return 2
        inputs = traffic.ModelInputs.from_metadata(metadata)
        classes = [USER_CLASSES[name] for name in args.user_classes.split(",")]
        run = LocustRun(
            users=args.users,
            spawn_rate=args.spawn_rate or args.users,
            seconds=seconds,
            classes=classes,
            host=server.http,
            csv_prefix=out / "locust",
            log_path=out / "locust.log",
            env={
                "RECSERVE_LT_MODEL": args.model_name,
                "RECSERVE_LT_GRPC": server.grpc,
                "RECSERVE_LT_VOCAB": str(vocab_path),
                "RECSERVE_LT_BATCHES": args.batches,
                "RECSERVE_LT_UNKNOWN": str(args.unknown_share),
            },
            processes=args.locust_processes,
        )
        pids = {"server": server.pid}
        if cluster is not None:
            for process in [*cluster.shards, *cluster.workers]:
                pids[process.name.replace(" ", "_")] = process.process.pid
        interval = args.rss_interval or (max(0.25, min(seconds / 200.0, 5.0)) if args.soak else 1)
        sampler = RssSampler(pids, interval)
        sampler.start()
        started = time.monotonic()
        started_unix = time.time()
        locust = run.start()
        soak: dict[str, Any] | None = None
        marks: list[tuple[float, str]] = []
        if args.soak:
            reload_at = seconds / 2.0
            while time.monotonic() - started < reload_at and locust.poll() is None:
                time.sleep(0.1)
            reload_unix = time.time()
            try:
                version = publish_new_version(served)
                answer = server.reload()
                reload_result: dict[str, Any] = {
                    "ok": answer.get("version") == version,
                    "published": version,
                    **answer,
                    "seconds": round(time.time() - reload_unix, 3),
                }
            except Exception as error:  # report it; the verdict fails
                reload_result = {"ok": False, "error": repr(error)}
            marks.append((reload_unix, "reload"))
            soak = {"reload_at_s": reload_unix - started_unix, "reload": reload_result}
        try:
            locust.wait(timeout=seconds + 90)
        except subprocess.TimeoutExpired:
            stop_process(locust)
        sampler.stop()
        stats = read_stats(run.csv_prefix)
        history = read_history(run.csv_prefix)
        total = next(row for row in stats if row["name"] == "Aggregated")
        problems = []
        if total["failures"]:
            problems.append(f"{total['failures']} failed requests")
        if total["rps"] <= 0:
            problems.append("no throughput")
        silent = silent_classes(classes, stats)
        if silent:
            problems.append(f"user classes {silent} sent no requests")
        problems.extend(f"locust task error: {line}" for line in task_exceptions(run.csv_prefix))
        if soak is not None:
            samples = sampler.samples
            with open(out / "rss.csv", "w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=list(samples[0]))
                writer.writeheader()
                writer.writerows(samples)
            verdict = memory_verdict(
                [s["t_s"] for s in samples],
                [s["server_rss_mb"] for s in samples],
                warmup_s=max(0.1 * seconds, min(10.0, 0.2 * seconds)),
            )
            soak["memory"] = asdict(verdict)
            if not verdict.passed:
                problems.append(f"server RSS grew by {verdict.growth_mb} MB")
            if not soak["reload"].get("ok"):
                problems.append(f"reload failed: {soak['reload']}")
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
            (lambda: stop_process(locust)) if locust is not None else None,
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
