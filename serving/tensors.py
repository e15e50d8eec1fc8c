"""Request tensors -> validated batches, following the model's feature signature.

Tensor naming: :mod:`serving.tensor_specs`. Everything is checked before any lookup: known
names, dtypes, non-negative IDs and lengths, lengths summing to the number of IDs, one batch
size, the maximum batch size. Errors are InvalidArgumentError naming the input.

Plain JSON and binary-extension bodies first go through the fast builders of
:mod:`serving.fast_batch`; anything they do not take is converted as the eager decoder did and
takes the general path, so the result and every error message are the same either way.

Also: the finite checks of dense inputs and of predictions.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import cast

import numpy as np

from embedding_store.batch import (
    Batch,
    IDFeature,
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    NonIDTypeFeature,
)
from embedding_store.errors import InvalidArgumentError, RecserveError
from embedding_store.signature import FeatureSignature, describe_inexact
from serving.core import DTYPE_NAMES
from serving.fast_batch import batch_from_binary, batch_from_json, json_plan, lengths_total
from serving.lazy_tensors import BinaryTensors, JsonTensors
from serving.tensor_specs import LENGTHS_SUFFIX, input_names


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
    # The loop above checked every array is an ndarray (a check mypy cannot see through).
    stacked = np.stack(cast("list[np.ndarray]", arrays))
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
        batch = batch_from_json(signature, inputs.raw_entries, max_batch_size)
        if batch is not None:
            return batch
        inputs = inputs.materialize()
    elif isinstance(inputs, BinaryTensors):
        batch = batch_from_binary(signature, inputs, max_batch_size)
        if batch is not None:
            return batch
        inputs = inputs.materialize()
    expected = input_names(signature)
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
    id_features: list[IDFeature] = []
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
        total = lengths_total(lengths)
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
                f"[{', '.join(['batch', *(str(d) for d in spec.sample_shape)])}]"
            )
        agree(array.shape[0], spec.name)
        target = np.dtype(spec.dtype)
        if target.kind in "iu":
            # An integer feature (the model may index with it) travels as FP32 (the
            # metadata's datatype): NaN, 3.7 or 1e30 would be cast to 3 or to an arbitrary
            # integer, answered with a 200. Checked on the FP32 values, before the cast.
            require_finite(spec.name, array)
            require_whole(spec.name, array, target)
        with np.errstate(over="ignore", invalid="ignore"):
            array = array.astype(target, copy=False)
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
    if json_plan(signature) is not None:
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
        # A Batch's non-ID features are all named (it names unnamed ones): name is a str here.
        require_finite(cast(str, feature.name), array)


def require_whole(name: str, array: np.ndarray, target: np.dtype) -> None:
    """InvalidArgumentError naming the input, the sample and the value unless every value
    of ``array`` (float32 [batch, ...], finite) is a whole number in the range of the
    integer dtype ``target``, the dtype the model takes input ``name`` in."""
    problem = describe_inexact(array, target)
    if problem is not None:
        raise InvalidArgumentError(
            f"input {name!r} is an integer feature of the model ({target}): {problem}"
        )


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
