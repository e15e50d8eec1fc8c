"""Shared fixtures of the integration tests: ``recserve serve`` subprocesses on loopback
(killed by PID at teardown). The trained Adult checkpoints (``adult_checkpoint``,
``adult_checkpoint_b``) are session fixtures of ``tests/conftest.py``, shared with tests/e2e."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

# Re-exported: test modules import them from here.
from tests.conftest import REPO_ROOT as REPO_ROOT
from tests.conftest import TRAIN_SCRIPT as TRAIN_SCRIPT
from tests.conftest import _subprocess_env as _subprocess_env

ADULT_PREPROCESSOR = "examples.adult_income.preprocess:instances_to_batch"
_SERVING_LINE = re.compile(
    r"recserve serving model '(?P<model>[^']+)' version (?P<version>\S+): "
    r"HTTP listening on (?P<http_host>[^\s,]+):(?P<http_port>\d+), "
    r"gRPC listening on (?P<grpc_host>[^\s,]+):(?P<grpc_port>\d+)"
)


# --------------------------------------------------------------------------- servers
@dataclass
class ServeProcess:
    """A running ``recserve serve`` subprocess."""

    process: subprocess.Popen
    http_port: int
    grpc_port: int
    version: str
    log_path: Path
    host: str = "127.0.0.1"
    args: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        """SIGTERM (graceful drain); use ``process.wait`` for the exit code."""
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


def start_serve_process(
    checkpoint: Path, *extra_args: str, log_dir: Path, timeout: float = 90.0
) -> ServeProcess:
    """Start ``recserve serve`` on free loopback ports; return once it prints its ports."""
    log_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="serve-", suffix=".log", dir=log_dir)
    os.close(fd)
    log_path = Path(name)
    args = [
        sys.executable,
        "-m",
        "embedding_store.cli",
        "serve",
        "--checkpoint",
        str(checkpoint),
        "--host",
        "127.0.0.1",
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        *extra_args,
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            args, cwd=REPO_ROOT, env=_subprocess_env(), stdout=log, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + timeout
    while True:
        match = _SERVING_LINE.search(log_path.read_text(errors="replace"))
        if match:
            return ServeProcess(
                process=process,
                http_port=int(match["http_port"]),
                grpc_port=int(match["grpc_port"]),
                version=match["version"],
                log_path=log_path,
                host=match["http_host"],
                args=args,
            )
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
            raise RuntimeError(
                f"recserve serve did not start (exit {process.returncode}):\n"
                + log_path.read_text(errors="replace")[-4000:]
            )
        time.sleep(0.05)


@pytest.fixture(scope="session")
def serve_process(tmp_path_factory) -> Iterator[Callable[..., ServeProcess]]:
    """``serve_process(checkpoint, *args) -> ServeProcess``; every server started through it
    is killed (by PID) at the end of the session if it still runs."""
    started: list[ServeProcess] = []
    log_dir = tmp_path_factory.mktemp("serve-logs")

    def start(checkpoint: Path, *args: str, timeout: float = 90.0) -> ServeProcess:
        server = start_serve_process(checkpoint, *args, log_dir=log_dir, timeout=timeout)
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


@pytest.fixture
def copy_checkpoint(tmp_path) -> Callable[[Path, str], Path]:
    """``copy_checkpoint(src, name) -> tmp_path/name`` (a private, writable copy)."""

    def copy(source: Path, name: str) -> Path:
        return Path(shutil.copytree(source, tmp_path / name))

    return copy


def write_infer_global_config(directory: Path, checkpoint: Path) -> Path:
    """``directory/global_config.yml`` for an Infer tier (read-only shards) that loads
    ``checkpoint``'s embeddings at start."""
    path = directory / "global_config.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "common_config": {
                    "job_type": "Infer",
                    "infer_config": {"embedding_checkpoint": str(checkpoint / "embeddings")},
                },
                "embedding_parameter_server_config": {"capacity": 100_000},
            }
        )
    )
    return path
