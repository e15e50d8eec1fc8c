"""gRPC front end: the KServe v2 / Open Inference Protocol ``inference.GRPCInferenceService``.

:class:`InferenceServicer` is thin: it decodes a request with :mod:`serving.grpc_codec`, calls
ONE :class:`~serving.core.PredictionCore` method and encodes the answer. Errors abort the call
with the status code of :func:`grpc_code_name_of` and the public message only (bad input ->
INVALID_ARGUMENT, unknown model -> NOT_FOUND, not ready / overloaded -> UNAVAILABLE, anything
unexpected -> INTERNAL with its traceback in the log).

Messages come from :data:`serving.proto.V2` (a private descriptor pool), so this server can share
a process with ``tritonclient.grpc``. :func:`build_grpc_server` also registers the standard
health service (overall ``""`` and ``inference.GRPCInferenceService``) and server reflection.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from embedding_store.errors import NotFoundError, UnavailableError
from embedding_store.grpc_common import (
    add_health_servicer,
    on_prompt_threads,
    parse_request,
    prompt_thread_pool,
    rpc_errors,
    server_options,
)
from serving import grpc_codec
from serving.core import PredictionCore
from serving.proto import SERVICE_NAME, V2

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

#: Methods that answer at once from the core's state (never waiting for a prediction): run
#: on the server's prompt threads (embedding_store.grpc_common.on_prompt_threads).
_PROMPT_METHODS = frozenset(
    ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata")
)

#: (method, request class, response class) of the service, in spec order.
_METHODS = (
    ("ServerLive", V2.ServerLiveRequest, V2.ServerLiveResponse),
    ("ServerReady", V2.ServerReadyRequest, V2.ServerReadyResponse),
    ("ModelReady", V2.ModelReadyRequest, V2.ModelReadyResponse),
    ("ServerMetadata", V2.ServerMetadataRequest, V2.ServerMetadataResponse),
    ("ModelMetadata", V2.ModelMetadataRequest, V2.ModelMetadataResponse),
    ("ModelInfer", V2.ModelInferRequest, V2.ModelInferResponse),
)


def _min_timeout(*timeouts: float | None) -> float | None:
    present = [t for t in timeouts if t is not None]
    return min(present) if present else None


#: gRPC reports a call without a deadline as one ~1e10 s away; beyond this there is none.
_NO_DEADLINE_SECONDS = 365 * 24 * 3600.0


def _time_remaining(context: grpc.ServicerContext) -> float | None:
    """Seconds left of the client's deadline, or None when it set none (the server default
    applies then, as over HTTP)."""
    remaining = context.time_remaining()
    if remaining is None or remaining > _NO_DEADLINE_SECONDS:
        return None
    return remaining


class InferenceServicer:
    """``inference.GRPCInferenceService`` over a :class:`PredictionCore` (thread-safe)."""

    def __init__(self, core: PredictionCore) -> None:
        self._core = core
        # Optional parts of a core (PredictionService has both): counting requests refused
        # here, and being told when a call ends before its answer.
        self._record_rejected = getattr(core, "record_rejected", None)
        self._cancellable = "on_cancel" in inspect.signature(core.predict).parameters

    @rpc_errors
    def ServerLive(self, request: Any, context: grpc.ServicerContext) -> Any:
        return V2.ServerLiveResponse(live=bool(self._core.live()))

    @rpc_errors
    def ServerReady(self, request: Any, context: grpc.ServicerContext) -> Any:
        return V2.ServerReadyResponse(ready=bool(self._core.ready()))

    @rpc_errors
    def ModelReady(self, request: Any, context: grpc.ServicerContext) -> Any:
        # A model or version this server does not serve is not ready (ready=false), as over
        # HTTP (404, a "false" there) and in Triton: tritonclient.grpc.is_model_ready()
        # then answers False instead of raising.
        try:
            ready = self._core.model_ready(request.name, request.version or None)
        except NotFoundError:
            ready = False
        return V2.ModelReadyResponse(ready=bool(ready))

    @rpc_errors
    def ServerMetadata(self, request: Any, context: grpc.ServicerContext) -> Any:
        return grpc_codec.server_metadata_message(self._core.server_metadata())

    @rpc_errors
    def ModelMetadata(self, request: Any, context: grpc.ServicerContext) -> Any:
        metadata = self._core.model_metadata(request.name, request.version or None)
        return grpc_codec.model_metadata_message(metadata)

    @rpc_errors
    def ModelInfer(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            decoded = grpc_codec.decode_grpc_request(request)
        except Exception as error:  # never reached the core: counted there all the same
            if self._record_rejected is not None:
                self._record_rejected("grpc", request.model_name, error)
            raise
        timeout = _min_timeout(_time_remaining(context), decoded.timeout)
        # A call cancelled by its client (or past its deadline) drops its queued work.
        cancel = {"on_cancel": context.add_callback} if self._cancellable else {}
        try:
            prediction = self._core.predict(
                request.model_name,
                request.model_version or None,
                decoded.inputs,
                protocol="grpc",
                timeout=timeout,
                **cancel,
            )
        except futures.CancelledError:
            # The call is over (the core counted it as cancelled): gRPC sends nothing more.
            return V2.ModelInferResponse()
        return grpc_codec.encode_grpc_response(prediction, decoded)

    def method_handlers(
        self, prompt_pool: futures.ThreadPoolExecutor | None = None
    ) -> dict[str, grpc.RpcMethodHandler]:
        """The unary handlers of the service, keyed by method name. Requests are parsed in
        the handler, not by gRPC's deserializer: a malformed message is then INVALID_ARGUMENT
        naming it, where a failing deserializer makes gRPC answer INTERNAL. With
        ``prompt_pool``, liveness, readiness and metadata calls (:data:`_PROMPT_METHODS`) run there,
        not queued behind ModelInfer calls waiting for their answers."""
        handlers = {}
        for name, request_class, response_class in _METHODS:
            behavior = _parsed(getattr(self, name), request_class, self._malformed_hook(name))
            if prompt_pool is not None and name in _PROMPT_METHODS:
                behavior = on_prompt_threads(behavior, prompt_pool)
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                behavior, response_serializer=response_class.SerializeToString
            )
        return handlers

    def _malformed_hook(self, method: str) -> Callable[[BaseException], None] | None:
        """What counts a ``method`` request that does not parse: an infer request, in
        ``recserve_requests_total`` as HTTP counts an undecodable body (its model name
        unread: ``unknown``)."""
        record = self._record_rejected
        if method != "ModelInfer" or record is None:
            return None
        return lambda problem: record("grpc", "", problem)


def _parsed(
    method: Callable[[Any, grpc.ServicerContext], Any],
    request_class: type,
    on_malformed: Callable[[BaseException], None] | None = None,
) -> Callable[[bytes, grpc.ServicerContext], Any]:
    """``method`` taking the raw request bytes: parsed here, INVALID_ARGUMENT if malformed
    (after telling ``on_malformed``)."""

    def handler(payload: bytes, context: grpc.ServicerContext) -> Any:
        return method(parse_request(request_class, payload, context, on_malformed), context)

    return handler


def add_inference_servicer(
    servicer: InferenceServicer,
    server: grpc.Server,
    prompt_pool: futures.ThreadPoolExecutor | None = None,
) -> None:
    """Register ``servicer`` on ``server`` (what a generated ``add_*_to_server`` does);
    ``prompt_pool``: see :meth:`InferenceServicer.method_handlers`."""
    handlers = servicer.method_handlers(prompt_pool)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class InferenceStub:
    """A minimal client of the service over our own messages (tests, tools). Each attribute is
    a unary callable: ``stub.ModelInfer(V2.ModelInferRequest(...), timeout=1.0)``."""

    # Set by __init__, one per entry of _METHODS.
    ServerLive: grpc.UnaryUnaryMultiCallable
    ServerReady: grpc.UnaryUnaryMultiCallable
    ModelReady: grpc.UnaryUnaryMultiCallable
    ServerMetadata: grpc.UnaryUnaryMultiCallable
    ModelMetadata: grpc.UnaryUnaryMultiCallable
    ModelInfer: grpc.UnaryUnaryMultiCallable

    def __init__(self, channel: grpc.Channel) -> None:
        for name, request_class, response_class in _METHODS:
            setattr(
                self,
                name,
                channel.unary_unary(
                    f"/{SERVICE_NAME}/{name}",
                    request_serializer=request_class.SerializeToString,
                    response_deserializer=response_class.FromString,
                    _registered_method=True,
                ),
            )


class GrpcHealth:
    """The standard health service, with one switch for the overall ``""`` status and the
    inference service's status."""

    SERVICES = ("", SERVICE_NAME)

    def __init__(self, servicer: health.HealthServicer | None = None) -> None:
        self.servicer = servicer or health.HealthServicer()

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in self.SERVICES:
            self.servicer.set(service, status)

    def refresh(self, core: PredictionCore) -> bool:
        """Set the status from ``core.ready()`` (NOT_SERVING if it raises); returns it."""
        try:
            serving = bool(core.ready())
        except Exception:
            log.exception("readiness check failed")
            serving = False
        self.set_serving(serving)
        return serving

    def shutdown(self) -> None:
        """Mark every service NOT_SERVING for good (call before stopping the server)."""
        self.servicer.enter_graceful_shutdown()


def _reflection_pool() -> descriptor_pool.DescriptorPool:
    """A pool holding exactly the services this server exposes, for server reflection."""
    pool = descriptor_pool.DescriptorPool()
    for file in (health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR, V2.file):
        pool.AddSerializedFile(file.serialized_pb)
    return pool


def build_grpc_server(
    core: PredictionCore,
    *,
    host: str = "0.0.0.0",
    port: int = 0,
    max_workers: int = 8,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_request_bytes: int | None = None,
    maximum_concurrent_rpcs: int | None = None,
    reuse_port: bool = False,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.Server, int, GrpcHealth]:
    """A (not yet started) gRPC server with the inference, health and reflection services.

    ``max_request_bytes``: the largest request message (RESOURCE_EXHAUSTED above it; default
    ``max_message_bytes``), as ``--max-body-bytes`` limits HTTP bodies. ``credentials``
    (``grpc.ssl_server_credentials``): TLS on the port; None: plaintext.
    Returns ``(server, bound_port, health)``; ``port=0`` picks a free port. Health starts from
    ``core.ready()``; keep it current with ``health.set_serving(...)`` / ``health.refresh(core)``.
    Call ``server.start()``, and ``health.shutdown(); server.stop(grace)`` to stop.
    """
    replaced = ("grpc.so_reuseport", "grpc.max_receive_message_length")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc-infer"),
        options=[
            *(o for o in server_options(max_message_bytes) if o[0] not in replaced),
            ("grpc.max_receive_message_length", max_request_bytes or max_message_bytes),
            ("grpc.so_reuseport", 1 if reuse_port else 0),  # several server processes
        ],
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
    )
    # Liveness, readiness and health checks answer from threads of their own: the RPC
    # pool's threads can all be waiting for predictions (a slow embedding tier).
    prompt_pool = prompt_thread_pool()
    add_inference_servicer(InferenceServicer(core), server, prompt_pool)
    grpc_health = GrpcHealth()
    add_health_servicer(grpc_health.servicer, server, prompt_pool)
    grpc_health.refresh(core)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
        server,
        pool=_reflection_pool(),
    )
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:  # grpcio raises "Failed to bind to address ..."
        bound = 0
    if not bound:
        raise UnavailableError(
            f"cannot listen for gRPC on {address} (is another server on that port? "
            "--grpc-port 0 picks a free one)"
        )
    return server, bound, grpc_health
