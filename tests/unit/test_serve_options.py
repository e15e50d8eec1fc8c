"""``recserve serve`` options: where the admin token comes from, and what worker processes
are started with."""

from __future__ import annotations

import argparse

import pytest

from embedding_store.errors import InvalidArgumentError
from serving import commands
from serving.server import ServeOptions, options_to_argv


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
    with pytest.raises(InvalidArgumentError, match=rf"--admin-token-file {secret} is empty"):
        commands._admin_token(_parse("--admin-token-file", str(secret)))
    missing = tmp_path / "missing"
    with pytest.raises(InvalidArgumentError, match=rf"--admin-token-file {missing}: No such"):
        commands._admin_token(_parse("--admin-token-file", str(missing)))
    with pytest.raises(SystemExit):  # not both
        _parse("--admin-token", "a", "--admin-token-file", str(secret))


def test_worker_processes_get_every_option_but_the_token_on_their_command_line():
    argv = options_to_argv(ServeOptions(checkpoint="ckpt", admin_token="s3cr3t", workers=1))
    assert "s3cr3t" not in argv and "--admin-token" not in argv
    assert argv[:3] == ["serve", "--checkpoint", "ckpt"]
