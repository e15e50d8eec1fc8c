"""Config and command-line bugs found by a second hunt; each test fails without its fix.

An unset shell variable turns ``--flag "$VAR"`` into ``--flag ""``: a path flag then named
the working directory (``Path("") == Path(".")``), a config flag failed with
": config file not found" or was skipped for its environment variable's file, and a tier
address flag silently chose the embedded tier. Each now ends in one argparse line naming
the flag."""

from __future__ import annotations

import pytest

from embedding_store.cli import build_parser


def usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The last line of the argparse error of ``recserve ARGV`` (asserting exit code 2)."""
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(argv)
    assert caught.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


EMPTY_PATH = "expected a path, got an empty value"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        # Was Path("."): the working directory became the root POST /admin/reload may load.
        (["serve", "--checkpoint", "c", "--reload-root", ""], "--reload-root"),
        (["serve", "--checkpoint", " "], "--checkpoint"),
        (["serve", "--checkpoint", "c", "--admin-token-file", ""], "--admin-token-file"),
        (["serve", "--checkpoint", "c", "--tls-cert", ""], "--tls-cert"),
        (["checkpoint", "reshard", "c", "--shards", "2", "--out", ""], "--out"),
        (["checkpoint", "inspect", ""], "DIR"),
        (["eval", "--data", "d.csv", "--out", "p.csv", "--mapping", ""], "--mapping"),
        (["predict", "--input", "r.jsonl", "--tls-ca", ""], "--tls-ca"),
        # Was ": config file not found" (no flag, no file name).
        (["embedding-worker", "--embedding-config", ""], "--embedding-config"),
        (["embedding-worker", "--global-config", ""], "--global-config"),
        (
            ["embedding-parameter-server", "--replica-index", "0", "--replica-size", "1",
             "--port", "0", "--embedding-config", ""],
            "--embedding-config",
        ),
        # Was skipped: the script then read $RECSERVE_EMBEDDING_CONFIG's file, or none.
        (["train", "--entry", "t.py", "--embedding-config", ""], "--embedding-config"),
        (["data-loader", "--entry", "t.py", "--replica-index", "0", "--replica-size", "1",
          "--global-config", ""], "--global-config"),
        (["embedding-tier", "status", "--worker", "w:1", "--embedding-config", ""],
         "--embedding-config"),
    ],
)  # fmt: skip
def test_an_empty_path_is_refused_naming_the_flag(capsys, argv, flag) -> None:
    assert usage_error(capsys, argv).endswith(f"error: argument {flag}: {EMPTY_PATH}")


def test_a_path_with_text_is_taken_as_given() -> None:
    args = build_parser().parse_args(["serve", "--checkpoint", "runs/c", "--reload-root", "runs"])
    assert (str(args.checkpoint), str(args.reload_root)) == ("runs/c", "runs")
    args = build_parser().parse_args(["embedding-worker", "--embedding-config", "e.yml"])
    assert args.embedding_config == "e.yml"


@pytest.mark.parametrize("flag", ["--embedding-workers", "--embedding-ps"])
@pytest.mark.parametrize("value", ["", " ", ","])
def test_serve_refuses_an_empty_tier_address_list(capsys, flag, value) -> None:
    """``--embedding-workers "$WORKER"`` with WORKER unset served from an embedded tier (the
    checkpoint's rows in this process) instead of the remote one, without a word."""
    error = usage_error(capsys, ["serve", "--checkpoint", "c", flag, value])
    assert error.endswith(
        f"error: argument {flag}: give at least one HOST:PORT (leave the flag out for the "
        "embedded tier)"
    )


def test_serve_without_tier_flags_is_embedded() -> None:
    from serving.commands import check_arguments

    args = build_parser().parse_args(["serve", "--checkpoint", "c"])
    assert (args.embedding_workers, args.embedding_ps) == (None, None)
    assert check_arguments(args) is None
    args = build_parser().parse_args(["serve", "--checkpoint", "c", "--embedding-ps", "a:1,b:2"])
    assert check_arguments(args) is None
