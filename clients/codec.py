"""Batches and rows <-> KServe v2 wire messages, and server errors -> recserve errors.

Protocol-only: nothing here talks to a socket, so the sync and async clients share it.

Tensor naming (what the server's model metadata lists):

* ID feature ``<slot>`` with a variable number of IDs per sample: ``<slot>`` UINT64
  [total_ids] and ``<slot>.lengths`` INT64 [batch];
* ID feature with one ID per sample (:class:`IDTypeFeatureWithSingleID`): ``<slot>`` UINT64
  [batch];
* non-ID feature ``<name>``: FP32 [batch, *sample_shape].

Labels are never sent. Over HTTP inputs use the binary tensor extension and binary outputs are
requested; over gRPC inputs go in ``raw_input_contents`` (so outputs come back raw).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import orjson

from clients._proto import V2
from clients.types import ModelInfo, PredictResult, TensorInfo
from embedding_store.batch import Batch, IDTypeFeatureWithSingleID
from embedding_store.errors import (
    InvalidArgumentError,
    RecserveError,
    error_for_grpc_code,
    error_for_http_status,
)

#: Header of the HTTP binary tensor extension: byte length of the JSON part of the body.
HEADER_LENGTH = "Inference-Header-Content-Length"
LENGTHS_SUFFIX = ".lengths"
OUTPUT_NAME = "prediction"
FALLBACK_IDS = "fallback_ids"
UNKNOWN_IDS = "unknown_ids"

_DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(bool),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in _DATATYPES.items()}

#: gRPC typed contents field per datatype (used only when a server answers without raw
#: outputs).
_CONTENTS: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


# --------------------------------------------------------------------------- errors
_F = TypeVar("_F", bound=Callable[..., Any])


def _checked_answer(decode: _F) -> _F:
    """``decode`` whose failures on a malformed answer (a field missing or of another type,
    shapes that do not fit) are a RecserveError saying so, never a bare Python error."""

    @functools.wraps(decode)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return decode(*args, **kwargs)
        except RecserveError:
            raise
        except (
            KeyError,
            TypeError,
            ValueError,
            AttributeError,
            IndexError,
            OverflowError,
        ) as error:
            raise RecserveError(
                f"the server's answer is malformed ({type(error).__name__}: {error})"
            ) from None

    return checked  # type: ignore[return-value]


def http_error(server: str, status: int, body: bytes) -> RecserveError:
    """The recserve error for an HTTP error answer (``{"error": message}`` or any text)."""
    message = ""
    try:
        document = orjson.loads(body)
        if isinstance(document, dict) and isinstance(document.get("error"), str):
            message = document["error"]
    except orjson.JSONDecodeError:
        pass
    if not message:
        message = body[:200].decode("utf-8", errors="replace").strip() or "(no message)"
    return error_for_http_status(status, f"server {server} answered HTTP {status}: {message}")


def grpc_error(server: str, code_name: str, details: str | None) -> RecserveError:
    """The recserve error for a failed gRPC call (status code name and details)."""
    return error_for_grpc_code(
        code_name, f"server {server} answered gRPC {code_name}: {details or '(no details)'}"
    )


# --------------------------------------------------------------------------- tensors
def datatype_of(array: np.ndarray) -> str:
    """KServe v2 datatype name of an array's dtype."""
    dtype = array.dtype if array.dtype.isnative else array.dtype.newbyteorder("=")
    name = _NAMES.get(dtype)
    if name is None:
        raise InvalidArgumentError(
            f"dtype {array.dtype} has no KServe v2 datatype; use one of {', '.join(_DATATYPES)}"
        )
    return name


def _little_endian_bytes(array: np.ndarray) -> bytes:
    if array.dtype == np.bool_:
        return np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    dtype = array.dtype if array.dtype.byteorder in "<|" else array.dtype.newbyteorder("<")
    return np.ascontiguousarray(array, dtype=dtype).tobytes()


def batch_to_tensors(batch: Batch) -> dict[str, np.ndarray]:
    """A :class:`Batch` -> named request tensors (labels are left out)."""
    tensors: dict[str, np.ndarray] = {}
    for feature in batch.id_type_features:
        values = np.ascontiguousarray(feature.values, dtype=np.uint64)
        tensors[feature.name] = values
        if not isinstance(feature, IDTypeFeatureWithSingleID):
            tensors[feature.name + LENGTHS_SUFFIX] = np.ascontiguousarray(
                feature.lengths, dtype=np.int64
            )
    for dense in batch.non_id_type_features:
        data = np.asarray(dense.data)
        if data.dtype != np.float32:
            data = data.astype(np.float32)
        # As the batch holds it: a model trained on [B] data takes [B] (sample shape ()), and
        # a server takes [B] for sample shape (1,) too; [B, 1] fits only the latter.
        # A Batch names every non-ID feature (positional default), so the name is set.
        assert dense.name is not None
        tensors[dense.name] = np.ascontiguousarray(data)
    return tensors


_INT64_MIN, _UINT64_LIMIT, _INT64_LIMIT = -(2**63), 2**64, 2**63


def _integer_range(value: Any) -> tuple[int, int] | None:
    """(min, max) of a (nested) list/tuple whose every leaf is an integer (a bool counts as
    0 or 1, as numpy counts it among integers); (0, 0) when it has no leaf at all (an empty
    ID list); None if any leaf is something else."""
    low = high = None
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, (int, np.integer, np.bool_)):
            number = int(item)
            low = number if low is None or number < low else low
            high = number if high is None or number > high else high
        else:
            return None
    return (0, 0) if low is None or high is None else (low, high)


def as_array(name: str, value: Any) -> np.ndarray:
    """``value`` (an array, or nested lists of numbers) as an array; InvalidArgumentError
    naming the input when it is none (a ragged list, say). Lists of Python integers become
    INT64, or UINT64 when one is >= 2**63 (numpy alone makes FP64 of a mix of those and
    small ones, which the server refuses as IDs), and so do empty lists (an ID feature with
    no IDs in this batch; numpy makes FP64 of those too); a mix of negative integers and
    integers >= 2**63, or one outside both ranges, is refused. Lists of Python floats stay
    FP64: send float32 arrays where the server takes FP32."""
    if isinstance(value, np.ndarray):
        return value
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as error:
        raise InvalidArgumentError(
            f"input {name!r} is not a rectangular array of numbers ({error})"
        ) from None
    if array.dtype.kind not in "fO":
        return array
    bounds = _integer_range(value)
    if bounds is None:
        return array
    low, high = bounds
    if low < _INT64_MIN or high >= _UINT64_LIMIT:
        outside = low if low < _INT64_MIN else high
        raise InvalidArgumentError(
            f"input {name!r}: integer {outside} fits neither INT64 nor UINT64"
        )
    if low < 0 and high >= _INT64_LIMIT:
        raise InvalidArgumentError(
            f"input {name!r} mixes negative integers ({low}) with integers >= 2**63 ({high}): "
            "neither INT64 nor UINT64 holds both"
        )
    dtype = np.uint64 if high >= _INT64_LIMIT else np.int64
    try:
        return np.asarray(value, dtype=dtype)
    except (ValueError, TypeError, OverflowError) as error:
        raise InvalidArgumentError(
            f"input {name!r} is not a rectangular array of numbers ({error})"
        ) from None


def check_tensors(tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Named arrays with KServe v2 datatypes (InvalidArgumentError naming a bad one); values
    that are not arrays go through :func:`as_array`."""
    if not tensors:
        raise InvalidArgumentError("no input tensors to send")
    checked: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"tensor names must be non-empty strings, got {name!r}")
        array = as_array(name, value)
        try:
            datatype_of(array)
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"input {name!r}: {error.message}") from None
        checked[name] = array
    return checked


def _decode_array(name: str, datatype: str, shape: Sequence[int], payload: Any) -> np.ndarray:
    dtype = _DATATYPES.get(datatype)
    if dtype is None:
        raise RecserveError(f"output {name!r} has unsupported datatype {datatype!r}")
    dims = tuple(int(d) for d in shape)
    if isinstance(payload, (bytes, bytearray, memoryview)):
        if len(payload) != math.prod(dims) * dtype.itemsize:
            raise RecserveError(
                f"output {name!r}: {len(payload)} bytes do not hold a {datatype} tensor of "
                f"shape {list(dims)}"
            )
        wire = np.dtype(np.uint8) if dtype == np.bool_ else dtype.newbyteorder("<")
        array = np.frombuffer(payload, dtype=wire).astype(dtype)
    else:
        array = np.asarray(payload, dtype=dtype)
        if array.size != math.prod(dims):
            raise RecserveError(f"output {name!r}: data does not fit shape {list(dims)}")
    return array.reshape(dims)


def _result(
    outputs: Mapping[str, np.ndarray],
    model_name: str,
    model_version: str,
    parameters: Mapping[str, Any],
) -> PredictResult:
    if not outputs:
        raise RecserveError("the server answered without outputs")
    array = outputs[OUTPUT_NAME] if OUTPUT_NAME in outputs else next(iter(outputs.values()))
    predictions = np.asarray(array, dtype=np.float32)
    if predictions.ndim == 1:
        predictions = predictions.reshape(-1, 1)
    return PredictResult(
        predictions=predictions,
        model_name=str(model_name),
        model_version=str(model_version),
        fallback_ids=int(parameters.get(FALLBACK_IDS) or 0),
        unknown_ids=int(parameters.get(UNKNOWN_IDS) or 0),
        parameters=parameters,
    )


def with_latency(result: PredictResult, seconds: float) -> PredictResult:
    return replace(result, latency_seconds=seconds)


# --------------------------------------------------------------------------- HTTP
def encode_http_infer(
    tensors: Mapping[str, np.ndarray], *, timeout: float | None = None
) -> tuple[bytes, dict[str, str]]:
    """An infer body in the binary tensor extension, and its headers. Outputs are requested
    binary. ``timeout`` (seconds) becomes the request's ``timeout`` parameter (microseconds),
    so the server stops working on a request its client gave up on."""
    inputs = []
    blobs = []
    for name, array in tensors.items():
        payload = _little_endian_bytes(array)
        inputs.append(
            {
                "name": name,
                "datatype": datatype_of(array),
                "shape": list(array.shape),
                "parameters": {"binary_data_size": len(payload)},
            }
        )
        blobs.append(payload)
    parameters: dict[str, Any] = {"binary_data_output": True}
    if timeout is not None and timeout > 0:
        parameters["timeout"] = max(1, int(timeout * 1e6))
    header = orjson.dumps({"inputs": inputs, "parameters": parameters})
    headers = {
        "Content-Type": "application/octet-stream",
        HEADER_LENGTH: str(len(header)),
    }
    return b"".join([header, *blobs]), headers


@_checked_answer
def decode_http_infer(body: bytes, header_length: str | None) -> PredictResult:
    """A KServe v2 REST infer answer (JSON, or JSON + binary outputs) -> result."""
    view = memoryview(body)
    size = int(header_length) if header_length is not None else len(body)
    if not 0 <= size <= len(body):
        raise RecserveError(f"bad {HEADER_LENGTH} {header_length!r} in the server's answer")
    document = parse_json(view[:size])
    offset = size
    outputs: dict[str, np.ndarray] = {}
    for entry in document.get("outputs") or ():
        name = entry.get("name", "")
        binary_size = (entry.get("parameters") or {}).get("binary_data_size")
        if binary_size is not None:
            payload = view[offset : offset + int(binary_size)]
            offset += int(binary_size)
        else:
            payload = entry.get("data", [])
        outputs[name] = _decode_array(name, entry.get("datatype", ""), entry["shape"], payload)
    return _result(
        outputs,
        document.get("model_name", ""),
        document.get("model_version", ""),
        document.get("parameters") or {},
    )


#: The friendly route's answers (without a --preprocessor) to rows that are not keyed by
#: feature name, or hold a string where a feature takes IDs or numbers: what raw CSV rows get.
#: An empty cell (``got ''``) is a missing value, no matter of layout.
_NOT_FEATURE_KEYED = re.compile(
    r"unknown feature\(s\)|(?:IDs must be integers|: expected [^']*), got '(?!')"
)


def rows_not_feature_keyed(message: str) -> bool:
    """Whether a server's refusal of friendly rows says they are not rows keyed by feature
    name (a preprocessor's own errors, ``instances could not be preprocessed: ...``, never)."""
    return bool(_NOT_FEATURE_KEYED.search(message)) and (
        "instances could not be preprocessed" not in message
    )


def encode_rows(rows: Sequence[Mapping[str, Any]]) -> bytes:
    """The friendly route's body: ``{"instances": [row, ...]}``."""
    try:
        return orjson.dumps(
            {"instances": list(rows)},
            option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS,
        )
    except TypeError as error:
        raise InvalidArgumentError(f"rows are not JSON-serializable: {error}") from None


@_checked_answer
def decode_rows_response(body: bytes) -> PredictResult:
    """``{"predictions": [[p], ...], "model_version": ..., "fallback_ids": ...}`` -> result."""
    document = parse_json(body)
    predictions = np.asarray(document.get("predictions", []), dtype=np.float32)
    # its fields but the predictions are the answer's parameters (a handful: cheap)
    parameters = {key: value for key, value in document.items() if key != "predictions"}
    return _result(
        {OUTPUT_NAME: predictions},
        document.get("model_name", ""),
        document.get("model_version", ""),
        parameters,
    )


@_checked_answer
def model_info_from_json(document: Mapping[str, Any]) -> ModelInfo:
    def specs(entries: Any) -> tuple[TensorInfo, ...]:
        return tuple(
            TensorInfo(e["name"], e["datatype"], tuple(int(d) for d in e.get("shape", ())))
            for e in entries or ()
        )

    return ModelInfo(
        name=document.get("name", ""),
        versions=tuple(str(v) for v in document.get("versions") or ()),
        platform=document.get("platform", ""),
        inputs=specs(document.get("inputs")),
        outputs=specs(document.get("outputs")),
    )


def parse_json(body: bytes | memoryview) -> dict[str, Any]:
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise RecserveError(f"the server's answer is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise RecserveError("the server's answer is not a JSON object")
    return document


# --------------------------------------------------------------------------- gRPC
def encode_grpc_infer(
    model_name: str, tensors: Mapping[str, np.ndarray], *, model_version: str = ""
) -> Any:
    """A ``ModelInferRequest`` with every input in ``raw_input_contents``."""
    request = V2.ModelInferRequest(model_name=model_name, model_version=model_version)
    for name, array in tensors.items():
        request.inputs.add(name=name, datatype=datatype_of(array), shape=list(array.shape))
        request.raw_input_contents.append(_little_endian_bytes(array))
    return request


def _parameter_value(parameter: Any) -> Any:
    choice = parameter.WhichOneof("parameter_choice")
    return getattr(parameter, choice) if choice else None


@_checked_answer
def decode_grpc_infer(response: Any) -> PredictResult:
    """A ``ModelInferResponse`` (raw or typed outputs) -> result."""
    raw = response.raw_output_contents
    outputs: dict[str, np.ndarray] = {}
    for position, output in enumerate(response.outputs):
        if raw:
            payload: Any = raw[position]
        else:
            field = _CONTENTS.get(output.datatype)
            payload = list(getattr(output.contents, field)) if field else b""
        outputs[output.name] = _decode_array(
            output.name, output.datatype, list(output.shape), payload
        )
    parameters = {key: _parameter_value(value) for key, value in response.parameters.items()}
    return _result(outputs, response.model_name, response.model_version, parameters)


@_checked_answer
def model_info_from_grpc(response: Any) -> ModelInfo:
    def specs(entries: Any) -> tuple[TensorInfo, ...]:
        return tuple(
            TensorInfo(e.name, e.datatype, tuple(int(d) for d in e.shape)) for e in entries
        )

    return ModelInfo(
        name=response.name,
        versions=tuple(response.versions),
        platform=response.platform,
        inputs=specs(response.inputs),
        outputs=specs(response.outputs),
    )
