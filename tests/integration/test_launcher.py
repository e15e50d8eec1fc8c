"""LocalCluster: it returns only once every shard's gRPC health is SERVING (num_workers=0
here), configures training shards when given an optimizer, and names a shard that never
serves, quoting its log. Real ``recserve embedding-parameter-server`` processes on 127.0.0.1,
stopped by PID by the launcher."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedding_store import checkpoint_dump, checkpoint_manifest
from embedding_store.config import load_embedding_config
from embedding_store.errors import UnavailableError
from embedding_store.initializer import InitializationConfig, initial_vectors
from embedding_store.launcher import LocalCluster, ManagedProcess
from embedding_store.optimizers import SGD
from embedding_store.ps_client import RemoteParameterServer
from embedding_store.shard import EmbeddingShard, RowBlock
from tests.integration.blocking_checkpoint import feed, replace_with_fifo

EMBEDDING_CONFIG = {"feature_index_prefix_bit": 8, "slots_config": {"user": {"dim": 4}}}


def health_of(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


@pytest.fixture
def embedding_config(tmp_path) -> Path:
    path = tmp_path / "embedding_config.yml"
    path.write_text(yaml.safe_dump(EMBEDDING_CONFIG))
    return path


def infer_config(tmp_path: Path, embedding_checkpoint: Path) -> Path:
    path = tmp_path / "global_config.infer.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "common_config": {
                    "job_type": "Infer",
                    "infer_config": {"embedding_checkpoint": str(embedding_checkpoint)},
                }
            }
        )
    )
    return path


def two_shard_checkpoint(
    directory: Path, embedding_config: Path
) -> checkpoint_manifest.EmbeddingManifest:
    """Shard 0 holds 3 rows, shard 1 holds 5 (dim 4): weights = the ID in every column."""
    shards = []
    for ids in (np.arange(3, dtype=np.uint64), np.arange(100, 105, dtype=np.uint64)):
        shard = EmbeddingShard(100)
        weights = np.repeat(ids.astype(np.float32)[:, None], 4, axis=1)
        shard.import_rows(RowBlock(ids=ids, weights=weights, state=None))
        shards.append(shard)
    config = load_embedding_config(embedding_config)
    return checkpoint_dump.dump_embeddings(shards, directory, config)


def test_start_returns_once_infer_shards_have_loaded(embedding_config, tmp_path):
    manifest = two_shard_checkpoint(tmp_path / "ckpt", embedding_config)
    assert manifest.rows_per_shard() == [3, 5]
    # Shard 1's file blocks its load; it is fed 2 s after the shard opened it, so a launcher
    # that returned before SERVING would be seen below.
    blocking = tmp_path / "ckpt" / "shard_00001" / "dim_4.safetensors"
    payload = replace_with_fifo(blocking)
    feeder = threading.Thread(target=feed, args=(blocking, payload, 60.0), kwargs={"hold": 2.0})
    feeder.start()
    try:
        with LocalCluster(
            embedding_config,
            infer_config(tmp_path, tmp_path / "ckpt"),
            num_shards=2,
            num_workers=0,
            log_dir=tmp_path / "logs",
        ) as cluster:
            assert cluster.workers == []
            for index, address in enumerate(cluster.ps_addresses):
                assert health_of(address) == "SERVING"
                with RemoteParameterServer(address, replica_index=index, timeout=5) as shard:
                    assert shard.status().rows == manifest.rows_per_shard()[index]
                    ids = np.array([0, 102], dtype=np.uint64)
                    expected = [[0.0] * 4, [0.0] * 4]
                    expected[index] = [float(ids[index])] * 4
                    assert shard.lookup(ids, 4, train=False).tolist() == expected
    finally:
        feeder.join(timeout=60)
    assert not feeder.is_alive()


def test_start_fails_naming_a_shard_that_never_serves(embedding_config, tmp_path):
    two_shard_checkpoint(tmp_path / "ckpt", embedding_config)
    replace_with_fifo(tmp_path / "ckpt" / "shard_00000" / "dim_4.safetensors")  # never fed
    cluster = LocalCluster(
        embedding_config,
        infer_config(tmp_path, tmp_path / "ckpt"),
        num_shards=2,
        num_workers=0,
        log_dir=tmp_path / "logs",
    )
    try:
        with pytest.raises(UnavailableError) as failure:
            cluster.start(timeout=6)  # a loaded machine takes >4 s to import
        assert all(not shard.alive for shard in cluster.shards)  # the launcher stopped them
    finally:
        cluster.stop()  # no-op when the launcher did; else no shard outlives a failed test
    message = failure.value.message
    assert message.startswith(
        f"parameter server 0 ({cluster.ps_addresses[0]}) did not become SERVING within 6 s "
        f"(health: NOT_SERVING); log {tmp_path / 'logs' / 'ps-0.log'}:\n"
    )
    assert "parameter server replica 0/2 listening on" in message  # the log's tail


def test_start_fails_naming_a_shard_that_exits(embedding_config, tmp_path):
    cluster = LocalCluster(
        embedding_config,
        infer_config(tmp_path, tmp_path / "missing"),
        num_shards=1,
        num_workers=0,
        log_dir=tmp_path / "logs",
    )
    try:
        with pytest.raises(UnavailableError) as failure:
            cluster.start(timeout=30)
    finally:
        cluster.stop()
    message = failure.value.message
    assert message.startswith(
        f"parameter server 0 ({cluster.ps_addresses[0]}) exited with code 1 before it was "
        "SERVING; log "
    )
    assert f"embedding checkpoint {tmp_path / 'missing'} does not exist" in message


def test_training_shards_are_configured_when_an_optimizer_is_given(embedding_config, tmp_path):
    optimizer = SGD(lr=0.25)
    initialization = InitializationConfig(low=2.0, high=3.0, seed=11)
    with LocalCluster(
        embedding_config,
        num_shards=2,
        num_workers=0,
        log_dir=tmp_path / "logs",
        optimizer=optimizer,
        initialization=initialization,
    ) as cluster:
        for index, address in enumerate(cluster.ps_addresses):
            assert health_of(address) == "SERVING"
            with RemoteParameterServer(address, replica_index=index, timeout=5) as shard:
                assert shard.status().optimizer == optimizer.to_dict()
                ids = np.arange(2, dtype=np.uint64)
                rows = shard.lookup(ids, 4, train=True)  # the initialization was sent too
                np.testing.assert_array_equal(rows, initial_vectors(ids, 4, initialization))
        cluster.kill_shard(1)
        address = cluster.restart_shard(1, timeout=30)
        assert address == cluster.ps_addresses[1] and health_of(address) == "SERVING"

    with LocalCluster(
        embedding_config, num_shards=1, num_workers=0, log_dir=tmp_path / "untrained"
    ) as cluster:  # no optimizer: left for the trainer to configure
        assert health_of(cluster.ps_addresses[0]) == "NOT_SERVING"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"num_shards": 0}, "need at least one shard"),
        ({"num_workers": -1}, "non-negative number of workers"),
        ({"initialization": InitializationConfig()}, "give optimizer too"),
    ],
)
def test_a_cluster_that_cannot_start_is_refused_before_any_process(tmp_path, arguments, message):
    with pytest.raises(ValueError, match=message):
        LocalCluster(tmp_path / "embedding.yml", log_dir=tmp_path / "logs", **arguments)
    assert not (tmp_path / "logs").exists()


def test_a_cluster_of_shards_without_workers_is_allowed(tmp_path):
    cluster = LocalCluster(tmp_path / "embedding.yml", num_workers=0, log_dir=tmp_path / "logs")
    assert (cluster.num_shards, cluster.num_workers, cluster.worker_addresses) == (2, 0, [])
    assert cluster.stop() == {}  # nothing was started, nothing to stop


def test_a_reused_log_gives_the_address_the_new_process_prints(tmp_path):
    """Logs are appended to: a cluster started again with the same ``log_dir`` must not take
    the address an earlier run printed (nothing listens there any more)."""
    log = tmp_path / "ps-0.log"
    log.write_text("recserve parameter server listening on 127.0.0.1:1111\n")
    script = "import time; time.sleep(0.3); print('listening on 127.0.0.1:2222', flush=True)"
    process = ManagedProcess("parameter server 0", [sys.executable, "-c", script], log)
    process.start(dict(os.environ))
    try:
        assert process.wait_for_address(30) == "127.0.0.1:2222"
    finally:
        process.stop(grace=10)
