"""Request tensors -> validated batches, following the model's feature signature.

KServe v2 tensor naming (what model metadata lists):

* ID feature ``<slot>`` with a variable number of IDs per sample: input ``<slot>`` (INT64 or
  UINT64, shape [total_ids]) and ``<slot>.lengths`` (INT32 or INT64, shape [batch]);
* ID feature with one ID per sample: ``<slot>`` (INT64 or UINT64, shape [batch]), no lengths;
* non-ID feature ``<name>``: FP32 [batch, *sample_shape].

Everything is checked before any lookup: known names, dtypes, non-negative IDs and lengths,
lengths summing to the number of IDs, one batch size, the maximum batch size. Errors are
InvalidArgumentError naming the input.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from embedding_store.batch import Batch, IDTypeFeature, IDTypeFeatureWithSingleID, NonIDTypeFeature
from embedding_store.errors import CapacityError, InvalidArgumentError, RecserveError
from embedding_store.signature import FeatureSignature
from serving.core import TensorSpec

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
) -> dict[str, np.ndarray] | None:
    """Every single-ID input converted and checked in one numpy pass: {name: read-only uint64
    [batch]}, rows of one [inputs, batch] array. None unless they all are 1-D INT64 or UINT64
    arrays of one dtype and length with no negative ID; the per-input checks of
    :func:`tensors_to_batch` then name the problem. (16-27 inputs of one sample each: one
    stack and one min instead of a conversion and a check per input.)"""
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
    return dict(zip(names, stacked, strict=True))


def _ids(name: str, array: np.ndarray) -> np.ndarray:
    if array.dtype == np.uint64:
        ids = array
    elif array.dtype.kind in "iu":
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
            f"input {name!r}: IDs must be INT64 or UINT64, got {array.dtype.name}"
        )
    if ids.ndim != 1:
        raise InvalidArgumentError(f"input {name!r}: IDs must be 1-D, got shape {list(ids.shape)}")
    return ids


def _lengths(name: str, array: np.ndarray) -> np.ndarray:
    if array.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"input {name!r}: lengths must be INT32 or INT64, got {array.dtype.name}"
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
    """Validate named request tensors against ``signature`` and build an inference Batch."""
    expected = _input_names(signature)
    unknown = sorted(set(inputs) - expected)
    if unknown:
        raise InvalidArgumentError(
            f"unknown input(s) {unknown}; the model takes {sorted(expected)}"
        )
    missing = sorted(expected - set(inputs))
    if missing:
        raise InvalidArgumentError(f"missing input(s) {missing}")
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

    single_ids = _single_ids_at_once(signature, inputs)
    if single_ids is not None:  # one length for all of them, checked in the stack
        name = _single_id_names(signature)[0]
        agree(len(single_ids[name]), name)
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
        total = int(lengths.sum())
        if total != len(ids):
            raise InvalidArgumentError(
                f"input {lengths_name!r} sums to {total} but {feature.name!r} has {len(ids)} IDs"
            )
        agree(len(lengths), lengths_name)
        id_features.append(IDTypeFeature(feature.name, ids, lengths))
    non_id_features = []
    for spec in signature.non_id_features:
        array = np.asarray(inputs[spec.name])
        if array.dtype.kind not in "fiu":
            raise InvalidArgumentError(f"input {spec.name!r} must be FP32, got {array.dtype.name}")
        if array.ndim == 1 and spec.sample_shape == (1,):
            array = array.reshape(-1, 1)
        if tuple(array.shape[1:]) != spec.sample_shape or array.ndim < 1:
            raise InvalidArgumentError(
                f"input {spec.name!r} has shape {list(array.shape)}; expected "
                f"[batch, {', '.join(str(d) for d in spec.sample_shape)}]"
            )
        agree(array.shape[0], spec.name)
        non_id_features.append(NonIDTypeFeature(array.astype(spec.dtype, copy=False), spec.name))
    if not batch_size:
        raise InvalidArgumentError("the request has an empty batch (batch size 0)")
    if batch_size > max_batch_size:
        raise CapacityError(
            f"batch size {batch_size} exceeds this server's max batch size {max_batch_size}"
        )
    try:
        return Batch(id_features, non_id_features, requires_grad=False)
    except RecserveError as error:
        raise InvalidArgumentError(error.message) from None


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
            raise InvalidArgumentError(f"instances[{index}] must be an object")
        unknown = sorted(set(instance) - names)
        if unknown:
            raise InvalidArgumentError(
                f"instances[{index}] has unknown feature(s) {unknown}; known: {sorted(names)}"
            )
    for feature in signature.id_features:
        values: list[int] = []
        lengths = np.empty(len(instances), dtype=np.int64)
        for index, instance in enumerate(instances):
            if feature.name not in instance:
                raise InvalidArgumentError(f"instances[{index}] lacks feature {feature.name!r}")
            value = instance[feature.name]
            items = value if isinstance(value, list) else [value]
            if feature.single_id and len(items) != 1:
                raise InvalidArgumentError(
                    f"instances[{index}].{feature.name}: exactly one ID expected, got {len(items)}"
                )
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
                raise InvalidArgumentError(
                    f"instances[{index}].{feature.name}: IDs must be integers"
                )
            if any(v < 0 or v >= 2**64 for v in items):
                raise InvalidArgumentError(
                    f"instances[{index}].{feature.name}: IDs must be in [0, 2**64)"
                )
            values.extend(items)
            lengths[index] = len(items)
        inputs[feature.name] = np.array(values, dtype=np.uint64)
        if not feature.single_id:
            inputs[feature.name + LENGTHS_SUFFIX] = lengths
    for spec in signature.non_id_features:
        rows = []
        for index, instance in enumerate(instances):
            if spec.name not in instance:
                raise InvalidArgumentError(f"instances[{index}] lacks feature {spec.name!r}")
            rows.append(instance[spec.name])
        try:
            array = np.asarray(rows, dtype=np.float32)
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"feature {spec.name!r}: every instance needs a number or a list of "
                f"{int(np.prod(spec.sample_shape))} numbers"
            ) from None
        inputs[spec.name] = array.reshape(len(instances), -1) if array.ndim == 1 else array
    return inputs
