"""TorchServe handler equivalent to recserve's serving path, for benchmarks/peers.py.

It serves a recserve checkpoint the way ``recserve serve`` does, with TorchServe doing the
HTTP, batching (``batchSize`` / ``maxBatchDelay``) and worker processes:

* loads the checkpoint's ``jit_dense.pt`` (the archive's serialized file) and every embedding
  row of ``embeddings/`` (safetensors tensors ``ids`` and ``weights``) into one sorted index
  per embedding dim (``np.searchsorted``; a missing ID gets the zero row, as recserve answers
  IDs it does not hold);
* decodes KServe v2 request bodies, JSON (``{"inputs": [{"name", "shape", "datatype",
  "data"}]}``) or the binary tensor extension (an ``Inference-Header-Content-Length`` request
  header splits the body into that JSON header, whose inputs carry ``parameters:
  {"binary_data_size": n}`` instead of ``data``, and the raw little-endian tensors in input
  order), with the same tensor layout recserve takes (``<slot>`` IDs, ``<slot>.lengths`` for
  jagged slots, FP32 dense inputs), and merges the requests of a TorchServe batch;
* adds each slot's feature prefix to its IDs, sum-pools them per sample (``1/sqrt(n)``
  weights for ``sqrt_scaling`` slots) with ``embedding_bag``, runs the dense model once, applies
  the output transform and answers each request in the format it asked for: a KServe v2 style
  JSON body, or, when the request asks for binary outputs (``outputs: [{"name": "prediction",
  "parameters": {"binary_data": true}}]`` or request parameter ``binary_data_output: true``),
  the binary extension's answer (JSON header with ``binary_data_size``, then the FP32
  little-endian predictions; response header ``Inference-Header-Content-Length``).

A malformed request raises ValueError naming the problem (TorchServe then fails the batch).

``recserve_bundle.json`` (an extra file of the archive, written by benchmarks/peers_servers.py)
holds what the handler needs from the checkpoint's manifests: slot order, prefixes, dims, the
dense inputs, the output transform and the path of the embeddings directory. This file runs
inside TorchServe's Python (its own venv): it imports only torch, numpy and safetensors.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from ts.context import Context  # TorchServe's, in its own venv

    #: One request's ``body`` (or ``data``): the bytes, or the JSON TorchServe parsed.
    RequestBody = bytes | bytearray | str | dict[str, Any]

BUNDLE_FILE = "recserve_bundle.json"
#: Binary tensor extension: byte length of the JSON part of the body (request and response).
HEADER_LENGTH = "Inference-Header-Content-Length"
OUTPUT_NAME = "prediction"
_DTYPES: dict[str, np.dtype] = {
    "INT64": np.dtype(np.int64),
    "UINT64": np.dtype(np.uint64),
    "INT32": np.dtype(np.int32),
    "FP32": np.dtype(np.float32),
}


def request_header(context: Context, index: int, name: str) -> str | None:
    """Request header ``name`` of request ``index``, as sent or lower-cased."""
    for key in (name, name.lower()):
        value = context.get_request_header(index, key)
        if value is not None:
            return value
    return None


def _json_header_size(value: str, body_size: int) -> int:
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{HEADER_LENGTH} must be an integer, got {value!r}") from None
    if not 0 <= size <= body_size:
        raise ValueError(f"{HEADER_LENGTH} is {size} but the request body has {body_size} bytes")
    return size


def wants_binary_output(document: dict) -> bool:
    """Whether the answer must be binary: the ``prediction`` output's ``binary_data`` if the
    request sets it, else the request parameter ``binary_data_output`` (default false)."""
    for output in document.get("outputs") or []:
        if output.get("name") == OUTPUT_NAME:
            flag = (output.get("parameters") or {}).get("binary_data")
            if flag is not None:
                return bool(flag)
    return bool((document.get("parameters") or {}).get("binary_data_output", False))


def decode_request(
    body: RequestBody, header_length: str | None
) -> tuple[dict[str, np.ndarray], bool]:
    """One KServe v2 request -> (named arrays, whether it asks for a binary answer).

    ``body``: the request bytes, or the dict TorchServe already parsed from an
    ``application/json`` body (no binary part then); ``header_length``: the
    ``Inference-Header-Content-Length`` request header (None: a plain JSON request).
    """
    if isinstance(body, str):
        body = body.encode()
    if isinstance(body, dict):
        document, binary = body, memoryview(b"")
    elif header_length is None:
        document, binary = json.loads(body), memoryview(b"")
    else:
        size = _json_header_size(header_length, len(body))
        document, binary = json.loads(body[:size]), memoryview(body)[size:]
    if not isinstance(document, dict) or not isinstance(document.get("inputs"), list):
        raise ValueError('the body must be a KServe v2 request {"inputs": [...]}')
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for tensor in document["inputs"]:
        name, datatype, shape = tensor["name"], tensor["datatype"], tensor["shape"]
        if datatype not in _DTYPES:
            raise ValueError(f"input {name!r}: unsupported datatype {datatype!r}")
        dtype = _DTYPES[datatype]
        nbytes = (tensor.get("parameters") or {}).get("binary_data_size")
        if nbytes is None:
            tensors[name] = np.asarray(tensor["data"], dtype=dtype).reshape(shape)
            continue
        if header_length is None:
            raise ValueError(
                f"input {name!r} has parameters.binary_data_size but the request has no "
                f"{HEADER_LENGTH} header"
            )
        expected = int(np.prod(shape)) * dtype.itemsize
        if nbytes != expected:
            raise ValueError(
                f"input {name!r}: binary_data_size is {nbytes} but shape {shape} of {datatype} "
                f"takes {expected} bytes"
            )
        if offset + nbytes > len(binary):
            raise ValueError(
                f"input {name!r}: binary_data_size {nbytes} runs past the end of the body "
                f"({len(binary) - offset} bytes of binary data left)"
            )
        little = np.frombuffer(binary[offset : offset + nbytes], dtype=dtype.newbyteorder("<"))
        tensors[name] = little.astype(dtype).reshape(shape)  # a native, writable copy
        offset += nbytes
    if offset != len(binary):
        raise ValueError(
            f"{len(binary) - offset} bytes of binary tensor data are not claimed by any input"
        )
    return tensors, wants_binary_output(document)


class RecserveEquivalentHandler:
    def __init__(self) -> None:
        self.initialized = False

    # ------------------------------------------------------------------ loading
    def initialize(self, context: Context) -> None:
        import safetensors.numpy

        torch.set_num_threads(int(os.environ.get("RECSERVE_PEER_TORCH_THREADS", "1")))
        model_dir = context.system_properties["model_dir"]
        with open(os.path.join(model_dir, BUNDLE_FILE)) as handle:
            bundle = json.load(handle)
        serialized = context.manifest["model"]["serializedFile"]
        self.model = torch.jit.load(os.path.join(model_dir, serialized), map_location="cpu")
        self.model.eval()
        self.model_name = bundle["model_name"]
        self.sigmoid = bundle["output_transform"] == "sigmoid"
        self.slots = bundle["id_slots"]
        self.dense_inputs = bundle["dense_inputs"]
        embeddings = bundle["embeddings_dir"]
        with open(os.path.join(embeddings, "embedding_manifest.json")) as handle:
            manifest = json.load(handle)
        parts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        for entry in manifest["files"]:
            tensors = safetensors.numpy.load_file(os.path.join(embeddings, entry["path"]))
            parts.setdefault(int(entry["dim"]), []).append((tensors["ids"], tensors["weights"]))
        self.tables: dict[int, tuple[np.ndarray, torch.Tensor]] = {}
        for dim, chunks in parts.items():
            ids = np.concatenate([c[0] for c in chunks]).astype(np.uint64)
            weights = np.concatenate([c[1] for c in chunks]).astype(np.float32)
            order = np.argsort(ids, kind="stable")
            table = torch.zeros(len(ids) + 1, dim)  # the last row answers unknown IDs
            table[:-1] = torch.from_numpy(weights[order])
            self.tables[dim] = (ids[order], table)
        self.groups: dict[int, list[int]] = {}
        for index, slot in enumerate(self.slots):
            dim = int(slot["dim"])
            if dim not in self.tables:
                self.tables[dim] = (np.zeros(0, np.uint64), torch.zeros(1, dim))
            self.groups.setdefault(dim, []).append(index)
        self.initialized = True

    # ------------------------------------------------------------------ requests
    @staticmethod
    def _body(row: dict[str, Any]) -> RequestBody | None:
        return row.get("body") if row.get("body") is not None else row.get("data")

    def preprocess(
        self, data: list[dict[str, Any]], context: Context
    ) -> tuple[dict[str, np.ndarray], list[int], list[bool]]:
        """Decode every request and concatenate them: (merged tensors, batch size of each,
        whether each asks for a binary answer)."""
        decoded, binary = [], []
        for index, row in enumerate(data):
            body = self._body(row)
            if body is None:
                raise ValueError(f"request {index} has no body")
            tensors, as_binary = decode_request(body, request_header(context, index, HEADER_LENGTH))
            decoded.append(tensors)
            binary.append(as_binary)
        sizes = []
        for tensors in decoded:
            slot = self.slots[0] if self.slots else None
            if slot is None:
                sizes.append(len(tensors[self.dense_inputs[0]["name"]]))
            elif slot["single_id"]:
                sizes.append(len(tensors[slot["name"]]))
            else:
                sizes.append(len(tensors[slot["name"] + ".lengths"]))
        merged = {
            name: np.concatenate([t[name] for t in decoded]) if len(decoded) > 1 else array
            for name, array in decoded[0].items()
        }
        return merged, sizes, binary

    def _pool(self, dim: int, members: list[int], tensors: dict, batch: int) -> torch.Tensor:
        """Sum-pooled embeddings of the slots ``members`` (same dim): [len * batch, dim]."""
        keys, table = self.tables[dim]
        ids_parts, length_parts, weight_parts = [], [], []
        any_sqrt = any(self.slots[i]["sqrt_scaling"] for i in members)
        for i in members:
            slot = self.slots[i]
            raw = tensors[slot["name"]].astype(np.uint64)
            mask, prefix = np.uint64(slot["mask"]), np.uint64(slot["prefix"])
            ids_parts.append((raw & mask) | prefix)
            lengths = (
                np.ones(batch, np.int64)
                if slot["single_id"]
                else tensors[slot["name"] + ".lengths"].astype(np.int64)
            )
            length_parts.append(lengths)
            if any_sqrt:
                per_sample = (
                    1.0 / np.sqrt(np.maximum(lengths, 1))
                    if slot["sqrt_scaling"]
                    else np.ones(batch)
                ).astype(np.float32)
                weight_parts.append(np.repeat(per_sample, lengths))
        ids = np.concatenate(ids_parts)
        lengths = np.concatenate(length_parts)
        if len(keys):
            position = np.minimum(np.searchsorted(keys, ids), len(keys) - 1)
            index = np.where(keys[position] == ids, position, len(keys))
        else:
            index = np.zeros(len(ids), np.int64)
        offsets = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        return torch.nn.functional.embedding_bag(
            torch.from_numpy(index.astype(np.int64)),
            table,
            torch.from_numpy(offsets),
            mode="sum",
            per_sample_weights=torch.from_numpy(np.concatenate(weight_parts)) if any_sqrt else None,
        )

    def inference(self, tensors: dict[str, np.ndarray], batch: int) -> np.ndarray:
        embeddings: list[torch.Tensor | None] = [None] * len(self.slots)
        for dim, members in self.groups.items():
            pooled = self._pool(dim, members, tensors, batch)
            for k, i in enumerate(members):
                embeddings[i] = pooled[k * batch : (k + 1) * batch]
        non_ids = [
            torch.from_numpy(
                np.ascontiguousarray(tensors[d["name"]], dtype=np.float32).reshape(
                    batch, *d["sample_shape"]
                )
            )
            for d in self.dense_inputs
        ]
        with torch.inference_mode():
            output = self.model(non_ids, embeddings)
            if self.sigmoid:
                output = torch.sigmoid(output)
        return output.reshape(batch, -1).numpy()

    def postprocess(
        self, predictions: np.ndarray, sizes: list[int], binary: list[bool], context: Context
    ) -> list[str | bytes]:
        answers: list[str | bytes] = []
        start = 0
        for index, (size, as_binary) in enumerate(zip(sizes, binary)):
            part = predictions[start : start + size]
            start += size
            if as_binary:
                answers.append(self._binary_answer(part, index, context))
                continue
            answers.append(
                json.dumps(
                    {
                        "model_name": self.model_name,
                        "outputs": [
                            {
                                "name": OUTPUT_NAME,
                                "datatype": "FP32",
                                "shape": list(part.shape),
                                "data": part.reshape(-1).tolist(),
                            }
                        ],
                    }
                )
            )
        return answers

    def _binary_answer(self, part: np.ndarray, index: int, context: Context) -> bytes:
        """The binary extension's answer to request ``index``: JSON header + FP32 bytes."""
        payload = np.ascontiguousarray(part, dtype="<f4").tobytes()
        header = json.dumps(
            {
                "model_name": self.model_name,
                "outputs": [
                    {
                        "name": OUTPUT_NAME,
                        "datatype": "FP32",
                        "shape": list(part.shape),
                        "parameters": {"binary_data_size": len(payload)},
                    }
                ],
            }
        ).encode()
        context.set_response_header(index, HEADER_LENGTH, str(len(header)))
        context.set_response_header(index, "content-type", "application/octet-stream")
        return header + payload

    def handle(self, data: list[dict[str, Any]], context: Context) -> list[str | bytes]:
        tensors, sizes, binary = self.preprocess(data, context)
        predictions = self.inference(tensors, sum(sizes))
        return self.postprocess(predictions, sizes, binary, context)


_service = RecserveEquivalentHandler()


def handle(data: list[dict[str, Any]] | None, context: Context) -> list[str | bytes] | None:
    """TorchServe's module-level entry point (``data`` is None at load time)."""
    if not _service.initialized:
        _service.initialize(context)
    if data is None:
        return None
    return _service.handle(data, context)
