"""Start parameter-server shards and embedding workers as local subprocesses (tests, demos).

Each process listens on a free loopback port (port 0) and prints the address it got; the
launcher reads it from the process's log file, waits until every shard's gRPC health service
reports SERVING (see :class:`LocalCluster` for training shards) and then the workers, and
tears everything down by PID (SIGTERM, then SIGKILL after a grace period). It only ever
signals processes it started itself. Beyond one machine use Kubernetes (``deploy/``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from embedding_store.errors import RecserveError, UnavailableError

if TYPE_CHECKING:
    from embedding_store.initializer import InitializationConfig
    from embedding_store.optimizers import Optimizer

#: A whole line only: a port read before its line ended could be cut short (or run on into
#: a log line written after it).
_LISTENING = re.compile(r"listening on (\S+):(\d+)\r?\n")


@dataclass
class ManagedProcess:
    """One started subprocess, its log file and the address it listens on."""

    name: str
    args: list[str]
    log_path: Path
    process: subprocess.Popen | None = None
    address: str | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)
    #: Where this run's output starts in the log (logs are appended to across restarts).
    _log_start: int = field(default=0, repr=False)

    def start(self, env: dict[str, str]) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._log_start = self._log.tell()
        self.process = subprocess.Popen(
            self.args, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        self.address = None

    def wait_for_address(self, timeout: float) -> str:
        """The HOST:PORT the process printed; UnavailableError if it died or took too long."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # Only this run's lines: an earlier run's address is no longer listened on.
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                text = log.read().decode(errors="replace")
            for match in _LISTENING.finditer(text):
                self.address = f"{match.group(1)}:{match.group(2)}"
            if self.address:
                return self.address
            if self.process is not None and self.process.poll() is not None:
                raise UnavailableError(
                    f"{self.name} exited with code {self.process.returncode} before listening; "
                    f"log {self.log_path}:\n{_tail(text)}"
                )
            time.sleep(0.05)
        raise UnavailableError(f"{self.name} did not start listening within {timeout:.0f} s")

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the process's log ("" when there is none yet)."""
        try:
            return _tail(self.log_path.read_text(errors="replace"), lines)
        except OSError:
            return ""

    def stop(self, grace: float = 10.0, *, kill: bool = False) -> int | None:
        """SIGTERM (or SIGKILL with ``kill``) this process by PID and wait; returns its code."""
        code = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
                try:
                    self.process.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(timeout=grace)
            code = self.process.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return code


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.splitlines()[-lines:])


def recserve_command(*args: str) -> list[str]:
    """The argv that runs ``recserve ARGS`` with this interpreter."""
    return [sys.executable, "-m", "embedding_store.cli", *args]


class LocalCluster:
    """N parameter-server shards and M embedding workers on 127.0.0.1.

    Use as a context manager. ``ps_addresses[i]`` is replica i; ``worker_addresses`` are the
    workers, each routing to all shards.

    :meth:`start` (and :meth:`restart_shard`) return once every shard's gRPC health service
    (``grpc.health.v1``, overall service) reports SERVING, within the start timeout; a shard
    that exits or stays NOT_SERVING fails the start with an :class:`UnavailableError` naming it
    and quoting the tail of its log. An inference shard (``job_type: Infer``) is SERVING once
    its checkpoint is loaded. A training shard is SERVING only once an optimizer is configured:
    with ``optimizer`` (and ``initialization``) the launcher configures every training shard
    itself, as a trainer would, and waits for SERVING; without it the shards are left for the
    trainer to configure, and the launcher waits only until their health service answers.
    Likewise an inference shard without ``infer_config.embedding_checkpoint`` (it waits for a
    Load RPC).
    """

    def __init__(
        self,
        embedding_config: str | os.PathLike,
        global_config: str | os.PathLike | None = None,
        *,
        num_shards: int = 2,
        num_workers: int = 1,
        host: str = "127.0.0.1",
        log_dir: str | os.PathLike | None = None,
        shard_timeout: float = 5.0,
        extra_env: dict[str, str] | None = None,
        optimizer: Optimizer | None = None,
        initialization: InitializationConfig | None = None,
    ) -> None:
        if num_shards < 1 or num_workers < 0:
            raise ValueError("need at least one shard and a non-negative number of workers")
        if initialization is not None and optimizer is None:
            raise ValueError("initialization is sent with the optimizer: give optimizer too")
        self.embedding_config = str(embedding_config)
        self.global_config = str(global_config) if global_config else None
        self.optimizer = optimizer
        self.initialization = initialization
        self.num_shards = num_shards
        self.num_workers = num_workers
        self.host = host
        self.shard_timeout = shard_timeout
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="recserve-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        self.shards: list[ManagedProcess] = []
        self.workers: list[ManagedProcess] = []

    def _config_args(self) -> list[str]:
        args = ["--embedding-config", self.embedding_config]
        if self.global_config:
            args += ["--global-config", self.global_config]
        return args

    def _shard_process(self, index: int, port: int = 0) -> ManagedProcess:
        args = recserve_command(
            "embedding-parameter-server",
            *self._config_args(),
            "--replica-index",
            str(index),
            "--replica-size",
            str(self.num_shards),
            "--host",
            self.host,
            "--port",
            str(port),
        )
        return ManagedProcess(f"parameter server {index}", args, self.log_dir / f"ps-{index}.log")

    def start(self, timeout: float = 60.0) -> LocalCluster:
        try:
            for index in range(self.num_shards):
                shard = self._shard_process(index)
                shard.start(self.env)
                self.shards.append(shard)
            deadline = time.monotonic() + timeout
            for shard in self.shards:
                shard.wait_for_address(timeout)
            for index, shard in enumerate(self.shards):
                self._wait_for_shard(index, shard, deadline, timeout)
            for index in range(self.num_workers):
                args = recserve_command(
                    "embedding-worker",
                    *self._config_args(),
                    "--ps",
                    ",".join(self.ps_addresses),
                    "--host",
                    self.host,
                    "--port",
                    "0",
                    "--shard-timeout",
                    str(self.shard_timeout),
                )
                worker = ManagedProcess(
                    f"embedding worker {index}", args, self.log_dir / f"worker-{index}.log"
                )
                worker.start(self.env)
                self.workers.append(worker)
            for worker in self.workers:
                worker.wait_for_address(timeout)
            self.wait_for_workers(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _shard_must_serve(self) -> tuple[bool, bool]:
        """(whether the shards must become SERVING on their own, whether to configure them)."""
        from embedding_store.config import GLOBAL_CONFIG_ENV, JobType, load_global_config

        # The file the shards read: the flag, else the variable in *their* environment.
        path = self.global_config or self.env.get(GLOBAL_CONFIG_ENV) or None
        common = load_global_config(path).common_config
        if common.job_type is JobType.INFER:
            return common.infer_config.embedding_checkpoint is not None, False
        return self.optimizer is not None, self.optimizer is not None

    def _wait_for_shard(
        self, index: int, shard: ManagedProcess, deadline: float, timeout: float
    ) -> None:
        """Poll shard ``index``'s health until SERVING (or, when it cannot serve before a
        trainer's Configure or a Load RPC, until it answers); configure it first when the
        cluster has an optimizer. UnavailableError (naming the shard, with its log tail) when
        the process exits or ``deadline`` passes."""
        from embedding_store.ps_client import RemoteParameterServer

        must_serve, configure = self._shard_must_serve()
        last = "no answer"
        with RemoteParameterServer(shard.address or "", replica_index=index, timeout=1.0) as ps:
            while True:
                if not shard.alive:
                    code = None if shard.process is None else shard.process.returncode
                    raise UnavailableError(
                        f"{shard.name} ({shard.address}) exited with code {code} before it was "
                        f"SERVING; log {shard.log_path}:\n{shard.log_tail()}"
                    )
                remaining = deadline - time.monotonic()
                try:
                    last = ps.health("", timeout=max(0.05, min(remaining, 1.0)))
                    if configure:
                        ps.configure(self.optimizer, self.initialization)
                        configure = False
                        continue  # read the health that follows the configuration
                    if last == "SERVING" or not must_serve:
                        return
                except RecserveError as error:
                    last = error.message
                if remaining <= 0:
                    raise UnavailableError(
                        f"{shard.name} ({shard.address}) did not become SERVING within "
                        f"{timeout:g} s (health: {last}); log {shard.log_path}:\n"
                        f"{shard.log_tail()}"
                    )
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def wait_for_workers(self, timeout: float) -> None:
        from embedding_store.config import load_embedding_config
        from embedding_store.worker_client import RemoteEmbeddingWorker

        config = load_embedding_config(self.embedding_config)
        for address in self.worker_addresses:
            with RemoteEmbeddingWorker(address, config) as client:
                client.wait_for_serving(timeout)

    @property
    def ps_addresses(self) -> list[str]:
        return [s.address or "" for s in self.shards]

    @property
    def worker_addresses(self) -> list[str]:
        return [w.address or "" for w in self.workers]

    def kill_shard(self, index: int) -> None:
        """SIGKILL shard ``index`` (a crash, for failure tests)."""
        self.shards[index].stop(kill=True)

    def restart_shard(self, index: int, timeout: float = 60.0) -> str:
        """Start shard ``index`` again on the same port and wait for it as :meth:`start`
        does (SERVING, configured if the cluster has an optimizer); returns its address."""
        old = self.shards[index]
        port = int((old.address or ":0").rsplit(":", 1)[1])
        old.stop()
        shard = self._shard_process(index, port)
        shard.start(self.env)
        self.shards[index] = shard
        deadline = time.monotonic() + timeout
        address = shard.wait_for_address(timeout)
        self._wait_for_shard(index, shard, deadline, timeout)
        return address

    def stop(self, grace: float = 10.0) -> dict[str, int | None]:
        """Stop workers first (they flush gradients), then shards; returns exit codes."""
        codes = {}
        for process in [*self.workers, *self.shards]:
            codes[process.name] = process.stop(grace)
        return codes

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
