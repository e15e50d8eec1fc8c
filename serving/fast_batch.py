"""Fast builders of inference Batches from raw request entries, one numpy call per group.

Plain JSON bodies arrive as :class:`~serving.lazy_tensors.JsonTensors` (raw JSON, not yet
arrays) and binary-extension bodies as :class:`~serving.lazy_tensors.BinaryTensors`:
:func:`batch_from_json` and :func:`batch_from_binary` turn the usual request straight into a
Batch (all single-ID inputs in one numpy call; features and Batch built unchecked, their
invariants being checked here), or return None; :func:`serving.tensors.tensors_to_batch` then
converts the inputs as the eager decoder did and takes the general path, so the result and
every error message are the same either way.
"""

from __future__ import annotations

import functools
import math
import operator
import sys
from array import array as c_array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from embedding_store.batch import (
    Batch,
    IDFeature,
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    NonIDTypeFeature,
    _check_name,
)
from embedding_store.errors import RecserveError
from embedding_store.signature import FeatureSignature
from serving.lazy_tensors import BinaryEntry, BinaryTensors
from serving.tensor_specs import (
    ID_DATATYPES,
    LENGTH_DATATYPES,
    LENGTHS_SUFFIX,
    input_names,
    input_specs,
)


@dataclass(frozen=True)
class _JsonPlan:
    """What :func:`batch_from_json` needs of a signature, worked out once per signature."""

    num_inputs: int
    single_names: tuple[str, ...]  # single-ID features, signature order
    single_getter: Callable[[Mapping[str, Any]], tuple[Any, ...]] | None  # their raw entries
    jagged_names: tuple[str, ...]  # jagged ID features, signature order
    id_order: tuple[tuple[bool, int], ...] | None  # (single?, index in its group); None: all single
    dense: tuple[tuple[str, list[int], int], ...]  # (name, sample_shape as a list, sample size)


def _getter(names: tuple[str, ...]) -> Callable[[Mapping[str, Any]], tuple[Any, ...]]:
    """``mapping -> tuple(mapping[name] for name in names)`` in one C call (KeyError if one
    is missing); itemgetter of a single key returns the item itself, hence the wrapper."""
    if len(names) == 1:
        (name,) = names
        return lambda mapping: (mapping[name],)
    return operator.itemgetter(*names)


@functools.lru_cache(maxsize=64)
def json_plan(signature: FeatureSignature) -> _JsonPlan | None:
    """The plan of the fast JSON builder, or None when it cannot apply to ``signature``:
    names Batch would refuse (invalid or not unique: checked here once, since the fast builder
    and the general path's end build the Batch unchecked), input names that clash (``x`` and
    ``x.lengths``), a non-float32 dense feature, or no feature at all."""
    ids = signature.id_features
    dense_specs = signature.non_id_features
    names = [f.name for f in ids] + [f.name for f in dense_specs]
    specs = input_specs(signature)
    if (
        not names
        or len(set(names)) != len(names)
        or len(input_names(signature)) != len(specs)
        or any(np.dtype(spec.dtype) != np.float32 for spec in dense_specs)
    ):
        return None
    try:
        for name in names:
            _check_name(name)
    except RecserveError:
        return None
    single_names = tuple(f.name for f in ids if f.single_id)
    jagged_names = tuple(f.name for f in ids if not f.single_id)
    order = tuple(
        (f.single_id, (single_names if f.single_id else jagged_names).index(f.name)) for f in ids
    )
    return _JsonPlan(
        num_inputs=len(specs),
        single_names=single_names,
        single_getter=_getter(single_names) if single_names else None,
        jagged_names=jagged_names,
        id_order=None if not jagged_names else order,
        dense=tuple(
            (spec.name, list(spec.sample_shape), math.prod(spec.sample_shape))
            for spec in dense_specs
        ),
    )


_ID_DATATYPES = frozenset(ID_DATATYPES)
_LENGTH_DATATYPES = frozenset(LENGTH_DATATYPES)
_INT64 = np.dtype(np.int64)
_UINT64 = np.dtype(np.uint64)
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
_min = np.minimum.reduce  # ndarray.min() minus a Python-level wrapper (~0.1 us a call)
#: What np.array may raise on JSON lists (eager decoding catches the same).
_CONVERSION_ERRORS = (ValueError, TypeError, OverflowError, RecursionError)


def lengths_total(lengths: np.ndarray) -> int:
    """The exact sum of non-negative int64 ``lengths``. numpy's int64 sum wraps around: four
    lengths of 2**62 would sum to 0 and pass for a feature with no IDs."""
    if not lengths.size:
        return 0
    if int(lengths.max()) <= _INT64_MAX // lengths.size:
        return int(lengths.sum())  # cannot overflow
    return sum(lengths.tolist())


def _dense_shape_accepted(shape: Any, batch_size: int, sample_shape: list[int]) -> bool:
    """Whether a raw dense tensor's ``shape`` is [B, *sample_shape] (or [B] for sample shape
    [1], as the general path takes it), every dim an int: ``[2, true] == [2, 1]`` in Python,
    but shape_of refuses bools."""
    if shape != [batch_size, *sample_shape] and (sample_shape != [1] or shape != [batch_size]):
        return False
    return all(type(dim) is int for dim in shape)


class _FallBackError(Exception):
    """Raised inside the fast JSON builder: the request is not the usual kind, fall back."""


def _json_int_list(tensor: dict[str, Any], datatypes: frozenset[str], size: int) -> np.ndarray:
    """A raw JSON integer tensor of shape [size] -> int64 [size] (non-negative; never written
    to by callers). Raises _FallBackError unless its datatype is one of ``datatypes`` and
    ``data`` a flat list (or the simdjson route's int64 array) of ``size`` ints in [0, 2**63).
    ``size`` may be 0."""
    shape = tensor["shape"]
    data = tensor["data"]
    if tensor["datatype"] not in datatypes or shape != [size] or type(shape[0]) is not int:
        raise _FallBackError
    if len(data) != size:
        raise _FallBackError
    if type(data) is not list and type(data) is not np.ndarray:
        raise _FallBackError
    if not size:
        return np.zeros(0, dtype=np.int64)
    if type(data) is np.ndarray:
        values = data  # ArrayJsonTensors: int64 [size], read-only
    elif type(data[0]) is not int:  # see batch_from_json on bools
        raise _FallBackError
    else:
        try:
            values = np.array(data)
        except _CONVERSION_ERRORS:
            raise _FallBackError from None
    if values.dtype != _INT64 or values.ndim != 1 or _min(values, None) < 0:
        raise _FallBackError
    return values


def _jagged_from_json(
    entries: Mapping[str, dict[str, Any]], name: str, batch_size: int
) -> IDTypeFeature:
    """A jagged ID feature from its raw JSON IDs and lengths (``batch_size`` >= 1); raises
    _FallBackError for anything unusual (INT32 lengths must fit INT32, as in eager decoding)."""
    lengths_tensor = entries[name + LENGTHS_SUFFIX]
    lengths = _json_int_list(lengths_tensor, _LENGTH_DATATYPES, batch_size)
    if lengths_tensor["datatype"] == "INT32" and int(lengths.max()) > _INT32_MAX:
        raise _FallBackError
    tensor = entries[name]
    shape = tensor["shape"]
    if type(shape) is not list or len(shape) != 1:
        raise _FallBackError
    ids = _json_int_list(tensor, _ID_DATATYPES, shape[0])
    if lengths_total(lengths) != len(ids):
        raise _FallBackError
    ids = ids.view(np.uint64)  # same bits: every value is non-negative
    ids.setflags(write=False)
    lengths.setflags(write=False)
    return IDTypeFeature.trusted(name, ids, lengths)


def batch_from_json(
    signature: FeatureSignature, entries: Mapping[str, dict[str, Any]], max_batch_size: int
) -> Batch | None:
    """The inference Batch of raw JSON tensors (:attr:`JsonTensors.raw_entries`) in a few
    numpy calls, or None if anything is unusual; the caller then runs the general path, whose
    checks name the problem. Never guesses: it accepts only requests the general path accepts
    and builds the Batch it builds (same features, order, dtypes, values).

    Accepted: exactly the model's inputs; single-ID inputs INT64/UINT64 of shape [B] whose
    ``data`` are flat lists of B ints in [0, 2**63): all of them converted by one ``np.array``
    into int64 [F, B], checked by one ``min`` and viewed as uint64 rows; jagged ID inputs
    likewise (IDs [total_ids], lengths INT32/INT64 [B] summing to total_ids); dense inputs
    FP32 of shape [B, *sample_shape] (or [B] for sample shape (1,)) whose ``data`` are flat
    lists of numbers, converted to float32 [B, *sample_shape]; 1 <= B <= ``max_batch_size``.

    Bools: np.array turns a list mixing ints and bools into int64, as the eager decoder's
    np.asarray does per input (so it accepts such a list), but an input whose data are all
    bools is a BOOL array there, refused. Such a list starts with a bool, and every list must
    start with an int here.

    :class:`~serving.http_decode.ArrayJsonTensors` entries hold, instead of each list, the
    flat int64 or float64 array those numbers make (see :mod:`serving.json_arrays`): the same
    checks apply to them, and they are joined with one ``np.concatenate``.
    """
    plan = json_plan(signature)
    if plan is None or len(entries) != plan.num_inputs:
        return None  # a missing or unknown input (names are unique, so counts decide)
    # Raw JSON may be anything: a missing key, a non-list, an empty list or a string all mean
    # "not the usual request" (KeyError, TypeError, IndexError): the general path says why.
    try:
        batch_size = 0
        rows: np.ndarray | tuple[()] = ()  # uint64 [F, B] once there are single-ID inputs
        if plan.single_getter is not None:
            tensors = plan.single_getter(entries)  # KeyError: an input is missing
            batch_size = len(tensors[0]["data"])
            shape_wanted = [batch_size]
            flat: list[Any] = []
            extend = flat.extend
            arrays: list[np.ndarray] = []  # ArrayJsonTensors: int64 [B] each
            for tensor in tensors:
                shape = tensor["shape"]
                data = tensor["data"]
                if (
                    tensor["datatype"] not in _ID_DATATYPES
                    or shape != shape_wanted  # a list of one dim, the batch size
                    or type(shape[0]) is not int  # [true] == [1]; shape_of refuses bools
                    or len(data) != batch_size
                    or not batch_size
                ):
                    return None
                if type(data) is np.ndarray:
                    arrays.append(data)
                elif type(data) is list and type(data[0]) is int:
                    extend(data)
                else:
                    return None
            if arrays:
                if flat:
                    return None  # never both from one body
                ids = np.concatenate(arrays)  # int64 [F * B]
            else:
                # One flat list into a signed 64-bit C array: ~30% faster than np.array, and
                # as strict. A float, a string, None or a nested list is a TypeError, an int
                # outside int64 an OverflowError: the general path says why. (bools are ints
                # to both.)
                try:
                    ids = np.frombuffer(c_array("q", flat), dtype=_INT64)  # int64 [F * B]
                except _CONVERSION_ERRORS:
                    return None
            if _min(ids, None) < 0:
                return None
            rows = ids.view(_UINT64).reshape(len(tensors), batch_size)  # same bits: all >= 0
            rows.setflags(write=False)  # rows are read-only views the Batch can share
        jagged = []
        for name in plan.jagged_names:
            if not batch_size:
                batch_size = entries[name + LENGTHS_SUFFIX]["shape"][0]
                if type(batch_size) is not int or batch_size < 1:
                    return None
            jagged.append(_jagged_from_json(entries, name, batch_size))
        dense = []
        for name, sample_shape, sample_size in plan.dense:
            tensor = entries[name]
            shape = tensor["shape"]
            data = tensor["data"]
            if not batch_size:
                batch_size = shape[0]
                if type(batch_size) is not int or batch_size < 1:
                    return None
            if tensor["datatype"] != "FP32" or len(data) != batch_size * sample_size:
                return None
            if not _dense_shape_accepted(shape, batch_size, sample_shape):
                return None
            if type(data) is np.ndarray:
                values = data  # ArrayJsonTensors: float64, what np.asarray makes of the list
            elif type(data) is not list:
                return None
            else:
                try:
                    values = np.array(data)  # what the eager decoder's np.asarray makes of it
                except _CONVERSION_ERRORS:
                    return None
            if values.ndim != 1 or values.dtype.kind not in "iuf":
                return None  # nested data, bools only, strings, None, ints beyond 64 bits
            # As the general path: the JSON numbers (float64 or 64-bit ints) -> float32, once.
            with np.errstate(over="ignore"):
                array = values.astype(np.float32).reshape(batch_size, *sample_shape)
            if not np.isfinite(array).all():
                return None  # the general path names the input
            array.setflags(write=False)
            dense.append(NonIDTypeFeature.trusted(array, name))
    except (KeyError, TypeError, IndexError, _FallBackError):
        return None
    if batch_size > max_batch_size:
        return None
    singles = IDTypeFeatureWithSingleID.trusted_rows(plan.single_names, rows)
    if plan.id_order is None:
        id_features: Sequence[IDFeature] = singles
    else:
        id_features = [
            singles[index] if single else jagged[index] for single, index in plan.id_order
        ]
    # Features in singles come from rows: it is the uint64 array whenever singles is not empty.
    return Batch._trusted_inference(
        id_features, dense, batch_size, cast(np.ndarray, rows) if singles else None
    )


#: Wire (little-endian) dtypes of the binary fast path; it runs only where they are native.
_WIRE_IDS = {"INT64": np.dtype("<i8"), "UINT64": np.dtype("<u8")}
_WIRE_FP32 = np.dtype("<f4")
_LITTLE_ENDIAN_HOST = sys.byteorder == "little"


def batch_from_binary(
    signature: FeatureSignature, inputs: BinaryTensors, max_batch_size: int
) -> Batch | None:
    """The inference Batch of a binary-extension body's inputs (:class:`BinaryTensors`)
    without converting them one by one, or None if anything is unusual (the caller then runs
    the general path, whose checks name the problem). Like :func:`batch_from_json`, it accepts
    only what the general path accepts and builds the Batch it builds.

    Accepted: exactly the model's inputs, no jagged ID feature; single-ID inputs all INT64 or
    all UINT64 of shape [B] (INT64 IDs non-negative): viewed as one uint64 [F, B] array, with
    one ``np.frombuffer`` when they lie side by side in signature order (zero-copy), else one
    concatenation; dense inputs FP32 of shape [B, *sample_shape] (or [B] for sample shape
    (1,)), zero-copy; 1 <= B <= ``max_batch_size``; a little-endian host.
    """
    plan = json_plan(signature)
    entries = inputs.raw_entries
    if (
        plan is None
        or plan.jagged_names
        or len(entries) != plan.num_inputs
        or not _LITTLE_ENDIAN_HOST
    ):
        return None
    body = inputs.body
    try:
        batch_size = 0
        rows: np.ndarray | None = None
        if plan.single_getter is not None:
            singles: Sequence[BinaryEntry] = plan.single_getter(entries)  # KeyError: missing
            first = singles[0].tensor
            datatype = first["datatype"]
            wire = _WIRE_IDS.get(datatype) if type(datatype) is str else None
            batch_size = first["shape"][0]
            if wire is None or type(batch_size) is not int or batch_size < 1:
                return None
            shape_wanted = [batch_size]
            size_wanted = 8 * batch_size
            side_by_side = True
            next_offset = singles[0].offset
            for entry in singles:
                tensor = entry.tensor
                shape = tensor["shape"]
                if (
                    tensor["datatype"] != datatype
                    or shape != shape_wanted
                    or type(shape[0]) is not int  # [true] == [1]; shape_of refuses bools
                    or entry.size != size_wanted
                ):
                    return None
                side_by_side = side_by_side and entry.offset == next_offset
                next_offset = entry.offset + size_wanted
            count = len(singles) * batch_size
            if side_by_side:
                ids = np.frombuffer(body, dtype=wire, count=count, offset=singles[0].offset)
            else:
                ids = np.concatenate(
                    [np.frombuffer(body, wire, batch_size, entry.offset) for entry in singles]
                )
            if datatype == "INT64" and _min(ids, None) < 0:
                return None  # the general path names the negative ID
            rows = ids.view(_UINT64).reshape(len(singles), batch_size)
            rows.setflags(write=False)
        dense = []
        for name, sample_shape, sample_size in plan.dense:
            entry = entries[name]
            shape = entry.tensor["shape"]
            if not batch_size:
                batch_size = shape[0]
                if type(batch_size) is not int or batch_size < 1:
                    return None
            if entry.tensor["datatype"] != "FP32" or entry.size != 4 * batch_size * sample_size:
                return None
            if not _dense_shape_accepted(shape, batch_size, sample_shape):
                return None
            array = np.frombuffer(
                body, dtype=_WIRE_FP32, count=batch_size * sample_size, offset=entry.offset
            ).reshape(batch_size, *sample_shape)
            if not np.isfinite(array).all():
                return None  # the general path names the input
            dense.append(NonIDTypeFeature.trusted(array, name))
    except (KeyError, TypeError, IndexError):
        return None
    if batch_size > max_batch_size:
        return None
    if rows is None:
        return Batch._trusted_inference([], dense, batch_size)
    singles_features = IDTypeFeatureWithSingleID.trusted_rows(plan.single_names, rows)
    return Batch._trusted_inference(singles_features, dense, batch_size, rows)
