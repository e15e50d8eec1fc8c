"""``recserve serve --workers N``: N server processes on the same ports, and the process
that supervises them.

Light to import (no torch): the supervisor only starts, signals and waits for its server
processes, which load the model themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from types import FrameType

from embedding_store.errors import UnavailableError
from serving.metrics import MULTIPROCESS_VARIABLE
from serving.options import ADMIN_TOKEN_VARIABLE, ServeOptions

log = logging.getLogger(__name__)


def _address_family(host: str) -> socket.AddressFamily:
    """IPv6 for an IPv6 literal (``::``, ``::1``), IPv4 otherwise."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _reserve_port(host: str, port: int, protocol: str) -> socket.socket:
    """A socket that holds ``host:port`` (``port`` 0: a free one) for the processes of a
    ``--workers`` server: bound, never listening, so it takes no connections. The processes
    bind the port with SO_REUSEPORT, which would also let them join another server already
    on it and split its traffic; this bind, without SO_REUSEPORT, fails on any such server.
    While it is held, only sockets of this user with SO_REUSEPORT (the processes) can bind
    the port: another server started meanwhile, even another ``--workers`` one, is refused
    rather than joining them. UnavailableError naming the address when it is taken."""
    reservation = socket.socket(_address_family(host), socket.SOCK_STREAM)
    # SO_REUSEADDR for the bind: connections of an earlier server in TIME_WAIT do not
    # count, a listening socket still does. Cleared after it, so that another server's
    # bind (with SO_REUSEADDR) conflicts with this one.
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        reservation.bind((host, port))
    except OSError as error:
        reservation.close()
        flag = "--http-port" if protocol == "HTTP" else "--grpc-port"
        raise UnavailableError(
            f"cannot listen for {protocol} on {host}:{port}: {error.strerror or error} "
            f"(is another server on that port? {flag} 0 picks a free one)"
        ) from None
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return reservation


def options_to_argv(options: ServeOptions) -> list[str]:
    """``recserve serve`` arguments that reproduce ``options`` (for worker processes), less
    the admin token: it goes in the ``RECSERVE_ADMIN_TOKEN`` variable, never in argv."""
    argv = ["serve"]
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        flag = "--" + field.name.replace("_", "-")
        if field.name == "admin_token":
            continue  # a secret: worker processes get it in their environment, not argv
        # FLAG=VALUE: a value that begins with "-" (a model name, a path) stays a value.
        if field.name in ("embedding_workers", "embedding_ps"):
            if value:
                argv.append(f"{flag}={','.join(value)}")
        elif isinstance(value, bool):
            if value:
                argv.append(flag)
        elif value is not None:
            argv.append(f"{flag}={value}")
    return argv


def serve_processes(options: ServeOptions) -> int:
    """Run ``options.workers`` server processes on the same ports (SO_REUSEPORT): HTTP
    parsing and model work spread over the cores; each process batches its own requests.

    SIGTERM/SIGINT are forwarded; a process still running ``--grace-seconds`` +
    :data:`STOP_MARGIN_SECONDS` after that (wedged) is killed. A process that exits while no
    stop was asked for (a crash, the OOM killer) stops the others, so the whole server exits
    non-zero and its supervisor (Kubernetes, compose, honcho) restarts it rather than it
    running on with fewer cores. The processes stop by themselves when this one is gone
    (killed outright), so they never hold the ports against its restart.
    Returns the worst exit code (128 + N for a process killed by signal N)."""
    supervisor = _Supervisor(kill_after=options.grace_seconds + STOP_MARGIN_SECONDS)
    # Before any process starts: a stop asked for from here on reaches every one of them.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, supervisor.forward)
    with (
        _reserve_port(options.host, options.http_port, "HTTP") as http_reservation,
        _reserve_port(options.host, options.grpc_port, "gRPC") as grpc_reservation,
    ):
        fixed = dataclasses.replace(
            options,
            http_port=http_reservation.getsockname()[1],
            grpc_port=grpc_reservation.getsockname()[1],
            workers=1,
            reuse_port=True,
            supervisor_pid=os.getpid(),
        )
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        command = [
            sys.executable, "-m", "embedding_store.cli", "--log-level", level,
            *options_to_argv(fixed),
        ]  # fmt: skip
        environment = dict(os.environ)
        if options.admin_token is not None:
            environment[ADMIN_TOKEN_VARIABLE] = options.admin_token
        # A scrape of /metrics reaches one process: they share their metrics through files
        # in a directory of this run's own (stale files of an earlier run would count again).
        metrics_directory = tempfile.mkdtemp(prefix="recserve-metrics-")
        environment[MULTIPROCESS_VARIABLE] = metrics_directory
        try:
            for _ in range(options.workers):
                if supervisor.stop_signal is not None:
                    break  # asked to stop while starting them: start no more
                supervisor.children.append(subprocess.Popen(command, env=environment))
            return supervisor.run(metrics_directory)
        finally:
            shutil.rmtree(metrics_directory, ignore_errors=True)


#: Seconds past ``--grace-seconds`` that a server process may take to stop (its own stop
#: is bounded by grace + ~4 s) before the supervisor kills it.
STOP_MARGIN_SECONDS = 10.0

#: Seconds between two looks at the server processes.
POLL_SECONDS = 0.2


class _Supervisor:
    """The server processes of one ``--workers`` server, and the stop asked of them."""

    def __init__(self, kill_after: float) -> None:
        self.children: list[subprocess.Popen] = []
        self.stop_signal: int | None = None  # the first SIGTERM/SIGINT (or a crash's stop)
        self.kill_after = kill_after

    def forward(self, signum: int, _frame: FrameType | None = None) -> None:
        """Signal handler: pass ``signum`` on to every process still running. It takes no
        lock (a second signal may interrupt it; see embedding_store.stop_signal)."""
        if self.stop_signal is None:
            self.stop_signal = signum
        for child in list(self.children):
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signum)

    def run(self, metrics_directory: str) -> int:
        """Watch the processes until all have exited; the worst exit code."""
        from prometheus_client import multiprocess

        if self.stop_signal is not None:  # a process started as the stop came may have missed it
            self.forward(self.stop_signal)
        crashed: subprocess.Popen | None = None
        dead: set[int] = set()
        kill_at: float | None = None
        while [child for child in self.children if child.poll() is None]:  # polls every one
            for child in self.children:
                if child.returncode is not None and child.pid not in dead:
                    dead.add(child.pid)  # its live gauges (ready, pending) no longer count
                    multiprocess.mark_process_dead(child.pid, metrics_directory)
            if crashed is None and self.stop_signal is None:
                crashed = next((c for c in self.children if c.returncode is not None), None)
                if crashed is not None:
                    log.error(
                        "server process %d exited (code %d) while serving: stopping the others",
                        crashed.pid,
                        crashed.returncode,
                    )
                    self.forward(signal.SIGTERM)
            if self.stop_signal is not None:
                if kill_at is None:
                    kill_at = time.monotonic() + self.kill_after
                elif time.monotonic() > kill_at:
                    wedged = [c for c in self.children if c.poll() is None]
                    log.error(
                        "server process(es) %s still running %.0f s after the stop: killing them",
                        ", ".join(str(c.pid) for c in wedged),
                        self.kill_after,
                    )
                    for child in wedged:
                        with contextlib.suppress(ProcessLookupError):
                            child.kill()
                    kill_at = math.inf
            time.sleep(POLL_SECONDS)
        # A process that the stop's own signal ended (it came before the process could
        # handle it, e.g. while it was still importing; or the CLI's 128 + N for an
        # interrupted start, 130 for a terminal's Ctrl-C) stopped as asked.
        stopped = () if self.stop_signal is None else (-self.stop_signal, 128 + self.stop_signal)
        codes = [
            0 if child.returncode in stopped
            else _exit_code(child.returncode)
            for child in self.children
        ]  # fmt: skip
        if crashed is not None and not any(codes):
            return 1  # it exited 0, but nobody asked it to
        return max(codes, default=0)


def _exit_code(returncode: int) -> int:
    """A child's exit status as a shell reports it: 128 + N when signal N killed it."""
    return 128 - returncode if returncode < 0 else returncode
