"""The embedding tier's shared token (RECSERVE_TIER_TOKEN / RECSERVE_TIER_TOKEN_FILE): tier
services refuse calls without it, health checks stay open, tier clients send it."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedding_store.config import EmbeddingConfig, GlobalConfig, SlotConfig
from embedding_store.errors import InvalidArgumentError, UnauthenticatedError
from embedding_store.grpc_common import tier_token
from embedding_store.initializer import InitializationConfig
from embedding_store.optimizers import SGD
from embedding_store.ps_client import RemoteParameterServer
from embedding_store.ps_service import ParameterServerOptions, ParameterServerProcess

CONFIG = EmbeddingConfig(slots_config={"a": SlotConfig(dim=4)})
TOKEN = "tier-s3cr3t"


def test_a_shard_with_a_token_refuses_calls_without_it(monkeypatch, tmp_path):
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    monkeypatch.delenv("RECSERVE_TIER_TOKEN", raising=False)
    monkeypatch.setenv("RECSERVE_TIER_TOKEN_FILE", str(secret))
    process = ParameterServerProcess(CONFIG, GlobalConfig(), ParameterServerOptions(port=0))
    process.start()  # reads the token now: the server checks every call
    try:
        with RemoteParameterServer(process.address, timeout=5) as client:  # sends it
            client.configure(SGD(lr=0.1), InitializationConfig(seed=1))
            assert client.lookup(np.arange(3, dtype=np.uint64), 4, train=True).shape == (3, 4)
        monkeypatch.delenv("RECSERVE_TIER_TOKEN_FILE")
        for token in (None, "another"):
            if token:
                monkeypatch.setenv("RECSERVE_TIER_TOKEN", token)
            with RemoteParameterServer(process.address, timeout=5) as client:
                with pytest.raises(UnauthenticatedError, match="needs its token"):
                    client.clear()
                with pytest.raises(UnauthenticatedError):
                    list(client.export_rows(4))
                assert client.health() == "SERVING"  # probes send no metadata
        monkeypatch.setenv("RECSERVE_TIER_TOKEN", TOKEN)
        with RemoteParameterServer(process.address, timeout=5) as client:
            assert client.status().rows == 3  # nothing was cleared
        # A plain channel, as an attacker's script: refused too; health answers.
        with grpc.insecure_channel(process.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            answer = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        process.stop(grace=0)


def test_a_token_file_that_cannot_be_read_is_named(monkeypatch, tmp_path):
    monkeypatch.delenv("RECSERVE_TIER_TOKEN", raising=False)
    monkeypatch.setenv("RECSERVE_TIER_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(InvalidArgumentError, match=r"RECSERVE_TIER_TOKEN_FILE=.*missing: No such"):
        tier_token()
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv("RECSERVE_TIER_TOKEN_FILE", str(tmp_path / "empty"))
    with pytest.raises(InvalidArgumentError, match="is empty"):
        tier_token()
    monkeypatch.delenv("RECSERVE_TIER_TOKEN_FILE")
    assert tier_token() is None
    monkeypatch.setenv("RECSERVE_TIER_TOKEN", "s3cret\n")  # as `echo` leaves it
    assert tier_token() == "s3cret"
    monkeypatch.setenv("RECSERVE_TIER_TOKEN", "s3cr\x01et")
    with pytest.raises(InvalidArgumentError, match="RECSERVE_TIER_TOKEN: the tier token must"):
        tier_token()
