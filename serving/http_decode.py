"""HTTP/JSON request bodies -> :class:`~serving.infer_request.InferRequest` (KServe v2 REST).

JSON bodies are parsed once by orjson (large plain JSON bodies by simdjson, see
serving/json_arrays.py) and each tensor becomes an array in one ``np.asarray`` call; binary
tensors are zero-copy ``np.frombuffer`` views, so decoded arrays may be read-only. Plain JSON
bodies keep their tensors as parsed (:class:`~serving.lazy_tensors.JsonTensors`, converted on
first touch) so that serving/fast_batch.py can build the batch from the raw JSON.

Formats handled:

* JSON tensors ``{"name", "shape", "datatype", "data"}`` with flat or nested ``data``;
* the HTTP binary tensor extension: an ``Inference-Header-Content-Length`` header splits the body
  into the JSON header and binary tensors; inputs carry ``parameters.binary_data_size``; outputs
  are binary when the request asks for it (per output ``parameters.binary_data`` or request-wide
  ``parameters.binary_data_output``), as tritonclient.http does by default. Decoded binary
  headers are cached by their bytes.

Also: request ``Content-Encoding`` (:func:`decode_body`) and the ``{"instances": [...]}`` body
(:func:`decode_instances`). Malformed tensors raise InvalidArgumentError naming the input.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from embedding_store.errors import CapacityError, InvalidArgumentError
from serving.infer_request import (
    SHARED_MEMORY_REGION,
    InferRequest,
    RequestedOutput,
    array_from_bytes,
    array_from_json,
    request_timeout,
    shared_memory_error,
)
from serving.json_arrays import LARGE_BODY_BYTES, parse_number_arrays
from serving.lazy_tensors import BinaryEntry, BinaryTensors, JsonTensors, LazyTensors

#: Header of the HTTP binary tensor extension: byte length of the JSON part of the body.
HEADER_LENGTH = "Inference-Header-Content-Length"


class ArrayJsonTensors(JsonTensors):
    """The inputs of a large plain JSON body whose ``data`` simdjson parsed straight into
    arrays (:func:`serving.json_arrays.parse_number_arrays`): in :attr:`raw_entries` each
    ``data`` is a flat read-only int64 or float64 array instead of a list.

    :func:`serving.fast_batch.batch_from_json` reads the raw entries. Any other use decodes the
    body again with orjson, as :func:`decode_http_request` does a body simdjson does not take,
    and converts every input from that: the same arrays, and the same first error.
    """

    __slots__ = ("_body",)

    def __init__(self, entries: dict[str, dict[str, Any]], body: bytes) -> None:
        super().__init__(entries)
        self._body = body

    def _convert(self) -> dict[str, np.ndarray]:
        inputs = _decode_json_request(self._body, None).inputs
        return inputs.materialize() if isinstance(inputs, LazyTensors) else dict(inputs)


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


def parse_json(body: bytes | memoryview, what: str = "request body") -> Any:
    """orjson-parse a body; InvalidArgumentError naming the problem."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as error:
        if not error.doc:  # orjson could not decode the bytes: "surrogates not allowed" at 0
            try:
                bytes(body).decode("utf-8")
            except UnicodeDecodeError as bad:
                raise InvalidArgumentError(
                    f"{what} is not valid UTF-8: byte {bad.start} is 0x{bad.object[bad.start]:02x} "
                    "(JSON is UTF-8 text)"
                ) from None
        # Python's json.dumps writes NaN and Infinity (allow_nan=True): orjson's "unexpected
        # character" / "no digit after sign" did not say that these words are the fault.
        at = error.doc[error.pos : error.pos + 8] if isinstance(error.doc, str) else ""
        hint = (
            " (NaN and Infinity are not JSON numbers; every value must be finite)"
            if at.startswith(("NaN", "Infinity"))
            else ""
        )
        raise InvalidArgumentError(f"{what} is not valid JSON: {error}{hint}") from None


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


def _header_length(value: object, body_size: int) -> int:
    """The checked header length ``value`` (not None: the caller handles an absent header)."""
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
        if SHARED_MEMORY_REGION in parameters:
            raise shared_memory_error(owner, output=True)
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
    lazy: LazyTensors | None = (
        _plain_json_inputs(raw_inputs)
        if json_size is None
        else _binary_inputs(raw_inputs, body, json_size)
    )
    if lazy is not None:
        try:
            outputs = header.get("outputs")
            if outputs is not None:
                outputs = _requested_outputs_json(outputs)
            timeout = request_timeout(parameters) if parameters else None
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
        parameters_of_input = _parameters_of(tensor, f"input {name!r}")
        size = parameters_of_input.get("binary_data_size")
        if size is None:
            if SHARED_MEMORY_REGION in parameters_of_input:
                raise shared_memory_error(f"input {name!r}", output=False)
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
        timeout=request_timeout(parameters),
    )


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
