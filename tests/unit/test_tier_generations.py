"""A load or clear through one embedding worker, and the forward contexts of the others.

The worker a load or clear goes through drops its own forward contexts; the tier's other
workers sharing the shards are not reached, and their contexts' gradients, computed against
the replaced rows, moved the new rows of the same IDs. Each shard now counts such
replacements in a row generation that train lookups carry back with their gradients
(``LookupResponse.generation``, ``UpdateRequest.generation``), and refuses older ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from embedding_store.batch import Batch, IDTypeFeatureWithSingleID
from embedding_store.config import JobType, embedding_config_from_mapping
from embedding_store.errors import FailedPreconditionError, UnavailableError
from embedding_store.grpc_common import add_servicer, pack_f32, pack_u64, server_options
from embedding_store.optimizers import SGD
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.ps_client import RemoteParameterServer
from embedding_store.ps_service import ParameterServerServicer
from embedding_store.remote_tier import RemoteShardTier
from embedding_store.shard import EmbeddingShard, RowBlock
from embedding_store.worker import EmbeddingWorker

DIM = 4
CONFIG = embedding_config_from_mapping({"slots_config": {"user": {"dim": DIM}}})
IDS = list(range(8))


def user_batch(ids: list[int]) -> Batch:
    return Batch([IDTypeFeatureWithSingleID.from_ids("user", ids)], requires_grad=False)


def ones(n: int) -> dict[str, torch.Tensor]:
    return {"user": torch.ones(n, DIM)}


def stale_message(rows: int, generation: int, now: int) -> str:
    return (
        f"gradients for {rows} rows (dim {DIM}) were computed against rows that a load or "
        f"clear of this shard has replaced since (their lookup's generation {generation}, "
        f"the shard's {now}): not applied (look the batch up again)"
    )


# --------------------------------------------------------------------------- the shard
def test_a_shard_refuses_gradients_of_a_generation_a_load_or_clear_replaced():
    shard = EmbeddingShard(100, optimizer=SGD(lr=1.0))
    ids = np.arange(3, dtype=np.uint64)
    grads = np.ones((3, DIM), np.float32)
    assert (shard.generation, shard.last_generation) == (1, None)
    shard.clear()  # no row was handed out for training: nothing to refuse later
    assert shard.generation == 1
    shard.lookup(ids, DIM, train=True)
    assert shard.last_generation == 1
    assert shard.update(ids, grads, generation=1) == 3
    rows = shard.export_rows(DIM)
    shard.replace_rows([rows])  # a load
    assert shard.generation == 2
    with pytest.raises(FailedPreconditionError) as refused:
        shard.update(ids, grads, generation=1)
    assert refused.value.message == stale_message(3, 1, 2)
    np.testing.assert_array_equal(shard.export_rows(DIM).weights, rows.weights)  # unmoved
    assert shard.update(ids, grads) == 3  # not said (a worker that predates it): as ever
    shard.clear()  # no train lookup since the load: the same generation
    assert shard.generation == 2
    shard.lookup(ids, DIM, train=True)
    shard.clear()
    assert (shard.generation, shard.last_generation) == (3, 2)
    assert shard.stats().stale_updates == 3


def test_a_restarted_shard_s_start_up_load_keeps_the_first_generation():
    """A shard restarted with its checkpoint takes the updates sent again while it loaded
    (ps_service: NOT_LOADED_YET): its start-up load replaced no row a lookup had read."""
    shard = EmbeddingShard(100, optimizer=SGD(lr=1.0))
    ids = np.arange(3, dtype=np.uint64)
    shard.replace_rows([RowBlock(ids, np.zeros((3, DIM), np.float32), None)])
    assert shard.generation == 1
    assert shard.update(ids, np.ones((3, DIM), np.float32), generation=1) == 3


def test_a_clear_of_shared_shards_refuses_another_in_process_worker_s_backward():
    """Two workers over the same in-process shard: the clear goes through one of them (it
    drops its own contexts); the other's backward no longer moves the fresh rows."""
    shard = EmbeddingShard(100, optimizer=SGD(lr=1.0))
    trainer, admin = EmbeddingWorker(CONFIG, [shard]), EmbeddingWorker(CONFIG, [shard])
    stale = trainer.lookup(user_batch(IDS), train=True)
    shard.clear()
    admin.invalidate_forward_contexts("a clear of the embedding tier")
    fresh = admin.lookup(user_batch(IDS), train=True).slots[0].embeddings
    with pytest.raises(FailedPreconditionError) as refused:
        trainer.backward(stale.ref, ones(len(IDS)))
    assert refused.value.message == stale_message(len(IDS), 1, 2)
    after = admin.lookup(user_batch(IDS), train=False).slots[0].embeddings
    torch.testing.assert_close(after, fresh, rtol=0, atol=0)


# --------------------------------------------------------------------------- over gRPC
@pytest.fixture
def shard_addresses() -> Iterator[tuple[list[str], list[EmbeddingShard]]]:
    """Two real ParameterServerServicers (SGD, lr 1) behind gRPC in this process."""
    shards = [
        EmbeddingShard(1000, optimizer=SGD(lr=1.0), replica_index=i, replica_size=2)
        for i in range(2)
    ]
    servers, addresses = [], []
    for shard in shards:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=server_options())
        servicer = ParameterServerServicer(shard, CONFIG, job_type=JobType.TRAIN)
        add_servicer(server, servicer, "ParameterServer")
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    try:
        yield addresses, shards
    finally:
        for server in servers:
            server.stop(None)


@pytest.mark.parametrize("action", ["clear", "load"])
def test_a_load_or_clear_through_one_worker_refuses_another_worker_s_stale_gradients(
    action, shard_addresses, tmp_path: Path
):
    addresses, shards = shard_addresses
    trainer = RemoteShardTier(CONFIG, addresses, shard_timeout=10.0)
    admin = RemoteShardTier(CONFIG, addresses, shard_timeout=10.0)
    try:
        if action == "load":
            admin.lookup(user_batch(IDS), train=True)
            admin.dump(tmp_path / "ckpt")
        stale = trainer.lookup(user_batch(IDS), train=True)
        if action == "load":
            admin.load(tmp_path / "ckpt")
        else:
            admin.clear()
        fresh = admin.lookup(user_batch(IDS), train=True).slots[0].embeddings
        trainer.backward(stale.ref, ones(len(IDS)))  # its context is not the admin's
        with pytest.raises(UnavailableError) as failed:
            trainer.flush()
        rows = shards[0].stats().stale_updates
        assert failed.value.message == (
            "1 gradient batch(es) could not be applied since the last flush; last error: "
            f"parameter server {addresses[0]} (shard 0): {stale_message(rows, 1, 2)}"
        )
        assert rows + shards[1].stats().stale_updates == len(IDS)
        after = admin.lookup(user_batch(IDS), train=False).slots[0].embeddings
        torch.testing.assert_close(after, fresh, rtol=0, atol=0)
        # Looked up again, the batch trains.
        again = trainer.lookup(user_batch(IDS), train=True)
        trainer.backward(again.ref, ones(len(IDS)))
        trainer.flush()
        assert [shard.generation for shard in shards] == [2, 2]
    finally:
        trainer.close()
        admin.close()


class _ShardBeforeGenerations:
    """A shard's stub whose lookups answer without a generation, as a shard that predates
    LookupResponse.generation."""

    def __init__(self, stub: object) -> None:
        self._stub = stub

    def Lookup(self, request: pb.LookupRequest, timeout: float | None = None) -> object:
        answer = self._stub.Lookup(request, timeout=timeout)
        answer.ClearField("generation")
        return answer

    def __getattr__(self, name: str) -> object:
        return getattr(self._stub, name)


def test_peers_that_predate_generations_still_work_together(shard_addresses):
    """Wire compatibility: an update without a generation (from a worker that predates it)
    is applied as ever; a worker whose shard answers without one sends its updates without
    one, also applied as ever."""
    addresses, shards = shard_addresses
    ids = np.array([2, 4], dtype=np.uint64)
    grads = np.ones((2, DIM), np.float32)
    with RemoteParameterServer(addresses[0], replica_index=0, replica_size=2) as client:
        client.lookup(ids, DIM, train=True)
        assert client.last_generation == 1
        client.clear()
        client.lookup(ids, DIM, train=True)
        assert (client.last_generation, shards[0].generation) == (2, 2)
        before = client.lookup(ids, DIM, train=False)
        assert client.last_generation is None  # an eval lookup's answer says none
        old_worker = pb.UpdateRequest(
            ids=pack_u64(ids), grads=pack_f32(grads), dim=DIM, replica_index=0, replica_size=2
        )
        assert client._stub.Update(old_worker, timeout=10).rows_updated == 2
        np.testing.assert_array_equal(client.lookup(ids, DIM, train=False), before - 1.0)

        client._stub = _ShardBeforeGenerations(client._stub)
        worker = EmbeddingWorker(CONFIG, [client])
        stale = worker.lookup(user_batch([2, 4]), train=True)
        assert client.last_generation is None
        client.clear()
        worker.lookup(user_batch([2, 4]), train=True)
        assert worker.backward(stale.ref, ones(2)).rows_pushed == 2
        assert shards[0].stats().stale_updates == 0
