"""Command-line values are checked by argparse: one clear line and exit 2, never a traceback
or a value that fails later (wrapped ports, NaN or endless timeouts, zero loaders or rounds)."""

from __future__ import annotations

import argparse
import functools
import threading
from pathlib import Path

import pytest

from embedding_store.cli import build_parser
from embedding_store.cli_types import (
    MAX_FLOAT_VALUE,
    non_negative_float,
    positive_float,
)
from embedding_store.errors import InvalidArgumentError
from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The one-line argparse error of ``recserve ARGV`` (asserting exit code 2)."""
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(argv)
    assert caught.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# --------------------------------------------------------------------------- shared types
def test_float_types_refuse_values_beyond_a_sane_maximum() -> None:
    # Above threading.TIMEOUT_MAX (~9.2e9 s) an Event.wait raises OverflowError at runtime.
    assert MAX_FLOAT_VALUE == 1e6 < threading.TIMEOUT_MAX
    assert positive_float("1e6") == 1e6 and non_negative_float("1000000") == 1e6
    assert non_negative_float("0") == 0.0 and positive_float("0.25") == 0.25
    for parse in (positive_float, non_negative_float):
        for text, message in (
            ("1e300", "expected a number <= 1000000, got '1e300'"),
            ("1000000.5", "expected a number <= 1000000, got '1000000.5'"),
            ("nan", "expected a finite number, got 'nan'"),
            ("inf", "expected a finite number, got 'inf'"),
            ("-inf", "expected a finite number, got '-inf'"),
        ):
            with pytest.raises(argparse.ArgumentTypeError) as caught:
                parse(text)
            assert str(caught.value) == message


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["serve", "--watch-seconds", "1e300"],
            "recserve serve: error: argument --watch-seconds: expected a number <= 1000000, "
            "got '1e300'",
        ),
        (
            ["serve", "--grace-seconds", "1e300"],
            "recserve serve: error: argument --grace-seconds: expected a number <= 1000000, "
            "got '1e300'",
        ),
        (
            ["predict", "--timeout", "1e10"],
            "recserve predict: error: argument --timeout: expected a number <= 1000000, got '1e10'",
        ),
        (
            ["eval", "--data", "d.csv", "--out", "o.csv", "--timeout", "1e10"],
            "recserve eval: error: argument --timeout: expected a number <= 1000000, got '1e10'",
        ),
        (
            ["eval", "--data", "d.csv", "--out", "o.csv", "--timeout", "0"],
            "recserve eval: error: argument --timeout: expected a number > 0, got '0'",
        ),
    ],
)
def test_seconds_flags_refuse_overflowing_or_zero_values(capsys, argv, message) -> None:
    assert usage_error(capsys, argv) == message


# --------------------------------------------------------------------------- embedding worker
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("70000", "expected a port in 0..65535, got 70000"),  # used to wrap to 4464
        ("-5", "expected a port in 0..65535, got -5"),  # used to wrap to 65531
        ("x", "expected an integer, got 'x'"),
    ],
)
def test_embedding_worker_port_is_a_port_number(capsys, value, message) -> None:
    error = usage_error(capsys, ["embedding-worker", "--port", value])
    assert error == f"recserve embedding-worker: error: argument --port: {message}"
    assert build_parser().parse_args(["embedding-worker", "--port", "65535"]).port == 65535


@pytest.mark.parametrize("action", ["dump", "load"])
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("nan", "expected a finite number, got 'nan'"),
        ("inf", "expected a finite number, got 'inf'"),
        ("-1", "expected a number > 0, got '-1'"),
        ("0", "expected a number > 0, got '0'"),
    ],
)
def test_embedding_tier_timeout_is_positive_and_finite(capsys, action, value, message) -> None:
    argv = ["embedding-tier", action, "--worker", "h:1", "--timeout", value, "ckpt"]
    error = usage_error(capsys, argv)
    assert error == f"recserve embedding-tier {action}: error: argument --timeout: {message}"
    argv[5] = "2.5"
    assert build_parser().parse_args(argv).timeout == 2.5


# --------------------------------------------------------------------------- training
@pytest.mark.parametrize("value", ["0", "-2"])
def test_train_needs_at_least_one_data_loader(capsys, value) -> None:
    error = usage_error(capsys, ["train", "--entry", "t.py", "--num-data-loaders", value])
    assert error == (
        f"recserve train: error: argument --num-data-loaders: expected an integer > 0, got {value}"
    )


def test_streaming_dataset_refuses_fewer_than_one_loader(monkeypatch) -> None:
    from training.data import StreamingDataset
    from training.env import NUM_LOADERS_ENV

    for bad in (0, -1):
        with pytest.raises(InvalidArgumentError) as caught:
            StreamingDataset(port=0, num_loaders=bad)
        assert caught.value.message == (
            f"num_loaders must be >= 1 (the data loaders streaming batches), got {bad}"
        )
    with pytest.raises(InvalidArgumentError, match=r"^num_loaders must be an integer >= 1"):
        StreamingDataset(port=0, num_loaders=1.5)  # type: ignore[arg-type]
    monkeypatch.setenv(NUM_LOADERS_ENV, "0")
    with pytest.raises(InvalidArgumentError) as caught:
        StreamingDataset(port=0)
    assert caught.value.message == (
        f"{NUM_LOADERS_ENV} must be >= 1 (the data loaders streaming batches), got 0"
    )
    monkeypatch.setenv(NUM_LOADERS_ENV, "two")
    with pytest.raises(InvalidArgumentError) as caught:
        StreamingDataset(port=0)
    assert caught.value.message == f"{NUM_LOADERS_ENV} must be an integer >= 1, got 'two'"
    monkeypatch.setenv(NUM_LOADERS_ENV, "3")
    assert StreamingDataset(port=0).num_loaders == 3  # not started: nothing to close


# --------------------------------------------------------------------------- load tests
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seconds", "nan"], "argument --seconds: expected a finite number, got 'nan'"),
        (["--seconds", "inf"], "argument --seconds: expected a finite number, got 'inf'"),
        (
            ["--soak", "--minutes", "nan"],
            "argument --minutes: expected a finite number, got 'nan'",
        ),
        (["--spawn-rate", "nan"], "argument --spawn-rate: expected a finite number, got 'nan'"),
        (["--spawn-rate", "-1"], "--spawn-rate must be > 0 users per second, got -1.0"),
        (
            ["--unknown-share", "nan"],
            "argument --unknown-share: expected a finite number, got 'nan'",
        ),
        (
            ["--soak", "--rss-interval", "nan"],
            "argument --rss-interval: expected a finite number, got 'nan'",
        ),
    ],
)
def test_load_test_durations_must_be_finite_before_anything_starts(capsys, argv, message) -> None:
    from load_tests.run import parse_args

    with pytest.raises(SystemExit) as caught:
        parse_args(["--synthetic", *argv])
    assert caught.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")
    assert parse_args(["--synthetic", "--seconds", "2", "--spawn-rate", "4"]).seconds == 2.0


# --------------------------------------------------------------------------- benchmarks
@functools.cache
def _embedding_core_benchmark():
    return load_script(Path("benchmarks/embedding_core.py"), "embedding_core_benchmark")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rounds", "0"], "argument --rounds: expected an integer > 0, got 0"),
        (["--shards", "0"], "argument --shards: expected an integer > 0, got 0"),
        (["--shards", "-1"], "argument --shards: expected an integer > 0, got -1"),
        (["--seconds", "nan"], "argument --seconds: expected a finite number, got 'nan'"),
        (["--threads", "0"], "argument --threads: expected an integer > 0, got 0"),
    ],
)
def test_embedding_core_benchmark_refuses_empty_runs(capsys, argv, message) -> None:
    benchmark = _embedding_core_benchmark()
    with pytest.raises(SystemExit) as caught:
        benchmark.parse_args(argv)
    assert caught.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")
    args = benchmark.parse_args(["--rounds", "3", "--shards", "2"])
    assert (args.rounds, args.shards, args.seconds, args.threads) == (3, 2, 2.0, 1)


def test_parameter_server_flags_are_named_once_in_their_errors(capsys):
    from embedding_store.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["embedding-parameter-server", "--replica-index", ""])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --replica-index: expected an integer, got ''" in err  # not named twice


def test_launch_commands_refuse_what_torchrun_or_a_loader_would_fail_on(tmp_path, monkeypatch):
    """Refused before anything is started: NN workers on several nodes with no shared tier
    (each node would train its own embeddings), a replica index not below the replica
    size. os.execve stands in for the start."""
    import os

    from training.env import EMBEDDING_WORKERS_ENV

    entry = tmp_path / "entry.py"
    entry.write_text("")
    monkeypatch.delenv(EMBEDDING_WORKERS_ENV, raising=False)
    started: list[list[str]] = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: started.append(argv))
    parse = build_parser().parse_args

    def run(*argv: str) -> None:
        args = parse([argv[0], "--entry", str(entry), *argv[1:]])
        args.handler(args)

    with pytest.raises(SystemExit, match="more than one NN worker needs one shared embedding"):
        run("train", "--nnodes", "2", "--nproc-per-node", "1", "--master-port", "29501")
    with pytest.raises(SystemExit, match=r"--replica-index 2 must be in \[0, --replica-size 2\)"):
        run("data-loader", "--replica-index", "2", "--replica-size", "2")
    with pytest.raises(SystemExit, match=r"--node-rank 1 must be in \[0, --nnodes 1\)"):
        run("train", "--node-rank", "1")
    with pytest.raises(SystemExit, match=r"--node-rank -1 must be in \[0, --nnodes 2\)"):
        run("train", "--nnodes", "2", "--node-rank", "-1", "--embedding-workers", "h:1")
    assert started == []
    run("data-loader", "--replica-index", "1", "--replica-size", "2")
    run("train", "--nnodes", "2", "--master-port", "29501", "--embedding-workers", "h:1")
    assert [argv[-1] for argv in started] == [str(entry), str(entry)]


def _options_without_help(
    parser: argparse.ArgumentParser, path: tuple[str, ...]
) -> list[tuple[str, str]]:
    """(command path, flag) of every option, in every subcommand, that has no help text."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                missing += _options_without_help(subparser, (*path, name))
        elif action.option_strings and not action.help:
            missing.append((" ".join(path), action.option_strings[-1]))
    return missing


def test_every_option_of_every_command_says_what_it_does() -> None:
    """`recserve COMMAND --help` is the reference users read: a flag listed with no text
    (as --max-queue-delay-ms was, the batching delay that decides throughput) hides what it
    does, its unit and its default."""
    assert _options_without_help(build_parser(), ("recserve",)) == []


def test_serve_help_gives_the_batching_flags_units_and_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "how long the first request of a merged batch waits for others, in ms" in text
    assert "0 merges what arrives together (default 2;" in text
    assert "refused (503 / UNAVAILABLE);" in text
    assert "frees its place at once (default 1024)" in text
    assert "(504 / DEADLINE_EXCEEDED after it; default 10)" in text


def test_serve_help_says_a_client_timeout_replaces_request_timeout_either_way(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A client's timeout replaces --request-timeout, longer ones too (up to a day): the help
    said "unless its client asks for less", as if the flag capped what clients may ask for."""
    from types import SimpleNamespace

    from serving.service import PredictionService

    service = SimpleNamespace(
        _accepting=True, _check_name=lambda name, version: None, default_timeout=10.0
    )
    prepare = functools.partial(PredictionService._prepare, service, "m", None, lambda _: "b")
    assert prepare(None) == ("b", 10.0)
    assert prepare(2.5) == ("b", 2.5)
    assert prepare(30.0) == ("b", 30.0)  # longer than --request-timeout: used as is

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "asks for less" not in text
    assert "when its client sets no timeout of its own" in text
    assert "replaces it, shorter or longer" in text


# --------------------------------------------------------------------------- parameter server
CONFIGS = ROOT / "examples" / "configs"


def _run_parameter_server(monkeypatch, *argv: str) -> list:
    """``recserve embedding-parameter-server ARGV`` with the server stubbed: the options it
    would have run with."""
    started: list = []
    monkeypatch.setattr(
        "embedding_store.ps_process.serve_parameter_server",
        lambda _config, _global, options: started.append(options) or 0,
    )
    args = build_parser().parse_args(
        ["embedding-parameter-server", "--embedding-config", str(CONFIGS / "embedding_config.yml"),
         *argv]
    )  # fmt: skip
    assert args.handler(args) == 0
    return started


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--replica-index", "0", "--replica-size", "0", "--port", "0"],
            "argument --replica-size: expected an integer in 1..65536, got 0",
        ),
        (
            ["--replica-index", "-1", "--replica-size", "1", "--port", "0"],
            "argument --replica-index: expected an integer >= 0, got -1",
        ),
        (
            ["--replica-index", "0", "--replica-size", "1", "--port", "65536"],
            "argument --port: expected an integer in 0..65535, got 65536",
        ),
        (
            ["--replica-index", "0", "--replica-size", "1", "--port", "0", "--host", " "],
            "argument --host: expected a non-empty value",
        ),
        (
            ["--replica-index", "0", "--replica-size", "1", "--port", "0", "--dump-on-exit", "\t"],
            "argument --dump-on-exit: expected a non-empty value",
        ),
    ],
)
def test_parameter_server_flag_values_are_checked(capsys, argv, message) -> None:
    error = usage_error(capsys, ["embedding-parameter-server", *argv])
    assert error == f"recserve embedding-parameter-server: error: {message}"


def test_parameter_server_flags_that_cannot_work_together_are_refused(monkeypatch, capsys):
    for argv, message in (
        (
            ["--replica-index", "2", "--replica-size", "2", "--port", "0"],
            "--replica-index must be < --replica-size: got --replica-index 2 with "
            "--replica-size 2",
        ),
        (
            ["--replica-index", "0", "--replica-size", "1", "--port", "7000",
             "--metrics-port", "7000"],
            "--metrics-port must differ from --port, both are 7000",
        ),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exited:
            _run_parameter_server(monkeypatch, *argv)
        assert exited.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")
    from embedding_store.ps_process import ParameterServerOptions

    (options,) = _run_parameter_server(
        monkeypatch, "--replica-index", "1", "--replica-size", "2", "--port", "0",
        "--metrics-port", "0", "--grace-seconds", "0.5", "--host", "0.0.0.0",
        "--dump-on-exit", "dumps", "--load-checkpoint", "ckpt",
    )  # fmt: skip
    assert options == ParameterServerOptions(
        replica_index=1, replica_size=2, host="0.0.0.0", port=0, metrics_port=0,
        dump_on_exit="dumps", load_checkpoint="ckpt", grace_seconds=0.5,
    )  # fmt: skip
    (options,) = _run_parameter_server(
        monkeypatch, "--replica-index", "0", "--replica-size", "1", "--port", "65535"
    )
    assert (options.port, options.metrics_port) == (65535, None)


# --------------------------------------------------------------------------- embedding worker
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("h:0", "'h:0' is not HOST:PORT"),
        (":7000", "':7000' is not HOST:PORT"),
        ("h:1,h:65536", "'h:65536' is not HOST:PORT"),
        (" , ", "give at least one HOST:PORT"),
    ],
)
def test_embedding_worker_shards_are_host_port_addresses(capsys, value, message) -> None:
    error = usage_error(capsys, ["embedding-worker", "--ps", value])
    assert error == f"recserve embedding-worker: error: argument --ps: {message}"


def _run_embedding_worker(monkeypatch, *argv: str) -> list[dict]:
    started: list[dict] = []

    def serve(_config, shards, **options) -> int:
        started.append({"shards": shards, **options})
        return 0

    monkeypatch.setattr("embedding_store.worker_service.serve_embedding_worker", serve)
    args = build_parser().parse_args(
        ["embedding-worker", "--embedding-config", str(CONFIGS / "embedding_config.yml"), *argv]
    )
    assert args.handler(args) == 0
    return started


def test_embedding_worker_metrics_port_must_differ_from_its_port(monkeypatch) -> None:
    with pytest.raises(SystemExit, match="--metrics-port must differ from --port, both are 7"):
        _run_embedding_worker(monkeypatch, "--ps", "h:1", "--port", "7", "--metrics-port", "7")
    (started,) = _run_embedding_worker(
        monkeypatch, "--ps", "a:1, b:2", "--port", "0", "--metrics-port", "0"
    )
    assert started["shards"] == ["a:1", "b:2"]
    assert (started["port"], started["metrics_port"]) == (0, 0)


def _global_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "global_config.yml"
    path.write_text(text)
    return str(path)


def test_embedding_worker_runs_with_its_flags_and_the_global_config(monkeypatch, tmp_path):
    """--ps, else infer_config.servers; metrics only when the global config enables them;
    the forward buffer from embedding_worker_config."""
    config = _global_config(
        tmp_path,
        "common_config:\n  infer_config:\n    servers: [ps-0:7000, ps-1:7000]\n"
        "embedding_worker_config:\n  forward_buffer_size: 7\n",
    )
    (started,) = _run_embedding_worker(
        monkeypatch, "--global-config", config, "--host", "0.0.0.0", "--port", "9",
        "--metrics-port", "10", "--shard-timeout", "2", "--startup-timeout", "3",
        "--grace-seconds", "4",
    )  # fmt: skip
    assert started == {
        "shards": ["ps-0:7000", "ps-1:7000"], "host": "0.0.0.0", "port": 9, "metrics_port": 10,
        "forward_buffer_size": 7, "shard_timeout": 2.0, "startup_timeout": 3.0,
        "grace_seconds": 4.0,
    }  # fmt: skip
    no_metrics = _global_config(
        tmp_path, "common_config:\n  metrics_config:\n    enable_metrics: false\n"
    )
    (started,) = _run_embedding_worker(
        monkeypatch, "--global-config", no_metrics, "--ps", "h:1", "--metrics-port", "10"
    )
    assert (started["shards"], started["metrics_port"]) == (["h:1"], None)
    with pytest.raises(SystemExit, match="no shards: pass --ps HOST:PORT"):
        _run_embedding_worker(monkeypatch, "--global-config", no_metrics)


def test_embedding_tier_progress_bar(capsys) -> None:
    from embedding_store.worker_command import _progress_bar

    _progress_bar("dump", 1, 3)
    _progress_bar("dump", 3, 3)
    _progress_bar("load", 0, 0)  # an empty tier: complete at once, no division by zero
    assert capsys.readouterr().err == (
        f"\r dump [{'#' * 10}{'.' * 20}] 1/3\r dump [{'#' * 30}] 3/3\n\r load [{'.' * 30}] 0/0\n"
    )


def test_embedding_tier_status_exits_1_when_a_shard_did_not_answer(monkeypatch, capsys):
    """A script checking the tier sees that it is not whole from the exit code."""
    from embedding_store.tier import TierStatus

    answers = {
        "whole": ("",),
        "partial": ("parameter server a:1: refused",),
    }

    deadlines: list[tuple[float, float]] = []

    class FakeWorker:
        def __init__(self, address, _config, timeout, admin_timeout) -> None:
            self.address = address
            deadlines.append((timeout, admin_timeout))

        def __enter__(self):
            return self

        def __exit__(self, *_exc) -> None:
            """Nothing to close: no channel was opened."""

        def status(self, partial: bool) -> TierStatus:
            assert partial
            return TierStatus(
                (5,), (10,), 0, 0, 0, ("",), (0.0,), shard_errors=answers[self.address]
            )

    monkeypatch.setattr("embedding_store.worker_client.RemoteEmbeddingWorker", FakeWorker)
    parse = build_parser().parse_args
    for worker, code in (("whole", 0), ("partial", 1)):
        args = parse(["embedding-tier", "status", "--worker", worker])
        assert args.handler(args) == code
    assert capsys.readouterr().out.splitlines()[::3] == [
        "shard 0: 5 rows of 10, idle, checkpoint none",
        "shard 0: NO ANSWER: parameter server a:1: refused",
    ]
    # --timeout bounds the status call itself (it took the client's 30 s whatever it said).
    args = parse(["embedding-tier", "status", "--worker", "whole", "--timeout", "3"])
    assert args.handler(args) == 0
    assert deadlines == [(30.0, 30.0), (30.0, 30.0), (3.0, 3.0)]


# --------------------------------------------------------------------------- recserve main
def _main_with_handler(monkeypatch, handler) -> int:
    """``recserve fake`` whose handler is ``handler``."""
    from embedding_store import cli

    def parser_with_fake() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog="recserve")
        parser.add_argument("--log-level", default="INFO")
        commands = parser.add_subparsers(dest="command")
        commands.add_parser("fake").set_defaults(handler=handler)
        return parser

    monkeypatch.setattr(cli, "build_parser", parser_with_fake)
    return cli.main(["fake"])


def test_recserve_turns_errors_into_one_line_and_an_exit_code(monkeypatch, capsys) -> None:
    def raise_(error: BaseException):
        def handler(_args):
            raise error

        return handler

    assert _main_with_handler(monkeypatch, raise_(InvalidArgumentError("bad value"))) == 1
    assert capsys.readouterr().err == "recserve fake: error: bad value\n"
    assert _main_with_handler(monkeypatch, raise_(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == ""  # Ctrl-C: no traceback, no error line
    missing = FileNotFoundError(2, "No such file or directory", "runs/x.yml")
    assert _main_with_handler(monkeypatch, raise_(missing)) == 1
    assert capsys.readouterr().err == (
        "recserve fake: error: No such file or directory: runs/x.yml\n"
    )
    assert _main_with_handler(monkeypatch, lambda _args: 3) == 3
    assert _main_with_handler(monkeypatch, lambda _args: None) == 0
    assert capsys.readouterr().err == ""


def test_recserve_without_a_command_prints_help_and_exits_2(capsys) -> None:
    from embedding_store.cli import main

    assert main([]) == 2
    assert capsys.readouterr().out.startswith("usage: recserve")


@pytest.mark.parametrize("command", ["train", "data-loader --replica-index 0 --replica-size 1"])
def test_script_arguments_before_the_separator_get_a_hint(capsys, command) -> None:
    from embedding_store.cli import main

    with pytest.raises(SystemExit) as exited:
        main([*command.split(), "--entry", "t.py", "--epochs", "3"])
    assert exited.value.code == 2
    name = command.split()[0]
    # "3" went to the script's arguments: the hint puts the two back together.
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "recserve: error: unrecognized arguments: --epochs (arguments for the --entry script "
        f"go after --: recserve {name} --entry SCRIPT -- --epochs 3)"
    )


# --------------------------------------------------------------------------- launch commands
@pytest.fixture
def launches(tmp_path, monkeypatch) -> tuple[Path, list[tuple[list[str], dict[str, str]]]]:
    """(an entry script, the (argv, environment) of every os.execve: none really starts)."""
    import os

    from training import env as training_env

    for name in (
        training_env.EMBEDDING_WORKERS_ENV, training_env.NUM_LOADERS_ENV,
        training_env.NN_WORKERS_ENV, "RECSERVE_EMBEDDING_CONFIG", "RECSERVE_GLOBAL_CONFIG",
    ):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    entry = tmp_path / "entry.py"
    entry.write_text("")
    started: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: started.append((argv, env)))
    return entry, started


def _launch(*argv: str) -> None:
    args = build_parser().parse_args(list(argv))
    args.handler(args)


def test_train_on_one_node_runs_torchrun_standalone(launches, monkeypatch) -> None:
    import sys

    monkeypatch.chdir(launches[0].parent)
    entry, started = launches
    (entry.parent / "e.yml").write_text("")  # what it holds is the script's to read
    _launch(
        "train", "--entry", str(entry), "--embedding-config", "e.yml", "--num-data-loaders", "3",
        "--nn-worker-addresses", "a:1", "--", "--epochs", "2", "--",
    )  # fmt: skip
    ((argv, env),) = started
    assert argv == [
        sys.executable, "-m", "training.torchrun", "--standalone", "--nproc-per-node=1",
        "--shutdown-timeout=30", str(entry), "--epochs", "2", "--",
    ]  # fmt: skip
    assert env["RECSERVE_EMBEDDING_CONFIG"] == str(entry.parent / "e.yml")  # absolute
    assert env["RECSERVE_NUM_DATA_LOADERS"] == "3"
    assert env["RECSERVE_NN_WORKER_ADDRESSES"] == "a:1"
    assert "RECSERVE_EMBEDDING_WORKERS" not in env and "RECSERVE_GLOBAL_CONFIG" not in env


def test_train_on_several_nodes_names_the_rendezvous(launches) -> None:
    entry, started = launches
    _launch(
        "train", "--entry", str(entry), "--nnodes", "3", "--node-rank", "2",
        "--master-addr", "10.0.0.1", "--nproc-per-node", "2", "--embedding-workers", "w:1",
        "--shutdown-timeout", "600",
    )  # fmt: skip
    _launch("train", "--entry", str(entry), "--master-port", "29600")  # one node, fixed port
    (first, env), (second, _env) = started
    assert first[3:] == [
        "--nnodes=3", "--node-rank=2", "--master-addr=10.0.0.1", "--master-port=29500",
        "--nproc-per-node=2", "--shutdown-timeout=600", str(entry),
    ]  # fmt: skip
    assert env["RECSERVE_EMBEDDING_WORKERS"] == "w:1"
    assert second[3:] == [
        "--nnodes=1", "--node-rank=0", "--master-addr=127.0.0.1", "--master-port=29600",
        "--nproc-per-node=1", "--shutdown-timeout=30", str(entry),
    ]  # fmt: skip


def test_train_refuses_what_torchrun_cannot_run(launches, capsys) -> None:
    entry, started = launches
    for argv, message in (
        (["--nproc-per-node", "0"], "--nproc-per-node and --nnodes must be >= 1"),
        (["--nnodes", "0"], "--nproc-per-node and --nnodes must be >= 1"),
    ):
        with pytest.raises(SystemExit, match=message):
            _launch("train", "--entry", str(entry), *argv)
    with pytest.raises(SystemExit, match=f"--entry {entry.parent} is not a file"):
        _launch("train", "--entry", str(entry.parent))
    # A mistyped config path: each rank's script failed with a traceback once started.
    for command in (["train"], ["data-loader", "--replica-index", "0", "--replica-size", "1"]):
        for flag in ("--embedding-config", "--global-config"):
            with pytest.raises(SystemExit) as refused:
                _launch(*command, "--entry", str(entry), flag, "embedding_config.ym")
            assert refused.value.code == (
                f"recserve {command[0]}: error: {flag} embedding_config.ym is not a file"
            )
    assert started == []
    for port in ("0", "65536", "-3"):
        error = usage_error(capsys, ["train", "--entry", str(entry), "--master-port", port])
        assert error == (
            f"recserve train: error: argument --master-port: expected a port in 1..65535, "
            f"got {port}"
        )
    error = usage_error(capsys, ["train", "--entry", str(entry), "--shutdown-timeout", "-1"])
    assert error == (
        "recserve train: error: argument --shutdown-timeout: expected an integer >= 0, got -1"
    )
    assert started == []


def test_train_wants_one_nn_worker_address_per_rank(launches) -> None:
    """Rank r listens on entry r and loaders deal batches over every entry: 1 entry for 2
    ranks had both bind one port, 3 for 2 had loaders wait 600 s for a third receiver."""
    entry, started = launches
    for addresses, argv, count, ranks, shape in (
        ("a:1", ["--nproc-per-node", "2"], 1, 2, "--nproc-per-node 2 x --nnodes 1"),
        ("a:1,b:1,c:1", ["--nproc-per-node", "2", "--nnodes", "1"], 3, 2,
         "--nproc-per-node 2 x --nnodes 1"),
        ("a:1,b:1", ["--nnodes", "3", "--node-rank", "1"], 2, 3, "--nproc-per-node 1 x --nnodes 3"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as refused:
            _launch(
                "train", "--entry", str(entry), "--embedding-workers", "w:1",
                "--nn-worker-addresses", addresses, *argv,
            )  # fmt: skip
        assert refused.value.code == (
            f"recserve train: error: --nn-worker-addresses lists {count} address(es) for "
            f"{ranks} NN worker(s) ({shape}): give one per NN worker, in rank order"
        )
    assert started == []
    _launch(
        "train", "--entry", str(entry), "--embedding-workers", "w:1", "--nproc-per-node", "2",
        "--nn-worker-addresses", "a:1, b:1",
    )  # fmt: skip
    assert started[0][1]["RECSERVE_NN_WORKER_ADDRESSES"] == "a:1, b:1"


def test_a_data_loader_learns_its_replica_index_and_size(launches) -> None:
    import sys

    entry, started = launches
    _launch(
        "data-loader", "--entry", str(entry), "--replica-index", "1", "--replica-size", "3",
        "--", "--rows", "10",
    )  # fmt: skip
    ((argv, env),) = started
    assert argv == [sys.executable, str(entry), "--rows", "10"]
    assert (env["RECSERVE_REPLICA_INDEX"], env["RECSERVE_REPLICA_SIZE"]) == ("1", "3")
    with pytest.raises(SystemExit, match=r"--replica-index -1 must be in \[0, --replica-size 3\)"):
        _launch(
            "data-loader", "--entry", str(entry), "--replica-index", "-1", "--replica-size", "3"
        )
    assert len(started) == 1


@pytest.mark.parametrize(
    ("argv", "last_line"),
    [
        # A typo in a required flag: argparse names the required one and not the typo.
        (["serve", "--chekpoint", "runs/click"],
         "recserve serve: error: the following arguments are required: --checkpoint "
         "(--chekpoint: did you mean --checkpoint?)"),
        (["serve", "--checkpoint", "runs/click", "--http-prot", "8000"],
         "recserve: error: unrecognized arguments: --http-prot 8000 "
         "(--http-prot: did you mean --http-port?)"),
        (["checkpoint", "inspect", "runs/click", "--jsn"],
         "recserve: error: unrecognized arguments: --jsn (--jsn: did you mean --json?)"),
        (["serve", "--checkpoint", "runs/click", "--max-batch-sise=3", "--no-such-thing"],
         "recserve: error: unrecognized arguments: --max-batch-sise=3 --no-such-thing "
         "(--max-batch-sise: did you mean --max-batch-size?)"),
    ],
)  # fmt: skip
def test_a_mistyped_flag_gets_the_flag_it_is_close_to(capsys, argv, last_line) -> None:
    from embedding_store.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == last_line


@pytest.mark.parametrize(
    ("argv", "flag", "value"),
    [
        (["embedding-tier", "status", "--worker"], "--worker", "http://127.0.0.1:7201"),
        (["embedding-worker", "--ps"], "--ps", "127.0.0.1:7101,grpc://127.0.0.1:7102/"),
        (["train", "--entry", "t.py", "--embedding-workers"], "--embedding-workers",
         "https://127.0.0.1:7201"),
    ],
)  # fmt: skip
def test_tier_addresses_given_as_urls_say_so(capsys, argv, flag, value) -> None:
    """gRPC took `--worker http://127.0.0.1:7201` for a host name: "errors resolving
    http://127.0.0.1:7201: ... Misformatted domain name"."""
    url = value.split(",")[-1]
    scheme, _, rest = url.partition("://")
    message = f"{url!r} is a URL: give HOST:PORT, without {scheme}:// (e.g. {rest.rstrip('/')})"
    error = usage_error(capsys, [*argv, value])
    assert error.endswith(f"error: argument {flag}: {message}"), error


def test_serve_tier_addresses_given_as_urls_say_so() -> None:
    from serving.commands import check_arguments

    for flag in ("--embedding-workers", "--embedding-ps"):
        args = build_parser().parse_args(["serve", "--checkpoint", "c", flag, "http://h:7100"])
        assert check_arguments(args) == (
            f"{flag}: 'http://h:7100' is a URL: give HOST:PORT, without http:// (e.g. h:7100)"
        )
    # gRPC's own target URIs are no URLs of a prediction server: they pass.
    args = build_parser().parse_args(
        ["train", "--entry", "t.py", "--embedding-workers", "dns:///h:1"]
    )
    assert args.embedding_workers == "dns:///h:1"


def test_a_stopped_run_names_the_ranks_its_grace_period_cut_off(capsys) -> None:
    """Ranks still running when --shutdown-timeout ran out were SIGKILLed: the launcher's line
    says which and that the checkpoint they wrote was not published; ranks that all exited 0
    before the signal came to them completed the run (exit 0)."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from training import torchrun

    stop = SignalException("got SIGTERM", signal.SIGTERM)
    argv = ["--standalone", "--nproc-per-node=3", "--shutdown-timeout=45", "t.py", "--x=1"]
    grace = torchrun._shutdown_timeout(argv)
    assert (grace, torchrun._shutdown_timeout(["t.py", "--shutdown-timeout=5"])) == ("45", "30")
    assert torchrun._stopped(stop, {0: 143, 1: -signal.SIGKILL, 2: None}, grace) == 143
    assert capsys.readouterr().err == (
        "recserve train: stopped by SIGTERM; rank(s) 1, 2 had not stopped 45 s after it "
        "(--shutdown-timeout) and were killed: a checkpoint they were writing was not "
        "published (the previous one is intact)\n"
    )
    assert torchrun._stopped(stop, {0: 143, 1: -signal.SIGTERM}, grace) == 143
    assert capsys.readouterr().err == "recserve train: stopped by SIGTERM\n"
    assert torchrun._stopped(stop, {0: 0, 1: 0}, grace) == 0
    assert "the run completed" in capsys.readouterr().err
    assert torchrun._stopped(stop, {}, grace) == 143  # no rank had started
