"""locust as a subprocess (:class:`LocustRun`), and the reading of what it wrote.

Final numbers come from locust's own totals, written by the locustfile when locust quits
(``<prefix>_final.json``): locust's ``--csv`` stats file is rewritten once a second and not at
shutdown. A locust that exits non-zero or writes no final stats fails the run, with the tail of
its log; so do failed requests, no throughput, a user class that sent nothing and errors
raised in locust tasks (:func:`stats_problems`), and seconds in which no request completed
(:func:`stall_problems`: a hung server's pending requests are never counted as failed).
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from load_tests.stack import REPO_ROOT, stop_process, subprocess_env, tail

LOCUSTFILE = Path(__file__).resolve().with_name("locustfile.py")
#: The request-name prefix of each user class in locust's stats (load_tests/locustfile.py).
REQUEST_LABELS = {
    "KServeBinaryUser": "v2-binary",
    "KServeJsonUser": "v2-json",
    "FriendlyJsonUser": "v1-predict",
    "GrpcUser": "v2-grpc",
    "TorchServeJsonUser": "torchserve-json",
    "TorchServeBinaryUser": "torchserve-binary",
}


def locust_installed() -> bool:
    """Whether ``python -m locust`` can run here (the same interpreter runs it)."""
    return importlib.util.find_spec("locust") is not None


#: Why the load tests refuse a ``user:password@`` part in a target URL (the client
#: library's wording says they are never sent and points to its certificate options: locust's
#: HTTP users would send them as Basic auth, and the load tests have no certificate option).
CREDENTIALS_REASON = (
    "the load tests' HTTP users would send them as Basic auth, and the server takes no "
    "credentials in the URL; remove them (the load tests have no client-certificate option)"
)


def checked_host(url: str, where: str = "--host") -> str:
    """``url``, the HTTP base URL of the server under load (given as ``where``: locust's
    ``--host``, or a variable), once checked as the client library checks a server URL
    (:func:`clients.client.parse_url`: a host, a valid port, no ``user:password@`` part);
    it must also be ``http://`` or ``https://`` with the scheme written out (locust and
    urllib take nothing else). ValueError naming ``where`` otherwise: locust sent every
    request to such a URL and counted each failure, or sent credentials that recserve
    takes no notice of."""
    from clients.client import parse_url
    from embedding_store.errors import InvalidArgumentError

    try:
        endpoint = parse_url(url, credentials_reason=CREDENTIALS_REASON)
    except InvalidArgumentError as error:
        raise ValueError(f"{where}: {error.message}") from None
    if endpoint.protocol != "http":
        raise ValueError(
            f"{where} {endpoint.url!r}: the server's HTTP URL is needed (http:// or https://); "
            "GrpcUser's gRPC address goes in RECSERVE_LT_GRPC=HOST:PORT"
        )
    if "://" not in url:
        raise ValueError(f"{where} {endpoint.url!r}: write the scheme out: http://{url.strip()}")
    return url


def checked_grpc_target(target: str, where: str = "RECSERVE_LT_GRPC") -> str:
    """``target``, the gRPC ``HOST:PORT`` of the server under load (given as ``where``), once
    checked as the client library checks ``grpc://HOST:PORT`` (:func:`clients.client.parse_url`:
    a host, a port, no path, no ``user:password@``), which is what the gRPC users connect
    to. ValueError naming ``where`` otherwise: every user failed at its start, one after
    another, with the client's error."""
    from clients._urls import redact_url
    from clients.client import parse_url
    from embedding_store.errors import InvalidArgumentError

    text = target.strip()
    if "://" in text:
        raise ValueError(
            f"{where} {redact_url(text)!r}: give HOST:PORT without a scheme (the gRPC users "
            "connect to grpc://HOST:PORT; they have no TLS option)"
        )
    try:
        parse_url(
            f"grpc://{text}",
            credentials_reason="the gRPC users would not send them, and the server takes no "
            "credentials in the URL; remove them (the load tests have no client-certificate "
            "option)",
        )
    except InvalidArgumentError as error:
        raise ValueError(f"{where}: {error.message}") from None
    return text


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
    #: With ``processes`` > 1, the port the master listens on for its worker processes, on
    #: 127.0.0.1: picked free by :meth:`start` (locust's default is 5557 on every interface,
    #: so a second such run on the machine, or anything else on 5557, stopped it).
    master_port: int = 0
    process: subprocess.Popen | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        checked_host(self.host)  # the locustfile checks it too, when locust is run by hand

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
            if self.master_port:
                args += ["--master-bind-host", "127.0.0.1", "--master-bind-port",
                         str(self.master_port), "--master-port", str(self.master_port)]  # fmt: skip
        return [*args, *self.classes]

    def clear_outputs(self) -> None:
        """Delete an earlier run's files at this prefix: what is read afterwards is this run's."""
        for suffix in LOCUST_OUTPUTS:
            Path(f"{self.csv_prefix}{suffix}").unlink(missing_ok=True)

    def start(self) -> subprocess.Popen:
        self.clear_outputs()
        if self.processes > 1 and not self.master_port:
            self.master_port = free_port()  # just before locust binds it: a short race
        env = {**self.env, "RECSERVE_LT_FINAL_STATS": str(self.final_stats_path)}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command(),
                cwd=REPO_ROOT,
                env=subprocess_env(env),
                stdout=log,
                stderr=subprocess.STDOUT,
                # With --processes, a process group of its own: the workers it forks are
                # found through it (see stop()) even once the master is gone.
                start_new_session=self.processes > 1,
            )
        return self.process

    def stop(self, grace: float = 15.0) -> int | None:
        """Stop locust by its PID (SIGTERM: it still writes its final stats; SIGKILL after
        ``grace``) and, with ``processes`` > 1, then every worker process it forked that is
        left in its process group: a master that failed to start (its port taken) or was
        killed left its workers running, orphaned. Returns the master's exit code."""
        code = stop_process(self.process, grace)
        if self.process is None or self.processes <= 1:
            return code
        group = self.process.pid  # its own session's: only processes locust forked
        with contextlib.suppress(ProcessLookupError):  # none left: nothing to do
            os.killpg(group, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while _group_running(group) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _group_running(group):
                os.killpg(group, signal.SIGKILL)
        return code


def _group_running(group: int) -> bool:
    """Whether a process of process group ``group`` still runs: one that is not a zombie
    (an orphan's zombie waits for whoever adopted it, and no signal ends it)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it ended while we looked
        # After the command: state, ppid, pgrp (proc(5)).
        if len(fields) > 2 and fields[2] == str(group) and fields[0] not in ("Z", "X"):
            return True
    return False


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _number(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def batch_size_of(name: str) -> int | None:
    """The batch size a locust request name carries (load_tests/locustfile.py names each
    request ``<label> b<rows>``: ``v2-binary b64`` -> 64), or None for another name
    (``Aggregated``)."""
    label, separator, size = name.rpartition(" b")
    return int(size) if separator and label and size.isdigit() else None


def rows_per_second(rows: list[dict[str, Any]]) -> float:
    """Rows (samples) per second of a locust run's stats ``rows``: each request name's req/s
    times its batch size, summed over the names (``Aggregated`` and names without a batch
    size left out)."""
    total = 0.0
    for row in rows:
        size = batch_size_of(row["name"])
        if row["name"] != "Aggregated" and size is not None:
            total += row["rps"] * size
    return total


def add_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` (stats rows: name, requests, rps, ...) with ``rows`` (rows sent: requests
    times the batch size of the name, :func:`batch_size_of`) and ``rows_per_s`` (req/s times
    it) on each: the ``Aggregated`` row's are the sums over the named rows (its requests mix
    batch sizes and protocols). A name without a batch size has None, and then so does
    ``Aggregated`` (its rows are not known)."""
    out = []
    named = [row for row in rows if row["name"] != "Aggregated"]
    sizes = [batch_size_of(row["name"]) for row in named]
    known = None not in sizes
    for row in rows:
        size = batch_size_of(row["name"])
        sent: int | None
        if row["name"] == "Aggregated":
            sent = sum(r["requests"] * (n or 0) for r, n in zip(named, sizes)) if known else None
            rate = round(rows_per_second(named), 2) if known else None
        else:
            sent = None if size is None else row["requests"] * size
            rate = None if size is None else round(row["rps"] * size, 2)
        out.append({**row, "rows": sent, "rows_per_s": rate})
    return out


def read_final_stats(path: Path) -> dict[str, Any] | None:
    """The locustfile's final stats (``exit_code``, ``written_unix``, ``stats`` rows as
    :func:`read_stats` returns them, ``errors``, ``exceptions``); None when absent or torn."""
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) and "stats" in document else None


def read_stats(csv_prefix: Path) -> list[dict[str, Any]]:
    """Rows of a locust run: name, requests, failures, rps, p50/p95/p99 (ms), avg, max, rows
    and rows_per_s (:func:`add_rows`).

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
    return add_rows(rows)


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
            f"({run.final_stats_path.name}); {run.log_path}:\n{tail(run.log_path, 20)}"
        )
    elif returncode != 0:
        total: dict[str, Any] = next((r for r in final["stats"] if r["name"] == "Aggregated"), {})
        explained = total.get("failures") or final.get("exceptions")
        problems.append(
            f"locust exited with code {returncode}"
            + ("" if explained else f"; {run.log_path}:\n{tail(run.log_path, 20)}")
        )
    return final, problems


#: Seconds between the reports of a locust worker process to its master (locust's
#: ``WORKER_REPORT_INTERVAL``): with ``--processes`` the master's counts, and so its history,
#: grow in steps this far apart per worker.
WORKER_REPORT_S = 3.0


def rate_window_s(processes: int) -> float:
    """The window of the history's rates (:func:`read_history`) for a locust run of
    ``processes`` processes: 1 s, or the workers' report interval with ``--processes``."""
    return WORKER_REPORT_S if processes > 1 else 1.0


def read_history(csv_prefix: Path, window_s: float = 1.0) -> list[dict[str, float]]:
    """The aggregated rows of ``<prefix>_stats_history.csv`` (one per second).

    ``rps`` and ``failures_per_s`` are rates over the trailing ``window_s`` seconds: the growth
    of locust's cumulative counts since the last row at least ``window_s`` older (since the
    first row, early in the run). ``window_s`` 1 (one process) gives each interval its own
    rate; with ``--processes`` pass :data:`WORKER_REPORT_S`: the master's counts grow only when
    a worker reports, every 3 s, and per-second rates read ~3x the rate, then 0. Such a
    window holds about one report of each worker; not always exactly one (the reports drift a
    little, and a worker reports once more when its users stop): a 2-process run at ~550 req/s
    read 0 / 1445 / 0 / 0 / 1794 / 0 / 823 / 614 / 809 per second, and 482 / 482 / 482 / 598 /
    598 / 872 / 479 / 749 over 3 s windows. ``completed`` is the requests (failed ones too)
    counted in the row's own interval, for :func:`stall_problems`. (locust's ``Requests/s``
    column is a trailing 10-second average that reads 0 for the first seconds of a run.) The
    percentiles are the history's: with ``--csv-full-history`` (:meth:`LocustRun.command`)
    locust's "current" ones, over the trailing ~10 s window
    (``CURRENT_RESPONSE_TIME_PERCENTILE_WINDOW``; 0, read as NaN, until that window has data);
    without the flag locust writes percentiles cumulative since the start of the run, which
    flatten any change over time. locust's CSV writer truncates them to whole ms (a window's
    4.8 ms reads 4, a sub-ms one 0, i.e. NaN): good for the picture; the summary's percentiles
    come from the final stats, to 2 significant digits (load_tests/locustfile.py
    ``latency_bucket``).
    """
    rows: list[dict[str, float]] = []
    path = Path(f"{csv_prefix}_stats_history.csv")
    if not path.exists():
        return rows
    counts: list[tuple[float, int, int]] = []  # (unix, requests, failures) of every row
    base = 0  # the last row at least window_s older than the current one (or the first)
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            if row["Name"] != "Aggregated":
                continue
            unix = float(row["Timestamp"])
            requests, failures = int(row["Total Request Count"]), int(row["Total Failure Count"])
            completed = requests - counts[-1][1] if counts else 0
            counts.append((unix, requests, failures))
            while base + 1 < len(counts) and counts[base + 1][0] <= unix - window_s:
                base += 1
            rps = failures_per_s = 0.0
            elapsed = unix - counts[base][0]
            if elapsed > 0:
                rps = (requests - counts[base][1]) / elapsed
                failures_per_s = (failures - counts[base][2]) / elapsed
            rows.append(
                {
                    "unix": unix,
                    "users": float(row["User Count"]),
                    "rps": rps,
                    "failures_per_s": failures_per_s,
                    "completed": float(completed),
                    "p50_ms": _number(row["50%"]) or float("nan"),
                    "p95_ms": _number(row["95%"]) or float("nan"),
                    "p99_ms": _number(row["99%"]) or float("nan"),
                }
            )
    return rows


#: Seconds in which not one request completed (a failed one counts as completed) while users
#: ran that fail a run: see :func:`stall_problems`.
STALL_S = 5.0


def stall_problems(history: list[dict[str, float]], limit_s: float = STALL_S) -> list[str]:
    """Stretches of at least ``limit_s`` seconds of the run's ``history`` (:func:`read_history`)
    in which no request completed while users ran, after the first one did.

    A server that stops answering fails no request until a client times out (60 s over HTTP):
    locust ends its users at ``-t`` with their requests still pending, and counts none of
    them, so a server hung for the last seconds of a run passed with 0 failures. A stretch is
    measured over history rows that show no growth; a load generator too busy to write rows
    (no rows at all) is not taken for a server that stopped."""
    problems = []
    start = history[0]["unix"] if history else 0.0
    grew: float | None = None  # the last row whose interval completed requests
    quiet: float | None = None  # the last row after it that completed none

    def close() -> None:
        if grew is not None and quiet is not None and quiet - grew >= limit_s:
            problems.append(
                f"no request completed for {quiet - grew:.0f} s while users ran (from "
                f"{grew - start:.0f} s into the run): the server stopped answering"
            )

    for row in history:
        if row["users"] <= 0:  # before the users start or once they stopped
            continue
        if row["completed"] > 0:
            close()
            grew, quiet = row["unix"], None
        elif grew is not None:
            quiet = row["unix"]
    close()
    return problems


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
