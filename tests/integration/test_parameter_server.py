"""A real ``recserve embedding-parameter-server`` process, driven over gRPC.

Every server is a subprocess on 127.0.0.1 with port 0; the tests read the port from the line it
prints and end it by PID (SIGTERM, SIGKILL as a fallback) in a ``finally``.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from embedding_store import checkpoint_dump, checkpoint_load, checkpoint_manifest
from embedding_store.config import load_embedding_config
from embedding_store.errors import FailedPreconditionError, UnavailableError
from embedding_store.grpc_common import LIVENESS_SERVICE
from embedding_store.initializer import InitializationConfig
from embedding_store.launcher import recserve_command
from embedding_store.optimizers import Adagrad
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.proto import embedding_tier_pb2_grpc as pb_grpc
from embedding_store.ps_client import RemoteParameterServer
from embedding_store.ps_service import SERVICE_NAME
from embedding_store.shard import EmbeddingShard
from tests.integration.blocking_checkpoint import feed, replace_with_fifo

CAPACITY = 64  # small: the lookups below evict, so the LRU must match bit for bit too
OPTIMIZER = Adagrad(lr=0.05, initial_accumulator_value=0.1)
INITIALIZATION = InitializationConfig(low=-0.1, high=0.1, seed=7)
LISTENING = re.compile(r"parameter server replica (\d+)/(\d+) listening on (\S+):(\d+)$")
METRICS = re.compile(r"metrics on http://(\S+)/metrics$")
START_TIMEOUT = 30.0


# --------------------------------------------------------------------------- processes
class ServerProcess:
    """One parameter-server subprocess; stdout is read line by line on a thread."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.address = ""
        self.metrics_url: str | None = None

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_listening(self, timeout: float = START_TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(
                    f"parameter server did not start; exit code {self.process.poll()}; log:\n"
                    + self.log_path.read_text(errors="replace")[-3000:]
                )
            if match := METRICS.search(line):
                self.metrics_url = f"http://{match.group(1)}/metrics"
            if match := LISTENING.search(line):
                self.address = f"{match.group(3)}:{match.group(4)}"
                return self.address

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        self._log.close()


@pytest.fixture
def start_server(tmp_path):
    """Factory: start a parameter server with config files, wait for its port."""
    started: list[ServerProcess] = []

    def start(
        global_config: dict | None = None,
        *,
        name: str = "ps",
        extra: tuple[str, ...] = (),
        replica: tuple[int, int] = (0, 1),
    ) -> ServerProcess:
        embedding_path = tmp_path / "embedding_config.yml"
        embedding_path.write_text(yaml.safe_dump(EMBEDDING_CONFIG))
        global_path = tmp_path / f"{name}_global_config.yml"
        global_path.write_text(yaml.safe_dump(global_config or train_global_config()))
        args = recserve_command(
            "embedding-parameter-server",
            "--embedding-config",
            str(embedding_path),
            "--global-config",
            str(global_path),
            "--replica-index",
            str(replica[0]),
            "--replica-size",
            str(replica[1]),
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--grace-seconds",
            "2",
            *extra,
        )
        server = ServerProcess(args, tmp_path / f"{name}.log")
        started.append(server)
        server.wait_listening()
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


EMBEDDING_CONFIG = {
    "feature_index_prefix_bit": 8,
    "slots_config": {"user": {"dim": 8}, "item": {"dim": 4}},
}


def train_global_config() -> dict:
    return {"embedding_parameter_server_config": {"capacity": CAPACITY}}


def infer_global_config(checkpoint_dir: Path) -> dict:
    return {
        "common_config": {
            "job_type": "Infer",
            "infer_config": {"embedding_checkpoint": str(checkpoint_dir)},
        },
        "embedding_parameter_server_config": {"capacity": CAPACITY},
    }


def bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)


def health_of(address: str, service: str) -> str:
    with grpc.insecure_channel(address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def train_sequence(shard, rounds: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    """Train lookups (with duplicates, two dims) and updates; returns what the lookups gave."""
    rng = np.random.default_rng(3)
    out = []
    for _ in range(rounds):
        for dim, base in ((8, 0), (4, 1 << 60)):
            ids = (rng.integers(0, 60, size=40) + base).astype(np.uint64)
            rows = shard.lookup(ids, dim, train=True)
            unique = np.unique(ids)
            grads = rng.standard_normal((len(unique), dim)).astype(np.float32)
            assert shard.update(unique, grads) >= 0
            out.append((ids, rows))
    return out


def eval_ids() -> np.ndarray:
    return np.arange(0, 80, dtype=np.uint64)  # some held, some evicted or never seen


# --------------------------------------------------------------------------- tests
def test_lookups_updates_dump_load_and_row_transfer(start_server, tmp_path):
    server = start_server()
    local = EmbeddingShard(CAPACITY, optimizer=OPTIMIZER, initialization=INITIALIZATION)
    with RemoteParameterServer(server.address, replica_index=0, timeout=5) as remote:
        remote.configure(OPTIMIZER, INITIALIZATION)
        remote.wait_for_serving(5)
        for (ids, want), (_, got) in zip(train_sequence(local), train_sequence(remote)):
            np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"ids {ids[:5]}")
        want = local.lookup(eval_ids(), 8, train=False)
        got, misses = remote.lookup_with_misses(eval_ids(), 8, train=False)
        np.testing.assert_array_equal(bits(got), bits(want))
        held = set(local.export_rows(8).ids.tolist())
        want_misses = sum(1 for i in eval_ids().tolist() if i not in held)
        assert misses == want_misses == remote.last_misses > 0
        assert got.flags.writeable

        status = remote.status()
        stats = local.stats()
        assert (status.rows, status.evictions, status.capacity) == (
            stats.rows,
            stats.evictions,
            CAPACITY,
        )
        assert stats.evictions > 0
        assert status.optimizer == OPTIMIZER.to_dict()
        assert status.serving and not status.read_only and status.job_type == "Train"

        # Dump over RPC; the caller (a worker) writes the manifest.
        ckpt = tmp_path / "ckpt"
        entries, optimizer = remote.dump(str(ckpt))
        assert optimizer == OPTIMIZER.to_dict()
        assert sum(e.rows for e in entries) == stats.rows
        config = load_embedding_config(tmp_path / "embedding_config.yml")
        checkpoint_dump.finalize_checkpoint(ckpt, config, 1, entries, optimizer)
        assert checkpoint_load.verify(ckpt).total_rows == stats.rows

        exported = list(remote.export_rows(max_rows_per_chunk=7))
        assert all(len(block) <= 7 for block in exported)
        assert sum(len(block) for block in exported) == stats.rows

    fresh = start_server(name="fresh")
    with RemoteParameterServer(fresh.address, timeout=5) as other:
        other.configure(OPTIMIZER, INITIALIZATION)
        assert other.load(str(ckpt)) == stats.rows
        for dim in (8, 4):
            np.testing.assert_array_equal(
                bits(other.lookup(eval_ids(), dim, train=False)),
                bits(local.lookup(eval_ids(), dim, train=False)),
            )
        # ExportRows -> ImportRows round trip: rows and optimizer state bit for bit
        other.clear()
        assert other.status().rows == 0
        assert other.import_rows(exported) == stats.rows
        for dim in (8, 4):
            mine = local.export_rows(dim)
            theirs = [b for b in other.export_rows() if b.dim == dim]
            ids = np.concatenate([b.ids for b in theirs])
            order, want_order = np.argsort(ids), np.argsort(mine.ids)
            np.testing.assert_array_equal(ids[order], mine.ids[want_order])
            weights = np.concatenate([b.weights for b in theirs])[order]
            state = np.concatenate([b.state for b in theirs])[order]
            np.testing.assert_array_equal(bits(weights), bits(mine.weights[want_order]))
            np.testing.assert_array_equal(bits(state), bits(mine.state[want_order]))

    # Inference: a read-only shard that loads the checkpoint at start.
    infer = start_server(infer_global_config(ckpt), name="infer")
    with RemoteParameterServer(infer.address, timeout=5) as reader:
        reader.wait_for_serving(START_TIMEOUT)
        assert health_of(infer.address, "") == "SERVING"
        for dim in (8, 4):
            np.testing.assert_array_equal(
                bits(reader.lookup(eval_ids(), dim, train=False)),
                bits(local.lookup(eval_ids(), dim, train=False)),
            )
        status = reader.status()
        assert status.read_only and status.job_type == "Infer" and status.rows == stats.rows
        with pytest.raises(FailedPreconditionError, match="read-only"):
            reader.lookup(eval_ids(), 8, train=True)
        with pytest.raises(FailedPreconditionError, match="read-only"):
            reader.update(eval_ids()[:2], np.ones((2, 8), np.float32))
        with pytest.raises(FailedPreconditionError, match=re.escape(infer.address)):
            reader.clear()


def test_health_reflection_metrics_and_malformed_requests(start_server):
    server = start_server()
    address = server.address
    assert health_of(address, "") == "NOT_SERVING"
    assert health_of(address, SERVICE_NAME) == "NOT_SERVING"
    assert health_of(address, LIVENESS_SERVICE) == "SERVING"  # alive, just not configured
    with RemoteParameterServer(address, timeout=5) as remote:
        with pytest.raises(UnavailableError, match="did not become SERVING"):
            remote.wait_for_serving(0.3)
        remote.configure(OPTIMIZER)
        remote.wait_for_serving(5)
        assert health_of(address, "") == health_of(address, SERVICE_NAME) == "SERVING"
        remote.lookup(np.arange(10, dtype=np.uint64), 8, train=True)
        remote.lookup(np.arange(20, dtype=np.uint64), 8, train=False)
        status = remote.status()

    with grpc.insecure_channel(address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= services

        stub = pb_grpc.ParameterServerStub(channel)
        cases = [
            (stub.Lookup, pb.LookupRequest(ids=b"\0" * 7, dim=8), "LookupRequest.ids: 7 bytes"),
            (
                stub.Lookup,
                pb.LookupRequest(ids=b"\0" * 8, dim=0),
                "LookupRequest.dim must be > 0, got 0",
            ),
            (
                stub.Update,
                pb.UpdateRequest(ids=b"\0" * 16, grads=b"\0" * 12, dim=4),
                "UpdateRequest.grads",
            ),
            (
                stub.Configure,
                pb.ConfigureRequest(adagrad=pb.Adagrad(lr=0.1, g_square_momentum=0)),
                "g_square_momentum",
            ),
            (stub.Dump, pb.ShardDumpRequest(), "ShardDumpRequest.directory"),
        ]
        for method, request, expected in cases:
            with pytest.raises(grpc.RpcError) as failure:
                method(request, timeout=5)
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, expected
            assert expected in failure.value.details()
        with pytest.raises(grpc.RpcError) as failure:
            stub.ImportRows(iter([pb.RowChunk(dim=4, ids=b"\0" * 8, weights=b"")]), timeout=5)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "RowChunk[0].weights" in failure.value.details()
        with pytest.raises(grpc.RpcError) as failure:
            stub.Load(pb.ShardLoadRequest(directory="/nonexistent/ckpt"), timeout=5)
        assert failure.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    assert server.metrics_url is not None
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    labels = '{replica="0",replicas="1"}'
    train, eval_ = (f'{{mode="{mode}",replica="0",replicas="1"}}' for mode in ("train", "eval"))
    assert values[f"recserve_ps_lookups_total{train}"] == 1
    assert values[f"recserve_ps_lookups_total{eval_}"] == 1
    assert status.lookups == 2
    assert values[f"recserve_ps_ids_looked_up_total{train}"] == 10
    assert values[f"recserve_ps_ids_looked_up_total{eval_}"] == 20
    # the miss ratio the help text names: 10 of the 20 eval IDs were unknown
    assert values[f"recserve_ps_misses_total{labels}"] == status.misses == 10
    assert values[f"recserve_ps_evictions_total{labels}"] == 0
    assert values[f"recserve_ps_rows{labels}"] == 10
    assert values[f"recserve_ps_capacity{labels}"] == CAPACITY
    assert values['recserve_ps_rpc_latency_seconds_count{method="Lookup"}'] >= 2
    assert values['recserve_ps_rpc_errors_total{code="INVALID_ARGUMENT",method="Lookup"}'] == 2


def test_sigterm_drains_dumps_and_exits_zero(start_server, tmp_path):
    dump_dir = tmp_path / "on_exit"
    server = start_server(name="term", extra=("--dump-on-exit", str(dump_dir)))
    with RemoteParameterServer(server.address, timeout=5) as remote:
        remote.configure(OPTIMIZER)
        remote.lookup(np.arange(12, dtype=np.uint64), 8, train=True)
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=10) == 0
    assert time.monotonic() - start < 5
    manifest = checkpoint_load.verify(dump_dir)
    assert manifest.total_rows == 12
    assert manifest.optimizer == OPTIMIZER.to_dict()
    assert (dump_dir / "shard_00000" / "dim_8.safetensors").exists()
    assert json.loads((dump_dir / checkpoint_manifest.MANIFEST_NAME).read_text())["num_shards"] == 1


def test_killed_server_fails_fast_naming_the_address(start_server):
    server = start_server(name="kill", replica=(1, 2))
    with RemoteParameterServer(server.address, replica_index=1, timeout=3) as remote:
        remote.configure(OPTIMIZER)
        assert remote.status().replica_index == 1
        remote.lookup(np.arange(4, dtype=np.uint64), 8, train=True)
        server.process.kill()
        server.process.wait(timeout=10)
        start = time.monotonic()
        with pytest.raises(UnavailableError) as failure:
            remote.lookup(np.arange(4, dtype=np.uint64), 8, train=False)
        assert time.monotonic() - start < 3.5
        assert f"parameter server {server.address} (shard 1)" in failure.value.message


def dump_tier(remotes: list[RemoteParameterServer], directory: Path, config_path: Path) -> None:
    """What a worker does: every shard writes its part, then the manifest and DONE."""
    entries, optimizer = [], None
    for remote in remotes:
        part, optimizer = remote.dump(str(directory))
        entries += part
    config = load_embedding_config(config_path)
    checkpoint_dump.finalize_checkpoint(directory, config, len(remotes), entries, optimizer)


def train_rounds(remote: RemoteParameterServer, base: int, rounds: int = 3) -> None:
    """Train lookups and updates of IDs ``base + [0, 40)`` at dims 8 and 4."""
    rng = np.random.default_rng(base)
    for _ in range(rounds):
        for dim, prefix in ((8, 0), (4, 1 << 60)):
            ids = (rng.integers(0, 40, size=30) + base + prefix).astype(np.uint64)
            remote.lookup(ids, dim, train=True)
            unique = np.unique(ids)
            grads = rng.standard_normal((len(unique), dim)).astype(np.float32)
            remote.update(unique, grads)


def sorted_rows(remote: RemoteParameterServer) -> dict[int, tuple[np.ndarray, ...]]:
    """Every row of a shard per dim, by ID: (ids, weight bits, state bits)."""
    out = {}
    for dim in (4, 8):
        blocks = [b for b in remote.export_rows() if b.dim == dim]
        ids = np.concatenate([b.ids for b in blocks])
        order = np.argsort(ids)
        weights = np.concatenate([b.weights for b in blocks])[order]
        state = np.concatenate([b.state for b in blocks])[order]
        out[dim] = (ids[order], bits(weights), bits(state))
    return out


def test_restarted_training_shard_reloads_its_part_of_the_tier_checkpoint(start_server, tmp_path):
    """Two Train shards dump one tier checkpoint; shard 1 is SIGKILLed and restarted on the
    same port with --load-checkpoint: it is NOT_SERVING while it loads, then serves exactly
    its own rows and optimizer state again (optimizer adopted from the checkpoint)."""
    servers = [start_server(name=f"ps{i}", replica=(i, 2)) for i in range(2)]
    remotes = [
        RemoteParameterServer(s.address, replica_index=i, timeout=5) for i, s in enumerate(servers)
    ]
    try:
        for i, remote in enumerate(remotes):
            remote.configure(OPTIMIZER, INITIALIZATION)
            train_rounds(remote, base=1000 * i)
        ckpt = tmp_path / "tier"
        dump_tier(remotes, ckpt, tmp_path / "embedding_config.yml")
        probe = {
            dim: np.arange(990, 1050, dtype=np.uint64) + prefix
            for dim, prefix in ((8, 0), (4, 1 << 60))
        }
        want_rows = sorted_rows(remotes[1])
        want = {dim: bits(remotes[1].lookup(ids, dim, train=False)) for dim, ids in probe.items()}
        assert want_rows[8][0].size > 0 and want_rows[4][0].size > 0
    finally:
        for remote in remotes:
            remote.close()
    # Hold the load in flight: shard 1's first file (dim 4) blocks until fed.
    first = ckpt / "shard_00001" / "dim_4.safetensors"
    payload = replace_with_fifo(first)

    old = servers[1]
    os.kill(old.pid, signal.SIGKILL)
    assert old.process.wait(timeout=10) == -signal.SIGKILL
    port = old.address.rsplit(":", 1)[1]
    restarted = start_server(
        name="ps1-restarted", replica=(1, 2), extra=("--port", port, "--load-checkpoint", str(ckpt))
    )
    assert restarted.address == old.address
    with RemoteParameterServer(restarted.address, replica_index=1, timeout=5) as remote:
        assert health_of(restarted.address, "") == "NOT_SERVING"
        status = remote.status()
        assert (status.task, status.serving, status.rows) == ("loading", False, 0)
        with pytest.raises(UnavailableError, match="has not loaded its embedding checkpoint"):
            remote.lookup(probe[8], 8, train=False)
        feed(first, payload)
        remote.wait_for_serving(START_TIMEOUT)  # no Configure: the checkpoint's optimizer
        status = remote.status()
        assert status.optimizer == OPTIMIZER.to_dict() and status.task == ""
        assert status.rows == sum(ids.size for ids, _, _ in want_rows.values())
        got_rows = sorted_rows(remote)
        for dim in (4, 8):
            for got, expected in zip(got_rows[dim], want_rows[dim]):
                np.testing.assert_array_equal(got, expected)
            np.testing.assert_array_equal(
                bits(remote.lookup(probe[dim], dim, train=False)), want[dim]
            )
        # shard 0's IDs stay unknown here: only replica 1's part was loaded
        assert remote.lookup_with_misses(probe[8][:10], 8, train=False)[1] == 10


def test_sigterm_lets_an_in_flight_rpc_finish_and_refuses_new_ones(start_server, tmp_path):
    server = start_server(name="drain", extra=("--grace-seconds", "60"))
    ckpt = tmp_path / "ckpt"
    with RemoteParameterServer(server.address, timeout=5) as remote:
        remote.configure(OPTIMIZER, INITIALIZATION)
        train_rounds(remote, base=0)
        rows = remote.status().rows
        dump_tier([remote], ckpt, tmp_path / "embedding_config.yml")
    blocking = ckpt / checkpoint_manifest.read_manifest(ckpt).files[0].path
    payload = replace_with_fifo(blocking)

    loader = RemoteParameterServer(server.address, timeout=5)
    outcome: list[object] = []

    def load() -> None:
        try:
            outcome.append(loader.load(str(ckpt), timeout=120))
        except BaseException as error:  # reported by the assertions below
            outcome.append(error)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        with RemoteParameterServer(server.address, timeout=5) as probe:
            deadline = time.monotonic() + 30
            while probe.status().task != "loading":  # the Load RPC is in flight
                assert time.monotonic() < deadline, "the Load RPC never started"
                time.sleep(0.02)
            os.kill(server.pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while True:  # until the server has stopped taking RPCs
                try:
                    assert probe.status().task == "loading"
                except UnavailableError:
                    break
                assert time.monotonic() < deadline, "new RPCs were still accepted"
                time.sleep(0.02)
        with (
            RemoteParameterServer(server.address, timeout=5) as late,
            pytest.raises(UnavailableError),
        ):
            late.status()  # a new connection is refused too
        assert thread.is_alive() and not outcome  # still blocked on the checkpoint file
        assert server.process.poll() is None  # it waits for the RPC, within the grace period
        fed = time.monotonic()
        feed(blocking, payload)
        thread.join(timeout=60)
        assert outcome == [rows]
        assert server.process.wait(timeout=30) == 0
        assert time.monotonic() - fed < 30  # it exited once the RPC was done, not at grace end
    finally:
        loader.close()
    assert "received SIGTERM" in server.log_path.read_text()


def test_an_infer_shard_whose_configured_checkpoint_is_missing_names_the_key(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    embedding = tmp_path / "embedding_config.yml"
    embedding.write_text(yaml.safe_dump(EMBEDDING_CONFIG))
    global_config = tmp_path / "global_config.yml"
    global_config.write_text(yaml.safe_dump(infer_global_config(missing)))
    result = subprocess.run(
        [
            sys.executable, "-m", "embedding_store.cli", "embedding-parameter-server",
            "--embedding-config", str(embedding), "--global-config", str(global_config),
            "--replica-index", "0", "--replica-size", "1", "--host", "127.0.0.1", "--port", "0",
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "error: common_config.infer_config.embedding_checkpoint: embedding checkpoint "
        f"{missing} does not exist"
    ) in result.stderr
    assert "Traceback" not in result.stderr
