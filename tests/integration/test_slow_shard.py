"""A shard that stops answering (SIGSTOP: the process is alive, its port open, nothing comes
back) must give the worker's callers DEADLINE_EXCEEDED naming the shard within the shard
deadline, never a hang; gradients pushed meanwhile are reported as failed on flush; once the
shard runs again (SIGCONT) the same worker serves it without a restart."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import yaml

from embedding_store.batch import Batch, IDTypeFeatureWithSingleID
from embedding_store.config import EmbeddingConfig, load_embedding_config
from embedding_store.errors import DeadlineExceededError, UnavailableError
from embedding_store.launcher import LocalCluster
from embedding_store.optimizers import SGD
from embedding_store.worker_client import RemoteEmbeddingWorker

SHARD_DEADLINE = 1.0  # seconds, the worker's deadline for each shard call


def _batch() -> Batch:
    # IDs 0..63 hash to both shards (checked below), so every lookup needs shard 1.
    return Batch(
        [IDTypeFeatureWithSingleID("user", np.arange(64, dtype=np.uint64))], requires_grad=False
    )


@pytest.fixture(scope="module")
def _cluster(tmp_path_factory) -> Iterator[tuple[LocalCluster, EmbeddingConfig]]:
    """One tier for the module (starting one takes seconds): each test stalls a shard and
    lets it run again; both train the same 64 IDs with the same optimizer."""
    root = tmp_path_factory.mktemp("slow-shard")
    embedding = root / "embedding_config.yml"
    embedding.write_text(yaml.safe_dump({"slots_config": {"user": {"dim": 4}}}))
    cluster = LocalCluster(
        embedding, num_shards=2, log_dir=root / "logs", shard_timeout=SHARD_DEADLINE
    )
    cluster.start(timeout=120)
    try:
        yield cluster, load_embedding_config(embedding)
    finally:
        cluster.stop()


@pytest.fixture()
def stalled_cluster(_cluster):
    """(cluster, embedding config, PIDs the test stopped): whatever the test stopped runs
    again when it ends."""
    cluster, config = _cluster
    stopped: list[int] = []
    try:
        yield cluster, config, stopped
    finally:
        for pid in stopped:  # never leave a stopped process behind
            os.kill(pid, signal.SIGCONT)


@pytest.mark.timeout(120)
def test_stalled_shard_gives_deadline_exceeded_then_recovers(stalled_cluster):
    cluster, config, stopped = stalled_cluster
    with RemoteEmbeddingWorker(cluster.worker_addresses[0], config, timeout=30) as remote:
        remote.configure(optimizer=SGD(lr=0.5))
        trained = remote.lookup(_batch(), train=True)
        remote.backward(trained.ref, {"user": torch.ones(64, 4)})
        remote.flush()
        expected = remote.lookup(_batch(), train=False).slots[0].embeddings
        rows = remote.status().rows_per_shard
        assert sum(rows) == 64 and min(rows) > 0  # both shards hold some of the IDs

        pid = cluster.shards[1].process.pid
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

        started = time.monotonic()
        with pytest.raises(DeadlineExceededError) as failure:
            remote.lookup(_batch(), train=False)
        waited = time.monotonic() - started
        assert SHARD_DEADLINE * 0.9 <= waited < SHARD_DEADLINE + 5  # the deadline, no hang
        assert "shard 1" in failure.value.message
        assert cluster.ps_addresses[1] in failure.value.message
        # A caller with less time than the shard deadline (a server's --lookup-timeout) is
        # told which shard too, not only that the worker did not answer.
        address = cluster.worker_addresses[0]
        with (
            RemoteEmbeddingWorker(address, config, timeout=SHARD_DEADLINE / 2) as hurried,
            pytest.raises(DeadlineExceededError) as hurried_failure,
        ):
            hurried.lookup(_batch(), train=False)
        assert f"parameter server {cluster.ps_addresses[1]} (shard 1)" in (
            hurried_failure.value.message
        )

        os.kill(pid, signal.SIGCONT)
        stopped.remove(pid)
        after = remote.lookup(_batch(), train=False).slots[0].embeddings
        assert torch.equal(after, expected)  # same rows, same worker, no restart


@pytest.mark.timeout(120)
def test_gradients_for_a_stalled_shard_fail_on_flush_not_hang(stalled_cluster):
    cluster, config, stopped = stalled_cluster
    with RemoteEmbeddingWorker(cluster.worker_addresses[0], config, timeout=30) as remote:
        remote.configure(optimizer=SGD(lr=0.5))
        trained = remote.lookup(_batch(), train=True)  # forward while the shard answers

        pid = cluster.shards[1].process.pid
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)
        remote.backward(trained.ref, {"user": torch.ones(64, 4)})  # only queued
        started = time.monotonic()
        with pytest.raises(UnavailableError) as failure:
            remote.flush()
        assert time.monotonic() - started < SHARD_DEADLINE + 10
        assert "1 gradient batch(es) could not be applied" in failure.value.message
        assert cluster.ps_addresses[1] in failure.value.message

        os.kill(pid, signal.SIGCONT)
        stopped.remove(pid)
        trained = remote.lookup(_batch(), train=True)
        remote.backward(trained.ref, {"user": torch.ones(64, 4)})
        remote.flush()  # pushes work again
