"""The protocol-neutral KServe v2 (Open Inference Protocol) request model and tensor checks.

Front ends are thin: they turn a request into an :class:`InferRequest` (named numpy arrays plus
request options), call the core once, and turn the :class:`~serving.core.Prediction` back into
the wire format the request used: serving/http_decode.py and serving/http_encode.py for HTTP,
serving/grpc_codec.py for gRPC. This module holds what both share: the request model, the
checks of datatypes and shapes, the conversion of one tensor to an array (JSON ``data`` in one
``np.asarray`` call; little-endian bytes as a zero-copy, read-only ``np.frombuffer`` view), and
the choice of outputs and response parameters.

Names are passed through untouched (the core maps them to features, see serving/tensors.py).
BYTES tensors are not supported. Malformed tensors raise InvalidArgumentError naming the input.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from embedding_store.errors import InvalidArgumentError
from serving.core import KSERVE_DTYPES, Prediction

#: Response parameters every inference answer carries.
FALLBACK_IDS = "fallback_ids"
UNKNOWN_IDS = "unknown_ids"
#: The tensor parameter of Triton's shared-memory extensions (system and CUDA), which this
#: server does not implement: it registers no region (``/v2/systemsharedmemory``,
#: ``/v2/cudasharedmemory`` and their gRPC methods do not exist here).
SHARED_MEMORY_REGION = "shared_memory_region"

_MAX_DIMS = 16
_MAX_ELEMENTS = 1 << 40  # bound on the product of the non-zero dimensions
_LITTLE: dict[str, np.dtype] = {n: d.newbyteorder("<") for n, d in KSERVE_DTYPES.items()}
#: The native-byte-order twin of each wire dtype (what decoded arrays hold).
_NATIVE: dict[np.dtype, np.dtype] = {d: d.newbyteorder("=") for d in _LITTLE.values()}
_NAME_OF_DTYPE: dict[np.dtype, str] = {d: n for n, d in KSERVE_DTYPES.items()}
_SUPPORTED = ", ".join(KSERVE_DTYPES)


@dataclass(frozen=True)
class RequestedOutput:
    """An entry of the request's ``outputs``; ``binary`` None means the request default."""

    name: str
    binary: bool | None = None


@dataclass
class InferRequest:
    """A decoded inference request, protocol-neutral.

    ``timeout`` is in seconds, from ``parameters["timeout"]`` (microseconds, as Triton reads it).
    ``binary_output`` is the HTTP default for outputs without their own ``binary_data``;
    ``raw`` says a gRPC request used ``raw_input_contents`` (so outputs go back raw too).
    """

    inputs: Mapping[str, np.ndarray]  # a dict, or JsonTensors for plain JSON HTTP bodies
    id: str = ""
    parameters: dict[str, Any] | None = None
    outputs: tuple[RequestedOutput, ...] | None = None
    binary_output: bool = False
    raw: bool = False
    timeout: float | None = None


# --------------------------------------------------------------------------- validation
def dtype_of(name: str, datatype: object) -> np.dtype:
    """The (little-endian) numpy dtype of a KServe v2 datatype name; errors name the input."""
    if not isinstance(datatype, str):
        raise InvalidArgumentError(f"input {name!r}: 'datatype' must be a string")
    dtype = _LITTLE.get(datatype)
    if dtype is None:
        if datatype == "BYTES":
            raise InvalidArgumentError(
                f"input {name!r}: datatype BYTES is not supported; send numeric tensors "
                "(IDs as INT64 or UINT64, dense features as FP32)"
            )
        raise InvalidArgumentError(
            f"input {name!r}: unknown datatype {datatype[:40]!r}; expected one of {_SUPPORTED}"
        )
    return dtype


def shape_of(name: str, shape: object) -> tuple[int, ...]:
    """A validated tensor shape: at most 16 non-negative integers, at most 2**40 elements
    (zero dimensions aside)."""
    if not isinstance(shape, (list, tuple)) or len(shape) > _MAX_DIMS:
        raise InvalidArgumentError(
            f"input {name!r}: 'shape' must be a list of at most {_MAX_DIMS} non-negative integers"
        )
    extent = 1
    exact = True  # every dim a plain int (JSON's case): the tuple needs no conversion
    for dim in shape:
        if type(dim) is not int:
            if isinstance(dim, bool) or not isinstance(dim, int):
                raise InvalidArgumentError(
                    f"input {name!r}: shape {_shape_text(shape)} must hold non-negative integers"
                )
            exact = False
        if dim < 0:
            raise InvalidArgumentError(
                f"input {name!r}: shape {_shape_text(shape)} must hold non-negative integers"
            )
        extent *= max(dim, 1)
        if extent > _MAX_ELEMENTS:
            raise InvalidArgumentError(f"input {name!r}: shape {_shape_text(shape)} is too large")
    return tuple(shape) if exact else tuple(int(dim) for dim in shape)


def _shape_text(shape: Sequence[Any]) -> str:
    text = "[" + ", ".join(str(dim) for dim in shape) + "]"
    return text if len(text) <= 80 else text[:77] + "...]"


def count_mismatch(name: str, dims: tuple[int, ...], count: int, what: str) -> str:
    return (
        f"input {name!r}: shape {_shape_text(dims)} has {math.prod(dims)} elements but {what} "
        f"has {count}"
    )


def array_from_json(name: str, datatype: object, shape: object, data: object) -> np.ndarray:
    """A JSON tensor (``data`` flat or nested, row-major) -> array of ``shape``."""
    dtype = dtype_of(name, datatype)
    dims = shape_of(name, shape)
    if not isinstance(data, list):
        raise InvalidArgumentError(f"input {name!r}: 'data' must be a (flat or nested) list")
    try:
        values = np.asarray(data)
    except (ValueError, TypeError, OverflowError, RecursionError):
        depth = _nesting_depth(data)
        if depth > _MAX_DIMS:  # regular maybe, but beyond numpy's 64 dimensions
            raise InvalidArgumentError(
                f"input {name!r}: 'data' nests lists {depth} deep; nest them at most "
                f"{len(dims)} deep (one level per dimension of its shape), or send them flat"
            ) from None
        raise InvalidArgumentError(
            f"input {name!r}: 'data' is ragged or mixes lists and numbers"
        ) from None
    count = math.prod(dims)
    if values.size != count:
        raise InvalidArgumentError(count_mismatch(name, dims, values.size, "data"))
    native = _NATIVE[dtype]
    if count == 0:
        return np.zeros(dims, dtype=native)
    kind = values.dtype.kind
    if dtype.kind == "b":
        if kind != "b":
            raise InvalidArgumentError(f"input {name!r}: BOOL data must be true/false")
    elif dtype.kind in "iu":
        if kind == "f" and dtype.kind == "u" and dtype.itemsize == 8:
            # numpy promotes a mix of ints below and above 2**63 to float64: reparse exactly.
            values = _exact_uint64(name, data, values)
        elif kind not in "iu":
            raise _not_integers(name, datatype, data, dtype)
        if values.dtype != dtype:
            info = np.iinfo(dtype)
            low, high = int(values.min()), int(values.max())
            if low < info.min or high > info.max:
                bad = low if low < info.min else high
                raise InvalidArgumentError(
                    f"input {name!r}: value {bad} is out of range for {datatype}"
                )
    elif kind not in "iuf":
        raise InvalidArgumentError(f"input {name!r}: {datatype} data must be numbers")
    # A JSON number beyond FP32's range becomes inf, which the batch builder refuses by name:
    # numpy's overflow warning would only add a line to the log per such request.
    with np.errstate(over="ignore"):
        values = values.astype(native, copy=False)
    return values if values.shape == dims else values.reshape(dims)


def _nesting_depth(data: list) -> int:
    """How deep lists nest along the first items of ``data`` (1 for a flat list)."""
    depth, item = 0, cast(Any, data)
    while type(item) is list:
        depth += 1
        item = item[0] if item else None
    return depth


def _exact_uint64(name: str, data: list, approximate: np.ndarray) -> np.ndarray:
    """UINT64 JSON data that numpy first read as float64: parse as uint64, and accept it only
    if every value is a JSON integer (``1.0`` or ``1e3`` is refused, as for INT64) and what
    float64 read equals the exact parse."""
    try:
        with np.errstate(invalid="ignore", over="ignore"):
            exact = np.asarray(data, dtype=np.uint64)
    except (ValueError, TypeError, OverflowError):
        exact = None
    if (
        exact is None
        or not _only_ints(data)
        or not np.array_equal(exact.astype(np.float64), approximate)
    ):
        raise _not_integers(name, "UINT64", data, np.dtype(np.uint64)) from None
    return exact


def _not_integers(name: str, datatype: object, data: list, dtype: np.dtype) -> InvalidArgumentError:
    """The error for integer ``data`` (a JSON list, flat or nested, that numpy read as
    floats): its first value that is a float or an int beyond ``dtype``'s range, named as
    out of range when it is a whole number beyond that range, else the data called no
    integers. orjson reads an integer literal beyond 64 bits (2**64, -2**63 - 1) as a
    float, and numpy reads ints past int64 mixed with negative ones as floats: the client
    sent an integer, too large. The error path only: one walk over the list."""
    info = np.iinfo(dtype)
    first = next(_suspects(data, info.min, info.max), None)
    shown: str | None = None
    if isinstance(first, float):
        # A float at -2**63 is beyond it too: orjson reads that integer itself as an int.
        if math.isfinite(first) and first.is_integer() and not info.min < first < info.max:
            shown = f"{first:.17g}"
    elif first is not None:
        shown = str(first)  # only out-of-range ints are suspects
    if shown is not None:
        # As the range check of integer data: "value -3 is out of range for UINT64".
        return InvalidArgumentError(f"input {name!r}: value {shown} is out of range for {datatype}")
    return InvalidArgumentError(
        f"input {name!r}: {datatype} data must be integers within its range"
    )


def _suspects(data: list, low: int, high: int) -> Iterator[int | float]:
    """The floats of (nested) list ``data`` and its ints outside [low, high], in row-major
    order."""
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            kind = type(item)
            if kind is list:
                stack.append(iter(item))
                break
            if kind is float or (kind is int and not low <= item <= high):
                yield item
        else:
            stack.pop()


def _only_ints(data: list) -> bool:
    """Whether (nested) list ``data`` holds only Python ints: JSON integers, no floats."""
    pending = [data]
    while pending:
        for item in pending.pop():
            kind = type(item)
            if kind is list:
                pending.append(item)
            elif kind is not int:
                return False
    return True


def array_from_bytes(
    name: str, datatype: object, shape: object, payload: bytes | memoryview, what: str
) -> np.ndarray:
    """Little-endian row-major bytes -> array of ``shape`` (a zero-copy, read-only view)."""
    dtype = dtype_of(name, datatype)
    dims = shape_of(name, shape)
    expected = math.prod(dims) * dtype.itemsize
    if len(payload) != expected:
        raise InvalidArgumentError(
            f"input {name!r}: shape {_shape_text(dims)} of {datatype} needs {expected} bytes "
            f"but {what} has {len(payload)}"
        )
    if dtype.kind == "b":
        return (np.frombuffer(payload, dtype=np.uint8) != 0).reshape(dims)
    values = np.frombuffer(payload, dtype=dtype)
    if not dtype.isnative:
        values = values.astype(dtype.newbyteorder("="))
    return values.reshape(dims)


def datatype_of(array: np.ndarray) -> str:
    """KServe v2 datatype name of an output array."""
    dtype = array.dtype if array.dtype.isnative else array.dtype.newbyteorder("=")
    name = _NAME_OF_DTYPE.get(dtype)
    if name is None:
        raise TypeError(f"output dtype {array.dtype} has no KServe v2 datatype")
    return name


def little_endian_bytes(array: np.ndarray) -> bytes:
    dtype = array.dtype if array.dtype.byteorder in "<|" else array.dtype.newbyteorder("<")
    return np.ascontiguousarray(array, dtype=dtype).tobytes()


def shared_memory_error(owner: str, output: bool) -> InvalidArgumentError:
    """The refusal of a tensor that names a shared-memory region (``owner``: "input 'x'" or
    "output 'x'"). An input there holds no data; an output would come back in the response
    while the client reads the region: refused, never answered as if it were not named."""
    where = (
        "ask for the output without one: it comes back in the response"
        if output
        else "send the input's data in the request (JSON 'data', binary data or raw contents)"
    )
    return InvalidArgumentError(
        f"{owner}: parameter {SHARED_MEMORY_REGION!r}: the shared-memory extensions are not "
        f"supported (this server registers no region); {where}"
    )


def request_timeout(parameters: Mapping[str, Any]) -> float | None:
    value = parameters.get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(
            "parameter 'timeout' must be a non-negative integer (microseconds)"
        )
    return value / 1e6 if value else None


def select_outputs(
    prediction: Prediction, requested: Sequence[RequestedOutput] | None, default_binary: bool
) -> list[tuple[str, np.ndarray, bool]]:
    """(name, array, binary) for each output to send: all of them, or those requested."""
    outputs = prediction.outputs
    if requested is None:
        return [(name, np.asarray(array), default_binary) for name, array in outputs.items()]
    selected = []
    for output in requested:
        if output.name not in outputs:
            raise InvalidArgumentError(
                f"unknown output {output.name!r}; the model has outputs {sorted(outputs)}"
            )
        binary = default_binary if output.binary is None else output.binary
        selected.append((output.name, np.asarray(outputs[output.name]), binary))
    return selected


def response_parameters(prediction: Prediction) -> dict[str, Any]:
    """Response ``parameters``: the core's extras plus ``fallback_ids`` and ``unknown_ids``."""
    parameters = dict(prediction.parameters)
    parameters[FALLBACK_IDS] = int(prediction.fallback_ids)
    parameters[UNKNOWN_IDS] = int(prediction.unknown_ids)
    return parameters
