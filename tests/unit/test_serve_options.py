"""``recserve serve`` options: where the admin token comes from, and what worker processes
are started with."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from embedding_store.errors import InvalidArgumentError, UnavailableError
from serving import commands
from serving.options import ServeOptions
from serving.processes import options_to_argv


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())
    return parser.parse_args(["serve", "--checkpoint", "ckpt", *argv])


def test_the_admin_token_comes_from_the_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("RECSERVE_ADMIN_TOKEN", raising=False)
    assert commands._admin_token(_parse()) is None
    monkeypatch.setenv("RECSERVE_ADMIN_TOKEN", "from-env")
    assert commands._admin_token(_parse()) == "from-env"
    secret = tmp_path / "token"
    secret.write_text("from-file\n")  # as a mounted Secret often ends
    assert commands._admin_token(_parse("--admin-token-file", str(secret))) == "from-file"
    assert commands._admin_token(_parse("--admin-token", "from-flag")) == "from-flag"
    secret.write_text("  \n")
    with pytest.raises(
        InvalidArgumentError, match=rf"--admin-token-file {secret}: the token is empty"
    ):
        commands._admin_token(_parse("--admin-token-file", str(secret)))
    secret.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(
        InvalidArgumentError, match=rf"--admin-token-file {secret}: not valid UTF-8"
    ):
        commands._admin_token(_parse("--admin-token-file", str(secret)))
    secret.write_text("Pa55:w0rd!#2024\n")  # any visible ASCII works in the header
    assert commands._admin_token(_parse("--admin-token-file", str(secret))) == "Pa55:w0rd!#2024"
    secret.write_text("two words\n")
    with pytest.raises(InvalidArgumentError, match="cannot carry"):
        commands._admin_token(_parse("--admin-token-file", str(secret)))
    monkeypatch.setenv("RECSERVE_ADMIN_TOKEN", "tab\tinside")
    with pytest.raises(InvalidArgumentError, match="RECSERVE_ADMIN_TOKEN variable: the token"):
        commands._admin_token(_parse())
    missing = tmp_path / "missing"
    with pytest.raises(InvalidArgumentError, match=rf"--admin-token-file {missing}: No such"):
        commands._admin_token(_parse("--admin-token-file", str(missing)))
    with pytest.raises(SystemExit):  # not both
        _parse("--admin-token", "a", "--admin-token-file", str(secret))


def test_worker_processes_get_every_option_but_the_token_on_their_command_line():
    argv = options_to_argv(ServeOptions(checkpoint="ckpt", admin_token="s3cr3t", workers=1))
    assert "s3cr3t" not in argv and "--admin-token" not in argv
    assert argv[:2] == ["serve", "--checkpoint=ckpt"]


def test_the_admin_token_stays_out_of_the_options_repr():
    options = ServeOptions(checkpoint="ckpt", admin_token="s3cr3t")
    assert "s3cr3t" not in repr(options) and "admin_token" not in repr(options)
    assert options.admin_token == "s3cr3t"


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--admin-token", ""], "--admin-token is empty: an empty bearer token would let any"),
        (["--admin-token", " padded"], "--admin-token has characters an Authorization header"),
        (["--admin-token", "caf\u00e9"], "--admin-token has characters an Authorization header"),
        (["--model-name", ""], "--model-name '': a model name is 1 to 255 characters"),
        (["--model-name", "a/b"], "--model-name 'a/b': a model name"),
        (["--model-name", "two words"], "--model-name 'two words': a model name"),
        (["--http-port", "9000", "--grpc-port", "9000"], "--http-port and --grpc-port are both"),
        (
            ["--max-queue-delay-ms", "12000", "--request-timeout", "2"],
            "--max-queue-delay-ms 12000 is not below --request-timeout 2 s",
        ),
        (["--max-body-bytes", "3000000000"], "--max-body-bytes 3000000000: at most 2147483647"),
        (["--threads", "99999999999"], "--threads 99999999999: at most 1024"),
        (
            ["--embedding-workers", "127.0.0.1:7000,not an address!!"],
            "--embedding-workers: 'not an address!!' is not HOST:PORT",
        ),
        (
            ["--embedding-workers", "127.0.0.1:7000,127.0.0.1:7001"],
            "--embedding-workers lists 2 addresses: a server talks to one embedding worker",
        ),
        (
            ["--embedding-workers", "127.0.0.1:7000", "--embedding-ps", "127.0.0.1:7100"],
            "--embedding-workers and --embedding-ps both given",
        ),
        (["--embedding-ps", "127.0.0.1:0"], "--embedding-ps: '127.0.0.1:0' is not HOST:PORT"),
        (["--embedding-ps", "h:65536"], "--embedding-ps: 'h:65536' is not HOST:PORT"),
        (["--model-name", "."], "--model-name '.': a model name"),
        (["--model-name", ".."], "--model-name '..': a model name"),
        (
            ["--max-queue-delay-ms", "2000", "--request-timeout", "2"],
            "--max-queue-delay-ms 2000 is not below --request-timeout 2 s",
        ),
        (["--threads", "1025"], "--threads 1025: at most 1024"),
        (["--model-name", "nul\x00"], "--model-name 'nul\\x00': a model name is 1 to 255"),
        (["--model-name", "bell\x07"], "--model-name 'bell\\x07': a model name is 1 to 255"),
        (["--model-name", "del\x7f"], "--model-name 'del\\x7f': a model name is 1 to 255"),
        (["--model-name", "m" * 256], f"--model-name '{'m' * 256}': a model name is 1 to 255"),
        (
            ["--max-decompressed-bytes", "2147483648"],
            "--max-decompressed-bytes 2147483648: at most 2147483647",
        ),
        (["--embedding-workers", ":7000"], "--embedding-workers: ':7000' is not HOST:PORT"),
        (["--workers", "257"], "--workers 257: at most 256 (each process loads the model)"),
        (["--watch-seconds", "1e-9"], "--watch-seconds 1e-09: 0 (off) or at least 0.1 s"),
        (["--watch-seconds", "0.09"], "--watch-seconds 0.09: 0 (off) or at least 0.1 s"),
        (
            ["--reload-root", "/nonexistent/recserve-root"],
            "--reload-root /nonexistent/recserve-root: no such directory",
        ),
        (["--max-connections", "1048577"], "--max-connections 1048577: at most 1048576"),
        (
            ["--max-concurrent-rpcs", "2147483648"],
            "--max-concurrent-rpcs 2147483648: at most 2147483647",
        ),
        (
            ["--max-body-bytes", "1000", "--max-body-bytes-in-flight", "999"],
            "--max-body-bytes-in-flight 999 is below --max-body-bytes 1000: the largest",
        ),
        (
            ["--max-body-bytes-in-flight", "67108863"],
            "--max-body-bytes-in-flight 67108863 is below --max-body-bytes 67108864",
        ),
    ],
)
def test_arguments_that_cannot_work_together_are_refused_before_anything_starts(argv, problem):
    found = commands.check_arguments(_parse(*argv))
    assert found is not None and found.startswith(problem), found


def test_sensible_arguments_pass_the_checks():
    args = _parse(
        "--model-name", "adult-income_v2.1", "--http-port", "0", "--grpc-port", "0",
        "--embedding-ps", "ps-0.ps:7000,ps-1.ps:7000", "--admin-token", "abc-DEF_123.~+/==:!#$",
        "--max-queue-delay-ms", "1", "--request-timeout", "0.5",
    )  # fmt: skip
    assert commands.check_arguments(args) is None


def test_arguments_at_their_limits_pass_the_checks():
    args = _parse(
        "--model-name", "...", "--embedding-workers", "w:65535", "--threads", "1024",
        "--max-queue-delay-ms", "1999", "--request-timeout", "2",
        "--max-body-bytes", "2147483647", "--max-decompressed-bytes", "2147483647",
        "--workers", "256", "--watch-seconds", "0.1", "--reload-root", "/",
    )  # fmt: skip
    assert commands.check_arguments(args) is None
    assert commands.check_arguments(_parse("--watch-seconds", "0")) is None
    assert commands.check_arguments(_parse("--model-name", "m" * 255)) is None
    capped = _parse(
        "--max-connections", "1048576", "--max-concurrent-rpcs", "2147483647",
        "--max-body-bytes", "1000", "--max-body-bytes-in-flight", "1000",
    )  # fmt: skip
    assert commands.check_arguments(capped) is None


@pytest.mark.parametrize("flag", ["--max-connections", "--max-concurrent-rpcs",
                                  "--max-body-bytes-in-flight"])  # fmt: skip
@pytest.mark.parametrize("value", ["0", "-1", "many"])
def test_the_caps_take_positive_integers_only(flag, value, capsys):
    with pytest.raises(SystemExit):
        _parse(flag, value)
    assert f"argument {flag}:" in capsys.readouterr().err


def test_the_caps_default_to_the_queue_size_and_four_largest_bodies_and_reach_workers():
    args = _parse()
    assert (args.max_connections, args.max_concurrent_rpcs) == (1024, 1024)
    assert args.max_body_bytes_in_flight is None
    assert ServeOptions(checkpoint=Path("c")).body_bytes_in_flight() == 4 * 64 * 1024 * 1024
    assert ServeOptions(checkpoint=Path("c"), max_body_bytes=10).body_bytes_in_flight() == 40
    options = ServeOptions(
        checkpoint=Path("c"), max_connections=3, max_concurrent_rpcs=5, max_body_bytes_in_flight=7
    )
    argv = options_to_argv(options)
    assert {"--max-connections=3", "--max-concurrent-rpcs=5", "--max-body-bytes-in-flight=7"} <= (
        set(argv)
    )
    again = _parse(*argv[2:])  # without "serve --checkpoint=c"
    assert (again.max_connections, again.max_concurrent_rpcs) == (3, 5)
    assert again.max_body_bytes_in_flight == 7
    assert "--max-body-bytes-in-flight" not in " ".join(options_to_argv(ServeOptions(Path("c"))))


@pytest.mark.parametrize(
    ("tiers", "problem"),
    [
        ({"embedding_workers": ["a:1", "b:2"]}, "embedding_workers lists 2 addresses"),
        ({"embedding_workers": ["a:1"], "embedding_ps": ["b:2"]}, "not both"),
    ],
)
def test_load_model_refuses_tiers_it_cannot_use(tiers, problem):
    """The Python API checks what the CLI does: the second address was silently unused."""
    from serving.model import load_model

    with pytest.raises(InvalidArgumentError, match=problem):
        load_model("no-such-checkpoint", name="model", **tiers)


def test_a_reserved_port_admits_only_the_server_processes():
    """``--workers``: the parent holds each port from before its processes start until they
    end. They bind with SO_REUSEPORT and listen; any other server, even a second
    ``--workers`` one whose own reservation would come next, is refused."""
    import socket

    from serving.processes import _reserve_port

    def server_process_listener(port: int) -> socket.socket:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        return listener

    with _reserve_port("127.0.0.1", 0, "HTTP") as reservation:
        port = reservation.getsockname()[1]
        assert port > 0
        with socket.socket() as plain_server, pytest.raises(OSError, match="in use"):
            plain_server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            plain_server.bind(("127.0.0.1", port))
        with pytest.raises(UnavailableError, match=f"cannot listen for gRPC on 127.0.0.1:{port}"):
            _reserve_port("127.0.0.1", port, "gRPC")  # a second --workers server
        with server_process_listener(port) as first, server_process_listener(port) as second:
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass  # answered by one of the listeners, never by the reservation
            assert {first.getsockname()[1], second.getsockname()[1]} == {port}


def test_the_admin_token_variable_is_stripped_and_blank_means_none(monkeypatch):
    """A token set with a trailing newline (``$(cat file)``, a Secret) is the token without
    it; a variable holding only whitespace gives no token (loopback-only reloads)."""
    monkeypatch.setenv("RECSERVE_ADMIN_TOKEN", "  t0ken\n")
    assert commands._admin_token(_parse()) == "t0ken"
    monkeypatch.setenv("RECSERVE_ADMIN_TOKEN", " \n")
    assert commands._admin_token(_parse()) is None


def _serve_and_capture(monkeypatch, argv: list[str]) -> tuple[str, ServeOptions]:
    """Run ``recserve serve ARGV``'s handler with the server stubbed out: (which entry point
    it called, the options it passed)."""
    from embedding_store.cli import build_parser

    called: list[tuple[str, ServeOptions]] = []
    monkeypatch.setattr(
        "serving.server.serve", lambda options: called.append(("serve", options)) or 0
    )
    monkeypatch.setattr(
        "serving.processes.serve_processes",
        lambda options: called.append(("serve_processes", options)) or 0,
    )
    args = build_parser().parse_args(argv)
    assert args.handler(args) == 0
    assert len(called) == 1
    return called[0]


def test_worker_processes_are_started_with_exactly_the_supervisors_options(monkeypatch, tmp_path):
    """options_to_argv must reproduce every option: what a server process parses from its
    command line (and its token from the environment) equals what the supervisor had."""
    monkeypatch.setenv("RECSERVE_ADMIN_TOKEN", "s3cr3t")
    options = ServeOptions(
        checkpoint=Path("runs/ckpt"), model_name="adult", host="::1", http_port=9100,
        grpc_port=9101, embedding_ps=("ps-0:7000", "ps-1:7000"), max_batch_size=64,
        max_request_batch_size=128, max_queue_delay_ms=0.5, max_queue_size=9,
        request_timeout=3.5, lookup_timeout=1.5, startup_timeout=7.0,
        fallback_policy="default", output_transform="sigmoid", onednn_min_rows=0,
        max_body_bytes=1000, max_decompressed_bytes=2000, read_timeout_seconds=4.0,
        watch_seconds=0.25, admin_token="s3cr3t", reload_root=tmp_path, grace_seconds=0.0,
        threads=3, preprocessor="pkg.mod:fn", workers=1, reuse_port=True, supervisor_pid=4321,
    )  # fmt: skip
    assert _serve_and_capture(monkeypatch, options_to_argv(options)) == ("serve", options)
    workers = ServeOptions(
        checkpoint=Path("ckpt"), embedding_workers=("w:1",), admin_token="s3cr3t"
    )
    assert _serve_and_capture(monkeypatch, options_to_argv(workers)) == ("serve", workers)
    # Values that begin with "-" are values, not flags, for the server processes too.
    dashed = ServeOptions(
        checkpoint=Path("-ckpt"), model_name="-latest", host="::", admin_token="s3cr3t"
    )
    assert _serve_and_capture(monkeypatch, options_to_argv(dashed)) == ("serve", dashed)


def test_serve_with_several_workers_runs_the_supervisor_and_refuses_bad_arguments(
    monkeypatch, capsys
):
    monkeypatch.delenv("RECSERVE_ADMIN_TOKEN", raising=False)
    entry, options = _serve_and_capture(
        monkeypatch, ["serve", "--checkpoint", "ckpt", "--workers", "2", "--http-port", "0"]
    )
    assert entry == "serve_processes"
    assert (options.workers, options.http_port, options.grpc_port) == (2, 0, 8001)
    assert options.checkpoint == Path("ckpt") and not options.reuse_port
    with pytest.raises(SystemExit) as exited:
        _serve_and_capture(monkeypatch, ["serve", "--checkpoint", "ckpt", "--threads", "1025"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "recserve serve: error: --threads 1025: at most 1024"
    )


def test_a_workers_server_on_a_taken_port_names_the_flag_and_starts_nothing(monkeypatch):
    """The port is checked before any process starts, and the error says which flag to
    change."""
    import signal
    import socket
    import subprocess

    from serving.processes import serve_processes

    def no_process(*_args, **_kwargs):
        raise AssertionError("no server process may start")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            for ports, protocol, flag in (
                ({"http_port": port, "grpc_port": 0}, "HTTP", "--http-port"),
                ({"http_port": 0, "grpc_port": port}, "gRPC", "--grpc-port"),
            ):
                options = ServeOptions(checkpoint="ckpt", workers=2, **ports)
                with pytest.raises(UnavailableError) as caught:
                    serve_processes(options)
                assert caught.value.message.startswith(
                    f"cannot listen for {protocol} on 127.0.0.1:{port}: "
                )
                assert caught.value.message.endswith(
                    f"(is another server on that port? {flag} 0 picks a free one)"
                )
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


@pytest.mark.parametrize(
    ("limits", "needed", "set_to", "warns"),
    [
        ((1024, 524288), 2304, (2304, 524288), False),  # a soft 1024, as some runtimes give: raised
        ((1024, 2000), 2304, (2000, 2000), True),  # as far as the hard limit, with a warning
        ((4096, 4096), 2304, None, False),  # already enough: untouched
        ((1024, -1), 2304, (2304, -1), False),  # hard RLIM_INFINITY
        ((1024, 1024), 2304, None, True),  # nothing to raise: only the warning
    ],
)
def test_the_open_files_limit_is_raised_for_the_caps(monkeypatch, limits, needed, set_to, warns):
    import resource

    from serving.server import raise_open_files_limit

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(resource, "RLIM_INFINITY", -1)
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits)
    monkeypatch.setattr(resource, "setrlimit", lambda which, value: calls.append(value))
    warning = raise_open_files_limit(needed)
    assert calls == ([] if set_to is None else [set_to])
    if warns:
        assert warning == (
            f"open files are limited to {min(limits[1], needed)} (hard RLIMIT_NOFILE), below "
            f"the {needed} that --max-connections and --max-concurrent-rpcs may need: "
            "connections beyond it fail to be accepted instead of being answered 503 (raise "
            "the limit, or lower the caps)"
        )
    else:
        assert warning is None


def test_onednn_min_rows_takes_auto_or_an_integer(capsys):
    assert _parse().onednn_min_rows is None  # auto: measured at load
    assert _parse("--onednn-min-rows", "auto").onednn_min_rows is None
    assert _parse("--onednn-min-rows", "AUTO").onednn_min_rows is None
    assert _parse("--onednn-min-rows", "0").onednn_min_rows == 0
    assert _parse("--onednn-min-rows", "64").onednn_min_rows == 64
    with pytest.raises(SystemExit):
        _parse("--onednn-min-rows", "fast")
    err = capsys.readouterr().err
    assert "argument --onednn-min-rows: expected an integer" in err
    assert ", or auto" in err
