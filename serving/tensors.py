"""Request tensors -> validated batches, following the model's feature signature.

KServe v2 tensor naming (what model metadata lists):

* ID feature ``<slot>`` with a variable number of IDs per sample: input ``<slot>`` (INT64 or
  UINT64, shape [total_ids]) and ``<slot>.lengths`` (INT32 or INT64, shape [batch]);
* ID feature with one ID per sample: ``<slot>`` (INT64 or UINT64, shape [batch]), no lengths;
* non-ID feature ``<name>``: FP32 [batch, *sample_shape].

Everything is checked before any lookup: known names, dtypes, non-negative IDs and lengths,
lengths summing to the number of IDs, one batch size, the maximum batch size. Errors are
InvalidArgumentError naming the input.

Plain JSON bodies arrive as :class:`~serving.lazy_tensors.JsonTensors` (raw JSON, not yet
arrays): a fast builder turns the usual request straight into a Batch (all single-ID inputs in
one ``np.array`` call; features and Batch built unchecked, their invariants being checked here);
anything else is converted as the eager decoder did and takes the general path, so the result
and every error message are the same either way.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import sys
from array import array as c_array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from embedding_store.batch import (
    Batch,
    IDFeature,
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    NonIDTypeFeature,
    _check_name,
)
from embedding_store.errors import InvalidArgumentError, RecserveError
from embedding_store.signature import FeatureSignature
from serving.core import DTYPE_NAMES, TensorSpec
from serving.lazy_tensors import BinaryEntry, BinaryTensors, JsonTensors

LENGTHS_SUFFIX = ".lengths"
ID_DATATYPES = ("INT64", "UINT64")
LENGTH_DATATYPES = ("INT32", "INT64")
OUTPUT_NAME = "prediction"


@functools.lru_cache(maxsize=64)
def input_specs(signature: FeatureSignature) -> tuple[TensorSpec, ...]:
    """The model's inputs as KServe v2 tensor specs, in signature order (cached: every
    request is checked against them)."""
    specs: list[TensorSpec] = []
    for feature in signature.id_features:
        specs.append(TensorSpec(feature.name, "INT64", (-1,), ID_DATATYPES))
        if not feature.single_id:
            specs.append(
                TensorSpec(feature.name + LENGTHS_SUFFIX, "INT64", (-1,), LENGTH_DATATYPES)
            )
    for feature in signature.non_id_features:
        specs.append(TensorSpec(feature.name, "FP32", (-1, *feature.sample_shape), ("FP32",)))
    return tuple(specs)


@functools.lru_cache(maxsize=64)
def _input_names(signature: FeatureSignature) -> frozenset[str]:
    return frozenset(spec.name for spec in input_specs(signature))


def output_specs() -> tuple[TensorSpec, ...]:
    return (TensorSpec(OUTPUT_NAME, "FP32", (-1, 1), ("FP32",)),)


@functools.lru_cache(maxsize=64)
def _single_id_names(signature: FeatureSignature) -> tuple[str, ...]:
    names = tuple(f.name for f in signature.id_features if f.single_id)
    for name in names:  # checked once here, so features can be built unchecked per request
        IDTypeFeatureWithSingleID(name, np.zeros(0, dtype=np.uint64))
    return names


def _single_ids_at_once(
    signature: FeatureSignature, inputs: Mapping[str, np.ndarray]
) -> np.ndarray | None:
    """Every single-ID input converted and checked in one numpy pass: read-only uint64
    [inputs, batch], row k the IDs of ``_single_id_names(signature)[k]``. None unless they
    all are 1-D INT64 or UINT64 arrays of one dtype and length with no negative ID; the
    per-input checks of :func:`tensors_to_batch` then name the problem. (16-27 inputs of one
    sample each: one stack and one min instead of a conversion and a check per input.)"""
    names = _single_id_names(signature)
    if len(names) < 2:
        return None
    arrays = [inputs.get(name) for name in names]
    first = arrays[0]
    if (
        not isinstance(first, np.ndarray)
        or first.ndim != 1
        or first.dtype not in (np.dtype(np.int64), np.dtype(np.uint64))
    ):
        return None
    for array in arrays:
        if (
            not isinstance(array, np.ndarray)
            or array.dtype != first.dtype
            or array.shape != first.shape
        ):
            return None
    stacked = np.stack(arrays)
    if first.dtype == np.int64:
        if stacked.size and stacked.min() < 0:
            return None
        stacked = stacked.view(np.uint64)  # same bits: every value is non-negative
    stacked.flags.writeable = False  # rows are read-only views the Batch can share
    return stacked


def _wire_name(dtype: np.dtype) -> str:
    """KServe v2 name of ``dtype`` (numpy's name for one the protocol lacks)."""
    return DTYPE_NAMES.get(dtype, dtype.name)


def _ids(name: str, array: np.ndarray) -> np.ndarray:
    # Only the datatypes the model's metadata lists (ID_DATATYPES), as Triton refuses any
    # other: bytes sent under another datatype than their own would be read as that one.
    if array.dtype == np.uint64:
        ids = array
    elif array.dtype == np.int64:
        if array.size and array.min() < 0:
            position = int(np.argmax(array < 0))
            raise InvalidArgumentError(
                f"input {name!r}: IDs must be non-negative, got {int(array[position])} at "
                f"position {position}"
            )
        ids = array.astype(np.uint64)
        ids.flags.writeable = False  # our own copy: lets the Batch share it instead of copying
    else:
        raise InvalidArgumentError(
            f"input {name!r}: IDs must be INT64 or UINT64, got {_wire_name(array.dtype)}"
        )
    if ids.ndim != 1:
        raise InvalidArgumentError(f"input {name!r}: IDs must be 1-D, got shape {list(ids.shape)}")
    return ids


def _lengths(name: str, array: np.ndarray) -> np.ndarray:
    if array.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise InvalidArgumentError(
            f"input {name!r}: lengths must be INT32 or INT64, got {_wire_name(array.dtype)}"
        )
    if array.ndim != 1:
        raise InvalidArgumentError(
            f"input {name!r}: lengths must be 1-D [batch], got shape {list(array.shape)}"
        )
    if array.size and array.min() < 0:
        raise InvalidArgumentError(f"input {name!r}: lengths must be non-negative")
    return array.astype(np.int64)


@dataclass(frozen=True)
class _JsonPlan:
    """What :func:`_batch_from_json` needs of a signature, worked out once per signature."""

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
def _json_plan(signature: FeatureSignature) -> _JsonPlan | None:
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
        or len(_input_names(signature)) != len(specs)
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


def _lengths_total(lengths: np.ndarray) -> int:
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
    elif type(data[0]) is not int:  # see _batch_from_json on bools
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
    if _lengths_total(lengths) != len(ids):
        raise _FallBackError
    ids = ids.view(np.uint64)  # same bits: every value is non-negative
    ids.setflags(write=False)
    lengths.setflags(write=False)
    return IDTypeFeature.trusted(name, ids, lengths)


def _batch_from_json(
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
    plan = _json_plan(signature)
    if plan is None or len(entries) != plan.num_inputs:
        return None  # a missing or unknown input (names are unique, so counts decide)
    # Raw JSON may be anything: a missing key, a non-list, an empty list or a string all mean
    # "not the usual request" (KeyError, TypeError, IndexError): the general path says why.
    try:
        batch_size = 0
        rows: Sequence[np.ndarray] = ()
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
        id_features: list[IDFeature] = singles
    else:
        id_features = [
            singles[index] if single else jagged[index] for single, index in plan.id_order
        ]
    return Batch._trusted_inference(id_features, dense, batch_size, rows if singles else None)


#: Wire (little-endian) dtypes of the binary fast path; it runs only where they are native.
_WIRE_IDS = {"INT64": np.dtype("<i8"), "UINT64": np.dtype("<u8")}
_WIRE_FP32 = np.dtype("<f4")
_LITTLE_ENDIAN_HOST = sys.byteorder == "little"


def _batch_from_binary(
    signature: FeatureSignature, inputs: BinaryTensors, max_batch_size: int
) -> Batch | None:
    """The inference Batch of a binary-extension body's inputs (:class:`BinaryTensors`)
    without converting them one by one, or None if anything is unusual (the caller then runs
    the general path, whose checks name the problem). Like :func:`_batch_from_json`, it accepts
    only what the general path accepts and builds the Batch it builds.

    Accepted: exactly the model's inputs, no jagged ID feature; single-ID inputs all INT64 or
    all UINT64 of shape [B] (INT64 IDs non-negative): viewed as one uint64 [F, B] array, with
    one ``np.frombuffer`` when they lie side by side in signature order (zero-copy), else one
    concatenation; dense inputs FP32 of shape [B, *sample_shape] (or [B] for sample shape
    (1,)), zero-copy; 1 <= B <= ``max_batch_size``; a little-endian host.
    """
    plan = _json_plan(signature)
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


def tensors_to_batch(
    signature: FeatureSignature,
    inputs: Mapping[str, np.ndarray],
    *,
    max_batch_size: int,
) -> Batch:
    """Validate named request tensors against ``signature`` and build an inference Batch.

    :class:`~serving.lazy_tensors.JsonTensors` (plain JSON bodies) first go through a fast
    builder working on the raw JSON; whatever it does not take is converted eagerly
    (``materialize``, raising what the eager decoder raised) and takes the general path, so
    the Batch and every error are the same either way.
    """
    if isinstance(inputs, JsonTensors):
        batch = _batch_from_json(signature, inputs.raw_entries, max_batch_size)
        if batch is not None:
            return batch
        inputs = inputs.materialize()
    elif isinstance(inputs, BinaryTensors):
        batch = _batch_from_binary(signature, inputs, max_batch_size)
        if batch is not None:
            return batch
        inputs = inputs.materialize()
    expected = _input_names(signature)
    unknown = sorted(set(inputs) - expected)
    if unknown:
        raise InvalidArgumentError(
            f"unknown input(s) {unknown}; the model takes {sorted(expected)}"
        )
    missing = sorted(expected - set(inputs))
    if missing:
        raise InvalidArgumentError(
            f"missing input(s) {missing}; the model takes {sorted(expected)}"
        )
    batch_size: int | None = None
    batch_source = ""

    def agree(size: int, source: str) -> None:
        nonlocal batch_size, batch_source
        if batch_size is None:
            batch_size, batch_source = size, source
        elif size != batch_size:
            raise InvalidArgumentError(
                f"input {source!r} has batch size {size}, but {batch_source!r} has {batch_size}"
            )

    stacked = _single_ids_at_once(signature, inputs)
    single_ids = None
    if stacked is not None:  # one length for all of them, checked in the stack
        names = _single_id_names(signature)
        single_ids = dict(zip(names, stacked, strict=True))
        agree(stacked.shape[1], names[0])
    id_features = []
    for feature in signature.id_features:
        if single_ids is not None and feature.single_id:
            ids = single_ids[feature.name]
            id_features.append(IDTypeFeatureWithSingleID.trusted(feature.name, ids))
            continue
        ids = _ids(feature.name, np.asarray(inputs[feature.name]))
        if feature.single_id:
            agree(len(ids), feature.name)
            id_features.append(IDTypeFeatureWithSingleID(feature.name, ids))
            continue
        lengths_name = feature.name + LENGTHS_SUFFIX
        lengths = _lengths(lengths_name, np.asarray(inputs[lengths_name]))
        total = _lengths_total(lengths)
        if total != len(ids):
            raise InvalidArgumentError(
                f"input {lengths_name!r} sums to {total} but {feature.name!r} has {len(ids)} IDs"
            )
        agree(len(lengths), lengths_name)
        id_features.append(IDTypeFeature(feature.name, ids, lengths))
    non_id_features = []
    for spec in signature.non_id_features:
        array = np.asarray(inputs[spec.name])
        if array.dtype != np.float32:
            raise InvalidArgumentError(
                f"input {spec.name!r} must be FP32, got {_wire_name(array.dtype)}"
            )
        if array.ndim == 1 and spec.sample_shape == (1,):
            array = array.reshape(-1, 1)
        if tuple(array.shape[1:]) != spec.sample_shape or array.ndim < 1:
            raise InvalidArgumentError(
                f"input {spec.name!r} has shape {list(array.shape)}; expected "
                f"[batch, {', '.join(str(d) for d in spec.sample_shape)}]"
            )
        agree(array.shape[0], spec.name)
        with np.errstate(over="ignore", invalid="ignore"):
            array = array.astype(spec.dtype, copy=False)
        require_finite(spec.name, array)
        non_id_features.append(NonIDTypeFeature(array, spec.name))
    if not batch_size:
        raise InvalidArgumentError("the request has an empty batch (batch size 0)")
    if batch_size > max_batch_size:
        # A property of the request, not of the server's load: 400 / INVALID_ARGUMENT (as
        # Triton), never retried; CapacityError (413) is for bodies over the byte limit.
        raise InvalidArgumentError(
            f"batch size {batch_size} exceeds this server's max batch size {max_batch_size}"
        )
    if _json_plan(signature) is not None:
        # Names valid and unique (checked once per signature), every feature built and
        # checked above with one batch size >= 1: nothing left for Batch.__init__ to check.
        return Batch._trusted_inference(id_features, non_id_features, batch_size, stacked)
    try:
        return Batch(id_features, non_id_features, requires_grad=False)
    except RecserveError as error:
        raise InvalidArgumentError(error.message) from None


def require_finite_features(batch: Batch) -> None:
    """:func:`require_finite` for every non-ID feature of ``batch`` as the model will read it
    (float32), e.g. a batch made by a preprocessor from friendly rows."""
    for feature in batch.non_id_type_features:
        with np.errstate(over="ignore", invalid="ignore"):
            array = np.asarray(feature.data, dtype=np.float32)
        require_finite(feature.name, array)


def require_finite(name: str, array: np.ndarray) -> None:
    """InvalidArgumentError unless every value of dense input ``name`` (float32 [batch, ...])
    is finite: NaN or Inf (sent, or a number beyond FP32's range) would come back as a
    prediction of NaN, or as null in JSON, with no word of the input at fault."""
    finite = np.isfinite(array)
    if finite.all():
        return
    bad = np.argwhere(~finite)
    first = bad[0]
    raise InvalidArgumentError(
        f"input {name!r} has {len(bad)} non-finite value(s) (NaN, Inf, or beyond FP32's range "
        f"of +-3.4e38), the first at sample {int(first[0])}"
        + (f", position {[int(i) for i in first[1:]]}" if len(first) > 1 else "")
    )


_MISSING = object()


def _instance_ids(values: list[Any]) -> np.ndarray | None:
    """The IDs of friendly rows as uint64 [n], converted and checked for the whole batch at
    once (Python ints in [0, 2**64): no bools, floats or strings); None if any is not, so the
    caller finds and names it."""
    if not values:
        return np.zeros(0, dtype=np.uint64)
    if set(map(type, values)) != {int}:  # bools, floats, strings, a missing feature
        return None
    try:
        array = np.array(values, dtype=np.int64)
    except OverflowError:  # some ID is >= 2**63: only uint64 holds it (and no negative one)
        try:
            return np.array(values, dtype=np.uint64)
        except OverflowError:
            return None
    if int(array.min()) < 0:
        return None
    return array.view(np.uint64)


def _raise_instance_id_error(name: str, single_id: bool, raw: list[Any]) -> None:
    """Name the first row whose value of ID feature ``name`` is wrong (the error path only)."""
    for index, value in enumerate(raw):
        if value is _MISSING:
            raise InvalidArgumentError(f"instances[{index}] lacks feature {name!r}")
        items = value if type(value) is list else [value]
        if single_id and len(items) != 1:
            raise InvalidArgumentError(
                f"instances[{index}].{name}: exactly one ID expected, got {len(items)}"
            )
        for v in items:
            if not isinstance(v, int) or isinstance(v, bool):
                raise InvalidArgumentError(
                    f"instances[{index}].{name}: IDs must be integers, got {_short(v)} "
                    f"({type(v).__name__})"
                )
        for v in items:
            if v < 0 or v >= 2**64:
                raise InvalidArgumentError(
                    f"instances[{index}].{name}: IDs must be in [0, 2**64), got {_short(v)}"
                )
    raise InvalidArgumentError(f"feature {name!r}: IDs must be integers in [0, 2**64)")


def _short(value: object) -> str:
    """``repr(value)``, cut to 80 characters so an error never floods the client."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _holds_bool(values: list[Any]) -> bool:
    """Whether ``values`` (numbers, or lists of them, nested) holds true or false."""
    pending = [values]
    while pending:
        items = pending.pop()
        types = set(map(type, items))
        if bool in types:
            return True
        if list in types:
            pending.extend(item for item in items if type(item) is list)
    return False


def instances_to_inputs(
    signature: FeatureSignature, instances: Sequence[Mapping[str, Any]]
) -> dict[str, np.ndarray]:
    """Friendly JSON rows -> named tensors: an ID feature is an int or a list of ints, a
    non-ID feature a number or a (nested) list of numbers."""
    if not isinstance(instances, Sequence) or isinstance(instances, (str, bytes)):
        raise InvalidArgumentError('"instances" must be a list of objects')
    if not instances:
        raise InvalidArgumentError('"instances" is empty')
    names = {f.name for f in signature.id_features} | {f.name for f in signature.non_id_features}
    inputs: dict[str, np.ndarray] = {}
    for index, instance in enumerate(instances):
        if not isinstance(instance, Mapping):
            raise InvalidArgumentError(
                f"instances[{index}] must be an object (feature name -> value), got "
                f"{_short(instance)} ({type(instance).__name__})"
            )
        unknown = sorted(set(instance) - names)
        if unknown:
            raise InvalidArgumentError(
                f"instances[{index}] has unknown feature(s) {unknown}; known: {sorted(names)}"
            )
    for feature in signature.id_features:
        name = feature.name
        raw = [instance.get(name, _MISSING) for instance in instances]  # one per sample
        items = [value if type(value) is list else [value] for value in raw]
        lengths = np.fromiter(map(len, items), dtype=np.int64, count=len(items))
        ids = _instance_ids(list(itertools.chain.from_iterable(items)))
        if ids is None or (feature.single_id and bool((lengths != 1).any())):
            _raise_instance_id_error(feature.name, feature.single_id, raw)
        inputs[name] = ids
        if not feature.single_id:
            inputs[name + LENGTHS_SUFFIX] = lengths
    for spec in signature.non_id_features:
        rows = []
        for index, instance in enumerate(instances):
            if spec.name not in instance:
                raise InvalidArgumentError(f"instances[{index}] lacks feature {spec.name!r}")
            rows.append(instance[spec.name])
        try:
            values = np.asarray(rows)
        except (TypeError, ValueError, OverflowError):
            values = None
        # Strings, nulls and true/false are not numbers (float32 conversion would read
        # "0.5" as 0.5, null as NaN and true as 1.0).
        if values is None or values.dtype.kind not in "iuf" or _holds_bool(rows):
            raise InvalidArgumentError(
                f"feature {spec.name!r}: every instance needs a number or a list of "
                f"{int(np.prod(spec.sample_shape))} numbers"
            ) from None
        with np.errstate(over="ignore"):
            array = values.astype(np.float32)
        inputs[spec.name] = array.reshape(len(instances), -1) if array.ndim == 1 else array
    return inputs


def require_finite_predictions(predictions: np.ndarray) -> None:
    """InvalidArgumentError unless a request's predictions (float32 [batch, k]) are finite.

    Finite inputs can still overflow inside the model (a dense value near FP32's limit):
    the answer would be NaN, or null in JSON, with a 200. Refused, naming the samples."""
    bad = np.flatnonzero(~np.isfinite(predictions).reshape(len(predictions), -1).all(axis=1))
    if len(bad):
        raise InvalidArgumentError(
            f"the model's prediction is not finite (NaN or Inf) for {len(bad)} sample(s) of "
            f"this request, the first at sample {int(bad[0])}: its inputs are outside the "
            "range the model can score (look for extreme dense values)"
        )
