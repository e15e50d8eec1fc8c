"""load_tests/locustfile.py's TorchServe users, checked in a subprocess (locust monkey-patches
the standard library on import), and load_tests/run.py's reading of locust's history CSV."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

_DESCRIBE = """
import json

import pytest
from load_tests import locustfile as lf, traffic

payload = traffic.Payload(8, b"", header_length=123)
users = {"json": lf.TorchServeJsonUser, "binary": lf.TorchServeBinaryUser,
         "kserve-binary": lf.KServeBinaryUser}
print(json.dumps({
    name: {"path": user.path, "kind": user.kind, "label": user.label,
           "abstract": user.abstract, "headers": user.headers(user, payload)}
    for name, user in users.items()
} | {"short_names": {k: v.__name__ for k, v in lf.USER_CLASSES.items()}}))
"""


def test_torchserve_binary_user_mirrors_the_json_and_kserve_binary_users():
    env = {**os.environ, "RECSERVE_LT_MODEL": "model", "RECSERVE_LT_TS_MODEL": "synthetic"}
    result = subprocess.run(
        [sys.executable, "-c", _DESCRIBE],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    users = json.loads(result.stdout.strip().splitlines()[-1])
    binary, plain, kserve = users["binary"], users["json"], users["kserve-binary"]
    assert binary["path"] == plain["path"] == "/predictions/synthetic"
    assert binary["kind"] == "binary" and not binary["abstract"]
    assert binary["label"] == "torchserve-binary"
    assert (
        binary["headers"]
        == kserve["headers"]
        == {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": "123",
        }
    )
    assert plain["headers"] == {"Content-Type": "application/json"}
    assert users["short_names"]["torchserve-binary"] == "TorchServeBinaryUser"
    # load_tests/run.py names the same users (it does not import locust itself).
    from load_tests import run

    assert users["short_names"] == run.USER_CLASSES


_HISTORY_HEADER = (
    "Timestamp,User Count,Type,Name,Requests/s,Failures/s,50%,66%,75%,80%,90%,95%,98%,99%,"
    "99.9%,99.99%,100%,Total Request Count,Total Failure Count,Total Median Response Time,"
    "Total Average Response Time,Total Min Response Time,Total Max Response Time,"
    "Total Average Content Size"
)


def _history_row(unix: int, name: str, p50: str, requests: int, failures: int) -> str:
    # locust's own Requests/s column (a trailing average) is 0 here on purpose: not used.
    return (
        f"{unix},8,,{name},0.0,0.0,{p50},{p50},{p50},{p50},{p50},{p50},{p50},{p50},{p50},{p50},"
        f"{p50},{requests},{failures},5,6.0,1,9,100"
    )


def test_read_history_gives_each_interval_its_own_rates(tmp_path):
    from load_tests.run import read_history

    lines = [
        _HISTORY_HEADER,
        _history_row(1000, "Aggregated", "N/A", 0, 0),
        _history_row(1001, "Aggregated", "5", 800, 0),
        _history_row(1001, "v2-json b1", "4", 500, 0),  # per-name rows are skipped
        _history_row(1003, "Aggregated", "7", 2400, 6),
    ]
    (tmp_path / "run_stats_history.csv").write_text("\n".join(lines) + "\n")
    history = read_history(tmp_path / "run")
    assert [row["unix"] for row in history] == [1000.0, 1001.0, 1003.0]
    assert [row["rps"] for row in history] == [0.0, 800.0, 800.0]  # 1600 requests in 2 s
    assert [row["failures_per_s"] for row in history] == [0.0, 0.0, 3.0]
    assert [row["p50_ms"] for row in history][1:] == [5.0, 7.0]
    assert history[0]["p50_ms"] != history[0]["p50_ms"]  # N/A -> NaN


def test_read_history_of_a_run_without_history_is_empty(tmp_path):
    from load_tests.run import read_history

    assert read_history(tmp_path / "missing") == []


def test_memory_verdict_compares_the_last_quarter_with_the_first_after_warmup():
    from load_tests.run import memory_verdict

    times = [float(t) for t in range(20)]
    # Warm-up (t < 4) climbs from 100 to 400 MB and is left out; then flat at 400-404.
    rss = [100.0, 200.0, 300.0, 400.0] + [400.0 + (t % 5) for t in range(16)]
    flat = memory_verdict(times, rss, warmup_s=4.0)
    assert flat.passed and flat.samples == 16
    assert flat.first_quarter_median_mb == 401.5 and flat.last_quarter_median_mb == 402.5
    assert flat.growth_mb == 1.0 and flat.allowed_mb == 60.2  # 15 % of 401.5 > 50 MB

    growing = memory_verdict(times, rss[:4] + [400.0 + 10 * t for t in range(16)], warmup_s=4.0)
    assert not growing.passed
    assert growing.first_quarter_median_mb == 415.0 and growing.last_quarter_median_mb == 535.0
    assert growing.growth_mb == 120.0 and growing.growth_pct == 28.92

    # Missing samples (-1) are skipped; fewer than 4 kept is no verdict at all: not a pass.
    assert not memory_verdict([0.0, 1.0, 2.0], [-1.0, 10.0, 10.0], warmup_s=0.0).passed


def test_a_user_class_that_sent_nothing_fails_the_run(tmp_path, capsys):
    from load_tests.run import parse_args, silent_classes, task_exceptions

    stats = [
        {"name": "v1-predict b1", "requests": 10},
        {"name": "v2-grpc b64", "requests": 3},
        {"name": "v2-binary b1", "requests": 0},
        {"name": "Aggregated", "requests": 13},
    ]
    classes = ["KServeBinaryUser", "KServeJsonUser", "FriendlyJsonUser", "GrpcUser"]
    assert silent_classes(classes, stats) == ["KServeBinaryUser", "KServeJsonUser"]
    assert silent_classes(["FriendlyJsonUser", "GrpcUser"], stats) == []
    common = ["--synthetic", "--out", str(tmp_path)]
    refused = [
        (["--users", "2"], "--users 2 is fewer than the 4 user classes"),
        (["--batches", "0:1"], "--batches '0:1': bad batch mix"),
        (["--batches", "x"], "--batches 'x'"),
        (["--unknown-share", "1.5"], "--unknown-share must be in [0, 1), got 1.5"),
    ]
    for bad, message in refused:  # before any process starts
        with pytest.raises(SystemExit):
            parse_args([*bad, *common])
        assert message in capsys.readouterr().err
    assert parse_args(["--batches", "64", *common]).batches == "64"
    (tmp_path / "run_exceptions.csv").write_text(
        "Count,Message,Traceback,Nodes\n3,ValueError('bad batch size'),tb,local\n"
    )
    assert task_exceptions(tmp_path / "run") == ["3 x ValueError('bad batch size')"]
    assert task_exceptions(tmp_path / "absent") == []
