"""HTTP front end: KServe v2 / Open Inference Protocol REST, plus a friendly JSON route.

Thin by design: a route reads the raw body (size-capped), and one worker-thread call decodes it
with :mod:`serving.http_decode` (orjson + numpy, no per-element pydantic models), calls ONE
:class:`~serving.core.PredictionCore` method and encodes the answer (:mod:`serving.http_encode`),
so neither parsing nor the model ever runs on the event loop. Routes:

* ``GET /v2``, ``GET /v2/health/live``, ``GET /v2/health/ready`` (200 / 400, see
  :data:`HEALTH_FALSE_STATUS`);
* ``GET /v2/models/{name}[/versions/{version}]`` (metadata) and ``.../ready`` (200 / 400;
  404 for an unknown model or version);
* ``POST /v2/models/{name}[/versions/{version}]/infer``: JSON tensors or the binary tensor
  extension, as the KServe v2 REST spec and tritonclient.http speak them;
* ``POST /v1/models/{name}:predict``: ``{"instances": [{"<feature>": value or list}, ...]}``;
* ``POST /admin/reload`` when :class:`AdminHooks` are given.

:class:`InferFastPath` answers the two infer routes without FastAPI's per-request machinery
(the server runs it in front of the app); both paths share one handler.

Every error is ``{"error": "<message>"}`` with the status of :func:`http_status_of`; unexpected
exceptions are logged with their traceback and answered 500 with a generic message.
``/metrics`` is not served here: pass ``extra_routes`` or ``app.mount`` it.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import logging
import re
import warnings
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import CancelledError
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import Receive, Scope, Send

from embedding_store.errors import (
    CapacityError,
    InvalidArgumentError,
    PermissionDeniedError,
    RecserveError,
    http_status_of,
    public_message_of,
)
from serving import http_decode, http_encode, infer_request
from serving.core import KSERVE_DTYPES, PredictionCore

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
JSON = "application/json"


@dataclass(frozen=True)
class AdminHooks:
    """Admin callbacks. ``reload(checkpoint)`` gets the body's ``"checkpoint"`` (or None) and
    returns a JSON-able dict. Allowed with ``Authorization: Bearer <token>`` (when ``token`` is
    set), or from a loopback client that sends no Authorization header; 403 otherwise."""

    reload: Callable[[str | None], dict]
    token: str | None = None


# --------------------------------------------------------------------------- responses
def json_response(content: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type=JSON)


#: ``(method, path)`` of the HTTP request this task answers, for the log line of an
#: unexpected error (set per request: every request runs in a task, with a context, of its own).
_CURRENT_REQUEST: ContextVar[tuple[str, str]] = ContextVar("recserve_http_request")


def note_request(method: str, path: str) -> None:
    """Note the request the current task answers, for :func:`error_response`'s log line
    (each request runs in a task, with a context, of its own)."""
    _CURRENT_REQUEST.set((method, path))


def error_response(error: BaseException) -> Response:
    """``{"error": message}`` with the error's HTTP status; tracebacks only go to the log,
    whose line names the request this task answers (:func:`note_request`)."""
    status = http_status_of(error)
    if not isinstance(error, RecserveError):
        method, path = _CURRENT_REQUEST.get(("?", "?"))
        log.error("%s %r failed", method, path, exc_info=error)
    return json_response({"error": public_message_of(error)}, status)


class _App(FastAPI):
    """FastAPI that notes each HTTP request for :func:`error_response`'s log line."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            note_request(scope["method"], scope["path"])
        await super().__call__(scope, receive, send)


#: Linux's PATH_MAX: a longer checkpoint path is refused before the loader sees it.
_MAX_PATH = 4096


#: What a health route answers for "false" (not live, not ready). The KServe v2 REST spec: "A
#: 200 status code indicates true and a 4xx status code indicates false"; Triton answers 400.
#: This is the protocol's encoding of a boolean, not an error, so it does not go through the
#: error table: work refused while draining or overloaded stays 503 (UnavailableError).
HEALTH_FALSE_STATUS = 400


def health_false_response(message: str) -> Response:
    """``{"error": message}`` with :data:`HEALTH_FALSE_STATUS`."""
    return json_response({"error": message}, HEALTH_FALSE_STATUS)


def _routing_error(status: int, message: str) -> Response:
    """An HTTP-level answer of the router (404 no such route, 405 method): no recserve error
    stands behind it, so the status is the router's."""
    return json_response({"error": message}, status)


# --------------------------------------------------------------------------- OpenAPI
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


def _content(schema: dict[str, Any], media: str = JSON) -> dict[str, Any]:
    return {"content": {media: {"schema": schema}}}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {
        status: {"description": "error", **_content(_ERROR_SCHEMA)}
        for status in sorted({*statuses, 500})
    }


_INFER_OPENAPI = {
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
_INFER_RESPONSES = {
    200: {
        "description": "inference result (binary outputs follow the JSON header when asked)",
        **_content(
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
    **_errors(400, 404, 413, 503, 504),
}
_PREDICT_OPENAPI = {
    "requestBody": {
        "required": True,
        **_content(
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
_PREDICT_RESPONSES = {
    200: {
        "description": "one prediction per instance",
        **_content(
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
    **_errors(400, 404, 413, 503, 504),
}
_METADATA_RESPONSES = {
    200: {
        "description": "model metadata",
        **_content(
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
    **_errors(404),
}


#: Bodies up to this size are decoded on the event loop (when the core can be awaited).
SMALL_BODY_BYTES = 64 * 1024


# --------------------------------------------------------------------------- helpers
async def read_body(
    request: Request, max_bytes: int, max_decompressed_bytes: int | None = None
) -> bytes:
    """The request body, at most ``max_bytes`` (CapacityError -> 413), content-decoded."""
    return await read_chunks(
        request.stream(),
        request.headers.get("content-length"),
        request.headers.get("content-encoding"),
        max_bytes,
        max_decompressed_bytes,
    )


async def read_chunks(
    chunks: AsyncIterator[bytes],
    declared_length: str | None,
    content_encoding: str | None,
    max_bytes: int,
    max_decompressed_bytes: int | None = None,
) -> bytes:
    """Join a body's ``chunks``, at most ``max_bytes`` (CapacityError -> 413), then undo its
    ``content_encoding``, to at most ``max_bytes`` and ``max_decompressed_bytes`` (default
    :data:`DEFAULT_MAX_DECOMPRESSED_BYTES`). A ``declared_length`` over the limit is refused
    before reading; one that is not ASCII digits (str.isdigit() also takes "²", which int()
    refuses, and other scripts' digits) declares nothing: the body is counted as it streams."""
    declared = (
        int(declared_length)
        if declared_length and declared_length.isascii() and declared_length.isdigit()
        else None
    )
    if declared is not None and declared > max_bytes:
        raise CapacityError(f"request body of {declared} bytes exceeds the limit of {max_bytes}")
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise CapacityError(f"request body exceeds the limit of {max_bytes} bytes")
        parts.append(chunk)
    body = parts[0] if len(parts) == 1 else b"".join(parts)
    if (content_encoding or "identity").strip().lower() in ("identity", ""):
        return body
    inflated_limit = min(max_bytes, max_decompressed_bytes or DEFAULT_MAX_DECOMPRESSED_BYTES)
    # A few KB of gzip can inflate to megabytes: never on the event loop (zlib works
    # without the GIL), and two at a time, so that bombs cannot hold more than two inflated
    # bodies at once. They wait for their turn on the loop, not in a thread: waiting threads
    # would take the pool's tokens from every other route.
    return await anyio.to_thread.run_sync(
        http_decode.decode_body,
        body,
        content_encoding,
        inflated_limit,
        limiter=_inflating_limiter(),
    )


#: Largest request body once its Content-Encoding is undone (--max-decompressed-bytes).
DEFAULT_MAX_DECOMPRESSED_BYTES = 8 * 1024 * 1024
_INFLATING_AT_ONCE = 2
_INFLATING: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = (
    weakref.WeakKeyDictionary()
)


def _inflating_limiter() -> anyio.CapacityLimiter:
    """This event loop's limiter of concurrent inflations (anyio limiters belong to a loop)."""
    loop = asyncio.get_running_loop()
    limiter = _INFLATING.get(loop)
    if limiter is None:
        limiter = _INFLATING[loop] = anyio.CapacityLimiter(_INFLATING_AT_ONCE)
    return limiter


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host == "localhost"
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def admin_allowed(request: Request, token: str | None) -> bool:
    """Bearer token when one is sent (it must match), else only loopback clients."""
    authorization = request.headers.get("authorization")
    if authorization is not None:
        scheme, _, credential = authorization.partition(" ")
        return (
            token is not None
            and scheme.lower() == "bearer"
            and hmac.compare_digest(credential.strip().encode(), token.encode())
        )
    return _is_loopback(request.client.host if request.client else None)


def _version(version: str | None) -> str | None:
    return version or None


# --------------------------------------------------------------------------- the app
def _openapi_without_head(app: FastAPI) -> dict[str, Any]:
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


def create_app(
    core: PredictionCore,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES,
    admin: AdminHooks | None = None,
    extra_routes: Sequence[BaseRoute] = (),
    title: str = "recserve",
) -> FastAPI:
    """The FastAPI app of the serving front end over ``core``."""
    app = _App(
        title=title,
        summary="KServe v2 / Open Inference Protocol front end of recserve",
        default_response_class=Response,
        # A trailing slash is another path: 404 {"error"}, not a 307 with an empty body to a
        # Location built from the Host header.
        redirect_slashes=False,
    )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, error: StarletteHTTPException) -> Response:
        response = _routing_error(error.status_code, str(error.detail))
        if error.headers:  # a 405's Allow (RFC 9110)
            response.headers.update(error.headers)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, error: RequestValidationError) -> Response:
        return error_response(InvalidArgumentError(f"invalid request: {error.errors()}"))

    async def in_thread(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(functools.partial(function, *args, **kwargs))

    # A core that counts requests refused before they reach it (PredictionService) is told
    # of bodies that could not be read or decoded.
    record_rejected = getattr(core, "record_rejected", None)

    def rejected(name: str, error: BaseException) -> Response:
        """The answer to a prediction request refused before it reached the core, counted."""
        if record_rejected is not None:
            record_rejected("http", name, error)
        return error_response(error)

    # Every GET route answers HEAD too (RFC 9110 9.1; probes and load balancers use it). The
    # OpenAPI document lists the GETs only: see _openapi_without_head.
    get = functools.partial(app.api_route, methods=["GET", "HEAD"])
    app.openapi = functools.partial(_openapi_without_head, app)  # type: ignore[method-assign]

    # ---------------------------------------------------------------- health and metadata
    @get("/v2", summary="Server metadata", responses=_errors())
    async def server_metadata() -> Response:
        try:
            metadata = await in_thread(core.server_metadata)
            return json_response(http_encode.server_metadata_json(metadata))
        except Exception as error:
            return error_response(error)

    @get("/v2/health/live", summary="Liveness", responses=_errors(400))
    async def live() -> Response:
        try:
            if core.live():
                return json_response({"live": True})
            return health_false_response("server is not live")
        except Exception as error:
            return error_response(error)

    @get("/v2/health/ready", summary="Readiness", responses=_errors(400))
    async def ready() -> Response:
        try:
            # On the loop: probes must not queue behind work in the thread pool.
            if core.ready():
                return json_response({"ready": True})
            return health_false_response("server is not ready")
        except Exception as error:
            return error_response(error)

    async def model_metadata(name: str, version: str | None) -> Response:
        try:
            metadata = await in_thread(core.model_metadata, name, _version(version))
            return json_response(http_encode.model_metadata_json(metadata))
        except Exception as error:
            return error_response(error)

    async def model_ready(name: str, version: str | None) -> Response:
        try:
            if await in_thread(core.model_ready, name, _version(version)):
                return json_response({"name": name, "ready": True})
            return health_false_response(f"model {name!r} is not ready")
        except Exception as error:
            return error_response(error)

    @get("/v2/models/{name}", summary="Model metadata", responses=_METADATA_RESPONSES)
    async def get_model(name: str) -> Response:
        return await model_metadata(name, None)

    @get(
        "/v2/models/{name}/versions/{version}",
        summary="Model version metadata",
        responses=_METADATA_RESPONSES,
    )
    async def get_model_version(name: str, version: str) -> Response:
        return await model_metadata(name, version)

    @get("/v2/models/{name}/ready", summary="Model readiness", responses=_errors(400, 404))
    async def get_model_ready(name: str) -> Response:
        return await model_ready(name, None)

    @get(
        "/v2/models/{name}/versions/{version}/ready",
        summary="Model version readiness",
        responses=_errors(400, 404),
    )
    async def get_model_version_ready(name: str, version: str) -> Response:
        return await model_ready(name, version)

    # ---------------------------------------------------------------- inference
    def infer_response(prediction: Any, request: infer_request.InferRequest) -> Response:
        payload, json_size = http_encode.encode_http_response(prediction, request)
        if json_size is None:
            return Response(payload, media_type=JSON)
        return Response(
            payload,
            media_type="application/octet-stream",
            headers={http_decode.HEADER_LENGTH: str(json_size)},
        )

    def infer_sync(
        name: str, version: str | None, body: bytes, header_length: str | None
    ) -> Response:
        try:
            request = http_decode.decode_http_request(body, header_length)
        except Exception as error:
            return rejected(name, error)
        prediction = core.predict(
            name, version, request.inputs, protocol="http", timeout=request.timeout
        )
        return infer_response(prediction, request)

    # A core that can be awaited (PredictionService) answers small requests without a thread
    # hop: decoding them on the loop costs less than the hop, and no thread waits per request.
    predict_async = getattr(core, "predict_async", None)

    async def infer_body(
        body: bytes, header_length: str | None, name: str, version: str | None
    ) -> Response:
        try:
            if predict_async is not None and len(body) <= SMALL_BODY_BYTES:
                try:
                    decoded = http_decode.decode_http_request(body, header_length)
                except Exception as error:
                    return rejected(name, error)
                prediction = await predict_async(
                    name,
                    _version(version),
                    decoded.inputs,
                    protocol="http",
                    timeout=decoded.timeout,
                )
                return infer_response(prediction, decoded)
            return await in_thread(infer_sync, name, _version(version), body, header_length)
        except Exception as error:
            return error_response(error)

    async def infer(request: Request, name: str, version: str | None) -> Response:
        try:
            body = await read_body(request, max_body_bytes, max_decompressed_bytes)
        except Exception as error:
            return rejected(name, error)
        header_length = ", ".join(request.headers.getlist(http_decode.HEADER_LENGTH)) or None
        return await infer_body(body, header_length, name, version)

    # The same handler without FastAPI's routing and request objects (see InferFastPath).
    app.state.infer_handler = InferHandler(
        infer_body,
        max_body_bytes,
        max_decompressed_bytes,
        record_rejected=None
        if record_rejected is None
        else functools.partial(record_rejected, "http"),
    )

    @app.post(
        "/v2/models/{name}/infer",
        summary="Inference (KServe v2)",
        openapi_extra=_INFER_OPENAPI,
        responses=_INFER_RESPONSES,
    )
    async def post_infer(request: Request, name: str) -> Response:
        return await infer(request, name, None)

    @app.post(
        "/v2/models/{name}/versions/{version}/infer",
        summary="Inference on a model version (KServe v2)",
        openapi_extra=_INFER_OPENAPI,
        responses=_INFER_RESPONSES,
    )
    async def post_infer_version(request: Request, name: str, version: str) -> Response:
        return await infer(request, name, version)

    def predict_sync(name: str, body: bytes) -> Response:
        try:
            instances = http_decode.decode_instances(body)
        except Exception as error:
            return rejected(name, error)
        prediction = core.predict_instances(name, instances, protocol="http")
        return Response(http_encode.encode_instances_response(prediction), media_type=JSON)

    @app.post(
        "/v1/models/{name}:predict",
        summary="Friendly JSON prediction",
        openapi_extra=_PREDICT_OPENAPI,
        responses=_PREDICT_RESPONSES,
    )
    async def post_predict(request: Request, name: str) -> Response:
        try:
            body = await read_body(request, max_body_bytes, max_decompressed_bytes)
        except Exception as error:
            return rejected(name, error)
        try:
            return await in_thread(predict_sync, name, body)
        except Exception as error:
            return error_response(error)

    # ---------------------------------------------------------------- admin
    if admin is not None:

        @app.post(
            "/admin/reload",
            summary="Reload the model (loopback clients or bearer token)",
            openapi_extra={
                "requestBody": {
                    "required": False,
                    **_content(
                        {
                            "type": "object",
                            "properties": {"checkpoint": {"type": ["string", "null"]}},
                        }
                    ),
                }
            },
            responses={200: {"description": "reload result"}, **_errors(400, 403, 409)},
        )
        async def reload(request: Request) -> Response:
            try:
                if not admin_allowed(request, admin.token):
                    raise PermissionDeniedError(
                        "admin routes need a loopback client or a valid token"
                    )
                body = await read_body(request, 1024 * 1024)
                checkpoint = None
                if body.strip():
                    document = http_decode.parse_json(body)
                    if not isinstance(document, dict):
                        raise InvalidArgumentError('body must be {"checkpoint": "<path>"}')
                    checkpoint = document.get("checkpoint")
                    if checkpoint is not None and not isinstance(checkpoint, str):
                        raise InvalidArgumentError(
                            "'checkpoint' must be a string or null, got a JSON "
                            f"{type(checkpoint).__name__}"
                        )
                    if checkpoint is not None and (
                        not checkpoint or "\0" in checkpoint or len(checkpoint) > _MAX_PATH
                    ):
                        raise InvalidArgumentError(
                            f"'checkpoint' must be a path of 1 to {_MAX_PATH} characters "
                            "with no NUL"
                        )
                result = await in_thread(admin.reload, checkpoint)
                return json_response(result)
            except Exception as error:
                return error_response(error)

    app.router.routes.extend(extra_routes)
    return app


# --------------------------------------------------------------------------- fast path
@dataclass(frozen=True)
class InferHandler:
    """What the infer routes do after reading the body: ``handle(body, header_length, name,
    version) -> Response`` (never raises: errors become their ``{"error": ...}`` answers).
    ``record_rejected(name, error)``, when given, counts a request for model ``name`` refused
    before ``handle`` (its body or head could not be read, or was too large) as the core
    counts the requests it refuses."""

    handle: Callable[[bytes, str | None, str, str | None], Awaitable[Response]]
    max_body_bytes: int
    max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES
    record_rejected: Callable[[str, BaseException], None] | None = None


_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")


class InferFastPath:
    """ASGI app that answers ``POST /v2/models/{name}[/versions/{version}]/infer`` itself and
    hands every other request to ``app`` (the FastAPI app of :func:`create_app`).

    Same handler, same answers as the FastAPI routes, minus their per-request machinery
    (middleware stack, route matching over every route, ``Request`` objects, dependency
    solving): at batch 1 that machinery was about half of the event loop's time, so this
    path is the one the server runs. ``app`` keeps the routes for OpenAPI and for anyone who
    mounts it without this wrapper.
    """

    def __init__(self, app: FastAPI) -> None:
        handler = getattr(app.state, "infer_handler", None)
        if not isinstance(handler, InferHandler):
            raise TypeError("InferFastPath wraps an app built by serving.http_app.create_app")
        self.app = app
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            match = _INFER_PATH.fullmatch(scope["path"])
            if match is not None:
                note_request("POST", scope["path"])
                response = await self._infer(scope, receive, match[1], match[2])
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _infer(
        self, scope: Scope, receive: Receive, name: str, version: str | None
    ) -> Response:
        headers: dict[bytes, bytes] = {}
        for key, value in scope["headers"]:
            if key in (b"content-length", b"content-encoding", _HEADER_LENGTH_KEY):
                # Repeated: combined as RFC 9110 does (h11 and httptools refuse a repeated
                # Content-Length themselves; a repeated header length is refused by the codec).
                headers[key] = value if key not in headers else headers[key] + b", " + value

        async def chunks() -> AsyncIterator[bytes]:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise CancelledError("the client disconnected before sending its body")
                yield message.get("body", b"")
                if not message.get("more_body", False):
                    return

        def header(key: bytes) -> str | None:
            value = headers.get(key)
            return None if value is None else value.decode("latin-1")

        try:
            body = await read_chunks(
                chunks(),
                header(b"content-length"),
                header(b"content-encoding"),
                self.handler.max_body_bytes,
                self.handler.max_decompressed_bytes,
            )
        except CancelledError as gone:
            # Nobody is left to answer. Counted as cancelled, unless the HTTP layer cut the
            # request short itself (a 408) and counted it already (it marks the cycle, whose
            # method ``receive`` is).
            counted = getattr(getattr(receive, "__self__", None), REFUSED_MARK, False)
            if self.handler.record_rejected is not None and not counted:
                self.handler.record_rejected(name, gone)
            return json_response({"error": str(gone)}, 400)
        except Exception as error:
            if self.handler.record_rejected is not None:
                self.handler.record_rejected(name, error)
            return error_response(error)
        return await self.handler.handle(body, header(_HEADER_LENGTH_KEY), name, version)


_HEADER_LENGTH_KEY = http_decode.HEADER_LENGTH.lower().encode("latin-1")

#: Set (True) by the HTTP protocol on a request's ASGI cycle when it cut the request short
#: and counted it (serving.http_protocol): the app then does not count it a second time.
REFUSED_MARK = "recserve_refused"
