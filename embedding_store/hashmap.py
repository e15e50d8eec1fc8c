"""JIT-compiled open-addressing hash map from uint64 IDs to int64 row indexes.

The table is one power-of-two array ``table`` uint64 [capacity, 2]: column 0 holds the key,
column 1 the row, side by side so that a probe touches one cache line. It is probed linearly. A
slot is empty when its row is ``2**64 - 1`` (-1 as int64), so every uint64 (0 and 2**64-1
included) is a valid key. The load factor is kept at or below 0.5; growing rebuilds the table at
double size. There are no per-key deletes: the shard evicts in bulk, compacts its rows and calls
:meth:`IdIndex.rebuild`.

Slots are chosen by a *salted* SplitMix64 mix of the key. The salt matters: shard routing uses
``splitmix64(id) % num_shards`` (:mod:`embedding_store.hashing`), so with an unsalted mix all IDs
of one shard would share the low bits of their hash and crowd a fraction of the table.

Memory-level parallelism. On a table larger than the caches every probe is a cache miss, and a
plain loop waits for them one after another. The read kernels therefore first compute every
ID's home slot, then probe ID ``i`` while prefetching the home slot of ID ``i + PREFETCH``
(:func:`prefetch_row`, LLVM's ``llvm.prefetch``), so about ``PREFETCH`` misses are in flight.
The row kernels (:func:`gather_rows_kernel`, :func:`pool_rows_kernel`) do the same for the
weight rows they read; :func:`pool_kernel` (behind :meth:`IdIndex.pool`) is lookup + pooling
straight from the weight array, with no row copies. They live here, next to the probe code,
because numba's on-disk cache does not notice changes in *another* module's jitted functions.

All kernels are ``@njit(cache=True, nogil=True)`` loops over whole arrays; :class:`IdIndex` is
not thread-safe by itself (the shard serializes access with its lock).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from embedding_store.errors import InvalidArgumentError

if TYPE_CHECKING:
    from numba.core.base import BaseContext
    from numba.core.typing.context import BaseContext as TypingContext
    from numba.core.typing.templates import Signature

EMPTY = -1
MIN_CAPACITY = 16
#: How many IDs ahead the read kernels prefetch (measured here: 8-16 leave time on the table,
#: 32-64 are alike at batch 1024).
PREFETCH = 32

_FREE = np.uint64(0xFFFFFFFFFFFFFFFF)  # column 1 of an empty slot (EMPTY as uint64)
_SALT = np.uint64(0x5BD1E9955BD1E995)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


@intrinsic
def prefetch_row(
    typingctx: TypingContext, array: types.Type, row: types.Type
) -> tuple[Signature, Callable[..., ir.Value]] | None:
    """Hint the CPU to load the cache line of ``array[row]`` (its first element for a 2-D C array).

    Compiles to ``llvm.prefetch`` (read, high locality, data cache): no effect on results.
    ``row`` must be in bounds.
    """
    if not (isinstance(array, types.Array) and isinstance(row, types.Integer)):
        return None
    sig = types.void(array, row)

    def codegen(
        context: BaseContext,
        builder: ir.IRBuilder,
        signature: Signature,
        args: Sequence[ir.Value],
    ) -> ir.Value:
        array_type, row_type = signature.args
        ary = context.make_array(array_type)(context, builder, args[0])
        index = context.cast(builder, args[1], row_type, types.intp)
        zero = context.get_constant(types.intp, 0)
        ptr = cgutils.get_item_pointer2(
            context,
            builder,
            data=ary.data,
            shape=cgutils.unpack_tuple(builder, ary.shape),
            strides=cgutils.unpack_tuple(builder, ary.strides),
            layout=array_type.layout,
            inds=[index] + [zero] * (array_type.ndim - 1),
            wraparound=False,
            boundscheck=False,
        )
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _home_slot(key: np.uint64, mask: int) -> np.int64:
    """Salted SplitMix64 of ``key`` masked to the table: the first slot to probe."""
    z = (key ^ _SALT) + _GOLDEN
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    z = z ^ (z >> _S31)
    return np.int64(z & np.uint64(mask))


@njit(cache=True, nogil=True)
def _probe(table: np.ndarray, key: np.uint64, slot: int, mask: int) -> np.int64:
    """Row of ``key`` starting at its home ``slot``, or -1."""
    s = slot
    while True:
        v = table[s, 1]
        if v == _FREE:
            return np.int64(EMPTY)
        if table[s, 0] == key:
            return np.int64(v)
        s = (s + 1) & mask


@njit(cache=True, nogil=True)
def lookup_kernel(table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    """``out[i]`` = row of ``ids[i]`` or -1 (prefetching ``PREFETCH`` IDs ahead)."""
    mask = table.shape[0] - 1
    n = ids.shape[0]
    for i in range(n):  # home slots first (cheap), kept in out until probed
        out[i] = _home_slot(ids[i], mask)
    for i in range(min(PREFETCH, n)):
        prefetch_row(table, out[i])
    for i in range(n):
        if i + PREFETCH < n:
            prefetch_row(table, out[i + PREFETCH])
        out[i] = _probe(table, ids[i], out[i], mask)


@njit(cache=True, nogil=True)
def lookup_stamp_kernel(
    table: np.ndarray, ids: np.ndarray, out: np.ndarray, stamps: np.ndarray, base: int
) -> None:
    """Like :func:`lookup_kernel`, and sets ``stamps[row] = base + i`` for every hit ``i``.

    IDs are stamped in order, so where an ID repeats its last position wins.
    """
    mask = table.shape[0] - 1
    n = ids.shape[0]
    for i in range(n):
        out[i] = _home_slot(ids[i], mask)
    for i in range(min(PREFETCH, n)):
        prefetch_row(table, out[i])
    for i in range(n):
        if i + PREFETCH < n:
            prefetch_row(table, out[i + PREFETCH])
        r = _probe(table, ids[i], out[i], mask)
        out[i] = r
        if r >= 0:
            stamps[r] = base + i


@njit(cache=True, nogil=True)
def valid_bag_offsets(offsets: np.ndarray, n: int) -> bool:
    """True if ``offsets`` (int64 [num_bags]) are non-decreasing from 0 to at most ``n``.

    With no bags there must be no IDs (``n == 0``).
    """
    num_bags = offsets.shape[0]
    if num_bags == 0:
        return n == 0
    if offsets[0] != 0 or offsets[num_bags - 1] > n:
        return False
    for b in range(1, num_bags):  # noqa: SIM110 (a plain loop compiles best in numba)
        if offsets[b] < offsets[b - 1]:
            return False
    return True


@intrinsic
def fma_f32(
    typingctx: TypingContext, a: types.Type, b: types.Type, c: types.Type
) -> tuple[Signature, Callable[..., ir.Value]] | None:
    """``a * b + c`` on float32, rounded once (``llvm.fma``).

    torch's CPU ``embedding_bag`` accumulates weighted bags with fused multiply-adds; the fused
    pooling kernel does the same so that one in-process shard gives the bits that several
    shards, deduplication or a remote tier (which pool with ``embedding_bag``) give.
    """
    if not all(arg == types.float32 for arg in (a, b, c)):
        return None
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(
        context: BaseContext,
        builder: ir.IRBuilder,
        signature: Signature,
        args: Sequence[ir.Value],
    ) -> ir.Value:
        f32 = ir.FloatType()
        fma = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32] * 3))
        return builder.call(fma, args)

    return sig, codegen


@njit(cache=True, nogil=True)
def pool_rows_kernel(
    weights: np.ndarray,
    rows: np.ndarray,
    offsets: np.ndarray,
    id_weights: np.ndarray,
    out: np.ndarray,
) -> int:
    """Sum-pool ``weights[rows]`` into bags (offsets already checked); returns #rows < 0.

    Bag ``b`` holds ``rows[offsets[b]:offsets[b + 1]]`` (the last bag runs to the end), like
    ``embedding_bag(mode="sum")``: ``out[b] = sum of id_weights[i] * weights[rows[i]]`` in order,
    with ``id_weights`` float32 [n] or an empty array for weight 1; weighted terms are added
    with a fused multiply-add (:func:`fma_f32`), as torch does. Rows < 0 (unknown IDs) add
    nothing; an empty bag is zeros. Weight rows are prefetched ``PREFETCH`` IDs ahead.
    """
    n = rows.shape[0]
    num_bags = offsets.shape[0]
    dim = out.shape[1]
    weighted = id_weights.shape[0] > 0
    for i in range(min(PREFETCH, n)):
        if rows[i] >= 0:
            prefetch_row(weights, rows[i])
    misses = 0
    for b in range(num_bags):
        start = offsets[b]
        end = offsets[b + 1] if b + 1 < num_bags else n
        # The bag's first known row is written, later ones added: the same sums as adding to
        # zeros (up to the sign of a zero), without a read-modify-write of zeros first.
        first = True
        for i in range(start, end):
            if i + PREFETCH < n and rows[i + PREFETCH] >= 0:
                prefetch_row(weights, rows[i + PREFETCH])
            r = rows[i]
            if r < 0:
                misses += 1
            elif first:
                first = False
                if weighted:
                    w = id_weights[i]
                    for c in range(dim):
                        out[b, c] = w * weights[r, c]
                else:
                    for c in range(dim):
                        out[b, c] = weights[r, c]
            elif weighted:
                w = id_weights[i]
                for c in range(dim):
                    out[b, c] = fma_f32(w, weights[r, c], out[b, c])
            else:
                for c in range(dim):
                    out[b, c] += weights[r, c]
        if first:  # empty bag, or only unknown IDs
            for c in range(dim):
                out[b, c] = 0.0
    return misses


@njit(cache=True, nogil=True)
def gather_rows_kernel(weights: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = weights[rows[i]]``, zeros where ``rows[i] < 0``; prefetches rows ahead."""
    n = rows.shape[0]
    dim = out.shape[1]
    for i in range(min(PREFETCH, n)):
        if rows[i] >= 0:
            prefetch_row(weights, rows[i])
    for i in range(n):
        if i + PREFETCH < n and rows[i + PREFETCH] >= 0:
            prefetch_row(weights, rows[i + PREFETCH])
        r = rows[i]
        if r < 0:
            for c in range(dim):
                out[i, c] = 0.0
        else:
            for c in range(dim):
                out[i, c] = weights[r, c]


@njit(cache=True, nogil=True)
def pool_kernel(
    table: np.ndarray,
    weights: np.ndarray,
    ids: np.ndarray,
    offsets: np.ndarray,
    id_weights: np.ndarray,
    rows: np.ndarray,
    out: np.ndarray,
) -> int:
    """:func:`lookup_kernel` into ``rows`` then :func:`pool_rows_kernel` into ``out``.

    Returns the number of unknown IDs, or -1 if the offsets are invalid
    (:func:`valid_bag_offsets`; nothing is written then).
    """
    if not valid_bag_offsets(offsets, ids.shape[0]):
        return -1
    lookup_kernel(table, ids, rows)
    return pool_rows_kernel(weights, rows, offsets, id_weights, out)


@njit(cache=True, nogil=True)
def get_or_insert_kernel(
    table: np.ndarray,
    ids: np.ndarray,
    out: np.ndarray,
    start: int,
    next_row: int,
    size: int,
    limit: int,
) -> tuple[int, int, int]:
    """Rows of ``ids[start:]``, inserting unknown keys with rows ``next_row, next_row+1, ...``.

    Duplicates inside ``ids`` get the same row. Stops *before* an insert that would take the
    map past ``limit`` entries and returns ``(first unprocessed index, next_row, size)``.
    """
    mask = table.shape[0] - 1
    n = ids.shape[0]
    for i in range(start, min(start + PREFETCH, n)):
        prefetch_row(table, _home_slot(ids[i], mask))
    for i in range(start, n):
        if i + PREFETCH < n:
            prefetch_row(table, _home_slot(ids[i + PREFETCH], mask))
        k = ids[i]
        s = _home_slot(k, mask)
        while True:
            v = table[s, 1]
            if v == _FREE:
                if size >= limit:
                    return i, next_row, size
                table[s, 0] = k
                table[s, 1] = np.uint64(next_row)
                out[i] = next_row
                next_row += 1
                size += 1
                break
            if table[s, 0] == k:
                out[i] = np.int64(v)
                break
            s = (s + 1) & mask
    return n, next_row, size


@njit(cache=True, nogil=True)
def insert_rows_kernel(table: np.ndarray, ids: np.ndarray, rows: np.ndarray, size: int) -> int:
    """Upsert ``ids[i] -> rows[i]``; returns the new entry count. The caller ensures room."""
    mask = table.shape[0] - 1
    n = ids.shape[0]
    for i in range(min(PREFETCH, n)):
        prefetch_row(table, _home_slot(ids[i], mask))
    for i in range(n):
        if i + PREFETCH < n:
            prefetch_row(table, _home_slot(ids[i + PREFETCH], mask))
        k = ids[i]
        s = _home_slot(k, mask)
        while True:
            v = table[s, 1]
            if v == _FREE:
                table[s, 0] = k
                table[s, 1] = np.uint64(rows[i])
                size += 1
                break
            if table[s, 0] == k:
                table[s, 1] = np.uint64(rows[i])
                break
            s = (s + 1) & mask
    return size


@njit(cache=True, nogil=True)
def _reinsert_kernel(old: np.ndarray, table: np.ndarray) -> None:
    """Move every occupied slot of the old table into a (larger, empty) new table."""
    mask = table.shape[0] - 1
    for j in range(old.shape[0]):
        v = old[j, 1]
        if v == _FREE:
            continue
        k = old[j, 0]
        s = _home_slot(k, mask)
        while table[s, 1] != _FREE:
            s = (s + 1) & mask
        table[s, 0] = k
        table[s, 1] = v


def capacity_for(n: int) -> int:
    """Smallest power-of-two table (>= MIN_CAPACITY) holding ``n`` keys at load <= 0.5."""
    need = max(MIN_CAPACITY, 2 * int(n))
    return 1 << (need - 1).bit_length()


def _empty_table(capacity: int) -> np.ndarray:
    table = np.empty((capacity, 2), dtype=np.uint64)
    table[:, 0] = 0
    table[:, 1] = _FREE
    return table


def _as_ids(ids: np.ndarray, name: str = "ids") -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.uint64 or ids.ndim != 1:
        actual = (
            f"{ids.dtype}{list(ids.shape)}" if isinstance(ids, np.ndarray) else type(ids).__name__
        )
        raise InvalidArgumentError(f"{name} must be a uint64 [n] array, got {actual}")
    return np.ascontiguousarray(ids)


_NO_WEIGHTS = np.zeros(0, dtype=np.float32)
_BAD_OFFSETS = (
    "bag_offsets must be non-decreasing, start at 0 and stay <= {n} (the number of ids); "
    "with no bags there must be no ids"
)


def pooling_args(
    n: int,
    bag_offsets: object,
    id_weights: object,
    *,
    check_values: bool = True,
    weights_name: str = "weights",
) -> tuple[np.ndarray, np.ndarray]:
    """Checked ``(offsets int64 [num_bags], id_weights float32 [n] or empty)`` for pooling ``n``
    IDs (the pooling kernels take an empty weight array for "no weights").

    ``check_values`` also checks the offsets themselves (:func:`valid_bag_offsets`).
    """
    if (
        not isinstance(bag_offsets, np.ndarray)
        or bag_offsets.ndim != 1
        or bag_offsets.dtype.kind not in "iu"
    ):
        raise InvalidArgumentError(
            f"bag_offsets must be an int64 [num_bags] array, got {_describe(bag_offsets)}"
        )
    offsets = np.ascontiguousarray(bag_offsets, dtype=np.int64)
    if check_values and not valid_bag_offsets(offsets, n):
        raise InvalidArgumentError(_BAD_OFFSETS.format(n=n))
    if id_weights is None:
        return offsets, _NO_WEIGHTS
    if (
        not isinstance(id_weights, np.ndarray)
        or id_weights.dtype != np.float32
        or id_weights.shape != (n,)
    ):
        raise InvalidArgumentError(
            f"{weights_name} must be None or a float32 [{n}] array (one per id), "
            f"got {_describe(id_weights)}"
        )
    return offsets, np.ascontiguousarray(id_weights)


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{list(value.shape)}"
    return type(value).__name__


class IdIndex:
    """uint64 ID -> int64 row map (open addressing, linear probing, load <= 0.5)."""

    def __init__(self, initial_capacity: int = MIN_CAPACITY) -> None:
        cap = max(MIN_CAPACITY, 1 << (max(int(initial_capacity), 1) - 1).bit_length())
        self._table = _empty_table(cap)
        self._size = 0

    @property
    def size(self) -> int:
        """Number of keys held."""
        return self._size

    @property
    def capacity(self) -> int:
        """Number of slots of the table (a power of two; holds at most capacity // 2 keys)."""
        return self._table.shape[0]

    def __len__(self) -> int:
        return self._size

    def _grow_to(self, capacity: int) -> None:
        table = _empty_table(capacity)
        _reinsert_kernel(self._table, table)
        self._table = table

    def reserve(self, n: int) -> None:
        """Make room for ``n`` keys in total without further growth."""
        if 2 * n > self.capacity:
            self._grow_to(capacity_for(n))

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` (uint64 [n]) -> int64 [n], -1 where missing."""
        ids = _as_ids(ids)
        out = np.empty(ids.shape[0], dtype=np.int64)
        lookup_kernel(self._table, ids, out)
        return out

    def lookup_stamp(self, ids: np.ndarray, stamps: np.ndarray, base: int) -> np.ndarray:
        """:meth:`lookup`, also writing ``stamps[row] = base + i`` for each hit at position i.

        Where an ID repeats, its last position wins.
        """
        ids = _as_ids(ids)
        out = np.empty(ids.shape[0], dtype=np.int64)
        lookup_stamp_kernel(self._table, ids, out, stamps, np.int64(base))
        return out

    def pool(
        self,
        ids: np.ndarray,
        weights: np.ndarray,
        bag_offsets: np.ndarray,
        id_weights: np.ndarray | None = None,
        rows_out: np.ndarray | None = None,
    ) -> tuple[np.ndarray, int]:
        """Sum-pool the rows of ``ids`` from ``weights`` without materializing them.

        ``weights`` float32 [rows, dim] (the rows this index points into); ``bag_offsets``
        int64 [num_bags], non-decreasing from 0 (bag b is ``ids[offsets[b]:offsets[b+1]]``, the
        last bag runs to the end); ``id_weights`` float32 [n] or None. Unknown IDs add nothing.
        Returns ``(float32 [num_bags, dim], number of unknown IDs)``: the sums of
        ``embedding_bag(rows, offsets, mode="sum", per_sample_weights=id_weights)``, in the
        same order. ``rows_out`` (int64 [n], optional) receives the row of each ID (-1:
        unknown), which the kernel finds anyway: where a caller needs to know which IDs were
        unknown, not only how many.
        """
        ids = _as_ids(ids)
        n = ids.shape[0]
        if not (
            isinstance(weights, np.ndarray)
            and weights.dtype == np.float32
            and weights.ndim == 2
            and weights.flags.c_contiguous
        ):
            raise InvalidArgumentError("weights must be a C-contiguous float32 [rows, dim] array")
        offsets, id_weights = pooling_args(
            n, bag_offsets, id_weights, check_values=False, weights_name="id_weights"
        )
        if rows_out is None:
            rows = np.empty(n, dtype=np.int64)
        elif (
            isinstance(rows_out, np.ndarray)
            and rows_out.dtype == np.int64
            and rows_out.shape == (n,)
            and rows_out.flags.c_contiguous
            and rows_out.flags.writeable
        ):
            rows = rows_out
        else:
            raise InvalidArgumentError(f"rows_out must be a writable int64 [{n}] array")
        out = np.empty((offsets.shape[0], weights.shape[1]), dtype=np.float32)
        misses = pool_kernel(self._table, weights, ids, offsets, id_weights, rows, out)
        if misses < 0:
            raise InvalidArgumentError(_BAD_OFFSETS.format(n=n))
        return out, int(misses)

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
                self._table, ids, out, start, next_row, size, self.capacity // 2
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
        self._size = int(insert_rows_kernel(self._table, ids, rows, self._size))

    def rebuild(self, keys: np.ndarray) -> None:
        """Replace the whole map by ``keys[i] -> i`` (keys unique), sized for ``len(keys)``."""
        keys = _as_ids(keys, "keys")
        self._table = _empty_table(capacity_for(keys.shape[0]))
        self._size = int(
            insert_rows_kernel(self._table, keys, np.arange(keys.shape[0], dtype=np.int64), 0)
        )

    def keys(self) -> np.ndarray:
        """The keys held (uint64, table order)."""
        return self._table[self._table[:, 1] != _FREE, 0].copy()
