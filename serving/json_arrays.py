"""Large plain KServe v2 JSON infer bodies, their ``data`` parsed straight into numpy arrays.

orjson makes one Python object per JSON number. A 64-row request for a model of 26 ID slots
and 13 dense features carries ~2,500 numbers, and making those objects, converting them to
arrays and freeing them is most of what decoding such a body costs (~150 us in a tight loop,
more under load; docs/BENCHMARKS.md). simdjson parses the body once and copies each array of
numbers into a buffer (``Array.as_buffer``), with no object per number. On small bodies it
is slower than orjson (every input is navigated from Python, ~2 us each), hence
:data:`LARGE_BODY_BYTES`.

This is only a faster route to what orjson's route gives, never a different answer.
:func:`parse_number_arrays` takes one common kind of body and returns None for anything else,
and the caller then decodes the body with orjson as before. The kind it takes:

- a JSON object whose only key is ``inputs``, a non-empty array of objects;
- each with exactly the keys ``name`` (a string, unique), ``datatype`` (INT64, UINT64 or
  INT32, read as int64; FP32, read as float64 as orjson reads JSON numbers), ``shape`` (an
  array) and ``data`` (a flat array of numbers of that kind);
- no other ``[`` in the body than those of ``inputs`` and of each ``shape`` and ``data``:
  ``as_buffer`` flattens nested arrays, and the general decoder refuses ragged ones;
- no UTF-8 byte order mark (simdjson skips one, orjson refuses it);
- FP32 data below 2**53 in magnitude: numpy converts a list of JSON integers to float32 in
  one rounding, simdjson's doubles would round twice above 2**53.

Integers outside int64, floats in an integer array and bools fail ``as_buffer`` (None).
Shapes are returned as simdjson read them; the batch builder checks them.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

try:
    import simdjson
except ImportError:  # pragma: no cover - pysimdjson is a dependency; without it, orjson only
    simdjson = None  # type: ignore[assignment]  # the optional-import idiom: None = not installed

#: Plain JSON bodies from this size on take :func:`parse_number_arrays`. Measured with the
#: load tests' synthetic model (27 inputs), req/s of one server process under load against
#: orjson's route: 7.7 KB bodies (16 rows) -3 to -11%, 14 KB (32 rows) +4 to +10%, 26 KB
#: (64 rows) +18%.
LARGE_BODY_BYTES = 12 * 1024

_INTEGER_DATATYPES = frozenset(("INT64", "UINT64", "INT32"))
_FLOAT_DATATYPES = frozenset(("FP32",))
_INT64 = np.dtype(np.int64)
_FLOAT64 = np.dtype(np.float64)
_EXACT_FLOAT_LIMIT = float(2**53)
_OPEN_BRACKET = ord("[")
_BYTE_ORDER_MARK = b"\xef\xbb\xbf"
_TENSOR_KEYS = 4  # name, datatype, shape, data
# What simdjson raises on a body it cannot parse or a value of another type than asked for
# (UnicodeDecodeError is a ValueError); RuntimeError if a parser is reused too early.
_PARSE_ERRORS = (ValueError, TypeError, KeyError, IndexError, RuntimeError)

_OBJECT = simdjson.Object if simdjson is not None else None
_ARRAY = simdjson.Array if simdjson is not None else None

_local = threading.local()  # a simdjson.Parser per thread: parsers are not thread-safe


def _parser() -> Any:
    parser = getattr(_local, "parser", None)
    if parser is None:
        parser = _local.parser = simdjson.Parser()
    return parser


def parse_number_arrays(body: bytes) -> dict[str, dict[str, Any]] | None:
    """``{name: {"name", "datatype", "shape", "data"}}`` of a plain JSON infer body, in
    request order, or None unless the body is of the kind the module docstring describes.

    ``data`` is a flat read-only array: int64 [N] for integer datatypes, float64 [N] for
    FP32, N the number of values sent. ``shape`` is a list as sent (not checked here).
    """
    if simdjson is None or body[:3] == _BYTE_ORDER_MARK:
        return None
    try:
        entries = _parse(body)
    except _PARSE_ERRORS:
        # A parser whose document is still referenced refuses to parse again: start afresh.
        _local.parser = None
        return None
    if entries is None:
        return None
    brackets = int(np.count_nonzero(np.frombuffer(body, dtype=np.uint8) == _OPEN_BRACKET))
    if brackets != 1 + 2 * len(entries):
        return None  # a nested array somewhere, or a "[" inside a string
    return entries


def _parse(body: bytes) -> dict[str, dict[str, Any]] | None:
    document = _parser().parse(body)
    if type(document) is not _OBJECT or len(document) != 1:
        return None
    tensors = document["inputs"]  # KeyError: the only key is another one
    if type(tensors) is not _ARRAY or not len(tensors):
        return None
    entries: dict[str, dict[str, Any]] = {}
    integer_names: list[str] = []
    integer_buffers: list[Any] = []
    for tensor in tensors:
        # Four keys, all four found: none is given twice (simdjson keeps duplicates).
        if type(tensor) is not _OBJECT or len(tensor) != _TENSOR_KEYS:
            return None
        name = tensor["name"]
        datatype = tensor["datatype"]
        shape = tensor["shape"]
        values = tensor["data"]
        if type(name) is not str or name in entries or type(datatype) is not str:
            return None
        if type(values) is not _ARRAY or type(shape) is not _ARRAY:
            return None
        entry: dict[str, Any] = {
            "name": name,
            "datatype": datatype,
            "shape": shape.as_list(),
            "data": None,
        }
        entries[name] = entry
        if datatype in _INTEGER_DATATYPES:
            integer_names.append(name)
            integer_buffers.append(values.as_buffer(of_type="i"))
        elif datatype in _FLOAT_DATATYPES:
            data = np.frombuffer(values.as_buffer(of_type="d"), dtype=_FLOAT64)
            if data.size and not (
                data.max() < _EXACT_FLOAT_LIMIT and data.min() > -_EXACT_FLOAT_LIMIT
            ):
                return None
            data.setflags(write=False)
            entry["data"] = data
        else:
            return None
    if integer_buffers:
        # One array for every integer input (a view each): np.frombuffer costs ~0.7 us a
        # call, a slice ~0.1 us. The bytes object it views is our own, hence read-only.
        integers = np.frombuffer(b"".join(integer_buffers), dtype=_INT64)
        start = 0
        for name, buffer in zip(integer_names, integer_buffers):
            end = start + memoryview(buffer).nbytes // _INT64.itemsize
            entries[name]["data"] = integers[start:end]
            start = end
    return entries
