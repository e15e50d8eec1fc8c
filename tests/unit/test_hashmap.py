"""IdIndex against a Python dict: random, adversarial and duplicate keys, growth, rebuild."""

from __future__ import annotations

import numpy as np
import pytest

from embedding_store.errors import InvalidArgumentError
from embedding_store.hashing import splitmix64
from embedding_store.hashmap import MIN_CAPACITY, IdIndex, capacity_for

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
