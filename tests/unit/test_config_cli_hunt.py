"""Config and command-line bugs found by a hunt: each test fails without its fix.

A tier server whose port cannot be bound ends in one line naming the address (grpcio raises a
bare RuntimeError), and an embedding worker takes IPv6 hosts as the parameter server does.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from embedding_store import cli
from embedding_store.errors import UnavailableError
from embedding_store.grpc_common import bind_tier_port

ROOT = Path(__file__).resolve().parents[2]
EMBEDDING_CONFIG = ROOT / "examples" / "configs" / "embedding_config.yml"


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port held by a listening socket of this test (so no server can bind it)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def _cannot_listen(address: str) -> str:
    return (
        f"cannot listen on {address}: the port is in use, or the host is not an address of "
        "this machine (port 0 picks a free port)"
    )


# --------------------------------------------------------------------------- binding tier ports
def test_a_tier_port_that_cannot_be_bound_is_an_unavailable_error(taken_port) -> None:
    server = grpc.server(thread_pool=None, options=[("grpc.so_reuseport", 0)])
    try:
        with pytest.raises(UnavailableError) as caught:
            bind_tier_port(server, f"127.0.0.1:{taken_port}")
        assert caught.value.message == _cannot_listen(f"127.0.0.1:{taken_port}")
    finally:
        server.stop(0)


def test_embedding_worker_on_a_taken_port_ends_in_one_line(taken_port, capsys) -> None:
    """It used to end in a RuntimeError traceback (the parameter server said it in a line)."""
    argv = ["embedding-worker", "--ps", "127.0.0.1:1", "--embedding-config",
            str(EMBEDDING_CONFIG), "--port", str(taken_port), "--startup-timeout", "0",
            "--grace-seconds", "0"]  # fmt: skip
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        f"recserve embedding-worker: error: {_cannot_listen(f'127.0.0.1:{taken_port}')}"
    )
    assert "Traceback" not in err


def test_embedding_worker_binds_an_ipv6_host_in_brackets(monkeypatch) -> None:
    """``--host ::1`` was bound as ``::1:0``, which gRPC cannot parse (the parameter server
    wrote ``[::1]:0``)."""
    from embedding_store import worker_service
    from embedding_store.config import load_embedding_config

    bound: list[str] = []

    def refuse(_server: grpc.Server, address: str) -> int:
        bound.append(address)
        raise UnavailableError("stop here")

    monkeypatch.setattr(worker_service, "bind_tier_port", refuse)
    with pytest.raises(UnavailableError, match="stop here"):
        worker_service.serve_embedding_worker(
            load_embedding_config(EMBEDDING_CONFIG), ["127.0.0.1:1"], host="::1", port=7
        )
    assert bound == ["[::1]:7"]
