"""The worker core pools and scatters exactly like torch.nn.EmbeddingBag / autograd."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from embedding_store.batch import Batch, IDTypeFeature, IDTypeFeatureWithSingleID, Label
from embedding_store.config import embedding_config_from_mapping
from embedding_store.errors import (
    BatchValidationError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from embedding_store.hashing import shard_of
from embedding_store.optimizers import SGD, Adam
from embedding_store.shard import EmbeddingShard
from embedding_store.worker import EmbeddingWorker, _scatter_to_unique, hash_stack

DIM = 4


def make_config(**slot_overrides):
    slots = {
        "user": {"dim": DIM},
        "items": {"dim": DIM, "sqrt_scaling": True},
        "history": {"dim": DIM, "embedding_summation": False, "sample_fixed_size": 3},
        "city": {"dim": 2},
    }
    for name, extra in slot_overrides.items():
        slots[name].update(extra)
    return embedding_config_from_mapping(
        {"slots_config": slots, "feature_groups": {"people": ["user", "items"]}}
    )


def make_batch() -> Batch:
    return Batch(
        [
            IDTypeFeature.from_lists("user", [[1], [2, 2], [], [7]]),
            IDTypeFeature.from_lists("items", [[10, 11, 12], [], [10], [1, 10]]),
            IDTypeFeature.from_lists("history", [[5, 6, 7, 8], [5], [], [9, 9]]),
            IDTypeFeatureWithSingleID.from_ids("city", [3, 3, 4, 5]),
        ],
        labels=[Label(np.zeros((4, 1), np.float32))],
    )


def make_worker(
    config, num_shards: int, deduplicate: bool | None = None
) -> tuple[EmbeddingWorker, list[EmbeddingShard]]:
    shards = [
        EmbeddingShard(10_000, optimizer=SGD(lr=1.0), replica_index=i, replica_size=num_shards)
        for i in range(num_shards)
    ]
    return EmbeddingWorker(config, shards, deduplicate=deduplicate), shards


def table_ids(config, slot: str, raw: np.ndarray) -> np.ndarray:
    prefix = np.uint64(config.index_prefix(slot))
    return (raw.astype(np.uint64) & np.uint64(config.id_mask)) | prefix


def reference_rows(shards, ids: np.ndarray, dim: int) -> np.ndarray:
    """Rows as stored on their owning shards (eval lookups never insert)."""
    owner = shard_of(ids, len(shards))
    out = np.zeros((len(ids), dim), np.float32)
    for s, shard in enumerate(shards):
        picked = np.flatnonzero(owner == s)
        out[picked] = shard.lookup(ids[picked], dim, train=False)
    return out


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("deduplicate", [False, True])
def test_pooling_matches_embedding_bag(num_shards, deduplicate):
    config = make_config()
    worker, shards = make_worker(config, num_shards, deduplicate)
    batch = make_batch()
    result = worker.lookup(batch, train=True)
    assert [s.name for s in result.slots] == ["user", "items", "history", "city"]

    for name, mode_weights in [("user", False), ("items", True)]:
        feature = batch.id_feature(name)
        ids = table_ids(config, name, feature.values)
        rows = torch.from_numpy(reference_rows(shards, ids, DIM))
        bag = torch.nn.EmbeddingBag.from_pretrained(rows, mode="sum")
        weights = None
        if mode_weights:
            lengths = np.maximum(feature.lengths, 1).astype(np.float32)
            weights = torch.from_numpy(np.repeat(1 / np.sqrt(lengths), feature.lengths))
        expected = bag(
            torch.arange(len(ids)),
            torch.from_numpy(feature.offsets[:-1].copy()),
            per_sample_weights=weights,
        )
        assert torch.equal(result.slot(name).embeddings, expected)
    # Empty sample pools to zeros.
    assert torch.equal(result.slot("user").embeddings[2], torch.zeros(DIM))

    history = result.slot("history")
    assert history.embeddings.shape == (4, 3, DIM)
    assert history.mask.tolist() == [
        [True, True, True],
        [True, False, False],
        [False, False, False],
        [True, True, False],
    ]
    first = reference_rows(shards, table_ids(config, "history", np.array([5, 6, 7])), DIM)
    np.testing.assert_array_equal(history.embeddings[0].numpy(), first)
    assert torch.equal(history.embeddings[2], torch.zeros(3, DIM))
    city = result.slot("city")
    assert city.embeddings.shape == (4, 2)
    torch.testing.assert_close(city.embeddings[0], city.embeddings[1], rtol=0, atol=0)


def test_feature_group_shares_id_space():
    config = make_config()
    worker, shards = make_worker(config, 1)
    batch = Batch(
        [
            IDTypeFeature.from_lists("user", [[42]]),
            IDTypeFeature.from_lists("items", [[42]]),
            IDTypeFeature.from_lists("history", [[42]]),
        ],
        requires_grad=False,
    )
    result = worker.lookup(batch, train=True)
    user = result.slot("user").embeddings[0]
    # user and items are one group: ID 42 is the same row; history is its own ID space.
    torch.testing.assert_close(result.slot("items").embeddings[0], user, rtol=0, atol=0)
    assert not torch.equal(result.slot("history").embeddings[0, 0], user)
    assert shards[0].size() == 2


@pytest.mark.parametrize("num_shards", [1, 2])
@pytest.mark.parametrize("deduplicate", [False, True])
def test_backward_matches_autograd(num_shards, deduplicate):
    config = make_config()
    worker, shards = make_worker(config, num_shards, deduplicate)
    batch = make_batch()
    result = worker.lookup(batch, train=True)

    # Dense reference: one EmbeddingBag per slot over the rows the worker used, autograd grads.
    generator = torch.Generator().manual_seed(0)
    grads = {s.name: torch.randn(s.embeddings.shape, generator=generator) for s in result.slots}
    expected_after: dict[bytes, np.ndarray] = {}
    before: dict[bytes, np.ndarray] = {}
    accumulated: dict[bytes, np.ndarray] = {}
    for name in ["user", "items", "history", "city"]:
        feature = batch.id_feature(name)
        slot_cfg = config.slots_config[name]
        ids = table_ids(config, name, feature.values)
        rows = torch.from_numpy(reference_rows(shards, ids, slot_cfg.dim)).requires_grad_()
        if slot_cfg.embedding_summation:
            weights = None
            if slot_cfg.sqrt_scaling:
                lengths = np.maximum(feature.lengths, 1).astype(np.float32)
                weights = torch.from_numpy(np.repeat(1 / np.sqrt(lengths), feature.lengths))
            out = torch.nn.functional.embedding_bag(
                torch.arange(len(ids)),
                rows,
                torch.from_numpy(feature.offsets[:-1].copy()),
                mode="sum",
                per_sample_weights=weights,
            )
        else:
            fixed = slot_cfg.sample_fixed_size
            out = torch.zeros(feature.batch_size, fixed, slot_cfg.dim)
            for b, (start, stop) in enumerate(zip(feature.offsets[:-1], feature.offsets[1:])):
                take = min(stop - start, fixed)
                out[b, :take] = rows[start : start + take]
        (out * grads[name]).sum().backward()
        used = np.ones(len(ids), bool)
        if not slot_cfg.embedding_summation:  # IDs past sample_fixed_size are truncated
            position = np.arange(len(ids)) - np.repeat(feature.offsets[:-1], feature.lengths)
            used = position < slot_cfg.sample_fixed_size
        for i, key in enumerate(ids):
            if not used[i]:
                continue
            k = int(key).to_bytes(8, "little")
            before[k] = rows.detach()[i].numpy().copy()
            accumulated[k] = accumulated.get(k, 0) + rows.grad[i].numpy()
    for k, g in accumulated.items():
        expected_after[k] = before[k] - g  # SGD with lr = 1

    stats = worker.backward(result.ref, grads)
    assert stats.rows_pushed == len(expected_after)
    assert stats.nonfinite_rows_skipped == 0
    for k, expected in expected_after.items():
        key = np.array([int.from_bytes(k, "little")], dtype=np.uint64)
        got = reference_rows(shards, key, len(expected))[0]
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def test_nonfinite_gradients_are_skipped_and_counted():
    config = make_config()
    worker, _ = make_worker(config, 2)
    batch = make_batch()
    result = worker.lookup(batch, train=True)
    grads = {s.name: torch.zeros(s.embeddings.shape) for s in result.slots}
    grads["city"][0, 0] = float("nan")  # city ID 3 appears in samples 0 and 1
    grads["city"][2, 1] = float("inf")  # city ID 4
    snapshot = worker.lookup(batch, train=False)
    stats = worker.backward(result.ref, grads)
    assert stats.nonfinite_rows_skipped == 2
    assert worker.nonfinite_rows_skipped == 2
    after = worker.lookup(batch, train=False)
    for a, b in zip(snapshot.slots, after.slots):
        assert torch.equal(a.embeddings, b.embeddings)  # zero grads elsewhere: nothing moved


def _rows_by_id(shard: EmbeddingShard, dim: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    block = shard.export_rows(dim)
    return {
        int(i): (block.weights[k].copy(), block.state[k].copy()) for k, i in enumerate(block.ids)
    }


def test_slots_left_out_of_the_gradients_train_nothing():
    """torch.optim.Adam skips parameters without a gradient; a zero gradient would not: the
    moments would move the row and its step count would grow. So a slot left out of
    ``grads`` pushes none of its rows, while an ID it shares with a slot that has a gradient
    gets exactly that slot's gradient."""
    config = make_config()  # "user" and "items" share one ID space (feature group "people")
    shard = EmbeddingShard(10_000, optimizer=Adam(lr=0.1))
    worker = EmbeddingWorker(config, [shard])
    batch = Batch(
        [
            IDTypeFeature.from_lists("user", [[42], [7]]),
            IDTypeFeature.from_lists("items", [[42], [99]]),
            IDTypeFeatureWithSingleID.from_ids("city", [3, 4]),
        ],
        requires_grad=False,
    )
    first = worker.lookup(batch, train=True)  # inserts rows 42, 7, 99 and the cities
    first_grads = {s.name: torch.ones(s.embeddings.shape) for s in first.slots}
    first_grads["user"][0] = 0.0  # so rows 42 and 99 share their history (a gradient of 1)
    worker.backward(first.ref, first_grads)
    before = _rows_by_id(shard, DIM) | _rows_by_id(shard, 2)
    user_only = int(table_ids(config, "user", np.array([7]))[0])
    assert before[user_only][1][-1] == 1.0  # Adam state [m | v | t]: one step so far

    second = worker.lookup(batch, train=True)
    items_grad = torch.full(second.slot("items").embeddings.shape, 0.5)
    stats = worker.backward(second.ref, {"items": items_grad})
    after = _rows_by_id(shard, DIM) | _rows_by_id(shard, 2)

    shared = int(table_ids(config, "items", np.array([42]))[0])
    items_only = int(table_ids(config, "items", np.array([99]))[0])
    cities = [int(i) for i in table_ids(config, "city", np.array([3, 4]))]
    assert stats.rows_pushed == 2  # 42 and 99 only
    for row in [user_only, *cities]:
        assert np.array_equal(after[row][0], before[row][0])  # weights
        assert np.array_equal(after[row][1], before[row][1])  # Adam moments and step count
    # The shared row got items' gradient (0.5) alone, as row 99 did: the same Adam state.
    for row in (shared, items_only):
        assert not np.array_equal(after[row][0], before[row][0])
        assert after[row][1][-1] == 2.0
    np.testing.assert_array_equal(after[shared][1], after[items_only][1])


def test_no_gradients_drop_the_context_and_move_no_row():
    """``grads={}`` is how a trainer skips a batch (non-finite gradients): the context is
    used up, no row or optimizer state changes."""
    config = make_config()
    shard = EmbeddingShard(10_000, optimizer=Adam(lr=0.1, weight_decay=0.5))
    worker = EmbeddingWorker(config, [shard])
    batch = make_batch()
    first = worker.lookup(batch, train=True)
    worker.backward(first.ref, {s.name: torch.ones(s.embeddings.shape) for s in first.slots})
    before = {dim: _rows_by_id(shard, dim) for dim in (DIM, 2)}
    second = worker.lookup(batch, train=True)
    stats = worker.backward(second.ref, {})
    assert stats.rows_pushed == 0
    for dim in (DIM, 2):
        after = _rows_by_id(shard, dim)
        assert after.keys() == before[dim].keys()
        for row, (weights, state) in before[dim].items():
            assert np.array_equal(after[row][0], weights)
            assert np.array_equal(after[row][1], state)
    with pytest.raises(NotFoundError):
        worker.backward(second.ref, {})


def test_backward_errors_name_the_problem():
    config = make_config()
    worker, _ = make_worker(config, 1)
    result = worker.lookup(make_batch(), train=True)
    with pytest.raises(InvalidArgumentError, match=r"slot 'user'.*shape"):
        worker.backward(result.ref, {"user": torch.zeros(3, DIM)})
    with pytest.raises(NotFoundError, match="no forward context"):
        worker.backward(10_000, {})


def test_bad_gradients_are_refused_before_any_row_moves():
    # "city" (dim 2) and the dim-4 slots are separate groups, pushed one after the other:
    # a bad gradient in one must not leave the other group's update applied.
    config = make_config()
    worker, _ = make_worker(config, 2)
    batch = make_batch()
    before = worker.lookup(batch, train=True)
    good = {s.name: torch.ones(s.embeddings.shape) for s in before.slots}
    for bad, match in (
        ({**good, "city": torch.ones(3, 2)}, r"slot 'city' has shape \(3, 2\); expected \(4, 2\)"),
        ({**good, "usr": torch.ones(4, DIM)}, r"gradients for slots \['usr'\] that this forward"),
    ):
        ref = worker.lookup(batch, train=True).ref
        with pytest.raises(InvalidArgumentError, match=match):
            worker.backward(ref, bad)
        after = worker.lookup(batch, train=False)
        for a, b in zip(before.slots, after.slots):
            assert torch.equal(a.embeddings, b.embeddings)
        # The forward context is still there: corrected gradients go through.
        assert worker.backward(ref, good).rows_pushed > 0
        before = worker.lookup(batch, train=False)


def test_gradients_that_require_grad_are_taken_as_data():
    worker, _ = make_worker(make_config(), 2)
    batch = make_batch()
    result = worker.lookup(batch, train=True)
    grads = {s.name: torch.ones(s.embeddings.shape, requires_grad=True) for s in result.slots}
    twin = worker.lookup(batch, train=True)
    stats = worker.backward(result.ref, grads)
    assert stats == worker.backward(twin.ref, {k: v.detach() for k, v in grads.items()})
    assert stats.rows_pushed > 0


def test_a_sequence_of_features_is_checked_as_a_batch_is():
    worker, _ = make_worker(make_config(), 1)
    user = IDTypeFeature.from_lists("user", [[1], [2]])
    for features, match in (
        ([user, IDTypeFeature.from_lists("user", [[3], [4]])], "duplicate feature name 'user'"),
        ([user, IDTypeFeature.from_lists("items", [[3]])], "has batch size 1 but"),
        ([IDTypeFeature.from_lists("user", [])], "empty batch"),
    ):
        with pytest.raises(BatchValidationError, match=match):
            worker.lookup(features, train=False)
    assert worker.lookup([user], train=False).slots[0].embeddings.shape == (2, DIM)


def test_forward_buffer_is_bounded():
    config = make_config()
    shards = [EmbeddingShard(1000, optimizer=SGD(lr=0.1))]
    worker = EmbeddingWorker(config, shards, forward_buffer_size=2)
    refs = [worker.lookup(make_batch(), train=True).ref for _ in range(3)]
    assert worker.pending_backward == 2
    assert worker.expired_forward_contexts == 1
    with pytest.raises(NotFoundError, match="forward_buffer_size=2"):
        worker.backward(refs[0], {})
    worker.backward(refs[2], {})
    assert worker.pending_backward == 1


def test_unknown_slot_is_rejected():
    worker, _ = make_worker(make_config(), 1)
    batch = Batch([IDTypeFeature.from_lists("nope", [[1]])], requires_grad=False)
    with pytest.raises(BatchValidationError, match="'nope' is not a slot"):
        worker.lookup(batch, train=False)


def test_eval_lookup_never_inserts():
    worker, shards = make_worker(make_config(), 2)
    result = worker.lookup(make_batch(), train=False)
    assert sum(s.size() for s in shards) == 0
    assert all(torch.count_nonzero(s.embeddings) == 0 for s in result.slots)
    assert result.ref is None


def test_hash_stack_expands_into_disjoint_ranges():
    ids = np.array([1, 2, 2**63 + 5], dtype=np.uint64)
    stacked = hash_stack(ids, rounds=3, embedding_size=100).reshape(3, 3)
    for r in range(3):
        assert np.all((stacked[:, r] >= 100 * r) & (stacked[:, r] < 100 * (r + 1)))
    assert np.array_equal(stacked[1], hash_stack(ids[1:2], 3, 100))


def test_hash_stacked_slot_sums_its_rounds():
    stack = {"hash_stack_config": {"hash_stack_rounds": 2, "embedding_size": 50}}
    config = make_config(user=stack, items=stack, history=stack)
    worker, shards = make_worker(config, 2)
    batch = Batch(
        [
            IDTypeFeature.from_lists("user", [[123456789, 987654321]]),
            IDTypeFeature.from_lists("history", [[123456789]]),
        ],
        requires_grad=False,
    )
    result = worker.lookup(batch, train=True)
    stacked = hash_stack(np.array([123456789, 987654321], np.uint64), 2, 50)
    rows = reference_rows(shards, table_ids(config, "user", stacked), DIM)
    np.testing.assert_allclose(result.slot("user").embeddings[0].numpy(), rows.sum(0), atol=1e-7)
    stacked = hash_stack(np.array([123456789], np.uint64), 2, 50)
    rows = reference_rows(shards, table_ids(config, "history", stacked), DIM)
    np.testing.assert_allclose(
        result.slot("history").embeddings[0, 0].numpy(), rows.sum(0), atol=1e-7
    )
    assert sum(s.size() for s in shards) == 6  # 3 IDs x 2 rounds, user/history separate


def _expected_slot(config, shards, feature, weights_by_length: bool) -> torch.Tensor:
    """One summation slot pooled by hand: eval rows of its table IDs + embedding_bag."""
    ids = table_ids(config, feature.name, feature.values)
    dim = config.slots_config[feature.name].dim
    rows = torch.from_numpy(reference_rows(shards, ids, dim))
    weights = None
    if weights_by_length:
        lengths = np.maximum(feature.lengths, 1).astype(np.float32)
        weights = torch.from_numpy(np.repeat(1 / np.sqrt(lengths), feature.lengths))
    return torch.nn.functional.embedding_bag(
        torch.arange(len(ids)),
        rows,
        torch.from_numpy(feature.offsets[:-1].copy()),
        mode="sum",
        per_sample_weights=weights,
    )


def test_one_in_process_shard_pools_inside_the_shard():
    config = make_config()
    worker, shards = make_worker(config, 1)

    def refuse(*args, **kwargs):
        raise AssertionError("the worker should call lookup_pooled, not lookup")

    shards[0].lookup = refuse  # instance attribute: the fused path must not need it
    batch = make_batch()
    train = worker.lookup(batch, train=True)
    infer = worker.lookup(batch, train=False)
    del shards[0].lookup
    for a, b in zip(train.slots, infer.slots):
        assert torch.equal(a.embeddings, b.embeddings)
    assert torch.equal(
        infer.slot("user").embeddings,
        _expected_slot(config, shards, batch.id_feature("user"), False),
    )
    assert torch.equal(
        infer.slot("items").embeddings,
        _expected_slot(config, shards, batch.id_feature("items"), True),
    )
    # dedup (or several shards) takes the gather + embedding_bag path: the same bits, sqrt
    # scaling included (both add weighted terms with a fused multiply-add)
    dedup = EmbeddingWorker(config, shards, deduplicate=True).lookup(batch, train=False)
    for a, b in zip(infer.slots, dedup.slots):
        assert torch.equal(a.embeddings, b.embeddings)


def test_plans_are_right_whatever_the_order_sizes_and_feature_types():
    """The per-slot-names plan cache must not leak layouts between different batches."""
    config = make_config()
    worker, shards = make_worker(config, 1)
    rng = np.random.default_rng(5)
    worker.lookup(
        Batch(
            [
                IDTypeFeature.from_lists("user", [list(range(40))]),
                IDTypeFeature.from_lists("items", [list(range(40))]),
                IDTypeFeature.from_lists("city", [list(range(40))]),
            ],
            requires_grad=False,
        ),
        train=True,
    )
    for step in range(12):
        size = int(rng.integers(1, 6))
        single = step % 2 == 0
        features = []
        for name in ("user", "items", "city"):
            if single:
                features.append(
                    IDTypeFeatureWithSingleID.from_ids(name, rng.integers(0, 50, size).tolist())
                )
            else:
                lists = [rng.integers(0, 50, rng.integers(0, 4)).tolist() for _ in range(size)]
                features.append(IDTypeFeature.from_lists(name, lists))
        if step % 3 == 0:
            features.reverse()
        batch = Batch(features, requires_grad=False)
        result = worker.lookup(batch, train=False)
        assert [s.name for s in result.slots] == [f.name for f in features]
        for feature in features:
            expected = _expected_slot(config, shards, feature, feature.name == "items")
            torch.testing.assert_close(
                result.slot(feature.name).embeddings, expected, rtol=0, atol=1e-7
            )


def test_gradient_scatter_equals_index_add_bit_for_bit():
    """The scatter kernel sums like zeros.index_add_(0, inverse, bag_grads[bag] * weights)."""
    config = make_config()
    worker, _ = make_worker(config, 1)
    rng = np.random.default_rng(2)
    lists = [rng.integers(0, 30, rng.integers(0, 6)).tolist() for _ in range(200)]
    batch = Batch(
        [
            IDTypeFeature.from_lists("user", lists),
            IDTypeFeature.from_lists("items", lists[::-1]),  # sqrt-weighted, same ID space
            IDTypeFeature.from_lists("history", lists),  # raw, truncated to 3
        ],
        requires_grad=False,
    )
    (plan,) = worker._plan(batch.id_type_features)
    bag_grads = torch.randn(plan.num_bags, DIM, generator=torch.Generator().manual_seed(0))
    bag_grads[5, 1] = float("nan")

    unique, unique_grads, finite = _scatter_to_unique(plan, bag_grads.numpy())

    bag_of_id = torch.repeat_interleave(
        torch.arange(plan.num_bags), torch.from_numpy(plan.bag_lengths)
    )
    per_id = bag_grads.index_select(0, bag_of_id) * plan.id_weights.unsqueeze(1)
    ref_unique, inverse = torch.unique(
        torch.from_numpy(plan.ids.view(np.int64)), return_inverse=True
    )
    expected = torch.zeros(len(ref_unique), DIM).index_add_(0, inverse, per_id)
    order = np.argsort(unique.view(np.int64))
    np.testing.assert_array_equal(unique.view(np.int64)[order], ref_unique.numpy())
    np.testing.assert_array_equal(unique_grads[order], expected.numpy())  # NaN == NaN here
    np.testing.assert_array_equal(finite[order], torch.isfinite(expected).all(dim=1).numpy())
    assert 0 < np.count_nonzero(~finite) < len(finite)
    # first occurrence order
    first = np.unique(plan.ids, return_index=True)[1]
    np.testing.assert_array_equal(unique, plan.ids[np.sort(first)])


@pytest.mark.parametrize("num_shards", [1, 2])
def test_unknown_ids_are_counted_per_lookup(num_shards):
    config = make_config()
    worker, _ = make_worker(config, num_shards)
    known = Batch([IDTypeFeature.from_lists("user", [[1], [2]])], requires_grad=False)
    assert worker.lookup(known, train=True).unknown_ids == 0
    mixed = Batch([IDTypeFeature.from_lists("user", [[1, 99], [2, 98, 97]])], requires_grad=False)
    assert worker.lookup(mixed, train=False).unknown_ids == 3
    assert worker.lookup(known, train=False).unknown_ids == 0


def test_sqrt_scaled_pooling_gives_the_same_bits_whatever_the_shard_count():
    # One in-process shard pools in its own kernel; three shards gather and call
    # embedding_bag. Rows start from the same per-ID initial vectors, so the answers must be
    # bit-equal, the 1/sqrt(n)-weighted slot included.
    config = make_config()
    rng = np.random.default_rng(3)
    lists = [list(rng.integers(0, 500, rng.integers(0, 9))) for _ in range(256)]
    batch = Batch(
        [IDTypeFeature.from_lists("items", lists)], labels=[Label(np.zeros((256, 1), np.float32))]
    )
    answers = []
    for num_shards in (1, 3):
        worker, _ = make_worker(config, num_shards)
        answers.append(worker.lookup(batch, train=True).slot("items").embeddings)
    assert torch.equal(answers[0], answers[1])


def test_sqrt_scaling_of_a_hash_stacked_slot_weighs_by_the_raw_id_count():
    """1/sqrt(n) counts the sample's IDs, not IDs x rounds: every round's row gets it."""
    stack = {"hash_stack_config": {"hash_stack_rounds": 2, "embedding_size": 50}}
    config = make_config(user=stack, items=stack)  # one feature group: one hash stack
    for num_shards in (1, 2):
        worker, shards = make_worker(config, num_shards)
        batch = Batch(
            [IDTypeFeature.from_lists("items", [[123456789, 987654321], [555]])],
            requires_grad=False,
        )
        got = worker.lookup(batch, train=True).slot("items").embeddings
        first = reference_rows(
            shards,
            table_ids(
                config, "items", hash_stack(np.array([123456789, 987654321], np.uint64), 2, 50)
            ),
            DIM,
        )
        second = reference_rows(
            shards, table_ids(config, "items", hash_stack(np.array([555], np.uint64), 2, 50)), DIM
        )
        w = np.float32(1 / np.sqrt(np.float32(2)))
        np.testing.assert_allclose(got[0].numpy(), (first * w).sum(0), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got[1].numpy(), second.sum(0), rtol=1e-6, atol=1e-7)


def test_raw_ids_lose_the_prefix_bits_before_the_prefix_is_added():
    config = make_config()
    mask = (1 << 56) - 1  # feature_index_prefix_bit 8
    assert config.id_mask == mask
    worker, shards = make_worker(config, 1)
    batch = Batch(
        [
            IDTypeFeature.from_lists("user", [[2**63 + 5]]),  # plain summation slot
            IDTypeFeature.from_lists("history", [[2**62 + 7]]),  # raw slot
        ],
        requires_grad=False,
    )
    result = worker.lookup(batch, train=True)
    user_id = 5 | config.index_prefix("user")
    history_id = 7 | config.index_prefix("history")
    assert config.index_prefix("user") >> 56 != config.index_prefix("history") >> 56
    assert sorted(shards[0].export_rows(DIM).ids.tolist()) == sorted([user_id, history_id])
    rows = shards[0].lookup(np.array([user_id, history_id], np.uint64), DIM, train=False)
    np.testing.assert_array_equal(result.slot("user").embeddings[0].numpy(), rows[0])
    np.testing.assert_array_equal(result.slot("history").embeddings[0, 0].numpy(), rows[1])


def test_one_hash_stack_round_still_hashes_the_ids():
    stack = {"hash_stack_config": {"hash_stack_rounds": 1, "embedding_size": 50}}
    config = make_config(user=stack, items=stack)
    worker, shards = make_worker(config, 1)
    raw = np.array([123456789, 987654321, 42], np.uint64)
    batch = Batch([IDTypeFeature.from_lists("user", [raw.tolist()])], requires_grad=False)
    got = worker.lookup(batch, train=True).slot("user").embeddings
    hashed = hash_stack(raw, 1, 50)
    assert np.all(hashed < 50)
    expected_ids = table_ids(config, "user", hashed)
    assert sorted(shards[0].export_rows(DIM).ids.tolist()) == sorted(set(expected_ids.tolist()))
    rows = reference_rows(shards, expected_ids, DIM)
    np.testing.assert_allclose(got[0].numpy(), rows.sum(0), rtol=1e-6, atol=1e-7)


def test_plain_slots_of_one_dim_keep_their_own_id_spaces():
    """Plain summation slots of one dim are pooled together, each with its own prefix."""
    config = embedding_config_from_mapping(
        {"slots_config": {"a": {"dim": DIM}, "b": {"dim": DIM}, "c": {"dim": DIM}}}
    )
    prefixes = [config.index_prefix(name) for name in "abc"]
    assert len(set(prefixes)) == 3
    worker, shards = make_worker(config, 1)
    batch = Batch(
        [
            IDTypeFeature.from_lists("a", [[42], [1, 42]]),
            IDTypeFeature.from_lists("b", [[42], []]),
            IDTypeFeatureWithSingleID.from_ids("c", [42, 3]),
        ],
        requires_grad=False,
    )
    result = worker.lookup(batch, train=True)
    held = set(shards[0].export_rows(DIM).ids.tolist())
    assert held == {
        42 | prefixes[0],
        1 | prefixes[0],
        42 | prefixes[1],
        42 | prefixes[2],
        3 | prefixes[2],
    }
    for name, prefix in zip("abc", prefixes):
        row = shards[0].lookup(np.array([42 | prefix], np.uint64), DIM, train=False)[0]
        np.testing.assert_array_equal(result.slot(name).embeddings[0].numpy(), row)


def test_a_deduplicating_worker_sends_one_shard_each_distinct_id_once():
    """deduplicate=True on one in-process shard takes the unique + gather path, not the fused
    one: the shard sees distinct IDs, and unknown IDs are still counted per occurrence."""
    config = make_config()
    worker, shards = make_worker(config, 1, deduplicate=True)
    batch = Batch(
        [IDTypeFeature.from_lists("user", [[1, 99, 99], [99, 1, 98]])], requires_grad=False
    )
    unknown = worker.lookup(batch, train=False)
    assert unknown.unknown_ids == 6  # every occurrence of 1, 99, 98
    assert unknown.unknown_per_sample is not None
    assert unknown.unknown_per_sample.tolist() == [3, 3]
    stats = shards[0].stats()
    assert (stats.lookups, stats.ids_looked_up, stats.misses) == (1, 3, 3)
    result = worker.lookup(batch, train=True)
    assert result.unknown_ids == 0 and shards[0].stats().ids_looked_up == 6
    rows = shards[0].lookup(
        table_ids(config, "user", np.array([1, 99, 98], np.uint64)), DIM, train=False
    )
    np.testing.assert_allclose(
        result.slot("user").embeddings[0].numpy(), rows[0] + 2 * rows[1], rtol=1e-6, atol=1e-7
    )
    np.testing.assert_allclose(
        result.slot("user").embeddings[1].numpy(), rows[1] + rows[0] + rows[2], rtol=1e-6, atol=1e-7
    )


class _HookedShard:
    """An in-process shard whose updates first run ``before_update`` (set by the test)."""

    def __init__(self, shard: EmbeddingShard) -> None:
        self.shard = shard
        self.before_update = lambda: None

    def lookup(self, ids: np.ndarray, dim: int, *, train: bool) -> np.ndarray:
        return self.shard.lookup(ids, dim, train=train)

    def update(self, ids: np.ndarray, grads: np.ndarray) -> int:
        self.before_update()
        return self.shard.update(ids, grads)


def test_a_failed_shard_call_returns_only_once_every_shards_call_ended():
    """One shard down must not let the worker go on (the pusher's next batch, a load or
    clear after the failed push) while another shard still applies its part: the error
    comes once every shard's call ended, and it is the first failure in replica order."""
    config = make_config()
    shards = [
        EmbeddingShard(1000, optimizer=SGD(lr=1.0), replica_index=i, replica_size=3)
        for i in range(3)
    ]
    hooked = [_HookedShard(shard) for shard in shards]
    executor = ThreadPoolExecutor(max_workers=2)
    worker = EmbeddingWorker(config, hooked, executor=executor, deduplicate=True)
    batch = Batch([IDTypeFeature.from_lists("user", [list(range(30))])], requires_grad=False)
    ids = table_ids(config, "user", np.arange(30, dtype=np.uint64))
    assert set(shard_of(ids, 3).tolist()) == {0, 1, 2}
    result = worker.lookup(batch, train=True)
    entered, release, applied = threading.Event(), threading.Event(), []

    def down(index: int):
        def fail() -> None:
            raise UnavailableError(f"shard {index} is down")

        return fail

    def slow() -> None:
        entered.set()
        release.wait(10)
        applied.append(2)

    hooked[0].before_update = down(0)
    hooked[1].before_update = down(1)
    hooked[2].before_update = slow
    raised: list[tuple[str, list[int]]] = []

    def push() -> None:
        try:
            worker.backward(result.ref, {"user": torch.ones(1, DIM)})
        except UnavailableError as error:
            raised.append((error.message, list(applied)))  # what shard 2 had done by then

    pusher = threading.Thread(target=push)
    try:
        pusher.start()
        assert entered.wait(10)
        pusher.join(0.5)
        assert pusher.is_alive()  # shard 2's update still runs: no answer yet
        release.set()
        pusher.join(10)
        assert raised == [("shard 0 is down", [2])]
        assert shards[2].stats().updates == int(np.count_nonzero(shard_of(ids, 3) == 2))
    finally:
        release.set()
        executor.shutdown(wait=True)


# Unknown IDs of UNKNOWN_BATCH once KNOWN_BATCH was trained, per sample (see the comments).
UNKNOWN_PER_SAMPLE = [4, 2, 2, 6]


def _unknown_config():
    return make_config(city={"hash_stack_config": {"hash_stack_rounds": 2, "embedding_size": 1000}})


KNOWN_BATCH = Batch(
    [
        IDTypeFeature.from_lists("user", [[1]]),
        IDTypeFeature.from_lists("items", [[10]]),
        IDTypeFeature.from_lists("history", [[5]]),
        IDTypeFeatureWithSingleID.from_ids("city", [3]),
    ],
    requires_grad=False,
)
UNKNOWN_BATCH = Batch(
    [
        # user and items share a feature group: items' 1 is user 1's row (known), and 10 too
        IDTypeFeature.from_lists("user", [[1], [2, 2], [], [7]]),  # 0, 2, 0, 1
        IDTypeFeature.from_lists("items", [[10, 11, 11], [], [10], [1, 12]]),  # 2, 0, 0, 1
        # raw, 3 positions: the third 6 of sample 0 is never looked up
        IDTypeFeature.from_lists("history", [[5, 6, 6, 6], [5], [], [9, 9]]),  # 2, 0, 0, 2
        IDTypeFeatureWithSingleID.from_ids("city", [3, 3, 4, 4]),  # 2 rounds each: 0, 0, 2, 2
    ],
    requires_grad=False,
)


@pytest.mark.parametrize(
    ("num_shards", "deduplicate"),
    [(1, False), (1, True), (3, False), (3, True)],
    ids=["fused", "one-deduplicated", "three", "three-deduplicated"],
)
def test_unknown_ids_count_every_occurrence_split_by_sample(num_shards, deduplicate):
    """The same count whether or not the worker deduplicates before asking its shards (the
    networked tier does; 14 occurrences are 8 distinct rows here), and the same split by
    sample, which is what each request of a merged batch is told."""
    worker, shards = make_worker(_unknown_config(), num_shards, deduplicate)
    worker.lookup(KNOWN_BATCH, train=True)
    result = worker.lookup(UNKNOWN_BATCH, train=False)
    assert result.unknown_ids == sum(UNKNOWN_PER_SAMPLE) == 14
    assert result.unknown_per_sample is not None
    assert result.unknown_per_sample.tolist() == UNKNOWN_PER_SAMPLE
    if deduplicate:  # the shards were asked each distinct ID once
        assert sum(s.stats().misses for s in shards) == 8
    known = worker.lookup(KNOWN_BATCH, train=False)
    assert (known.unknown_ids, known.unknown_per_sample.tolist()) == (0, [0])


class _CountOnlyShard:
    """A shard that says how many IDs it answered with zeros but not which (as a remote
    shard that predates LookupResponse.missing)."""

    def __init__(self, shard: EmbeddingShard) -> None:
        self.shard = shard

    @property
    def last_misses(self) -> int:
        return self.shard.last_misses

    def lookup(self, ids: np.ndarray, dim: int, *, train: bool) -> np.ndarray:
        return self.shard.lookup(ids, dim, train=train)

    def update(self, ids: np.ndarray, grads: np.ndarray) -> int:
        return self.shard.update(ids, grads)


def test_a_shard_that_only_counts_its_misses_gives_its_count_and_no_split():
    shards = [EmbeddingShard(10_000, replica_index=i, replica_size=2) for i in range(2)]
    worker = EmbeddingWorker(
        _unknown_config(), [_CountOnlyShard(s) for s in shards], deduplicate=True
    )
    worker.lookup(KNOWN_BATCH, train=True)
    result = worker.lookup(UNKNOWN_BATCH, train=False)
    assert (result.unknown_ids, result.unknown_per_sample) == (8, None)  # distinct rows


@pytest.mark.parametrize(("num_shards", "deduplicate"), [(1, False), (3, True)])
def test_unknown_ids_of_single_id_slots_per_sample(num_shards, deduplicate):
    """Single-ID summation slots only (the common serving batch): one ID per bag."""
    worker, _ = make_worker(make_config(), num_shards, deduplicate)
    known = Batch(
        [
            IDTypeFeatureWithSingleID.from_ids("user", [1]),
            IDTypeFeatureWithSingleID.from_ids("items", [10]),
            IDTypeFeatureWithSingleID.from_ids("city", [3]),
        ],
        requires_grad=False,
    )
    worker.lookup(known, train=True)
    batch = Batch(
        [
            IDTypeFeatureWithSingleID.from_ids("user", [1, 7, 7, 1]),  # 0, 1, 1, 0
            IDTypeFeatureWithSingleID.from_ids("items", [10, 7, 12, 12]),  # 0, 1, 1, 1
            IDTypeFeatureWithSingleID.from_ids("city", [3, 4, 4, 3]),  # 0, 1, 1, 0
        ],
        requires_grad=False,
    )
    result = worker.lookup(batch, train=False)
    assert result.unknown_per_sample is not None
    assert (result.unknown_ids, result.unknown_per_sample.tolist()) == (7, [0, 3, 3, 1])


def test_deduplicated_lookups_keep_the_lru_order_of_the_batch_as_sent():
    """A remote tier deduplicates before its shards stamp the rows; the in-process tier
    sends the batch as it is, and a repeated ID's last position sets its recency. Both must
    leave the shards in the same LRU order, so a full shard evicts the same rows: [1, 2, 1]
    makes 2 the older row. Deduplicating by first occurrence used to make it 1."""
    config = make_config()
    user = np.uint64(config.index_prefix("user"))

    def held_after(deduplicate: bool) -> set[int]:
        shard = EmbeddingShard(4, optimizer=SGD(lr=1.0))  # evicts one row at a time
        worker = EmbeddingWorker(config, [shard], deduplicate=deduplicate)
        for ids in ([[1, 2, 1]], [[3], [4]], [[5]]):
            worker.lookup([IDTypeFeature.from_lists("user", ids)], train=True)
        return {int(i) ^ int(user) for i in shard.export_rows(DIM).ids}

    assert held_after(deduplicate=False) == {1, 3, 4, 5}
    assert held_after(deduplicate=True) == {1, 3, 4, 5}

    # Random batches with repeats over two full shards, Adam steps between them: the same
    # rows, weights, optimizer state and LRU ranks either way.
    rng = np.random.default_rng(7)
    tiers = []
    for deduplicate in (False, True):
        shards = [
            EmbeddingShard(12, optimizer=Adam(lr=0.1), replica_index=i, replica_size=2)
            for i in range(2)
        ]
        tiers.append((EmbeddingWorker(config, shards, deduplicate=deduplicate), shards))
    for _ in range(30):
        lists = [rng.integers(0, 30, rng.integers(1, 5)).tolist() for _ in range(4)]
        batch = [IDTypeFeature.from_lists("user", lists)]
        grads = {"user": torch.from_numpy(rng.normal(size=(4, DIM)).astype(np.float32))}
        for worker, _ in tiers:
            worker.backward(worker.lookup(batch, train=True).ref, grads)
    (_, plain), (_, deduplicated) = tiers
    assert sum(s.stats().evictions for s in plain) > 20
    for a, b in zip(plain, deduplicated):
        x, y = a.export_all()[DIM], b.export_all()[DIM]
        order_x, order_y = np.argsort(x.ids), np.argsort(y.ids)
        np.testing.assert_array_equal(x.ids[order_x], y.ids[order_y])
        np.testing.assert_array_equal(x.weights[order_x], y.weights[order_y])
        np.testing.assert_array_equal(x.state[order_x], y.state[order_y])
        np.testing.assert_array_equal(x.recency[order_x], y.recency[order_y])
