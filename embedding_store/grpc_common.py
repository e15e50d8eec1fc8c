"""Shared gRPC plumbing of the embedding tier: packed arrays, options, error translation.

Arrays cross the wire as packed little-endian bytes (``bytes`` protobuf fields), never as
repeated scalars: packing is a memcpy, and decoding checks sizes before it trusts them.
Errors travel as status codes chosen by :mod:`embedding_store.errors` (one mapping, one place):
servers abort with the code of the raised error and its public message, and clients turn the
status back into the same error class, naming the peer that failed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf.message import Message

from embedding_store.errors import (
    CheckpointError,
    DeadlineExceededError,
    InvalidArgumentError,
    RecserveError,
    UnavailableError,
    error_for_grpc_code,
    grpc_code_name_of,
    public_message_of,
)

log = logging.getLogger(__name__)

#: Health-check service name that reports SERVING for as long as the process serves gRPC at
#: all: for liveness probes. The overall service ("") is readiness: NOT_SERVING while a shard
#: loads, waits for its optimizer, or drains on SIGTERM, none of which a restart would fix.
LIVENESS_SERVICE = "recserve.liveness"

#: Largest message either side accepts or sends; set explicitly on every channel and server.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

_U64 = np.dtype("<u8")
_F32 = np.dtype("<f4")


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Options for client channels: explicit message limits, keepalive, fast reconnects."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1_000),
        ("grpc.enable_retries", 0),
    ]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Options for servers: the same explicit message limits."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


# --------------------------------------------------------------------------- packed arrays
def pack_u64(values: np.ndarray) -> bytes:
    """uint64 [n] -> little-endian bytes."""
    return np.ascontiguousarray(values, dtype=_U64).tobytes()


def pack_f32(values: np.ndarray) -> bytes:
    """float32 array of any shape -> little-endian bytes (row-major)."""
    return np.ascontiguousarray(values, dtype=_F32).tobytes()


def unpack_u64(payload: bytes, field: str) -> np.ndarray:
    """Little-endian bytes -> uint64 [n]; InvalidArgumentError naming ``field`` if malformed."""
    if len(payload) % 8:
        raise InvalidArgumentError(
            f"{field}: {len(payload)} bytes is not a whole number of uint64 values"
        )
    return np.frombuffer(payload, dtype=_U64).astype(np.uint64, copy=False)


def unpack_f32(payload: bytes, shape: tuple[int, ...], field: str) -> np.ndarray:
    """Little-endian bytes -> float32 ``shape``; InvalidArgumentError naming ``field``."""
    expected = 4 * int(np.prod(shape, dtype=np.int64))
    if len(payload) != expected:
        raise InvalidArgumentError(
            f"{field}: got {len(payload)} bytes, expected {expected} for float32 {list(shape)}"
        )
    return np.frombuffer(payload, dtype=_F32).astype(np.float32, copy=False).reshape(shape)


# --------------------------------------------------------------------------- server side
def status_code_of(error: BaseException) -> grpc.StatusCode:
    """The gRPC status code of any exception (recserve errors by class, others INTERNAL)."""
    return grpc.StatusCode[grpc_code_name_of(error)]


F = TypeVar("F", bound=Callable[..., Any])


def rpc_errors(method: F) -> F:
    """Decorate a unary servicer method: recserve errors abort with their code and message;
    anything else is logged with its traceback and answered INTERNAL without details."""

    @functools.wraps(method)
    def wrapper(self: object, request: Message, context: grpc.ServicerContext) -> Message:
        try:
            return method(self, request, context)
        except RecserveError as error:
            context.abort(status_code_of(error), public_message_of(error))
        except Exception as error:
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, public_message_of(error))

    return wrapper  # type: ignore[return-value]


def rpc_stream_errors(method: F) -> F:
    """Like :func:`rpc_errors` for server-streaming methods (generators)."""

    @functools.wraps(method)
    def wrapper(self: object, request: Message, context: grpc.ServicerContext) -> Iterator[Message]:
        try:
            yield from method(self, request, context)
        except RecserveError as error:
            context.abort(status_code_of(error), public_message_of(error))
        except Exception as error:
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, public_message_of(error))

    return wrapper  # type: ignore[return-value]


# --------------------------------------------------------------------------- client side
def error_from_rpc(error: grpc.RpcError, peer: str) -> RecserveError:
    """Turn a failed call into the recserve error of its status, naming ``peer``.

    ``peer`` describes who failed, e.g. ``"parameter server 127.0.0.1:7001 (shard 1 of 2)"``.
    """
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(code)
    if code == grpc.StatusCode.UNAVAILABLE:
        return UnavailableError(f"{peer} is unavailable: {details}")
    if code == grpc.StatusCode.CANCELLED:
        # Our clients never cancel a call whose status they read, so the server did: it was
        # stopping while the call arrived. Retryable, like UNAVAILABLE.
        return UnavailableError(f"{peer} cancelled the call (shutting down?): {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(f"{peer} did not answer within the deadline: {details}")
    if code == grpc.StatusCode.FAILED_PRECONDITION and "checkpoint" in details.lower():
        return CheckpointError(f"{peer}: {details}")
    return error_for_grpc_code(code.name, f"{peer}: {details}")


def call(peer: str, method: Callable[..., Any], request: Any, *, timeout: float | None) -> Any:
    """Invoke a unary ``method`` with a deadline; failures become recserve errors."""
    try:
        return method(request, timeout=timeout)
    except grpc.RpcError as error:
        raise error_from_rpc(error, peer) from None
