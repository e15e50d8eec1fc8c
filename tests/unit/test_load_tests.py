"""load_tests/locustfile.py's TorchServe users, checked in a subprocess (locust monkey-patches
the standard library on import), and load_tests/run.py's reading of locust's history CSV."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

_DESCRIBE = """
import json
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
