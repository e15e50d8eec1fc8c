"""load_tests/: the locustfile imports, traffic follows the metadata, and short bounded runs of
load_tests/run.py (a load run on the Adult model served with the Adult preprocessor, embedded,
and through the remote tier of 2 parameter servers + 1 embedding worker, a soak with a reload
on the synthetic Criteo-like model) pass with zero failed requests; SIGTERM to run.py stops
every process it started."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from load_tests import traffic

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN = REPO_ROOT / "load_tests" / "run.py"
ADULT_PREPROCESSOR = "examples.adult_income.preprocess:instances_to_batch"

METADATA = {
    "name": "model",
    "inputs": [
        {"name": "user", "datatype": "INT64", "shape": [-1]},
        {"name": "history", "datatype": "UINT64", "shape": [-1]},
        {"name": "history.lengths", "datatype": "INT64", "shape": [-1]},
        {"name": "dense", "datatype": "FP32", "shape": [-1, 3]},
    ],
    "outputs": [{"name": "prediction", "datatype": "FP32", "shape": [-1, 1]}],
}


class _Started:
    """``load_tests/run.py ARGS`` started now, in the background, for the run whose --out is
    ``out`` (its stdout and stderr to files beside it, so that a full pipe never blocks it
    while another test runs); :meth:`result` waits for it."""

    def __init__(self, args: list[str], out: Path, timeout: float) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.stdout, self.stderr = out.parent / "run.stdout", out.parent / "run.stderr"
        self.deadline = time.monotonic() + timeout
        with open(self.stdout, "wb") as stdout, open(self.stderr, "wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, str(RUN), *args, "--out", str(out)],
                cwd=REPO_ROOT,
                stdout=stdout,
                stderr=stderr,
            )

    def result(self) -> subprocess.CompletedProcess:
        """Waits until ``timeout`` seconds after the start (stopped past it: TimeoutExpired)."""
        try:
            code = self.process.wait(timeout=max(self.deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        return subprocess.CompletedProcess(
            self.process.args,
            code,
            self.stdout.read_text(errors="replace"),
            self.stderr.read_text(errors="replace"),
        )

    def stop(self) -> None:
        """SIGTERM first: run.py then stops every process it started (a SIGKILL would orphan
        them); SIGKILL if it has not ended 30 s later."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def _concurrent(
    request: pytest.FixtureRequest, folder: Path, runs: dict[str, tuple[list[str], float]]
) -> Iterator[dict[str, _Started]]:
    """The runs (test name -> (run.py arguments but --out, timeout)) of the tests selected in
    this session, all started at once, each with --out ``folder/<test name>/out``: bounded
    runs whose time is mostly their fixed --seconds/--minutes of load overlap instead of
    adding up (~20 s less on 2 cores), and each test still checks its own run."""
    selected = {item.name for item in request.session.items}
    started: dict[str, _Started] = {}
    try:
        for name, (args, timeout) in runs.items():
            if name in selected:
                started[name] = _Started(args, folder / name / "out", timeout)
        yield started
    finally:
        for run in started.values():
            run.stop()


def test_locustfile_imports_and_lists_its_users():
    result = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "load_tests/locustfile.py", "--list"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    listing = result.stdout + result.stderr
    for user in ("KServeBinaryUser", "KServeJsonUser", "FriendlyJsonUser", "GrpcUser"):
        assert user in listing


def test_traffic_follows_the_metadata():
    inputs = traffic.ModelInputs.from_metadata(METADATA)
    assert [(s.name, s.jagged) for s in inputs.id_slots] == [("user", False), ("history", True)]
    profile = traffic.TrafficProfile(unknown_share=0.5, default_vocab=100, seed=1)
    generator = traffic.TrafficGenerator(inputs, profile, {"user": np.arange(10, 20)})
    arrays = generator.arrays(64)
    assert arrays["user"].dtype == np.int64 and arrays["user"].shape == (64,)
    assert arrays["history"].dtype == np.uint64
    assert int(arrays["history.lengths"].sum()) == len(arrays["history"])
    assert arrays["dense"].shape == (64, 3) and arrays["dense"].dtype == np.float32
    known = (arrays["user"] >= 10) & (arrays["user"] < 20)
    assert 0 < known.sum() < 64  # a share of unknown IDs, the rest from the vocabulary
    assert (arrays["user"][~known] >= traffic.UNKNOWN_LOW).all()
    body, header = traffic.encode_kserve_binary(arrays)
    head = json.loads(body[:header])
    assert sum(i["parameters"]["binary_data_size"] for i in head["inputs"]) == len(body) - header
    friendly = json.loads(traffic.encode_friendly_json(inputs, arrays))["instances"]
    assert len(friendly) == 64 and len(friendly[0]["dense"]) == 3
    assert sum(len(row["history"]) for row in friendly) == len(arrays["history"])
    pool = traffic.PayloadPool(generator, "json", per_size=2)
    assert {pool.pick().batch_size for _ in range(50)} <= set(profile.batch_sizes)


def _summary(out: Path) -> dict:
    for name in ("summary.csv", "summary.md", "summary.json", "latency.png"):
        assert (out / name).exists(), name
    with open(out / "summary.csv", newline="") as handle:
        rows = {row["name"]: row for row in csv.DictReader(handle)}
    total = rows["Aggregated"]
    assert float(total["rps"]) > 0
    assert int(total["failures"]) == 0
    # rows/s on every row: req/s times the name's batch size; the all row's sums them.
    named = [row for name, row in rows.items() if name != "Aggregated"]
    for row in named:
        size = int(row["name"].rpartition(" b")[2])
        assert float(row["rows_per_s"]) == round(float(row["rps"]) * size, 2), row
        assert int(row["rows"]) == int(row["requests"]) * size, row
    assert int(total["rows"]) == sum(int(row["rows"]) for row in named)
    assert abs(float(total["rows_per_s"]) - sum(float(r["rows_per_s"]) for r in named)) < 0.05
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def load_runs(
    request: pytest.FixtureRequest, adult_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, _Started]]:
    """The embedded and the remote-tier load runs of the Adult checkpoint, started together
    (test name -> run)."""
    runs = {
        "test_short_embedded_run": (
            ["--checkpoint", str(adult_checkpoint), "--users", "4", "--seconds", "5",
             "--warmup-seconds", "1", "--serve-args", f"--preprocessor {ADULT_PREPROCESSOR}"],
            150.0,
        ),
        "test_short_remote_tier_run": (
            ["--checkpoint", str(adult_checkpoint), "--tier", "remote", "--users", "4",
             "--seconds", "4", "--user-classes", "json,grpc,friendly", "--warmup-seconds", "0"],
            200.0,
        ),
    }  # fmt: skip
    with _concurrent(request, tmp_path_factory.mktemp("load-runs"), runs) as started:
        yield started


@pytest.fixture(scope="module")
def soak_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, _Started]]:
    """The two soaks (one server process reloaded by POST; a --workers 2 server reloaded
    through its watcher), started together (test name -> run)."""
    runs = {
        "test_short_soak_with_reload": (
            ["--synthetic", "--soak", "--minutes", "0.25", "--users", "4", "--user-classes",
             "binary,grpc", "--warmup-seconds", "0"],
            220.0,
        ),
        "test_short_soak_with_reload_through_the_watcher_of_a_workers_server": (
            ["--synthetic", "--soak", "--minutes", "0.25", "--users", "4", "--user-classes",
             "binary,grpc", "--serve-args", "--workers 2 --watch-seconds 1",
             "--warmup-seconds", "0"],
            130.0,
        ),
    }  # fmt: skip
    with _concurrent(request, tmp_path_factory.mktemp("soak-runs"), runs) as started:
        yield started


@pytest.mark.timeout(180)
def test_short_embedded_run(load_runs):
    """Served as the README serves Adult: the friendly route takes raw rows through the
    preprocessor, so the friendly user sends the Adult test rows (slot IDs failed 100%)."""
    run = load_runs["test_short_embedded_run"]
    result, out = run.result(), run.out
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = _summary(out)
    assert summary["passed"] and summary["locust_exit_code"] == 0
    assert summary["friendly_rows"].endswith("test.csv.gz")
    names = {row["name"] for row in summary["stats"]}
    for label in ("v2-binary", "v2-json", "v1-predict", "v2-grpc"):
        assert any(name.startswith(label) for name in names), names
    # The summary's numbers are locust's final ones, not its once-a-second CSV, and none of
    # the warm-up's (a locust run of its own before the load).
    final = json.loads((out / "locust_final.json").read_text())
    assert summary["stats"] == final["stats"]
    warmup = json.loads((out / "locust_warmup_final.json").read_text())
    warmup_total = next(row for row in warmup["stats"] if row["name"] == "Aggregated")
    assert summary["warmup"]["requests"] == warmup_total["requests"] > 0
    assert summary["warmup"]["seconds"] == 1.0 and summary["warmup"]["problems"] == []
    assert warmup["written_unix"] < final["written_unix"]


@pytest.mark.timeout(240)
def test_short_remote_tier_run(load_runs):
    """2 parameter servers (Infer mode, loading the checkpoint's embeddings) + 1 embedding
    worker + the server looking embeddings up through the worker, under HTTP and gRPC load."""
    run = load_runs["test_short_remote_tier_run"]
    result, out = run.result(), run.out
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = _summary(out)
    assert summary["passed"] and summary["tier"] == "remote"
    names = {row["name"] for row in summary["stats"]}
    for label in ("v2-json", "v2-grpc", "v1-predict"):  # friendly: slot IDs, no preprocessor
        assert any(name.startswith(label) for name in names), names
    for process in ("ps-0", "ps-1", "worker-0"):
        assert (out / "cluster" / f"{process}.log").exists(), process


@pytest.mark.timeout(240)
def test_short_soak_with_reload(soak_runs):
    run = soak_runs["test_short_soak_with_reload"]
    result, out = run.result(), run.out
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = _summary(out)
    assert summary["verdict"] == "no failures, memory flat, reload served", summary["verdict"]
    soak = summary["soak"]
    assert soak["reload"]["ok"], soak["reload"]
    assert soak["reload"]["version"] != soak["reload"]["previous_version"]
    # What the server serves after it, not only what its reload answered.
    assert soak["reload"]["serves"] == {
        "ok": True,
        "metadata_versions": [soak["reload"]["version"]],
        "answered_version": soak["reload"]["version"],
    }
    assert list(soak["memory"]) == ["server"]
    assert soak["memory"]["server"]["passed"], soak["memory"]
    assert (out / "rss.csv").read_text().count("\n") > 10


@pytest.mark.timeout(150)
def test_short_soak_with_reload_through_the_watcher_of_a_workers_server(soak_runs):
    """A ``--workers 2`` server refuses ``POST /admin/reload`` (409), which failed every soak
    of one although both processes reloaded: the soak now publishes the new version where
    the server watches and waits until /metrics says every process serves it. RSS is
    sampled per process (the supervisor and each serving process), not summed."""
    run = soak_runs["test_short_soak_with_reload_through_the_watcher_of_a_workers_server"]
    result, out = run.result(), run.out
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    soak = _summary(out)["soak"]
    reload = soak["reload"]
    assert reload["ok"] and reload["via"] == "watcher", reload
    assert reload["version"] == reload["published"] != reload["previous_version"]
    assert reload["serves"]["answered_version"] == reload["version"], reload
    log = (out / "serve.log").read_text()
    assert log.count(f"now serving model version {reload['version']}") == 2, log[-3000:]
    assert list(soak["memory"]) == ["server", "server.1", "server.2"]
    assert all(memory["passed"] for memory in soak["memory"].values()), soak["memory"]
    pids = soak["pids"]
    assert len(set(pids.values())) == 3, pids
    with open(out / "rss.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) > 10
    for name in ("server", "server.1", "server.2"):
        assert all(float(row[f"{name}_rss_mb"]) > 0 for row in rows), name


def _processes_naming(text: str) -> list[str]:
    """Command lines of the live processes that contain ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in command:
            found.append(f"{proc.name}: {command}")
    return found


@pytest.mark.timeout(120)
def test_sigterm_stops_every_process(adult_checkpoint, tmp_path):
    """run.py had no SIGTERM handler: the server and locust lived on with PPID 1. (A soak, so
    that the server's command line names the output folder: its served copy.)"""
    out = tmp_path / "term"
    process = subprocess.Popen(
        [sys.executable, str(RUN), "--checkpoint", str(adult_checkpoint), "--soak", "--minutes",
         "2", "--users", "2", "--user-classes", "binary,grpc", "--out", str(out)],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        started: list[str] = []
        while time.monotonic() < deadline:  # until the server and locust both run
            assert process.poll() is None, process.stdout.read().decode()[-3000:]
            started = _processes_naming(str(out))
            if sum(("cli serve" in c) or ("-m locust" in c) for c in started) == 2:
                break
            time.sleep(0.2)
        assert sum(("cli serve" in c) or ("-m locust" in c) for c in started) == 2, started
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(timeout=60) == 143
        assert _processes_naming(str(out)) == []
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
