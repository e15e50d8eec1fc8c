"""EmbeddingShard: initialization, admission, LRU eviction, updates, export/import, errors."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from embedding_store.errors import (
    CapacityError,
    ConfigError,
    FailedPreconditionError,
    InvalidArgumentError,
)
from embedding_store.initializer import InitializationConfig, admitted, initial_vectors
from embedding_store.interfaces import ParameterServer
from embedding_store.optimizers import SGD, Adagrad, Adam
from embedding_store.shard import EmbeddingShard, RowBlock, zeros_aligned


def u64(*values) -> np.ndarray:
    if len(values) == 1 and not np.isscalar(values[0]):
        return np.asarray(values[0], dtype=np.uint64)
    return np.array(values, dtype=np.uint64)


def held(shard: EmbeddingShard, dim: int) -> set[int]:
    return set(shard.export_rows(dim).ids.tolist())


def test_satisfies_the_parameter_server_protocol() -> None:
    assert isinstance(EmbeddingShard(10), ParameterServer)


def test_same_id_same_initial_vector_whatever_replica_and_batch() -> None:
    ids = u64(np.arange(200, dtype=np.uint64) * np.uint64(7919) + np.uint64(2**63))
    a = EmbeddingShard(1000)
    rows_a = a.lookup(ids, 8, train=True)
    np.testing.assert_array_equal(rows_a, initial_vectors(ids, 8, InitializationConfig()))

    b = EmbeddingShard(1000, replica_index=3, replica_size=4)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(ids))
    got = {}
    for chunk in np.array_split(order, 7):
        batch = np.concatenate([ids[chunk], ids[chunk[:3]], u64(1, 2, 3)])  # dups + strangers
        out = b.lookup(batch, 8, train=True)
        got.update({int(k): out[i] for i, k in enumerate(batch.tolist())})
    for i, k in enumerate(ids.tolist()):
        np.testing.assert_array_equal(got[k], rows_a[i])
    # columns do not depend on the row width; the seed changes everything
    np.testing.assert_array_equal(initial_vectors(ids, 16)[:, :8], rows_a)
    other = initial_vectors(ids, 8, InitializationConfig(seed=1))
    assert not np.any(other == rows_a)
    assert rows_a.min() >= -0.01 and rows_a.max() < 0.01


def test_initialization_range_and_bound() -> None:
    ids = u64(np.arange(5000))
    v = initial_vectors(ids, 4, InitializationConfig(low=1.0, high=3.0))
    assert v.dtype == np.float32 and v.min() >= 1.0 and v.max() < 3.0
    assert abs(float(v.mean()) - 2.0) < 0.02
    clamped = initial_vectors(ids, 4, InitializationConfig(low=-1, high=1, weight_bound=0.25))
    assert np.abs(clamped).max() == np.float32(0.25)
    # Bounds beyond float32 made rows of +-Inf (low=-1e39) or NaN (a span beyond float64's),
    # stored for good: refused, as any peer's ConfigureRequest can set them.
    edge = float(np.finfo(np.float32).max)
    widest = initial_vectors(ids, 4, InitializationConfig(low=-edge, high=edge))
    assert np.isfinite(widest).all()
    for low, high in ((-1e39, 1.0), (0.0, 1e39), (-1e308, 1e308)):
        with pytest.raises(ConfigError, match="must be within float32's range"):
            InitializationConfig(low=low, high=high)


def test_initialization_never_yields_high_even_when_float32_rounds_to_it() -> None:
    # ID 88642246 (seed 0) draws u = 0.99999998..., which float32 rounds to 1.0: the value
    # must stay in [low, high), as the largest float32 below ``high``.
    v = initial_vectors(u64(88642246, 1), 1, InitializationConfig(low=0.0, high=1.0))
    assert v[0, 0] == np.nextafter(np.float32(1.0), np.float32(0.0))
    assert v.max() < 1.0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"admit_probability": 0.0}, r"admit_probability must be in \(0, 1\], got 0.0"),
        ({"admit_probability": 1.0000001}, "admit_probability must be in"),
        ({"weight_bound": 0.0}, "weight_bound must be > 0, got 0.0"),
        ({"seed": 2**64}, r"seed must be in \[0, 2\*\*64\)"),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*64\)"),
    ],
)
def test_initialization_settings_out_of_range_are_refused(settings, message) -> None:
    with pytest.raises(ConfigError, match=message):
        InitializationConfig(**settings)


def test_initialization_settings_at_their_limits_are_taken() -> None:
    config = InitializationConfig(admit_probability=1.0, weight_bound=1e-30, seed=2**64 - 1)
    assert (config.admit_probability, config.weight_bound, config.seed) == (1.0, 1e-30, 2**64 - 1)
    assert initial_vectors(u64(7), 1, config).shape == (1, 1)


@pytest.mark.parametrize("dim", [0, -1, True, 2.0])
def test_initial_vectors_need_a_positive_integer_dim(dim) -> None:
    with pytest.raises(InvalidArgumentError, match="dim must be a positive integer"):
        initial_vectors(u64(1, 2), dim)


def test_eval_never_inserts_and_counts_misses() -> None:
    shard = EmbeddingShard(100, optimizer=SGD())
    out = shard.lookup(u64(1, 2, 2), 4, train=False)
    assert out.shape == (3, 4) and out.dtype == np.float32 and not out.any()
    assert shard.size() == 0 and shard.dims() == []

    known = shard.lookup(u64(5, 6), 4, train=True)
    out = shard.lookup(u64(6, 7, 5, 7), 4, train=False)
    np.testing.assert_array_equal(out[[0, 2]], known[[1, 0]])
    assert not out[[1, 3]].any()
    assert shard.size() == 2
    s = shard.stats()
    assert (s.misses, s.lookups, s.ids_looked_up, s.inserts) == (5, 3, 9, 2)
    # other dims have their own tables: the same IDs are unknown at dim 8
    assert not shard.lookup(u64(5, 6), 8, train=False).any()
    assert shard.stats().misses == 7


def test_eval_lookups_are_counted_apart_from_train_lookups() -> None:
    shard = EmbeddingShard(100, optimizer=SGD())
    shard.lookup(u64(1, 2, 3), 4, train=True)
    shard.lookup(u64(1, 9), 4, train=False)  # 9 unknown
    offsets = np.array([0, 2], dtype=np.int64)
    shard.lookup_pooled(u64(1, 2, 8, 8), 4, offsets)  # held table: the fused kernel; 8 unknown
    shard.lookup_pooled(u64(1, 2), 6, offsets)  # no dim-6 table: the generic path
    shard.lookup_pooled(u64(4, 5, 1), 4, offsets, train=True)
    s = shard.stats()
    assert (s.lookups, s.ids_looked_up) == (5, 3 + 2 + 4 + 2 + 3)
    assert (s.eval_lookups, s.eval_ids_looked_up, s.misses) == (3, 2 + 4 + 2, 1 + 2 + 2)


def test_admission_is_deterministic_and_near_p() -> None:
    config = InitializationConfig(admit_probability=0.25, seed=3)
    shard = EmbeddingShard(200_000, initialization=config)
    ids = u64(np.arange(100_000) + 10**12)
    out = shard.lookup(ids, 2, train=True)
    expected = admitted(ids, config)
    assert 0.24 < expected.mean() < 0.26
    assert shard.size() == int(expected.sum())
    assert not out[~expected].any()
    np.testing.assert_array_equal(out[expected], initial_vectors(ids[expected], 2, config))
    assert shard.stats().rejected_admissions == 100_000 - shard.size()
    # the same IDs are rejected again (per occurrence); admitted ones are now held
    again = shard.lookup(ids, 2, train=True)
    np.testing.assert_array_equal(again, out)
    assert shard.stats().rejected_admissions == 2 * (100_000 - shard.size())
    assert shard.stats().inserts == shard.size()


def test_lru_evicts_exactly_the_least_recently_used_in_bulk() -> None:
    shard = EmbeddingShard(20)  # evicts at least ceil(20 / 10) = 2 rows at a time
    first = shard.lookup(u64(range(10)), 4, train=True)
    shard.lookup(u64(range(10, 20)), 4, train=True)
    assert shard.size() == 20 and shard.stats().evictions == 0

    out = shard.lookup(u64(3, 15, 100), 4, train=True)  # 1 new: evicts 2 (0 and 1)
    np.testing.assert_array_equal(out[0], first[3])
    assert held(shard, 4) == set(range(2, 20)) | {100}
    assert shard.stats().evictions == 2

    shard.lookup(u64(200, 201, 2), 4, train=True)  # 2 is touched first: evicts 4 and 5
    assert held(shard, 4) == {2, 3, *range(6, 20), 100, 200, 201}
    assert shard.stats().evictions == 4

    shard.lookup(u64(range(300, 308)), 4, train=True)  # 8 new: evicts what is needed (7)
    assert held(shard, 4) == {2, 3, *range(13, 20), 100, 200, 201, *range(300, 308)}
    assert shard.size() == 20
    s = shard.stats()
    assert (s.evictions, s.inserts, s.rows) == (11, 31, 20)
    # survivors kept their rows; evicted IDs are unknown again
    np.testing.assert_array_equal(shard.lookup(u64(3), 4, train=False)[0], first[3])
    assert not shard.lookup(u64(0, 4, 12), 4, train=False).any()


def test_bulk_eviction_takes_a_tenth_of_the_capacity_rounded_up() -> None:
    shard = EmbeddingShard(15)  # ceil(15 / 10) = 2
    shard.lookup(u64(range(15)), 4, train=True)
    shard.lookup(u64(100), 4, train=True)  # 1 new: evicts 2 (0 and 1), not just 1
    assert held(shard, 4) == {*range(2, 15), 100}
    assert shard.size() == 14 and shard.stats().evictions == 2


def test_eviction_never_takes_a_row_of_the_lookup_itself() -> None:
    """The first ID of the lookup is the one stamped with the clock the lookup started at: a
    bulk eviction wider than the rows outside the lookup still leaves it alone."""
    shard = EmbeddingShard(20)  # evicts at least 2 rows at a time
    first = shard.lookup(u64(range(20)), 4, train=True)
    out = shard.lookup(u64(*range(19), 100), 4, train=True)  # only row 19 may go
    assert held(shard, 4) == {*range(19), 100}
    assert shard.stats().evictions == 1
    np.testing.assert_array_equal(out[:19], first[:19])


def test_a_lookup_of_exactly_capacity_distinct_ids_fits() -> None:
    shard = EmbeddingShard(10)
    shard.lookup(u64(range(6)), 4, train=True)
    shard.lookup(u64(*range(6), 100, 101, 102, 103), 4, train=True)  # 6 held + 4 new = 10
    assert held(shard, 4) == {*range(6), 100, 101, 102, 103}
    shard.lookup(u64(range(200, 210)), 4, train=True)  # 10 new: every other row goes
    assert held(shard, 4) == set(range(200, 210))


def test_lru_last_occurrence_in_a_batch_wins() -> None:
    shard = EmbeddingShard(4)  # evicts 1 row at a time
    shard.lookup(u64(1, 2, 3, 4), 2, train=True)
    shard.lookup(u64(1, 2, 1), 2, train=True)  # order now 3, 4, 2, 1
    for new, gone in ((5, 3), (6, 4), (7, 2)):
        shard.lookup(u64(new, new), 2, train=True)  # a repeated new ID takes one row
        assert gone not in held(shard, 2)
        assert shard.size() == 4
    assert held(shard, 2) == {1, 5, 6, 7}


def test_lru_is_global_across_dims() -> None:
    shard = EmbeddingShard(10)
    shard.lookup(u64(1, 2, 3), 4, train=True)
    shard.lookup(u64(11, 12, 13), 8, train=True)
    shard.lookup(u64(4, 5, 6), 4, train=True)
    shard.lookup(u64(14), 8, train=True)
    assert shard.size() == 10 and shard.dims() == [4, 8]
    shard.lookup(u64(12, 20, 21), 8, train=True)  # evicts 1 and 2 from the dim-4 table
    assert held(shard, 4) == {3, 4, 5, 6}
    assert held(shard, 8) == {11, 12, 13, 14, 20, 21}
    shard.lookup(u64(30), 4, train=True)  # evicts 3
    shard.lookup(u64(31), 4, train=True)  # evicts 11 from the dim-8 table
    assert held(shard, 4) == {4, 5, 6, 30, 31}
    assert held(shard, 8) == {12, 13, 14, 20, 21}
    assert shard.stats().evictions == 4


def test_capacity_error_names_the_numbers() -> None:
    shard = EmbeddingShard(10)
    with pytest.raises(CapacityError, match=r"11 distinct rows .*capacity is 10"):
        shard.lookup(u64(range(11)), 4, train=True)
    assert shard.size() == 0
    shard.lookup(u64(range(6)), 4, train=True)
    with pytest.raises(CapacityError, match=r"12 distinct rows \(6 new \+ 6 held\)"):
        shard.lookup(u64(*range(6), *range(100, 106)), 4, train=True)
    assert held(shard, 4) == set(range(6))
    # duplicates of new IDs count once
    shard.lookup(u64([50] * 30 + [51]), 4, train=True)
    assert shard.size() == 8


def _trained_shard(optimizer) -> EmbeddingShard:
    shard = EmbeddingShard(1000, optimizer=optimizer)
    rng = np.random.default_rng(5)
    for dim in (4, 8):
        ids = u64(rng.integers(0, 2**64, 50, dtype=np.uint64))
        for _ in range(3):
            shard.lookup(ids, dim, train=True)
            shard.update(ids[::2].copy(), rng.standard_normal((25, dim)).astype(np.float32))
    return shard


@pytest.mark.parametrize(
    "optimizer", [SGD(), Adagrad(vectorwise_shared=True), Adam()], ids=["sgd", "adagrad", "adam"]
)
def test_export_import_round_trip_is_bit_exact(optimizer) -> None:
    source = _trained_shard(optimizer)
    target = EmbeddingShard(1000, optimizer=optimizer)
    for dim in source.dims():
        target.import_rows(source.export_rows(dim))
    assert target.dims() == source.dims() and target.size() == source.size()
    for dim in source.dims():
        a, b = source.export_rows(dim), target.export_rows(dim)
        assert a.state.shape[1] == optimizer.state_width(dim)
        for name in ("ids", "weights", "state"):
            assert getattr(a, name).tobytes() == getattr(b, name).tobytes()
        # optimizer state travelled: the same update gives the same rows
        grads = np.full((len(a), dim), 0.5, dtype=np.float32)
        assert source.update(a.ids, grads) == target.update(a.ids, grads) == len(a)
        np.testing.assert_array_equal(
            source.lookup(a.ids, dim, train=False), target.lookup(a.ids, dim, train=False)
        )


def test_export_is_a_copy_and_empty_dims_export_empty() -> None:
    shard = EmbeddingShard(10, optimizer=Adam())
    block = shard.export_rows(4)
    assert block.ids.shape == (0,) and block.weights.shape == (0, 4) and block.state.shape == (0, 9)
    shard.lookup(u64(1), 4, train=True)
    block = shard.export_rows(4)
    block.weights[:] = 7
    assert shard.lookup(u64(1), 4, train=False).max() < 1


def test_import_overwrites_evicts_and_adapts_state() -> None:
    shard = EmbeddingShard(10, optimizer=Adagrad(initial_accumulator_value=0.3))
    shard.lookup(u64(range(8)), 2, train=True)
    block = RowBlock(
        ids=u64(7, 100, 101, 102, 103),
        weights=np.arange(10, dtype=np.float32).reshape(5, 2),
        state=np.full((5, 2), 9.0, dtype=np.float32),
    )
    shard.import_rows(block)  # 4 new on 8 held of 10: evicts 2 LRU rows (0 and 1)
    assert held(shard, 2) == {2, 3, 4, 5, 6, 7, 100, 101, 102, 103}
    assert shard.stats().evictions == 2
    np.testing.assert_array_equal(shard.lookup(u64(7, 103), 2, train=False), [[0, 1], [8, 9]])
    # a block without state gets fresh optimizer state
    shard.import_rows(RowBlock(u64(5), np.ones((1, 2), np.float32), np.zeros((1, 0), np.float32)))
    exported = shard.export_rows(2)
    row = int(np.flatnonzero(exported.ids == 5)[0])
    assert exported.state[row].tolist() == pytest.approx([0.3, 0.3])
    assert exported.state[exported.ids == 7].tolist() == [[9.0, 9.0]]
    with pytest.raises(InvalidArgumentError, match=r"block.state has 3 columns .*adagrad.* 2"):
        shard.import_rows(
            RowBlock(u64(1), np.ones((1, 2), np.float32), np.ones((1, 3), np.float32))
        )
    with pytest.raises(InvalidArgumentError, match=r"block.weights must be a float32 \[1, dim\]"):
        shard.import_rows(RowBlock(u64(1), np.ones((1, 2)), np.ones((1, 2), np.float32)))


def test_replace_rows_is_all_or_nothing() -> None:
    source = _trained_shard(Adam())
    blocks = [source.export_rows(d) for d in source.dims()]
    shard = EmbeddingShard(1000, optimizer=Adam(), read_only=True)
    shard.replace_rows([RowBlock(u64(1, 2), np.ones((2, 16), np.float32), None)])
    assert shard.export_rows(16).state.shape == (2, 33)  # state=None: fresh state
    shard.replace_rows(blocks)
    assert shard.dims() == [4, 8] and shard.size() == source.size()
    for d in (4, 8):
        a, b = source.export_rows(d), shard.export_rows(d)
        assert a.weights.tobytes() == b.weights.tobytes()
        assert a.state.tobytes() == b.state.tobytes()
    bad = RowBlock(u64(9), np.ones((1, 4), np.float32), np.ones((1, 3), np.float32))
    with pytest.raises(InvalidArgumentError, match=r"block\.state has 3 columns"):
        shard.replace_rows([blocks[1], bad])
    with pytest.raises(CapacityError, match="needs 100 rows but its capacity is 60"):
        EmbeddingShard(60, optimizer=Adam()).replace_rows(blocks)
    assert shard.size() == source.size()  # unchanged
    shard.replace_rows([])
    assert shard.size() == 0


def test_checkpoint_version_is_the_loaded_ones_until_the_rows_change() -> None:
    source = _trained_shard(Adam())
    blocks = [source.export_rows(d) for d in source.dims()]
    ids = source.export_rows(4).ids[:3]

    def loaded(read_only: bool = False) -> EmbeddingShard:
        shard = EmbeddingShard(1000, optimizer=Adam(), read_only=read_only)
        assert shard.checkpoint_version == ""
        shard.replace_rows(blocks, checkpoint_version="v1")
        assert shard.checkpoint_version == "v1"
        return shard

    # Reads keep it: inference lookups, pooled or not, of known and unknown IDs.
    shard = loaded(read_only=True)
    shard.lookup(u64(*ids.tolist(), 10**12), 4, train=False)
    shard.lookup_pooled(ids, 4, np.array([0, 2], np.int64), train=False)
    shard.export_rows(4)
    assert shard.checkpoint_version == "v1"
    # A failed replacement keeps the rows and their version.
    with pytest.raises(InvalidArgumentError):
        shard.replace_rows(
            [RowBlock(u64(9), np.ones((1, 4), np.float32), np.ones((1, 3), np.float32))],
            checkpoint_version="v2",
        )
    assert shard.checkpoint_version == "v1"
    # Writes drop it: an import (into a training shard), a train lookup that inserts (one of
    # known IDs keeps it), an update, a clear.
    shard = loaded()
    shard.import_rows(RowBlock(u64(1), np.ones((1, 4), np.float32), None))
    assert shard.checkpoint_version == ""
    shard = loaded()
    shard.lookup(ids, 4, train=True)
    assert shard.checkpoint_version == "v1"
    shard.lookup(u64(10**12), 4, train=True)
    assert shard.checkpoint_version == ""
    shard = loaded()
    assert shard.update(u64(10**13), np.ones((1, 4), np.float32)) == 0  # not held: no change
    assert shard.checkpoint_version == "v1"
    shard.update(ids, np.ones((3, 4), np.float32))
    assert shard.checkpoint_version == ""
    shard = loaded()
    shard.clear()
    assert shard.checkpoint_version == ""


def test_read_only_shard_loads_whole_and_refuses_writes() -> None:
    source = _trained_shard(Adam())
    infer = EmbeddingShard(1000, read_only=True)  # no optimizer: state is dropped on load
    infer.replace_rows([source.export_rows(dim) for dim in source.dims()])
    block = source.export_rows(8)
    np.testing.assert_array_equal(infer.lookup(block.ids, 8, train=False), block.weights)
    assert infer.export_rows(8).state.shape == (len(block), 0)
    assert infer.read_only
    with pytest.raises(FailedPreconditionError, match="read-only"):
        infer.lookup(block.ids, 8, train=True)
    with pytest.raises(FailedPreconditionError, match="read-only"):
        infer.update(block.ids, block.weights)
    with pytest.raises(FailedPreconditionError, match="read-only"):
        infer.clear()
    # Rows written one by one (over ImportRows by any peer) would mix into a checkpoint's.
    with pytest.raises(FailedPreconditionError, match="read-only: row imports are refused"):
        infer.import_rows(RowBlock(block.ids[:1], np.full((1, 8), 100, np.float32), None))
    np.testing.assert_array_equal(infer.lookup(block.ids, 8, train=False), block.weights)
    assert infer.size() == source.size()
    # Loaded rows are not inserts: an alert on writes to read-only shards stays quiet.
    assert (infer.stats().inserts, infer.stats().rows_loaded) == (0, source.size())
    infer.replace_rows([source.export_rows(8)])  # a reload counts again
    assert (infer.stats().inserts, infer.stats().rows_loaded) == (0, source.size() + len(block))
    with pytest.raises(InvalidArgumentError, match="non-finite"):
        source.import_rows(RowBlock(u64(5), np.full((1, 8), np.inf, np.float32), None))


def test_update_through_shard_equals_direct_kernel() -> None:
    opt = Adagrad(lr=0.1, initial_accumulator_value=0.2, weight_decay=0.01)
    config = InitializationConfig(low=-0.5, high=0.5, weight_bound=0.45)
    shard = EmbeddingShard(100, optimizer=opt, initialization=config)
    ids = u64(10, 20, 30, 40)
    shard.lookup(ids, 3, train=True)
    rng = np.random.default_rng(1)
    weights = initial_vectors(ids, 3, config)
    state = opt.initial_state(4, 3)
    for _ in range(4):
        grads = rng.standard_normal((5, 3)).astype(np.float32) * 3
        upd_ids = u64(30, 10, 999, 40, 20)  # 999 is not held: skipped and counted
        assert shard.update(upd_ids, grads) == 4
        opt.apply(weights, state, np.array([2, 0, -1, 3, 1]), grads, 0.45)
    np.testing.assert_array_equal(shard.lookup(ids, 3, train=False), weights)
    np.testing.assert_array_equal(shard.export_rows(3).state, state)
    assert np.abs(weights).max() <= np.float32(0.45)
    s = shard.stats()
    assert (s.updates, s.skipped_updates) == (16, 4)
    # an unknown dim skips everything
    assert shard.update(ids, np.zeros((4, 5), np.float32)) == 0
    assert shard.stats().skipped_updates == 8


def test_update_without_optimizer_fails() -> None:
    shard = EmbeddingShard(10)
    shard.lookup(u64(1), 2, train=True)
    with pytest.raises(
        FailedPreconditionError,
        match=r"no optimizer configured; call configure\(optimizer=\.\.\.\)",
    ):
        shard.update(u64(1), np.zeros((1, 2), np.float32))


def test_configure_reinitializes_state_only_on_type_or_width_change() -> None:
    shard = EmbeddingShard(10, optimizer=SGD())
    shard.lookup(u64(1, 2), 4, train=True)
    assert shard.export_rows(4).state.shape == (2, 0)
    shard.configure(optimizer=Adagrad(initial_accumulator_value=0.7))
    assert np.all(shard.export_rows(4).state == np.float32(0.7))
    shard.update(u64(1), np.ones((1, 4), np.float32))
    before = shard.export_rows(4).state
    shard.configure(optimizer=Adagrad(lr=0.5, initial_accumulator_value=0.1))  # same type
    np.testing.assert_array_equal(shard.export_rows(4).state, before)
    shard.configure(optimizer=Adagrad(vectorwise_shared=True))  # width 4 -> 1
    assert np.all(shard.export_rows(4).state == np.full((2, 1), 0.01, np.float32))
    shard.configure(optimizer=Adam())
    assert shard.export_rows(4).state.shape == (2, 9) and not shard.export_rows(4).state.any()
    new_init = InitializationConfig(low=0.5, high=0.6)
    shard.configure(initialization=new_init)
    assert shard.initialization == new_init and isinstance(shard.optimizer, Adam)
    assert shard.lookup(u64(3), 4, train=True).min() >= 0.5
    # rows inserted after configure get the new optimizer's initial state
    assert shard.export_rows(4).state.shape == (3, 9)


def test_clear_keeps_counters_and_vectors_come_back_identical() -> None:
    shard = EmbeddingShard(10, optimizer=SGD())
    first = shard.lookup(u64(1, 2), 4, train=True)
    shard.clear()
    assert shard.size() == 0 and shard.dims() == []
    assert shard.stats().inserts == 2
    np.testing.assert_array_equal(shard.lookup(u64(1, 2), 4, train=True), first)


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (
            lambda s: s.lookup(np.array([1, 2]), 4, train=True),
            r"ids must be a uint64 \[n\] .*int64",
        ),
        (lambda s: s.lookup(u64([[1, 2]]), 4, train=False), r"ids must be .*uint64\[1, 2\]"),
        (lambda s: s.lookup([1, 2], 4, train=False), r"ids must be .*got list"),
        (lambda s: s.lookup(u64(1), 0, train=True), r"dim must be a positive integer, got 0"),
        (lambda s: s.lookup(u64(1), True, train=True), r"dim must be a positive integer, got True"),
        (
            lambda s: s.export_rows(np.bool_(True)),
            r"dim must be a positive integer, got (np\.)?(True|bool_\(True\))",
        ),
        (lambda s: s.update(u64(1), np.zeros((1, 4))), r"grads must be a float32 .*float64"),
        (
            lambda s: s.update(u64(1, 2), np.zeros((3, 4), np.float32)),
            r"grads must have shape \[2, dim >= 1\] .*got \[3, 4\]",
        ),
        (lambda s: s.import_rows("rows"), r"block must be a RowBlock, got str"),
    ],
)
def test_bad_arguments_are_named(call, pattern: str) -> None:
    shard = EmbeddingShard(10, optimizer=SGD())
    with pytest.raises(InvalidArgumentError, match=pattern):
        call(shard)


def test_constructor_validation() -> None:
    with pytest.raises(InvalidArgumentError, match="capacity must be >= 1"):
        EmbeddingShard(0)
    with pytest.raises(InvalidArgumentError, match=r"replica_index must be in \[0, 2\)"):
        EmbeddingShard(10, replica_index=2, replica_size=2)
    with pytest.raises(InvalidArgumentError, match="optimizer must be"):
        EmbeddingShard(10, optimizer="adam")


def test_empty_batches() -> None:
    shard = EmbeddingShard(10, optimizer=SGD())
    assert shard.lookup(u64([]), 4, train=True).shape == (0, 4)
    assert shard.lookup(u64([]), 4, train=False).shape == (0, 4)
    assert shard.update(u64([]), np.zeros((0, 4), np.float32)) == 0


def test_concurrent_lookups_and_updates_stay_consistent() -> None:
    shard = EmbeddingShard(3000, optimizer=Adagrad())
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(40):
                ids = np.unique(rng.integers(0, 20_000, 500).astype(np.uint64))
                dim = int(rng.choice([4, 8]))
                out = shard.lookup(ids, dim, train=True)
                assert out.shape == (len(ids), dim)
                shard.update(ids, np.ones((len(ids), dim), np.float32))
                shard.lookup(ids, dim, train=False)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = shard.stats()
    assert s.rows <= 3000 and s.evictions > 0
    assert s.rows == sum(len(shard.export_rows(d)) for d in shard.dims())
    assert s.inserts - s.evictions == s.rows


def _bag(rows: np.ndarray, offsets: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    """torch.nn.EmbeddingBag(mode="sum") over already gathered rows."""
    return torch.nn.functional.embedding_bag(
        torch.arange(len(rows)),
        torch.from_numpy(rows),
        torch.from_numpy(offsets),
        mode="sum",
        per_sample_weights=None if weights is None else torch.from_numpy(weights),
    ).numpy()


def _pooling_case(seed: int, n_bags: int, pool: int):
    """IDs in bags of 0..4 (empty bags included), their offsets and sqrt weights."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([[0], rng.integers(0, 5, n_bags - 2), [0]])
    ids = u64(rng.integers(0, pool, int(lengths.sum())))
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    sqrt = np.repeat((1 / np.sqrt(np.maximum(lengths, 1))).astype(np.float32), lengths)
    return ids, offsets, sqrt


@pytest.mark.parametrize("weighted", [False, True])
def test_lookup_pooled_eval_equals_lookup_then_embedding_bag(weighted: bool) -> None:
    shard = EmbeddingShard(10_000, optimizer=SGD())
    shard.lookup(u64(np.arange(0, 400, 2)), 8, train=True)  # even IDs known, odd unknown
    ids, offsets, sqrt = _pooling_case(1, 300, 400)
    weights = sqrt if weighted else None
    before = shard.stats()

    pooled = shard.lookup_pooled(ids, 8, offsets, weights)

    middle = shard.stats()
    expected = _bag(shard.lookup(ids, 8, train=False), offsets, weights)
    after = shard.stats()
    assert pooled.dtype == np.float32 and pooled.shape == (300, 8)
    # Bit-equal, weighted too: both add weighted terms with a fused multiply-add.
    np.testing.assert_array_equal(pooled, expected)
    assert not pooled[0].any() and not pooled[-1].any()
    unknown = int(np.count_nonzero(ids % np.uint64(2)))
    assert unknown > 0
    # counted exactly like an eval lookup; nothing inserted, no stamp refreshed
    assert middle.misses - before.misses == after.misses - middle.misses == unknown
    assert middle.lookups - before.lookups == 1
    assert middle.ids_looked_up - before.ids_looked_up == len(ids)
    assert shard.size() == 200


def test_weighted_pooling_rounds_each_multiply_add_once() -> None:
    # Reference: each term w * x + acc computed exactly in float64 (a float32 product is exact
    # there) and rounded once to float32, as llvm.fma and torch's embedding_bag do.
    shard = EmbeddingShard(10_000, optimizer=SGD())
    ids, offsets, sqrt = _pooling_case(7, 400, 300)
    rows = shard.lookup(ids, 5, train=True)
    pooled = shard.lookup_pooled(ids, 5, offsets, sqrt)
    ends = np.append(offsets[1:], len(ids))
    expected = np.zeros((len(offsets), 5), dtype=np.float32)
    for bag, (start, end) in enumerate(zip(offsets, ends)):
        for i in range(start, end):
            term = np.float64(sqrt[i]) * rows[i].astype(np.float64)
            expected[bag] = (term + expected[bag].astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(pooled, expected)
    unfused = np.zeros_like(expected)  # multiply, round, add, round: differs in some bags
    for bag, (start, end) in enumerate(zip(offsets, ends)):
        for i in range(start, end):
            unfused[bag] += sqrt[i] * rows[i]
    assert not np.array_equal(unfused, expected)


def test_lookup_pooled_exact_values() -> None:
    shard = EmbeddingShard(100)
    shard.import_rows(RowBlock(u64(7, 8), np.array([[1, 2], [10, 20]], np.float32), state=None))
    offsets = np.array([0, 0, 2, 3], dtype=np.int64)  # bags: [], [7, 99], [8], [8, 7]
    ids = u64(7, 99, 8, 8, 7)
    assert shard.lookup_pooled(ids, 2, offsets).tolist() == [[0, 0], [1, 2], [10, 20], [11, 22]]
    w = np.array([2, 5, 0.5, 1, 3], np.float32)
    assert shard.lookup_pooled(ids, 2, offsets, w).tolist() == [[0, 0], [2, 4], [5, 10], [13, 26]]
    # a dim without rows: zeros, all misses
    assert shard.lookup_pooled(ids, 3, offsets).tolist() == [[0, 0, 0]] * 4
    assert shard.stats().misses == 1 + 1 + 5


@pytest.mark.parametrize("weighted", [False, True])
def test_lookup_pooled_train_matches_train_lookup(weighted: bool) -> None:
    """Same rows admitted, stamped, evicted and initialized as lookup(train=True)."""
    config = InitializationConfig(admit_probability=0.7, seed=5)
    a = EmbeddingShard(150, optimizer=Adagrad(), initialization=config)
    b = EmbeddingShard(150, optimizer=Adagrad(), initialization=config)
    for seed in range(12):
        ids, offsets, sqrt = _pooling_case(seed, 60, 400)
        weights = sqrt if weighted else None
        pooled = b.lookup_pooled(ids, 4, offsets, weights, train=True)
        expected = _bag(a.lookup(ids, 4, train=True), offsets, weights)
        if weighted:
            np.testing.assert_allclose(pooled, expected, rtol=1e-6, atol=1e-7)
        else:
            np.testing.assert_array_equal(pooled, expected)
    assert a.stats() == b.stats()
    assert a.stats().evictions > 0 and a.stats().rejected_admissions > 0
    ra, rb = a.export_rows(4), b.export_rows(4)
    np.testing.assert_array_equal(ra.ids, rb.ids)
    np.testing.assert_array_equal(ra.weights, rb.weights)
    np.testing.assert_array_equal(ra.state, rb.state)


def test_lookup_pooled_checks_arguments_before_changing_anything() -> None:
    shard = EmbeddingShard(100, optimizer=SGD())
    ids = u64(1, 2, 3)
    for train in (False, True):
        with pytest.raises(InvalidArgumentError, match="bag_offsets must be non-decreasing"):
            shard.lookup_pooled(ids, 4, np.array([0, 2, 1]), train=train)
        with pytest.raises(InvalidArgumentError, match=r"weights must be None or a float32 \[3\]"):
            shard.lookup_pooled(ids, 4, np.array([0]), np.ones(2, np.float32), train=train)
        with pytest.raises(InvalidArgumentError, match="ids must be a uint64"):
            shard.lookup_pooled(ids.astype(np.int64), 4, np.array([0]), train=train)
        with pytest.raises(InvalidArgumentError, match="dim must be a positive integer"):
            shard.lookup_pooled(ids, 0, np.array([0]), train=train)
    assert shard.size() == 0 and shard.stats().lookups == 0
    shard.lookup(ids, 4, train=True)
    with pytest.raises(InvalidArgumentError, match="stay <= 3"):
        shard.lookup_pooled(ids, 4, np.array([0, 4]))
    assert shard.stats().lookups == 1 and shard.stats().misses == 0


def test_lookup_pooled_on_a_read_only_shard() -> None:
    source = EmbeddingShard(100)
    source.lookup(u64(1, 2), 4, train=True)
    shard = EmbeddingShard(100, read_only=True)
    shard.replace_rows([source.export_rows(4)])
    pooled = shard.lookup_pooled(u64(1, 2, 3), 4, np.array([0, 1]))
    np.testing.assert_array_equal(pooled[0], source.lookup(u64(1), 4, train=False)[0])
    with pytest.raises(FailedPreconditionError, match="read-only"):
        shard.lookup_pooled(u64(1), 4, np.array([0]), train=True)


def test_lookup_pooled_is_safe_against_concurrent_evictions() -> None:
    """Eval pooling runs under the shard lock: a row is its vector or zeros, never torn."""
    shard = EmbeddingShard(2000)
    probe = u64(np.arange(3000))
    vectors = initial_vectors(probe, 8, InitializationConfig())
    offsets = np.arange(len(probe), dtype=np.int64)  # one ID per bag
    stop = threading.Event()
    errors: list[BaseException] = []

    def trainer() -> None:
        rng = np.random.default_rng(0)
        try:
            for _ in range(200_000):  # keeps inserting, evicting and compacting (bounded)
                if stop.is_set():
                    break
                shard.lookup(u64(rng.integers(0, 3000, 700)), 8, train=True)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=trainer)
    thread.start()
    checked = 0
    deadline = time.monotonic() + 30
    try:
        # until several bulk evictions happened in between (the trainer needs the GIL too)
        while (checked < 30 or shard.stats().evictions < 5 * 200) and time.monotonic() < deadline:
            pooled = shard.lookup_pooled(probe, 8, offsets)
            known = pooled.any(axis=1)
            np.testing.assert_array_equal(pooled[known], vectors[known])
            checked += 1
            time.sleep(0.001)
    finally:
        stop.set()
        thread.join()
    assert not errors
    assert shard.stats().evictions >= 5 * 200


def test_rows_start_on_cache_lines() -> None:
    """A dim-16 float32 row is one 64-byte line only if the array starts on a line."""
    for shape, dtype in [((1000, 16), np.float32), ((3, 0), np.float32), ((0, 4), np.float64)]:
        a = zeros_aligned(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and not a.any()
        assert a.flags.c_contiguous and a.flags.writeable
        assert a.size == 0 or a.ctypes.data % 64 == 0
    shard = EmbeddingShard(100_000, optimizer=Adagrad())
    for n in (10, 5000, 60_000):  # growth reallocates
        shard.lookup(u64(np.arange(n)), 16, train=True)
        table = shard._tables[16]
        assert table.weights.ctypes.data % 64 == 0 and table.state.ctypes.data % 64 == 0


@pytest.mark.parametrize(
    ("optimizer", "column", "what"),
    [
        (Adagrad(lr=0.1), 2, "adagrad accumulators must be >= 0"),
        (Adagrad(lr=0.1, vectorwise_shared=True), 0, "adagrad accumulators must be >= 0"),
        (Adam(lr=0.1), 3 + 1, "adam second moments and step counts must be >= 0"),  # v[1]
        (Adam(lr=0.1), 2 * 3, "adam second moments and step counts must be >= 0"),  # the step
    ],
)
def test_imported_optimizer_state_that_would_make_rows_nan_is_refused(
    optimizer, column, what
) -> None:
    # Finite but negative: sqrt of a negative accumulator makes the row NaN on its next update.
    shard = EmbeddingShard(100, optimizer=optimizer)
    ids = u64(1, 2)
    before = shard.lookup(ids, 3, train=True).copy()
    state = optimizer.initial_state(2, 3)
    state[1, column] = -0.5
    weights = np.ones((2, 3), np.float32)
    with pytest.raises(InvalidArgumentError, match=rf"{what}, but row 1 holds -0.5"):
        shard.import_rows(RowBlock(ids, weights, state))
    with pytest.raises(InvalidArgumentError, match=what):  # a checkpoint's rows: refused too
        shard.replace_rows([RowBlock(ids, weights, state)])
    np.testing.assert_array_equal(shard.lookup(ids, 3, train=False), before)  # unchanged
    state[1, column] = 0.0  # zero is a valid accumulator, moment and step
    shard.import_rows(RowBlock(ids, weights, state))
    shard.update(ids, np.ones((2, 3), np.float32))
    assert np.isfinite(shard.lookup(ids, 3, train=False)).all()
    # The first moments of Adam may be negative
    if isinstance(optimizer, Adam):
        state[:, :3] = -1.0
        shard.import_rows(RowBlock(ids, weights, state))


@pytest.mark.parametrize("optimizer", [Adagrad(lr=0.1), Adam()], ids=["adagrad", "adam"])
def test_state_a_shard_writes_for_a_huge_finite_gradient_moves_to_another_shard(optimizer):
    # A finite gradient past ~1e20 makes the accumulator / second moment +Inf: the row stays
    # finite (its updates become 0) and loads from a checkpoint; ImportRows refused it as
    # "non-finite", so the rows could not be moved to another shard.
    source = EmbeddingShard(100, optimizer=optimizer)
    ids = u64(5, 6)
    source.lookup(ids, 4, train=True)
    source.update(ids, np.full((2, 4), 1e30, np.float32))
    block = source.export_rows(4)
    assert np.isinf(block.state).any() and np.isfinite(block.weights).all()
    target = EmbeddingShard(100, optimizer=optimizer)
    target.import_rows(block)
    moved = target.export_rows(4)
    np.testing.assert_array_equal(moved.state, block.state)
    target.update(ids, np.ones((2, 4), np.float32))
    assert np.isfinite(target.lookup(ids, 4, train=False)).all()


def test_imported_adam_first_moments_must_be_finite() -> None:
    shard = EmbeddingShard(100, optimizer=Adam())
    ids = u64(1, 2)
    state = Adam().initial_state(2, 3)
    state[1, 2] = -np.inf  # the next update would make the row infinite
    with pytest.raises(InvalidArgumentError, match="adam first moments must be finite, but row 1"):
        shard.import_rows(RowBlock(ids, np.ones((2, 3), np.float32), state))
    state[1, 2] = np.nan
    with pytest.raises(InvalidArgumentError, match=r"block\.state has NaN values"):
        shard.import_rows(RowBlock(ids, np.ones((2, 3), np.float32), state))
    assert shard.size() == 0


def test_last_misses_of_a_train_lookup_count_the_rejected_admissions() -> None:
    config = InitializationConfig(admit_probability=0.5, seed=11)
    shard = EmbeddingShard(1000, initialization=config)
    ids = u64(np.arange(64) + 5000)
    ok = admitted(ids, config)
    assert 0 < ok.sum() < 64
    shard.lookup(ids, 4, train=True)
    assert shard.last_misses == 64 - int(ok.sum())  # per occurrence
    assert shard.last_missing is not None and shard.last_missing.tolist() == (~ok).tolist()
    doubled = np.concatenate([ids, ids])
    shard.lookup_pooled(doubled, 4, np.array([0, 64], np.int64), train=True)
    assert shard.last_misses == 2 * (64 - int(ok.sum()))
    assert shard.last_missing is not None
    assert shard.last_missing.tolist() == np.concatenate([~ok, ~ok]).tolist()
    shard.lookup(ids[ok], 4, train=True)  # all held: nothing answered with zeros
    assert (shard.last_misses, shard.last_missing) == (0, None)


def test_last_missing_flags_the_positions_an_eval_lookup_answered_with_zeros() -> None:
    """Per position of the IDs asked (duplicates included), on both lookup paths."""
    shard = EmbeddingShard(100)
    shard.lookup(u64(1, 2), 4, train=False)  # no table of dim 4 yet: every ID
    assert (shard.last_misses, shard.last_missing.tolist()) == (2, [True, True])
    shard.lookup(u64(1, 2), 4, train=True)
    asked = u64(1, 7, 2, 7, 9, 1)
    shard.lookup(asked, 4, train=False)
    expected = [False, True, False, True, True, False]
    assert (shard.last_misses, shard.last_missing.tolist()) == (3, expected)
    shard.lookup_pooled(asked, 4, np.array([0, 2, 2], np.int64))  # the fused kernel
    assert (shard.last_misses, shard.last_missing.tolist()) == (3, expected)
    shard.lookup_pooled(u64(2, 1), 4, np.array([0], np.int64))
    assert (shard.last_misses, shard.last_missing) == (0, None)


def test_eviction_keeps_each_surviving_rows_optimizer_state_with_its_id() -> None:
    """Compaction after a bulk eviction moves ids, weights, stamps AND optimizer state."""
    shard = EmbeddingShard(10, optimizer=Adagrad(lr=0.1, initial_accumulator_value=0.5))
    ids = u64(range(10))
    shard.lookup(ids, 2, train=True)
    grads = np.arange(20, dtype=np.float32).reshape(10, 2) + 1  # a distinct state per row
    shard.update(ids, grads)
    before = shard.export_rows(2)
    by_id = {
        int(i): (w.copy(), s.copy()) for i, w, s in zip(before.ids, before.weights, before.state)
    }
    # rows 0..9 stamped 0..9; touch 0 and 1 so that 2 and 3 are the oldest, then insert one
    shard.lookup(u64(0, 1), 2, train=True)
    shard.lookup(u64(100), 2, train=True)  # evicts ceil(10 / 10) = 1 row: ID 2
    after = shard.export_rows(2)
    assert set(after.ids.tolist()) == {0, 1, *range(3, 10), 100}
    for i, w, s in zip(after.ids.tolist(), after.weights, after.state):
        if i == 100:
            np.testing.assert_array_equal(s, [0.5, 0.5])  # fresh accumulators
            continue
        np.testing.assert_array_equal(w, by_id[i][0])
        np.testing.assert_array_equal(s, by_id[i][1])
        # the accumulator is initial + grad**2 of that very row
        np.testing.assert_array_equal(s, np.float32(0.5) + grads[i] * grads[i])


def test_replace_rows_takes_exactly_capacity_rows_and_refuses_one_more() -> None:
    weights = np.ones((11, 4), np.float32)
    shard = EmbeddingShard(10, read_only=True)
    shard.replace_rows([RowBlock(u64(range(10)), weights[:10], None)])
    assert shard.size() == 10
    with pytest.raises(CapacityError, match="needs 11 rows but its capacity is 10"):
        shard.replace_rows([RowBlock(u64(range(11)), weights, None)])
    # duplicated IDs count once
    shard.replace_rows([RowBlock(u64(*range(10), 0), weights, None)])
    assert shard.size() == 10


def test_row_arrays_never_grow_past_the_capacity() -> None:
    shard = EmbeddingShard(3000)
    for start, stop in ((0, 1000), (1000, 2100), (2100, 2500), (2500, 3000)):
        shard.lookup(u64(range(start, stop)), 4, train=True)  # the last doubling is capped
    assert shard.size() == 3000
    table = shard._tables[4]
    assert table.alloc == 3000
    assert all(a.shape[0] == 3000 for a in (table.ids, table.weights, table.state, table.stamps))


def test_importing_a_single_new_row_inserts_it_and_leaves_the_others() -> None:
    shard = EmbeddingShard(10, optimizer=Adagrad(initial_accumulator_value=0.25))
    shard.lookup(u64(1, 2, 3), 4, train=True)
    before = shard.export_rows(4)
    shard.import_rows(RowBlock(u64(7), np.full((1, 4), 3.5, np.float32), None))
    after = shard.export_rows(4)
    assert after.ids.tolist() == [1, 2, 3, 7]
    np.testing.assert_array_equal(after.weights[:3], before.weights)
    np.testing.assert_array_equal(after.state[:3], before.state)
    np.testing.assert_array_equal(after.weights[3], [3.5, 3.5, 3.5, 3.5])
    np.testing.assert_array_equal(after.state[3], [0.25, 0.25, 0.25, 0.25])
    assert shard.stats().inserts == 4


def _held_ids(shard: EmbeddingShard) -> set[int]:
    return {int(i) for dim in shard.dims() for i in shard.export_rows(dim).ids}


def test_exported_rows_carry_the_lru_order_over_dims_and_replace_rows_restores_it():
    """Used in the order 1, 2 (dim 4), 3 (dim 8), 1 again: least recently used first that
    is 2, 3, 1. A shard refilled from the export evicts 2 and 3 for five new rows, as the
    original does (loading dim by dim in row order used to evict 2 and 1)."""
    u64 = lambda *ids: np.array(ids, dtype=np.uint64)  # noqa: E731
    shard = EmbeddingShard(6, optimizer=SGD(lr=0.1))
    shard.lookup(u64(1, 2), 4, train=True)
    shard.lookup(u64(3), 8, train=True)
    shard.lookup(u64(1), 4, train=True)
    blocks = shard.export_all()  # rows in row order, recency their LRU rank over all dims
    assert {dim: (b.ids.tolist(), b.recency.tolist()) for dim, b in blocks.items()} == {
        4: ([1, 2], [2, 0]),
        8: ([3], [1]),
    }
    assert shard.export_rows(4).ids.tolist() == [2, 1]  # least recently used first
    restored = EmbeddingShard(6, optimizer=SGD(lr=0.1))
    restored.replace_rows(list(blocks.values()))
    for held in (shard, restored):
        held.lookup(u64(10, 11, 12, 13, 14), 8, train=True)
        assert held.stats().evictions == 2
        assert _held_ids(held) == {1, 10, 11, 12, 13, 14}


def test_rows_without_recency_are_used_in_block_order_and_bad_recency_is_refused():
    u64 = lambda *ids: np.array(ids, dtype=np.uint64)  # noqa: E731
    weights = np.zeros((2, 4), dtype=np.float32)
    shard = EmbeddingShard(3, optimizer=SGD(lr=0.1))
    shard.replace_rows([RowBlock(u64(5, 6), weights, None)])  # as older checkpoints hold
    shard.lookup(u64(7, 8), 4, train=True)  # evicts the first row of the block
    assert _held_ids(shard) == {6, 7, 8}
    with pytest.raises(InvalidArgumentError) as refused:
        shard.replace_rows([RowBlock(u64(5, 6), weights, None, np.zeros(2, np.float32))])
    assert str(refused.value) == "block.recency must be None or an int64 [2] array, got float32[2]"
    assert _held_ids(shard) == {6, 7, 8}


class _ReferenceLru:
    """The shard's documented LRU, written plainly: stamps ``clock + position`` per train
    lookup (the last position of a repeated ID wins); when new IDs do not fit, evict the
    ``max(ceil(capacity / 10), needed)`` least recently used rows not in this lookup."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rows: dict[int, tuple[int, np.ndarray]] = {}  # ID -> (stamp, initial vector)
        self.clock = 0

    def lookup(self, ids: list[int], dim: int) -> np.ndarray:
        base, self.clock = self.clock, self.clock + len(ids)
        new = [i for i in dict.fromkeys(ids) if i not in self.rows]
        if new and len(self.rows) + len(new) > self.capacity:
            held = sum(1 for stamp, _ in self.rows.values() if stamp >= base)
            held += len({i for i in ids if i in self.rows and self.rows[i][0] < base})
            if held + len(new) > self.capacity:
                raise CapacityError("too many distinct IDs")
            old = sorted((stamp, i) for i, (stamp, _) in self.rows.items() if i not in ids)
            k = max(-(-self.capacity // 10), len(self.rows) + len(new) - self.capacity)
            for _, i in old[:k]:
                del self.rows[i]
        for position, i in enumerate(ids):
            vector = self.rows[i][1] if i in self.rows else None
            if vector is None:
                vector = initial_vectors(np.array([i], dtype=np.uint64), dim)[0]
            self.rows[i] = (base + position, vector)
        return np.stack([self.rows[i][1] for i in ids])


def test_lru_eviction_matches_a_reference_also_across_checkpoint_round_trips():
    """Random train lookups of two dims on small shards, now and then replaced by a fresh
    shard loaded from its own export (as a resumed run is): rows read and rows held always
    equal the reference's. A round trip used to forget the LRU order."""
    rng = np.random.default_rng(0)
    for _ in range(60):
        capacity = int(rng.integers(5, 40))
        shard, reference = EmbeddingShard(capacity, optimizer=SGD(lr=0.1)), _ReferenceLru(capacity)
        for _ in range(60):
            dim = int(rng.choice([4, 8]))
            ids = rng.integers(0, 40, int(rng.integers(1, 8))) * 2 + (dim == 8)  # disjoint
            try:
                rows = shard.lookup(ids.astype(np.uint64), dim, train=True)
            except CapacityError:
                with pytest.raises(CapacityError):
                    reference.lookup(ids.tolist(), dim)
                break
            assert np.array_equal(rows, reference.lookup(ids.tolist(), dim))
            held = {int(i) for d in shard.dims() for i in shard.export_rows(d).ids}
            assert held == set(reference.rows)
            if rng.random() < 0.1:
                blocks = list(shard.export_all().values())
                shard = EmbeddingShard(capacity, optimizer=SGD(lr=0.1))
                shard.replace_rows(blocks)


@pytest.mark.parametrize(
    "optimizer",
    [Adagrad(lr=0.1, initial_accumulator_value=0.25), Adam(lr=0.1, betas=(0.5, 0.75))],
    ids=["adagrad", "adam"],
)
def test_a_trained_row_evicted_and_looked_up_again_starts_over(optimizer) -> None:
    """It comes back with its ID's initial vector and fresh optimizer state (Adam's step
    count back to 0), so its next update is a first update, as for an ID never seen."""
    init = InitializationConfig(low=-0.5, high=0.5, seed=11)
    shard = EmbeddingShard(4, optimizer=optimizer, initialization=init)  # evicts 1 row at a time
    grads = np.array([[1, -2], [3, 4], [-5, 6], [7, 8]], np.float32)
    shard.lookup(u64(1, 2, 3, 4), 2, train=True)
    for _ in range(3):
        shard.update(u64(1, 2, 3, 4), grads)
    fresh = initial_vectors(u64(1), 2, init)
    assert not np.array_equal(shard.lookup(u64(1), 2, train=False), fresh)
    shard.lookup(u64(2, 3, 4), 2, train=True)  # ID 1 is now the least recently used
    shard.lookup(u64(5), 2, train=True)  # evicts ID 1
    shard.update(u64(5), grads[:1])  # trained state in every row slot the shard has used
    assert held(shard, 2) == {2, 3, 4, 5}

    again = shard.lookup(u64(1), 2, train=True)  # evicts ID 2, brings ID 1 back
    assert held(shard, 2) == {1, 3, 4, 5}
    np.testing.assert_array_equal(again, fresh)
    block = shard.export_rows(2)
    row = block.ids.tolist().index(1)
    np.testing.assert_array_equal(block.state[row], optimizer.initial_state(1, 2)[0])
    shard.update(u64(1), grads[:1])
    weights, state = fresh.copy(), optimizer.initial_state(1, 2)
    optimizer.apply(weights, state, np.array([0]), grads[:1])
    block = shard.export_rows(2)
    row = block.ids.tolist().index(1)
    np.testing.assert_array_equal(block.weights[row], weights[0])
    np.testing.assert_array_equal(block.state[row], state[0])
