"""How tier processes announce their address, and how the launcher reads it back from a log
that holds their stdout and stderr together."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from embedding_store.errors import UnavailableError
from embedding_store.grpc_common import announce
from embedding_store.launcher import ManagedProcess


class _Writes(io.StringIO):
    """stdout that records each write call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


def test_the_line_and_its_newline_go_out_in_one_write(monkeypatch) -> None:
    """print() writes the text and its newline apart: unbuffered (PYTHONUNBUFFERED), a log
    line of another thread landed between them in the shared log file."""
    out = _Writes()
    monkeypatch.setattr("sys.stdout", out)
    announce("parameter server replica 0/2 listening on 127.0.0.1:37251")
    assert out.calls == ["parameter server replica 0/2 listening on 127.0.0.1:37251\n"]


def _launched(tmp_path: Path, text: str) -> ManagedProcess:
    log = tmp_path / "ps-0.log"
    log.write_text(text)
    return ManagedProcess(name="parameter server 0", args=[], log_path=log)


def test_the_launcher_reads_an_address_from_a_whole_line_only(tmp_path: Path) -> None:
    """A CI run read port 372512026: a log line ran on from '...:37251' before its newline.
    A port is taken once its line ended, never from a line still being written."""
    cut = "parameter server replica 0/2 listening on 127.0.0.1:3725"
    with pytest.raises(UnavailableError) as waited:
        _launched(tmp_path, cut).wait_for_address(timeout=0.2)
    assert waited.value.message == "parameter server 0 did not start listening within 0 s"
    run_on = cut + "12026-11-23 09:36:15,259 INFO embedding_store.ps_service: loaded 180 rows\n"
    with pytest.raises(UnavailableError):
        _launched(tmp_path, run_on).wait_for_address(timeout=0.2)
    whole = "WARNING no --dump-root\n" + cut + "1\nINFO loaded 180 rows\n"
    assert _launched(tmp_path, whole).wait_for_address(timeout=0.2) == "127.0.0.1:37251"
