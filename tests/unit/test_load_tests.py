"""load_tests/locustfile.py's TorchServe users, checked in a subprocess (locust monkey-patches
the standard library on import), and load_tests/locust_run.py's reading of locust's history CSV."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.unit.python_script import last_json_line, run_python

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
    result = run_python(_DESCRIBE, env=env)
    users = last_json_line(result)
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
    from load_tests.locust_run import read_history

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


def test_read_history_of_locust_processes_gives_rates_over_their_report_interval(tmp_path):
    """With --processes the master's counts grow only when a worker reports, every 3 s: the
    per-second rates of its history read 3x the rate, then 0 (the plot's req/s spiked). Over
    windows of the report interval each row reads the steady rate: here 2 workers, 100 req/s
    each, reporting 300 requests every 3 s at their own phases, read 200 req/s."""
    from load_tests.locust_run import WORKER_REPORT_S, rate_window_s, read_history

    assert [rate_window_s(n) for n in (1, 2, 8)] == [1.0, WORKER_REPORT_S, WORKER_REPORT_S]
    reports = [(1000.5 + 3 * k, 300) for k in range(5)] + [(1001.5 + 3 * k, 300) for k in range(5)]
    lines = [_HISTORY_HEADER]
    for second in range(1000, 1013):  # a row each second, written ~0.9 s into it
        total = sum(count for at, count in reports if at <= second + 0.9)
        lines.append(_history_row(second, "Aggregated", "5", total, total // 100))
    (tmp_path / "run_stats_history.csv").write_text("\n".join(lines) + "\n")
    per_second = [row["rps"] for row in read_history(tmp_path / "run")]
    assert per_second[4:10] == [300.0, 0.0, 300.0, 300.0, 0.0, 300.0]  # the spikes
    history = read_history(tmp_path / "run", WORKER_REPORT_S)
    assert [row["rps"] for row in history] == [
        0.0, 300.0, 150.0, *[200.0] * 10  # the first rows: since the first one
    ]  # fmt: skip
    assert [row["failures_per_s"] for row in history][3:] == [2.0] * 10
    # Each row's own completions, which the stall check reads: 0 between reports.
    assert [row["completed"] for row in history][4:7] == [300.0, 0.0, 300.0]


def test_read_history_of_a_run_without_history_is_empty(tmp_path):
    from load_tests.locust_run import read_history

    assert read_history(tmp_path / "missing") == []


def _soak(
    seconds: float, interval: float, rss, *, reload_s: float | None = None
) -> tuple[list[float], list[float]]:
    """RSS samples of a soak: ``rss(t)`` every ``interval`` s (t = 0 .. ``seconds``)."""
    times = [round(k * interval, 3) for k in range(int(seconds / interval) + 1)]
    return times, [float(rss(t)) for t in times]


def test_memory_verdict_fails_a_steady_leak_the_quartile_rule_let_pass():
    from load_tests.memory import memory_verdict

    # The reviewer's case: 30 s soak (0.25 s samples), reload at 15 s, server leaking 1.5 MB/s;
    # the old rule saw +57.8 MB against +70.2 MB allowed: "flat".
    times, rss = _soak(30, 0.25, lambda t: 430 + 1.5 * t + (30 if 15 <= t < 27 else 0))
    leak = memory_verdict(times, rss, warmup_s=6.0, run_s=30.0, reload_s=15.0)
    assert not leak.passed
    assert leak.slope_mb_per_min == leak.sustained_mb_per_min == 90.0  # 1.5 MB/s
    assert leak.allowed_mb_per_min == 40.0  # 20 MB floor over half a minute
    assert leak.samples == 36 and leak.reload_step_mb is None  # 6..15 s; no settled segment
    assert "grows 90 MB/min" in leak.reason

    # The 10-minute settings: 0.16 MB/s (576 MB/h) passed the quartile rule; allowed is now
    # 2 MB/min (the 20 MB floor over 10 minutes), the leak is 9.6 MB/min.
    times, rss = _soak(600, 3.0, lambda t: 430 + 0.16 * t)
    slow = memory_verdict(times, rss, warmup_s=60.0, run_s=600.0, reload_s=300.0)
    assert not slow.passed
    assert slow.sustained_mb_per_min == 9.6 and slow.allowed_mb_per_min == 2.0
    assert slow.reload_step_mb == 19.2  # quarters before and after the settling window


def test_memory_verdict_passes_steps_noise_and_the_reload_transient():
    from load_tests.memory import memory_verdict

    noise = np.random.default_rng(0).normal(0, 0.5, 201)

    def healthy(t: float) -> float:
        # An allocator step of +15 MB at 200 s, and the replaced model resident (+30 MB) for
        # the 50 s after the reload at 300 s (as in a 5-minute soak): not growth.
        return 430 + (15 if t >= 200 else 0) + (30 if 300 <= t < 350 else 0) + noise[int(t / 3)]

    times, rss = _soak(600, 3.0, healthy)
    flat = memory_verdict(times, rss, warmup_s=60.0, run_s=600.0, reload_s=300.0)
    assert flat.passed, flat
    assert flat.reason == "flat" and flat.samples == 161  # 60..297 s and 360..600 s
    assert abs(flat.sustained_mb_per_min) < 0.5 and abs(flat.reload_step_mb) < 2
    assert flat.baseline_mb == pytest.approx(430, abs=1) and flat.last_mb == pytest.approx(
        445, abs=1
    )

    # The replaced model never released: +40 MB from the reload on.
    times, rss = _soak(600, 3.0, lambda t: healthy(t) + (40 if t >= 300 else 0))
    kept = memory_verdict(times, rss, warmup_s=60.0, run_s=600.0, reload_s=300.0)
    assert not kept.passed and kept.reload_step_mb == pytest.approx(40, abs=2)
    assert "more after the reload settled" in kept.reason

    # Warm-up climbs are left out; too few samples after it is no verdict: not a pass.
    times, rss = _soak(20, 1.0, lambda t: 100 + 50 * min(t, 4) + (t % 3))
    assert memory_verdict(times, rss, warmup_s=4.0, run_s=20.0).passed
    assert not memory_verdict([0.0, 1.0, 2.0], [-1.0, 10.0, 10.0], warmup_s=0.0, run_s=3).passed


def test_memory_verdict_fails_a_leak_that_starts_late_in_the_run():
    """A leak from 8 minutes on in a 10-minute soak (3 s samples, reload at 300 s): the
    segment after the reload ([360, 600] s) grows in its second half only, which the
    segments' rule lets pass; the final 120 s grow in both halves."""
    from load_tests.memory import memory_verdict

    def late_leak(t: float) -> float:
        # The replaced model resident for 40 s after the reload, then 0.16 MB/s from 480 s.
        return 430 + (30 if 300 <= t < 340 else 0) + 0.16 * max(t - 480, 0)

    times, rss = _soak(600, 3.0, late_leak)
    leak = memory_verdict(times, rss, warmup_s=60.0, run_s=600.0, reload_s=300.0)
    assert not leak.passed
    assert leak.reason == "grows 9.6 MB/min in both halves of the final 120 s (allowed 2.0)"
    assert (leak.final_window_s, leak.final_mb_per_min) == (120.0, 9.6)
    assert leak.sustained_mb_per_min == 9.6 and leak.reload_step_mb == 0.0

    # The same leak from 5 minutes before the end fails through its segment already.
    times, rss = _soak(600, 3.0, lambda t: 430 + 0.16 * max(t - 300, 0))
    early = memory_verdict(times, rss, warmup_s=60.0, run_s=600.0, reload_s=300.0)
    assert early.reason == "grows 9.6 MB/min in both halves of a segment (allowed 2.0)"


def test_the_final_window_passes_a_reload_step_warm_up_growth_and_noise():
    from load_tests.memory import memory_verdict

    noise = np.random.default_rng(1).normal(0, 1.0, 201)  # 1 MB standard deviation

    def stepped(t: float) -> float:
        # +15 MB kept after the reload (under the 20 MB allowed), both models resident for
        # 50 s, and a one-off allocator step of +6 MB at 550 s, inside the final window.
        return (
            430 + (15 if t >= 300 else 0) + (30 if 300 <= t < 350 else 0) + (6 if t >= 550 else 0)
        )

    times, rss = _soak(600, 3.0, stepped)
    step = memory_verdict(times, rss, warmup_s=60.0, run_s=600.0, reload_s=300.0)
    assert step.passed and step.reason == "flat", step
    assert (step.final_window_s, step.final_mb_per_min) == (120.0, 0.0)
    assert step.reload_step_mb == 15.0 and step.sustained_mb_per_min == 0.0

    # Warm-up: +150 MB over the first 60 s (left out), flat after it.
    times, rss = _soak(600, 3.0, lambda t: 280 + 2.5 * min(t, 60))
    warm = memory_verdict(times, rss, warmup_s=60.0, run_s=600.0, reload_s=300.0)
    assert warm.passed and warm.reason == "flat", warm
    assert (warm.final_mb_per_min, warm.sustained_mb_per_min) == (0.0, 0.0)

    # Noise around a flat level, on top of the reload's transient.
    times, rss = _soak(600, 3.0, lambda t: 430 + (30 if 300 <= t < 350 else 0) + noise[int(t / 3)])
    noisy = memory_verdict(times, rss, warmup_s=60.0, run_s=600.0, reload_s=300.0)
    assert noisy.passed and noisy.reason == "flat", noisy
    assert noisy.final_window_s == 120.0 and abs(noisy.final_mb_per_min) < 1.0
    # A short run's final window is 60 s, not 20% of it: +20 MB over the last 20 s of a 100 s
    # run (a transient there) grows in one half of it only.
    times, rss = _soak(100, 0.5, lambda t: 430 + max(t - 80, 0))
    short = memory_verdict(times, rss, warmup_s=10.0, run_s=100.0)
    assert short.passed and short.final_window_s == 60.0, short
    # The same noise over a late leak still fails.
    times, rss = _soak(600, 3.0, lambda t: 430 + noise[int(t / 3)] + 0.16 * max(t - 480, 0))
    assert not memory_verdict(times, rss, warmup_s=60.0, run_s=600.0, reload_s=300.0).passed


def test_a_soak_too_short_to_judge_after_its_reload_says_so(tmp_path):
    """The 60 s after the reload are left out, so a soak under ~2 minutes never judges the
    memory after it: even the replaced model never released (+200 MB) passes. The pass says
    what it did not cover, in the summary too."""
    from dataclasses import asdict

    from load_tests.memory import memory_verdict
    from load_tests.report import write_summary

    times, rss = _soak(30, 0.25, lambda t: 430 + (200 if t >= 15 else 0))
    short = memory_verdict(times, rss, warmup_s=6.0, run_s=30.0, reload_s=15.0)
    assert short.passed and short.reload_step_mb is None
    assert short.reason == (
        "flat before the reload; not judged after it (under 6 samples past the 60 s it "
        "settles: a longer soak judges it)"
    )
    # Long enough: the same step fails.
    times, rss = _soak(150, 1.0, lambda t: 430 + (200 if t >= 60 else 0))
    long = memory_verdict(times, rss, warmup_s=15.0, run_s=150.0, reload_s=60.0)
    assert not long.passed and long.reload_step_mb == 200.0
    row = {"name": "Aggregated", "requests": 1, "failures": 0, "rps": 1.0, "p50_ms": 1.0,
           "p95_ms": 1.0, "p99_ms": 1.0}  # fmt: skip
    result = {
        "stats": [row], "model": "m", "inputs": "x", "checkpoint": "/c", "tier": "embedded",
        "users": 1, "classes": ["GrpcUser"], "seconds": 30.0, "batches": "1", "seed": 1,
        "serve_args": [], "passed": True, "verdict": "no failures",
        "soak": {"reload_at_s": 15.0, "reload": {"ok": True}, "pids": {},
                 "memory": {"server": asdict(short)}},
    }  # fmt: skip
    write_summary(tmp_path, result)
    text = (tmp_path / "summary.md").read_text()
    assert text.count(f"**flat** ({short.reason})") == 1


def test_every_sampled_process_gets_a_memory_verdict():
    """Remote tier: the parameter servers and the embedding worker are sampled too; a worker
    leaking 5 MB/s (+40% in 30 s) used to pass because only the server was judged."""
    from load_tests.memory import memory_verdicts

    samples = [
        {
            "t_s": t,
            "unix": 1000.0 + t,
            "server_rss_mb": 430.0,
            "parameter_server_0_rss_mb": 120.0 + (t % 2),
            "parameter_server_1_rss_mb": 121.0,
            "embedding_worker_0_rss_mb": 380.0 + 5.0 * t,
        }
        for t in np.arange(0, 30.25, 0.25)
    ]
    verdicts = memory_verdicts(samples, warmup_s=6.0, run_s=30.0, reload_s=15.0)
    assert list(verdicts) == [
        "server",
        "parameter_server_0",
        "parameter_server_1",
        "embedding_worker_0",
    ]
    assert [name for name, v in verdicts.items() if not v.passed] == ["embedding_worker_0"]
    assert verdicts["embedding_worker_0"].sustained_mb_per_min == 300.0
    assert verdicts["embedding_worker_0"].process == "embedding_worker_0"


def test_a_user_class_that_sent_nothing_fails_the_run(tmp_path, capsys):
    from load_tests.locust_run import silent_classes, task_exceptions
    from load_tests.run import parse_args

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
    # A class named twice reached locust twice: it is one class, given once.
    repeated = parse_args(["--user-classes", "json,grpc,json,grpc,binary", *common])
    assert repeated.user_classes == "json,grpc,binary"
    (tmp_path / "run_exceptions.csv").write_text(
        "Count,Message,Traceback,Nodes\n3,ValueError('bad batch size'),tb,local\n"
    )
    assert task_exceptions(tmp_path / "run") == ["3 x ValueError('bad batch size')"]
    assert task_exceptions(tmp_path / "absent") == []


# --------------------------------------------------------------------------- locust's numbers
_STATS_HEADER = (
    "Type,Name,Request Count,Failure Count,Median Response Time,Average Response Time,"
    "Min Response Time,Max Response Time,Average Content Size,Requests/s,Failures/s,50%,66%,"
    "75%,80%,90%,95%,98%,99%,99.9%,99.99%,100%"
)


def _locust_run(tmp_path: Path):
    from load_tests.locust_run import LocustRun

    return LocustRun(
        users=4,
        spawn_rate=4,
        seconds=15,
        classes=["KServeJsonUser"],
        host="http://127.0.0.1:1",
        csv_prefix=tmp_path / "locust",
        log_path=tmp_path / "locust.log",
        env={},
    )


def test_a_failed_locust_never_reports_an_earlier_runs_numbers(tmp_path):
    """locust failing (not importable: exit 1) in a reused --out folder used to PASS with the
    earlier run's locust_stats.csv, and die with FileNotFoundError in a fresh one."""
    import time

    from load_tests.locust_run import locust_outcome

    run = _locust_run(tmp_path)
    earlier = ",Aggregated,10503,0,5,6.0,1,90,100,700.2,0.0,5,6,7,8,9,10,12,14,20,30,90"
    (tmp_path / "locust_stats.csv").write_text(f"{_STATS_HEADER}\n{earlier}\n")
    (tmp_path / "locust_final.json").write_text(
        json.dumps({"written_unix": 1.0, "exit_code": 0, "stats": [], "exceptions": []})
    )
    run.clear_outputs()  # what LocustRun.start() does first
    assert not list(tmp_path.glob("locust_*"))
    (tmp_path / "locust.log").write_text("ModuleNotFoundError: No module named 'locust'\n")
    final, problems = locust_outcome(run, 1, started_unix=time.time())
    assert final is None
    assert problems == [
        f"locust exited with code 1 and wrote no final stats (locust_final.json); "
        f"{tmp_path / 'locust.log'}:\nModuleNotFoundError: No module named 'locust'"
    ]
    # A final stats file older than the run is an earlier run's: ignored the same way.
    (tmp_path / "locust_final.json").write_text(
        json.dumps({"written_unix": 1.0, "exit_code": 0, "stats": [], "exceptions": []})
    )
    assert locust_outcome(run, 0, started_unix=time.time())[0] is None


def test_without_locust_nothing_starts(tmp_path, monkeypatch, capsys):
    import importlib.util

    from load_tests import run

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "locust" else real(name, *a)
    )
    assert run.main(["--synthetic", "--out", str(tmp_path / "out")]) == 2
    assert "locust is not importable" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # no synthetic model, no server


def test_final_numbers_come_from_the_stats_locust_writes_when_it_quits(tmp_path):
    """locust rewrites locust_stats.csv once a second and not at shutdown: a server killed
    14.9 s into a 15 s run showed 847 failures in locust's own summary, 0 in the CSV."""
    from load_tests.locust_run import read_stats, task_exceptions

    stale = ",Aggregated,10503,0,5,6.0,1,90,100,700.2,0.0,5,6,7,8,9,10,12,14,20,30,90"
    (tmp_path / "run_stats.csv").write_text(f"{_STATS_HEADER}\n{stale}\n")
    assert read_stats(tmp_path / "run")[0]["failures"] == 0  # no final stats: the CSV
    total = {"type": "", "name": "Aggregated", "requests": 11655, "failures": 847, "rps": 777.0}
    (tmp_path / "run_final.json").write_text(
        json.dumps(
            {
                "written_unix": 2.0,
                "exit_code": 1,
                "stats": [total],
                "exceptions": [{"count": 2, "msg": "KeyError('x')"}],
            }
        )
    )
    assert read_stats(tmp_path / "run") == [total]
    assert task_exceptions(tmp_path / "run") == ["2 x KeyError('x')"]


_FINAL_STATS = """
import os, sys

os.environ["RECSERVE_LT_FINAL_STATS"] = sys.argv[1]
from locust import events
from locust.env import Environment
from load_tests import locustfile as lf

env = Environment(user_classes=[lf.KServeJsonUser], events=events)
runner = env.create_local_runner()
events.init.fire(environment=env, runner=runner, web_ui=None)
for ms in (10, 20, 30, 40, 50):
    env.stats.log_request("POST", "v2-json b1", ms, 100)
env.stats.log_request("POST", "v2-json b8", 200, 100)
env.stats.log_error("POST", "v2-json b8", "HTTP 500: boom")
env.stats.log_request("POST", "v2-json b64", 40, 100)
env.stats.log_request("grpc", "v2-grpc b8", 40, 100)
events.quit.fire(exit_code=1)  # what locust's shutdown fires last, after runner.quit()
"""


def test_the_locustfile_writes_the_final_stats_when_locust_quits(tmp_path):
    from load_tests.locust_run import read_final_stats

    path = tmp_path / "final.json"
    run_python(_FINAL_STATS, str(path))
    final = read_final_stats(path)
    assert final["exit_code"] == 1
    rows = {row["name"]: row for row in final["stats"]}
    # By protocol, then batch size as a number (b64 sorted before b8 as text).
    assert list(rows) == ["v2-grpc b8", "v2-json b1", "v2-json b8", "v2-json b64", "Aggregated"]
    total = rows["Aggregated"]
    assert (total["requests"], total["failures"]) == (8, 1)
    assert (total["p50_ms"], total["p99_ms"], total["max_ms"]) == (40.0, 200.0, 200.0)
    assert rows["v2-json b1"]["p50_ms"] == 30.0 and rows["v2-json b1"]["avg_ms"] == 30.0
    # Rows sent and rows/s of each protocol and batch size; the total sums them.
    sizes = {"v2-grpc b8": 8, "v2-json b1": 1, "v2-json b8": 8, "v2-json b64": 64}
    assert {name: rows[name]["rows"] for name in sizes} == {
        "v2-grpc b8": 8, "v2-json b1": 5, "v2-json b8": 8, "v2-json b64": 64
    }  # fmt: skip
    assert total["rows"] == 85
    for name, size in sizes.items():
        assert rows[name]["rows_per_s"] == round(rows[name]["rps"] * size, 2) > 0
    assert total["rows_per_s"] == round(sum(rows[n]["rps"] * k for n, k in sizes.items()), 2)
    assert final["errors"] == [
        {"name": "v2-json b8", "method": "POST", "error": "HTTP 500: boom", "count": 1}
    ]


def test_the_history_has_trailing_window_percentiles(tmp_path):
    """Without --csv-full-history locust writes percentiles cumulative since the start into
    the history: the latency plot could not show a change over time."""
    from load_tests.locust_run import read_history

    command = _locust_run(tmp_path).command()
    assert "--csv-full-history" in command
    assert command[command.index("--csv") + 1] == str(tmp_path / "locust")
    lines = [
        _HISTORY_HEADER,
        _history_row(1000, "v2-json b1", "3", 100, 0),  # full history: a row per name too
        _history_row(1000, "Aggregated", "4", 300, 0),
        _history_row(1001, "v2-json b1", "30", 200, 0),
        _history_row(1001, "Aggregated", "40", 600, 0),
    ]
    (tmp_path / "h_stats_history.csv").write_text("\n".join(lines) + "\n")
    assert [row["p50_ms"] for row in read_history(tmp_path / "h")] == [4.0, 40.0]


# --------------------------------------------------------------------------- processes
class _NeverReady:
    """A "server" that prints the listening line but never answers: recserve serve stuck."""

    LINE = "HTTP listening on 127.0.0.1:9, gRPC listening on 127.0.0.1:9"

    @classmethod
    def make(cls, tmp_path: Path):
        from load_tests.stack import ServeProcess

        class Stuck(ServeProcess):
            def command(self) -> list[str]:
                script = f"import time; print({cls.LINE!r}, flush=True); time.sleep(60)"
                return [sys.executable, "-c", script]

        return Stuck(tmp_path, tmp_path / "serve.log")


def test_a_server_that_never_becomes_ready_is_stopped(tmp_path):
    server = _NeverReady.make(tmp_path)
    with pytest.raises(RuntimeError) as caught:
        server.start(timeout=1.5)
    assert server.process.poll() is not None  # was left running (PPID 1 after run.py exits)
    log = tmp_path / "serve.log"
    head, _, rest = str(caught.value).partition(" s; ")  # waited what the listening left: ~1 s
    assert re.fullmatch(r"recserve serve at http://127\.0\.0\.1:9 is not ready after [12]", head)
    assert rest == f"{log}:\n{_NeverReady.LINE}"


def test_a_server_that_does_not_start_is_named_with_its_log(tmp_path):
    """run.py prints "the stack did not start: <this>": it quoted the log's tail without
    saying which file it was, and a server that never listened said nothing else at all."""
    from load_tests.stack import ServeProcess

    class Script(ServeProcess):
        script = ""

        def command(self) -> list[str]:
            return [sys.executable, "-c", self.script]

    log = tmp_path / "serve.log"
    crashing = Script(tmp_path, log)
    crashing.script = "import sys; print('error: bad flag', flush=True); sys.exit(2)"
    with pytest.raises(RuntimeError) as caught:
        crashing.start(timeout=30)
    assert str(caught.value) == (
        f"recserve serve exited with 2 before it listened; {log}:\nerror: bad flag"
    )
    silent = Script(tmp_path, log)
    silent.script = "import time; print('loading', flush=True); time.sleep(60)"
    with pytest.raises(RuntimeError) as caught:
        silent.start(timeout=0.5)
    assert silent.process.poll() is not None
    assert str(caught.value) == f"recserve serve did not listen within 0 s; {log}:\nloading"


def test_an_interrupted_start_stops_the_server(tmp_path, monkeypatch):
    server = _NeverReady.make(tmp_path)

    def interrupted(timeout: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(server, "wait_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.start(timeout=30)
    assert server.process.poll() is not None


_SIGTERM = """
import os, signal, subprocess, sys, time
from load_tests.stack import sigterm_exits, stop_process

with sigterm_exits():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(child.pid, flush=True)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    finally:
        stop_process(child)
        print("stopped", child.returncode, flush=True)
"""


def test_sigterm_runs_the_cleanup(tmp_path):
    """run.py had no SIGTERM handler: the server and locust lived on with PPID 1."""
    result = run_python(_SIGTERM, returncode=143)
    pid, stopped = result.stdout.splitlines()
    assert stopped == "stopped -15"
    assert not Path(f"/proc/{pid}").exists()


def test_a_process_of_the_stack_that_died_is_named(tmp_path):
    from load_tests.stack import dead_processes

    log = tmp_path / "serve.log"
    log.write_text("starting\nSegmentation fault\n")
    dead = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    dead.wait(timeout=30)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        found = dead_processes(
            {"recserve serve": (dead, log), "worker": (alive, log), "x": (None, log)}
        )
    finally:
        alive.kill()
        alive.wait(timeout=30)
    assert found == [
        f"recserve serve (pid {dead.pid}) died during the run with exit code 3; {log}:\n"
        "starting\nSegmentation fault"
    ]


# --------------------------------------------------------------------------- arguments
def test_bad_arguments_are_refused_before_anything_starts(tmp_path, capsys):
    from load_tests.run import parse_args

    common = ["--out", str(tmp_path)]
    refused = [
        (["--synthetic", "--rss-interval", "-1"], "--rss-interval must be in (0, 60]"),
        (["--synthetic", "--locust-processes", "0"], "--locust-processes must be in 1..64"),
        (["--synthetic", "--soak", "--seconds", "30"], "--soak runs for --minutes"),
        (["--synthetic", "--minutes", "3"], "--minutes is the length of a --soak"),
        (["--synthetic", "--seed", "-1"], "--seed must be >= 0"),
        (["--checkpoint", str(tmp_path / "nope")], "no such directory"),
    ]
    for bad, message in refused:
        with pytest.raises(SystemExit) as exit_info:
            parse_args([*bad, *common])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, bad
    soak = parse_args(["--synthetic", "--soak", *common])
    assert (soak.minutes, soak.seconds) == (10.0, 10.0)


def test_an_out_that_is_a_file_is_refused_before_anything_starts(tmp_path, capsys):
    """It raised FileExistsError from mkdir, a traceback with exit status 1."""
    from load_tests.run import parse_args

    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--synthetic", "--out", str(tmp_path / "file")])
    assert exit_info.value.code == 2
    assert f"--out {tmp_path / 'file'}: exists and is not a folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "seconds"),
    [
        (["--seconds", "2.5"], 2.0),  # locust's -t 2s: round half to even, as command() does
        (["--seconds", "3.6"], 4.0),
        (["--seconds", "0.4"], 1.0),
        (["--soak", "--minutes", "0.33"], 20.0),
        (["--soak"], 600.0),
    ],
)
def test_the_load_lasts_the_whole_seconds_locust_runs(flags, seconds, tmp_path):
    """locust's -t takes whole seconds: the summary and the soak's timing use what ran."""
    from load_tests.locust_run import LocustRun
    from load_tests.run import load_seconds, parse_args

    ran = load_seconds(parse_args(["--synthetic", "--out", str(tmp_path), *flags]))
    assert ran == seconds
    run = LocustRun(1, 1.0, ran, [], "http://h", tmp_path / "l", tmp_path / "l.log", {})
    assert run.command()[run.command().index("-t") + 1] == f"{seconds:.0f}s"


def test_a_soak_of_a_workers_server_needs_its_watcher(tmp_path, capsys):
    """``recserve serve --workers N`` refuses POST /admin/reload: the soak reloads through
    ``--watch-seconds``, so without it the soak is refused before anything starts."""
    from load_tests.run import parse_args
    from load_tests.stack import watch_seconds_of, workers_of

    common = ["--synthetic", "--soak", "--out", str(tmp_path)]
    for serve_args in ("--workers 2", "--workers=3 --watch-seconds 0"):
        with pytest.raises(SystemExit) as exit_info:
            parse_args([*common, "--serve-args", serve_args])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err
        assert "--watch-seconds" in error and "POST /admin/reload" in error, error
    for serve_args in ("--workers 2 --watch-seconds 1", "--workers 1", "--watch-seconds 2"):
        parse_args([*common, "--serve-args", serve_args])
    parse_args(["--synthetic", "--serve-args", "--workers 2", "--out", str(tmp_path)])  # no soak
    assert workers_of(["--workers=4", "--watch-seconds", "0.5"]) == 4
    assert watch_seconds_of(["--workers=4", "--watch-seconds", "0.5"]) == 0.5
    assert (workers_of([]), watch_seconds_of([])) == (1, 0.0)


def test_each_process_of_a_workers_server_gets_its_own_rss_column():
    """RSS of ``recserve serve --workers N`` was the sum of all its processes in one column;
    now the supervisor and each child are sampled (and judged) on their own."""
    from load_tests.memory import RssSampler, memory_verdicts, rss_bytes
    from load_tests.stack import server_pids

    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         "kids = [subprocess.Popen([sys.executable, '-c', 'import time; b = b\"x\" * %d; "
         "time.sleep(30)' % (n * 64 << 20)]) for n in (1, 2)]\n"
         "time.sleep(30)"],
    )  # fmt: skip
    pids: dict[str, int] = {}
    try:
        pids = server_pids(parent.pid, 2, timeout=20)
        assert list(pids) == ["server", "server.1", "server.2"] and pids["server"] == parent.pid
        assert len(set(pids.values())) == 3
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (
            (rss_bytes(pids["server.1"]) or 0) < 64 << 20
            or (rss_bytes(pids["server.2"]) or 0) < 128 << 20
        ):
            time.sleep(0.1)
        sizes = {name: rss_bytes(pid) / (1 << 20) for name, pid in pids.items()}
        assert sizes["server"] < 60 < sizes["server.1"] < 120 < sizes["server.2"], sizes
        sampler = RssSampler(pids, 0.05)
        sampler.start()
        time.sleep(0.6)
        sampler.stop()
        columns = [key for key in sampler.samples[0] if key.endswith("_rss_mb")]
        assert columns == ["server_rss_mb", "server.1_rss_mb", "server.2_rss_mb"]
        verdicts = memory_verdicts(sampler.samples, warmup_s=0.0, run_s=0.6, reload_s=None)
        assert list(verdicts) == ["server", "server.1", "server.2"]
    finally:  # the children first, by PID: killing the parent alone would orphan them
        for name, pid in pids.items():
            if name != "server":
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait(timeout=10)
    assert server_pids(parent.pid, 1) == {"server": parent.pid}


def test_the_watcher_reload_waits_until_every_process_serves_the_new_version(tmp_path):
    """The soak's reload of a --workers server: publish, then /metrics must read 1 for the
    new version and 0 for the old one (no process still serves it); bounded, with a clear
    failure naming both."""
    import http.server
    import threading

    from load_tests.checkpoint_reload import checkpoint_version, reload_through_watcher
    from load_tests.stack import ServeProcess

    served = tmp_path / "served"
    served.mkdir()
    (served / "manifest.json").write_text(json.dumps({"step": 3, "version": "00000003-aa"}))
    (served / "DONE").write_text("")
    state = {"old": 1, "new": None}

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            version = checkpoint_version(served)
            lines = [f'recserve_model_info{{model="model",version="00000003-aa"}} {state["old"]}']
            if version != "00000003-aa" and state["new"] is not None:
                lines.append(f'recserve_model_info{{model="model",version="{version}"}} 1')
            body = ("# TYPE recserve_model_info gauge\n" + "\n".join(lines) + "\n").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass  # a quiet stand-in: no access log on the test's stderr

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    server = ServeProcess(served, tmp_path / "serve.log")
    server.http = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        # One process serves the new version, the other still the old one: not done.
        state["new"] = 1
        with pytest.raises(RuntimeError) as error:
            reload_through_watcher(server, served, timeout=0.5, poll=0.05)
        assert "did not serve version 00000004-" in str(error.value)
        assert "0 for 00000003-aa" in str(error.value)
        # Both processes moved on: the old version reads 0.
        state["old"] = 0
        previous = checkpoint_version(served)
        result = reload_through_watcher(server, served, timeout=5, poll=0.05)
        assert result["ok"] and result["via"] == "watcher"
        assert result["previous_version"] == previous != result["version"]
        assert result["version"] == checkpoint_version(served) == result["published"]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_checkpoint_that_cannot_be_served_is_exit_status_2(tmp_path, capsys):
    """vocab_from_checkpoint and the soak's copy ran outside the try: a traceback, exit 1."""
    from load_tests.run import main

    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "out").mkdir()
    for earlier in ("summary.md", "summary.json", "locust_stats.csv", "locust_final.json"):
        (tmp_path / "out" / earlier).write_text("an earlier run's PASS\n")
    for extra in ([], ["--soak", "--minutes", "1"]):
        assert main(["--checkpoint", str(empty), "--out", str(tmp_path / "out"), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: the stack did not start:") and "Traceback" not in err
        assert "embedding_manifest.json" in err
        assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_file()) == []


# --------------------------------------------------------------------------- traffic
_ONE_SLOT = {
    "name": "m",
    "inputs": [
        {"name": "item", "datatype": "INT64", "shape": [-1]},
        {"name": "history", "datatype": "INT64", "shape": [-1]},
        {"name": "history.lengths", "datatype": "INT64", "shape": [-1]},
    ],
}


def _pool(kind: str, process: int, environ: dict[str, str]):
    from load_tests import traffic

    generator = traffic.TrafficGenerator(
        traffic.ModelInputs.from_metadata(_ONE_SLOT),
        traffic.TrafficProfile.from_env(environ),
        stream=traffic.stream_key(kind, process, environ),
    )
    return traffic.PayloadPool(generator, kind)


def test_pools_of_each_kind_and_process_send_their_own_traffic():
    """Every pool used seed 0: all classes sent the same batch sizes in lockstep."""
    seeded = {"RECSERVE_LT_SEED": "5"}

    def sizes(pool) -> list[int]:
        return [pool.pick().batch_size for _ in range(40)]

    def first_ids(pool) -> list[int]:
        return pool.by_size[8][0].arrays["item"].tolist()

    json_0, grpc_0 = _pool("json", 0, seeded), _pool("grpc", 0, seeded)
    assert sizes(json_0) != sizes(grpc_0)
    assert sizes(_pool("grpc", 0, seeded)) == sizes(_pool("grpc", 0, seeded))  # reproducible
    assert first_ids(_pool("grpc", 0, seeded)) == first_ids(_pool("grpc", 0, seeded))
    assert first_ids(_pool("grpc", 0, seeded)) != first_ids(_pool("grpc", 1, seeded))
    assert first_ids(_pool("grpc", 0, {})) != first_ids(_pool("grpc", 0, {}))  # no seed: a nonce
    # One popularity ranking for every pool: the same hot IDs, whichever the stream.
    ranking = [
        _pool(kind, 3, seeded).generator._ids["item"][:5].tolist() for kind in ("json", "grpc")
    ]
    assert ranking[0] == ranking[1]


def test_a_pool_holds_thousands_of_rows_per_batch_size():
    """64 payloads per size: ~94 distinct unknown IDs and ~1355 of the 10000 IDs ever sent."""
    from load_tests import traffic

    pool = _pool("grpc", 0, {"RECSERVE_LT_SEED": "1"})
    assert {size: len(payloads) for size, payloads in pool.by_size.items()} == {
        1: 512,
        8: 512,
        64: 128,
    }
    ids = np.concatenate([p.arrays["item"] for payloads in pool.by_size.values() for p in payloads])
    assert len(ids) == 512 + 4096 + 8192
    unknown = ids[ids >= traffic.UNKNOWN_LOW]
    assert len(np.unique(unknown)) > 200
    assert len(np.unique(ids[ids < traffic.UNKNOWN_LOW])) > 2500
    # Payloads are slices of one draw: each one's jagged lengths cover its own IDs.
    for payload in pool.by_size[8][:20]:
        assert payload.arrays["history.lengths"].shape == (8,)
        assert payload.arrays["history.lengths"].sum() == len(payload.arrays["history"])


def test_the_documented_list_length_mean_is_the_real_one():
    from load_tests import traffic

    generator = traffic.TrafficGenerator(traffic.ModelInputs.from_metadata(_ONE_SLOT))
    mean = float(np.arange(len(generator._length_p)) @ generator._length_p)
    assert round(mean, 2) == 2.06
    assert "mean of 2.06" in traffic.__doc__


def test_a_generated_sample_follows_the_configured_traffic_model():
    """Measured on what is sent, not on the sampler's tables: 200k draws of a fixed seed.
    Each share lies within 5 binomial standard deviations of the configured one; the Zipf
    exponent is the slope of log(count) over log(rank) of the 20 hottest IDs."""
    from load_tests import traffic

    def within(measured: float, expected: float, n: int) -> bool:
        return abs(measured - expected) <= 5 * (expected * (1 - expected) / n) ** 0.5

    inputs = traffic.ModelInputs.from_metadata(_ONE_SLOT)
    vocab = {"item": np.arange(5000, 6000, dtype=np.uint64)}
    profile = traffic.TrafficProfile(zipf_exponent=1.3, unknown_share=0.05, seed=11)
    generator = traffic.TrafficGenerator(inputs, profile, vocab, stream=(0, 0))
    n = 200_000
    arrays = generator.arrays(n)
    items = arrays["item"]
    unknown = items >= traffic.UNKNOWN_LOW
    assert within(float(unknown.mean()), 0.05, n)
    rank_of = {int(v): r for r, v in enumerate(generator._ids["item"])}
    counts = np.bincount([rank_of[int(v)] for v in items[~unknown]], minlength=1000)
    harmonic = float(np.sum(1.0 / np.arange(1, 1001) ** 1.3))
    assert within(counts[0] / counts.sum(), 1 / harmonic, int(counts.sum()))
    slope = np.polyfit(np.log(np.arange(1, 21)), np.log(counts[:20]), 1)[0]
    assert abs(slope + 1.3) < 0.03, slope
    lengths = arrays["history.lengths"]
    expected = np.exp(-np.arange(9) / 3.0) / np.exp(-np.arange(9) / 3.0).sum()
    measured = np.bincount(lengths, minlength=9) / n
    assert lengths.max() == 8
    assert all(within(float(m), float(e), n) for m, e in zip(measured, expected)), measured
    history = arrays["history"]
    assert within(float((history >= traffic.UNKNOWN_LOW).mean()), 0.05, len(history))
    pool = traffic.PayloadPool(
        traffic.TrafficGenerator(inputs, traffic.TrafficProfile(seed=11), vocab, stream=(1, 0)),
        "grpc",
        per_size=2,
    )
    sizes = np.asarray([pool.pick().batch_size for _ in range(20_000)])
    for size, share in ((1, 0.6), (8, 0.3), (64, 0.1)):
        assert within(float((sizes == size).mean()), share, 20_000), (size, sizes)


@pytest.mark.parametrize(
    ("text", "mix"),
    [
        ("1:6,8:3,64:1", ((1, 8, 64), (6.0, 3.0, 1.0))),
        ("64", ((64,), (1.0,))),
        (" 1 , 2:0.5", ((1, 2), (1.0, 0.5))),
    ],
)
def test_a_batch_mix_is_read_as_sizes_and_weights(text, mix):
    from load_tests import traffic

    assert traffic.parse_batch_mix(text) == mix


@pytest.mark.parametrize("text", ["0:1", "8:1,0", "-1", "8:0", "1:6,8:-1", "", "a:1"])
def test_a_batch_mix_without_positive_sizes_and_weights_is_refused(text):
    from load_tests import traffic

    with pytest.raises(ValueError):
        traffic.parse_batch_mix(text)


def test_the_profile_reads_every_load_test_variable():
    from load_tests import traffic

    environ = {
        "RECSERVE_LT_BATCHES": "4:1,16:3",
        "RECSERVE_LT_ZIPF": "1.5",
        "RECSERVE_LT_UNKNOWN": "0.25",
        "RECSERVE_LT_SEED": "9",
    }
    profile = traffic.TrafficProfile.from_env(environ)
    assert (profile.batch_sizes, profile.batch_weights) == ((4, 16), (1.0, 3.0))
    assert (profile.zipf_exponent, profile.unknown_share, profile.seed) == (1.5, 0.25, 9)
    assert traffic.TrafficProfile.from_env({}) == traffic.TrafficProfile()


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("RECSERVE_LT_ZIPF", "fast", "RECSERVE_LT_ZIPF='fast': expected a number >= 0"),
        ("RECSERVE_LT_ZIPF", "nan", "RECSERVE_LT_ZIPF='nan': expected a number >= 0"),
        ("RECSERVE_LT_UNKNOWN", "1", "RECSERVE_LT_UNKNOWN='1': expected a number in [0, 1)"),
        ("RECSERVE_LT_UNKNOWN", "2%", "RECSERVE_LT_UNKNOWN='2%': expected a number in [0, 1)"),
        ("RECSERVE_LT_SEED", "1.5", "RECSERVE_LT_SEED='1.5': expected an integer >= 0"),
        ("RECSERVE_LT_SEED", "-3", "RECSERVE_LT_SEED='-3': expected an integer >= 0"),
        (
            "RECSERVE_LT_BATCHES",
            "8:x",
            "RECSERVE_LT_BATCHES='8:x': could not convert string to float: 'x'",
        ),
        (
            "RECSERVE_LT_BATCHES",
            "0",
            "RECSERVE_LT_BATCHES='0': bad batch mix '0': use SIZE[:WEIGHT],...",
        ),
    ],
)
def test_a_bad_load_test_variable_is_named_with_its_value(name, value, message):
    """A bare float()/int() said only "could not convert string to float: 'fast'"."""
    from load_tests import traffic

    with pytest.raises(ValueError) as error:
        traffic.TrafficProfile.from_env({name: value})
    assert str(error.value) == message
    # Empty is unset, as for RECSERVE_LT_SEED before.
    assert traffic.TrafficProfile.from_env({name: " "}) == traffic.TrafficProfile()


_BAD_LOCUSTFILE_VARIABLES = """
import os, sys
import locust  # monkey-patches the standard library first, as locust itself does

for name, value in (("RECSERVE_LT_WAIT", "0.1s"), ("RECSERVE_LT_WAIT", "-1"),
                    ("RECSERVE_LT_POOL", "1e3"), ("RECSERVE_LT_WAIT", "0.25")):
    os.environ[name] = value
    sys.modules.pop("load_tests.locustfile", None)
    try:
        from load_tests import locustfile
        print("imported", locustfile.WAIT, locustfile.POOL_PER_SIZE)
    except ValueError as error:
        print(error)
    del os.environ[name]
"""


def test_the_locustfile_names_a_bad_wait_or_pool_variable():
    result = run_python(_BAD_LOCUSTFILE_VARIABLES)
    assert result.stdout.splitlines() == [
        "RECSERVE_LT_WAIT='0.1s': expected seconds >= 0",
        "RECSERVE_LT_WAIT='-1': expected seconds >= 0",
        "RECSERVE_LT_POOL='1e3': expected an integer >= 0",
        "imported 0.25 None",
    ]


def test_zipf_ranks_have_probability_one_over_rank_to_the_exponent():
    from load_tests import traffic

    np.testing.assert_allclose(traffic._Zipf(3, 1.0).cdf, [6 / 11, 9 / 11, 1.0], rtol=1e-12)
    np.testing.assert_allclose(traffic._Zipf(2, 2.0).cdf, [0.8, 1.0], rtol=1e-12)


def test_a_draw_above_the_rounded_cdf_is_the_last_rank():
    """cumsum of 12 weights ends at 1 - 2**-52: a uniform draw above it is still rank 11."""
    from load_tests import traffic

    zipf = traffic._Zipf(12, 1.1)
    assert zipf.cdf[-1] < np.nextafter(1.0, 0.0)

    class Top:
        def random(self, count):
            return np.full(count, np.nextafter(1.0, 0.0))

    assert zipf.sample(Top(), 3).tolist() == [11, 11, 11]


def test_unknown_ids_lie_in_their_documented_range():
    from load_tests import traffic

    generator = traffic.TrafficGenerator(
        traffic.ModelInputs.from_metadata(_ONE_SLOT),
        traffic.TrafficProfile(unknown_share=1.0, default_vocab=100, seed=3),
    )
    ids = generator.arrays(4096)["item"]
    assert ids.dtype == np.int64
    assert ids.min() >= traffic.UNKNOWN_LOW and ids.max() < 2 * traffic.UNKNOWN_LOW
    assert ids.max() >= traffic.UNKNOWN_LOW + (traffic.UNKNOWN_LOW >> 1)  # spread, not stuck low
    known = traffic.TrafficGenerator(
        traffic.ModelInputs.from_metadata(_ONE_SLOT),
        traffic.TrafficProfile(unknown_share=0.0, default_vocab=100, seed=3),
    ).arrays(4096)["item"]
    assert known.min() >= 0 and known.max() < 100


# --------------------------------------------------------------------------- friendly rows
def test_the_adult_preprocessor_gets_raw_rows(tmp_path, capsys):
    """Against `--preprocessor examples.adult_income.preprocess:instances_to_batch` the
    friendly user failed 100%: it sent slot IDs ("row 0 has no column 'age'")."""
    from examples.adult_income.preprocess import instances_to_batch
    from load_tests import traffic
    from load_tests.run import ADULT_PREPROCESSOR, ADULT_ROWS, parse_args

    common = ["--synthetic", "--out", str(tmp_path)]
    adult = parse_args([*common, "--serve-args", f"--preprocessor {ADULT_PREPROCESSOR}"])
    assert adult.friendly_rows == ADULT_ROWS
    with pytest.raises(SystemExit):
        parse_args([*common, "--serve-args=--preprocessor=my.module:rows"])
    assert "pass --friendly-rows FILE" in capsys.readouterr().err
    assert (
        parse_args(
            [
                *common,
                "--serve-args",
                "--preprocessor my.module:rows",
                "--user-classes",
                "json,grpc",
            ]
        ).friendly_rows
        is None
    )

    rows = traffic.load_rows(ADULT_ROWS, limit=300)
    assert len(rows) == 300 and rows[0]["age"] == "25" and rows[0]["workclass"] == "Private"
    generator = traffic.TrafficGenerator(
        traffic.ModelInputs.from_metadata(_ONE_SLOT),
        traffic.TrafficProfile(batch_sizes=(8,), batch_weights=(1.0,)),
    )
    pool = traffic.PayloadPool(generator, "friendly", per_size=4, rows=rows)
    instances = json.loads(pool.pick().body)["instances"]
    assert len(instances) == 8 and set(instances[0]) == set(rows[0])
    assert instances_to_batch(instances).batch_size == 8
    (tmp_path / "rows.jsonl").write_text('{"age": 39, "x": "a"}\n\n{"age": 50, "x": "b"}\n')
    assert traffic.load_rows(tmp_path / "rows.jsonl") == [
        {"age": 39, "x": "a"},
        {"age": 50, "x": "b"},
    ]


_EMPTY_204 = """
from gevent import monkey

monkey.patch_all()
import http.server, threading
from locust.contrib.fasthttp import FastHttpSession
from locust.env import Environment
from load_tests.locustfile import _check


class NoContent(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass  # no access log: stdout must hold only the failures printed below


server = http.server.HTTPServer(("127.0.0.1", 0), NoContent)
threading.Thread(target=server.serve_forever, daemon=True).start()
env = Environment()
failures = []
env.events.request.add_listener(lambda exception=None, **_: failures.append(str(exception)))
session = FastHttpSession(
    base_url=f"http://127.0.0.1:{server.server_port}", request_event=env.events.request, user=None
)
with session.post("/v2/models/m/infer", data=b"{}", catch_response=True) as response:
    _check(response, "v2-json")
print(failures)
server.shutdown()
"""


def test_a_non_200_answer_without_a_body_counts_as_a_failure():
    """A 204 (a proxy's, say) has no body and no locust error: it must count as a failed
    request naming its status, not raise AttributeError in the user."""
    result = run_python(_EMPTY_204)
    assert result.stdout.strip() == "['v2-json: HTTP 204: empty body']"


_WRONG_ANSWERS = """
from gevent import monkey

monkey.patch_all()
import http.server, json, struct, threading
from locust.contrib.fasthttp import FastHttpSession
from locust.env import Environment
from load_tests import locustfile as lf


def v2(rows, data=None, unknown=1):
    data = [0.5] * rows if data is None else data
    parameters = {} if unknown is None else {"fallback_ids": 0, "unknown_ids": unknown}
    return json.dumps({"model_name": "m", "model_version": "1", "parameters": parameters,
        "outputs": [{"name": "prediction", "datatype": "FP32", "shape": [rows, 1],
                     "data": data}]}).encode()


def binary(rows, cut=0):
    head = json.dumps({"model_name": "m", "parameters": {"unknown_ids": 0}, "outputs": [
        {"name": "prediction", "datatype": "FP32", "shape": [rows, 1],
         "parameters": {"binary_data_size": 4 * rows}}]}).encode()
    return head + struct.pack(f"<{rows}f", *[0.25] * rows)[: 4 * rows - cut], len(head)


ANSWERS = {  # path -> (body, Inference-Header-Content-Length or None)
    "/v2/ok": (v2(2), None),
    "/v2/short": (v2(1), None),
    "/v2/nan": (v2(2, [0.5, None]), None),  # how orjson (the server's) writes a NaN
    "/v2/empty": (b"", None),
    "/v2/no-outputs": (b'{"model_name": "m", "outputs": []}', None),
    "/v2/all-unknown": (v2(2, unknown=5), None),  # 5 IDs sent (below), all unknown
    "/v2/no-unknown-ids": (v2(2, unknown=None), None),
    "/v2/too-many-unknown": (v2(2, unknown=6), None),
    "/v2/negative-unknown": (v2(2, unknown=-1), None),
    "/v2/text-unknown": (v2(2, unknown="3"), None),
    "/bin/ok": binary(2),
    "/bin/cut": binary(2, cut=3),
    "/v1/ok": (b'{"predictions": [[0.5], [0.5]], "unknown_ids": 0}', None),
    "/v1/none": (b'{"predictions": []}', None),
    "/v1/no-unknown-ids": (b'{"predictions": [[0.5], [0.5]], "fallback_ids": 0}', None),
    "/ts/ok": (v2(2, unknown=None), None),  # TorchServe promises no unknown_ids
    "/ts/too-many-unknown": (v2(2, unknown=6), None),  # but one it sends is checked
}


class Canned(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body, header_length = ANSWERS.get(self.path) or ANSWERS[CURRENT[0]]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        if header_length is not None:
            self.send_header("Inference-Header-Content-Length", str(header_length))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


CURRENT = ["/v2/short"]  # what any other path gets
server = http.server.HTTPServer(("127.0.0.1", 0), Canned)
threading.Thread(target=server.serve_forever, daemon=True).start()
env = Environment()
seen = []
env.events.request.add_listener(
    lambda name, exception=None, **_: seen.append([name, exception and str(exception)])
)
session = FastHttpSession(
    base_url=f"http://127.0.0.1:{server.server_port}", request_event=env.events.request, user=None
)
users = {"/v2": lf.KServeJsonUser, "/bin": lf.KServeBinaryUser, "/v1": lf.FriendlyJsonUser,
         "/ts": lf.TorchServeJsonUser}
for path in ANSWERS:
    user = users["/" + path.split("/")[1]]
    with session.post(path, data=b"{}", name=path, catch_response=True) as response:
        lf._check(response, user.label, 2, lambda r: user.answer(user, r), ids_sent=5,
                  unknown_ids_promised=user.promises_unknown_ids)

# The gRPC user: its client decodes the answer, the user checks the rows.
import numpy as np
from types import SimpleNamespace
from load_tests import traffic

grpc_user = lf.GrpcUser(env)
payload = traffic.Payload(3, b"", arrays={"x": np.zeros(3, np.int64)}, ids=3)
grpc_user.pool = SimpleNamespace(pick=lambda: payload)
for rows, parameters in (([[0.5]] * 3, {"unknown_ids": 3}), ([[0.5]] * 3, {}),
                         ([[0.5]] * 3, {"unknown_ids": 4}), ([[0.5], [0.5]], {})):
    answer = SimpleNamespace(predictions=np.asarray(rows, np.float32), parameters=parameters)
    grpc_user.client = SimpleNamespace(infer=lambda arrays, answer=answer: answer)
    grpc_user.infer()

# A whole task of an HTTP user, with RECSERVE_LT_CHECK_ANSWERS on, then off (peers.py's
# no-work ceiling): a short answer to a 2-row request.
lf.KServeJsonUser.host = f"http://127.0.0.1:{server.server_port}"
http_user = lf.KServeJsonUser(env)
http_user.pool = SimpleNamespace(pick=lambda: traffic.Payload(2, b"{}"))
for check in (True, False):
    lf.CHECK_ANSWERS = check
    http_user.infer()
    grpc_user.infer()
print(json.dumps(seen))
server.shutdown()
"""


def test_a_200_with_a_wrong_or_empty_answer_counts_as_a_failure():
    """The users counted every 200 as a success: an empty body, a missing row or a NaN passed
    as a fast request. Each answer is now decoded (JSON, binary outputs by the response's
    Inference-Header-Content-Length, the friendly route's predictions; gRPC's by the client)
    and must hold one finite prediction per row sent, and, where the protocol promises it
    (recserve's v2 and friendly answers, not TorchServe's), an integer ``unknown_ids`` within
    [0, the IDs sent]: a server that stopped counting unknown IDs passed unseen."""
    seen = last_json_line(run_python(_WRONG_ANSWERS))
    short_grpc = "wrong answer: 2 prediction rows (shape [2, 1]) for a request of 3 rows"
    wrong = "v2-json: HTTP 200 with a wrong answer: "
    assert seen[-8:] == [
        ["v2-grpc b3", None],
        ["v2-grpc b3", "wrong answer: the answer has no unknown_ids"],
        ["v2-grpc b3", "wrong answer: unknown_ids 4 is outside [0, 3] (the IDs sent)"],
        ["v2-grpc b3", short_grpc],
        ["v2-json b2", "v2-json: HTTP 200 with a wrong answer: 1 prediction rows (shape "
                       "[1, 1]) for a request of 2 rows"],
        ["v2-grpc b3", short_grpc],
        ["v2-json b2", None],  # RECSERVE_LT_CHECK_ANSWERS=0: the status alone
        ["v2-grpc b3", None],
    ]  # fmt: skip
    assert dict(seen[:-8]) == {
        "/v2/ok": None,
        "/v2/short": "v2-json: HTTP 200 with a wrong answer: 1 prediction rows (shape [1, 1]) "
        "for a request of 2 rows",
        "/v2/nan": "v2-json: HTTP 200 with a wrong answer: 1 of 2 predictions are not finite",
        "/v2/empty": "v2-json: HTTP 200 with a wrong answer: the server's answer is not valid "
        "JSON: Input is a zero-length, empty document: line 1 column 1 (char 0)",
        "/v2/no-outputs": "v2-json: HTTP 200 with a wrong answer: the server answered without "
        "outputs",
        "/v2/all-unknown": None,
        "/v2/no-unknown-ids": wrong + "the answer has no unknown_ids",
        "/v2/too-many-unknown": wrong + "unknown_ids 6 is outside [0, 5] (the IDs sent)",
        "/v2/negative-unknown": wrong + "unknown_ids -1 is outside [0, 5] (the IDs sent)",
        "/v2/text-unknown": wrong + "unknown_ids '3' is not an integer",
        "/bin/ok": None,
        "/bin/cut": "v2-binary: HTTP 200 with a wrong answer: output 'prediction': 5 bytes do "
        "not hold a FP32 tensor of shape [2, 1]",
        "/v1/ok": None,
        "/v1/none": "v1-predict: HTTP 200 with a wrong answer: 0 prediction rows (shape [0, 1]) "
        "for a request of 2 rows",
        "/v1/no-unknown-ids": "v1-predict: HTTP 200 with a wrong answer: the answer has no "
        "unknown_ids",
        "/ts/ok": None,
        "/ts/too-many-unknown": "torchserve-json: HTTP 200 with a wrong answer: unknown_ids 6 "
        "is outside [0, 5] (the IDs sent)",
    }


def test_unknown_ids_must_be_a_count_of_the_ids_sent():
    """An answer's unknown_ids: an integer within [0, IDs sent]; absent, a problem only where
    the protocol promises it; with raw rows (the IDs are the preprocessor's) the lower bound
    alone. Each payload knows its ID occurrences: every ID slot's, jagged ones' lists too."""
    from load_tests import traffic

    check = traffic.unknown_ids_problem
    assert check({"unknown_ids": 0}, 5, True) is None
    assert check({"unknown_ids": 5}, 5, True) is None
    assert check({"unknown_ids": 6}, 5, True) == "unknown_ids 6 is outside [0, 5] (the IDs sent)"
    assert check({"unknown_ids": -1}, None, True) == (
        "unknown_ids -1 is outside [0, ?] (the IDs sent)"
    )
    assert check({"unknown_ids": 10**6}, None, True) is None  # raw rows: no upper bound known
    assert check({"unknown_ids": True}, 5, True) == "unknown_ids True is not an integer"
    assert check({"unknown_ids": 1.0}, 5, False) == "unknown_ids 1.0 is not an integer"
    assert check({}, 5, True) == "the answer has no unknown_ids"
    assert check({"fallback_ids": 0}, 5, False) is None
    inputs = traffic.ModelInputs.from_metadata({"inputs": [
        {"name": "user", "datatype": "INT64", "shape": [-1]},
        {"name": "history", "datatype": "UINT64", "shape": [-1]},
        {"name": "history.lengths", "datatype": "INT64", "shape": [-1]},
        {"name": "dense", "datatype": "FP32", "shape": [-1, 3]},
    ]})  # fmt: skip
    profile = traffic.TrafficProfile(batch_sizes=(8,), batch_weights=(1.0,), seed=4)
    generator = traffic.TrafficGenerator(inputs, profile)
    for kind in traffic.PAYLOAD_KINDS:
        for payload in traffic.PayloadPool(generator, kind, per_size=3).by_size[8]:
            if kind == "friendly":
                rows = json.loads(payload.body)["instances"]
                sent = sum(1 + len(row["history"]) for row in rows)
            elif kind == "json":
                tensors = {t["name"]: t["shape"][0] for t in json.loads(payload.body)["inputs"]}
                sent = tensors["user"] + tensors["history"]
            elif kind == "binary":
                head = json.loads(payload.body[: payload.header_length])["inputs"]
                sizes = {t["name"]: t["parameters"]["binary_data_size"] // 8 for t in head}
                sent = sizes["user"] + sizes["history"]
            else:
                assert payload.arrays is not None
                sent = len(payload.arrays["user"]) + len(payload.arrays["history"])
            assert payload.ids == sent > 8, kind
    rows_pool = traffic.PayloadPool(generator, "friendly", per_size=2, rows=[{"age": "39"}])
    assert {p.ids for p in rows_pool.by_size[8]} == {None}


def test_non_finite_or_missing_predictions_are_a_wrong_answer():
    """What every user checks, the gRPC one too (its answers are decoded by the client)."""

    def result(*values: float) -> np.ndarray:
        return np.asarray(values, dtype=np.float32).reshape(-1, 1)

    from load_tests import traffic

    assert traffic.answer_problem(result(0.1, 0.9), 2) is None
    assert traffic.answer_problem(result(0.1), 2) == (
        "1 prediction rows (shape [1, 1]) for a request of 2 rows"
    )
    assert traffic.answer_problem(result(0.1, float("nan"), float("inf")), 3) == (
        "2 of 3 predictions are not finite"
    )
    assert traffic.answer_problem(result(), 1) == (
        "0 prediction rows (shape [0, 1]) for a request of 1 rows"
    )


_NO_HOST = """
from load_tests import locustfile as lf

try:
    lf.model_inputs(None)
except RuntimeError as error:
    print(error)
"""


def test_a_user_without_a_host_or_metadata_variables_is_told_what_to_set():
    """A GrpcUser run by hand without --host (locust's User needs none) used to fail with an
    AttributeError on None when it read the model's inputs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECSERVE_LT_METADATA")}
    result = run_python(_NO_HOST, env=env)
    assert "--host, RECSERVE_LT_METADATA_URL or RECSERVE_LT_METADATA_FILE" in result.stdout


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (
            "http://ann:s3cret@127.0.0.1:8000",
            "--host: server URL 'http://ann:***@127.0.0.1:8000' has credentials "
            "(user:password@): the load tests' HTTP users would send them as Basic auth, and "
            "the server takes no credentials in the URL; remove them (the load tests have no "
            "client-certificate option)",
        ),
        (
            "http://127.0.0.1:99999",
            "--host: server URL 'http://127.0.0.1:99999' has an invalid port",
        ),
        (
            "ftp://127.0.0.1:8000",
            "--host: server URL 'ftp://127.0.0.1:8000': scheme must be http, https, grpc or "
            "grpcs, got 'ftp'",
        ),
        (
            "grpc://127.0.0.1:8001",
            "--host 'grpc://127.0.0.1:8001': the server's HTTP URL is needed (http:// or "
            "https://); GrpcUser's gRPC address goes in RECSERVE_LT_GRPC=HOST:PORT",
        ),
        (
            "127.0.0.1:8000",
            "--host 'http://127.0.0.1:8000': write the scheme out: http://127.0.0.1:8000",
        ),
    ],
)
def test_a_load_tests_target_url_is_checked_as_the_client_checks_it(url, message, tmp_path):
    """locust's --host went to locust unchecked: credentials (which locust sends as Basic
    auth, and recserve ignores), a bad port or scheme failed request after request. run.py's
    LocustRun refuses it before locust starts."""
    from load_tests.locust_run import LocustRun, checked_host

    with pytest.raises(ValueError) as refused:
        checked_host(url)
    assert str(refused.value) == message
    with pytest.raises(ValueError) as refused:
        LocustRun(1, 1.0, 1.0, ["KServeJsonUser"], url, tmp_path / "l", tmp_path / "log", {})
    assert str(refused.value) == message
    assert checked_host("https://127.0.0.1:8443/prefix/") == "https://127.0.0.1:8443/prefix/"


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            "ann:s3cret@127.0.0.1:8001",
            "RECSERVE_LT_GRPC: server URL 'grpc://ann:***@127.0.0.1:8001' has credentials "
            "(user:password@): the gRPC users would not send them, and the server takes no "
            "credentials in the URL; remove them (the load tests have no client-certificate "
            "option)",
        ),
        ("127.0.0.1", "RECSERVE_LT_GRPC: gRPC server URL 'grpc://127.0.0.1' needs a port"),
        (
            "127.0.0.1:99999",
            "RECSERVE_LT_GRPC: server URL 'grpc://127.0.0.1:99999' has an invalid port",
        ),
        (
            "127.0.0.1:8001/v2",
            "RECSERVE_LT_GRPC: gRPC server URL 'grpc://127.0.0.1:8001/v2' cannot have a path",
        ),
        (
            "grpcs://ann:pw@127.0.0.1:8001",
            "RECSERVE_LT_GRPC 'grpcs://ann:***@127.0.0.1:8001': give HOST:PORT without a "
            "scheme (the gRPC users connect to grpc://HOST:PORT; they have no TLS option)",
        ),
    ],
)
def test_the_load_tests_grpc_target_is_checked_as_the_client_checks_it(target, message):
    """RECSERVE_LT_GRPC went to every GrpcUser unchecked: each failed at its start."""
    from load_tests.locust_run import checked_grpc_target

    with pytest.raises(ValueError) as refused:
        checked_grpc_target(target)
    assert str(refused.value) == message
    assert checked_grpc_target(" 127.0.0.1:8001 ") == "127.0.0.1:8001"


_BAD_HOST = """
import os, sys
from locust import events
from locust.env import Environment
from load_tests import locustfile as lf

env = Environment(user_classes=[lf.KServeJsonUser], events=events, host=sys.argv[1])
events.init.fire(environment=env, runner=env.create_local_runner(), web_ui=None)
print("started")
"""


def test_the_locustfile_refuses_a_bad_host_or_metadata_url_before_any_user_starts():
    """Run by hand (locust -f load_tests/locustfile.py --host ...), not through run.py."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECSERVE_LT_")}
    result = run_python(_BAD_HOST, "http://127.0.0.1:0x50", env=env, returncode=1)
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --host: server URL 'http://127.0.0.1:0x50' has an invalid port"
    )
    assert "started" not in result.stdout
    env["RECSERVE_LT_METADATA_URL"] = "http://ann:pw@127.0.0.1:8000"
    result = run_python(_BAD_HOST, "http://127.0.0.1:8000", env=env, returncode=1)
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: RECSERVE_LT_METADATA_URL: server URL 'http://ann:***@127.0.0.1:8000' has "
            "credentials (user:password@)"
        )
    )
    del env["RECSERVE_LT_METADATA_URL"]
    env["RECSERVE_LT_GRPC"] = "127.0.0.1"
    result = run_python(_BAD_HOST, "http://127.0.0.1:8000", env=env, returncode=1)
    assert result.stderr.strip().splitlines()[-1] == (
        "error: RECSERVE_LT_GRPC: gRPC server URL 'grpc://127.0.0.1' needs a port"
    )
    assert "started" not in result.stdout


_GRPC_TARGETS = """
import os
from types import SimpleNamespace
from locust.env import Environment
from load_tests import locustfile as lf

lf.payload_pool = lambda *args: SimpleNamespace()
for value in (" 127.0.0.1:8001 ", " "):
    os.environ["RECSERVE_LT_GRPC"] = value
    lf.check_urls(None)  # the start-up check passes both: stripped, then blank is unset
    user = lf.GrpcUser(Environment())
    try:
        user.on_start()
    except Exception as error:
        print(f"{type(error).__name__}: {error}")
    else:
        print(user.client.url)
        user.on_stop()
"""


def test_a_grpc_user_reads_its_target_as_the_start_up_check_does():
    """The start-up check stripped RECSERVE_LT_GRPC, the users did not: a space around
    HOST:PORT passed the check, then every GrpcUser connected to "grpc:// HOST:PORT"; a
    blank variable, unset to the check, made each user fail on an empty address."""
    result = run_python(_GRPC_TARGETS)
    assert result.stdout.splitlines() == [
        "grpc://127.0.0.1:8001",
        "RuntimeError: GrpcUser needs RECSERVE_LT_GRPC=HOST:PORT",
    ]


def test_the_watcher_reload_waits_for_two_of_its_looks():
    """A --watch-seconds of 300 could never reload within a fixed 120 s."""
    from load_tests.checkpoint_reload import watcher_reload_timeout

    assert watcher_reload_timeout(["--workers", "2", "--watch-seconds", "300"]) == 720.0
    assert watcher_reload_timeout(["--watch-seconds", "1"]) == 122.0


def test_read_history_gives_a_repeated_timestamp_no_rate(tmp_path):
    """Two history rows in the same second have no interval between them: their rates are 0,
    never a division by zero."""
    from load_tests.locust_run import read_history

    lines = [
        _HISTORY_HEADER,
        _history_row(1000, "Aggregated", "4", 100, 0),
        _history_row(1000, "Aggregated", "4", 150, 1),
        _history_row(1002, "Aggregated", "4", 350, 3),
    ]
    (tmp_path / "run_stats_history.csv").write_text("\n".join(lines) + "\n")
    history = read_history(tmp_path / "run")
    assert [row["rps"] for row in history] == [0.0, 0.0, 100.0]
    assert [row["failures_per_s"] for row in history] == [0.0, 0.0, 1.0]


def test_read_stats_from_the_csv_takes_each_percentile_from_its_own_column(tmp_path):
    from load_tests.locust_run import read_stats

    # 50% 5, 66% 6, 75% 7, 80% 8, 90% 9, 95% 10, 98% 12, 99% 14
    row = "POST,v2-json b1,10503,3,5,6.04,1,90,100,700.26,0.0,5,6,7,8,9,10,12,14,20,30,90"
    (tmp_path / "run_stats.csv").write_text(f"{_STATS_HEADER}\n{row}\n")
    assert read_stats(tmp_path / "run") == [
        {
            "type": "POST",
            "name": "v2-json b1",
            "requests": 10503,
            "failures": 3,
            "rps": 700.26,
            "p50_ms": 5.0,
            "p95_ms": 10.0,
            "p99_ms": 14.0,
            "avg_ms": 6.04,
            "max_ms": 90.0,
            "rows": 10503,
            "rows_per_s": 700.26,
        }
    ]


def test_final_stats_written_before_the_run_started_are_an_earlier_runs(tmp_path):
    from load_tests.locust_run import locust_outcome

    run = _locust_run(tmp_path)
    (tmp_path / "locust.log").write_text("")
    started = 1_700_000_000.0
    for written, mine in ((started - 1.0, False), (started, True), (started + 5.0, True)):
        document = {"written_unix": written, "exit_code": 0, "stats": [], "exceptions": []}
        (tmp_path / "locust_final.json").write_text(json.dumps(document))
        final, problems = locust_outcome(run, 0, started_unix=started)
        assert (final == document, problems == []) == (mine, mine), written


def test_rows_come_from_the_batch_size_each_request_name_carries():
    from load_tests.locust_run import add_rows, batch_size_of

    assert [batch_size_of(n) for n in ("v2-json b64", "torchserve-binary b1", "v2-grpc b8")] == [
        64, 1, 8
    ]  # fmt: skip
    assert [batch_size_of(n) for n in ("Aggregated", "v2-json bx", " b8", "v2-json")] == [None] * 4
    # A name without a batch size (not the locustfile's): its rows are unknown, and the total's.
    rows = add_rows([{"name": "custom", "requests": 3, "rps": 1.0},
                     {"name": "v2-json b8", "requests": 2, "rps": 1.0},
                     {"name": "Aggregated", "requests": 5, "rps": 2.0}])  # fmt: skip
    assert [(r["rows"], r["rows_per_s"]) for r in rows] == [(None, None), (16, 8.0), (None, None)]


def test_the_summary_lists_every_row_in_csv_and_markdown(tmp_path):
    """Each protocol and batch size has its own row, with its rows/s (the all row mixes them,
    and had no rows/s): the same rows in summary.csv, summary.md and summary.json."""
    from load_tests.locust_run import add_rows
    from load_tests.report import write_summary

    rows = add_rows([
        {"name": "v2-grpc b8", "requests": 100, "failures": 0, "rps": 5.0, "p50_ms": 2.0,
         "p95_ms": 4.0, "p99_ms": 6.0, "avg_ms": 2.5},
        {"name": "v2-json b1", "requests": 900, "failures": 2, "rps": 45.04, "p50_ms": 3.0,
         "p95_ms": 7.5, "p99_ms": 12.0, "avg_ms": 4.0},
        {"name": "v2-json b64", "requests": 10, "failures": 0, "rps": 0.5, "p50_ms": None,
         "p95_ms": None, "p99_ms": None, "avg_ms": 0.0},
        {"name": "Aggregated", "requests": 1010, "failures": 2, "rps": 50.55, "p50_ms": 3.0,
         "p95_ms": 7.5, "p99_ms": 12.0, "avg_ms": 4.0},
    ])  # fmt: skip
    result = {
        "stats": rows, "model": "adult", "inputs": "json", "checkpoint": "/c", "tier": "local",
        "users": 4, "classes": ["KServeJsonUser"], "seconds": 20.0, "batches": "1", "seed": 7,
        "serve_args": [], "passed": False, "verdict": "2 failures",
        "latency_resolution": "2 significant digits",
    }  # fmt: skip
    write_summary(tmp_path, result)
    assert (tmp_path / "summary.csv").read_text().splitlines() == [
        "name,requests,failures,rps,rows,rows_per_s,p50_ms,p95_ms,p99_ms",
        "v2-grpc b8,100,0,5.0,800,40.0,2.0,4.0,6.0",
        "v2-json b1,900,2,45.04,900,45.04,3.0,7.5,12.0",
        "v2-json b64,10,0,0.5,640,32.0,,,",
        "Aggregated,1010,2,50.55,2340,117.04,3.0,7.5,12.0",  # 40 + 45.04 + 32 rows/s
    ]
    markdown = (tmp_path / "summary.md").read_text().splitlines()
    assert "- verdict: **FAIL** (2 failures)" in markdown
    assert (
        "- req/s: requests over the time from the start of the load to its last request; "
        "percentiles from locust's histogram of the response times, kept to 2 significant digits"
    ) in markdown
    assert (
        "- each request row is one protocol (route) and batch size (`v2-json b8`: KServe v2 "
        "JSON, 8 rows); rows/s: its req/s times its batch size. **all** mixes them: its req/s "
        "and percentiles are over every request, its rows/s the sum of the rows' rows/s"
    ) in markdown
    table = markdown[markdown.index("|---|---:|---:|---:|---:|---:|---:|---:|") + 1 :][:4]
    assert table == [
        "| v2-grpc b8 | 100 | 0 | 5.0 | 40.0 | 2 | 4 | 6 |",
        "| v2-json b1 | 900 | 2 | 45.0 | 45.0 | 3 | 7.5 | 12 |",
        "| v2-json b64 | 10 | 0 | 0.5 | 32.0 | - | - | - |",
        "| **all** | 1010 | 2 | 50.5 | 117.0 | 3 | 7.5 | 12 |",
    ]
    assert json.loads((tmp_path / "summary.json").read_text())["stats"] == rows
    write_summary(tmp_path, {**result, "spawn_rate": 0.5})  # a ramp-up of ~8 s of the 20
    assert (
        "- req/s: requests over the time from the start of the load to its last request; "
        "percentiles from locust's histogram of the response times, kept to 2 significant "
        "digits; both include the ramp-up to 4 users at 0.5/s"
    ) in (tmp_path / "summary.md").read_text().splitlines()
    assert "- warm-up: none (`--warmup-seconds 0`)" in markdown
    warmup = {"seconds": 3.0, "requests": 812, "failures": 0, "locust_exit_code": 0,
              "problems": []}  # fmt: skip
    write_summary(tmp_path, {**result, "warmup": warmup})
    assert (
        "- warm-up: 3 s before the load, 812 requests (0 failed), in none of the numbers below "
        "(`locust_warmup_*`)"
    ) in (tmp_path / "summary.md").read_text().splitlines()
    assert json.loads((tmp_path / "summary.json").read_text())["warmup"] == warmup


# --------------------------------------------------------------------------- traffic: exact
def test_metadata_groups_id_slots_jagged_partners_and_dense_inputs():
    """A ``<slot>.lengths`` input is a jagged slot's partner only when ``<slot>`` exists (its
    datatype kept); alone it is an ID slot of its own. Dense sample shapes drop the batch."""
    from load_tests import traffic

    metadata = {
        "name": "ranker",
        "inputs": [
            {"name": "item", "datatype": "INT64", "shape": [-1]},
            {"name": "history", "datatype": "UINT64", "shape": [-1]},
            {"name": "history.lengths", "datatype": "INT32", "shape": [-1]},
            {"name": "orphan.lengths", "datatype": "INT64", "shape": [-1]},
            {"name": "dense", "datatype": "FP32", "shape": [-1, 2, 3]},
            {"name": "score", "datatype": "FP32", "shape": [-1]},
        ],
    }
    inputs = traffic.ModelInputs.from_metadata(metadata)
    assert inputs == traffic.ModelInputs(
        "ranker",
        (
            traffic.IdSlot("item", "INT64", jagged=False),
            traffic.IdSlot("history", "UINT64", jagged=True, lengths_datatype="INT32"),
            traffic.IdSlot("orphan.lengths", "INT64", jagged=False),
        ),
        (traffic.DenseInput("dense", (2, 3)), traffic.DenseInput("score", ())),
    )
    assert traffic.ModelInputs.from_metadata({"inputs": []}).name == "model"
    generator = traffic.TrafficGenerator(inputs, traffic.TrafficProfile(seed=2))
    assert generator.arrays(4)["history.lengths"].dtype == np.int32
    bad = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}]}
    with pytest.raises(ValueError, match="input 'text': unsupported datatype BYTES"):
        traffic.ModelInputs.from_metadata(bad)


_EXACT_INPUTS = {
    "name": "m",
    "inputs": [
        {"name": "item", "datatype": "INT64", "shape": [-1]},
        {"name": "history", "datatype": "UINT64", "shape": [-1]},
        {"name": "history.lengths", "datatype": "INT32", "shape": [-1]},
        {"name": "dense", "datatype": "FP32", "shape": [-1, 2]},
        {"name": "score", "datatype": "FP32", "shape": [-1]},
    ],
}


def _exact_arrays() -> dict[str, np.ndarray]:
    return {
        "item": np.array([3, 4], dtype=np.int64),
        "history": np.array([7, 8, 9], dtype=np.uint64),
        "history.lengths": np.array([1, 2], dtype=np.int32),
        "dense": np.array([[0.5, 1.0], [2.0, -1.5]], dtype=np.float32),
        "score": np.array([0.25, -2.0], dtype=np.float32),
    }


def test_kserve_json_encoding_is_flat_row_major_data():
    from load_tests import traffic

    document = json.loads(traffic.encode_kserve_json(_exact_arrays()))
    assert document == {
        "inputs": [
            {"name": "item", "shape": [2], "datatype": "INT64", "data": [3, 4]},
            {"name": "history", "shape": [3], "datatype": "UINT64", "data": [7, 8, 9]},
            {"name": "history.lengths", "shape": [2], "datatype": "INT32", "data": [1, 2]},
            {"name": "dense", "shape": [2, 2], "datatype": "FP32", "data": [0.5, 1.0, 2.0, -1.5]},
            {"name": "score", "shape": [2], "datatype": "FP32", "data": [0.25, -2.0]},
        ]
    }


def test_kserve_binary_encoding_is_the_header_then_little_endian_tensors():
    from load_tests import traffic

    arrays = _exact_arrays()
    arrays["item"] = arrays["item"].astype(">i8")  # big-endian input: sent little-endian
    body, header_length = traffic.encode_kserve_binary(arrays)
    header = json.loads(body[:header_length])
    assert [(i["name"], i["shape"], i["datatype"]) for i in header["inputs"]] == [
        ("item", [2], "INT64"),
        ("history", [3], "UINT64"),
        ("history.lengths", [2], "INT32"),
        ("dense", [2, 2], "FP32"),
        ("score", [2], "FP32"),
    ]
    sizes = [i["parameters"]["binary_data_size"] for i in header["inputs"]]
    assert sizes == [16, 24, 8, 16, 8]
    assert header["outputs"] == [{"name": "prediction", "parameters": {"binary_data": True}}]
    expected = b"".join(
        np.asarray(values, dtype=dtype).tobytes()
        for values, dtype in (
            ([3, 4], "<i8"),
            ([7, 8, 9], "<u8"),
            ([1, 2], "<i4"),
            ([0.5, 1.0, 2.0, -1.5], "<f4"),
            ([0.25, -2.0], "<f4"),
        )
    )
    assert body[header_length:] == expected


def test_friendly_encoding_gives_each_row_its_own_list_and_values():
    """Row k of a jagged slot holds the IDs between the cumulative lengths before and after
    it; a dense input of sample shape () is a number per row, any other shape a list."""
    from load_tests import traffic

    inputs = traffic.ModelInputs.from_metadata(_EXACT_INPUTS)
    body = traffic.encode_friendly_json(inputs, _exact_arrays())
    assert json.loads(body) == {
        "instances": [
            {"item": 3, "history": [7], "dense": [0.5, 1.0], "score": 0.25},
            {"item": 4, "history": [8, 9], "dense": [2.0, -1.5], "score": -2.0},
        ]
    }
    arrays = _exact_arrays()
    arrays["history.lengths"] = np.array([0, 3], dtype=np.int32)  # an empty list first
    rows = json.loads(traffic.encode_friendly_json(inputs, arrays))["instances"]
    assert [row["history"] for row in rows] == [[], [7, 8, 9]]


def test_friendly_encoding_nests_a_multi_dimensional_sample_as_the_route_takes_it():
    """A [2, 3] dense input is two lists of 3 per row, as the friendly route takes it: a flat
    list of 6 failed every friendly request of a soak of such a model (HTTP 400)."""
    from embedding_store.signature import FeatureSignature, IdFeatureSpec, NonIdFeatureSpec
    from load_tests import traffic
    from serving.instance_inputs import instances_to_inputs

    metadata = {"name": "m", "inputs": [
        {"name": "item", "datatype": "INT64", "shape": [-1]},
        {"name": "grid", "datatype": "FP32", "shape": [-1, 2, 3]},
    ]}  # fmt: skip
    inputs = traffic.ModelInputs.from_metadata(metadata)
    grid = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    body = traffic.encode_friendly_json(inputs, {"item": np.array([3, 4]), "grid": grid})
    instances = json.loads(body)["instances"]
    assert instances == [
        {"item": 3, "grid": [[0, 1, 2], [3, 4, 5]]},
        {"item": 4, "grid": [[6, 7, 8], [9, 10, 11]]},
    ]
    signature = FeatureSignature(
        (IdFeatureSpec("item", True),), (NonIdFeatureSpec("grid", "float32", (2, 3)),)
    )
    np.testing.assert_array_equal(instances_to_inputs(signature, instances)["grid"], grid)


def test_raw_rows_are_read_up_to_the_limit_from_csv_json_lines_and_gzip(tmp_path):
    import gzip

    from load_tests import traffic

    lines = "".join(f'{{"age": {20 + k}}}\n' for k in range(5))
    (tmp_path / "rows.ndjson").write_text(lines)
    assert traffic.load_rows(tmp_path / "rows.ndjson", limit=3) == [
        {"age": 20},
        {"age": 21},
        {"age": 22},
    ]
    assert len(traffic.load_rows(tmp_path / "rows.ndjson", limit=5)) == 5
    with gzip.open(tmp_path / "rows.csv.gz", "wt") as handle:
        handle.write("age,workclass\n39,Private\n50,State-gov\n28,Private\n")
    assert traffic.load_rows(tmp_path / "rows.csv.gz", limit=2) == [
        {"age": "39", "workclass": "Private"},
        {"age": "50", "workclass": "State-gov"},
    ]
    with gzip.open(tmp_path / "rows.jsonl.gz", "wt") as handle:
        handle.write('{"age": 7}\n')
    assert traffic.load_rows(tmp_path / "rows.jsonl.gz") == [{"age": 7}]
    (tmp_path / "header.csv").write_text("age,workclass\n")
    with pytest.raises(ValueError, match=r"header\.csv: no rows"):
        traffic.load_rows(tmp_path / "header.csv")


def test_a_pool_refuses_unknown_kinds_and_misplaced_or_empty_rows():
    from load_tests import traffic

    generator = traffic.TrafficGenerator(
        traffic.ModelInputs.from_metadata(_ONE_SLOT),
        traffic.TrafficProfile(batch_sizes=(2,), batch_weights=(1.0,)),
    )
    with pytest.raises(ValueError, match="unknown payload kind 'xml'"):
        traffic.PayloadPool(generator, "xml", per_size=1)
    for kind, rows in (("json", [{"age": 1}]), ("friendly", [])):
        with pytest.raises(ValueError, match="raw rows need the friendly payload kind"):
            traffic.PayloadPool(generator, kind, per_size=1, rows=rows)


def test_a_pick_above_the_rounded_cdf_is_the_last_batch_size():
    """Weights whose normalized cumsum ends below 1: a uniform draw above it still picks the
    last batch size (not an index past the end)."""
    from load_tests import traffic

    weights = tuple(1.0 / np.arange(1, 13) ** 1.1)
    profile = traffic.TrafficProfile(batch_sizes=tuple(range(1, 13)), batch_weights=weights)
    generator = traffic.TrafficGenerator(traffic.ModelInputs.from_metadata(_ONE_SLOT), profile)
    pool = traffic.PayloadPool(generator, "grpc", per_size=1)
    assert pool._cdf[-1] < np.nextafter(1.0, 0.0)

    class Top:
        def random(self) -> float:
            return float(np.nextafter(1.0, 0.0))

        def integers(self, high: int) -> int:
            return high - 1

    pool._rng = Top()
    assert pool.pick().batch_size == 12


def test_stream_keys_and_pool_sizes():
    from load_tests import traffic

    seeded = {"RECSERVE_LT_SEED": "1"}
    assert traffic.stream_key("json", 0, seeded) == (0, 0)
    assert traffic.stream_key("grpc", 2, seeded) == (3, 2)
    assert traffic.stream_key("binary", -3, seeded) == (1, 0)  # no negative spawn key
    unseeded = traffic.stream_key("friendly", 1, {})
    assert unseeded[:2] == (2, 1) and len(unseeded) == 3 and 0 <= unseeded[2] < 2**63
    # An empty RECSERVE_LT_SEED is unset: a nonce, and the profile's default seed.
    assert len(traffic.stream_key("json", 0, {"RECSERVE_LT_SEED": ""})) == 3
    assert traffic.TrafficProfile.from_env({"RECSERVE_LT_SEED": ""}).seed == 0
    # About 8192 rows per size, 64 to 512 payloads.
    sizes = (1, 16, 64, 128, 256, 8192)
    assert [traffic.pool_payloads(size) for size in sizes] == [512, 512, 128, 64, 64, 64]


def test_a_slot_with_an_empty_vocabulary_draws_from_the_default_one():
    from load_tests import traffic

    generator = traffic.TrafficGenerator(
        traffic.ModelInputs.from_metadata(_ONE_SLOT),
        traffic.TrafficProfile(unknown_share=0.0, default_vocab=50, seed=4),
        {"item": np.zeros(0, np.uint64), "history": np.array([900, 901], np.uint64)},
    )
    arrays = generator.arrays(256)
    assert set(arrays["item"].tolist()) <= set(range(50))
    assert set(arrays["history"].tolist()) <= {900, 901}


def _fake_embeddings(root: Path, config: dict, shards: list[np.ndarray]) -> None:
    """An ``embeddings/`` folder as vocab_from_checkpoint reads it: the manifest's config and
    one safetensors file of stored (prefixed) ``ids`` per shard."""
    import safetensors.numpy

    embeddings = root / "embeddings"
    files = []
    for index, ids in enumerate(shards):
        path = f"shard_{index}/dim_4.safetensors"
        (embeddings / path).parent.mkdir(parents=True)
        safetensors.numpy.save_file({"ids": ids.astype(np.uint64)}, str(embeddings / path))
        files.append({"path": path, "rows": len(ids)})
    manifest = {"embedding_config": config, "files": files}
    (embeddings / "embedding_manifest.json").write_text(json.dumps(manifest))


def test_the_vocabulary_strips_each_id_spaces_prefix(tmp_path):
    """IDs stored as the embedding config prefixes them (feature groups first, then ungrouped
    slots; prefix numbers from 1): each slot's vocabulary is its ID space's raw IDs, sorted,
    slots of one group sharing theirs, and a raw ID using all 56 bits stays whole."""
    from embedding_store.config import embedding_config_from_mapping
    from load_tests import traffic

    mapping = {
        "feature_index_prefix_bit": 8,
        "slots_config": {"user": {"dim": 4}, "item": {"dim": 4}, "hist": {"dim": 4}},
        "feature_groups": {"items": ["item", "hist"]},
    }
    config = embedding_config_from_mapping(mapping)
    big = (1 << 56) - 3
    raw = {"user": [big, 5], "item": [11, 10], "hist": [12, 11]}
    stored = {name: config.prefix_ids(name, np.array(ids, np.uint64)) for name, ids in raw.items()}
    shards = [np.concatenate([stored["user"], stored["item"]]), stored["hist"]]
    _fake_embeddings(tmp_path, mapping, shards)
    vocab = traffic.vocab_from_checkpoint(tmp_path)
    assert {name: ids.tolist() for name, ids in vocab.items()} == {
        "user": [5, big],
        "item": [10, 11, 12],
        "hist": [10, 11, 12],
    }
    assert vocab["user"].dtype == np.uint64
    # Without prefix bits every slot shares one ID space; the embeddings folder itself works.
    flat = {**mapping, "feature_index_prefix_bit": 0, "feature_groups": {}}
    _fake_embeddings(tmp_path / "flat", flat, [np.array([9, 3, 9], np.uint64)])
    vocab = traffic.vocab_from_checkpoint(tmp_path / "flat" / "embeddings")
    assert {name: ids.tolist() for name, ids in vocab.items()} == {
        "user": [3, 9],
        "item": [3, 9],
        "hist": [3, 9],
    }
    traffic.save_vocab(vocab, tmp_path / "vocab.npz")
    loaded = traffic.load_vocab(tmp_path / "vocab.npz")
    assert {name: ids.tolist() for name, ids in loaded.items()} == {
        "user": [3, 9],
        "item": [3, 9],
        "hist": [3, 9],
    }


def test_describe_names_slots_jagged_ones_and_dense_shapes():
    from load_tests import traffic

    inputs = traffic.ModelInputs.from_metadata(_EXACT_INPUTS)
    assert traffic.describe(inputs) == "2 ID slots (1 jagged), dense inputs dense[2], score[]"


# --------------------------------------------------------------------------- run.py arguments
_BOUNDS = "--users, --seconds and --minutes must be positive"
_BOUNDED = "bounded runs only: at most 1000 users, 3600 s, 120 minutes"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--users", "0"], _BOUNDS),
        (["--seconds", "0"], _BOUNDS),
        (["--soak", "--minutes", "0"], _BOUNDS),
        (["--users", "1001"], _BOUNDED),
        (["--seconds", "3600.5"], _BOUNDED),
        (["--soak", "--minutes", "120.5"], _BOUNDED),
        (["--spawn-rate", "0"], "--spawn-rate must be > 0 users per second, got 0.0"),
        (["--locust-processes", "65"], "--locust-processes must be in 1..64, got 65"),
        (["--warmup-seconds", "-1"], "--warmup-seconds must be within 0..120, got -1"),
        (["--warmup-seconds", "121"], "--warmup-seconds must be within 0..120, got 121"),
        (["--rss-interval", "0"], "--rss-interval must be in (0, 60] seconds, got 0.0"),
        (["--rss-interval", "60.5"], "--rss-interval must be in (0, 60] seconds, got 60.5"),
        (["--unknown-share", "1"], "--unknown-share must be in [0, 1), got 1.0"),
        (["--unknown-share", "-0.1"], "--unknown-share must be in [0, 1), got -0.1"),
        (["--seconds", "nan"], "expected a finite number, got 'nan'"),
        (["--spawn-rate", "inf"], "expected a finite number, got 'inf'"),
        (["--seconds", "ten"], "expected a number, got 'ten'"),
        (["--user-classes", "json,xml,soap"], "unknown user classes ['soap', 'xml']"),
        (["--serve-args", '--model-name "x'], "--serve-args '--model-name \"x': No closing"),
    ],
)
def test_each_argument_bound_is_refused_with_its_message(flags, message, tmp_path, capsys):
    from load_tests.run import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--synthetic", "--out", str(tmp_path), *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["--users", "1", "--user-classes", "json"],
        ["--users", "1000", "--seconds", "3600"],
        ["--soak", "--minutes", "120", "--rss-interval", "60"],
        ["--spawn-rate", "0.5", "--locust-processes", "64", "--unknown-share", "0"],
        ["--locust-processes", "1", "--seed", "0"],
        # A class named twice is one class: 2 users cover json and grpc.
        ["--users", "2", "--user-classes", "json,json,grpc"],
    ],
)
def test_arguments_on_their_bounds_are_accepted(flags, tmp_path):
    from load_tests.run import parse_args

    parse_args(["--synthetic", "--out", str(tmp_path), *flags])


def test_serve_flags_are_read_as_recserve_serve_reads_them():
    """The last value given wins, in either spelling; a flag without its value, or a value that
    is not a number, reads as absent (the server itself then refuses it)."""
    from load_tests.stack import preprocessor_of, serve_option, watch_seconds_of, workers_of

    assert serve_option(["--workers", "2", "--workers=3"], "--workers") == "3"
    assert serve_option(["--workers=3", "--workers", "4"], "--workers") == "4"
    assert serve_option(["--max-batch-size", "8", "--workers"], "--workers") is None
    assert workers_of(["--workers"]) == 1
    assert workers_of(["--workers", "two"]) == 1
    assert preprocessor_of(["--preprocessor=a.b:c"]) == "a.b:c"
    for text in ("inf", "nan", "soon"):
        assert watch_seconds_of(["--watch-seconds", text]) == 0.0, text


# --------------------------------------------------------------------------- run.py memory
def test_memory_verdict_bounds_are_inclusive_where_the_rule_says_at_most():
    """Growth at exactly the allowed rate and a reload step of exactly the floor pass; the
    allowed rate never drops under MAX_GROWTH_MB_PER_MIN for a long soak."""
    from load_tests.memory import memory_verdict

    # 20-minute soak: allowed max(1, 20 MB / 20 min) = 1 MB/min; growing exactly that passes.
    times, rss = _soak(1200, 10.0, lambda t: 300 + t / 60.0)
    at_limit = memory_verdict(times, rss, warmup_s=0.0, run_s=1200.0)
    assert (at_limit.sustained_mb_per_min, at_limit.allowed_mb_per_min) == (1.0, 1.0)
    assert at_limit.passed, at_limit
    # 60-minute soak: 20 MB / 60 min is 0.33 MB/min, but 1 MB/min stays allowed.
    times, rss = _soak(3600, 30.0, lambda t: 300 + 0.5 * t / 60.0)
    long = memory_verdict(times, rss, warmup_s=0.0, run_s=3600.0)
    assert long.allowed_mb_per_min == 1.0 and long.passed, long
    # A reload step of exactly the 20 MB floor passes; 20.5 MB does not.
    for step, passed in ((20.0, True), (20.5, False)):
        times, rss = _soak(100, 1.0, lambda t, s=step: 100 + (s if t >= 50 else 0))
        verdict = memory_verdict(times, rss, warmup_s=0.0, run_s=100.0, reload_s=50.0, settle_s=20)
        assert (verdict.reload_step_mb, verdict.passed) == (step, passed)


def test_memory_verdict_judges_a_segment_from_six_samples_and_keeps_zero_readings():
    """A judged segment needs 6 samples: 5 are no verdict. Only negative readings mean "no
    sample"; every kept sample counts, and the levels are medians of quarters (at least one
    sample) of the judged ones."""
    from load_tests.memory import memory_verdict

    six = memory_verdict([0, 1, 2, 3, 4, 5], [0.0, 2.0, 0.0, 0.0, 0.0, 4.0], warmup_s=0, run_s=6)
    assert (six.passed, six.samples, six.reason) == (True, 6, "flat")
    assert (six.baseline_mb, six.last_mb) == (0.0, 4.0)  # one sample each: the first, the last
    five = memory_verdict([0, 1, 2, 3, 4, 5], [-1.0, 5, 5, 5, 5, 5], warmup_s=0, run_s=6)
    assert not five.passed and five.reason == "too few samples after warm-up (5)"
    ends = memory_verdict(
        range(8), [100.0, 104.0, 101.0, 101.0, 101.0, 101.0, 96.0, 99.0], warmup_s=0, run_s=8
    )
    assert (ends.baseline_mb, ends.last_mb) == (102.0, 97.5)  # quarters of 2 samples


def test_the_reload_step_compares_two_sample_levels_around_the_reload():
    """The level before the reload is the median of its last quarter, after it the median of
    the first quarter of the settled segment, each at least 2 samples (one sample is noise)."""
    from load_tests.memory import memory_verdict

    times = [float(t) for t in range(14)]
    rss = [100.0] * 5 + [104.0] + [-1.0] * 2 + [130.0] * 6
    verdict = memory_verdict(times, rss, warmup_s=0.0, run_s=14.0, reload_s=6.0, settle_s=2.0)
    assert verdict.reload_step_mb == 28.0  # 130 - median(100, 104)


def test_theil_sen_slope_is_the_median_pairwise_slope_of_distinct_times():
    from load_tests.memory import theil_sen_slope

    assert theil_sen_slope(np.array([1.0, 1.0]), np.array([0.0, 5.0])) is None
    assert theil_sen_slope(np.array([3.0]), np.array([1.0])) is None
    # Pairs: 1, 3, 1, 1, -1 (the two samples at t = 1 form no pair): median 1.
    assert theil_sen_slope(np.array([0.0, 1, 1, 2]), np.array([0.0, 1, 3, 2])) == 1.0
    # An outlier does not move it.
    assert theil_sen_slope(np.arange(7.0), np.array([0.0, 2, 4, 60, 8, 10, 12])) == 2.0


# --------------------------------------------------------------------------- run.py locust
def test_a_non_zero_locust_exit_is_explained_by_failures_or_task_errors(tmp_path):
    """locust exits 1 when requests failed or tasks raised: the problem names the exit code,
    and only an exit that nothing explains adds the log's tail."""
    from load_tests.locust_run import locust_outcome

    run = _locust_run(tmp_path)
    (tmp_path / "locust.log").write_text("locust said why\n")

    def outcome(failures: int, exceptions: list, code: int) -> list[str]:
        total = {"name": "Aggregated", "requests": 9, "failures": failures}
        document = {"written_unix": 10.0, "stats": [total], "exceptions": exceptions}
        (tmp_path / "locust_final.json").write_text(json.dumps(document))
        final, problems = locust_outcome(run, code, started_unix=5.0)
        assert final == document
        return problems

    task_error = [{"count": 1, "msg": "KeyError('x')"}]
    assert outcome(3, [], 1) == ["locust exited with code 1"]
    assert outcome(0, task_error, 1) == ["locust exited with code 1"]
    tail = f"locust exited with code 2; {tmp_path / 'locust.log'}:\nlocust said why"
    assert outcome(0, [], 2) == [tail]
    assert outcome(0, [], 0) == []


def test_a_locust_still_running_past_its_deadline_is_stopped_and_fails_the_run():
    """A locust still running 90 s after the end of its load was stopped silently: the run
    passed on whatever it had written."""
    from load_tests.run import _stop_overrun

    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        problems = _stop_overrun(hung, 12.5)
    finally:
        hung.kill()
        hung.wait(timeout=30)
    assert problems == [
        "locust was still running 90 s after the end of its 12.5 s load and was stopped "
        "(exit code -15): its numbers may be incomplete"
    ]
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(timeout=30)
    assert _stop_overrun(done, 12.5) == []
    assert done.returncode == 0


_FAKE_LOCUST = """
import json, os, sys, time
stats = [{"name": "v2-json b1", "requests": 40, "failures": int(sys.argv[1]), "rps": 40.0},
         {"name": "Aggregated", "requests": 40, "failures": int(sys.argv[1]), "rps": 40.0}]
with open(os.environ["RECSERVE_LT_FINAL_STATS"], "w") as handle:
    json.dump({"exit_code": 0, "written_unix": time.time(), "stats": stats}, handle)
"""


def test_the_warm_up_is_a_locust_run_of_its_own_whose_failures_fail_the_run(tmp_path):
    """run.py had no warm-up: the first seconds of a cold server were in the summary. The
    warm-up is a locust run of its own (its own files), run to its end; what it sent is
    reported apart, and a request it saw fail is still a problem."""
    from load_tests.locust_run import LocustRun
    from load_tests.run import WARMUP_S, _warm_up, parse_args

    common = ["--synthetic", "--out", str(tmp_path)]
    assert parse_args(common).warmup_seconds == WARMUP_S == 3
    assert parse_args([*common, "--warmup-seconds", "0"]).warmup_seconds == 0

    class FakeLocust(LocustRun):
        failures = 0

        def command(self) -> list[str]:
            return [sys.executable, "-c", _FAKE_LOCUST, str(self.failures)]

    run = FakeLocust(users=1, spawn_rate=1, seconds=1.0, classes=[], host="http://127.0.0.1:1",
                     csv_prefix=tmp_path / "locust_warmup", log_path=tmp_path / "warmup.log",
                     env={})  # fmt: skip
    warmup = _warm_up(run, {})
    assert warmup == {"seconds": 1.0, "requests": 40, "failures": 0, "locust_exit_code": 0,
                      "problems": []}  # fmt: skip
    assert (tmp_path / "locust_warmup_final.json").exists()  # its own files
    FakeLocust.failures = 2
    assert _warm_up(run, {})["problems"] == ["2 failed requests"]


def test_torn_or_foreign_final_stats_are_absent(tmp_path):
    from load_tests.locust_run import read_final_stats

    path = tmp_path / "final.json"
    for text in ('{"stats": [', '["stats"]', '{"exit_code": 0}'):
        path.write_text(text)
        assert read_final_stats(path) is None, text
    assert read_final_stats(tmp_path / "missing.json") is None
    path.write_text('{"stats": []}')
    assert read_final_stats(path) == {"stats": []}


def test_task_errors_are_one_line_of_at_most_200_characters(tmp_path):
    from load_tests.locust_run import task_exceptions

    message = "  ValueError('" + "x" * 300 + "')\n"
    (tmp_path / "csv_exceptions.csv").write_text(
        "Count,Message,Traceback,Nodes\n" + f'4,"{message}",tb,local\n'
    )
    expected = "4 x " + message.strip()[:200]
    assert task_exceptions(tmp_path / "csv") == [expected]
    document = {"stats": [], "exceptions": [{"count": 4, "msg": message}]}
    (tmp_path / "final_final.json").write_text(json.dumps(document))
    assert task_exceptions(tmp_path / "final") == [expected]


def test_the_locust_command_runs_whole_seconds_and_processes_only_when_asked(tmp_path):
    from load_tests.locust_run import LOCUSTFILE, LocustRun

    def command(seconds: float, processes: int) -> list[str]:
        run = LocustRun(
            users=3, spawn_rate=1.5, seconds=seconds, classes=["KServeJsonUser", "GrpcUser"],
            host="http://127.0.0.1:1", csv_prefix=tmp_path / "locust",
            log_path=tmp_path / "locust.log", env={}, processes=processes,
        )  # fmt: skip
        return run.command()

    assert command(14.6, 1)[1:] == [
        "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "3", "-r", "1.5", "-t",
        "15s", "--host", "http://127.0.0.1:1", "--csv", str(tmp_path / "locust"),
        "--csv-full-history", "--only-summary", "--stop-timeout", "5", "--loglevel", "WARNING",
        "KServeJsonUser", "GrpcUser",
    ]  # fmt: skip
    short = command(0.3, 1)
    assert short[short.index("-t") + 1] == "1s"  # never "0s"
    assert command(5, 3)[-4:] == ["--processes", "3", "KServeJsonUser", "GrpcUser"]


def test_locust_processes_talk_over_a_free_loopback_port(tmp_path, monkeypatch):
    """locust's master listened for its --processes workers on *:5557: on every interface,
    and a second such run on the machine (or anything on 5557) failed with "Socket bind
    failure: Address already in use", leaving the workers it had forked running."""
    from load_tests import locust_run

    started: list[list[str]] = []

    class Recorder:
        def __init__(self, command: list[str], **kwargs) -> None:
            started.append(command)
            assert kwargs["start_new_session"] is True

    monkeypatch.setattr(locust_run.subprocess, "Popen", Recorder)
    run = locust_run.LocustRun(
        users=4, spawn_rate=4, seconds=5, classes=["GrpcUser"], host="http://127.0.0.1:1",
        csv_prefix=tmp_path / "locust", log_path=tmp_path / "locust.log", env={}, processes=2,
    )  # fmt: skip
    run.start()
    port = run.master_port
    assert started[0][-9:] == [
        "--processes", "2", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
        "--master-port", str(port), "GrpcUser",
    ]  # fmt: skip
    with socket.socket() as probe:  # free when picked
        probe.bind(("127.0.0.1", port))


_ORPHANING_MASTER = """
import subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(worker.pid, flush=True)
sys.exit(1)  # as locust's master does when its port is taken: its workers live on
"""


def test_stopping_locust_stops_the_workers_it_left_behind(tmp_path):
    from load_tests.locust_run import LocustRun

    class Orphaning(LocustRun):
        def command(self) -> list[str]:
            return [sys.executable, "-c", _ORPHANING_MASTER]

    run = Orphaning(
        users=2, spawn_rate=2, seconds=5, classes=["GrpcUser"], host="http://127.0.0.1:1",
        csv_prefix=tmp_path / "locust", log_path=tmp_path / "locust.log", env={}, processes=2,
    )  # fmt: skip
    master = run.start()
    worker = 0
    try:
        assert master.wait(timeout=30) == 1
        worker = int((tmp_path / "locust.log").read_text().split()[0])
        assert _running(worker)
        assert run.stop(grace=5) == 1
        deadline = time.monotonic() + 10
        while _running(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(worker)
    finally:
        if worker and _running(worker):
            os.kill(worker, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie waiting for its (new) parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_the_summary_of_a_soak_lists_the_reload_and_each_process(tmp_path):
    from load_tests.report import write_summary

    row = {"name": "Aggregated", "requests": 0, "failures": 0, "rps": 0.0, "p50_ms": None,
           "p95_ms": None, "p99_ms": None}  # fmt: skip

    def memory(process: str, passed: bool, step: float | None) -> dict:
        return {"process": process, "samples": 40, "warmup_s": 6.0, "baseline_mb": 430.0,
                "last_mb": 431.5, "slope_mb_per_min": 0.2, "sustained_mb_per_min": 0.1,
                "allowed_mb_per_min": 40.0, "reload_step_mb": step, "passed": passed,
                "reason": "flat" if passed else "grows 90 MB/min"}  # fmt: skip

    result = {
        "stats": [row], "model": "m", "inputs": "x", "checkpoint": "/c", "tier": "embedded",
        "users": 2, "classes": ["GrpcUser"], "seconds": 30.0, "batches": "1", "seed": 1,
        "serve_args": ["--workers", "2"], "passed": True, "verdict": "no failures",
        "soak": {"reload_at_s": 15.04, "reload": {"ok": True},
                 "pids": {"server": 41},
                 "memory": {"server": memory("server", True, 1.5),
                            "server.1": memory("server.1", False, None)}},
    }  # fmt: skip
    write_summary(tmp_path, result)
    lines = (tmp_path / "summary.md").read_text().splitlines()
    assert "| **all** | 0 | 0 | 0.0 | - | - | - | - |" in lines
    assert "- serve flags: `--workers 2`" in lines
    soak = lines[lines.index("## Soak") :]
    assert soak[2:6] == [
        "- reload at 15.0 s: {'ok': True}",
        "- server (pid 41) RSS: 430.0 MB -> 431.5 MB, slope 0.2 MB/min, sustained 0.1 MB/min "
        "(allowed 40.0), after the reload +1.5 MB, 40 samples after 6.0 s warm-up: **flat**",
        "- server.1 RSS: 430.0 MB -> 431.5 MB, slope 0.2 MB/min, sustained 0.1 MB/min "
        "(allowed 40.0), after the reload -, 40 samples after 6.0 s warm-up: **GROWING** "
        "(grows 90 MB/min)",
        "- series: `rss.csv`",
    ]
    assert (tmp_path / "summary.csv").read_text().splitlines()[1] == "Aggregated,0,0,0.0,,,,,"


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    from load_tests.stack import stop_process

    assert stop_process(None) is None
    stubborn = subprocess.Popen(
        [sys.executable, "-c", "import signal, time\n"
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
         "time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert stubborn.stdout.readline().strip() == "ready"
        assert stop_process(stubborn, grace=0.3) == -signal.SIGKILL
    finally:
        if stubborn.poll() is None:
            stubborn.kill()
        stubborn.wait(timeout=10)
        stubborn.stdout.close()
    assert stop_process(stubborn) == -signal.SIGKILL  # already ended: its exit code


# --------------------------------------------------------------------------- locustfile
_LOCUSTFILE_PIECES = """
import json, os, sys
from types import SimpleNamespace

os.environ["RECSERVE_LT_FINAL_STATS"] = sys.argv[1]
from locust import events
from locust.env import Environment
from locust.runners import WorkerRunner
from load_tests import locustfile as lf

out = {}
users = [lf.KServeJsonUser, lf.KServeBinaryUser, lf.FriendlyJsonUser]
out["users"] = {u.__name__: [u.path, u.label, u.kind, u.content_type] for u in users}
runner = lambda **attributes: SimpleNamespace(environment=SimpleNamespace(
    runner=SimpleNamespace(**attributes)))
out["process_index"] = [lf._process_index(runner(worker_index=3)),
                        lf._process_index(runner(worker_index=None)), lf._process_index(runner())]
out["pools"] = {kind: lf.payload_pool(kind, "http://unused").rows for kind in ("json", "friendly")}
out["stream"] = list(lf.payload_pool("grpc", "http://unused", 2).generator.stream)

env = Environment(user_classes=[lf.KServeJsonUser], events=events)
for ms in range(1, 101):
    env.stats.log_request("POST", "v2-json b8", ms, 10)
env.stats.log_request("POST", "v2-json b1", 5, 10)
env.stats.log_request("GET", "v2-json b1", 7, 10)
env.stats.total.start_time, env.stats.total.last_request_timestamp = 1000.0, 1004.0
document = lf.final_stats(env.stats, {}, 0)
out["rows"] = [[r["type"], r["name"], r["requests"], r["rps"], r["p50_ms"], r["p95_ms"],
                r["p99_ms"]] for r in document["stats"]]

class Worker(WorkerRunner):
    def __init__(self):
        self.exceptions = {}

lf._environments[:] = [SimpleNamespace(runner=Worker(), stats=env.stats)]
lf._write_final_stats(exit_code=0)
out["worker_wrote"] = os.path.exists(sys.argv[1])
lf._environments[:] = [SimpleNamespace(runner=SimpleNamespace(exceptions={}), stats=env.stats)]
lf._write_final_stats(exit_code=0)
out["master_wrote"] = os.path.exists(sys.argv[1])
print(json.dumps(out))
"""


def test_the_locustfiles_users_pools_and_final_rows(tmp_path):
    """Paths and labels per user; the load-generator process index (0 when locust has none);
    raw rows only for the friendly pool; the final rows sorted by name then method, with
    rps over the whole run and each percentile its own; only the master writes them."""
    (tmp_path / "rows.jsonl").write_text('{"age": 39}\n')
    (tmp_path / "metadata.json").write_text(json.dumps(_ONE_SLOT))
    env = {
        **os.environ,
        "RECSERVE_LT_MODEL": "adult",
        "RECSERVE_LT_ROWS": str(tmp_path / "rows.jsonl"),
        "RECSERVE_LT_METADATA_FILE": str(tmp_path / "metadata.json"),
        "RECSERVE_LT_SEED": "4",
        "RECSERVE_LT_POOL": "2",
    }
    final = tmp_path / "final.json"
    result = run_python(_LOCUSTFILE_PIECES, str(final), env=env)
    out = last_json_line(result)
    assert out["users"] == {
        "KServeJsonUser": ["/v2/models/adult/infer", "v2-json", "json", "application/json"],
        "KServeBinaryUser": [
            "/v2/models/adult/infer", "v2-binary", "binary", "application/octet-stream",
        ],
        "FriendlyJsonUser": ["/v1/models/adult:predict", "v1-predict", "friendly",
                             "application/json"],
    }  # fmt: skip
    assert out["process_index"] == [3, 0, 0]
    assert out["pools"] == {"json": None, "friendly": [{"age": 39}]}
    assert out["stream"] == [3, 2]
    assert out["rows"] == [
        ["GET", "v2-json b1", 1, 0.25, 7.0, 7.0, 7.0],
        ["POST", "v2-json b1", 1, 0.25, 5.0, 5.0, 5.0],
        ["POST", "v2-json b8", 100, 25.0, 51.0, 96.0, 100.0],  # 1 .. 100 ms
        ["", "Aggregated", 102, 25.5, 50.0, 95.0, 99.0],
    ]
    assert (out["worker_wrote"], out["master_wrote"]) == (False, True)
    assert json.loads(final.read_text())["stats"][-1]["requests"] == 102


_FINE_PERCENTILES = """
import json
from locust.env import Environment
from locust.rpc.protocol import Message
from locust.stats import RequestStats, StatsEntry
from load_tests import locustfile as lf

out = {"buckets": [lf.latency_bucket(t) for t in (4.567, 0.81234, 12.51, 1234.5, 0.0, 99.6)]}
env = Environment(user_classes=[lf.KServeJsonUser])
for i in range(100):  # 0.503, 0.513, ..., 1.493 ms
    env.stats.log_request("POST", "v2-json b1", 0.503 + 0.01 * i, 10)
row = lf.final_stats(env.stats, {}, 0)["stats"][0]
out["local"] = [row["p50_ms"], row["p95_ms"], row["p99_ms"]]
out["resolution"] = lf.final_stats(env.stats, {}, 0)["latency_resolution"]
# What a worker of --processes reports to its master, through locust's wire encoding.
entry = env.stats.entries[("v2-json b1", "POST")]
report = Message("stats", {"stats": [entry.get_stripped_report()]}, "w").serialize()
master = RequestStats()
merged = StatsEntry(master, "v2-json b1", "POST")
merged.extend(StatsEntry.unserialize(Message.unserialize(report).data["stats"][0], master))
out["master"] = [merged.get_response_time_percentile(p) for p in (0.5, 0.95, 0.99)]
print(json.dumps(out))
"""


def test_percentiles_keep_two_significant_digits_of_each_response_time():
    """locust's histogram rounded every response time below 100 ms to a whole ms, so these
    100 requests of 0.503 .. 1.493 ms read p50 = p95 = p99 = 1 ms. The locustfile now gives
    locust's bucketing hook 2 significant digits, which the master of --processes receives
    as they are."""
    out = last_json_line(run_python(_FINE_PERCENTILES))
    assert out["buckets"] == [4.6, 0.81, 13.0, 1200.0, 0.0, 100.0]
    assert out["local"] == [1.0, 1.5, 1.5]  # 1.003, 1.453, 1.493 ms
    assert out["master"] == [1.0, 1.5, 1.5]
    assert out["resolution"] == "2 significant digits"


# --------------------------------------------------------------------------- run.py verdicts
def test_a_run_fails_on_any_failed_request_no_throughput_silence_or_task_error(tmp_path):
    from load_tests.locust_run import stats_problems

    classes = ["KServeJsonUser", "GrpcUser"]

    def rows(failures: int, rps: float, grpc_requests: int) -> list[dict]:
        return [
            {"name": "v2-json b1", "requests": 10, "failures": failures, "rps": rps},
            {"name": "v2-grpc b1", "requests": grpc_requests, "failures": 0, "rps": 0.0},
            {"name": "Aggregated", "requests": 10 + grpc_requests, "failures": failures,
             "rps": rps},
        ]  # fmt: skip

    assert stats_problems(rows(0, 5.0, 3), classes, tmp_path / "none") == []
    assert stats_problems(rows(1, 5.0, 3), classes, tmp_path / "none") == ["1 failed requests"]
    assert stats_problems(rows(0, 0.0, 3), classes, tmp_path / "none") == ["no throughput"]
    assert stats_problems(rows(0, 5.0, 0), classes, tmp_path / "none") == [
        "user classes ['GrpcUser'] sent no requests"
    ]
    document = {"stats": [], "exceptions": [{"count": 2, "msg": "KeyError('x')"}]}
    (tmp_path / "run_final.json").write_text(json.dumps(document))
    assert stats_problems(rows(0, 5.0, 3), classes, tmp_path / "run") == [
        "locust task error: 2 x KeyError('x')"
    ]


def test_a_soak_fails_on_any_growing_process_or_a_failed_reload():
    from load_tests.memory import NO_RELOAD, memory_verdict, soak_problems

    times, flat_rss = _soak(60, 1.0, lambda t: 100.0)
    _, leak_rss = _soak(60, 1.0, lambda t: 100.0 + 2.0 * t)
    flat = memory_verdict(times, flat_rss, warmup_s=0.0, run_s=60.0, process="server")
    leak = memory_verdict(times, leak_rss, warmup_s=0.0, run_s=60.0, process="worker")
    assert soak_problems({"server": flat}, {"ok": True}) == []
    assert soak_problems({"server": flat, "worker": leak}, {"ok": True}) == [
        "worker RSS: grows 120 MB/min in both halves of a segment (allowed 20.0)"
    ]
    # Each way a reload fails the soak, with its reason in words.
    never = {"ok": False, "error": NO_RELOAD}
    assert soak_problems({"server": flat}, never) == [
        "reload never happened: the load ended, or a process of the stack died, before half-way"
    ]
    refused = {"ok": False, "error": "HTTPError(500)"}
    assert soak_problems({"server": flat, "worker": leak}, refused) == [
        "worker RSS: grows 120 MB/min in both halves of a segment (allowed 20.0)",
        "reload failed: HTTPError(500)",
    ]
    # The server answered, but with another version than the one published: not ok either.
    stale = {"ok": False, "published": "00000002-bb", "version": "00000001-aa"}
    assert soak_problems({"server": flat}, stale) == [
        "reload failed: the server loaded version '00000001-aa', not the published '00000002-bb'"
    ]
    # The reload said it loaded the new version, but an inference still answers the old one.
    unserved = {"ok": False, "published": "00000002-bb", "version": "00000002-bb",
                "serves": {"ok": False, "metadata_versions": ["00000002-bb"],
                           "answered_version": "00000001-aa"}}  # fmt: skip
    assert soak_problems({"server": flat}, unserved) == [
        "reload not served: after it the model's metadata lists versions ['00000002-bb'] and "
        "an inference answered version '00000001-aa', not the published '00000002-bb'"
    ]
    unverified = {**unserved, "serves": {"ok": False, "error": "URLError('refused')"}}
    assert soak_problems({"server": flat}, unverified) == [
        "reload not verified: asking the server what it serves failed: URLError('refused')"
    ]
    # No "ok" (nor a version) is no pass; nor is a soak whose memory nobody sampled.
    assert soak_problems({"server": flat}, {"published": "x"}) == [
        "reload failed: the server loaded version None, not the published 'x'"
    ]
    assert soak_problems({}, {"ok": True}) == ["no RSS samples: the memory was not judged"]


def test_a_soaks_verdict_fails_with_each_reason_from_synthetic_samples(tmp_path):
    """What run.py judges at the end of a soak, from RssSampler's samples (server flat, the
    embedding worker leaking 1 MB/s), locust's final rows (3 failures) and the reload's
    result: FAIL, with every reason in the summary; the same soak without them passes."""
    from dataclasses import asdict

    from load_tests.locust_run import stats_problems
    from load_tests.memory import NO_RELOAD, judge_soak, soak_warmup_s, verdict_text
    from load_tests.report import write_summary

    assert (soak_warmup_s(30.0), soak_warmup_s(600.0), soak_warmup_s(20.0)) == (6.0, 60.0, 4.0)

    def samples(leak_mb_per_s: float) -> list[dict[str, float]]:
        return [
            {"t_s": t, "unix": 1000.0 + t, "server_rss_mb": 430.0 + (t % 1.0),
             "embedding_worker_0_rss_mb": 380.0 + leak_mb_per_s * t}
            for t in np.arange(0, 30.25, 0.25).tolist()
        ]  # fmt: skip

    def rows(failures: int) -> list[dict]:
        return [{"name": "Aggregated", "requests": 900, "failures": failures, "rps": 30.0,
                 "p50_ms": 3.0, "p95_ms": 6.0, "p99_ms": 9.0}]  # fmt: skip

    served = {"ok": True, "published": "2-b", "version": "2-b", "serves": {"ok": True}}
    verdicts, problems = judge_soak(samples(0.0), seconds=30.0, reload_s=15.0, reload=served)
    problems = stats_problems(rows(0), [], tmp_path / "none") + problems
    assert problems == [] and all(v.passed for v in verdicts.values())
    assert verdict_text(problems, soak=True) == "no failures, memory flat, reload served"

    never = {"ok": False, "error": NO_RELOAD}
    verdicts, problems = judge_soak(samples(1.0), seconds=30.0, reload_s=None, reload=never)
    problems = stats_problems(rows(3), [], tmp_path / "none") + problems
    verdict = verdict_text(problems, soak=True)
    assert verdict == (
        "3 failed requests; embedding_worker_0 RSS: grows 60 MB/min in both halves of a "
        "segment (allowed 40.0); reload never happened: the load ended, or a process of the "
        "stack died, before half-way"
    )
    result = {
        "stats": rows(3), "model": "m", "inputs": "x", "checkpoint": "/c", "tier": "remote",
        "users": 2, "classes": [], "seconds": 30.0, "batches": "1", "seed": 1,
        "serve_args": [], "passed": not problems, "verdict": verdict,
        "soak": {"reload_at_s": -1.0, "reload": never, "pids": {},
                 "memory": {name: asdict(v) for name, v in verdicts.items()}},
    }  # fmt: skip
    write_summary(tmp_path, result)
    assert f"- verdict: **FAIL** ({verdict})" in (tmp_path / "summary.md").read_text()


def test_the_soak_reload_is_checked_against_what_the_server_answers(tmp_path):
    """The reload half-way through a soak passes only when the server loaded the published
    version, its metadata lists it and an inference answers with it (a server that says it
    reloaded but answers with the old model fails, as does one whose reload errs)."""
    import http.server
    import threading

    from load_tests.checkpoint_reload import checkpoint_version, soak_reload
    from load_tests.memory import reload_problem
    from load_tests.stack import ServeProcess

    served = tmp_path / "served"
    served.mkdir()
    (served / "manifest.json").write_text(json.dumps({"step": 3, "version": "00000003-aa"}))
    (served / "DONE").write_text("")
    # What the stand-in answers: "new" is the version in the served directory now.
    state = {"reload": "new", "metadata": "new", "answer": "new", "status": 200}
    seen: list[tuple[str, str, bytes]] = []

    class Server(http.server.BaseHTTPRequestHandler):
        def _answer(self, document: dict) -> None:
            body = json.dumps(document).encode()
            self.send_response(state["status"] if self.path == "/admin/reload" else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _version(self, which: str) -> str:
            return checkpoint_version(served) if state[which] == "new" else "00000003-aa"

        def do_GET(self) -> None:
            seen.append(("GET", self.path, b""))
            self._answer({"name": "model", "versions": [self._version("metadata")]})

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(("POST", self.path, body))
            key = "reload" if self.path == "/admin/reload" else "answer"
            field = "version" if key == "reload" else "model_version"
            self._answer({field: self._version(key)})

        def log_message(self, *args: object) -> None:
            pass  # a quiet stand-in: no access log on the test's stderr

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    server = ServeProcess(served, tmp_path / "serve.log")
    server.http = f"http://127.0.0.1:{httpd.server_address[1]}"

    def reload() -> dict:
        seen.clear()
        return soak_reload(server, served, workers=1, watcher_timeout=1.0, infer_body=b'{"q":1}')

    try:
        good = reload()
        version = checkpoint_version(served)
        assert good["ok"] and good["published"] == good["version"] == version != "00000003-aa"
        assert good["serves"] == {"ok": True, "metadata_versions": [version],
                                  "answered_version": version}  # fmt: skip
        assert [(method, path) for method, path, _ in seen] == [
            ("POST", "/admin/reload"),
            ("GET", "/v2/models/model"),
            ("POST", "/v2/models/model/infer"),
        ]
        assert seen[2][2] == b'{"q":1}' and reload_problem(good) is None
        # Reloaded, says so, lists the new version, but the model that answers is the old one.
        state["answer"] = "old"
        unserved = reload()
        assert not unserved["ok"] and unserved["serves"]["answered_version"] == "00000003-aa"
        assert reload_problem(unserved) == (
            f"reload not served: after it the model's metadata lists versions "
            f"['{unserved['published']}'] and an inference answered version '00000003-aa', "
            f"not the published '{unserved['published']}'"
        )
        # The reload itself loaded the old version.
        state.update(answer="new", reload="old")
        stale = reload()
        assert not stale["ok"] and reload_problem(stale) == (
            "reload failed: the server loaded version '00000003-aa', not the published "
            f"'{stale['published']}'"
        )
        # The reload is refused: nothing is checked after it.
        state.update(reload="new", status=500)
        refused = reload()
        assert refused == {"ok": False, "error": refused["error"]}
        assert "HTTPError 500" in refused["error"] and len(seen) == 1
        assert reload_problem(refused) == f"reload failed: {refused['error']}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_log_tail_is_its_last_lines(tmp_path):
    from load_tests.stack import tail

    (tmp_path / "a.log").write_text("one\ntwo\nthree\n")
    assert tail(tmp_path / "a.log", 2) == "two\nthree"
    assert tail(tmp_path / "missing.log") == ""


_SECOND_SIGTERM = """
import os, signal
from load_tests.stack import sigterm_exits

try:
    with sigterm_exits():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        finally:  # the cleanup, interrupted by a second SIGTERM
            os.kill(os.getpid(), signal.SIGTERM)
            print("cleanup finished", flush=True)
finally:
    print("handler restored", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
"""


def test_a_second_sigterm_does_not_cut_the_cleanup_short():
    result = run_python(_SECOND_SIGTERM, returncode=143)
    assert result.stdout.splitlines() == ["cleanup finished", "handler restored True"]


_SECOND_CTRL_C = """
import os, signal
from load_tests.stack import run_cleanups

def stop_locust():
    os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C while locust is being stopped
    print("locust stopped", flush=True)

def stop_sampler():
    raise OSError("gone")

try:
    try:
        raise KeyboardInterrupt  # the first Ctrl-C
    finally:
        run_cleanups([stop_sampler, None, stop_locust, lambda: print("server stopped")])
except KeyboardInterrupt:
    print("interrupted", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


def test_a_second_ctrl_c_does_not_cut_the_cleanup_short():
    """run.py's cleanup caught Exception per step: a KeyboardInterrupt while it waited for
    locust to quit ended it there, and the server and the remote tier were left running."""
    result = run_python(_SECOND_CTRL_C)
    assert result.stdout.splitlines() == ["locust stopped", "server stopped", "interrupted True"]
    assert result.stderr.splitlines() == ["warning: cleanup failed: OSError('gone')"]


def test_the_rss_columns_wait_for_every_serving_process():
    """Serving processes start one after another: the columns are taken once all N exist."""
    from load_tests.stack import server_pids

    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         "kids, sleeper = [], 'import time; time.sleep(30)'\n"
         "for _ in range(2):\n"
         "    kids.append(subprocess.Popen([sys.executable, '-c', sleeper]))\n"
         "    time.sleep(0.4)\n"
         "time.sleep(30)"],
    )  # fmt: skip
    pids: dict[str, int] = {}
    try:
        pids = server_pids(parent.pid, 2, timeout=20)
        assert list(pids) == ["server", "server.1", "server.2"]
        assert len(set(pids.values())) == 3
    finally:  # the children first, by PID
        for name, pid in pids.items():
            if name != "server":
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait(timeout=10)


def test_served_versions_are_the_served_models_own(monkeypatch):
    """``recserve_model_info`` of every model served: only ``model``'s versions count."""
    import io
    import urllib.request

    from load_tests.checkpoint_reload import served_versions

    text = (
        "# TYPE recserve_model_info gauge\n"
        'recserve_model_info{model="model",version="v2"} 1\n'
        'recserve_model_info{model="model",version="v1"} 0\n'
        'recserve_model_info{model="other",version="v9"} 1\n'
        'recserve_model_info{model="model"} 1\n'
        "# TYPE recserve_requests_total counter\n"
        'recserve_requests_total{model="model",version="v3"} 5\n'
    )
    opened = []

    def urlopen(url: str, timeout: float) -> io.BytesIO:
        opened.append(url)
        return io.BytesIO(text.encode())

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    assert served_versions("http://127.0.0.1:9", "model") == {"v2": 1.0, "v1": 0.0}
    assert opened == ["http://127.0.0.1:9/metrics"]


# --------------------------------------------------------------------------- report files
def _summary_result(**changes) -> dict:
    row = {"name": "Aggregated", "requests": 10, "failures": 0, "rps": 5.0, "p50_ms": 3.0,
           "p95_ms": 4.0, "p99_ms": 5.0}  # fmt: skip
    result = {
        "stats": [row], "model": "m", "inputs": "x", "checkpoint": "/c", "tier": "embedded",
        "users": 2, "classes": ["KServeJsonUser"], "seconds": 10.0, "batches": "1", "seed": 1,
        "serve_args": [], "passed": True, "verdict": "no failures",
    }  # fmt: skip
    return result | changes


def test_without_matplotlib_the_summary_says_why_there_is_no_plot(tmp_path, monkeypatch):
    """The load extra brings locust, not matplotlib: plot() raised ImportError after the run,
    so run.py wrote no summary at all and the run's verdict was lost."""
    from load_tests.report import NO_MATPLOTLIB, plot, write_summary

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    history = [{"unix": 1000.0 + t, "users": 2.0, "rps": 5.0, "failures_per_s": 0.0,
                "p50_ms": 3.0, "p95_ms": 4.0, "p99_ms": 5.0} for t in range(3)]  # fmt: skip
    note = plot(tmp_path / "latency.png", history, title="t")
    assert note == NO_MATPLOTLIB and "pip install matplotlib" in note
    assert not (tmp_path / "latency.png").exists()
    write_summary(tmp_path, _summary_result(plot=note))
    lines = (tmp_path / "summary.md").read_text().splitlines()
    assert f"Latency over time: none ({NO_MATPLOTLIB}); locust CSVs: `locust_*.csv`." in lines
    assert json.loads((tmp_path / "summary.json").read_text())["plot"] == NO_MATPLOTLIB
    write_summary(tmp_path, _summary_result(plot=None))
    lines = (tmp_path / "summary.md").read_text().splitlines()
    assert "Latency over time: `latency.png`; locust CSVs: `locust_*.csv`." in lines


def test_a_summary_that_cannot_be_rendered_leaves_no_partial_report(tmp_path):
    """summary.csv and summary.json used to be written before summary.md was rendered: a
    failure there left two files of three; and each file is renamed into place whole."""
    from load_tests.report import write_summary

    broken = _summary_result()
    del broken["verdict"]
    with pytest.raises(KeyError):
        write_summary(tmp_path, broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    write_summary(tmp_path, _summary_result())
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "summary.csv", "summary.json", "summary.md",
    ]  # fmt: skip
    table = (tmp_path / "summary.csv").read_text().splitlines()
    assert table[1] == "Aggregated,10,0,5.0,,,3.0,4.0,5.0"  # no rows: not named


_PREBUILT = """
import json
from locust import events
from locust.env import Environment
from load_tests import locustfile as lf

classes = [lf.KServeBinaryUser, lf.GrpcUser, lf.TorchServeBinaryUser]
env = Environment(user_classes=classes, events=events, host="http://127.0.0.1:9")
events.init.fire(environment=env, runner=env.create_local_runner(), web_ui=None)
out = {"built": sorted(lf._pools),
       "sizes": {k: {s: len(p) for s, p in pool.by_size.items()} for k, pool in lf._pools.items()}}
lf._pools.clear()
sent = []
Worker = type("Worker", (lf.WorkerRunner,), {
    "__init__": lambda self: None,
    "send_message": lambda self, kind, data=None, client_id=None: sent.append([kind, data]),
})
env.runner = Worker()  # a master that sent no index (worker_index stays -1)
events.init.fire(environment=env, runner=env.runner, web_ui=None)
out["no_index"] = [sorted(lf._pools), sent[:]]
env.runner.worker_index = 1  # what locust's master sent it when it connected
sent.clear()
events.init.fire(environment=env, runner=env.runner, web_ui=None)
out["by_worker_1"] = [sorted(lf._pools), sent, list(lf._pools["grpc"].generator.stream)]
print(json.dumps(out))
"""

_MASTER_WAITS = """
import json, sys, time
import gevent
from types import SimpleNamespace
from locust import events
from locust.env import Environment
from load_tests import locustfile as lf

lf.POOLS_WAIT_S = float(sys.argv[1])
handlers = {}


def register(self, kind, listener, concurrent=False):
    handlers[kind] = listener


env = Environment(user_classes=[lf.KServeJsonUser], events=events)
Master = type("Master", (lf.MasterRunner,), {
    "__init__": lambda self: None, "register_message": register, "worker_count": 2,
    "environment": env, "greenlet": None,
})
env.runner = Master()
events.init.fire(environment=env, runner=env.runner, web_ui=None)


readies = []


def ready(worker, building_s):
    gevent.sleep(building_s)  # building its pools
    readies.append(time.time())
    handlers[lf.POOLS_READY](environment=env, msg=SimpleNamespace(node_id=worker))


cleared = time.time()  # locust clears the stats just before test_start
env.stats.total.start_time = cleared
# "NAME:SECONDS": each worker ready SECONDS after the one before it
workers = [(name, float(s)) for name, s in (w.split(":") for w in sys.argv[2:])]
gevent.spawn(lambda: [ready(worker, building_s) for worker, building_s in workers])
events.test_start.fire(environment=env)
returned = time.time()
last = readies[-1] if readies else cleared
print(json.dumps({"handlers": sorted(handlers), "ready": len(readies),
                  "waited": returned - cleared,
                  "after_the_last": returned >= last and env.stats.total.start_time >= last}))
"""


def test_the_pools_are_built_before_the_run_starts(tmp_path):
    """Built in the users' on_start, the pools took the first ~0.5-1 s of the run, which
    locust's req/s (requests / time since the start) counted: a 6 s run read 711 req/s of a
    server answering ~820. A worker of --processes builds its own when it starts, from the
    stream of the index its master sent (before, its users built them once the run had
    started), and tells its master, whether it could build them or not."""
    (tmp_path / "metadata.json").write_text(json.dumps(_ONE_SLOT))
    env = {
        **os.environ,
        "RECSERVE_LT_METADATA_FILE": str(tmp_path / "metadata.json"),
        "RECSERVE_LT_POOL": "3",
        "RECSERVE_LT_BATCHES": "1:1,8:2",
        "RECSERVE_LT_SEED": "2",
    }
    out = last_json_line(run_python(_PREBUILT, env=env))
    assert out["built"] == ["binary", "grpc"]  # TorchServe's binary user shares the binary pool
    assert out["sizes"] == {"binary": {"1": 3, "8": 3}, "grpc": {"1": 3, "8": 3}}
    ready = [["recserve_pools_ready", {"built": []}]]
    assert out["no_index"] == [[], ready]
    built = [["recserve_pools_ready", {"built": ["binary", "grpc"]}]]
    assert out["by_worker_1"] == [["binary", "grpc"], built, [3, 1]]


@pytest.mark.parametrize(
    ("wait_s", "workers", "ready", "waited"),
    # Margins of 0.7 s or more either side of the wait's end: a loaded CI machine's
    # scheduling must not move a worker's readiness across it.
    [(5.0, ["w1:0.3", "w2:0.3"], 2, 0.6), (1.0, ["w1:0.3", "w2:1.4"], 1, 1.0)],
)
def test_the_master_starts_the_load_once_its_workers_pools_are_built(
    wait_s, workers, ready, waited
):
    """locust's master cleared its stats (its req/s clock) and sent the load while each
    worker still built its pools: a 5 s run of 2 processes read 582 req/s of a server
    answering ~730 (789 with this). It now waits until every worker said its pools are
    built (here after 0.3 and 0.6 s, or 0.3 and 1.7 s against a 1 s limit), at most
    POOLS_WAIT_S, and restarts the clock."""
    out = last_json_line(run_python(_MASTER_WAITS, str(wait_s), *workers))
    assert waited - 0.02 <= out.pop("waited") < waited + 0.4  # a busy machine's slack
    assert out == {"handlers": ["recserve_pools_ready"], "ready": ready, "after_the_last": True}


def test_a_server_that_stops_answering_fails_the_run(tmp_path):
    """A server hung 8 s into a 14 s run: locust ended its users with their requests pending
    and counted none of them: 342 requests, 0 failures, exit 0, a PASS. Its history shows it."""
    from load_tests.locust_run import read_history, stall_problems

    def history(counts: list[tuple[int, int]]) -> list[dict[str, float]]:
        lines = [_HISTORY_HEADER] + [
            _history_row(1000 + t, "Aggregated", "5", total, 0).replace(",8,,", f",{users},,", 1)
            for t, (users, total) in enumerate(counts)
        ]
        (tmp_path / "h_stats_history.csv").write_text("\n".join(lines) + "\n")
        return read_history(tmp_path / "h")

    answering = [(0, 0), (2, 0), (2, 46), (2, 92), (2, 137)]  # users start; 1 s to the first
    hung = answering + [(2, 160)] + [(2, 160)] * 6 + [(0, 160)] * 3  # stopping: users 0
    assert stall_problems(history(hung)) == [
        "no request completed for 6 s while users ran (from 5 s into the run): the server "
        "stopped answering"
    ]
    assert stall_problems(history(hung), limit_s=7.0) == []
    # 4 quiet seconds, then answers again: under the 5 s limit; then one of exactly 5 s.
    recovered = answering + [(2, 137)] * 4 + [(2, 180)] + [(2, 180)] * 5 + [(2, 200)]
    assert stall_problems(history(recovered)) == [
        "no request completed for 5 s while users ran (from 9 s into the run): the server "
        "stopped answering"
    ]
    # A load generator too busy to write its rows for 8 s is no stall: its rows all grow.
    busy = [*answering, (2, 300)]
    rows = history(busy)
    rows[-1]["unix"] += 8.0
    assert stall_problems(rows) == [] and stall_problems([]) == []
