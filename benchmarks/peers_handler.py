"""TorchServe handler equivalent to recserve's serving path, for benchmarks/peers.py.

It serves a recserve checkpoint the way ``recserve serve`` does, with TorchServe doing the
HTTP, batching (``batchSize`` / ``maxBatchDelay``) and worker processes:

* loads the checkpoint's ``jit_dense.pt`` (the archive's serialized file) and every embedding
  row of ``embeddings/`` (safetensors tensors ``ids`` and ``weights``) into one sorted index
  per embedding dim (``np.searchsorted``; a missing ID gets the zero row, as recserve answers
  IDs it does not hold);
* decodes KServe v2 JSON request bodies (``{"inputs": [{"name", "shape", "datatype",
  "data"}]}``, the same tensor layout recserve takes: ``<slot>`` IDs, ``<slot>.lengths`` for
  jagged slots, FP32 dense inputs) and merges the requests of a TorchServe batch;
* adds each slot's feature prefix to its IDs, sum-pools them per sample (``1/sqrt(n)``
  weights for ``sqrt_scaling`` slots) with ``embedding_bag``, runs the dense model once, applies
  the output transform and answers each request with a KServe v2 style JSON body.

``recserve_bundle.json`` (an extra file of the archive, written by benchmarks/peers.py) holds
what the handler needs from the checkpoint's manifests: slot order, prefixes, dims, the dense
inputs, the output transform and the path of the embeddings directory. This file runs inside
TorchServe's Python (its own venv): it imports only torch, numpy and safetensors.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

BUNDLE_FILE = "recserve_bundle.json"
_DTYPES = {"INT64": np.int64, "UINT64": np.uint64, "INT32": np.int32, "FP32": np.float32}


class RecserveEquivalentHandler:
    def __init__(self) -> None:
        self.initialized = False

    # ------------------------------------------------------------------ loading
    def initialize(self, context) -> None:
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
    def _document(row) -> dict:
        body = row.get("body") if row.get("body") is not None else row.get("data")
        if isinstance(body, (bytes, bytearray)):
            body = json.loads(body)
        if not isinstance(body, dict) or "inputs" not in body:
            raise ValueError('the body must be a KServe v2 JSON request {"inputs": [...]}')
        return body

    def preprocess(self, data) -> tuple[dict[str, np.ndarray], list[int]]:
        """Decode every request and concatenate them: (merged tensors, batch size of each)."""
        decoded = []
        for row in data:
            tensors = {}
            for tensor in self._document(row)["inputs"]:
                dtype = _DTYPES[tensor["datatype"]]
                tensors[tensor["name"]] = np.asarray(tensor["data"], dtype=dtype).reshape(
                    tensor["shape"]
                )
            decoded.append(tensors)
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
        return merged, sizes

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

    def postprocess(self, predictions: np.ndarray, sizes: list[int]) -> list[str]:
        answers, start = [], 0
        for size in sizes:
            part = predictions[start : start + size]
            start += size
            answers.append(
                json.dumps(
                    {
                        "model_name": self.model_name,
                        "outputs": [
                            {
                                "name": "prediction",
                                "datatype": "FP32",
                                "shape": list(part.shape),
                                "data": part.reshape(-1).tolist(),
                            }
                        ],
                    }
                )
            )
        return answers

    def handle(self, data, context):
        tensors, sizes = self.preprocess(data)
        predictions = self.inference(tensors, sum(sizes))
        return self.postprocess(predictions, sizes)


_service = RecserveEquivalentHandler()


def handle(data, context):
    """TorchServe's module-level entry point (``data`` is None at load time)."""
    if not _service.initialized:
        _service.initialize(context)
    if data is None:
        return None
    return _service.handle(data, context)
