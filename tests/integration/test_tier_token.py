"""The embedding tier's shared token (RECSERVE_TIER_TOKEN / RECSERVE_TIER_TOKEN_FILE): tier
services refuse calls without it, health checks stay open, tier clients send it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedding_store.config import EmbeddingConfig, GlobalConfig, SlotConfig
from embedding_store.errors import InvalidArgumentError, UnauthenticatedError
from embedding_store.grpc_common import tier_token
from embedding_store.initializer import InitializationConfig
from embedding_store.optimizers import SGD
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.proto import embedding_tier_pb2_grpc as pb_grpc
from embedding_store.ps_client import RemoteParameterServer
from embedding_store.ps_process import ParameterServerOptions, ParameterServerProcess

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
        # None, another, and one that starts with the right token: all refused.
        for token in (None, "another", TOKEN + "-and-more"):
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
        # Counted as failed RPCs, by method (they never reach the methods, which count the
        # others): a client with a stale token showed no error at all.
        errors = {
            (s.labels["method"], s.labels["code"]): s.value
            for metric in process.metrics.registry.collect()
            if metric.name == "recserve_ps_rpc_errors"
            for s in metric.samples
            if s.name == "recserve_ps_rpc_errors_total" and s.value
        }
        assert errors == {("Clear", "UNAUTHENTICATED"): 3.0, ("ExportRows", "UNAUTHENTICATED"): 3.0}
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


#: A shard in a process of its own (its peak memory is then its own): prints its address.
_SHARD_SCRIPT = """
import sys, time
from embedding_store.config import EmbeddingConfig, GlobalConfig, SlotConfig
from embedding_store.ps_process import ParameterServerOptions, ParameterServerProcess
shard = ParameterServerProcess(
    EmbeddingConfig(slots_config={"a": SlotConfig(dim=4)}), GlobalConfig(),
    ParameterServerOptions(port=0),
)
shard.start()
print(shard.address, flush=True)
time.sleep(60)
"""


def _peak_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) / 1024


def test_a_refused_call_is_not_read(tmp_path):
    """A caller without the token must not make the shard buffer its request (up to the
    256 MiB message limit, per call): the refusal answers before reading it."""
    shard = subprocess.Popen(
        [sys.executable, "-c", _SHARD_SCRIPT],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, RECSERVE_TIER_TOKEN=TOKEN),
    )
    try:
        address = shard.stdout.readline().strip()
        before = _peak_rss_mib(shard.pid)
        request = pb.LookupRequest(ids=b"\0" * (96 << 20), dim=4)  # 96 MiB of IDs
        options = [("grpc.max_send_message_length", 128 << 20)]
        with (
            grpc.insecure_channel(address, options=options) as channel,
            pytest.raises(grpc.RpcError) as refused,
        ):
            pb_grpc.ParameterServerStub(channel).Lookup(request, timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Reading it would hold at least its 96 MiB at once.
        assert _peak_rss_mib(shard.pid) - before < 32
    finally:
        shard.kill()
        shard.wait()
