"""KServe v2 (Open Inference Protocol) tensors <-> numpy, shared by the HTTP and gRPC front ends.

Front ends are thin: they turn a request into an :class:`InferRequest` (named numpy arrays plus
request options), call the core once, and turn the :class:`~serving.core.Prediction` back into
the wire format the request used. Everything here is vectorized: JSON bodies are parsed once by
orjson and each tensor becomes an array in one ``np.asarray`` call; binary tensors (the HTTP
binary extension, gRPC ``raw_input_contents``) are zero-copy ``np.frombuffer`` views, so decoded
arrays may be read-only. Plain JSON bodies keep their tensors as parsed (:class:`JsonTensors`,
converted on first touch) so that serving/tensors.py can build the batch from the raw JSON.

Formats handled:

* JSON tensors ``{"name", "shape", "datatype", "data"}`` with flat or nested ``data``;
* the HTTP binary tensor extension: an ``Inference-Header-Content-Length`` header splits the body
  into the JSON header and binary tensors; inputs carry ``parameters.binary_data_size``; outputs
  are binary when the request asks for it (per output ``parameters.binary_data`` or request-wide
  ``parameters.binary_data_output``), as tritonclient.http does by default;
* gRPC typed ``contents`` and ``raw_input_contents`` (little-endian, sizes checked); outputs go
  back as ``raw_output_contents`` when the request used raw inputs, else typed (the protocol
  allows either). tritonclient always sends raw inputs, and reads only raw outputs.

Names are passed through untouched (the core maps them to features, see serving/tensors.py).
BYTES tensors are not supported. Malformed tensors raise InvalidArgumentError naming the input.
"""

from __future__ import annotations

import abc
import math
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from embedding_store.errors import CapacityError, InvalidArgumentError
from serving.core import KSERVE_DTYPES, ModelMetadata, Prediction, ServerMetadata, TensorSpec
from serving.json_arrays import LARGE_BODY_BYTES, parse_number_arrays
from serving.proto import V2

#: Header of the HTTP binary tensor extension: byte length of the JSON part of the body.
HEADER_LENGTH = "Inference-Header-Content-Length"
#: Response parameters every inference answer carries.
FALLBACK_IDS = "fallback_ids"
UNKNOWN_IDS = "unknown_ids"

_MAX_DIMS = 16
_MAX_ELEMENTS = 1 << 40  # bound on the product of the non-zero dimensions
_LITTLE: dict[str, np.dtype] = {n: d.newbyteorder("<") for n, d in KSERVE_DTYPES.items()}
#: The native-byte-order twin of each wire dtype (what decoded arrays hold).
_NATIVE: dict[np.dtype, np.dtype] = {d: d.newbyteorder("=") for d in _LITTLE.values()}
_NAME_OF_DTYPE: dict[np.dtype, str] = {d: n for n, d in KSERVE_DTYPES.items()}
_SUPPORTED = ", ".join(KSERVE_DTYPES)

#: gRPC InferTensorContents field per datatype, and the dtype that field holds on the wire.
_CONTENTS: dict[str, tuple[str, np.dtype]] = {
    "BOOL": ("bool_contents", np.dtype(bool)),
    "INT8": ("int_contents", np.dtype(np.int32)),
    "INT16": ("int_contents", np.dtype(np.int32)),
    "INT32": ("int_contents", np.dtype(np.int32)),
    "INT64": ("int64_contents", np.dtype(np.int64)),
    "UINT8": ("uint_contents", np.dtype(np.uint32)),
    "UINT16": ("uint_contents", np.dtype(np.uint32)),
    "UINT32": ("uint_contents", np.dtype(np.uint32)),
    "UINT64": ("uint64_contents", np.dtype(np.uint64)),
    "FP32": ("fp32_contents", np.dtype(np.float32)),
    "FP64": ("fp64_contents", np.dtype(np.float64)),
}


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


def _count_mismatch(name: str, dims: tuple[int, ...], count: int, what: str) -> str:
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
        raise InvalidArgumentError(
            f"input {name!r}: 'data' is ragged or mixes lists and numbers"
        ) from None
    count = math.prod(dims)
    if values.size != count:
        raise InvalidArgumentError(_count_mismatch(name, dims, values.size, "data"))
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
            raise InvalidArgumentError(
                f"input {name!r}: {datatype} data must be integers within its range"
            )
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
        raise InvalidArgumentError(
            f"input {name!r}: UINT64 data must be integers within its range"
        ) from None
    return exact


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


class _LazyTensors(Mapping[str, np.ndarray]):
    """A read-only mapping {input name: array} whose inputs are converted on first touch.

    Any use (``[]``, ``get``, ``in``, ``len``, iteration, ``keys``/``items``/``values``,
    ``==``) first converts every input in request order (:meth:`materialize`, once; the arrays
    are cached) and then behaves exactly like the dict of arrays the eager decoder returned:
    same order, keys and arrays. A malformed tensor therefore raises the eager decoder's first
    error, from that first touch instead of from :func:`decode_http_request`.
    """

    __slots__ = ("_arrays",)

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] | None = None

    @abc.abstractmethod
    def _convert(self) -> dict[str, np.ndarray]:
        """Every input converted as the eager decoder converts it, in request order."""

    def _converted(self) -> dict[str, np.ndarray]:
        arrays = self._arrays
        if arrays is None:
            arrays = self._arrays = self._convert()
        return arrays

    def materialize(self) -> dict[str, np.ndarray]:
        """A new dict of every input converted, in request order: what the eager decoder
        returned (arrays are shared with this mapping's cache). The first malformed tensor
        (in request order) raises, as in the eager decoder."""
        return dict(self._converted())

    def __getitem__(self, name: str) -> np.ndarray:
        return self._converted()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._converted())

    def __len__(self) -> int:
        return len(self._converted())

    def __contains__(self, name: object) -> bool:
        return name in self._converted()


class JsonTensors(_LazyTensors):
    """The inputs of a plain JSON infer body, converted to arrays only when first touched.

    It keeps each raw JSON tensor object (``{"name", "datatype", "shape", "data"}`` as orjson
    parsed it) instead of converting it in :func:`decode_http_request`. Serving's
    :func:`serving.tensors.tensors_to_batch` reads the raw objects (:attr:`raw_entries`) and
    builds the batch of 16-27 features in a few numpy calls instead of one conversion per
    input, never touching the mapping itself. Any other use converts every input with
    :func:`array_from_json` (see :class:`_LazyTensors`).
    """

    __slots__ = ("_entries",)

    def __init__(self, entries: dict[str, dict[str, Any]]) -> None:
        """``entries``: {name: raw JSON tensor object} in request order, names unique, each
        object a dict holding ``"data"``. Taken over, not copied: the caller must not modify
        it (nor the objects)."""
        super().__init__()
        self._entries = entries

    @property
    def raw_entries(self) -> Mapping[str, dict[str, Any]]:
        """{name: raw JSON tensor object}, in request order. Read it, never modify it."""
        return self._entries

    def _convert(self) -> dict[str, np.ndarray]:
        return {
            name: array_from_json(name, tensor.get("datatype"), tensor.get("shape"), tensor["data"])
            for name, tensor in self._entries.items()
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self._entries)})"


class ArrayJsonTensors(JsonTensors):
    """The inputs of a large plain JSON body whose ``data`` simdjson parsed straight into
    arrays (:func:`serving.json_arrays.parse_number_arrays`): in :attr:`raw_entries` each
    ``data`` is a flat read-only int64 or float64 array instead of a list.

    :func:`serving.tensors.tensors_to_batch` reads the raw entries. Any other use decodes the
    body again with orjson, as :func:`decode_http_request` does a body simdjson does not take,
    and converts every input from that: the same arrays, and the same first error.
    """

    __slots__ = ("_body",)

    def __init__(self, entries: dict[str, dict[str, Any]], body: bytes) -> None:
        super().__init__(entries)
        self._body = body

    def _convert(self) -> dict[str, np.ndarray]:
        inputs = _decode_json_request(self._body, None).inputs
        return inputs.materialize() if isinstance(inputs, _LazyTensors) else dict(inputs)


@dataclass(frozen=True, slots=True)
class BinaryEntry:
    """One input of a binary-extension body: its JSON header object and where its bytes lie."""

    tensor: dict[str, Any]  # {"name", "datatype", "shape", "parameters"} as orjson parsed it
    offset: int  # of its first byte in the body
    size: int  # parameters.binary_data_size


class BinaryTensors(_LazyTensors):
    """The inputs of a binary-extension body whose inputs are all binary, converted to arrays
    only when first touched.

    :func:`decode_http_request` has checked the layout (unique names, every input with only
    ``parameters.binary_data_size``, sizes that tile the body after the JSON header exactly);
    each input's datatype, shape and size are checked when it is converted
    (:func:`array_from_bytes`, zero-copy). :func:`serving.tensors.tensors_to_batch` reads
    :attr:`raw_entries` and :attr:`body` and views all single-ID inputs with one
    ``np.frombuffer`` when they lie side by side. Any other use converts every input (see
    :class:`_LazyTensors`).
    """

    __slots__ = ("_body", "_entries")

    def __init__(self, entries: Mapping[str, BinaryEntry], body: bytes) -> None:
        super().__init__()
        self._entries = entries
        self._body = body

    @property
    def raw_entries(self) -> Mapping[str, BinaryEntry]:
        """{name: BinaryEntry}, in request order. Read it, never modify it."""
        return self._entries

    @property
    def body(self) -> bytes:
        """The whole request body (JSON header, then the tensors' bytes)."""
        return self._body

    def _convert(self) -> dict[str, np.ndarray]:
        view = memoryview(self._body)
        return {
            name: array_from_bytes(
                name,
                entry.tensor.get("datatype"),
                entry.tensor.get("shape"),
                view[entry.offset : entry.offset + entry.size],
                "binary_data_size",
            )
            for name, entry in self._entries.items()
        }

    def __repr__(self) -> str:
        return f"BinaryTensors({list(self._entries)})"


def _plain_json_inputs(raw_inputs: list[Any]) -> JsonTensors | None:
    """The inputs of a body without binary tensors as :class:`JsonTensors`, or None unless
    every input is a JSON object with a str ``name`` (unique), ``data`` and no ``parameters``
    (then the eager loop of :func:`decode_http_request` runs and raises what it always did)."""
    entries: dict[str, dict[str, Any]] = {}
    for tensor in raw_inputs:
        # Exact types: orjson builds dict and str; anything else takes the eager loop.
        if type(tensor) is not dict or "data" not in tensor or "parameters" in tensor:
            return None
        name = tensor.get("name")
        if type(name) is not str:
            return None
        entries[name] = tensor
    if len(entries) != len(raw_inputs):
        return None  # a name given twice
    return JsonTensors(entries)


def _binary_inputs(raw_inputs: list[Any], body: bytes, json_size: int) -> BinaryTensors | None:
    """The inputs of a binary-extension body as :class:`BinaryTensors`, or None unless every
    input is a JSON object with a str ``name`` (unique), no ``data`` and ``parameters`` holding
    only an int ``binary_data_size`` >= 0, and the sizes tile the bytes after the JSON header
    exactly (then the eager loop of :func:`decode_http_request` runs and raises what it always
    did)."""
    entries: dict[str, BinaryEntry] = {}
    offset = json_size
    for tensor in raw_inputs:
        # Exact types: orjson builds dict, str and int; anything else takes the eager loop.
        if type(tensor) is not dict or "data" in tensor:
            return None
        name = tensor.get("name")
        parameters = tensor.get("parameters")
        if type(name) is not str or type(parameters) is not dict or len(parameters) != 1:
            return None
        size = parameters.get("binary_data_size")
        if type(size) is not int or size < 0:
            return None
        entries[name] = BinaryEntry(tensor, offset, size)
        offset += size
    if len(entries) != len(raw_inputs) or offset != len(body):
        return None  # a name given twice, bytes past the tensors, or tensors past the end
    return BinaryTensors(entries, body)


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


def _little_endian_bytes(array: np.ndarray) -> bytes:
    dtype = array.dtype if array.dtype.byteorder in "<|" else array.dtype.newbyteorder("<")
    return np.ascontiguousarray(array, dtype=dtype).tobytes()


def _request_timeout(parameters: Mapping[str, Any]) -> float | None:
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


# --------------------------------------------------------------------------- JSON / HTTP
def parse_json(body: bytes | memoryview, what: str = "request body") -> Any:
    """orjson-parse a body; InvalidArgumentError naming the problem."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise InvalidArgumentError(f"{what} is not valid JSON: {error}") from None


def decode_body(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """Undo a request ``Content-Encoding`` (gzip, deflate or identity), at most ``max_bytes``."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("identity", ""):
        return body
    if encoding not in ("gzip", "deflate"):
        raise InvalidArgumentError(
            f"unsupported Content-Encoding {encoding[:40]!r}; use gzip, deflate or identity"
        )
    decompressor = zlib.decompressobj(zlib.MAX_WBITS | (16 if encoding == "gzip" else 0))
    try:
        plain = decompressor.decompress(body, max_bytes + 1)
    except zlib.error as error:
        raise InvalidArgumentError(f"request body is not valid {encoding} data: {error}") from None
    if len(plain) > max_bytes:
        raise CapacityError(f"decompressed request body exceeds {max_bytes} bytes")
    if not decompressor.eof:
        raise InvalidArgumentError(f"request body is truncated {encoding} data")
    if decompressor.unused_data:  # junk, or a second gzip member, that would be dropped
        raise InvalidArgumentError(
            f"request body has {len(decompressor.unused_data)} byte(s) after the end of its "
            f"{encoding} data"
        )
    return plain


def _header_length(value: object, body_size: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):  # a caller's own number
        length = value
    else:
        # A header's text: ASCII digits only, as Content-Length (int() would also take
        # "+12", "1_2" and " 12 ").
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        if not isinstance(text, str) or not text.isascii() or not text.isdigit():
            if isinstance(text, str) and "," in text:
                raise InvalidArgumentError(
                    f"{HEADER_LENGTH} must be sent once, got {text!r} (it was repeated)"
                )
            raise InvalidArgumentError(f"{HEADER_LENGTH} must be an integer, got {value!r}")
        length = int(text)
    if not 0 <= length <= body_size:
        raise InvalidArgumentError(
            f"{HEADER_LENGTH} is {length} but the request body has {body_size} bytes"
        )
    return length


def _parameters_of(entry: Mapping[str, Any], owner: str) -> dict[str, Any]:
    parameters = entry.get("parameters")
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise InvalidArgumentError(
            f"{owner}: 'parameters' must be an object, got {_json_kind(parameters)}"
        )
    return parameters


def _bool_parameter(parameters: Mapping[str, Any], key: str, owner: str) -> bool | None:
    value = parameters.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidArgumentError(
            f"{owner}: parameter {key!r} must be true or false, got {_json_kind(value)}"
        )
    return value


def _requested_outputs_json(outputs: object) -> tuple[RequestedOutput, ...] | None:
    if outputs is None:
        return None
    if not isinstance(outputs, list):
        raise InvalidArgumentError(
            f"'outputs' must be a list of {{\"name\": ...}} objects, got {_json_kind(outputs)}"
        )
    if not outputs:
        return None  # none named: every output, as gRPC reads an empty list
    requested: list[RequestedOutput] = []
    seen: set[str] = set()
    for position, output in enumerate(outputs):
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise InvalidArgumentError(
                f"outputs[{position}] must be an object with a string 'name', got "
                f"{_entry_kind(output)}"
            )
        name = output["name"]
        owner = f"output {name!r}"
        if name in seen:
            raise InvalidArgumentError(f"{owner} is requested twice")
        seen.add(name)
        parameters = _parameters_of(output, owner)
        if parameters.get("classification"):
            raise InvalidArgumentError(f"{owner}: the classification extension is not supported")
        requested.append(RequestedOutput(name, _bool_parameter(parameters, "binary_data", owner)))
    return tuple(requested)


@dataclass(frozen=True, slots=True)
class _BinaryHeader:
    """What one binary-extension JSON header decoded to (inputs all binary, see
    :func:`_binary_inputs`): the same header bytes decode the same way, for a body of
    ``body_size`` bytes. Shared by every request that sends these bytes: read, never modify."""

    body_size: int
    entries: Mapping[str, BinaryEntry]
    id: str
    parameters: dict[str, Any]
    outputs: tuple[RequestedOutput, ...] | None
    binary_output: bool
    timeout: float | None

    def request(self, body: bytes) -> InferRequest:
        return InferRequest(
            inputs=BinaryTensors(self.entries, body),
            id=self.id,
            parameters=self.parameters,
            outputs=self.outputs,
            binary_output=self.binary_output,
            timeout=self.timeout,
        )


#: Decoded binary-extension headers by their bytes. A client sends the same header for every
#: request of one batch size (names, shapes, datatypes, sizes; no per-request ``id``), and
#: parsing and checking it costs ~50 us for 27 inputs against ~3.5 us for a lookup. Bounded:
#: cleared when full; headers over BINARY_HEADER_CACHE_MAX_BYTES are not kept.
_binary_headers: dict[bytes, _BinaryHeader] = {}
BINARY_HEADER_CACHE_SIZE = 256
BINARY_HEADER_CACHE_MAX_BYTES = 16 * 1024


def _remember_binary_header(
    key: bytes, request: InferRequest, inputs: BinaryTensors, body_size: int
) -> None:
    if len(_binary_headers) >= BINARY_HEADER_CACHE_SIZE:
        _binary_headers.clear()  # no LRU bookkeeping per request; refilled by the next ones
    _binary_headers[key] = _BinaryHeader(
        body_size,
        inputs.raw_entries,
        request.id,
        request.parameters or {},
        request.outputs,
        request.binary_output,
        request.timeout,
    )


def decode_http_request(body: bytes, header_length: object = None) -> InferRequest:
    """A KServe v2 REST infer body (JSON, or JSON + binary tensors) -> :class:`InferRequest`.

    ``header_length`` is the ``Inference-Header-Content-Length`` header value, if any.

    A plain JSON body (no binary tensors; every input an object with a unique ``name``,
    ``data`` and no ``parameters``) gets its inputs as a lazy :class:`JsonTensors`, a body whose
    inputs are all binary as a lazy :class:`BinaryTensors`: a malformed tensor then raises when
    it is looked up, not here. Every other body is decoded eagerly into a dict of arrays. A
    binary header decoded before (the same bytes, the same body size) is not parsed again.
    """
    if header_length is None:
        return _decode_http_request(body, None)
    json_size = _header_length(header_length, len(body))
    if json_size > BINARY_HEADER_CACHE_MAX_BYTES:
        return _decode_http_request(body, json_size)
    key = bytes(memoryview(body)[:json_size])
    known = _binary_headers.get(key)
    if known is not None and known.body_size == len(body):
        return known.request(body)
    request = _decode_http_request(body, json_size)
    if isinstance(request.inputs, BinaryTensors):
        _remember_binary_header(key, request, request.inputs, len(body))
    return request


def _decode_http_request(body: bytes, json_size: int | None) -> InferRequest:
    """:func:`decode_http_request` once the header length (``json_size``) is checked."""
    if json_size is None and len(body) >= LARGE_BODY_BYTES:
        entries = parse_number_arrays(body)
        if entries is not None:  # {"inputs": [...]} only: what orjson's route gives it
            return InferRequest(inputs=ArrayJsonTensors(entries, body), parameters={})
    return _decode_json_request(body, json_size)


def _refuse_bools_in_numbers(raw_inputs: list[Any]) -> None:
    """InvalidArgumentError for true/false in the ``data`` of a numeric input: numpy (and
    every fast path) would read them as 1 and 0, while KServe v2 keeps JSON booleans for
    BOOL tensors."""
    for tensor in raw_inputs:
        if type(tensor) is not dict or tensor.get("datatype") == "BOOL":
            continue
        pending = [tensor.get("data")]
        while pending:
            items = pending.pop()
            if type(items) is not list:
                continue
            types = set(map(type, items))
            if bool in types:
                raise InvalidArgumentError(
                    f"input {_quoted_name(tensor.get('name'))}: {tensor.get('datatype')} data "
                    "must be numbers, got true/false"
                )
            if list in types:
                pending.extend(item for item in items if type(item) is list)


def _quoted_name(name: object) -> str:
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."


def _json_kind(value: object) -> str:
    """The JSON type of a decoded value, for error messages (never the value itself)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {_quoted_name(value)}"
    if isinstance(value, str):
        return f"the string {_quoted_name(value)}"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _entry_kind(entry: object) -> str:
    """What an ``inputs[i]`` / ``outputs[i]`` entry that lacks a string 'name' was."""
    if not isinstance(entry, dict):
        return _json_kind(entry)
    if "name" not in entry:
        return "an object without 'name'"
    return f"an object whose 'name' is {_json_kind(entry['name'])}"


def _decode_json_request(body: bytes, json_size: int | None) -> InferRequest:
    """:func:`_decode_http_request` with orjson: every kind of body."""
    view = memoryview(body)
    if json_size is None:
        try:
            header = parse_json(body)
        except InvalidArgumentError as error:
            if b"binary_data_size" in body and "unexpected content after document" in str(error):
                # The common mistake: a binary body sent without its header length.
                raise InvalidArgumentError(
                    f"{error.message}; the body looks like the binary tensor extension (a "
                    f"JSON header, then raw bytes): send the {HEADER_LENGTH} header with the "
                    "JSON header's length in bytes"
                ) from None
            raise
    elif json_size == len(body):
        header = parse_json(body)
    else:
        header = parse_json(
            view[:json_size],
            f"the request's JSON header (its first {HEADER_LENGTH}: {json_size} bytes)",
        )
    if not isinstance(header, dict):
        raise InvalidArgumentError(
            f"request body must be a JSON object with 'inputs', got {_json_kind(header)}"
        )
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgumentError(f"'id' must be a string, got {_json_kind(request_id)}")
    parameters = _parameters_of(header, "request")
    binary_output = bool(_bool_parameter(parameters, "binary_data_output", "request"))
    raw_inputs = header.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidArgumentError(
            f"'inputs' must be a non-empty list of tensors, got {_json_kind(raw_inputs)}"
        )
    end = len(body) if json_size is None else json_size
    if body.find(b"true", 0, end) >= 0 or body.find(b"false", 0, end) >= 0:
        _refuse_bools_in_numbers(raw_inputs)  # rare: only a body with a literal looks
    lazy: _LazyTensors | None = (
        _plain_json_inputs(raw_inputs)
        if json_size is None
        else _binary_inputs(raw_inputs, body, json_size)
    )
    if lazy is not None:
        try:
            outputs = header.get("outputs")
            if outputs is not None:
                outputs = _requested_outputs_json(outputs)
            timeout = _request_timeout(parameters) if parameters else None
        except InvalidArgumentError:
            # The eager decoder converted every input before reading these: its error first.
            lazy.materialize()
            raise
        return InferRequest(
            inputs=lazy,
            id=request_id,
            parameters=parameters,
            outputs=outputs,
            binary_output=binary_output,
            timeout=timeout,
        )
    offset = json_size if json_size is not None else len(body)
    inputs: dict[str, np.ndarray] = {}
    for position, tensor in enumerate(raw_inputs):
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise InvalidArgumentError(
                f"inputs[{position}] must be an object with a string 'name', got "
                f"{_entry_kind(tensor)}"
            )
        name = tensor["name"]
        if name in inputs:
            raise InvalidArgumentError(f"input {name!r} is given twice")
        size = _parameters_of(tensor, f"input {name!r}").get("binary_data_size")
        if size is None:
            if "data" not in tensor:
                raise InvalidArgumentError(
                    f"input {name!r} has neither 'data' nor parameters.binary_data_size"
                )
            inputs[name] = array_from_json(
                name, tensor.get("datatype"), tensor.get("shape"), tensor["data"]
            )
            continue
        if "data" in tensor:
            raise InvalidArgumentError(
                f"input {name!r} has both 'data' and parameters.binary_data_size; send one"
            )
        if json_size is None:
            raise InvalidArgumentError(
                f"input {name!r} has parameters.binary_data_size but the request has no "
                f"{HEADER_LENGTH} header"
            )
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidArgumentError(
                f"input {name!r}: binary_data_size must be a non-negative integer, got "
                f"{_json_kind(size)}"
            )
        if offset + size > len(body):
            raise InvalidArgumentError(
                f"input {name!r}: binary_data_size {size} runs past the end of the body "
                f"({len(body) - offset} bytes left)"
            )
        inputs[name] = array_from_bytes(
            name,
            tensor.get("datatype"),
            tensor.get("shape"),
            view[offset : offset + size],
            "binary_data_size",
        )
        offset += size
    if offset != len(body):
        raise InvalidArgumentError(
            f"{len(body) - offset} bytes of binary tensor data are not claimed by any input"
        )
    return InferRequest(
        inputs=inputs,
        id=request_id,
        parameters=parameters,
        outputs=_requested_outputs_json(header.get("outputs")),
        binary_output=binary_output,
        timeout=_request_timeout(parameters),
    )


def encode_http_response(prediction: Prediction, request: InferRequest) -> tuple[bytes, int | None]:
    """The REST infer answer: (body, JSON header length when binary outputs follow it)."""
    outputs_json: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, array, binary in select_outputs(prediction, request.outputs, request.binary_output):
        entry: dict[str, Any] = {
            "name": name,
            "datatype": datatype_of(array),
            "shape": list(array.shape),
        }
        if binary:
            payload = _little_endian_bytes(array)
            entry["parameters"] = {"binary_data_size": len(payload)}
            blobs.append(payload)
        else:
            flat = np.ascontiguousarray(array).reshape(-1)
            if flat.dtype == np.float16:
                flat = flat.astype(np.float32)
            entry["data"] = (
                flat if flat.dtype.isnative else flat.astype(flat.dtype.newbyteorder("="))
            )
        outputs_json.append(entry)
    response: dict[str, Any] = {
        "model_name": prediction.model_name,
        "model_version": prediction.model_version,
    }
    if request.id:
        response["id"] = request.id
    response["parameters"] = response_parameters(prediction)
    response["outputs"] = outputs_json
    header = orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def decode_instances(body: bytes) -> list[dict[str, Any]]:
    """``{"instances": [{"<feature>": value or list, ...}, ...]}`` -> the instances."""
    document = parse_json(body)
    instances = document.get("instances") if isinstance(document, dict) else None
    if not isinstance(instances, list) or not instances:
        raise InvalidArgumentError('request body must be {"instances": [{...}, ...]}')
    for position, instance in enumerate(instances):
        if not isinstance(instance, dict):
            raise InvalidArgumentError(
                f"instances[{position}] must be an object mapping feature names to values"
            )
    return instances


def encode_instances_response(prediction: Prediction) -> bytes:
    """``{"predictions": [[p], ...], "model_version", "fallback_ids", "unknown_ids"}``."""
    outputs = prediction.outputs
    name = "prediction" if "prediction" in outputs else next(iter(outputs))
    predictions = np.ascontiguousarray(outputs[name])
    if predictions.dtype == np.float16:
        predictions = predictions.astype(np.float32)
    return orjson.dumps(
        {
            "predictions": predictions,
            "model_name": prediction.model_name,
            "model_version": prediction.model_version,
            FALLBACK_IDS: int(prediction.fallback_ids),
            UNKNOWN_IDS: int(prediction.unknown_ids),
        },
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


def _tensor_json(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


def model_metadata_json(metadata: ModelMetadata) -> dict[str, Any]:
    """``GET /v2/models/{name}`` body, per the spec."""
    return {
        "name": metadata.name,
        "versions": list(metadata.versions),
        "platform": metadata.platform,
        "inputs": [_tensor_json(spec) for spec in metadata.inputs],
        "outputs": [_tensor_json(spec) for spec in metadata.outputs],
    }


def server_metadata_json(metadata: ServerMetadata) -> dict[str, Any]:
    """``GET /v2`` body, per the spec."""
    return {
        "name": metadata.name,
        "version": metadata.version,
        "extensions": list(metadata.extensions),
    }


# --------------------------------------------------------------------------- gRPC
def parameter_value(parameter: Any) -> Any:
    """An InferParameter -> its Python value (None when unset)."""
    choice = parameter.WhichOneof("parameter_choice")
    return getattr(parameter, choice) if choice else None


def set_parameter(parameter: Any, value: Any) -> None:
    """Python value -> InferParameter (bool, int64/uint64, double, or string)."""
    if isinstance(value, (bool, np.bool_)):
        parameter.bool_param = bool(value)
    elif isinstance(value, (int, np.integer)):
        value = int(value)
        if value > np.iinfo(np.int64).max:
            parameter.uint64_param = value
        else:
            parameter.int64_param = value
    elif isinstance(value, (float, np.floating)):
        parameter.double_param = float(value)
    else:
        parameter.string_param = str(value)


def _grpc_tensor(name: str, tensor: Any) -> np.ndarray:
    dtype = dtype_of(name, tensor.datatype)
    dims = shape_of(name, list(tensor.shape))
    datatype = tensor.datatype
    if datatype not in _CONTENTS:
        # FP16 and the like have no typed contents field. Say in the same answer what the
        # inputs take, or the caller learns it one round trip later.
        raise InvalidArgumentError(
            f"input {name!r}: {datatype} tensors must be sent in raw_input_contents (and "
            "recserve models take IDs as INT64 or UINT64, lengths as INT32 or INT64, dense "
            "features as FP32)"
        )
    field, wire_dtype = _CONTENTS[datatype]
    values = getattr(tensor.contents, field)
    count = math.prod(dims)
    if len(values) != count:
        present = [descriptor.name for descriptor, _ in tensor.contents.ListFields()]
        if present and field not in present:
            raise InvalidArgumentError(
                f"input {name!r}: datatype {datatype} takes contents.{field}, got "
                f"contents.{present[0]}"
            )
        raise InvalidArgumentError(_count_mismatch(name, dims, len(values), f"contents.{field}"))
    fields = tensor.contents.ListFields()
    if len(fields) > 1:
        # A second typed field is data the caller meant to send: never drop it silently.
        others = sorted(descriptor.name for descriptor, _ in fields if descriptor.name != field)
        raise InvalidArgumentError(
            f"input {name!r}: datatype {datatype} takes contents.{field} only, but "
            f"{', '.join('contents.' + other for other in others)} is also set"
        )
    array = np.fromiter(values, dtype=wire_dtype, count=count)
    if wire_dtype != dtype.newbyteorder("="):
        if count:
            info = np.iinfo(dtype)
            low, high = int(array.min()), int(array.max())
            if low < info.min or high > info.max:
                bad = low if low < info.min else high
                raise InvalidArgumentError(
                    f"input {name!r}: value {bad} is out of range for {datatype}"
                )
        array = array.astype(dtype.newbyteorder("="))
    return array.reshape(dims)


def decode_grpc_request(request: Any) -> InferRequest:
    """A ``ModelInferRequest`` (typed contents or raw_input_contents) -> :class:`InferRequest`."""
    raw = request.raw_input_contents
    if not request.inputs:
        raise InvalidArgumentError("the request has no inputs")
    if raw and len(raw) != len(request.inputs):
        raise InvalidArgumentError(
            f"raw_input_contents has {len(raw)} entries but the request has "
            f"{len(request.inputs)} inputs"
        )
    inputs: dict[str, np.ndarray] = {}
    for position, tensor in enumerate(request.inputs):
        name = tensor.name
        if name in inputs:
            raise InvalidArgumentError(f"input {name!r} is given twice")
        if raw:
            if tensor.HasField("contents"):
                raise InvalidArgumentError(
                    f"input {name!r}: contents must be empty when raw_input_contents is used"
                )
            inputs[name] = array_from_bytes(
                name,
                tensor.datatype,
                list(tensor.shape),
                raw[position],
                f"raw_input_contents[{position}]",
            )
        else:
            inputs[name] = _grpc_tensor(name, tensor)
    parameters = {key: parameter_value(value) for key, value in request.parameters.items()}
    outputs = None
    if request.outputs:
        names = [output.name for output in request.outputs]
        if len(set(names)) != len(names):
            twice = next(name for position, name in enumerate(names) if name in names[:position])
            # As over HTTP: name the output.
            raise InvalidArgumentError(f"output {twice!r} is requested twice")
        for output in request.outputs:
            # As over HTTP: a classification client must not get raw scores unannounced.
            classification = output.parameters.get("classification")
            if classification is not None and parameter_value(classification):
                raise InvalidArgumentError(
                    f"output {output.name!r}: the classification extension is not supported"
                )
        outputs = tuple(RequestedOutput(name) for name in names)
    return InferRequest(
        inputs=inputs,
        id=request.id,
        parameters=parameters,
        outputs=outputs,
        raw=bool(raw),
        timeout=_request_timeout(parameters),
    )


def encode_grpc_response(prediction: Prediction, request: InferRequest) -> Any:
    """:class:`Prediction` -> ``ModelInferResponse`` (raw outputs iff the request was raw;
    FP16 outputs force raw, since typed contents have no field for them)."""
    selected = select_outputs(prediction, request.outputs, False)
    datatypes = [datatype_of(array) for _, array, _ in selected]
    raw = request.raw or any(datatype not in _CONTENTS for datatype in datatypes)
    response = V2.ModelInferResponse(
        model_name=prediction.model_name, model_version=prediction.model_version, id=request.id
    )
    for key, value in response_parameters(prediction).items():
        set_parameter(response.parameters[key], value)
    for (name, array, _), datatype in zip(selected, datatypes):
        output = response.outputs.add(name=name, datatype=datatype, shape=array.shape)
        if raw:
            response.raw_output_contents.append(_little_endian_bytes(array))
        else:
            field, _ = _CONTENTS[datatype]
            getattr(output.contents, field).extend(array.reshape(-1).tolist())
    return response


def model_metadata_message(metadata: ModelMetadata) -> Any:
    """:class:`ModelMetadata` -> ``ModelMetadataResponse``."""
    response = V2.ModelMetadataResponse(
        name=metadata.name, versions=list(metadata.versions), platform=metadata.platform
    )
    for specs, field in ((metadata.inputs, response.inputs), (metadata.outputs, response.outputs)):
        for spec in specs:
            field.add(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))
    return response


def server_metadata_message(metadata: ServerMetadata) -> Any:
    """:class:`ServerMetadata` -> ``ServerMetadataResponse``."""
    return V2.ServerMetadataResponse(
        name=metadata.name, version=metadata.version, extensions=list(metadata.extensions)
    )
