"""embedding_store.hashing: the routing hash is part of the checkpoint format (a shard's files
hold the IDs ``shard_of`` gives it, and loads re-shard with it), so its values are pinned to
the SplitMix64 reference and must never change."""

from __future__ import annotations

import numpy as np
import pytest

from embedding_store.hashing import shard_of, splitmix64

IDS = np.array([0, 1, 2, 12345, 2**63, 2**64 - 1], dtype=np.uint64)


def test_splitmix64_matches_the_reference_generator():
    # SplitMix64 (Steele, Lea, Flood 2014) seeded with s first returns
    # mix(s + 0x9E3779B97F4A7C15), which is splitmix64(s) here: the reference generator's first
    # outputs for seeds 0 and 1 are these two published values.
    out = splitmix64(IDS)
    assert out.dtype == np.uint64
    assert int(out[0]) == 0xE220A8397B1DCDAF
    assert int(out[1]) == 0x910A2DEC89025CC1
    assert [int(v) for v in out[2:]] == [
        10905525725756348110,
        2454886589211414944,
        5196802822362493915,
        16490336266968443936,
    ]


def test_shard_routing_is_pinned():
    assert shard_of(IDS, 1).tolist() == [0] * len(IDS)
    assert shard_of(IDS, 2).tolist() == [1, 1, 0, 0, 1, 0]
    assert shard_of(IDS, 3).tolist() == [1, 2, 1, 2, 1, 2]
    assert shard_of(IDS, 8).tolist() == [7, 1, 6, 0, 3, 0]


def test_routing_spreads_ids_evenly():
    ids = np.arange(100_000, dtype=np.uint64)
    counts = np.bincount(shard_of(ids, 4), minlength=4)
    assert counts.min() > 24_000 and counts.max() < 26_000  # sequential IDs spread too


def test_shard_of_returns_int64_and_refuses_no_shards():
    """Shards index arrays and are compared with int64 shard ids: the dtype is part of the
    contract, for one shard as for many."""
    for num_shards in (1, 3):
        shards = shard_of(IDS, num_shards)
        assert shards.dtype == np.int64 and shards.shape == IDS.shape
    for num_shards in (0, -2):
        with pytest.raises(ValueError, match=f"num_shards must be >= 1, got {num_shards}"):
            shard_of(IDS, num_shards)
