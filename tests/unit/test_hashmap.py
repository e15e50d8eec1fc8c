"""IdIndex against a Python dict: random, adversarial and duplicate keys, growth, rebuild."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedding_store.errors import InvalidArgumentError
from embedding_store.hashing import splitmix64
from embedding_store.hashmap import MIN_CAPACITY, PREFETCH, IdIndex, capacity_for

U64_MAX = 2**64 - 1


def _reference_insert(ref: dict[int, int], ids: np.ndarray, next_row: int) -> tuple[list, int]:
    rows = []
    start = next_row
    for k in ids.tolist():
        if k not in ref:
            ref[k] = next_row
            next_row += 1
        rows.append(ref[k])
    return rows, next_row - start


def _check_against(index: IdIndex, ref: dict[int, int], probe: np.ndarray) -> None:
    expected = np.array([ref.get(k, -1) for k in probe.tolist()], dtype=np.int64)
    np.testing.assert_array_equal(index.lookup(probe), expected)
    assert index.size == len(ref)
    assert index.size <= index.capacity // 2
    assert index.capacity & (index.capacity - 1) == 0


def _adversarial_sets() -> dict[str, np.ndarray]:
    seq = np.arange(5000, dtype=np.uint64)
    return {
        "extremes": np.array([0, U64_MAX, 1, U64_MAX - 1, 2**63, 2**63 - 1], dtype=np.uint64),
        "sequential": seq,
        "low_bits_zero": seq << np.uint64(32),
        "stride_2_20": seq * np.uint64(2**20),
        "high_bit_only": (seq << np.uint64(40)) | np.uint64(2**63),
        # keys of one routing shard (splitmix64 % 4 == 1) must still spread in the table
        "one_routing_shard": np.arange(40000, dtype=np.uint64)[
            (splitmix64(np.arange(40000, dtype=np.uint64)) % np.uint64(4)) == 1
        ],
    }


@pytest.mark.parametrize("name", list(_adversarial_sets()))
def test_adversarial_keys_match_dict(name: str) -> None:
    keys = _adversarial_sets()[name]
    index, ref = IdIndex(), {}
    rows, inserted = index.get_or_insert(keys, 0)
    exp_rows, exp_inserted = _reference_insert(ref, keys, 0)
    assert inserted == exp_inserted
    np.testing.assert_array_equal(rows, exp_rows)
    absent = np.array([2, 3, 12345678901234567890, U64_MAX - 7], dtype=np.uint64)
    _check_against(index, ref, np.concatenate([keys, absent, keys[::-1]]))


def test_random_keys_with_duplicates_and_growth_match_dict() -> None:
    rng = np.random.default_rng(7)
    index, ref = IdIndex(), {}
    next_row = 100  # rows need not start at 0
    pool = rng.integers(0, 2**64, 30000, dtype=np.uint64, endpoint=False)
    capacities = set()
    for _ in range(12):
        batch = rng.choice(pool, 6000)  # many duplicates within and across batches
        rows, inserted = index.get_or_insert(batch, next_row)
        exp_rows, exp_inserted = _reference_insert(ref, batch, next_row)
        np.testing.assert_array_equal(rows, exp_rows)
        assert inserted == exp_inserted
        next_row += inserted
        capacities.add(index.capacity)
    assert len(capacities) > 1  # it grew
    probe = np.concatenate([pool, rng.integers(0, 2**64, 5000, dtype=np.uint64)])
    _check_against(index, ref, probe)


def test_duplicates_in_one_call_share_a_row() -> None:
    index = IdIndex()
    ids = np.array([9, 9, 0, 9, U64_MAX, 0, U64_MAX], dtype=np.uint64)
    rows, inserted = index.get_or_insert(ids, 5)
    assert inserted == 3
    assert rows.tolist() == [5, 5, 6, 5, 7, 6, 7]
    again, inserted_again = index.get_or_insert(ids[::-1].copy(), 8)
    assert inserted_again == 0
    assert again.tolist() == [7, 6, 7, 5, 6, 5, 5]


def test_growth_keeps_load_at_most_half() -> None:
    index = IdIndex()
    assert index.capacity == MIN_CAPACITY
    for n in (1, 8, 9, 1000, 100_000):
        index.get_or_insert(np.arange(n, dtype=np.uint64), index.size)
        assert index.size == n
        assert index.capacity == capacity_for(n)
        assert index.size <= index.capacity // 2


def test_insert_rows_upserts_and_rebuild_replaces() -> None:
    index = IdIndex()
    index.insert_rows(np.array([1, 2, 3], dtype=np.uint64), np.array([10, 20, 30]))
    index.insert_rows(np.array([2, U64_MAX], dtype=np.uint64), np.array([21, 40]))
    probe = np.array([1, 2, 3, U64_MAX, 0], dtype=np.uint64)
    assert index.lookup(probe).tolist() == [10, 21, 30, 40, -1]
    assert index.size == 4
    assert sorted(index.keys().tolist()) == [1, 2, 3, U64_MAX]

    keys = np.array([U64_MAX, 0, 7], dtype=np.uint64)
    index.rebuild(keys)
    assert index.size == 3
    assert index.lookup(probe).tolist() == [-1, -1, -1, 0, 1]
    assert index.lookup(np.array([7], dtype=np.uint64)).tolist() == [2]
    big = np.random.default_rng(1).permutation(50_000).astype(np.uint64)
    index.rebuild(big)
    np.testing.assert_array_equal(index.lookup(big), np.arange(50_000))
    index.rebuild(np.zeros(0, dtype=np.uint64))
    assert index.size == 0 and index.capacity == MIN_CAPACITY


def test_lookup_stamp_writes_last_position() -> None:
    index = IdIndex()
    index.get_or_insert(np.array([5, 6, 7], dtype=np.uint64), 0)
    stamps = np.zeros(3, dtype=np.int64)
    rows = index.lookup_stamp(np.array([7, 8, 5, 7], dtype=np.uint64), stamps, 100)
    assert rows.tolist() == [2, -1, 0, 2]
    assert stamps.tolist() == [102, 0, 103]


def test_rejects_non_uint64_ids() -> None:
    index = IdIndex()
    with pytest.raises(InvalidArgumentError, match=r"ids must be a uint64 \[n\] array, got int64"):
        index.lookup(np.array([1, 2], dtype=np.int64))
    with pytest.raises(InvalidArgumentError, match="ids"):
        index.get_or_insert(np.zeros((2, 2), dtype=np.uint64), 0)


def test_lookup_and_stamp_across_the_prefetch_window() -> None:
    """Batches shorter and longer than the prefetch distance give the dict's answers."""
    rng = np.random.default_rng(3)
    index, ref = IdIndex(), {}
    keys = rng.integers(0, 2**64, 3000, dtype=np.uint64)
    _reference_insert(ref, keys, 0)
    index.get_or_insert(keys, 0)
    for n in (0, 1, PREFETCH - 1, PREFETCH, PREFETCH + 1, 2 * PREFETCH + 3, 5000):
        probe = np.concatenate([keys, rng.integers(0, 2**64, 3000, dtype=np.uint64)])
        probe = rng.choice(probe, n)  # repeats, hits and misses
        _check_against(index, ref, probe)
        stamps = np.full(len(ref), -7, dtype=np.int64)
        rows = index.lookup_stamp(probe, stamps, 1000)
        expected = np.full(len(ref), -7, dtype=np.int64)
        for i, k in enumerate(probe.tolist()):
            if k in ref:
                expected[ref[k]] = 1000 + i  # the last position wins
        np.testing.assert_array_equal(stamps, expected)
        np.testing.assert_array_equal(rows, index.lookup(probe))


def _reference_pool(rows, weights, offsets, id_weights, n):
    """embedding_bag(mode="sum") by hand: float32, in order, unknown rows (-1) add nothing;
    each weighted term is a fused multiply-add: w * x + acc exact in float64 (a product of
    two float32 is), rounded once to float32."""
    out = np.zeros((len(offsets), weights.shape[1]), dtype=np.float32)
    for b, start in enumerate(offsets.tolist()):
        end = offsets[b + 1] if b + 1 < len(offsets) else n
        for i in range(start, end):
            if rows[i] >= 0:
                w = np.float64(1) if id_weights is None else np.float64(id_weights[i])
                term = w * weights[rows[i]].astype(np.float64)
                out[b] = (term + out[b].astype(np.float64)).astype(np.float32)
    return out


@pytest.mark.parametrize("weighted", [False, True])
def test_pool_equals_lookup_then_embedding_bag(weighted: bool) -> None:
    rng = np.random.default_rng(11)
    index = IdIndex()
    keys = rng.integers(0, 2**64, 2000, dtype=np.uint64)
    keys[:2] = [0, U64_MAX]
    index.get_or_insert(keys, 0)
    weights = rng.standard_normal((2000, 5)).astype(np.float32)
    unknown = rng.integers(0, 2**64, 300, dtype=np.uint64)
    # bags of 0..6 IDs and one of 100: empty bags first, in the middle and last
    lengths = np.concatenate([[0, 0], rng.integers(0, 7, 400), [100, 0]])
    ids = rng.choice(np.concatenate([keys, unknown]), int(lengths.sum()))
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    id_weights = rng.random(len(ids)).astype(np.float32) if weighted else None

    pooled, misses = index.pool(ids, weights, offsets, id_weights)

    rows = index.lookup(ids)
    assert misses == int(np.count_nonzero(rows < 0)) > 0
    expected = _reference_pool(rows, weights, offsets, id_weights, len(ids))
    np.testing.assert_array_equal(pooled, expected)
    assert not pooled[[0, 1, len(offsets) - 1]].any()  # empty bags are zeros
    gathered = np.where((rows >= 0)[:, None], weights[np.maximum(rows, 0)], 0).astype(np.float32)
    torch_pooled = torch.nn.functional.embedding_bag(
        torch.arange(len(ids)),
        torch.from_numpy(gathered),
        torch.from_numpy(offsets),
        mode="sum",
        per_sample_weights=None if id_weights is None else torch.from_numpy(id_weights),
    )
    # Bit-equal, weighted too: torch adds weighted terms with a fused multiply-add as well.
    np.testing.assert_array_equal(pooled, torch_pooled.numpy())


def test_pool_edge_cases() -> None:
    index = IdIndex()
    index.get_or_insert(np.array([10, 20], dtype=np.uint64), 0)
    weights = np.array([[1, 2], [30, 40]], dtype=np.float32)
    none = np.zeros(0, dtype=np.uint64)
    out, misses = index.pool(none, weights, np.zeros(0, dtype=np.int64))
    assert out.shape == (0, 2) and misses == 0
    out, misses = index.pool(none, weights, np.zeros(3, dtype=np.int64))
    assert out.tolist() == [[0, 0]] * 3 and misses == 0
    ids = np.array([20, 10, 99, 20], dtype=np.uint64)
    out, misses = index.pool(ids, weights, np.array([0, 1, 3], dtype=np.int32))
    assert out.tolist() == [[30, 40], [1, 2], [30, 40]] and misses == 1
    out, _ = index.pool(ids, weights, np.array([0]), np.array([1, 2, 3, 0.5], np.float32))
    assert out.tolist() == [[30 + 2 + 15, 40 + 4 + 20]]
    found = np.empty(4, dtype=np.int64)  # the rows the kernel found, -1 where unknown
    assert index.pool(ids, weights, np.array([0]), rows_out=found)[1] == 1
    assert found.tolist() == [1, 0, -1, 1]
    with pytest.raises(InvalidArgumentError, match=r"rows_out must be a writable int64 \[4\]"):
        index.pool(ids, weights, np.array([0]), rows_out=np.empty(4, dtype=np.int32))


@pytest.mark.parametrize(
    ("offsets", "id_weights", "pattern"),
    [
        (np.array([1, 2]), None, "bag_offsets must be non-decreasing, start at 0"),
        (np.array([0, 3, 2]), None, "non-decreasing"),
        (np.array([0, 5]), None, r"stay <= 4"),
        (np.zeros(0, dtype=np.int64), None, "no bags there must be no ids"),
        (np.array([0.0, 1.0]), None, r"bag_offsets must be an int64 \[num_bags\] array"),
        (np.zeros((1, 1), dtype=np.int64), None, "bag_offsets must be"),
        ([0, 1], None, "bag_offsets must be"),
        (np.array([0]), np.ones(3, np.float32), r"id_weights must be None or a float32 \[4\]"),
        (np.array([0]), np.ones(4, np.float64), "id_weights must be"),
    ],
)
def test_pool_rejects_bad_arguments(offsets, id_weights, pattern: str) -> None:
    index = IdIndex()
    weights = np.ones((4, 2), dtype=np.float32)
    ids = np.arange(4, dtype=np.uint64)
    with pytest.raises(InvalidArgumentError, match=pattern):
        index.pool(ids, weights, offsets, id_weights)


def test_pool_rejects_bad_weights() -> None:
    ids = np.arange(4, dtype=np.uint64)
    for weights in (np.ones((4, 2)), np.ones(4, np.float32), np.ones((2, 4), np.float32).T):
        with pytest.raises(InvalidArgumentError, match="weights must be a C-contiguous float32"):
            IdIndex().pool(ids, weights, np.array([0]))


def test_insert_rows_refuses_negative_rows_and_mismatched_shapes() -> None:
    index = IdIndex()
    index.insert_rows(np.array([1], dtype=np.uint64), np.array([0]))
    # -1 is the empty-slot marker: a row of -1 would silently drop the key from the table.
    with pytest.raises(InvalidArgumentError, match="rows must be >= 0"):
        index.insert_rows(np.array([2, 3], dtype=np.uint64), np.array([4, -1]))
    with pytest.raises(InvalidArgumentError, match=r"rows must have the shape of ids \[2\]"):
        index.insert_rows(np.array([2, 3], dtype=np.uint64), np.array([4]))
    assert index.size == 1
    assert index.lookup(np.array([1, 2, 3], dtype=np.uint64)).tolist() == [0, -1, -1]


def test_insert_rows_grows_the_table_to_keep_load_at_most_half() -> None:
    index = IdIndex()
    assert index.capacity == MIN_CAPACITY == 16
    index.insert_rows(np.arange(8, dtype=np.uint64), np.arange(8))
    assert (index.size, index.capacity) == (8, 16)
    index.insert_rows(np.array([8], dtype=np.uint64), np.array([8]))  # the 9th key: grow
    assert (index.size, index.capacity) == (9, 32)
    np.testing.assert_array_equal(index.lookup(np.arange(9, dtype=np.uint64)), np.arange(9))


def test_keys_include_zero_and_the_largest_uint64() -> None:
    index = IdIndex()
    index.rebuild(np.array([0, U64_MAX, 7], dtype=np.uint64))
    assert sorted(index.keys().tolist()) == [0, 7, U64_MAX]
    index.get_or_insert(np.array([0, 5], dtype=np.uint64), index.size)
    assert sorted(index.keys().tolist()) == [0, 5, 7, U64_MAX]
