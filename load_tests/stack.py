"""The serving stack of a load run as processes, each started here and ended by its PID.

``recserve serve`` as a subprocess (:class:`ServeProcess`: waits for its listening line, then
for readiness), the remote tier (LocalCluster: 2 parameter servers in Infer mode loading the
checkpoint's embeddings read-only + 1 embedding worker), the PIDs of the processes of a
``recserve serve --workers N`` server, the values of ``recserve serve`` flags, which processes
of the stack died, SIGTERM turned into SystemExit so that ``finally`` blocks stop every
process (on Ctrl-C too), and the cleanup that does so, which a second signal cannot cut short.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from embedding_store.launcher import LocalCluster

REPO_ROOT = Path(__file__).resolve().parents[1]
_SERVING_LINE = re.compile(
    r"HTTP listening on (?P<http_host>[^\s,]+):(?P<http_port>\d+), "
    r"gRPC listening on (?P<grpc_host>[^\s,]+):(?P<grpc_port>\d+)"
)


def subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def tail(path: Path, lines: int = 30) -> str:
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
                        f"recserve serve exited with {self.process.returncode} before it "
                        f"listened; {self.log_path}:\n{tail(self.log_path)}"
                    )
                time.sleep(0.1)
            raise RuntimeError(
                f"recserve serve did not listen within {timeout:.0f} s; {self.log_path}:\n"
                f"{tail(self.log_path)}"
            )
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # Not listening yet, or not ready (an error status): ask again below.
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(f"{self.http}/v2/health/ready", timeout=2) as r,
            ):
                if r.status == 200:
                    return
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"recserve serve exited with {self.process.returncode} before it was "
                    f"ready; {self.log_path}:\n{tail(self.log_path)}"
                )
            time.sleep(0.1)
        raise RuntimeError(
            f"recserve serve at {self.http} is not ready after {timeout:.0f} s; "
            f"{self.log_path}:\n{tail(self.log_path)}"
        )

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


# --------------------------------------------------------------------------- processes
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


def dead_processes(processes: dict[str, tuple[subprocess.Popen | None, Path]]) -> list[str]:
    """Which of the stack's processes (name -> (process, log)) have exited, with their exit
    code and log tail: a server that died is the cause, its requests' failures the symptom."""
    return [
        f"{name} (pid {process.pid}) died during the run with exit code {process.returncode}; "
        f"{log}:\n{tail(log, 15)}"
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


def run_cleanups(steps: Sequence[Callable[[], object] | None]) -> None:
    """Run every cleanup step (None: nothing to clean), in order, each on its own: one that
    raises is reported on stderr and the next still runs. Ctrl-C (SIGINT) and SIGTERM are
    ignored meanwhile (in the main thread; every step is bounded by its own grace periods):
    a second Ctrl-C while locust was being stopped ended the cleanup there, and the server
    and the remote tier were left running."""
    main = threading.current_thread() is threading.main_thread()
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in held} if main else {}
    try:
        for step in steps:
            if step is None:
                continue
            try:
                step()
            except Exception as error:  # keep cleaning up
                print(f"warning: cleanup failed: {error!r}", file=sys.stderr)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# --------------------------------------------------------------------------- serve flags
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


def watch_seconds_of(serve_args: list[str]) -> float:
    """The ``--watch-seconds`` of ``recserve serve`` flags (0, off, when absent)."""
    try:
        value = float(serve_option(serve_args, "--watch-seconds") or 0.0)
    except ValueError:
        return 0.0
    return value if math.isfinite(value) else 0.0
