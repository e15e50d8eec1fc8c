"""The batch data model: what a data loader produces and every later tier consumes.

Equivalent to PERSIA's ``persia.embedding.data`` types:

* :class:`IDTypeFeature`: a jagged (variable-length) sparse feature, like TorchRec's
  ``KeyedJaggedTensor`` for one key: ``values`` uint64 [total_ids] holds the IDs of all samples
  back to back, ``lengths`` int64 [batch] how many of them belong to each sample.
* :class:`IDTypeFeatureWithSingleID`: exactly one uint64 ID per sample, ``values`` uint64 [batch].
* :class:`NonIDTypeFeature`: a dense numeric array whose first axis is the batch.
* :class:`Label`: a dense numeric array (targets), same rules as :class:`NonIDTypeFeature`.
* :class:`Batch` (alias :data:`PersiaBatch`): the validated collection of all of the above.

Every object is immutable in spirit: arrays the objects own are read-only, so later tiers can
share them without copying. Writeable input arrays are copied; arrays that are already read-only
(and C-contiguous, aligned, native byte order) are shared as they are, on the understanding that
whoever froze them will not modify them through another reference.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from functools import cached_property
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from embedding_store.errors import BatchValidationError

__all__ = [
    "MAX_NAME_BYTES",
    "SUPPORTED_DTYPES",
    "Batch",
    "IDFeature",
    "IDTypeFeature",
    "IDTypeFeatureWithSingleID",
    "Label",
    "NonIDTypeFeature",
    "PersiaBatch",
]

MAX_NAME_BYTES = 255
"""Longest feature name, in UTF-8 bytes."""

SUPPORTED_DTYPES: tuple[np.dtype[Any], ...] = tuple(
    np.dtype(t)
    for t in (
        np.bool_,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
    )
)
"""Dtypes allowed for :class:`NonIDTypeFeature` and :class:`Label` data (native byte order)."""

_U64_MAX = 2**64 - 1
_INT64_MAX = 2**63 - 1


# --------------------------------------------------------------------------------------------
# helpers


def _check_name(name: object, what: str = "feature") -> str:
    """Return ``name`` if it is a non-empty str of at most MAX_NAME_BYTES UTF-8 bytes."""
    if not isinstance(name, str) or not name:
        raise BatchValidationError(
            f"{what} name must be a non-empty str, got {name!r} ({type(name).__name__})"
        )
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise BatchValidationError(
            f"{what} name {name!r} cannot be encoded as UTF-8: {e.reason}"
        ) from None
    if size > MAX_NAME_BYTES:
        raise BatchValidationError(
            f"{what} name {name[:40]!r}... is {size} UTF-8 bytes; the limit is {MAX_NAME_BYTES}"
        )
    return name


def _readonly(arr: np.ndarray) -> np.ndarray:
    """A read-only, C-contiguous, aligned, native-byte-order array with ``arr``'s contents.

    Writeable arrays are copied (the caller keeps its own array); already read-only arrays that
    satisfy the layout requirements are shared.
    """
    if (
        arr.flags.writeable
        or not arr.flags.c_contiguous
        or not arr.flags.aligned
        or not arr.dtype.isnative
    ):
        arr = np.array(arr, dtype=arr.dtype.newbyteorder("="), order="C", copy=True)
        arr.flags.writeable = False
    return arr


def _u64_array(name: str, arr: object, what: str) -> npt.NDArray[np.uint64]:
    """Validate a directly passed ID array: numpy, dtype uint64, 1-D. Returns a read-only array."""
    if not isinstance(arr, np.ndarray):
        raise BatchValidationError(
            f"feature {name!r}: {what} must be a numpy uint64 array, got {type(arr).__name__}"
        )
    if arr.dtype.kind != "u" or arr.dtype.itemsize != 8:
        raise BatchValidationError(
            f"feature {name!r}: {what} has dtype {arr.dtype}; "
            "expected uint64 (convert with .astype(np.uint64))"
        )
    if arr.ndim != 1:
        raise BatchValidationError(
            f"feature {name!r}: {what} must be 1-D, got shape {tuple(arr.shape)}"
        )
    return _readonly(arr)


def _lengths_array(name: str, lengths: object, what: str = "lengths") -> npt.NDArray[np.int64]:
    """Validate per-sample lengths (any integer dtype, 1-D, >= 0). Returns read-only int64."""
    if isinstance(lengths, np.ndarray):
        arr = lengths
    else:
        try:
            arr = np.asarray(lengths)
        except (ValueError, TypeError) as e:
            raise BatchValidationError(
                f"feature {name!r}: {what} must be a 1-D integer array: {e}"
            ) from None
        if arr.size == 0:
            arr = np.zeros(arr.shape, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise BatchValidationError(
            f"feature {name!r}: {what} has dtype {arr.dtype}; expected an integer array"
        )
    if arr.ndim != 1:
        raise BatchValidationError(
            f"feature {name!r}: {what} must be 1-D, got shape {tuple(arr.shape)}"
        )
    if arr.size:
        if arr.dtype.kind == "i":
            negative = arr < 0
            if negative.any():
                i = int(np.argmax(negative))
                where = f"sample {i}" if what == "lengths" else f"{what}[{i}]"
                raise BatchValidationError(
                    f"feature {name!r}: {what} must be >= 0, {where} is {int(arr[i])}"
                )
        elif int(arr.max()) > _INT64_MAX:
            i = int(np.argmax(arr))
            raise BatchValidationError(
                f"feature {name!r}: {what} entry {i} is {int(arr[i])}, too large for int64"
            )
    if arr.dtype != np.int64:
        arr = arr.astype(np.int64)
    return _readonly(arr)


def _sample_of(flat_index: int, lengths: npt.NDArray[np.int64]) -> int:
    """Which sample the ``flat_index``-th ID belongs to, given per-sample lengths."""
    return int(np.searchsorted(np.cumsum(lengths), flat_index, side="right"))


def _is_valid_python_id(x: object) -> bool:
    """An int (not a bool: True is no ID) with 0 <= x < 2**64."""
    return (
        isinstance(x, (int, np.integer))
        and not isinstance(x, (bool, np.bool_))
        and 0 <= int(x) <= _U64_MAX
    )


def _python_ids_to_u64(
    name: str, flat: list[Any], lengths: npt.NDArray[np.int64]
) -> npt.NDArray[np.uint64]:
    """Convert a flat list of Python ints (IDs of all samples) to uint64, vectorized.

    ``lengths`` (int64 [batch]) only serves to name the sample of an invalid ID.
    """
    if not flat:
        return np.empty(0, dtype=np.uint64)
    try:
        # np.array reads True as 1 among ints: a bool anywhere takes the slow path, which
        # names it (a C-level scan of the types, no Python loop).
        types = set(map(type, flat))
        arr = None if bool in types or np.bool_ in types else np.array(flat)
    except (ValueError, TypeError, OverflowError):
        arr = None
    if arr is not None and arr.ndim == 1 and arr.dtype.kind in "iu":
        if arr.dtype.kind == "i":
            negative = arr < 0
            if negative.any():
                j = int(np.argmax(negative))
                raise BatchValidationError(
                    f"feature {name!r}: sample {_sample_of(j, lengths)} contains ID "
                    f"{int(arr[j])}; IDs must be integers with 0 <= id < 2**64"
                )
        return arr.astype(np.uint64)
    # Slow path: something is not a plain in-range int; find it to name the sample.
    for j, x in enumerate(flat):
        if not _is_valid_python_id(x):
            raise BatchValidationError(
                f"feature {name!r}: sample {_sample_of(j, lengths)} contains {x!r}; "
                "IDs must be integers with 0 <= id < 2**64"
            )
    return np.fromiter((int(x) for x in flat), dtype=np.uint64, count=len(flat))


def _equal_arrays(a: np.ndarray, b: np.ndarray) -> bool:
    """Exact equality: same dtype, same shape, same bytes (NaN payloads and -0.0 included)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# --------------------------------------------------------------------------------------------
# ID-type features


class IDTypeFeature:
    """A jagged sparse feature (one key of a KeyedJaggedTensor).

    Attributes:
        name: feature name, non-empty, at most 255 UTF-8 bytes.
        values: uint64 [total_ids], the IDs of all samples back to back (read-only).
        lengths: int64 [batch], the number of IDs of each sample (read-only, may be 0).
    """

    def __init__(self, name: str, values: np.ndarray, lengths: np.ndarray) -> None:
        """Build from ``values`` (uint64 [total_ids], 1-D) and ``lengths`` (any integer [batch]).

        Raises:
            BatchValidationError: bad name, values not a 1-D uint64 array, negative lengths, or
                ``sum(lengths) != len(values)``.
        """
        self._name = _check_name(name)
        self._values = _u64_array(self._name, values, "values")
        self._lengths = _lengths_array(self._name, lengths)
        total = self._values.shape[0]
        if self._lengths.size:
            longest = int(self._lengths.max())
            if longest > total:
                i = int(np.argmax(self._lengths))
                raise BatchValidationError(
                    f"feature {self._name!r}: sample {i} has length {longest} but values holds "
                    f"only {total} IDs"
                )
            summed = int(self._lengths.sum())
        else:
            summed = 0
        if summed != total:
            raise BatchValidationError(
                f"feature {self._name!r}: lengths sum to {summed} but values holds {total} IDs"
            )

    # constructors ----------------------------------------------------------------------------

    @classmethod
    def from_lists(
        cls, name: str, lists: Iterable[Sequence[int] | np.ndarray] | np.ndarray
    ) -> IDTypeFeature:
        """Build from per-sample ID sequences, e.g. ``[[1, 2], [], [7]]``.

        Each sample is a sequence of Python ints in ``[0, 2**64)`` or a 1-D uint64 numpy array;
        empty samples are allowed. A 2-D uint64 array [batch, k] means k IDs per sample.
        """
        name = _check_name(name)
        if isinstance(lists, np.ndarray):
            if lists.ndim != 2:
                raise BatchValidationError(
                    f"feature {name!r}: from_lists takes a sequence of per-sample sequences or a "
                    f"2-D uint64 array, got an array of shape {tuple(lists.shape)}"
                )
            rows, cols = lists.shape
            values = _u64_array(name, np.ascontiguousarray(lists).reshape(-1), "values")
            return cls(name, values, np.full(rows, cols, dtype=np.int64))
        if isinstance(lists, (str, bytes, bytearray)) or not isinstance(lists, Iterable):
            raise BatchValidationError(
                f"feature {name!r}: from_lists takes a sequence of per-sample ID sequences, "
                f"got {type(lists).__name__}"
            )
        samples = list(lists)
        lengths = np.empty(len(samples), dtype=np.int64)
        all_arrays = True
        for i, sample in enumerate(samples):
            if isinstance(sample, np.ndarray):
                if sample.dtype.kind != "u" or sample.dtype.itemsize != 8:
                    raise BatchValidationError(
                        f"feature {name!r}: sample {i} has dtype {sample.dtype}; "
                        "expected uint64 (convert with .astype(np.uint64))"
                    )
                if sample.ndim != 1:
                    raise BatchValidationError(
                        f"feature {name!r}: sample {i} must be 1-D, got shape {tuple(sample.shape)}"
                    )
            elif isinstance(sample, (str, bytes, bytearray)) or not isinstance(sample, Sequence):
                raise BatchValidationError(
                    f"feature {name!r}: sample {i} is of type {type(sample).__name__}; expected a "
                    "sequence of IDs (list, tuple or uint64 array)"
                )
            else:
                all_arrays = False
            lengths[i] = len(sample)
        if all_arrays:
            if samples:
                values = np.concatenate(samples).astype(np.uint64, copy=False)
            else:
                values = np.empty(0, dtype=np.uint64)
        else:
            flat = list(
                itertools.chain.from_iterable(
                    s.tolist() if isinstance(s, np.ndarray) else s for s in samples
                )
            )
            values = _python_ids_to_u64(name, flat, lengths)
        values.flags.writeable = False  # freshly built: let the constructor share it
        lengths.flags.writeable = False
        return cls(name, values, lengths)

    @classmethod
    def trusted(cls, name: str, values: np.ndarray, lengths: np.ndarray) -> IDTypeFeature:
        """Build without re-checking, for hot paths whose caller already guarantees what
        ``__init__`` checks: ``name`` a valid feature name, ``values`` a read-only, C-contiguous,
        native-order uint64 [total_ids] array and ``lengths`` a read-only, C-contiguous,
        native-order int64 [batch] array of non-negative entries summing to ``len(values)``
        (e.g. serving's request decoding and the dynamic batcher's merge of such features)."""
        feature = cls.__new__(cls)
        feature._name = name
        feature._values = values
        feature._lengths = lengths
        return feature

    @classmethod
    def from_lengths(cls, name: str, lengths: np.ndarray, values: np.ndarray) -> IDTypeFeature:
        """Build from ``lengths`` (integer [batch]) and ``values`` (uint64 [sum(lengths)])."""
        return cls(name, values, lengths)

    @classmethod
    def from_offsets(cls, name: str, offsets: np.ndarray, values: np.ndarray) -> IDTypeFeature:
        """Build from CSR ``offsets`` (integer [batch+1], starts at 0, non-decreasing, ends at
        ``len(values)``) and ``values`` (uint64 [total_ids])."""
        name = _check_name(name)
        offs = _lengths_array(name, offsets, "offsets")
        if offs.size == 0:
            raise BatchValidationError(
                f"feature {name!r}: offsets must have batch+1 >= 1 entries, got none"
            )
        if offs[0] != 0:
            raise BatchValidationError(
                f"feature {name!r}: offsets must start at 0, got {int(offs[0])}"
            )
        lengths = np.diff(offs)
        decreasing = lengths < 0
        if decreasing.any():
            i = int(np.argmax(decreasing))
            raise BatchValidationError(
                f"feature {name!r}: offsets must be non-decreasing, but offsets[{i + 1}] = "
                f"{int(offs[i + 1])} < offsets[{i}] = {int(offs[i])}"
            )
        if isinstance(values, np.ndarray) and values.ndim == 1 and int(offs[-1]) != len(values):
            raise BatchValidationError(
                f"feature {name!r}: offsets end at {int(offs[-1])} but values holds "
                f"{len(values)} IDs"
            )
        lengths.flags.writeable = False
        return cls(name, values, lengths)

    # accessors -------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The feature name."""
        return self._name

    @property
    def values(self) -> npt.NDArray[np.uint64]:
        """uint64 [total_ids], read-only."""
        return self._values

    @property
    def lengths(self) -> npt.NDArray[np.int64]:
        """int64 [batch], read-only."""
        return self._lengths

    @property
    def batch_size(self) -> int:
        """Number of samples."""
        return int(self._lengths.shape[0])

    @property
    def num_ids(self) -> int:
        """Total number of IDs over all samples (``len(values)``)."""
        return int(self._values.shape[0])

    @cached_property
    def offsets(self) -> npt.NDArray[np.int64]:
        """int64 [batch+1], ``offsets[i]:offsets[i+1]`` slices sample i's IDs (read-only)."""
        offs = np.zeros(self.batch_size + 1, dtype=np.int64)
        np.cumsum(self._lengths, out=offs[1:])
        offs.flags.writeable = False
        return offs

    def to_lists(self) -> list[list[int]]:
        """Per-sample lists of Python ints."""
        flat = self._values.tolist()
        bounds = self.offsets.tolist()
        return [flat[bounds[i] : bounds[i + 1]] for i in range(self.batch_size)]

    def equals(self, other: object) -> bool:
        """Exact equality of kind, name, values and lengths."""
        return (
            type(other) is type(self)
            and other.name == self._name
            and _equal_arrays(other.values, self._values)
            and _equal_arrays(other.lengths, self._lengths)
        )

    def __repr__(self) -> str:
        return (
            f"IDTypeFeature(name={self._name!r}, batch_size={self.batch_size}, "
            f"num_ids={self.num_ids})"
        )


class IDTypeFeatureWithSingleID:
    """A sparse feature with exactly one ID per sample.

    Attributes:
        name: feature name.
        values: uint64 [batch], one ID per sample (read-only).

    ``lengths`` (int64 ones [batch]) and ``offsets`` (int64 arange [batch+1]) exist so that code
    can treat both ID-type feature kinds uniformly.
    """

    def __init__(self, name: str, values: np.ndarray) -> None:
        """Build from ``values`` (uint64 [batch], 1-D).

        Raises:
            BatchValidationError: bad name, or values not a 1-D uint64 array.
        """
        self._name = _check_name(name)
        self._values = _u64_array(self._name, values, "values")

    @classmethod
    def trusted(cls, name: str, values: np.ndarray) -> IDTypeFeatureWithSingleID:
        """Build without re-checking, for hot paths whose caller already guarantees what
        ``__init__`` checks: ``name`` a valid feature name and ``values`` a read-only,
        C-contiguous, native-order uint64 [batch] array (e.g. serving's request decoding,
        whose names come from the model's signature)."""
        feature = cls.__new__(cls)
        feature._name = name
        feature._values = values
        return feature

    @classmethod
    def trusted_rows(
        cls, names: Sequence[str], rows: Iterable[np.ndarray]
    ) -> list[IDTypeFeatureWithSingleID]:
        """:meth:`trusted` for many features at once, ``names[i]`` with ``rows[i]`` (e.g. the
        rows of one read-only uint64 [features, batch] array), under the same guarantees. One
        call instead of one per feature: serving builds 16-27 of them per request."""
        new = object.__new__
        features: list[IDTypeFeatureWithSingleID] = []
        append = features.append
        for name, values in zip(names, rows):
            feature = new(cls)
            feature._name = name
            feature._values = values
            append(feature)
        return features

    @classmethod
    def from_ids(cls, name: str, ids: Sequence[int] | np.ndarray) -> IDTypeFeatureWithSingleID:
        """Build from one ID per sample: Python ints in ``[0, 2**64)`` or a uint64 array."""
        name = _check_name(name)
        if isinstance(ids, np.ndarray):
            return cls(name, ids)
        if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Sequence):
            raise BatchValidationError(
                f"feature {name!r}: from_ids takes a sequence of IDs, got {type(ids).__name__}"
            )
        flat = list(ids)
        values = _python_ids_to_u64(name, flat, np.ones(len(flat), dtype=np.int64))
        values.flags.writeable = False
        return cls(name, values)

    @property
    def name(self) -> str:
        """The feature name."""
        return self._name

    @property
    def values(self) -> npt.NDArray[np.uint64]:
        """uint64 [batch], read-only."""
        return self._values

    @property
    def batch_size(self) -> int:
        """Number of samples."""
        return int(self._values.shape[0])

    @property
    def num_ids(self) -> int:
        """Total number of IDs (equals ``batch_size``)."""
        return self.batch_size

    @cached_property
    def lengths(self) -> npt.NDArray[np.int64]:
        """int64 ones [batch], read-only."""
        ones = np.ones(self.batch_size, dtype=np.int64)
        ones.flags.writeable = False
        return ones

    @cached_property
    def offsets(self) -> npt.NDArray[np.int64]:
        """int64 arange [batch+1], read-only."""
        offs = np.arange(self.batch_size + 1, dtype=np.int64)
        offs.flags.writeable = False
        return offs

    def to_lists(self) -> list[list[int]]:
        """Per-sample one-element lists of Python ints."""
        return [[v] for v in self._values.tolist()]

    def equals(self, other: object) -> bool:
        """Exact equality of kind, name and values."""
        return (
            type(other) is type(self)
            and other.name == self._name
            and _equal_arrays(other.values, self._values)
        )

    def __repr__(self) -> str:
        return f"IDTypeFeatureWithSingleID(name={self._name!r}, batch_size={self.batch_size})"


IDFeature = IDTypeFeature | IDTypeFeatureWithSingleID
"""Either kind of ID-type feature."""


# --------------------------------------------------------------------------------------------
# dense features and labels


_Dense = TypeVar("_Dense", bound="_DenseArray")


class _DenseArray:
    """Common base of :class:`NonIDTypeFeature` and :class:`Label`."""

    _kind = "dense array"

    def __init__(self, data: np.ndarray, name: str | None = None) -> None:
        if name is not None:
            name = _check_name(name, self._kind)
        shown = repr(name) if name is not None else "(unnamed)"
        if not isinstance(data, np.ndarray):
            raise BatchValidationError(
                f"{self._kind} {shown}: data must be a numpy array, got {type(data).__name__}"
            )
        dtype = data.dtype
        native = dtype.newbyteorder("=") if dtype.byteorder not in ("|", "=") else dtype
        if native not in SUPPORTED_DTYPES:
            supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
            raise BatchValidationError(
                f"{self._kind} {shown}: unsupported dtype {dtype}; supported: {supported}"
            )
        if data.ndim < 1:
            raise BatchValidationError(
                f"{self._kind} {shown}: data must have ndim >= 1 (first axis = batch), "
                "got a 0-d array"
            )
        self._name = name
        self._data = _readonly(data)

    @classmethod
    def trusted(cls: type[_Dense], data: np.ndarray, name: str) -> _Dense:
        """Build without re-checking, for hot paths whose caller already guarantees what
        ``__init__`` checks: ``name`` a valid name and ``data`` a read-only, C-contiguous,
        aligned, native-order [batch, ...] array (ndim >= 1) of a supported dtype (e.g.
        serving's request decoding, whose names and dtypes come from the model's signature)."""
        array = cls.__new__(cls)
        array._name = name
        array._data = data
        return array

    @property
    def name(self) -> str | None:
        """The name; None until a :class:`Batch` assigns the positional default."""
        return self._name

    @property
    def data(self) -> np.ndarray:
        """[batch, ...] of a supported dtype, read-only, C-contiguous."""
        return self._data

    @property
    def batch_size(self) -> int:
        """Number of samples (``data.shape[0]``)."""
        return int(self._data.shape[0])

    def _named(self, name: str) -> _DenseArray:
        """A copy with ``name`` set, sharing the (read-only) data."""
        clone = object.__new__(type(self))
        clone._name = _check_name(name, self._kind)
        clone._data = self._data
        return clone

    def equals(self, other: object) -> bool:
        """Exact equality of kind, name, dtype, shape and bytes."""
        return (
            type(other) is type(self)
            and other.name == self._name
            and _equal_arrays(other.data, self._data)
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self._name!r}, dtype={self._data.dtype}, "
            f"shape={tuple(self._data.shape)})"
        )


class NonIDTypeFeature(_DenseArray):
    """A dense numeric feature.

    Attributes:
        data: [batch, ...] numeric array (bool, int8-64, uint8-64, float16/32/64), ndim >= 1.
        name: optional; a :class:`Batch` names unnamed ones ``non_id_feature_{i}`` by position.
    """

    _kind = "non-ID feature"


class Label(_DenseArray):
    """A label (training target) array.

    Attributes:
        data: [batch, ...] numeric array (same dtype rules as :class:`NonIDTypeFeature`).
        name: optional; a :class:`Batch` names unnamed ones ``label_{i}`` by position.
    """

    _kind = "label"


# --------------------------------------------------------------------------------------------
# the batch


def _as_tuple(arg: object, what: str, expected: tuple[type, ...], wording: str) -> tuple[Any, ...]:
    if arg is None:
        return ()
    if isinstance(arg, (np.ndarray, str, bytes, _DenseArray, *expected)) or not isinstance(
        arg, Iterable
    ):
        raise BatchValidationError(
            f"{what} must be a sequence of {wording}, got {type(arg).__name__}"
        )
    items = tuple(arg)
    for i, item in enumerate(items):
        if not isinstance(item, expected):
            raise BatchValidationError(
                f"{what}[{i}] is of type {type(item).__name__}; expected {wording}"
            )
    return items


class Batch:
    """A validated mini-batch: ID-type features, non-ID-type features and labels.

    All features and labels share one batch size (>= 1); names are unique across all three
    kinds. Training batches carry labels and ``requires_grad=True``; inference batches set
    ``requires_grad=False`` (labels optional). ``meta`` is opaque bytes passed through
    untouched; ``batch_id`` is an optional uint64 set by the data pipeline.
    """

    def __init__(
        self,
        id_type_features: Sequence[IDFeature],
        non_id_type_features: Sequence[NonIDTypeFeature] | None = (),
        labels: Sequence[Label] | None = (),
        *,
        requires_grad: bool = True,
        meta: bytes | None = None,
        batch_id: int | None = None,
    ) -> None:
        """Validate and assemble a batch.

        Raises:
            BatchValidationError: wrong types, empty batch, mismatched batch sizes, duplicate
                names, ``requires_grad=True`` without labels, bad ``meta`` or ``batch_id``.
        """
        ids = _as_tuple(
            id_type_features,
            "id_type_features",
            (IDTypeFeature, IDTypeFeatureWithSingleID),
            "IDTypeFeature or IDTypeFeatureWithSingleID",
        )
        dense = _as_tuple(
            non_id_type_features, "non_id_type_features", (NonIDTypeFeature,), "NonIDTypeFeature"
        )
        labs = _as_tuple(labels, "labels", (Label,), "Label")
        dense = tuple(
            f if f.name is not None else f._named(f"non_id_feature_{i}")
            for i, f in enumerate(dense)
        )
        labs = tuple(
            f if f.name is not None else f._named(f"label_{i}") for i, f in enumerate(labs)
        )

        kinds: dict[str, str] = {}
        for kind, group in (("ID-type feature", ids), ("non-ID feature", dense), ("label", labs)):
            for f in group:
                if f.name in kinds:
                    raise BatchValidationError(
                        f"duplicate feature name {f.name!r} (a {kinds[f.name]} and a {kind}); "
                        "names must be unique across ID-type features, non-ID features and labels"
                    )
                kinds[f.name] = kind

        if not ids and not dense:
            raise BatchValidationError(
                "empty batch: a batch needs at least one ID-type or non-ID-type feature"
            )
        first = (ids + dense)[0]
        size = first.batch_size
        for f in ids + dense + labs:
            if f.batch_size != size:
                raise BatchValidationError(
                    f"{kinds[f.name]} {f.name!r} has batch size {f.batch_size} but "
                    f"{kinds[first.name]} {first.name!r} has batch size {size}; all features "
                    "and labels must have the same batch size"
                )
        if size < 1:
            raise BatchValidationError(
                f"empty batch: batch size is 0 ({kinds[first.name]} {first.name!r} has no samples)"
            )

        if not isinstance(requires_grad, (bool, np.bool_)):
            raise BatchValidationError(
                f"requires_grad must be a bool, got {type(requires_grad).__name__}"
            )
        if requires_grad and not labs:
            raise BatchValidationError(
                "requires_grad=True but the batch has no labels; training batches need labels, "
                "inference batches must set requires_grad=False"
            )
        if meta is not None and not isinstance(meta, bytes):
            raise BatchValidationError(f"meta must be bytes or None, got {type(meta).__name__}")
        if batch_id is not None and (
            isinstance(batch_id, (bool, np.bool_))
            or not isinstance(batch_id, (int, np.integer))
            or not 0 <= int(batch_id) <= _U64_MAX
        ):
            raise BatchValidationError(
                f"batch_id must be None or an int with 0 <= batch_id < 2**64, got {batch_id!r}"
            )

        self._ids: tuple[IDFeature, ...] = ids
        self._dense: tuple[NonIDTypeFeature, ...] = dense
        self._labels: tuple[Label, ...] = labs
        self._batch_size = size
        self._requires_grad = bool(requires_grad)
        self._meta = meta
        self._batch_id = None if batch_id is None else int(batch_id)
        self._kinds = kinds
        self._id_index = {f.name: f for f in ids}
        self._dense_index = {f.name: f for f in dense}
        self._label_index = {f.name: f for f in labs}

    #: Optional, private: a read-only uint64 [n_single_id_features, batch_size] array whose
    #: k-th row *is* the values array of the k-th IDTypeFeatureWithSingleID of the batch (in
    #: id_type_features order). Set only by _trusted_inference callers that built the features
    #: as rows of one array, so that merging many batches concatenates one array per batch
    #: instead of one per feature (serving's dynamic batcher). None: not known.
    _single_id_rows: np.ndarray | None = None

    @classmethod
    def _trusted_inference(
        cls,
        id_type_features: Sequence[IDFeature],
        non_id_type_features: Sequence[NonIDTypeFeature],
        batch_size: int,
        single_id_rows: np.ndarray | None = None,
    ) -> Batch:
        """Assemble an inference batch (``requires_grad=False``, no labels, ``meta`` and
        ``batch_id`` None) without re-checking anything.

        Private to the serving hot paths (request decoding, the dynamic batcher's merge), which
        build 16-27 features per request and already guarantee what ``__init__`` would check:
        every feature is an :class:`IDTypeFeature` / :class:`IDTypeFeatureWithSingleID` resp. a
        *named* :class:`NonIDTypeFeature`, names are unique across both groups, every feature
        has ``batch_size`` samples, ``batch_size >= 1`` and at least one feature is given.
        Breaking any of these gives a batch that ``__init__`` would have refused. The batch
        holds exactly what ``__init__`` would have set (the name indexes are built on first use).
        ``single_id_rows``: see :attr:`_single_id_rows` (the caller guarantees its rows are the
        single-ID features' values arrays, in order).
        """
        batch = cls.__new__(cls)
        batch._ids = tuple(id_type_features)
        batch._dense = tuple(non_id_type_features)
        batch._labels = ()
        batch._batch_size = batch_size
        batch._requires_grad = False
        batch._meta = None
        batch._batch_id = None
        if single_id_rows is not None:
            batch._single_id_rows = single_id_rows
            if len(single_id_rows) == len(batch._ids):  # every ID feature is a row
                batch.__dict__["num_ids"] = single_id_rows.size  # the cached property's value
        # _kinds and the three name indexes are left to their cached properties below: built
        # on the first lookup by name (which the serving hot paths never do), ~2 us a batch.
        return batch

    # name indexes: __init__ sets them (it needs _kinds to validate); batches assembled by
    # _trusted_inference build them on first use, equal to what __init__ would have set.

    @cached_property
    def _kinds(self) -> dict[str, str]:
        """{name: "ID-type feature" | "non-ID feature" | "label"}, in feature order."""
        kinds = dict.fromkeys((f.name for f in self._ids), "ID-type feature")
        # A Batch names every non-ID feature and label (positional default), so no name is None.
        dense_names = cast("Iterator[str]", (f.name for f in self._dense))
        label_names = cast("Iterator[str]", (f.name for f in self._labels))
        kinds.update(dict.fromkeys(dense_names, "non-ID feature"))
        kinds.update(dict.fromkeys(label_names, "label"))
        return kinds

    @cached_property
    def _id_index(self) -> dict[str, IDFeature]:
        return {f.name: f for f in self._ids}

    @cached_property
    def _dense_index(self) -> dict[str, NonIDTypeFeature]:
        return {f.name: f for f in self._dense}  # type: ignore[misc]

    @cached_property
    def _label_index(self) -> dict[str, Label]:
        return {f.name: f for f in self._labels}  # type: ignore[misc]

    # properties ------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Number of samples (>= 1)."""
        return self._batch_size

    @cached_property
    def num_ids(self) -> int:
        """IDs over every ID-type feature and sample (what a lookup resolves)."""
        return sum(feature.num_ids for feature in self._ids)

    @property
    def id_type_features(self) -> tuple[IDFeature, ...]:
        """ID-type features in the order given."""
        return self._ids

    @property
    def non_id_type_features(self) -> tuple[NonIDTypeFeature, ...]:
        """Non-ID-type features in the order given, all named."""
        return self._dense

    @property
    def labels(self) -> tuple[Label, ...]:
        """Labels in the order given, all named."""
        return self._labels

    @property
    def id_feature_names(self) -> tuple[str, ...]:
        """Names of the ID-type features, in order."""
        return tuple(f.name for f in self._ids)

    @property
    def non_id_feature_names(self) -> tuple[str, ...]:
        """Names of the non-ID-type features, in order."""
        return tuple(f.name for f in self._dense)  # type: ignore[misc]

    @property
    def label_names(self) -> tuple[str, ...]:
        """Names of the labels, in order."""
        return tuple(f.name for f in self._labels)  # type: ignore[misc]

    @property
    def requires_grad(self) -> bool:
        """True for training batches (gradients flow back to the embeddings)."""
        return self._requires_grad

    @property
    def meta(self) -> bytes | None:
        """Opaque user bytes, or None."""
        return self._meta

    @property
    def batch_id(self) -> int | None:
        """Optional uint64 batch id."""
        return self._batch_id

    # accessors -------------------------------------------------------------------------------

    def _lookup(self, index: dict[str, Any], kind: str, name: str) -> Any:
        try:
            return index[name]
        except (KeyError, TypeError):
            pass
        elsewhere = self._kinds.get(name) if isinstance(name, str) else None
        hint = f" ({name!r} is a {elsewhere})" if elsewhere else ""
        raise BatchValidationError(f"unknown {kind} {name!r}{hint}; known {kind}s: {sorted(index)}")

    def id_feature(self, name: str) -> IDFeature:
        """The ID-type feature called ``name``; BatchValidationError if there is none."""
        return self._lookup(self._id_index, "ID-type feature", name)

    def non_id_feature(self, name: str) -> NonIDTypeFeature:
        """The non-ID-type feature called ``name``; BatchValidationError if there is none."""
        return self._lookup(self._dense_index, "non-ID feature", name)

    def label(self, name: str) -> Label:
        """The label called ``name``; BatchValidationError if there is none."""
        return self._lookup(self._label_index, "label", name)

    # comparison and codec --------------------------------------------------------------------

    def equals(self, other: object) -> bool:
        """Exact equality: same features (kinds, names, order, dtypes, shapes, bytes), flags,
        meta and batch_id."""
        if not isinstance(other, Batch):
            return False
        return (
            self._requires_grad == other._requires_grad
            and self._meta == other._meta
            and self._batch_id == other._batch_id
            and len(self._ids) == len(other._ids)
            and len(self._dense) == len(other._dense)
            and len(self._labels) == len(other._labels)
            and all(a.equals(b) for a, b in zip(self._ids, other._ids))
            and all(a.equals(b) for a, b in zip(self._dense, other._dense))
            and all(a.equals(b) for a, b in zip(self._labels, other._labels))
        )

    def to_bytes(self) -> bytes:
        """Encode with :func:`embedding_store.batch_codec.encode_batch`."""
        from embedding_store.batch_codec import encode_batch

        return encode_batch(self)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Batch:
        """Decode with :func:`embedding_store.batch_codec.decode_batch`.

        Raises:
            DecodeError: the bytes are malformed; BatchValidationError: they decode to an
                invalid batch.
        """
        from embedding_store.batch_codec import decode_batch

        return decode_batch(data)

    def __repr__(self) -> str:
        return (
            f"Batch(batch_size={self._batch_size}, id_type_features={list(self.id_feature_names)}, "
            f"non_id_type_features={list(self.non_id_feature_names)}, "
            f"labels={list(self.label_names)}, requires_grad={self._requires_grad}, "
            f"batch_id={self._batch_id}, meta={'None' if self._meta is None else len(self._meta)})"
        )


PersiaBatch = Batch
"""PERSIA's name for :class:`Batch`."""
