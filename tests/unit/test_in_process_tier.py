"""The embedded tier (shards and worker core in this process): every shard takes part in
configure, clear, dump and load, and its status and progress reports say so."""

from __future__ import annotations

import pytest
import torch

from embedding_store.errors import FailedPreconditionError, NotFoundError, RecserveError
from embedding_store.initializer import InitializationConfig
from embedding_store.optimizers import SGD, Adam
from embedding_store.tier import InProcessEmbeddingTier
from tests.unit.test_worker_service import CONFIG, DIM, ones, user_batch


def test_status_rows_capacity_and_nonfinite_rows_of_every_shard():
    with InProcessEmbeddingTier(CONFIG, capacity=100, num_shards=3, optimizer=SGD(lr=1.0)) as tier:
        result = tier.lookup(user_batch(list(range(30))), train=True)
        grads = ones(30)["user"]
        grads[[0, 7]] = float("nan")
        stats = tier.backward(result.ref, {"user": grads})
        assert stats.nonfinite_rows_skipped == 2
        status = tier.status()
        assert sum(status.rows_per_shard) == 30 and all(status.rows_per_shard)
        assert status.capacity_per_shard == (100, 100, 100)
        assert status.nonfinite_rows_skipped == 2
        assert (status.pending_backward, status.pending_gradient_batches) == (0, 0)


def test_configure_and_clear_reach_every_shard():
    with InProcessEmbeddingTier(CONFIG, num_shards=3, optimizer=SGD(lr=1.0)) as tier:
        tier.configure(optimizer=SGD(lr=0.25))
        assert [s.optimizer.to_dict() for s in tier.shards] == [SGD(lr=0.25).to_dict()] * 3
        tier.lookup(user_batch(list(range(30))), train=True)
        assert all(tier.status().rows_per_shard)
        tier.clear()
        assert tier.status().rows_per_shard == (0, 0, 0)


def test_dump_and_load_report_their_progress_once_done(tmp_path):
    with InProcessEmbeddingTier(CONFIG, num_shards=3, optimizer=SGD(lr=1.0)) as tier:
        result = tier.lookup(user_batch(list(range(30))), train=True)
        tier.backward(result.ref, {"user": torch.full((30, DIM), 0.5)})
        expected = tier.lookup(user_batch(list(range(30))), train=False).slots[0].embeddings
        seen = []
        tier.dump(tmp_path / "ckpt", progress=lambda *step: seen.append(step))
        assert seen == [("dump", 3, 3)]
    with InProcessEmbeddingTier(CONFIG, num_shards=3, read_only=True) as served:
        seen = []
        served.load(tmp_path / "ckpt", progress=lambda *step: seen.append(step))
        assert seen == [("load", 3, 3)]
        assert served.status().rows_per_shard == tier.status().rows_per_shard
        answer = served.lookup(user_batch(list(range(30))), train=False).slots[0].embeddings
        torch.testing.assert_close(answer, expected, rtol=0, atol=0)


def test_shards_are_the_replicas_of_one_tier_and_a_dump_writes_each_part(tmp_path):
    with InProcessEmbeddingTier(CONFIG, num_shards=3, optimizer=SGD(lr=1.0)) as tier:
        assert [(s.replica_index, s.replica_size) for s in tier.shards] == [(0, 3), (1, 3), (2, 3)]
        tier.lookup(user_batch(list(range(30))), train=True)
        manifest = tier.dump(tmp_path / "ckpt")
        assert sorted({entry.shard for entry in manifest.files}) == [0, 1, 2]
        with pytest.raises(RecserveError):  # an existing checkpoint is kept ...
            tier.dump(tmp_path / "ckpt")
        tier.dump(tmp_path / "ckpt", overwrite=True)  # ... unless it is to be replaced
    with InProcessEmbeddingTier(CONFIG, num_shards=3, read_only=True) as served:
        assert served.status().shard_checkpoint_versions == ("",) * 3
        loaded = served.load(tmp_path / "ckpt")
        assert loaded.version
        assert served.status().shard_checkpoint_versions == (loaded.version,) * 3


def test_initialization_given_at_start_or_configured_later_makes_new_rows():
    """New rows are drawn from [low, high) of the initialization in force: disjoint ranges
    tell which one made them."""
    at_start = InitializationConfig(low=0.25, high=0.5)
    with InProcessEmbeddingTier(
        CONFIG, num_shards=2, optimizer=SGD(), initialization=at_start
    ) as tier:
        rows = tier.lookup(user_batch([1, 2, 3]), train=True).slots[0].embeddings
        assert rows.min() >= 0.25 and rows.max() < 0.5
        tier.configure(initialization=InitializationConfig(low=-0.5, high=-0.25))
        rows = tier.lookup(user_batch([4, 5, 6]), train=True).slots[0].embeddings
        assert rows.min() >= -0.5 and rows.max() < -0.25


def test_status_counts_train_lookups_waiting_for_their_gradients_up_to_the_buffer():
    with InProcessEmbeddingTier(CONFIG, optimizer=SGD(), forward_buffer_size=2) as tier:
        refs = [tier.lookup(user_batch([i]), train=True).ref for i in range(3)]
        assert tier.status().pending_backward == 2  # the oldest context expired
        with pytest.raises(NotFoundError, match="forward_buffer_size=2"):
            tier.backward(refs[0], ones(1))
        tier.backward(refs[2], ones(1))
        assert tier.status().pending_backward == 1


@pytest.mark.parametrize("num_shards", [1, 3])
def test_an_id_twice_in_a_batch_gets_one_adam_step_with_the_summed_gradient(num_shards):
    """ID 5 in samples 0 and 1 (gradients 1 and 2) and ID 7 in sample 2 (gradient 4): one
    Adam step each (t=1, not one per occurrence), with g = 3 and g = 4. With eps = 1:
    w -= lr * g / (|g| + 1), i.e. 0.75 and 0.8 times lr."""
    adam = Adam(lr=0.5, betas=(0.5, 0.75), eps=1.0)
    with InProcessEmbeddingTier(CONFIG, num_shards=num_shards, optimizer=adam) as tier:
        batch = user_batch([5, 5, 7])
        before = tier.lookup(batch, train=True)
        grads = torch.tensor([1.0, 2.0, 4.0]).repeat_interleave(DIM).reshape(3, DIM)
        tier.backward(before.ref, {"user": grads})
        after = tier.lookup(batch, train=False).slots[0].embeddings
        start = before.slots[0].embeddings
        expected = start - 0.5 * torch.tensor([[0.75], [0.75], [0.8]])
        torch.testing.assert_close(after, expected, rtol=0, atol=1e-7)
        states = [
            row.tolist()
            for shard in tier.shards
            for dim in shard.dims()
            for row in shard.export_rows(dim).state
        ]
    # [m (DIM) | v (DIM) | t] per row: m = 0.5 g, v = 0.25 g^2, t = 1
    assert sorted(states) == [[1.5] * DIM + [2.25] * DIM + [1.0], [2.0] * DIM + [4.0] * DIM + [1.0]]


def test_a_backward_for_a_lookup_made_before_a_clear_is_refused():
    """Its gradients, computed against the cleared rows, moved the fresh rows of the same
    IDs (initialized again at the next lookup)."""
    ids = list(range(6))
    with InProcessEmbeddingTier(CONFIG, num_shards=2, optimizer=SGD(lr=1.0)) as tier:
        stale = tier.lookup(user_batch(ids), train=True)
        tier.clear()
        fresh = tier.lookup(user_batch(ids), train=False).slots[0].embeddings
        with pytest.raises(FailedPreconditionError) as refused:
            tier.backward(stale.ref, ones(len(ids)))
        assert refused.value.message == (
            f"forward context {stale.ref} was taken before a clear of the embedding tier "
            "replaced the rows it looked up: its gradients were computed against the old rows "
            "and are not applied (look the batch up again)"
        )
        after = tier.lookup(user_batch(ids), train=False).slots[0].embeddings
        torch.testing.assert_close(after, fresh, rtol=0, atol=0)
        assert tier.status().pending_backward == 0


def test_a_backward_for_a_lookup_made_before_a_load_is_refused(tmp_path):
    """Its gradients, computed against the rows the load replaced, moved the loaded rows of
    the same IDs."""
    ids = list(range(6))
    with InProcessEmbeddingTier(CONFIG, num_shards=2, optimizer=SGD(lr=1.0)) as tier:
        tier.lookup(user_batch(ids), train=True)
        tier.dump(tmp_path / "ckpt")
        loaded = tier.lookup(user_batch(ids), train=False).slots[0].embeddings
        stale = tier.lookup(user_batch(ids), train=True)
        tier.load(tmp_path / "ckpt")
        with pytest.raises(FailedPreconditionError) as refused:
            tier.backward(stale.ref, ones(len(ids)))
        assert refused.value.message == (
            f"forward context {stale.ref} was taken before the load of embedding checkpoint "
            f"{tmp_path / 'ckpt'} replaced the rows it looked up: its gradients were computed "
            "against the old rows and are not applied (look the batch up again)"
        )
        after = tier.lookup(user_batch(ids), train=False).slots[0].embeddings
        torch.testing.assert_close(after, loaded, rtol=0, atol=0)
        assert tier.status().pending_backward == 0
