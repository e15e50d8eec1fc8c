"""JIT-compiled open-addressing hash map from uint64 IDs to int64 row indexes.

The table is two parallel power-of-two arrays, ``keys`` (uint64) and ``vals`` (int64), probed
linearly. A slot is empty when its value is ``-1``, so every uint64 (0 and 2**64-1 included) is
a valid key. The load factor is kept at or below 0.5; growing rebuilds the table at double size.
There are no per-key deletes: the shard evicts in bulk, compacts its rows and calls
:meth:`IdIndex.rebuild`.

Slots are chosen by a *salted* SplitMix64 mix of the key. The salt matters: shard routing uses
``splitmix64(id) % num_shards`` (:mod:`embedding_store.hashing`), so with an unsalted mix all IDs
of one shard would share the low bits of their hash and crowd a fraction of the table.

All kernels are ``@njit(cache=True, nogil=True)`` loops over whole arrays; :class:`IdIndex` is
not thread-safe by itself (the shard serializes access with its lock).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from embedding_store.errors import InvalidArgumentError

EMPTY = -1
MIN_CAPACITY = 16

_SALT = np.uint64(0x5BD1E9955BD1E995)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


@njit(cache=True, nogil=True)
def _home_slot(key, mask):
    """Salted SplitMix64 of ``key`` masked to the table: the first slot to probe."""
    z = (key ^ _SALT) + _GOLDEN
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    z = z ^ (z >> _S31)
    return np.int64(z & np.uint64(mask))


@njit(cache=True, nogil=True)
def lookup_kernel(keys, vals, ids, out):
    """``out[i]`` = row of ``ids[i]`` or -1."""
    mask = keys.shape[0] - 1
    for i in range(ids.shape[0]):
        k = ids[i]
        s = _home_slot(k, mask)
        while True:
            v = vals[s]
            if v == EMPTY:
                out[i] = EMPTY
                break
            if keys[s] == k:
                out[i] = v
                break
            s = (s + 1) & mask


@njit(cache=True, nogil=True)
def lookup_stamp_kernel(keys, vals, ids, out, stamps, base):
    """Like :func:`lookup_kernel`, and sets ``stamps[row] = base + i`` for every hit ``i``."""
    mask = keys.shape[0] - 1
    for i in range(ids.shape[0]):
        k = ids[i]
        s = _home_slot(k, mask)
        while True:
            v = vals[s]
            if v == EMPTY:
                out[i] = EMPTY
                break
            if keys[s] == k:
                out[i] = v
                stamps[v] = base + i
                break
            s = (s + 1) & mask


@njit(cache=True, nogil=True)
def get_or_insert_kernel(keys, vals, ids, out, start, next_row, size, limit):
    """Rows of ``ids[start:]``, inserting unknown keys with rows ``next_row, next_row+1, ...``.

    Duplicates inside ``ids`` get the same row. Stops *before* an insert that would take the
    map past ``limit`` entries and returns ``(first unprocessed index, next_row, size)``.
    """
    mask = keys.shape[0] - 1
    n = ids.shape[0]
    for i in range(start, n):
        k = ids[i]
        s = _home_slot(k, mask)
        while True:
            v = vals[s]
            if v == EMPTY:
                if size >= limit:
                    return i, next_row, size
                keys[s] = k
                vals[s] = next_row
                out[i] = next_row
                next_row += 1
                size += 1
                break
            if keys[s] == k:
                out[i] = v
                break
            s = (s + 1) & mask
    return n, next_row, size


@njit(cache=True, nogil=True)
def insert_rows_kernel(keys, vals, ids, rows, size):
    """Upsert ``ids[i] -> rows[i]``; returns the new entry count. The caller ensures room."""
    mask = keys.shape[0] - 1
    for i in range(ids.shape[0]):
        k = ids[i]
        s = _home_slot(k, mask)
        while True:
            v = vals[s]
            if v == EMPTY:
                keys[s] = k
                vals[s] = rows[i]
                size += 1
                break
            if keys[s] == k:
                vals[s] = rows[i]
                break
            s = (s + 1) & mask
    return size


@njit(cache=True, nogil=True)
def _reinsert_kernel(old_keys, old_vals, keys, vals):
    """Move every occupied slot of the old table into a (larger, empty) new table."""
    mask = keys.shape[0] - 1
    for j in range(old_keys.shape[0]):
        v = old_vals[j]
        if v == EMPTY:
            continue
        k = old_keys[j]
        s = _home_slot(k, mask)
        while vals[s] != EMPTY:
            s = (s + 1) & mask
        keys[s] = k
        vals[s] = v


def capacity_for(n: int) -> int:
    """Smallest power-of-two table (>= MIN_CAPACITY) holding ``n`` keys at load <= 0.5."""
    need = max(MIN_CAPACITY, 2 * int(n))
    return 1 << (need - 1).bit_length()


def _as_ids(ids: np.ndarray, name: str = "ids") -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
        actual = (
            f"{ids.dtype}{list(ids.shape)}" if isinstance(ids, np.ndarray) else type(ids).__name__
        )
        raise InvalidArgumentError(f"{name} must be a uint64 [n] array, got {actual}")
    return np.ascontiguousarray(ids)


class IdIndex:
    """uint64 ID -> int64 row map (open addressing, linear probing, load <= 0.5)."""

    def __init__(self, initial_capacity: int = MIN_CAPACITY) -> None:
        cap = max(MIN_CAPACITY, 1 << (max(int(initial_capacity), 1) - 1).bit_length())
        self._keys = np.zeros(cap, dtype=np.uint64)
        self._vals = np.full(cap, EMPTY, dtype=np.int64)
        self._size = 0

    @property
    def size(self) -> int:
        """Number of keys held."""
        return self._size

    @property
    def capacity(self) -> int:
        """Number of slots of the table (a power of two; holds at most capacity // 2 keys)."""
        return self._keys.shape[0]

    def __len__(self) -> int:
        return self._size

    def _grow_to(self, capacity: int) -> None:
        keys = np.zeros(capacity, dtype=np.uint64)
        vals = np.full(capacity, EMPTY, dtype=np.int64)
        _reinsert_kernel(self._keys, self._vals, keys, vals)
        self._keys, self._vals = keys, vals

    def reserve(self, n: int) -> None:
        """Make room for ``n`` keys in total without further growth."""
        if 2 * n > self.capacity:
            self._grow_to(capacity_for(n))

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` (uint64 [n]) -> int64 [n], -1 where missing."""
        ids = _as_ids(ids)
        out = np.empty(ids.shape[0], dtype=np.int64)
        lookup_kernel(self._keys, self._vals, ids, out)
        return out

    def lookup_stamp(self, ids: np.ndarray, stamps: np.ndarray, base: int) -> np.ndarray:
        """:meth:`lookup`, also writing ``stamps[row] = base + i`` for each hit at position i.

        Where an ID repeats, its last position wins.
        """
        ids = _as_ids(ids)
        out = np.empty(ids.shape[0], dtype=np.int64)
        lookup_stamp_kernel(self._keys, self._vals, ids, out, stamps, np.int64(base))
        return out

    def get_or_insert(self, ids: np.ndarray, next_free_row: int) -> tuple[np.ndarray, int]:
        """Rows of ``ids``, inserting unknown ones as ``next_free_row, next_free_row + 1, ...``.

        Duplicates within ``ids`` share one row. Returns ``(rows int64 [n], num_inserted)``.
        """
        ids = _as_ids(ids)
        n = ids.shape[0]
        out = np.empty(n, dtype=np.int64)
        start, next_row, size = 0, int(next_free_row), self._size
        while True:
            start, next_row, size = get_or_insert_kernel(
                self._keys, self._vals, ids, out, start, next_row, size, self.capacity // 2
            )
            self._size = size
            if start >= n:
                break
            self._grow_to(self.capacity * 2)
        return out, next_row - int(next_free_row)

    def insert_rows(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Upsert ``ids[i] -> rows[i]`` (ids uint64 [n], rows int64 [n], rows >= 0)."""
        ids = _as_ids(ids)
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if rows.shape != ids.shape:
            raise InvalidArgumentError(
                f"rows must have the shape of ids {list(ids.shape)}, got {list(rows.shape)}"
            )
        if rows.size and int(rows.min()) < 0:
            raise InvalidArgumentError("rows must be >= 0 (-1 marks an empty slot)")
        self.reserve(self._size + ids.shape[0])
        self._size = int(insert_rows_kernel(self._keys, self._vals, ids, rows, self._size))

    def rebuild(self, keys: np.ndarray) -> None:
        """Replace the whole map by ``keys[i] -> i`` (keys unique), sized for ``len(keys)``."""
        keys = _as_ids(keys, "keys")
        cap = capacity_for(keys.shape[0])
        self._keys = np.zeros(cap, dtype=np.uint64)
        self._vals = np.full(cap, EMPTY, dtype=np.int64)
        self._size = int(
            insert_rows_kernel(
                self._keys, self._vals, keys, np.arange(keys.shape[0], dtype=np.int64), 0
            )
        )

    def keys(self) -> np.ndarray:
        """The keys held (uint64, table order)."""
        return self._keys[self._vals != EMPTY].copy()
