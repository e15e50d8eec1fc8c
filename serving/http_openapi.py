"""The HTTP front end's OpenAPI document: request, response and error schemas of its routes."""

from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from serving import http_decode, infer_request
from serving.core import KSERVE_DTYPES
from serving.http_responses import JSON

_PARAMETERS_SCHEMA = {"type": "object", "additionalProperties": True}
_TENSOR_SCHEMA = {
    "type": "object",
    "required": ["name", "shape", "datatype"],
    "properties": {
        "name": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "datatype": {"type": "string", "enum": list(KSERVE_DTYPES)},
        "parameters": _PARAMETERS_SCHEMA,
        "data": {"type": "array", "description": "flat or nested, row-major"},
    },
}
_INFER_REQUEST_SCHEMA = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "id": {"type": "string"},
        "parameters": _PARAMETERS_SCHEMA,
        "inputs": {"type": "array", "items": _TENSOR_SCHEMA, "minItems": 1},
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string"}, "parameters": _PARAMETERS_SCHEMA},
            },
        },
    },
}
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}},
}
_METADATA_TENSOR = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "datatype": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}},
    },
}


def content(schema: dict[str, Any], media: str = JSON) -> dict[str, Any]:
    return {"content": {media: {"schema": schema}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {
        status: {"description": "error", **content(_ERROR_SCHEMA)}
        for status in sorted({*statuses, 500})
    }


INFER_OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {
            JSON: {"schema": _INFER_REQUEST_SCHEMA},
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "description": "binary tensor extension: JSON header of "
                f"{http_decode.HEADER_LENGTH} bytes, then the binary_data_size bytes of each "
                "binary input in order",
            },
        },
    }
}
INFER_RESPONSES = {
    200: {
        "description": "inference result (binary outputs follow the JSON header when asked)",
        **content(
            {
                "type": "object",
                "properties": {
                    "model_name": {"type": "string"},
                    "model_version": {"type": "string"},
                    "id": {"type": "string"},
                    "parameters": {
                        "type": "object",
                        "properties": {
                            infer_request.FALLBACK_IDS: {"type": "integer"},
                            infer_request.UNKNOWN_IDS: {"type": "integer"},
                        },
                    },
                    "outputs": {"type": "array", "items": _TENSOR_SCHEMA},
                },
            }
        ),
    },
    **errors(400, 404, 413, 503, 504),
}
PREDICT_OPENAPI = {
    "requestBody": {
        "required": True,
        **content(
            {
                "type": "object",
                "required": ["instances"],
                "properties": {
                    "instances": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": {
                                "oneOf": [
                                    {"type": "number"},
                                    {"type": "array", "items": {"type": "number"}},
                                ]
                            },
                        },
                    }
                },
            }
        ),
    }
}
PREDICT_RESPONSES = {
    200: {
        "description": "one prediction per instance",
        **content(
            {
                "type": "object",
                "properties": {
                    "predictions": {
                        "type": "array",
                        "items": {"type": "array", "items": {"type": "number"}},
                    },
                    "model_name": {"type": "string"},
                    "model_version": {"type": "string"},
                    infer_request.FALLBACK_IDS: {"type": "integer"},
                    infer_request.UNKNOWN_IDS: {"type": "integer"},
                },
            }
        ),
    },
    **errors(400, 404, 413, 503, 504),
}
METADATA_RESPONSES = {
    200: {
        "description": "model metadata",
        **content(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "versions": {"type": "array", "items": {"type": "string"}},
                    "platform": {"type": "string"},
                    "inputs": {"type": "array", "items": _METADATA_TENSOR},
                    "outputs": {"type": "array", "items": _METADATA_TENSOR},
                },
            }
        ),
    },
    **errors(404),
}


# --------------------------------------------------------------------------- the app
def openapi_without_head(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document with the HEAD operations left out: HEAD is GET without a
    body, and FastAPI would give both the same operationId (which OpenAPI forbids)."""
    if app.openapi_schema is None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Duplicate Operation ID")
            schema = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                routes=app.routes,
            )
        for operations in schema.get("paths", {}).values():
            operations.pop("head", None)
        app.openapi_schema = schema
    return app.openapi_schema
