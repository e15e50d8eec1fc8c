"""benchmarks/serve_throughput.py, train_throughput.py and embedding_tier.py: options that
would measure nothing are refused before anything starts (they used to end in a
ZeroDivisionError or StatisticsError after the whole run), serve_throughput's HTTP clients
count a request that failed in transport as an error, grpc_floor.py's timed window ends with
the last answer, and SIGTERM or Ctrl-C leave no server of theirs running."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import embedding_tier  # noqa: E402
import grpc_floor  # noqa: E402
import serve_throughput  # noqa: E402
import train_throughput  # noqa: E402


def _refused(parse, argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        parse(argv)
    assert caught.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rounds", "0"], "argument --rounds: expected an integer > 0, got 0"),
        (["--seconds", "0"], "argument --seconds: expected a number > 0, got '0'"),
        (["--seconds", "nan"], "argument --seconds: expected a finite number, got 'nan'"),
        (["--clients", "0"], "argument --clients: expected an integer > 0, got 0"),
        (["--batch-sizes", "1", "0"], "argument --batch-sizes: expected an integer > 0, got 0"),
        (["--batch-sizes", "1025"], "--batch-sizes: at most 1024 (16 batches of Adult test "
         "rows each), got 1025"),
        (["--server-threads", "0"], "argument --server-threads: expected an integer > 0, got 0"),
        (["--max-queue-delay-ms", "-1"],
         "argument --max-queue-delay-ms: expected a number >= 0, got '-1'"),
        (["--rounds", "101"], "bounded runs only: at most 600 --seconds, 100 --rounds, "
         "256 --clients"),
        (["--checkpoint", "/nonexistent/ckpt"], "--checkpoint /nonexistent/ckpt: no such "
         "directory"),
    ],
)  # fmt: skip
def test_serve_throughput_refuses_runs_that_measure_nothing(argv, message, capsys):
    _refused(serve_throughput.parse_args, argv, message, capsys)


def test_serve_throughput_accepts_its_bounds():
    args = serve_throughput.parse_args(
        ["--batch-sizes", "1", "1024", "--rounds", "100", "--seconds", "600",
         "--clients", "256", "--max-queue-delay-ms", "0"]
    )  # fmt: skip
    assert (args.batch_sizes, args.rounds, args.seconds, args.clients) == ([1, 1024], 100, 600, 256)
    assert args.max_queue_delay_ms == 0.0
    defaults = serve_throughput.parse_args([])
    assert (defaults.batch_sizes, defaults.rounds, defaults.seconds) == ([1, 64], 2, 3.0)


def test_a_request_that_fails_in_transport_is_an_error_not_a_dead_thread():
    """Nothing listens: every attempt is refused. The client threads raised
    ConnectionRefusedError and ended, taking their counts along: 0 requests, 0 errors."""
    with socket.socket() as probe:  # a free port, closed again: connections are refused
        probe.bind(("127.0.0.1", 0))
        address = probe.getsockname()
    stats = serve_throughput.run_clients(
        address, serve_throughput._http_client, [(b"{}", "2")], 1, clients=2, seconds=0.2
    )
    assert stats.requests > 0 and stats.errors == stats.requests == len(stats.latencies)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rounds", "0"], "argument --rounds: expected an integer > 0, got 0"),
        (["--steps-per-round", "0"],
         "argument --steps-per-round: expected an integer > 0, got 0"),
        (["--test-batches", "0"], "argument --test-batches: expected an integer > 0, got 0"),
        (["--staleness", "0"], "argument --staleness: expected an integer > 0, got 0"),
        (["--warmup", "-1"], "argument --warmup: expected an integer >= 0, got -1"),
        (["--max-seconds", "inf"], "argument --max-seconds: expected a finite number, got 'inf'"),
        (["--batch-size", "65536"], "--batch-size x (--train-batches + --test-batches) is "
         "8,912,896 samples; at most 4,194,304"),
    ],
)  # fmt: skip
def test_train_throughput_refuses_runs_that_measure_nothing(argv, message, capsys):
    _refused(train_throughput.parse_args, argv, message, capsys)


def test_train_throughput_defaults_and_bounds():
    args = train_throughput.parse_args([])
    assert (args.batch_size, args.rounds, args.steps_per_round, args.warmup) == (1024, 10, 30, 3)
    assert (args.staleness, args.train_batches, args.test_batches, args.threads) == (10, 128, 8, 0)
    largest = train_throughput.parse_args(["--batch-size", "32768", "--train-batches", "120"])
    assert largest.batch_size * (largest.train_batches + largest.test_batches) == 1 << 22


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seconds", "0"], "argument --seconds: expected a number > 0, got '0'"),
        (["--seconds", "601"], "--seconds must be at most 600, got 601"),
        (["--torch-threads", "0"], "argument --torch-threads: expected an integer > 0, got 0"),
        (["--rounds", "0"], "--rounds must be in 1..100"),
    ],
)
def test_embedding_tier_refuses_runs_that_measure_nothing(argv, message, capsys):
    _refused(embedding_tier.parse_args, argv, message, capsys)
    args = embedding_tier.parse_args(["--seconds", "600"])
    assert (args.seconds, args.threads, args.rounds, args.torch_threads) == (600.0, 2, 3, 1)


def test_a_grpc_floor_call_does_not_pay_for_closing_the_channel(monkeypatch):
    """The aio measurement read the clock after asyncio.run() returned: closing the channel
    and the event loop's teardown counted as calls (the sync one stopped inside the channel,
    so the aio / sync ratio compared different things). Here the close takes 0.5 s."""
    import grpc

    real = grpc.aio.insecure_channel

    class SlowToClose:
        def __init__(self, channel: grpc.aio.Channel) -> None:
            self.channel = channel

        async def __aenter__(self) -> grpc.aio.Channel:
            return await self.channel.__aenter__()

        async def __aexit__(self, *exc: object) -> None:
            await asyncio.sleep(0.5)
            await self.channel.__aexit__(*exc)

    monkeypatch.setattr(grpc.aio, "insecure_channel", lambda *a, **k: SlowToClose(real(*a, **k)))
    row = grpc_floor.measure("aio", 1000, 10)
    assert (row["server"], row["calls"]) == ("aio", 10)
    assert row["wall_ms"] * 10 < 450  # 10 calls on loopback, without the 0.5 s close


@pytest.mark.parametrize("name", ["serve_throughput", "embedding_tier", "train_throughput",
                                  "grpc_floor"])  # fmt: skip
def test_sigterm_unwinds_a_benchmark_so_its_processes_are_stopped(name, monkeypatch):
    """Without a handler SIGTERM (``timeout``, a CI job's end) ended the script on the spot:
    no ``finally`` ran, and its server, cluster or gRPC servers lived on."""
    module = sys.modules[name]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def sigterm(*_args: object) -> None:  # what the script runs first, hit by SIGTERM
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler), handler  # SIG_DFL: the process ends, no finally runs
        handler(signal.SIGTERM, None)

    if name == "grpc_floor":  # main() reads sys.argv, then measures
        monkeypatch.setattr(sys, "argv", ["grpc_floor.py"])
        monkeypatch.setattr(module, "benchmark", sigterm)
    else:
        monkeypatch.setattr(module, "parse_args", sigterm)
    with pytest.raises(SystemExit) as caught:
        module.main() if name == "grpc_floor" else module.main([])
    assert caught.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_an_interrupted_server_start_kills_the_server(tmp_path, monkeypatch):
    """serve_throughput's caller holds no handle to the server until start_server returns:
    Ctrl-C while it loaded left it running."""
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen(command: list[str], **kwargs) -> subprocess.Popen:  # recserve serve, loading
        started.append(real_popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs))
        return started[-1]

    class Interrupted:
        def search(self, text: str) -> None:
            raise KeyboardInterrupt

    monkeypatch.setattr(serve_throughput.subprocess, "Popen", popen)
    monkeypatch.setattr(serve_throughput, "_SERVING_LINE", Interrupted())
    try:
        with pytest.raises(KeyboardInterrupt):
            serve_throughput.start_server(tmp_path, tmp_path / "serve.log", 1, 2.0)
        assert started[0].poll() == -signal.SIGKILL
    finally:
        if started and started[0].poll() is None:
            started[0].kill()
            started[0].wait(timeout=10)


# --------------------------------------------------------------------------- ratio arithmetic
def test_embedding_core_ratios_are_medians_of_same_round_ratios():
    import embedding_core

    # Per-round ratios 2, 1, 3: median 2. (Medians of each side would give 4 / 3.)
    assert embedding_core.median_ratio([2.0, 4.0, 9.0], [1.0, 4.0, 3.0]) == 2.0


def test_serve_throughput_reports_median_rps_and_pooled_latencies(capsys):
    import argparse
    import json

    def stats(rps: list[float], latencies_s: list[float], errors: int = 0, cpu=(0.0, 0.0)):
        return serve_throughput.Stats(
            requests=len(latencies_s), errors=errors, seconds=1.0, latencies=latencies_s,
            rps_per_round=rps, server_cpu=cpu[0], client_cpu=cpu[1],
        )  # fmt: skip

    results = {
        (1, "in-process"): stats([100.0, 300.0, 200.0], [0.001, 0.002, 0.003]),
        (1, "http"): stats(
            [50.0, 40.0, 90.0], [0.010, 0.020, 0.030, 0.040, 0.050], errors=1, cpu=(0.25, 0.1)
        ),
    }
    args = argparse.Namespace(seconds=3.0, rounds=3, clients=8, server_threads=1,
                              max_queue_delay_ms=2.0)  # fmt: skip
    serve_throughput.report(args, Path("/c"), results)
    document = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    base, http = document["results"]
    assert (base["rps"], base["rps_vs_in_process"], base["clients"]) == (200.0, 1.0, 1)
    assert (http["rps"], http["samples_per_s"], http["clients"], http["errors"]) == (
        50.0,
        50.0,
        8,
        1,
    )
    assert http["rps_vs_in_process"] == 0.25  # median 50 over median 200
    assert http["p50_ms"] == pytest.approx(30.0) and http["p99_ms"] == pytest.approx(49.6)
    assert http["p50_vs_in_process"] == pytest.approx(15.0)  # 30 ms over 2 ms
    # CPU per request pooled over the rounds: 0.25 s of the server, 0.1 s of the clients, 5
    # requests. The in-process baseline has no server.
    assert http["server_cpu_us_per_request"] == pytest.approx(50_000.0)
    assert http["client_cpu_us_per_request"] == pytest.approx(20_000.0)
    assert base["server_cpu_us_per_request"] is base["client_cpu_us_per_request"] is None


def test_embedding_tier_summary_rates_and_cpu_per_call():
    raw = {"calls": 50, "seconds": 2.0, "latencies": [0.01] * 49 + [0.11],
           "cpu": {"client": 0.5, "worker": 1.0}}  # fmt: skip
    summary = embedding_tier.summarize(raw, 64)
    assert summary["ids_per_s"] == 26 * 64 * 25 and summary["samples_per_s"] == 64 * 25
    assert summary["p50_ms"] == pytest.approx(10.0) and summary["p99_ms"] == pytest.approx(61.0)
    assert summary["cpu_ms_per_call"] == {"client": 10.0, "worker": 20.0}


def test_serve_throughput_reads_cpu_seconds_past_a_command_name_with_parentheses():
    """Fields 14 and 15 of /proc/PID/stat (utime, stime) in clock ticks: the command name,
    in parentheses, may hold ") " itself and must not shift the fields."""
    stat = "4242 (py) (x) 1) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 3 0"
    assert serve_throughput.cpu_seconds_of_stat(stat, 100) == 3.25
    assert serve_throughput.per_request_us(0.5, 1000) == 500.0
    assert serve_throughput.per_request_us(0.5, 0) != serve_throughput.per_request_us(0.5, 0)
