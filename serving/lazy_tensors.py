"""Lazy {input name: array} mappings for HTTP infer bodies, converted on first touch.

serving/http_decode.py keeps the inputs of a plain JSON body as parsed (:class:`JsonTensors`)
and those of a body whose inputs are all binary as offsets into the body
(:class:`BinaryTensors`), so that serving/fast_batch.py can build the batch from the raw entries
without converting each input; any other use converts every input as the eager decoder does.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from serving.infer_request import array_from_bytes, array_from_json


class LazyTensors(Mapping[str, np.ndarray]):
    """A read-only mapping {input name: array} whose inputs are converted on first touch.

    Any use (``[]``, ``get``, ``in``, ``len``, iteration, ``keys``/``items``/``values``,
    ``==``) first converts every input in request order (:meth:`materialize`, once; the arrays
    are cached) and then behaves exactly like the dict of arrays the eager decoder returned:
    same order, keys and arrays. A malformed tensor therefore raises the eager decoder's first
    error, from that first touch instead of from
    :func:`~serving.http_decode.decode_http_request`.
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


class JsonTensors(LazyTensors):
    """The inputs of a plain JSON infer body, converted to arrays only when first touched.

    It keeps each raw JSON tensor object (``{"name", "datatype", "shape", "data"}`` as orjson
    parsed it) instead of converting it in :func:`~serving.http_decode.decode_http_request`.
    Serving's :func:`serving.fast_batch.batch_from_json` reads the raw objects
    (:attr:`raw_entries`) and builds the batch of 16-27 features in a few numpy calls instead
    of one conversion per input, never touching the mapping itself. Any other use converts
    every input with :func:`~serving.infer_request.array_from_json` (see :class:`LazyTensors`).
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


@dataclass(frozen=True, slots=True)
class BinaryEntry:
    """One input of a binary-extension body: its JSON header object and where its bytes lie."""

    tensor: dict[str, Any]  # {"name", "datatype", "shape", "parameters"} as orjson parsed it
    offset: int  # of its first byte in the body
    size: int  # parameters.binary_data_size


class BinaryTensors(LazyTensors):
    """The inputs of a binary-extension body whose inputs are all binary, converted to arrays
    only when first touched.

    :func:`~serving.http_decode.decode_http_request` has checked the layout (unique names,
    every input with only ``parameters.binary_data_size``, sizes that tile the body after the
    JSON header exactly); each input's datatype, shape and size are checked when it is
    converted (:func:`~serving.infer_request.array_from_bytes`, zero-copy).
    :func:`serving.fast_batch.batch_from_binary` reads :attr:`raw_entries` and :attr:`body` and
    views all single-ID inputs with one ``np.frombuffer`` when they lie side by side. Any other
    use converts every input (see :class:`LazyTensors`).
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
