"""The recserve prediction client (HTTP or gRPC, one interface).

::

    from clients import RecserveClient

    with RecserveClient("grpc://127.0.0.1:8001", model_name="adult", timeout=2.0) as client:
        result = client.predict(batch)          # a Batch -> KServe v2 tensors
        result.predictions                      # float32 [batch, 1]
        result.model_version, result.fallback_ids, result.unknown_ids, result.latency_seconds

    with RecserveClient("http://127.0.0.1:8000", model_name="adult") as client:
        client.predict([{"age": 39, "workclass": "State-gov", ...}])   # friendly rows (HTTP)

The client speaks only the wire protocol (KServe v2 REST with the binary tensor extension, or
KServe v2 gRPC with raw contents). It reuses connections (one urllib3 pool / one gRPC channel)
and retries only what the server could not take (HTTP 503, gRPC UNAVAILABLE or CANCELLED,
connections refused or reset while connecting, connections dropped before an answer) with
exponential backoff and jitter. Errors are :mod:`embedding_store.errors`
classes chosen by status (400 -> InvalidArgumentError, 404 -> NotFoundError, 413 ->
CapacityError, 503 -> UnavailableError, 504 -> DeadlineExceededError, ...); messages name the
server.
"""

from __future__ import annotations

import numbers
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard, TypeVar, cast
from urllib.parse import urlsplit

import numpy as np

from clients import codec
from clients._grpc import DEFAULT_MAX_MESSAGE_BYTES, GrpcBackend, reconnect_backoff_ms
from clients._http import HttpBackend
from clients._tls import LIBRARY_NAMES, client_tls
from clients._urls import redact_url, refuse_credentials
from clients.retry import RetryableError, RetryPolicy, exhausted
from clients.types import ModelInfo, PredictResult
from embedding_store.batch import Batch
from embedding_store.cli_types import MAX_FLOAT_VALUE
from embedding_store.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    RecserveError,
    UnavailableError,
)

T = TypeVar("T")

DEFAULT_TIMEOUT = 10.0
#: The longest ``timeout`` accepted (seconds; 1e6, about 11.5 days): longer ones overflow the
#: clock arithmetic of urllib3 and gRPC (the same limit as the CLI's duration flags).
MAX_TIMEOUT_SECONDS = MAX_FLOAT_VALUE
DEFAULT_BACKOFF = (0.05, 1.0)
#: The largest ``max_message_bytes``: gRPC takes its message limits as a C int.
MAX_MESSAGE_BYTES = 2**31 - 1


@dataclass(frozen=True)
class Endpoint:
    """A parsed server URL: ``protocol`` "http" or "grpc"; ``base`` the HTTP base URL (with
    scheme) or the gRPC target (``host:port``); ``url`` as the user wrote it, normalized, with
    the password of a ``user:password@`` part shown as ``***`` (it is what messages show);
    ``tls`` for ``https://`` and ``grpcs://``."""

    protocol: str
    base: str
    url: str
    tls: bool = False


def parse_url(
    url: str,
    *,
    tls_names: tuple[str, str, str] = LIBRARY_NAMES,
    credentials_reason: str | None = None,
) -> Endpoint:
    """``http://host:port[/prefix]``, ``https://...``, ``grpc://host:port`` or
    ``grpcs://host:port`` (gRPC over TLS) (a bare ``host:port`` means HTTP). A
    ``user:password@`` part is refused: it would never be sent (``tls_names``: how the
    refusal names the client-certificate options, the library's or a CLI's flags;
    ``credentials_reason``: the refusal's reason in place of that wording, for a caller
    whose own client is not this library's, as the load tests' locust)."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidArgumentError(f"server URL must be a non-empty string, got {url!r}")
    text = url.strip()
    shown = redact_url(url)  # messages never show a password given in the URL
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urlsplit(text)
    except ValueError as error:  # "Invalid IPv6 URL"
        raise InvalidArgumentError(f"server URL {shown!r}: {error}") from None
    scheme = parts.scheme.lower()
    if not parts.hostname:
        raise InvalidArgumentError(f"server URL {shown!r} has no host")
    try:
        port = parts.port
    except ValueError:
        raise InvalidArgumentError(f"server URL {shown!r} has an invalid port") from None
    if scheme in ("http", "https"):
        base = f"{scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        endpoint = Endpoint("http", base, redact_url(base), tls=scheme == "https")
    elif scheme in ("grpc", "grpcs"):
        if port is None:
            raise InvalidArgumentError(f"gRPC server URL {shown!r} needs a port")
        if parts.path.strip("/"):
            raise InvalidArgumentError(f"gRPC server URL {shown!r} cannot have a path")
        shown = redact_url(f"{scheme}://{parts.netloc}")
        endpoint = Endpoint("grpc", parts.netloc, shown, tls=scheme == "grpcs")
    else:
        raise InvalidArgumentError(
            f"server URL {shown!r}: scheme must be http, https, grpc or grpcs, got {parts.scheme!r}"
        )
    # Last, once the URL is otherwise valid: a wrong scheme or port is the first thing to fix.
    refuse_credentials(
        parts.netloc, f"server URL {endpoint.url!r}", tls_names[1:], reason=credentials_reason
    )
    return endpoint


def is_rows(data: object) -> bool:
    """True for a list/tuple of dict rows (the friendly input)."""
    return (
        isinstance(data, (list, tuple))
        and len(data) > 0
        and all(isinstance(row, Mapping) for row in data)
    )


def check_input(data: object) -> None:
    """TypeError unless ``data`` is a Batch or a non-empty list of dict rows."""
    if isinstance(data, Batch) or is_rows(data):
        return
    if isinstance(data, (list, tuple)) and not data:
        raise InvalidArgumentError("predict() got no rows")
    raise TypeError(
        "predict() takes a Batch or a list of dict rows, got "
        f"{type(data).__name__}; send named tensors with infer()"
    )


def rows_need_http(url: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"friendly dict rows need an HTTP server URL (they go to /v1/models/{{name}}:predict); "
        f"{url} is gRPC: send a Batch (or named tensors with infer()) instead"
    )


def _is_seconds(value: object) -> TypeGuard[numbers.Real]:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _resolve_backoff(backoff: object) -> tuple[float, float]:
    """``backoff`` seconds (the minimum; the maximum is the default's, or that if larger) or
    a ``(min, max)`` pair; InvalidArgumentError naming anything else (the range itself is
    checked by :class:`RetryPolicy`)."""
    if _is_seconds(backoff):
        return float(backoff), max(float(backoff), DEFAULT_BACKOFF[1])
    if (
        isinstance(backoff, (tuple, list))
        and len(backoff) == 2
        and all(_is_seconds(value) for value in backoff)
    ):
        return float(backoff[0]), float(backoff[1])
    raise InvalidArgumentError(f"backoff must be seconds or (min, max) seconds, got {backoff!r}")


class _ClientBase:
    """What the sync and async clients share: configuration and argument checks."""

    def __init__(
        self,
        url: str,
        *,
        model_name: str = "model",
        timeout: float | None = DEFAULT_TIMEOUT,
        retries: int = 3,
        backoff: float | tuple[float, float] = DEFAULT_BACKOFF,
        max_connections: int = 8,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
    ) -> None:
        self.endpoint = parse_url(url)
        self._tls = client_tls(self.endpoint.tls, self.endpoint.url, tls_ca, tls_cert, tls_key)
        if not isinstance(model_name, str) or not model_name:
            raise InvalidArgumentError(f"model_name must be a non-empty string, got {model_name!r}")
        self.model_name = model_name
        self.timeout = _checked_timeout(timeout)
        self.policy = RetryPolicy(retries, *_resolve_backoff(backoff))
        self._max_connections = _checked_count("max_connections", max_connections)
        self._max_message_bytes = _checked_count(
            "max_message_bytes", max_message_bytes, MAX_MESSAGE_BYTES
        )
        self._transport = self._make_backend()
        self._closed = False

    def _make_backend(self) -> Any:
        """The transport (HTTP or gRPC, blocking or asyncio): each subclass builds its own."""
        raise NotImplementedError(f"{type(self).__name__} must define _make_backend")

    @property
    def _backend(self) -> Any:
        """The transport, while the client is open: every call after close() raises the
        same error, whatever the protocol (the transports themselves fail each their own
        way, or silently reconnect)."""
        if self._closed:
            raise FailedPreconditionError(f"{self!r} is closed; create a new client")
        return self._transport

    def _check_open(self) -> None:
        """FailedPreconditionError once the client is closed: a retry that waited out its
        delay while another thread or task closed the client is not sent (it used to be:
        over HTTP on a new connection, over gRPC as a raw ValueError "Cannot invoke RPC on
        closed channel!", or, asyncio, on a new channel that nothing closed)."""
        self._backend  # noqa: B018  (the property raises for a closed client)

    def _close_transport(self) -> Any:
        """Mark the client closed and return the transport to close (None if already)."""
        if self._closed:
            return None
        self._closed = True
        return self._transport

    @property
    def url(self) -> str:
        """The server URL as messages show it: a ``user:password@`` part as ``user:***@``."""
        return self.endpoint.url

    @property
    def protocol(self) -> str:
        """ "http" or "grpc"."""
        return self.endpoint.protocol

    def _timeout(self, timeout: float | None) -> float | None:
        """A call's own ``timeout`` (checked as the constructor's), or the client's."""
        return self.timeout if timeout is None else _checked_timeout(timeout)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, model_name={self.model_name!r})"


def _checked_timeout(timeout: object) -> float | None:
    """``timeout`` as seconds in (0, MAX_TIMEOUT_SECONDS] or None; InvalidArgumentError naming
    it otherwise (NaN and inf too: inf or 1e10 used to reach urllib3 as a raw OverflowError,
    and gRPC as an instant DEADLINE_EXCEEDED)."""
    if timeout is None:
        return None
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, numbers.Real)
        # cast: typeshed's numbers.Real has no __gt__, so `0 < Real` does not type-check.
        or not 0 < cast(float, timeout) <= MAX_TIMEOUT_SECONDS
    ):
        raise InvalidArgumentError(
            f"timeout must be > 0 and <= {MAX_TIMEOUT_SECONDS:.0f} seconds, or None, "
            f"got {timeout!r}"
        )
    return float(timeout)


def _checked_wait(timeout: object, interval: object) -> tuple[float, float]:
    """``wait_until_ready``'s ``timeout`` (seconds in [0, MAX_TIMEOUT_SECONDS]: 0 polls once)
    and ``interval`` (in (0, MAX_TIMEOUT_SECONDS]); InvalidArgumentError naming the one at
    fault otherwise (an interval of NaN or < 0 was a raw ValueError from time.sleep after the
    first poll, a NaN timeout one of ready()'s own timeout)."""
    for name, value, low in (("timeout", timeout, ">= 0"), ("interval", interval, "> 0")):
        valid = _is_seconds(value) and (
            0 <= cast(float, value) <= MAX_TIMEOUT_SECONDS
            if name == "timeout"
            else 0 < cast(float, value) <= MAX_TIMEOUT_SECONDS
        )
        if not valid:
            raise InvalidArgumentError(
                f"wait_until_ready {name} must be {low} and <= {MAX_TIMEOUT_SECONDS:.0f} "
                f"seconds, got {value!r}"
            )
    return float(cast(float, timeout)), float(cast(float, interval))


def _checked_count(name: str, value: object, maximum: int | None = None) -> int:
    """``value`` as an integer in [1, ``maximum``]; InvalidArgumentError naming ``name``
    otherwise (0 or a string used to fail later, raw: the asyncio HTTP client's thread pool
    refused 0 with a ValueError, gRPC took 0 bytes as a limit no message fits, and a limit
    over 2**31 - 1 overflowed its C int)."""
    valid = not isinstance(value, bool) and isinstance(value, numbers.Integral)
    if valid:
        number = int(cast(int, value))
        valid = number >= 1 and (maximum is None or number <= maximum)
    if not valid:
        bound = f"between 1 and {maximum}" if maximum is not None else ">= 1"
        raise InvalidArgumentError(f"{name} must be an integer {bound}, got {value!r}")
    return number


class RecserveClient(_ClientBase):
    """Blocking client of a recserve server over HTTP or gRPC (chosen by the URL scheme).

    Args:
        url: ``http://host:port`` or ``grpc://host:port``; ``https://`` and ``grpcs://`` for
            TLS.
        model_name: the model to call (``recserve serve --model-name``).
        timeout: seconds per attempt, > 0 and at most :data:`MAX_TIMEOUT_SECONDS` (1e6)
            (None: no limit); over HTTP it is also sent as the request's ``timeout``
            parameter, over gRPC as the call deadline. Anything else (NaN, inf, 0, a bool)
            raises InvalidArgumentError naming it, here or in a call's own ``timeout``.
        retries: extra attempts after HTTP 503 / gRPC UNAVAILABLE or CANCELLED (a stopping
            server) / connections refused or reset while connecting / connections dropped
            before an answer.
        backoff: (min, max) seconds of the exponential backoff between attempts (jittered).
        max_connections: HTTP connections kept per host (an integer >= 1).
        max_message_bytes: gRPC message size limit (both directions), an integer in
            [1, 2**31 - 1].
        tls_ca: PEM file of the CA(s) to trust for an ``https://`` or ``grpcs://`` server
            (default: the system's trust store).
        tls_cert, tls_key: PEM client certificate and its unencrypted key, for a server that
            requires client certificates (mutual TLS); together or not at all.
            TLS options with a plaintext URL, and files that are missing, not PEM or not a
            matching pair, raise InvalidArgumentError naming the option and the file.

    Thread-safe; use one client per server and close it (or use it as a context manager).
    """

    _backend: HttpBackend | GrpcBackend

    def _make_backend(self) -> HttpBackend | GrpcBackend:
        if self.protocol == "http":
            return HttpBackend(
                self.endpoint.base, max_connections=self._max_connections, tls=self._tls
            )
        return GrpcBackend(
            self.endpoint.base,
            self.url,
            max_message_bytes=self._max_message_bytes,
            tls=self._tls,
            max_reconnect_backoff_ms=reconnect_backoff_ms(self.policy),
        )

    # ------------------------------------------------------------------ plumbing
    def _retrying(self, call: Callable[..., T], *args: Any) -> T:
        attempt = 0
        while True:
            try:
                return call(*args)
            except RetryableError as retry:
                if attempt >= self.policy.retries:
                    raise exhausted(retry, attempt + 1) from None
                time.sleep(self.policy.delay(attempt))
                self._check_open()
                attempt += 1

    def _health(self, call: Callable[..., bool], *args: Any) -> bool:
        try:
            return bool(call(*args))
        except (RetryableError, UnavailableError, DeadlineExceededError):
            return False

    # ------------------------------------------------------------------ API
    def live(self, *, timeout: float | None = None) -> bool:
        """Whether the server process answers (False if unreachable)."""
        return self._health(self._backend.live, self._timeout(timeout))

    def ready(self, *, timeout: float | None = None) -> bool:
        """Whether the server is ready to predict (False if unreachable or not ready)."""
        return self._health(self._backend.ready, self._timeout(timeout))

    def model_ready(self, *, timeout: float | None = None) -> bool:
        """Whether this client's model is ready (NotFoundError for an unknown model)."""
        return self._health(self._backend.model_ready, self.model_name, self._timeout(timeout))

    def wait_until_ready(self, timeout: float = 30.0, *, interval: float = 0.05) -> bool:
        """Poll :meth:`ready` every ``interval`` seconds until it is True (returns True) or
        ``timeout`` seconds pass (False); InvalidArgumentError for a ``timeout`` < 0 or an
        ``interval`` <= 0 (NaN, inf or over 1e6 s either)."""
        timeout, interval = _checked_wait(timeout, interval)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if self.ready(timeout=max(min(left, 1.0), 0.01)):
                return True
            if time.monotonic() + interval > deadline:
                return False
            time.sleep(interval)

    def metadata(self, *, timeout: float | None = None) -> ModelInfo:
        """The model's name, versions and input/output tensor specs."""
        return self._retrying(self._backend.metadata, self.model_name, self._timeout(timeout))

    def infer(
        self, tensors: Mapping[str, np.ndarray], *, timeout: float | None = None
    ) -> PredictResult:
        """Score named KServe v2 tensors (``<slot>``, ``<slot>.lengths``, ``<name>``): arrays,
        or nested lists (lists of Python integers, and empty lists, are sent as INT64, or
        UINT64 when one is >= 2**63; Python floats as FP64, so pass float32 arrays for FP32
        inputs; a ragged list raises InvalidArgumentError naming the input)."""
        started = time.perf_counter()
        checked = codec.check_tensors(tensors)
        result = self._retrying(
            self._backend.infer, self.model_name, checked, self._timeout(timeout)
        )
        return codec.with_latency(result, time.perf_counter() - started)

    def predict(
        self, data: Batch | Sequence[Mapping[str, Any]], *, timeout: float | None = None
    ) -> PredictResult:
        """Score a :class:`Batch` (any protocol) or a list of friendly dict rows (HTTP only:
        raw rows for the server's ``--preprocessor``, or, without one, keyed by feature name)."""
        check_input(data)
        started = time.perf_counter()
        if isinstance(data, Batch):
            tensors = codec.batch_to_tensors(data)
            result = self._retrying(
                self._backend.infer, self.model_name, tensors, self._timeout(timeout)
            )
        else:
            if not isinstance(self._backend, HttpBackend):
                raise rows_need_http(self.url)
            result = self._retrying(
                self._backend.predict_rows, self.model_name, list(data), self._timeout(timeout)
            )
        return codec.with_latency(result, time.perf_counter() - started)

    def close(self) -> None:
        """Release the connections; later calls raise FailedPreconditionError. Idempotent."""
        transport = self._close_transport()
        if transport is not None:
            transport.close()

    def __enter__(self) -> RecserveClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "Endpoint",
    "RecserveClient",
    "RecserveError",
    "parse_url",
]
