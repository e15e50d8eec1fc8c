"""HTTP front end: KServe v2 / Open Inference Protocol REST, plus a friendly JSON route.

Thin by design: a route reads the raw body (size-capped), and one worker-thread call decodes it
with :mod:`serving.http_decode` (orjson + numpy, no per-element pydantic models), calls ONE
:class:`~serving.core.PredictionCore` method and encodes the answer (:mod:`serving.http_encode`),
so neither parsing nor the model ever runs on the event loop. Health, metadata and readiness
answer from the core's in-memory state on the loop itself, never queued behind requests
waiting in the thread pool for their answers. Routes:

* ``GET /v2``, ``GET /v2/health/live``, ``GET /v2/health/ready`` (200 / 400, see
  :data:`HEALTH_FALSE_STATUS`);
* ``GET /v2/models/{name}[/versions/{version}]`` (metadata) and ``.../ready`` (200 / 400;
  404 for an unknown model or version);
* ``POST /v2/models/{name}[/versions/{version}]/infer``: JSON tensors or the binary tensor
  extension, as the KServe v2 REST spec and tritonclient.http speak them;
* ``POST /v1/models/{name}:predict``: ``{"instances": [{"<feature>": value or list}, ...]}``;
* ``POST /admin/reload`` when :class:`~serving.http_admin.AdminHooks` are given.

:class:`~serving.http_fast_path.InferFastPath` answers the two infer routes without FastAPI's
per-request machinery (the server runs it in front of the app); both paths share one handler.

Every error is ``{"error": "<message>"}`` with the status of :func:`http_status_of`; unexpected
exceptions are logged with their traceback and answered 500 with a generic message.
``/metrics`` is not served here: pass ``extra_routes`` or ``app.mount`` it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from typing import Any

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import Receive, Scope, Send

from embedding_store.errors import InvalidArgumentError, PermissionDeniedError
from serving import http_decode, http_encode, infer_request
from serving.core import PredictionCore
from serving.http_admin import AdminHooks, admin_allowed
from serving.http_body import DEFAULT_MAX_DECOMPRESSED_BYTES, read_body
from serving.http_fast_path import (
    ClientGone,
    InferHandler,
    answer_unless_gone,
    client_gone_response,
    refused_by_protocol,
)
from serving.http_openapi import (
    INFER_OPENAPI,
    INFER_RESPONSES,
    METADATA_RESPONSES,
    PREDICT_OPENAPI,
    PREDICT_RESPONSES,
    content,
    errors,
    openapi_without_head,
)
from serving.http_responses import JSON, error_response, json_response, note_request

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


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


#: Bodies up to this size are decoded on the event loop (when the core can be awaited).
SMALL_BODY_BYTES = 64 * 1024


def _version(version: str | None) -> str | None:
    return version or None


def _takes_on_cancel(method: Callable[..., Any]) -> bool:
    return "on_cancel" in inspect.signature(method).parameters


def told_when(gone: ClientGone | None, cancellable: bool) -> dict[str, Any]:
    """The ``on_cancel`` keyword of a core call that ``gone`` tells of the client's
    disconnect (none for a core that does not take it)."""
    return {"on_cancel": gone.add_callback} if gone is not None and cancellable else {}


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

    def rejected(name: str, error: BaseException, receive: Receive | None = None) -> Response:
        """The answer to a prediction request refused before it reached the core, counted
        (unless the HTTP protocol cut it short and counted it: ``receive`` tells). A client
        gone before its body was in (CancelledError) is counted as cancelled, not as a 500."""
        if record_rejected is not None and not (receive and refused_by_protocol(receive)):
            record_rejected("http", name, error)
        if isinstance(error, CancelledError):  # nobody is left to read the answer
            return json_response({"error": str(error)}, 400)
        return error_response(error)

    # Every GET route answers HEAD too (RFC 9110 9.1; probes and load balancers use it). The
    # OpenAPI document lists the GETs only: see openapi_without_head.
    get = functools.partial(app.api_route, methods=["GET", "HEAD"])
    app.openapi = functools.partial(openapi_without_head, app)  # type: ignore[method-assign]

    # ---------------------------------------------------------------- health and metadata
    # The spec's text names this route "v2", and its OpenAPI documents (the OIP's
    # open_inference_rest.yaml, KServe's rest_predict_v2.yaml) "/v2/": a client generated from
    # them asks for "/v2/". Both answer; every other trailing slash stays a 404.
    @get("/v2/", include_in_schema=False)
    @get("/v2", summary="Server metadata", responses=errors())
    async def server_metadata() -> Response:
        try:
            # On the loop, as the health routes: metadata is read from memory, and in the
            # thread pool it queued behind requests waiting there for their answers (8.5 s
            # with 45 friendly requests on a hung shard).
            metadata = core.server_metadata()
            return json_response(http_encode.server_metadata_json(metadata))
        except Exception as error:
            return error_response(error)

    @get("/v2/health/live", summary="Liveness", responses=errors(400))
    async def live() -> Response:
        try:
            if core.live():
                return json_response({"live": True})
            return health_false_response("server is not live")
        except Exception as error:
            return error_response(error)

    @get("/v2/health/ready", summary="Readiness", responses=errors(400))
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
            metadata = core.model_metadata(name, _version(version))  # on the loop: see above
            return json_response(http_encode.model_metadata_json(metadata))
        except Exception as error:
            return error_response(error)

    async def model_ready(name: str, version: str | None) -> Response:
        try:
            # On the loop, as readiness: a probe must not queue behind requests waiting in
            # the thread pool for their answers (a slow embedding tier).
            if core.model_ready(name, _version(version)):
                return json_response({"name": name, "ready": True})
            return health_false_response(f"model {name!r} is not ready")
        except Exception as error:
            return error_response(error)

    @get("/v2/models/{name}", summary="Model metadata", responses=METADATA_RESPONSES)
    async def get_model(name: str) -> Response:
        return await model_metadata(name, None)

    @get(
        "/v2/models/{name}/versions/{version}",
        summary="Model version metadata",
        responses=METADATA_RESPONSES,
    )
    async def get_model_version(name: str, version: str) -> Response:
        return await model_metadata(name, version)

    @get("/v2/models/{name}/ready", summary="Model readiness", responses=errors(400, 404))
    async def get_model_ready(name: str) -> Response:
        return await model_ready(name, None)

    @get(
        "/v2/models/{name}/versions/{version}/ready",
        summary="Model version readiness",
        responses=errors(400, 404),
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
        name: str,
        version: str | None,
        body: bytes,
        header_length: str | None,
        gone: ClientGone | None = None,
    ) -> Response:
        try:
            request = http_decode.decode_http_request(body, header_length)
        except Exception as error:
            return rejected(name, error)
        prediction = core.predict(
            name,
            version,
            request.inputs,
            protocol="http",
            timeout=request.timeout,
            **told_when(gone, predict_cancellable),
        )
        return infer_response(prediction, request)

    # A core that takes on_cancel (PredictionService) drops a request whose client went away
    # before its batch ran (serving.http_fast_path.answer_unless_gone tells it).
    predict_cancellable = _takes_on_cancel(core.predict)
    instances_cancellable = _takes_on_cancel(core.predict_instances)

    # A core that can be awaited (PredictionService) answers small requests without a thread
    # hop: decoding them on the loop costs less than the hop, and no thread waits per request.
    predict_async = getattr(core, "predict_async", None)

    async def infer_body(
        body: bytes,
        header_length: str | None,
        name: str,
        version: str | None,
        gone: ClientGone | None = None,
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
            return await in_thread(infer_sync, name, _version(version), body, header_length, gone)
        except CancelledError:  # the client went away (counted by the core): not a 500
            return client_gone_response()
        except Exception as error:
            return error_response(error)

    async def infer(request: Request, name: str, version: str | None) -> Response:
        try:
            body = await read_body(request, max_body_bytes, max_decompressed_bytes)
        except Exception as error:
            return rejected(name, error, request.receive)
        header_length = ", ".join(request.headers.getlist(http_decode.HEADER_LENGTH)) or None
        return await answer_unless_gone(
            request.receive, lambda gone: infer_body(body, header_length, name, version, gone)
        )

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
        openapi_extra=INFER_OPENAPI,
        responses=INFER_RESPONSES,
    )
    async def post_infer(request: Request, name: str) -> Response:
        return await infer(request, name, None)

    @app.post(
        "/v2/models/{name}/versions/{version}/infer",
        summary="Inference on a model version (KServe v2)",
        openapi_extra=INFER_OPENAPI,
        responses=INFER_RESPONSES,
    )
    async def post_infer_version(request: Request, name: str, version: str) -> Response:
        return await infer(request, name, version)

    def predict_sync(name: str, body: bytes, gone: ClientGone | None = None) -> Response:
        try:
            instances = http_decode.decode_instances(body)
        except Exception as error:
            return rejected(name, error)
        prediction = core.predict_instances(
            name, instances, protocol="http", **told_when(gone, instances_cancellable)
        )
        return Response(http_encode.encode_instances_response(prediction), media_type=JSON)

    async def predict_body(name: str, body: bytes, gone: ClientGone) -> Response:
        try:
            return await in_thread(predict_sync, name, body, gone)
        except CancelledError:  # the client went away (counted by the core): not a 500
            return client_gone_response()
        except Exception as error:
            return error_response(error)

    @app.post(
        "/v1/models/{name}:predict",
        summary="Friendly JSON prediction",
        openapi_extra=PREDICT_OPENAPI,
        responses=PREDICT_RESPONSES,
    )
    async def post_predict(request: Request, name: str) -> Response:
        try:
            body = await read_body(request, max_body_bytes, max_decompressed_bytes)
        except Exception as error:
            return rejected(name, error, request.receive)
        return await answer_unless_gone(
            request.receive, lambda gone: predict_body(name, body, gone)
        )

    # ---------------------------------------------------------------- admin
    if admin is not None:

        @app.post(
            "/admin/reload",
            summary="Reload the model (loopback clients or bearer token)",
            openapi_extra={
                "requestBody": {
                    "required": False,
                    **content(
                        {
                            "type": "object",
                            "properties": {"checkpoint": {"type": ["string", "null"]}},
                        }
                    ),
                }
            },
            responses={200: {"description": "reload result"}, **errors(400, 403, 409)},
        )
        async def reload(request: Request) -> Response:
            try:
                if not admin_allowed(request, admin.token):
                    raise PermissionDeniedError(
                        "admin routes need a loopback client (not a browser page: no Origin "
                        "header) or a valid token"
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
