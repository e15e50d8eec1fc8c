"""gRPC backends (sync ``grpc`` and ``grpc.aio``): one attempt per call over one channel.

Messages come from :data:`clients._proto.V2` (a private descriptor pool). A failed call raises
:class:`~clients.retry.RetryableError` for UNAVAILABLE (which covers refused connections) and
for a server's limit of concurrent calls, the matching recserve error for any other status.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc
import grpc.aio
import numpy as np

from clients import codec
from clients._proto import METHODS, SERVICE_NAME, V2
from clients._tls import ClientTls, handshake_refused, tls_hint
from clients._urls import redact_url, redact_userinfo
from clients.retry import RetryableError, RetryPolicy
from clients.types import ModelInfo, PredictResult
from embedding_store.errors import FailedPreconditionError, RecserveError, UnavailableError

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024

#: (method, request, decode) of one call.
Call = tuple[str, Any, Callable[[Any], Any]]


#: Bounds of the channel's wait between two connection attempts (milliseconds).
MIN_RECONNECT_BACKOFF_MS = 50
MAX_RECONNECT_BACKOFF_MS = 1_000


def reconnect_backoff_ms(policy: RetryPolicy) -> int:
    """The longest wait of a channel between two connection attempts, for a client that
    retries by ``policy``: half the shortest total wait of its retries, within
    [:data:`MIN_RECONNECT_BACKOFF_MS`, :data:`MAX_RECONNECT_BACKOFF_MS`].

    Why: a channel whose connection attempts failed (a server down, or restarting) fails every
    call at once, with the last attempt's error, until its backoff timer lets it try again;
    retries all sent within that wait are no attempts at all. With a fixed 1 s (gRPC jitters
    it by up to 20%), a client with the default policy (3 retries, at least 0.175 s of waits
    in all) still failed with "Connection refused" after its server was back up.
    """
    shortest = sum(
        min(policy.backoff_max, policy.backoff_min * 2.0**attempt) / 2
        for attempt in range(policy.retries)
    )
    return int(min(max(shortest * 1000 / 2, MIN_RECONNECT_BACKOFF_MS), MAX_RECONNECT_BACKOFF_MS))


def channel_options(
    max_message_bytes: int, max_reconnect_backoff_ms: int = MAX_RECONNECT_BACKOFF_MS
) -> list[tuple[str, Any]]:
    """Explicit message limits, quick reconnects (the client retries, gRPC does not): at most
    ``max_reconnect_backoff_ms`` between two connection attempts (:func:`reconnect_backoff_ms`
    fits it to a client's retries)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", MIN_RECONNECT_BACKOFF_MS),
        ("grpc.min_reconnect_backoff_ms", MIN_RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", max_reconnect_backoff_ms),
        ("grpc.enable_retries", 0),
    ]


# --------------------------------------------------------------------------- calls
def live_call() -> Call:
    return "ServerLive", V2.ServerLiveRequest(), lambda response: bool(response.live)


def ready_call() -> Call:
    return "ServerReady", V2.ServerReadyRequest(), lambda response: bool(response.ready)


def model_ready_call(model: str) -> Call:
    return "ModelReady", V2.ModelReadyRequest(name=model), lambda response: bool(response.ready)


def metadata_call(model: str) -> Call:
    return "ModelMetadata", V2.ModelMetadataRequest(name=model), codec.model_info_from_grpc


def infer_call(model: str, tensors: Mapping[str, np.ndarray]) -> Call:
    return "ModelInfer", codec.encode_grpc_infer(model, tensors), codec.decode_grpc_infer


#: The clock of :func:`time_left` (monotonic seconds).
_clock = time.monotonic


def time_left(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (a :data:`_clock` reading; None: no limit), or 0.0
    once it passed."""
    return None if deadline is None else max(deadline - _clock(), 0.0)


#: What grpcio answers, with RESOURCE_EXHAUSTED, a call beyond a server's
#: ``maximum_concurrent_rpcs`` (``recserve serve --max-concurrent-rpcs``): the server could not
#: take it now, as an HTTP 503, unlike a message over the size limit (same code, not retried).
CONCURRENT_RPC_LIMIT = "Concurrent RPC limit exceeded!"


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else _clock() + timeout


#: How gRPC begins the UNAVAILABLE details it makes up itself when the channel has no
#: connection (nothing listening, a refused handshake, a name that does not resolve): the
#: server answered nothing.
_NOT_CONNECTED = ("failed to connect to all addresses", "errors resolving", "DNS resolution")

#: What gRPC says of a peer that does not speak HTTP/2 (a server's HTTP/1.1 port): every
#: attempt gets the same answer.
NOT_HTTP2_PEER = ("Trying to connect an http1.x server", "Expected SETTINGS frame as the first")


def http1_hint(url: str) -> str:
    """What to do when ``url`` answered in something else than HTTP/2 (the twin of
    :func:`clients._http.http2_hint`)."""
    return (
        f" (server {url} does not speak HTTP/2: is that the server's HTTP port? grpc:// URLs "
        "use its --grpc-port (8001 by default), http:// URLs its --http-port (8000))"
    )


def _failure(
    server: str, error: grpc.RpcError, *, secure: bool = False, target: str = ""
) -> RecserveError | RetryableError:
    """The error a failed call raises; ``secure``: the channel speaks TLS; ``target``: the
    channel's, whose password, if any, the details must not show."""
    code = error.code() if callable(getattr(error, "code", None)) else None
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    details = error.details() if callable(getattr(error, "details", None)) else str(error)
    if details and target:
        details = redact_userinfo(details, target)
    hint = tls_hint(details or "", secure=secure)
    http1 = any(sign in (details or "") for sign in NOT_HTTP2_PEER)
    if http1:
        hint += http1_hint(server)
    if name == "UNAVAILABLE" and (details or "").startswith(_NOT_CONNECTED):
        # Not "server X answered gRPC UNAVAILABLE": that reads as a server up and refusing
        # work (a full queue, a drain), when there was no connection to one at all.
        mapped: RecserveError = UnavailableError(
            f"cannot connect to server {server}: gRPC UNAVAILABLE: {details}{hint}"
        )
    else:
        mapped = codec.grpc_error(server, name, details + hint)
    # UNAVAILABLE is retried (a server restarting), but not a refused TLS handshake: it
    # would fail the same way, only later. CANCELLED comes from the server here (these
    # clients never cancel a call): grpc cancels the calls still open when a server stops,
    # and every call of the protocol is a read, safe to send again.
    # Nor a peer that does not speak HTTP/2: the port answers that way every time.
    retry = (
        name in ("UNAVAILABLE", "CANCELLED") and not handshake_refused(details or "") and not http1
    ) or (name == "RESOURCE_EXHAUSTED" and details == CONCURRENT_RPC_LIMIT)
    return RetryableError(mapped) if retry else mapped


def _stubs(channel: Any) -> dict[str, Any]:
    return {
        name: channel.unary_unary(
            f"/{SERVICE_NAME}/{name}",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        for name, request_class, response_class in METHODS
    }


def closed_error(server: str) -> FailedPreconditionError:
    """What a call on a closed backend raises (the clients check first, naming themselves;
    this is for a call that raced :meth:`close`)."""
    return FailedPreconditionError(f"the gRPC client of {server} is closed; create a new client")


# --------------------------------------------------------------------------- sync
class GrpcBackend:
    """Blocking calls on one ``grpc`` channel to ``target`` (``host:port``)."""

    def __init__(
        self,
        target: str,
        server: str,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        tls: ClientTls | None = None,
        max_reconnect_backoff_ms: int = MAX_RECONNECT_BACKOFF_MS,
    ) -> None:
        self.server = redact_url(server)  # for messages: never a password
        self._target = target
        self._tls = tls
        options = channel_options(max_message_bytes, max_reconnect_backoff_ms)
        self._channel = (
            grpc.insecure_channel(target, options=options)
            if tls is None
            else grpc.secure_channel(target, tls.grpc_credentials(), options=options)
        )
        self._stubs = _stubs(self._channel)

    def _run(self, call: Call, timeout: float | None) -> Any:
        method, request, decode = call
        try:
            response = self._stubs[method](request, timeout=timeout)
        except grpc.RpcError as error:
            raise _failure(
                self.server, error, secure=self._tls is not None, target=self._target
            ) from None
        except ValueError as error:  # grpc's "Cannot invoke RPC on closed channel!"
            if "closed channel" not in str(error):
                raise
            raise closed_error(self.server) from None
        return decode(response)

    def live(self, timeout: float | None) -> bool:
        return self._run(live_call(), timeout)

    def ready(self, timeout: float | None) -> bool:
        return self._run(ready_call(), timeout)

    def model_ready(self, model: str, timeout: float | None) -> bool:
        """Whether ``model`` is ready; NotFoundError for an unknown one. Both calls it may
        take share one ``timeout`` (the second used to get a whole one of its own)."""
        deadline = _deadline(timeout)
        ready = self._run(model_ready_call(model), timeout)
        left = time_left(deadline)
        # The server answers false for an unknown model too (as Triton does): the metadata
        # call tells NotFoundError apart, if time is left for it (not ready, either way).
        if not ready and (left is None or left > 0):
            self._run(metadata_call(model), left)
        return ready

    def metadata(self, model: str, timeout: float | None) -> ModelInfo:
        return self._run(metadata_call(model), timeout)

    def infer(
        self, model: str, tensors: Mapping[str, np.ndarray], timeout: float | None
    ) -> PredictResult:
        return self._run(infer_call(model, tensors), timeout)

    def close(self) -> None:
        self._channel.close()


# --------------------------------------------------------------------------- asyncio
class AsyncGrpcBackend:
    """``grpc.aio`` calls on one channel, opened on first use inside the running loop.

    A ``grpc.aio`` channel belongs to the loop it was opened on. Called from another loop
    (a second ``asyncio.run()``, say) once that one is closed, the backend opens a new
    channel on the new loop and drops the old one (it used to fail with a raw
    ``RuntimeError: Event loop is closed``, for good); so it does once that loop has stopped
    with no call pending (a loop left open after ``run_until_complete``). While the first
    loop runs (in another thread), or has stopped with calls pending on it, a call from a
    second one raises FailedPreconditionError: one loop at a time.
    """

    def __init__(
        self,
        target: str,
        server: str,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        tls: ClientTls | None = None,
        max_reconnect_backoff_ms: int = MAX_RECONNECT_BACKOFF_MS,
    ) -> None:
        self.server = redact_url(server)  # for messages: never a password
        self._target = target
        self._tls = tls
        self._max_message_bytes = max_message_bytes
        self._max_reconnect_backoff_ms = max_reconnect_backoff_ms
        self._channel: grpc.aio.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stubs: dict[str, Any] = {}
        # The check and the swap below, atomic: first calls on two loops in two threads
        # would otherwise both pass the check, each opening a channel.
        self._swap_lock = threading.Lock()
        self._in_flight = 0  # calls awaiting an answer on the current channel
        self._closed = False  # close() was called: no channel is opened again

    def _open_channel(self) -> grpc.aio.Channel:
        options = channel_options(self._max_message_bytes, self._max_reconnect_backoff_ms)
        if self._tls is None:
            return grpc.aio.insecure_channel(self._target, options=options)
        return grpc.aio.secure_channel(self._target, self._tls.grpc_credentials(), options=options)

    async def _stubs_for_this_loop(self) -> dict[str, Any]:
        if self._closed:  # a new channel now would never be closed
            raise closed_error(self.server)
        loop = asyncio.get_running_loop()
        if self._channel is not None and self._loop is loop:
            return self._stubs
        with self._swap_lock:  # no await inside: a plain lock is enough
            if self._channel is not None and self._loop is loop:
                return self._stubs
            old, old_loop = self._channel, self._loop
            busy = old_loop is not None and not old_loop.is_closed()
            if busy and old_loop is not None and (old_loop.is_running() or self._in_flight):
                raise FailedPreconditionError(
                    f"the gRPC client of {self.server} is in use on another event loop "
                    "(running, or with calls pending); use one client per event loop (or "
                    "one loop at a time)"
                )
            # Swap before awaiting anything, so that concurrent first calls on this loop
            # share one new channel.
            self._channel = self._open_channel()
            self._loop = loop
            self._stubs = _stubs(self._channel)
            stubs = self._stubs
        if old is not None:
            with contextlib.suppress(Exception):
                await old.close()
        return stubs

    async def _run(self, call: Call, timeout: float | None) -> Any:
        stubs = await self._stubs_for_this_loop()
        method, request, decode = call
        self._in_flight += 1
        try:
            response = await stubs[method](request, timeout=timeout)
        except grpc.RpcError as error:
            raise _failure(
                self.server, error, secure=self._tls is not None, target=self._target
            ) from None
        finally:
            self._in_flight -= 1
        return decode(response)

    async def live(self, timeout: float | None) -> bool:
        return await self._run(live_call(), timeout)

    async def ready(self, timeout: float | None) -> bool:
        return await self._run(ready_call(), timeout)

    async def model_ready(self, model: str, timeout: float | None) -> bool:
        """As :meth:`GrpcBackend.model_ready`: both calls share one ``timeout``."""
        deadline = _deadline(timeout)
        ready = await self._run(model_ready_call(model), timeout)
        left = time_left(deadline)
        if not ready and (left is None or left > 0):  # NotFoundError for an unknown model
            await self._run(metadata_call(model), left)
        return ready

    async def metadata(self, model: str, timeout: float | None) -> ModelInfo:
        return await self._run(metadata_call(model), timeout)

    async def infer(
        self, model: str, tensors: Mapping[str, np.ndarray], timeout: float | None
    ) -> PredictResult:
        return await self._run(infer_call(model, tensors), timeout)

    async def close(self) -> None:
        self._closed = True
        if self._channel is not None:
            channel, self._channel, self._loop = self._channel, None, None
            await channel.close()
