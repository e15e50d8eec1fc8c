"""Predictions and metadata -> KServe v2 REST (HTTP/JSON) response bodies.

Infer answers are JSON (orjson, numpy arrays serialized directly), with binary outputs after
the JSON header when the request asked for them (the HTTP binary tensor extension, see
serving/http_decode.py); also the ``{"predictions": [...]}`` answer of the instances route and
the ``GET /v2`` and ``GET /v2/models/{name}`` metadata bodies.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from serving.core import ModelMetadata, Prediction, ServerMetadata, TensorSpec
from serving.infer_request import (
    FALLBACK_IDS,
    UNKNOWN_IDS,
    InferRequest,
    datatype_of,
    little_endian_bytes,
    response_parameters,
    select_outputs,
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
            payload = little_endian_bytes(array)
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
