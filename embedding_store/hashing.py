"""Stable, vectorized 64-bit hashing used for shard routing, hash stacking and initialization.

All functions take and return ``numpy.uint64`` arrays and are deterministic across processes,
machines and shard counts (no Python ``hash``, no random seeds from the environment).
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(ids: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer of ``ids`` (uint64 [n]) -> uint64 [n]; a bijection on uint64."""
    with np.errstate(over="ignore"):
        z = np.asarray(ids, dtype=np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def shard_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """Owning shard of each (prefixed) ID: uint64 [n] -> int64 [n] in ``[0, num_shards)``.

    The hash is mixed first so that IDs sharing low bits (or one feature prefix) spread evenly.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if num_shards == 1:
        return np.zeros(len(ids), dtype=np.int64)
    return (splitmix64(ids) % np.uint64(num_shards)).astype(np.int64)
