"""Friendly-route rows (``{"instances": [...]}``) -> named KServe v2 request tensors.

An ID feature is an int or a list of ints, a non-ID feature a number or a (nested) list of
numbers; a wrong value is refused with an InvalidArgumentError naming its row.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import numpy as np

from embedding_store.errors import InvalidArgumentError
from embedding_store.signature import FeatureSignature
from serving.tensor_specs import LENGTHS_SUFFIX

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


def _raise_instance_id_error(name: str, single_id: bool, raw: list[Any]) -> NoReturn:
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
            if type(v) is float and v.is_integer() and not 0 <= v < 2**64:
                # An integer literal beyond 64 bits, which the JSON parser (orjson) read as
                # a float: out of range, not "no integer".
                raise InvalidArgumentError(
                    f"instances[{index}].{name}: ID {v:.17g} is out of the uint64 range [0, 2**64)"
                )
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
        values = _dense_values(spec.name, spec.sample_shape, rows)
        with np.errstate(over="ignore"):
            inputs[spec.name] = values.astype(np.float32)
    return inputs


def _numbers(values: Any) -> np.ndarray | None:
    """``values`` (a number or (nested) lists of them) as a numeric array, or None if they
    are ragged or hold anything but numbers: strings, nulls and true/false are not numbers
    (float32 conversion would read "0.5" as 0.5, null as NaN and true as 1.0)."""
    try:
        array = np.asarray(values)
    except (TypeError, ValueError, OverflowError, RecursionError):
        return None
    if array.dtype.kind not in "iuf" or _holds_bool([values]):
        return None
    return array


def _dense_form(sample_shape: tuple[int, ...]) -> str:
    """What one friendly row gives for a non-ID feature of ``sample_shape`` (error messages)."""
    if math.prod(sample_shape) == 1 and len(sample_shape) <= 1:
        return "a number"
    if len(sample_shape) == 1:
        return f"a list of {sample_shape[0]} numbers"
    return f"lists of numbers nested as {list(sample_shape)}"


def _dense_values(name: str, sample_shape: tuple[int, ...], rows: list[Any]) -> np.ndarray:
    """The values of non-ID feature ``name`` in friendly rows as a numeric array
    [len(rows), *sample_shape]. A row gives its sample nested as ``sample_shape`` (a flat list
    for one dimension), or, for a one-value sample (shape () or (1,)), a number or a list of
    one number. The whole batch converts in one call when the rows agree; rows that mix
    forms are converted one by one, and the first wrong row is named."""
    one_value = math.prod(sample_shape) == 1 and len(sample_shape) <= 1
    values = _numbers(rows)
    if values is not None:
        if values.shape[1:] == sample_shape:
            return values
        if one_value and values.shape[1:] in ((), (1,)):
            return values.reshape(len(rows), *sample_shape)
    samples = []
    for index, row in enumerate(rows):
        sample = _numbers(row)
        # Not numbers (a string, null, true), or numbers of another shape: the row is named
        # with the one form its sample takes.
        if sample is None or (
            sample.shape != sample_shape and not (one_value and sample.shape in ((), (1,)))
        ):
            raise InvalidArgumentError(
                f"instances[{index}].{name}: expected {_dense_form(sample_shape)}, got "
                f"{_short(row)}"
            )
        samples.append(sample.reshape(sample_shape))
    return np.stack(samples)
