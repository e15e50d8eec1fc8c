"""One embedding parameter-server shard, in process: rows, optimizer state, LRU eviction.

Layout. Rows of different widths live in separate per-dim tables; each table has one
:class:`~embedding_store.hashmap.IdIndex` (uint64 ID -> row), contiguous ``ids`` uint64 [rows],
``weights`` float32 [rows, dim], optimizer ``state`` float32 [rows, w] and a last-access
``stamps`` int64 [rows]. Arrays grow geometrically (doubling, capped by the shard capacity) and are
never reallocated per batch. IDs never collide across dims: the worker prefixes IDs per feature
group, so one ID lives in at most one table.

Capacity and LRU. ``capacity`` bounds the rows of the whole shard, all dims together. A shard-
wide clock advances by ``n`` per train lookup of ``n`` IDs; position ``i`` of the batch stamps
its row with ``clock + i`` (the last position wins for a repeated ID), so stamps are unique and
the least-recently-used order is exact and deterministic. When a train lookup (or
:meth:`EmbeddingShard.import_rows`) needs more rows than fit, the shard first stamps the IDs of
the lookup it already holds, then evicts IN BULK the least-recently-used rows across all dim
tables: ``max(ceil(capacity / 10), rows needed)``, never a row of this lookup. A lookup whose
distinct IDs (held plus new) exceed ``capacity`` raises :class:`CapacityError` before it inserts
or evicts anything (the rows it holds have become the most recently used). The LRU is
global to the shard: PERSIA's ``num_hashmap_internal_shards`` is accepted for compatibility
and ignored. Only train lookups and imports refresh stamps; eval lookups and updates do not.

What one lookup protects. A worker looks a batch up one dim group at a time, and several
batches are in flight under bounded staleness, so a shard that is nearly full can evict a row
that an earlier lookup (another dim of the same batch, or an earlier batch) read and whose
gradient has not arrived yet. That gradient is then dropped and counted in ``skipped_updates``,
as PERSIA drops updates of evicted rows; the row comes back with a fresh initial vector when
next looked up. Updates match rows by ID, as PERSIA's do: if another lookup brings the row back
before the late gradient arrives, that gradient (at most ``embedding_staleness`` batches old,
like any asynchronous update) is applied to the fresh row. The bulk eviction takes the least
recently used rows first, so this happens only when a shard's capacity is within a few batches'
worth of distinct IDs of its rows: size ``capacity`` well above ``embedding_staleness`` x the
distinct IDs a batch sends to one shard (docs/deploy.md), and watch ``skipped_updates``.

Training vs inference. A train lookup admits unknown IDs with probability ``admit_probability``
(deterministic per ID and seed; rejected IDs read as zeros and are not stored) and initializes
admitted ones with :func:`~embedding_store.initializer.initial_vectors` and the optimizer's
initial state. An eval/infer lookup (``train=False``) never inserts: unknown IDs read as zeros
and count as misses. :meth:`EmbeddingShard.lookup_pooled` is either lookup fused with sum
pooling (the rows are summed straight from the weight array, never copied out). A
``read_only`` shard refuses train lookups, updates, clear and row imports: it takes rows only
whole, from a checkpoint (:meth:`~EmbeddingShard.replace_rows`), so what it serves is always
one checkpoint's rows.

Generations. A load (:meth:`EmbeddingShard.replace_rows`) or a :meth:`~EmbeddingShard.clear`
replaces rows that train lookups may have read and whose gradients are still on their way
(from any worker: one worker drops its own forward contexts when a load or clear goes
through it, but cannot reach the others'). The shard counts such replacements in its
``generation`` (1 at start; it moves on only when train lookups read rows since the last
one, so a restarted shard's start-up load keeps 1), tells each train lookup its generation
(:attr:`EmbeddingShard.last_generation`), and :meth:`EmbeddingShard.update` refuses
gradients said to be computed at an older generation (``FailedPreconditionError``, counted
in ``stale_updates``) instead of applying them to the new rows of the same IDs.

Threads. Every public method holds one ``threading.Lock``; the numba kernels release the GIL.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from embedding_store.errors import CapacityError, FailedPreconditionError, InvalidArgumentError
from embedding_store.hashmap import IdIndex, gather_rows_kernel, pool_rows_kernel, pooling_args
from embedding_store.initializer import InitializationConfig, admitted, initial_vectors
from embedding_store.optimizers import SGD, Adagrad, Adam

EVICTION_FRACTION = 0.1
_MIN_ALLOC = 1024


@dataclass(frozen=True)
class ShardStats:
    """Counters since the shard was created (``clear`` does not reset them).

    ``lookups`` / ``ids_looked_up``: calls and IDs (per occurrence) of all lookups, train and
    eval; ``eval_lookups`` / ``eval_ids_looked_up``: those of eval/infer lookups
    (``train=False``) alone, so the miss ratio is ``misses / eval_ids_looked_up``.
    ``misses``: unknown IDs of eval/infer lookups. ``inserts``: rows created (train lookups and
    imports); ``rows_loaded``: rows put in whole from checkpoints (``replace_rows``), counted
    apart so that a read-only shard's inserts stay 0. ``rejected_admissions``: unknown IDs of
    train lookups not admitted (per occurrence). ``skipped_updates``: IDs of ``update`` calls
    the shard no longer holds. ``stale_updates``: rows of ``update`` calls refused because a
    load or clear replaced the rows since their lookup (see "Generations" in the module
    docstring).
    """

    rows: int
    capacity: int
    lookups: int
    ids_looked_up: int
    misses: int
    inserts: int
    evictions: int
    rejected_admissions: int
    updates: int
    skipped_updates: int
    eval_lookups: int
    eval_ids_looked_up: int
    rows_loaded: int = 0
    stale_updates: int = 0


@dataclass(frozen=True)
class RowBlock:
    """Rows of one dim: ids uint64 [n], weights float32 [n, dim], optimizer state float32 [n, w].

    ``state=None`` (import only) means "no saved state": the shard initializes it.
    ``recency`` (int64 [n] or None): each row's place in its shard's least-recently-used
    order over all dims (smaller: used longer ago), as :meth:`EmbeddingShard.export_all`
    gives it; :meth:`EmbeddingShard.replace_rows` restores that order from it. None: unknown
    (the rows count as used in block order).
    """

    ids: np.ndarray
    weights: np.ndarray
    state: np.ndarray | None
    recency: np.ndarray | None = None

    @property
    def dim(self) -> int:
        return int(self.weights.shape[1])

    def __len__(self) -> int:
        return int(self.ids.shape[0])


CACHE_LINE = 64


def zeros_aligned(shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
    """``np.zeros(shape, dtype)`` whose data starts on a 64-byte cache-line boundary.

    numpy's own large allocations start 16 bytes into a page, so every 64-byte row (dim 16
    float32) would straddle two cache lines: two memory accesses per random row instead of one.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buffer = np.zeros(nbytes + CACHE_LINE, dtype=np.uint8)
    start = -buffer.ctypes.data % CACHE_LINE
    return buffer[start : start + nbytes].view(dtype).reshape(shape)


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{list(value.shape)}"
    return type(value).__name__


def _check_ids(ids: object, name: str = "ids") -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
        raise InvalidArgumentError(f"{name} must be a uint64 [n] array, got {_describe(ids)}")
    return np.ascontiguousarray(ids)


def _check_dim(dim: object) -> int:
    if isinstance(dim, (bool, np.bool_)) or not isinstance(dim, (int, np.integer)) or dim < 1:
        raise InvalidArgumentError(f"dim must be a positive integer, got {dim!r}")
    return int(dim)


def _check_optimizer(optimizer: object) -> None:
    if not isinstance(optimizer, (SGD, Adagrad, Adam)):
        raise InvalidArgumentError(
            f"optimizer must be an SGD, Adagrad or Adam instance, got {type(optimizer).__name__}"
        )


class _DimTable:
    """Rows of one width: index + contiguous arrays, ``size`` of them in use."""

    def __init__(self, dim: int, width: int, alloc: int) -> None:
        self.dim = dim
        self.index = IdIndex(2 * alloc)
        self.ids = np.zeros(alloc, dtype=np.uint64)
        self.weights = zeros_aligned((alloc, dim), np.float32)
        self.state = zeros_aligned((alloc, width), np.float32)
        self.stamps = np.zeros(alloc, dtype=np.int64)
        self.size = 0

    @property
    def alloc(self) -> int:
        return self.ids.shape[0]

    def reserve(self, need: int, limit: int) -> None:
        """Room for ``need`` rows; doubling, but never past ``limit`` (>= need) rows."""
        if need <= self.alloc:
            return
        new = min(max(need, 2 * self.alloc, _MIN_ALLOC), max(limit, need))
        n = self.size
        for name in ("ids", "weights", "state", "stamps"):
            old = getattr(self, name)
            arr = zeros_aligned((new, *old.shape[1:]), old.dtype)
            arr[:n] = old[:n]
            setattr(self, name, arr)

    def compact(self, keep: np.ndarray) -> None:
        """Keep rows where ``keep`` (bool [size]) is true, in order, and rebuild the index."""
        n = int(np.count_nonzero(keep))
        for name in ("ids", "weights", "state", "stamps"):
            arr = getattr(self, name)
            arr[:n] = arr[: self.size][keep]
        self.size = n
        self.index.rebuild(self.ids[:n])

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """Weights of ``rows`` (int64 [n], row indices of this table; -1 gives zeros):
        float32 [n, dim], a copy."""
        out = np.empty((rows.shape[0], self.dim), dtype=np.float32)
        gather_rows_kernel(self.weights, rows, out)
        return out


class EmbeddingShard:
    """One shard of the embedding table (see the module docstring for the semantics)."""

    def __init__(
        self,
        capacity: int,
        *,
        optimizer: SGD | Adagrad | Adam | None = None,
        initialization: InitializationConfig | None = None,
        read_only: bool = False,
        replica_index: int = 0,
        replica_size: int = 1,
        num_hashmap_internal_shards: int = 1,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
            raise InvalidArgumentError(f"capacity must be an integer, got {capacity!r}")
        if capacity < 1:
            raise InvalidArgumentError(f"capacity must be >= 1, got {capacity}")
        if optimizer is not None:
            _check_optimizer(optimizer)
        initialization = InitializationConfig() if initialization is None else initialization
        if not isinstance(initialization, InitializationConfig):
            raise InvalidArgumentError(
                "initialization must be an InitializationConfig, "
                f"got {type(initialization).__name__}"
            )
        if not (isinstance(replica_size, (int, np.integer)) and replica_size >= 1):
            raise InvalidArgumentError(f"replica_size must be >= 1, got {replica_size!r}")
        if not (isinstance(replica_index, (int, np.integer)) and 0 <= replica_index < replica_size):
            raise InvalidArgumentError(
                f"replica_index must be in [0, {replica_size}), got {replica_index!r}"
            )
        if not (
            isinstance(num_hashmap_internal_shards, (int, np.integer))
            and num_hashmap_internal_shards >= 1
        ):
            raise InvalidArgumentError(
                f"num_hashmap_internal_shards must be >= 1, got {num_hashmap_internal_shards!r}"
            )
        self._capacity = int(capacity)
        self._optimizer = optimizer
        self._initialization = initialization
        self._read_only = bool(read_only)
        self.replica_index = int(replica_index)
        self.replica_size = int(replica_size)
        self.num_hashmap_internal_shards = int(num_hashmap_internal_shards)
        self._min_evict = max(1, -(-self._capacity // 10))
        self._lock = threading.Lock()
        self._tables: dict[int, _DimTable] = {}
        self._rows = 0
        self._clock = 0
        self._lookups = 0
        self._ids_looked_up = 0
        self._eval_lookups = 0
        self._eval_ids_looked_up = 0
        self._misses = 0
        self._local = threading.local()  # per-thread result of the last lookup
        self._inserts = 0
        self._rows_loaded = 0
        self._evictions = 0
        self._rejected = 0
        self._updates = 0
        self._skipped = 0
        self._checkpoint_version = ""
        self._modified = False  # rows changed since start or the last replace_rows
        self._stale_updates = 0
        # See "Generations" in the module docstring. _handed_out: a train lookup read rows
        # at this generation (its gradients may still come).
        self._generation = 1
        self._handed_out = False

    # ------------------------------------------------------------------ properties

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def read_only(self) -> bool:
        return self._read_only

    @property
    def optimizer(self) -> SGD | Adagrad | Adam | None:
        return self._optimizer

    @property
    def initialization(self) -> InitializationConfig:
        return self._initialization

    @property
    def checkpoint_version(self) -> str:
        """The version of the embedding checkpoint the rows were loaded from
        (:attr:`embedding_store.checkpoint_manifest.EmbeddingManifest.version`); ``""`` when
        none was loaded or the rows changed since (a train lookup inserted, an update, a clear,
        an import). Servers compare it with their model's to catch mixed versions."""
        return self._checkpoint_version

    @property
    def modified(self) -> bool:
        """Whether any row changed (a train lookup inserted, an update, a clear, an import)
        since the shard was created or its rows were last replaced from a checkpoint. A
        shard that is not modified holds nothing a dump would add: it is empty, or it holds
        a checkpoint's rows as loaded."""
        return self._modified

    @property
    def generation(self) -> int:
        """How many times a load or clear replaced rows that train lookups had read, plus 1
        (see "Generations" in the module docstring)."""
        return self._generation

    def size(self) -> int:
        """Rows held, all dims together."""
        return self._rows

    def dims(self) -> list[int]:
        """Row widths that have a table (sorted)."""
        with self._lock:
            return sorted(self._tables)

    def stats(self) -> ShardStats:
        with self._lock:
            return ShardStats(
                rows=self._rows,
                capacity=self._capacity,
                lookups=self._lookups,
                ids_looked_up=self._ids_looked_up,
                misses=self._misses,
                inserts=self._inserts,
                evictions=self._evictions,
                rejected_admissions=self._rejected,
                updates=self._updates,
                skipped_updates=self._skipped,
                eval_lookups=self._eval_lookups,
                eval_ids_looked_up=self._eval_ids_looked_up,
                rows_loaded=self._rows_loaded,
                stale_updates=self._stale_updates,
            )

    # ------------------------------------------------------------------ configuration

    def configure(
        self,
        *,
        optimizer: SGD | Adagrad | Adam | None = None,
        initialization: InitializationConfig | None = None,
    ) -> None:
        """Set the optimizer and/or initialization (``None`` leaves one unchanged).

        A different optimizer type (or state width) re-initializes the state of every row;
        new hyperparameters for the same type keep the state.
        """
        if optimizer is not None:
            _check_optimizer(optimizer)
        if initialization is not None and not isinstance(initialization, InitializationConfig):
            raise InvalidArgumentError(
                "initialization must be an InitializationConfig, "
                f"got {type(initialization).__name__}"
            )
        with self._lock:
            if optimizer is not None:
                old = self._optimizer
                for table in self._tables.values():
                    width = optimizer.state_width(table.dim)
                    if (
                        old is None
                        or type(old) is not type(optimizer)
                        or old.state_width(table.dim) != width
                    ):
                        state = zeros_aligned((table.alloc, width), np.float32)
                        state[: table.size] = optimizer.initial_state(table.size, table.dim)
                        table.state = state
                self._optimizer = optimizer
            if initialization is not None:
                self._initialization = initialization

    # ------------------------------------------------------------------ internals

    def _width(self, dim: int) -> int:
        return 0 if self._optimizer is None else self._optimizer.state_width(dim)

    def _table(self, dim: int, need: int) -> _DimTable:
        table = self._tables.get(dim)
        if table is None:
            alloc = min(self._capacity, max(_MIN_ALLOC, need))
            table = _DimTable(dim, self._width(dim), alloc)
            self._tables[dim] = table
        return table

    def _evict(self, needed: int, protect_from: int) -> None:
        """Evict ``max(min_evict, needed)`` LRU rows with stamps below ``protect_from``."""
        tables = [t for t in self._tables.values() if t.size]
        stamps = np.concatenate([t.stamps[: t.size] for t in tables])
        evictable_mask = stamps < protect_from
        evictable = int(np.count_nonzero(evictable_mask))
        k = min(max(self._min_evict, needed), evictable)
        if k <= 0:
            return
        if k == evictable:
            victims = evictable_mask
        else:
            victims = np.zeros(stamps.shape[0], dtype=bool)
            victims[np.argpartition(stamps, k - 1)[:k]] = True
        offset = 0
        for table in tables:
            mine = victims[offset : offset + table.size]
            offset += table.size
            if mine.any():
                table.compact(~mine)
        self._rows -= k
        self._evictions += k

    def _make_room(self, table: _DimTable, new_ids: np.ndarray, base: int, what: str) -> None:
        """Evict so that the distinct ``new_ids`` fit; the batch's held rows are protected."""
        if self._rows + new_ids.shape[0] <= self._capacity:
            return
        n_new = int(np.unique(new_ids).shape[0])
        if self._rows + n_new <= self._capacity:
            return
        held = int(np.count_nonzero(table.stamps[: table.size] >= base))
        if held + n_new > self._capacity:
            raise CapacityError(
                f"{what} needs {held + n_new} distinct rows ({n_new} new + {held} held) "
                f"but the shard's capacity is {self._capacity} rows"
            )
        self._evict(self._rows + n_new - self._capacity, base)

    def _insert(
        self, table: _DimTable, new_ids: np.ndarray, stamps: np.ndarray, fill: bool
    ) -> np.ndarray:
        """Insert ``new_ids`` (none held; duplicates allowed) -> their rows.

        With ``fill``, new rows get initial vectors and optimizer state (else the caller writes).
        """
        limit = table.size + (self._capacity - self._rows)
        table.reserve(min(table.size + new_ids.shape[0], limit), limit)
        start = table.size
        rows, k = table.index.get_or_insert(new_ids, start)
        table.ids[rows] = new_ids
        table.stamps[rows] = stamps
        if fill and k:
            table.weights[start : start + k] = initial_vectors(
                table.ids[start : start + k], table.dim, self._initialization
            )
            if self._optimizer is not None:
                table.state[start : start + k] = self._optimizer.initial_state(k, table.dim)
        table.size += k
        self._rows += k
        self._inserts += k
        if k:
            self._checkpoint_version = ""
            self._modified = True
        return rows

    # ------------------------------------------------------------------ data path

    def lookup(self, ids: np.ndarray, dim: int, *, train: bool) -> np.ndarray:
        """Rows of ``ids`` (uint64 [n], duplicates allowed) -> float32 [n, dim].

        ``train=True`` admits and inserts unknown IDs (evicting LRU rows when full);
        ``train=False`` never inserts: unknown IDs read as zeros and count as misses.
        """
        ids = _check_ids(ids)
        dim = _check_dim(dim)
        if train and self._read_only:
            raise FailedPreconditionError("this shard is read-only: train lookups are refused")
        with self._lock:
            table, rows = self._rows_locked(ids, dim, train)
            if table is None:
                return np.zeros((ids.shape[0], dim), dtype=np.float32)
            # _rows_locked returns rows with every table (None only with a None table).
            return table.gather(cast(np.ndarray, rows))

    @property
    def last_misses(self) -> int:
        """IDs answered with zeros by this thread's last lookup on this shard (unknown IDs of
        an eval lookup, or IDs refused admission by a train lookup)."""
        return getattr(self._local, "misses", 0)

    @property
    def last_missing(self) -> np.ndarray | None:
        """Which IDs this thread's last lookup on this shard answered with zeros (those
        :attr:`last_misses` counts): bool [n] over the positions of its ``ids``, or None when
        none was (``last_misses == 0``). A worker that deduplicated IDs before asking turns
        it into a count of ID occurrences, and splits it by sample."""
        return getattr(self._local, "missing", None)

    @property
    def last_generation(self) -> int | None:
        """The shard's :attr:`generation` when this thread's last train lookup on this shard
        read its rows (None before any): what the gradients computed against them are to be
        sent with (:meth:`update`'s ``generation``)."""
        return getattr(self._local, "generation", None)

    def _replaced(self) -> None:
        """Rows were replaced (a load, a clear): a new generation if train lookups read rows
        of the current one. The caller holds ``_lock``."""
        if self._handed_out:
            self._generation += 1
            self._handed_out = False

    def _missed(self, missing: np.ndarray | None, count: int) -> None:
        """Record this thread's last lookup's misses: ``count`` IDs, at ``missing`` (bool
        [n]; None only when ``count`` is 0)."""
        self._local.misses = count
        self._local.missing = missing if count else None

    def lookup_pooled(
        self,
        ids: np.ndarray,
        dim: int,
        bag_offsets: np.ndarray,
        weights: np.ndarray | None = None,
        *,
        train: bool = False,
    ) -> np.ndarray:
        """:meth:`lookup` fused with sum pooling: float32 [num_bags, dim].

        Equals ``embedding_bag(lookup(ids, dim, train=train), bag_offsets, mode="sum",
        per_sample_weights=weights)`` (same sums, same order) without materializing the rows:
        bag ``b`` sums ``ids[bag_offsets[b]:bag_offsets[b + 1]]`` (the last bag runs to the
        end), each row times ``weights[i]`` (float32 [n]) when given; an empty bag is zeros.
        ``bag_offsets`` is int64 [num_bags], non-decreasing from 0. Everything else is
        :meth:`lookup`'s: a train lookup inserts, stamps and evicts exactly as there; an eval
        lookup never inserts, and its unknown IDs add zeros and count as misses.
        """
        ids = _check_ids(ids)
        dim = _check_dim(dim)
        n = ids.shape[0]
        if train and self._read_only:
            raise FailedPreconditionError("this shard is read-only: train lookups are refused")
        with self._lock:
            table = self._tables.get(dim)
            if not train and table is not None:  # the hot infer path: one kernel
                found = np.empty(n, dtype=np.int64)
                pooled, misses = table.index.pool(
                    ids, table.weights, bag_offsets, weights, rows_out=found
                )
                self._lookups += 1
                self._ids_looked_up += n
                self._eval_lookups += 1
                self._eval_ids_looked_up += n
                self._misses += misses
                # Which IDs missed is worked out only when some did (their rows are -1).
                self._missed(found < 0 if misses else None, int(misses))
                return pooled
            # Check everything before a train lookup changes the shard.
            offsets, id_weights = pooling_args(n, bag_offsets, weights)
            table, rows = self._rows_locked(ids, dim, train)
            out = np.empty((offsets.shape[0], dim), dtype=np.float32)
            if table is None:
                out[:] = 0.0
            else:
                pool_rows_kernel(table.weights, rows, offsets, id_weights, out)
            return out

    def _rows_locked(
        self, ids: np.ndarray, dim: int, train: bool
    ) -> tuple[_DimTable | None, np.ndarray | None]:
        """The rows of ``ids`` in the ``dim`` table (-1: not held), doing a lookup's work.

        Counts the lookup; eval: counts misses; train: stamps, admits, evicts and inserts.
        Returns ``(None, None)`` for an eval lookup of a dim without rows. Holds the lock.
        """
        n = ids.shape[0]
        self._lookups += 1
        self._ids_looked_up += n
        self._missed(None, 0)
        if not train:
            self._eval_lookups += 1
            self._eval_ids_looked_up += n
            table = self._tables.get(dim)
            if table is None:
                self._misses += n
                self._missed(np.ones(n, dtype=np.bool_), n)
                return None, None
            rows = table.index.lookup(ids)
            missing = rows < 0
            misses = int(np.count_nonzero(missing))
            self._misses += misses
            self._missed(missing, misses)
            return table, rows
        # Its rows go out for training: their gradients are to come with this generation.
        self._handed_out = True
        self._local.generation = self._generation
        table = self._table(dim, n)
        base = self._clock
        self._clock += n
        rows = table.index.lookup_stamp(ids, table.stamps, base)
        miss = np.flatnonzero(rows < 0)
        if miss.shape[0] == 0:
            return table, rows
        miss_ids = ids[miss]
        if self._initialization.admit_probability < 1.0:
            ok = admitted(miss_ids, self._initialization)
            rejected = miss.shape[0] - int(np.count_nonzero(ok))
            if rejected:
                self._rejected += rejected
                refused = np.zeros(n, dtype=np.bool_)
                refused[miss[~ok]] = True
                self._missed(refused, rejected)
                miss, miss_ids = miss[ok], miss_ids[ok]
                if miss.shape[0] == 0:
                    return table, rows
        size_before = self._rows
        self._make_room(table, miss_ids, base, f"a train lookup of {n} IDs (dim {dim})")
        if self._rows != size_before:  # evicted: held rows moved
            rows = table.index.lookup(ids)
        rows[miss] = self._insert(table, miss_ids, base + miss, fill=True)
        return table, rows

    def update(self, ids: np.ndarray, grads: np.ndarray, *, generation: int | None = None) -> int:
        """Apply the optimizer to ``ids`` (uint64 [n], unique) with ``grads`` float32 [n, dim].

        Returns the number of rows updated; IDs no longer held are skipped and counted.
        ``generation``: the :attr:`last_generation` of the train lookup the gradients were
        computed after (None: not said, applied as ever). When a load or clear has replaced
        the rows since (an older generation than the shard's), nothing is applied:
        FailedPreconditionError, the rows counted in ``stale_updates``.
        """
        if self._read_only:
            raise FailedPreconditionError("this shard is read-only: updates are refused")
        ids = _check_ids(ids)
        if not isinstance(grads, np.ndarray) or grads.dtype != np.float32 or grads.ndim != 2:
            raise InvalidArgumentError(
                f"grads must be a float32 [n, dim] array, got {_describe(grads)}"
            )
        if grads.shape[0] != ids.shape[0] or grads.shape[1] < 1:
            raise InvalidArgumentError(
                f"grads must have shape [{ids.shape[0]}, dim >= 1] to match ids, "
                f"got {list(grads.shape)}"
            )
        grads = np.ascontiguousarray(grads)
        with self._lock:
            optimizer = self._optimizer
            if optimizer is None:
                raise FailedPreconditionError(
                    "no optimizer configured; call configure(optimizer=...)"
                )
            n = ids.shape[0]
            if generation is not None and generation < self._generation:
                self._stale_updates += n
                raise FailedPreconditionError(
                    f"gradients for {n} rows (dim {grads.shape[1]}) were computed against rows "
                    f"that a load or clear of this shard has replaced since (their lookup's "
                    f"generation {generation}, the shard's {self._generation}): not applied "
                    "(look the batch up again)"
                )
            table = self._tables.get(grads.shape[1])
            if table is None or n == 0:
                self._skipped += n
                return 0
            rows = table.index.lookup(ids)
            optimizer.apply(
                table.weights, table.state, rows, grads, self._initialization.weight_bound
            )
            updated = int(np.count_nonzero(rows >= 0))
            if updated:
                self._checkpoint_version = ""
                self._modified = True
            self._updates += updated
            self._skipped += n - updated
            return updated

    def clear(self) -> None:
        """Drop every row (counters are kept)."""
        if self._read_only:
            raise FailedPreconditionError("this shard is read-only: clear is refused")
        with self._lock:
            self._tables = {}
            self._rows = 0
            self._checkpoint_version = ""
            self._modified = True
            self._replaced()

    # ------------------------------------------------------------------ bulk transfer

    def export_rows(self, dim: int) -> RowBlock:
        """Copies of all rows of width ``dim``, least recently used first: an importer that
        takes them in order (:meth:`import_rows`) keeps their relative recency."""
        dim = _check_dim(dim)
        with self._lock:
            block, stamps = self._copy_rows_stamped(dim)
        # Sorted after the lock is released: lookups and updates wait only for the copies.
        order = np.argsort(stamps)
        assert block.state is not None  # copies always hold the state (width 0 or more)
        return RowBlock(block.ids[order], block.weights[order], block.state[order])

    def export_all(self) -> dict[int, RowBlock]:
        """Copies of every row, by dim, taken at one instant: what a dump writes. Dims
        exported one at a time could hold, together, more rows than ``capacity`` (training
        evicts rows of a dim already copied for rows of one not yet copied), which no shard
        could load back. Holds a copy of the shard's rows in memory until written.

        Rows come in the shard's row order, and each block's ``recency`` places its rows in
        the shard's LRU order over all dims: :meth:`replace_rows` restores that order, so a
        resumed shard evicts the rows this one would have (a checkpoint that kept no order
        made a resumed run evict other rows than an uninterrupted one)."""
        with self._lock:
            copies = {dim: self._copy_rows_stamped(dim) for dim in sorted(self._tables)}
        if not copies:
            return {}
        # Ranks of the (unique) stamps over all dims, computed after the lock is released
        # (an argsort of millions of stamps would stall lookups and updates meanwhile).
        every = np.concatenate([stamps for _, stamps in copies.values()])
        ranks = np.empty(every.shape[0], dtype=np.int64)
        ranks[np.argsort(every)] = np.arange(every.shape[0], dtype=np.int64)
        out, start = {}, 0
        for dim, (block, _) in copies.items():
            n = len(block)
            out[dim] = RowBlock(block.ids, block.weights, block.state, ranks[start : start + n])
            start += n
        return out

    def _copy_rows_stamped(self, dim: int) -> tuple[RowBlock, np.ndarray]:
        """Copies of the rows of width ``dim`` in row order, and their LRU stamps (int64
        [n], unique: larger is used more recently); the caller holds ``_lock``."""
        table = self._tables.get(dim)
        if table is None:
            block = RowBlock(
                ids=np.zeros(0, dtype=np.uint64),
                weights=np.zeros((0, dim), dtype=np.float32),
                state=np.zeros((0, self._width(dim)), dtype=np.float32),
            )
            return block, np.zeros(0, dtype=np.int64)
        n = table.size
        block = RowBlock(
            ids=table.ids[:n].copy(),
            weights=table.weights[:n].copy(),
            state=table.state[:n].copy(),
        )
        return block, table.stamps[:n].astype(np.int64, copy=True)

    def import_rows(self, block: RowBlock) -> None:
        """Insert or overwrite ``block``'s rows bit-exactly, evicting LRU rows as needed.

        Refused on read-only shards, for non-finite weights, NaN state and state the
        optimizer refuses (:meth:`check_state`). ``block.state``
        must have the optimizer's width for the block's dim; a block with ``state=None`` (or
        width 0) gets fresh optimizer state, and state is dropped when no optimizer is
        configured. Imported rows become the most recently used. On an error the shard's
        rows and state are unchanged (the rows the block already held may have become the
        most recently used).
        """
        if self._read_only:
            raise FailedPreconditionError(
                "this shard is read-only: row imports are refused (it loads checkpoints whole)"
            )
        ids, weights, state, dim = _check_block(block)
        if ids.shape[0] == 0:
            return
        if not np.isfinite(weights).all():
            raise InvalidArgumentError("block.weights has non-finite values (NaN or Inf)")
        if state is not None and np.isnan(state).any():
            # The optimizer reads the state on the next update: the row would become NaN.
            # Infinities are the optimizer's to judge (check_state): its own kernels store
            # +Inf accumulators for a finite gradient past ~1.8e19 and the row stays finite.
            raise InvalidArgumentError("block.state has NaN values")
        with self._lock:
            new_state = self._state_for_import(state, ids.shape[0], dim)
            self._import_locked(ids, weights, new_state, dim)
            self._checkpoint_version = ""
            self._modified = True

    def replace_rows(
        self,
        blocks: list[RowBlock],
        *,
        checkpoint_version: str = "",
        state_of: SGD | Adagrad | Adam | None = None,
        adopt: bool = False,
    ) -> None:
        """Replace every row of the shard by ``blocks`` (one per dim, as from a checkpoint).

        All-or-nothing: blocks are validated first (shapes, state widths, total rows against
        ``capacity``) and any error leaves the shard unchanged. Allowed on read-only shards.
        ``checkpoint_version``: the checkpoint the blocks come from (see
        :attr:`checkpoint_version`). When every block has a ``recency``, the rows take that
        least-recently-used order (ties: in block order); else they count as used in block
        order, one block after the other.

        ``state_of``: the optimizer the blocks' state was read for (a checkpoint load's). A
        load reads its files before it swaps them in, and a Configure may change the
        shard's optimizer meanwhile: with ``state_of``, a block's state is taken only when
        the shard's optimizer at the swap is of that kind with that state width, else its
        rows get fresh state. ``adopt``: a shard that has no optimizer at the swap takes
        ``state_of`` (a restarted training shard resumes with its checkpoint's); one that
        was configured meanwhile keeps its own, as one configured before the load does.
        """
        checked = [_check_block(b) for b in blocks]
        recencies = [_check_recency(b) for b in blocks]
        dims = [c[3] for c in checked]
        if len(set(dims)) != len(dims):
            raise InvalidArgumentError(f"replace_rows needs one block per dim, got dims {dims}")
        total = sum(c[0].shape[0] for c in checked)
        if total > self._capacity:
            total = sum(int(np.unique(c[0]).shape[0]) for c in checked)
            if total > self._capacity:
                raise CapacityError(
                    f"replacing the shard's rows needs {total} rows but its capacity is "
                    f"{self._capacity} rows"
                )
        with self._lock:
            saved_optimizer = self._optimizer
            if adopt and state_of is not None and self._optimizer is None:
                self._optimizer = state_of
            try:
                states = [
                    self._state_for_import(
                        None if state_of is not None and not self._fits(state_of, d) else st,
                        ids.shape[0],
                        d,
                    )
                    for ids, _, st, d in checked
                ]
            except BaseException:
                self._optimizer = saved_optimizer
                raise
            saved = (self._tables, self._rows, self._inserts)
            self._tables, self._rows = {}, 0
            try:
                for (ids, weights, _, dim), state in zip(checked, states):
                    if ids.shape[0]:
                        self._import_locked(ids, weights, state, dim)
                if recencies and all(r is not None for r in recencies):
                    self._restamp(checked, cast("list[np.ndarray]", recencies))
            except BaseException:
                self._tables, self._rows, self._inserts = saved
                self._optimizer = saved_optimizer
                raise
            self._inserts = saved[2]  # loaded, not created: counted in rows_loaded
            self._rows_loaded += self._rows
            self._checkpoint_version = checkpoint_version
            self._modified = False
            self._replaced()

    def _fits(self, state_of: SGD | Adagrad | Adam, dim: int) -> bool:
        """Whether state kept for ``state_of`` is state of the shard's optimizer for rows of
        ``dim`` (the same kind, the same width); the caller holds ``_lock``."""
        optimizer = self._optimizer
        return (
            optimizer is not None
            and type(optimizer) is type(state_of)
            and optimizer.state_width(dim) == state_of.state_width(dim)
        )

    def _restamp(
        self,
        checked: list[tuple[np.ndarray, np.ndarray, np.ndarray | None, int]],
        recencies: list[np.ndarray],
    ) -> None:
        """Stamp the rows just imported from ``checked`` blocks in the LRU order their
        ``recencies`` (int64 [n] each) give, over all dims; the caller holds ``_lock``."""
        every = np.concatenate(recencies)
        if every.shape[0] == 0:
            return
        stamps = np.empty(every.shape[0], dtype=np.int64)
        stamps[np.argsort(every, kind="stable")] = self._clock + np.arange(every.shape[0])
        self._clock += every.shape[0]
        start = 0
        for ids, _, _, dim in checked:
            n = ids.shape[0]
            if n:
                table = self._tables[dim]
                # Repeated IDs: the last one's stamp wins, as when the block was imported.
                table.stamps[table.index.lookup(ids)] = stamps[start : start + n]
            start += n

    def _state_for_import(self, state: np.ndarray | None, n: int, dim: int) -> np.ndarray | None:
        """The state to write for imported rows (None: no state columns)."""
        width = self._width(dim)
        optimizer = self._optimizer
        if state is not None and state.shape[1] == width:
            if width:
                assert optimizer is not None  # width > 0 only with an optimizer (see _width)
                optimizer.check_state(state, dim)
            return state if width else None
        if state is None or state.shape[1] == 0 or optimizer is None:
            if width == 0:
                return None
            assert optimizer is not None  # width > 0 only with an optimizer (see _width)
            return optimizer.initial_state(n, dim)
        raise InvalidArgumentError(
            f"block.state has {state.shape[1]} columns but the shard's optimizer "
            f"({optimizer.name}) keeps {width} per row of dim {dim}"
        )

    def _import_locked(
        self, ids: np.ndarray, weights: np.ndarray, state: np.ndarray | None, dim: int
    ) -> None:
        n = ids.shape[0]
        table = self._table(dim, n)
        base = self._clock
        self._clock += n
        rows = table.index.lookup_stamp(ids, table.stamps, base)
        miss = np.flatnonzero(rows < 0)
        if miss.shape[0]:
            miss_ids = ids[miss]
            size_before = self._rows
            self._make_room(table, miss_ids, base, f"importing {n} rows (dim {dim})")
            if self._rows != size_before:
                rows = table.index.lookup(ids)
            rows[miss] = self._insert(table, miss_ids, base + miss, fill=False)
        table.weights[rows] = weights
        if state is not None:
            table.state[rows] = state


def _check_recency(block: RowBlock) -> np.ndarray | None:
    """``block.recency`` (None, or int64 [n] for the block's n rows), checked."""
    recency = block.recency
    n = block.ids.shape[0]
    if recency is not None and (
        not isinstance(recency, np.ndarray) or recency.dtype != np.int64 or recency.shape != (n,)
    ):
        raise InvalidArgumentError(
            f"block.recency must be None or an int64 [{n}] array, got {_describe(recency)}"
        )
    return recency


def _check_block(block: object) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """Validated ``(ids, weights, state or None, dim)`` of a RowBlock."""
    if not isinstance(block, RowBlock):
        raise InvalidArgumentError(f"block must be a RowBlock, got {type(block).__name__}")
    ids = _check_ids(block.ids, "block.ids")
    weights, state = block.weights, block.state
    n = ids.shape[0]
    if (
        not isinstance(weights, np.ndarray)
        or weights.dtype != np.float32
        or weights.ndim != 2
        or weights.shape[0] != n
        or weights.shape[1] < 1
    ):
        raise InvalidArgumentError(
            f"block.weights must be a float32 [{n}, dim] array, got {_describe(weights)}"
        )
    if state is not None and (
        not isinstance(state, np.ndarray)
        or state.dtype != np.float32
        or state.ndim != 2
        or state.shape[0] != n
    ):
        raise InvalidArgumentError(
            f"block.state must be None or a float32 [{n}, w] array, got {_describe(state)}"
        )
    return ids, weights, state, int(weights.shape[1])


def warm_up_kernels(
    optimizers: Sequence[SGD | Adagrad | Adam] = (),
    initialization: InitializationConfig | None = None,
) -> None:
    """Compile (or load from numba's on-disk cache) the kernels of a shard's RPC paths, on a
    scratch shard of a few rows: a train lookup (index, initializer and, with
    ``initialization``'s ``admit_probability`` < 1, admission), an eval lookup and an update
    with each of ``optimizers``. A parameter server calls it before it reports SERVING, so
    that a fresh process's first lookup and update do not compile: ~1.3-1.9 s each on a
    busy machine with an empty cache (a container's cache under /tmp starts empty), ~0.3 s
    for the first lookup even from the cache. A dispatcher compiles once per process: later
    calls take well under a millisecond per kernel.
    """
    ids = np.arange(1, 9, dtype=np.uint64)
    shard = EmbeddingShard(64, initialization=initialization)
    shard.lookup(ids, 1, train=True)
    shard.lookup(ids, 1, train=False)
    for optimizer in optimizers:
        shard.configure(optimizer=optimizer)
        shard.update(ids, np.zeros((ids.shape[0], 1), dtype=np.float32))


#: What a training shard may be configured with: every optimizer type, and admission.
TRAINING_KERNELS: tuple[tuple[SGD | Adagrad | Adam, ...], InitializationConfig] = (
    (SGD(), Adagrad(), Adam()),
    InitializationConfig(admit_probability=0.5),
)
