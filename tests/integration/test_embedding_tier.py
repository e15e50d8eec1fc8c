"""The networked embedding tier: 2 (or 3) parameter-server processes + 1 worker on loopback.

Everything here is real: subprocesses started through the ``recserve`` CLI, gRPC on 127.0.0.1,
checkpoints on disk. Results are compared bit for bit with the in-process tier.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import yaml
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from prometheus_client.parser import text_string_to_metric_families

from embedding_store.batch import Batch, IDTypeFeature, IDTypeFeatureWithSingleID
from embedding_store.config import load_embedding_config
from embedding_store.errors import (
    CheckpointError,
    DeadlineExceededError,
    InvalidArgumentError,
    UnavailableError,
)
from embedding_store.grpc_common import LIVENESS_SERVICE
from embedding_store.launcher import LocalCluster, ManagedProcess, recserve_command
from embedding_store.optimizers import Adagrad, Adam, Optimizer
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.proto import embedding_tier_pb2_grpc as pb_grpc
from embedding_store.tier import InProcessEmbeddingTier
from embedding_store.worker_client import RemoteEmbeddingWorker
from serving.batcher import merge_batches

EMBEDDING_CONFIG = {
    "slots_config": {
        "user": {"dim": 8},
        "items": {"dim": 8, "sqrt_scaling": True},
        "history": {"dim": 4, "embedding_summation": False, "sample_fixed_size": 3},
    },
    "feature_groups": {"people": ["user", "items"]},
}
WORKER_SERVICE = "recserve.embedding.v1.EmbeddingWorker"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
OPTIMIZER = Adagrad(lr=0.05, initial_accumulator_value=0.1)


def batch_of(seed: int, batch_size: int = 32) -> Batch:
    rng = np.random.default_rng(seed)

    def lists(high: int, most: int):
        return [
            rng.integers(0, high, rng.integers(0, most + 1)).tolist() for _ in range(batch_size)
        ]

    return Batch(
        [
            IDTypeFeatureWithSingleID("user", rng.integers(0, 500, batch_size).astype(np.uint64)),
            IDTypeFeature.from_lists("items", lists(2000, 4)),
            IDTypeFeature.from_lists("history", lists(300, 5)),
        ],
        requires_grad=False,
    )


def gradients(result, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.embeddings.shape, generator=generator) for s in result.slots}


def write_tier_configs(root: Path) -> tuple[Path, Path]:
    """embedding_config.yml (EMBEDDING_CONFIG) and a training global_config.yml in ``root``."""
    embedding = root / "embedding_config.yml"
    embedding.write_text(yaml.safe_dump(EMBEDDING_CONFIG))
    global_config = root / "global_config.yml"
    global_config.write_text(
        yaml.safe_dump({"embedding_parameter_server_config": {"capacity": 100_000}})
    )
    return embedding, global_config


@pytest.fixture(scope="module")
def config_files(tmp_path_factory):
    return write_tier_configs(tmp_path_factory.mktemp("configs"))


def two_shards_one_worker(config_files: tuple[Path, Path], log_dir: Path) -> LocalCluster:
    """The tier these tests run against: 2 parameter servers and 1 embedding worker."""
    embedding, global_config = config_files
    return LocalCluster(
        embedding, global_config, num_shards=2, num_workers=1, log_dir=log_dir, shard_timeout=3.0
    )


@pytest.fixture(scope="module")
def cluster(config_files, tmp_path_factory):
    with two_shards_one_worker(config_files, tmp_path_factory.mktemp("logs")) as running:
        yield running


@pytest.fixture
def remote(cluster, config_files):
    config = load_embedding_config(config_files[0])
    with RemoteEmbeddingWorker(cluster.worker_addresses[0], config, timeout=10) as client:
        client.configure(optimizer=OPTIMIZER)
        client.clear()
        yield client


def local_tier(
    config_files, num_shards: int = 2, optimizer: Optimizer = OPTIMIZER
) -> InProcessEmbeddingTier:
    config = load_embedding_config(config_files[0])
    return InProcessEmbeddingTier(
        config, capacity=100_000, num_shards=num_shards, optimizer=optimizer
    )


def assert_same_lookup(a, b):
    assert [s.name for s in a.slots] == [s.name for s in b.slots]
    for x, y in zip(a.slots, b.slots):
        assert torch.equal(x.embeddings, y.embeddings), x.name
        if x.mask is not None:
            assert torch.equal(x.mask, y.mask)


def train_both(remote, local, steps: int) -> None:
    """``steps`` train lookups and updates on the remote and the in-process tier, each
    lookup equal on both."""
    for step in range(steps):
        batch = batch_of(step)
        got = remote.lookup(batch, train=True)
        expected = local.lookup(batch, train=True)
        assert_same_lookup(got, expected)
        remote.backward(got.ref, gradients(got, step))
        local.backward(expected.ref, gradients(expected, step))
        remote.flush()  # the remote tier applies gradients asynchronously (bounded staleness)


@pytest.mark.parametrize(
    "optimizer",
    # Adam with weight decay: moments, a per-row step count and decay cross the wire too
    [OPTIMIZER, Adam(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)],
    ids=["adagrad", "adam"],
)
def test_lookups_and_updates_equal_the_in_process_tier(remote, config_files, optimizer):
    remote.configure(optimizer=optimizer)
    local = local_tier(config_files, optimizer=optimizer)
    train_both(remote, local, steps=4)
    for seed in range(4):
        assert_same_lookup(
            remote.lookup(batch_of(seed), train=False), local.lookup(batch_of(seed), train=False)
        )
    status = remote.status()
    assert sum(status.rows_per_shard) == sum(local.status().rows_per_shard)
    assert all(rows > 0 for rows in status.rows_per_shard)


def _three_slots(user: list[int], items: list[list[int]], history: list[list[int]]) -> Batch:
    return Batch(
        [
            IDTypeFeatureWithSingleID("user", np.array(user, dtype=np.uint64)),
            IDTypeFeature.from_lists("items", items),
            IDTypeFeature.from_lists("history", history),
        ],
        requires_grad=False,
    )


def test_unknown_ids_are_counted_per_occurrence_and_per_sample_as_in_process(remote, config_files):
    """The worker asks its shards each distinct ID once, and still counts every unknown
    occurrence, as the in-process tier does (one shard: the fused kernel; two); each
    sample's own count is what each request of a merged batch is told."""
    known = _three_slots([1], [[10]], [[5]])
    # user and items share a feature group (user 7 and items 7 would be one row); history
    # keeps 3 positions: the fourth 9 of sample 0 is never looked up.
    first = _three_slots([1, 7, 7], [[10, 20, 20], [20], [10, 21]], [[5, 9, 9, 9], [9, 6], []])
    second = _three_slots([7, 1], [[], [21, 10]], [[9], [5, 5]])
    expected = {"first": [4, 4, 2], "second": [2, 1], "merged": [4, 4, 2, 2, 1]}
    tiers = {
        "remote": remote,
        "in-process, one shard": local_tier(config_files, num_shards=1),
        "in-process, two shards": local_tier(config_files),
    }
    for name, tier in tiers.items():
        tier.lookup(known, train=True)
        for batch, per_sample in zip(
            (first, second, merge_batches([first, second])), expected.values(), strict=True
        ):
            result = tier.lookup(batch, train=False)
            assert result.unknown_ids == sum(per_sample), name
            assert result.unknown_per_sample is not None, name
            assert result.unknown_per_sample.tolist() == per_sample, name


def test_dump_from_two_shards_load_into_three(remote, cluster, config_files, tmp_path):
    for step in range(3):
        result = remote.lookup(batch_of(step), train=True)
        remote.backward(result.ref, gradients(result, step))
    remote.flush()  # gradients are applied asynchronously: settle them before reading
    expected = [remote.lookup(batch_of(s), train=False) for s in range(3)]
    progress = []
    manifest = remote.dump(tmp_path / "ckpt", progress=lambda *p: progress.append(p))
    assert manifest.num_shards == 2
    assert progress[-1] == ("dump", 2, 2)
    assert (tmp_path / "ckpt" / "DONE").exists()

    embedding, global_config = config_files
    with LocalCluster(embedding, global_config, num_shards=3, log_dir=tmp_path / "logs3") as three:
        config = load_embedding_config(embedding)
        with RemoteEmbeddingWorker(three.worker_addresses[0], config) as other:
            other.configure(optimizer=OPTIMIZER)
            other.load(tmp_path / "ckpt")
            assert sum(other.status().rows_per_shard) == manifest.total_rows
            for seed in range(3):
                assert_same_lookup(other.lookup(batch_of(seed), train=False), expected[seed])


def _corrupt_one_byte(manifest, shard: int) -> None:
    entry = next(e for e in manifest.files if e.shard == shard)
    path = manifest.directory / entry.path
    payload = bytearray(path.read_bytes())
    payload[-5] ^= 0xFF
    path.write_bytes(bytes(payload))


def test_failed_loads_leave_every_shard_unchanged(remote, config_files, tmp_path):
    for step in range(3):
        result = remote.lookup(batch_of(step), train=True)
        remote.backward(result.ref, gradients(result, step))
    remote.flush()
    rows_before = remote.status().rows_per_shard
    expected = [remote.lookup(batch_of(s), train=False) for s in range(3)]
    same_count = remote.dump(tmp_path / "two")
    with local_tier(config_files, num_shards=3) as three:
        for step in range(5, 9):
            result = three.lookup(batch_of(step), train=True)
            three.backward(result.ref, gradients(result, step))
        other_count = three.dump(tmp_path / "three")
    # A corrupt file of the second shard: the first shard must not have loaded its own part.
    # Then a re-shard (3 -> 2 shards) with a corrupt file of the last source shard.
    _corrupt_one_byte(same_count, shard=1)
    _corrupt_one_byte(other_count, shard=2)
    for directory in (tmp_path / "two", tmp_path / "three"):
        with pytest.raises(CheckpointError, match="corrupt: SHA-256 mismatch"):
            remote.load(directory)
        assert remote.status().rows_per_shard == rows_before
        for seed in range(3):
            assert_same_lookup(remote.lookup(batch_of(seed), train=False), expected[seed])


def test_reshard_into_an_optimizer_with_another_state_width_keeps_every_row(
    remote, config_files, tmp_path
):
    # Saved with per-column Adagrad state, loaded into shards that keep one value per row:
    # the state is dropped (as for another optimizer), the rows all arrive, none is lost.
    with local_tier(config_files, num_shards=3) as three:
        for step in range(4):
            result = three.lookup(batch_of(step), train=True)
            three.backward(result.ref, gradients(result, step))
        manifest = three.dump(tmp_path / "three")
        expected = [three.lookup(batch_of(s), train=False) for s in range(4)]
    remote.configure(optimizer=Adagrad(lr=0.05, vectorwise_shared=True))
    remote.load(tmp_path / "three")
    assert sum(remote.status().rows_per_shard) == manifest.total_rows
    for seed in range(4):
        assert_same_lookup(remote.lookup(batch_of(seed), train=False), expected[seed])


def test_bad_gradients_fail_the_backward_call_and_train_nothing(remote):
    result = remote.lookup(batch_of(0), train=True)  # inserts the rows
    before = remote.lookup(batch_of(0), train=False)
    grads = gradients(result, 0)
    with pytest.raises(InvalidArgumentError, match=r"slot 'user' has shape \(3, 8\)"):
        remote.backward(result.ref, {**grads, "user": torch.ones(3, 8)})
    result = remote.lookup(batch_of(0), train=True)
    with pytest.raises(InvalidArgumentError, match=r"gradients for slots \['usr'\]"):
        remote.backward(result.ref, {**grads, "usr": torch.ones(32, 8)})
    remote.flush()  # nothing was queued: no late failure either
    assert_same_lookup(remote.lookup(batch_of(0), train=False), before)


def test_dead_shard_gives_a_clear_error_and_recovers_after_restart(
    remote, cluster, config_files, tmp_path
):
    result = remote.lookup(batch_of(0), train=True)
    remote.backward(result.ref, gradients(result, 0))
    remote.flush()
    remote.dump(tmp_path / "ckpt")
    expected = remote.lookup(batch_of(0), train=False)

    cluster.kill_shard(1)
    started = time.monotonic()
    with pytest.raises((UnavailableError, DeadlineExceededError)) as failure:
        remote.lookup(batch_of(0), train=False)
    assert time.monotonic() - started < 8  # the shard deadline, not a hang
    assert cluster.ps_addresses[1] in failure.value.message
    assert "shard 1" in failure.value.message

    cluster.restart_shard(1)
    deadline = time.monotonic() + 20
    while True:  # the worker's channel reconnects on its own
        try:
            remote.configure(optimizer=OPTIMIZER)
            break
        except UnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    remote.load(tmp_path / "ckpt")
    assert_same_lookup(remote.lookup(batch_of(0), train=False), expected)


def test_malformed_requests_are_invalid_argument_naming_the_field(cluster):
    with grpc.insecure_channel(cluster.worker_addresses[0]) as channel:
        stub = pb_grpc.EmbeddingWorkerStub(channel)
        with pytest.raises(grpc.RpcError) as bad_batch:
            stub.Lookup(pb.WorkerLookupRequest(batch=b"not a batch", train=False), timeout=5)
        assert bad_batch.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "batch" in bad_batch.value.details()

        good = batch_of(1).to_bytes()
        ref = stub.Lookup(pb.WorkerLookupRequest(batch=good, train=True), timeout=5).ref
        with pytest.raises(grpc.RpcError) as bad_grad:
            stub.Backward(
                pb.BackwardRequest(
                    ref=ref,
                    grads=pb.PackedSlots(
                        slots=[pb.SlotHeader(name="user", shape=[32, 8])], data=b"\0" * 5
                    ),
                ),
                timeout=5,
            )
        assert bad_grad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "grads.data: got 5 bytes, expected 1024" in bad_grad.value.details()

        with pytest.raises(grpc.RpcError) as unknown_slot:
            stub.Lookup(
                pb.WorkerLookupRequest(
                    batch=Batch(
                        [IDTypeFeature.from_lists("nope", [[1]])], requires_grad=False
                    ).to_bytes()
                ),
                timeout=5,
            )
        assert unknown_slot.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'nope'" in unknown_slot.value.details()

        with pytest.raises(grpc.RpcError) as empty_dir:
            list(stub.Dump(pb.WorkerDumpRequest(directory=""), timeout=5))
        assert empty_dir.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_worker_health_waits_for_its_shards(config_files, tmp_path):
    embedding, global_config = config_files
    ps_port = free_port()
    worker = ManagedProcess(
        "worker",
        recserve_command(
            "embedding-worker",
            "--embedding-config",
            str(embedding),
            "--ps",
            f"127.0.0.1:{ps_port}",
            "--port",
            "0",
        ),
        tmp_path / "worker.log",
    )
    shard = ManagedProcess(
        "shard",
        recserve_command(
            "embedding-parameter-server",
            "--embedding-config",
            str(embedding),
            "--global-config",
            str(global_config),
            "--replica-index",
            "0",
            "--replica-size",
            "1",
            "--port",
            str(ps_port),
        ),
        tmp_path / "ps.log",
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        worker.start(env)
        address = worker.wait_for_address(30)
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="recserve.embedding.v1.EmbeddingWorker")
            assert (
                health.Check(request, timeout=5).status
                == health_pb2.HealthCheckResponse.NOT_SERVING
            )
            # Waiting for its shard, the worker is not ready, but alive (liveness probes).
            alive = health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE)
            assert health.Check(alive, timeout=5).status == SERVING
            shard.start(env)
            shard.wait_for_address(30)
            deadline = time.monotonic() + 30
            while health.Check(request, timeout=5).status != SERVING:
                assert time.monotonic() < deadline, "worker never became SERVING"
                time.sleep(0.1)
        assert worker.stop() == 0  # SIGTERM: drained and exited cleanly
    finally:
        worker.stop(kill=True)
        shard.stop()


def test_wrong_replica_order_is_refused(config_files, tmp_path):
    embedding, global_config = config_files
    with LocalCluster(
        embedding, global_config, num_shards=2, num_workers=0, log_dir=tmp_path
    ) as shards:
        swapped = ",".join(reversed(shards.ps_addresses))
        worker = ManagedProcess(
            "worker",
            recserve_command(
                "embedding-worker", "--embedding-config", str(embedding), "--ps", swapped
            ),
            tmp_path / "worker.log",
        )
        worker.start(dict(os.environ))
        try:
            assert worker.process.wait(timeout=30) == 1
        finally:
            worker.stop(kill=True)
        assert "answers as replica 1 of 2" in (tmp_path / "worker.log").read_text()


def test_tier_admin_cli_dumps_with_progress_and_reports_status(
    remote, cluster, config_files, tmp_path
):
    result = remote.lookup(batch_of(5), train=True)
    remote.backward(result.ref, gradients(result, 5))
    remote.flush()
    embedding = str(config_files[0])
    worker = cluster.worker_addresses[0]
    cli = [sys.executable, "-m", "embedding_store.cli", "embedding-tier"]
    dump = subprocess.run(
        [*cli, "dump", "--worker", worker, "--embedding-config", embedding, str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dump.returncode == 0, dump.stderr
    assert "dump [##############################] 2/2" in dump.stderr
    assert (tmp_path / "c" / "DONE").exists()
    again = subprocess.run(
        [*cli, "dump", "--worker", worker, "--embedding-config", embedding, str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 1 and "already exists" in again.stderr
    status = subprocess.run(
        [*cli, "status", "--worker", worker, "--embedding-config", embedding],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0
    rows = remote.status().rows_per_shard
    assert status.stdout.splitlines()[:3] == [
        # Trained rows come from no checkpoint.
        f"shard 0: {rows[0]} rows of 100000, idle, checkpoint none",
        f"shard 1: {rows[1]} rows of 100000, idle, checkpoint none",
        "worker: idle",
    ]


def test_worker_serves_reflection(cluster):
    with grpc.insecure_channel(cluster.worker_addresses[0]) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert set(database.get_services()) == {
            WORKER_SERVICE,
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        }
        # The descriptors come over the wire too: a client needs no .proto file.
        status = DescriptorPool(database).FindMessageTypeByName(
            "recserve.embedding.v1.WorkerStatusResponse"
        )
        assert {"shard_status", "task", "task_progress"} <= set(status.fields_by_name)


# --------------------------------------------------------------------------- metrics
METRICS_LINE = re.compile(r"embedding worker metrics on (http://\S+/metrics)")


def scrape(url: str) -> tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """The /metrics text and its samples by (name, sorted labels); parsing checks the format."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return text, samples


def test_worker_metrics_count_lookups_ids_and_gradients(cluster, config_files, tmp_path):
    """A worker started with --metrics-port (0: a free port) over the cluster's shards:
    exact counters after known lookups and gradients (one row NaN), and RPC histograms."""
    embedding, global_config = config_files
    log_path = tmp_path / "worker.log"
    worker = ManagedProcess(
        "metrics worker",
        recserve_command(
            "embedding-worker",
            "--embedding-config",
            str(embedding),
            "--global-config",
            str(global_config),
            "--ps",
            ",".join(cluster.ps_addresses),
            "--port",
            "0",
            "--metrics-port",
            "0",
        ),
        log_path,
    )
    worker.start(dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        address = worker.wait_for_address(60)
        url = METRICS_LINE.search(log_path.read_text())[1]  # printed before "listening on"
        # 3 + 3 + 5 = 11 IDs; unique rows: 6 of dim 8 (user and items share the feature
        # group's prefix, their IDs differ), 3 of dim 4 (history keeps 3 positions: 5, 6, 7).
        batch = Batch(
            [
                IDTypeFeatureWithSingleID("user", np.array([1, 2, 3], dtype=np.uint64)),
                IDTypeFeature.from_lists("items", [[10, 11], [12], []]),
                IDTypeFeature.from_lists("history", [[5, 6, 7, 8], [5], []]),
            ],
            requires_grad=False,
        )
        config = load_embedding_config(embedding)
        with RemoteEmbeddingWorker(address, config, timeout=10) as client:
            client.wait_for_serving(30)
            client.configure(optimizer=OPTIMIZER)
            client.clear()
            # Every ID is unknown: 10 occurrences (history's 5 twice), 9 distinct rows.
            assert client.lookup(batch, train=False).unknown_ids == 10
            first = client.lookup(batch, train=True)
            second = client.lookup(batch, train=True)
            grads = {s.name: torch.ones(s.embeddings.shape) for s in first.slots}
            grads["user"][0, 3] = float("nan")  # user ID 1's row: skipped, not pushed
            client.backward(first.ref, grads)
            client.backward(
                second.ref, {s.name: torch.ones(s.embeddings.shape) for s in second.slots}
            )
            client.flush()
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as bad:
            pb_grpc.EmbeddingWorkerStub(channel).Lookup(
                pb.WorkerLookupRequest(batch=b"not a batch"), timeout=5
            )
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        text, samples = scrape(url)
        expected = {
            ("recserve_worker_lookups_total", (("mode", "train"),)): 2,
            ("recserve_worker_lookups_total", (("mode", "eval"),)): 1,
            ("recserve_worker_ids_looked_up_total", (("mode", "train"),)): 22,
            ("recserve_worker_ids_looked_up_total", (("mode", "eval"),)): 11,
            ("recserve_worker_unknown_ids_total", ()): 10,
            ("recserve_worker_gradient_batches_pushed_total", ()): 2,
            ("recserve_worker_gradient_rows_pushed_total", ()): 8 + 9,
            ("recserve_worker_nonfinite_gradient_rows_skipped_total", ()): 1,
            ("recserve_worker_failed_gradient_pushes_total", ()): 0,
            ("recserve_worker_pending_gradient_batches", ()): 0,
            ("recserve_worker_pending_forward_contexts", ()): 0,
            ("recserve_worker_rpc_latency_seconds_count", (("method", "Lookup"),)): 4,
            ("recserve_worker_rpc_latency_seconds_count", (("method", "Backward"),)): 2,
            ("recserve_worker_rpc_latency_seconds_count", (("method", "Flush"),)): 1,
            (
                "recserve_worker_rpc_errors_total",
                (("code", "INVALID_ARGUMENT"), ("method", "Lookup")),
            ): 1,
        }
        assert {key: samples.get(key) for key in expected} == expected
        for method in ("Lookup", "Backward", "Flush", "Configure", "Clear"):
            bucket = (
                "recserve_worker_rpc_latency_seconds_bucket",
                (("le", "+Inf"), ("method", method)),
            )
            assert samples[bucket] >= 1, method
        if shutil.which("promtool"):
            check = subprocess.run(
                ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
            )
            assert check.returncode == 0, check.stdout + check.stderr
        assert worker.stop() == 0  # SIGTERM: drained, metrics server closed, exit 0
    finally:
        worker.stop(kill=True)
