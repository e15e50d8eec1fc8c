"""HTTP backend: one attempt per call over a shared urllib3 connection pool.

Raises :class:`~clients.retry.RetryableError` for HTTP 503, connections refused or reset while
connecting and connections dropped before an answer, recserve errors for everything else (a
timeout is never retried: the server may still be working on the request). A call's
``timeout`` bounds the whole attempt.
The clients add retries, latency and the sync/async surface.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import http.client
import io
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import quote

import numpy as np
import urllib3
import urllib3.connection
from urllib3.exceptions import HTTPError, NewConnectionError, ProtocolError, SSLError
from urllib3.exceptions import TimeoutError as Urllib3Timeout

from clients import codec
from clients._tls import CLIENT_CERTIFICATE_HINT, ClientTls, tls_hint
from clients._urls import redact_url
from clients.retry import RetryableError
from clients.types import ModelInfo, PredictResult
from embedding_store.errors import DeadlineExceededError, RecserveError, UnavailableError

_REFUSED = (errno.ECONNREFUSED,)
#: Resets and broken pipes while connecting (a server closing its listener, a full accept
#: queue): the request was not sent, so a retry is as safe as after a refusal.
_RESET = (errno.ECONNRESET, errno.EPIPE)


def _connect_failure(error: BaseException) -> str | None:
    """Why a connection could not be opened, when a retry may help: "refused the connection"
    or "reset the connection while connecting" (found along the exception chain); None
    otherwise."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, ConnectionRefusedError):
            return "refused the connection"
        if isinstance(current, (ConnectionResetError, BrokenPipeError)):
            return "reset the connection while connecting"
        if isinstance(current, OSError) and current.errno in _REFUSED:
            return "refused the connection"
        if isinstance(current, OSError) and current.errno in _RESET:
            return "reset the connection while connecting"
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    text = str(error)
    if "Connection refused" in text:
        return "refused the connection"
    if "Connection reset by peer" in text or "Broken pipe" in text:
        return "reset the connection while connecting"
    return None


def answered_in_http2(error: BaseException) -> bool:
    """Whether ``error`` (or one along its chain, or in its args: urllib3 wraps it) is the
    status line of an HTTP/2 frame: a gRPC-only server (``recserve serve --grpc-port``)
    answers an HTTP/1.1 request with a SETTINGS frame (3 length bytes, type 4), which
    http.client reads as a bad status line."""
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, http.client.BadStatusLine):
            line = str(current.args[0]) if current.args else ""  # the line, as latin-1 text
            return line[:1] == "\x00" and line[3:4] == "\x04"
        pending += [a for a in current.args if isinstance(a, BaseException)]
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
    return False


def http2_hint(url: str) -> str:
    """The message for an HTTP/1.1 request answered in HTTP/2 (see :func:`answered_in_http2`)."""
    return (
        f"server {url} answered in HTTP/2, not HTTP/1.1: is that the server's gRPC port? "
        "HTTP clients use its --http-port (8000 by default), grpc:// URLs its --grpc-port "
        "(8001)"
    )


@dataclass(frozen=True)
class _Answer:
    """An HTTP answer read to the end: status, headers, body."""

    status: int
    headers: Mapping[str, str]
    data: bytes


def _read_before(response: urllib3.BaseHTTPResponse, deadline: float | None) -> bytes:
    """The whole body of ``response``, each read bounded by the time left until ``deadline``
    (monotonic seconds; None: no bound). TimeoutError once it has passed."""
    if deadline is None:
        return response.read()
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed while reading the answer")
        # Asked each time: urllib3 hands the connection back to the pool as it reads the
        # last byte, and from then on its socket is another caller's (or closed, when the
        # pool was full). Its connection attribute is None then.
        sock = getattr(getattr(response, "connection", None), "sock", None)
        if sock is not None:
            sock.settimeout(left)
        chunk = response.read1(_CHUNK_BYTES)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


_CHUNK_BYTES = 1 << 16
_HEALTH_FALSE_STATUSES = frozenset((400, 503))


# --------------------------------------------------------------------------- deadlines
#: When the answer being read must be complete (monotonic seconds), for the connections of
#: this thread; None: no bound. Set by :func:`answer_deadline` around one request.
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "recserve_http_deadline", default=None
)


@contextlib.contextmanager
def answer_deadline(deadline: float | None) -> Iterator[None]:
    """Bound every read of the answers of the requests made inside (status line, headers and
    body, on connections of :class:`DeadlineHTTPResponse`) by ``deadline`` (monotonic
    seconds; None: no bound)."""
    token = _DEADLINE.set(deadline)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


#: When the attempt being made on this thread began (monotonic seconds), if before it reached
#: the thread: set by :func:`attempt_started` (the asyncio client's calls wait for a thread).
_ATTEMPT_STARTED: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "recserve_http_attempt_started", default=None
)


@contextlib.contextmanager
def attempt_started(started: float) -> Iterator[None]:
    """Count the timeout of the calls made inside from ``started`` (monotonic seconds), not
    from when they run: a call that waited for a free worker thread has that much less."""
    token = _ATTEMPT_STARTED.set(started)
    try:
        yield
    finally:
        _ATTEMPT_STARTED.reset(token)


def answer_within(timeout: float | None) -> contextlib.AbstractContextManager[None]:
    """:func:`answer_deadline` ``timeout`` seconds from now (None: no bound)."""
    return answer_deadline(None if timeout is None else time.monotonic() + timeout)


class _DeadlineReader(io.RawIOBase):
    """A socket's raw reader whose every read gets the time left until ``deadline`` as its
    socket timeout (TimeoutError once it has passed)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        # The socket's own reader (makefile counts it, so that the connection closing its
        # socket after a "Connection: close" answer leaves it open until the body is read).
        self._raw = sock.makefile("rb", buffering=0)
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed while reading the answer")
        self._sock.settimeout(left)
        return self._raw.readinto(buffer)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


class _DeadlineSocket:
    """What :class:`http.client.HTTPResponse` takes from a socket (``makefile``), with reads
    bounded by a deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))


class DeadlineHTTPResponse(http.client.HTTPResponse):
    """An answer read within the deadline of :func:`answer_deadline`, status line and headers
    included: a socket timeout alone bounds each read, so a server that drips its headers a
    byte at a time used to stretch a call's timeout without end."""

    def __init__(self, sock: Any, *args: Any, **kwargs: Any) -> None:
        deadline = _DEADLINE.get()
        if deadline is not None:
            # cast: http.client reads nothing from its socket but makefile("rb").
            sock = cast(socket.socket, _DeadlineSocket(sock, deadline))
        super().__init__(sock, *args, **kwargs)


class _HTTPConnection(urllib3.connection.HTTPConnection):
    response_class = DeadlineHTTPResponse


class _HTTPSConnection(urllib3.connection.HTTPSConnection):
    response_class = DeadlineHTTPResponse


class _HTTPConnectionPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSConnectionPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


class HttpBackend:
    """Calls of the KServe v2 REST protocol on ``base_url`` (``http://host:port[/prefix]``)."""

    def __init__(
        self, base_url: str, *, max_connections: int = 8, tls: ClientTls | None = None
    ) -> None:
        self.server = base_url.rstrip("/")  # requests go here (with any user:password@) ...
        self._shown = redact_url(self.server)  # ... and messages show this (password ***)
        self._max_connections = max_connections
        # A TLS 1.3 client completes its handshake before the server checks the client's
        # certificate, so a server that wants one may just close the connection after the
        # request, before the client has read its alert: the drop then says nothing of TLS.
        self._drop_hint = (
            CLIENT_CERTIFICATE_HINT
            if self.server.startswith("https://") and (tls is None or tls.cert is None)
            else ""
        )
        self._pool = urllib3.PoolManager(
            num_pools=2,
            maxsize=max_connections,
            retries=False,
            **(tls.urllib3_options() if tls else {}),
        )
        # Connections whose answers are read within each call's deadline, headers included.
        self._pool.pool_classes_by_scheme = {
            "http": _HTTPConnectionPool,
            "https": _HTTPSConnectionPool,
        }

    # ------------------------------------------------------------------ plumbing
    def _request(
        self,
        method: str,
        path: str,
        *,
        timeout: float | None,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> _Answer:
        """One attempt, within ``timeout`` seconds in all (connect, headers and body: a server
        that sends its answer a byte at a time cannot stretch it)."""
        now = time.monotonic()
        started = _ATTEMPT_STARTED.get()
        deadline = None if timeout is None else (now if started is None else started) + timeout
        if deadline is not None and deadline <= now:  # spent waiting for a worker thread
            raise DeadlineExceededError(
                f"server {self._shown} did not answer {method} {path} within {timeout} s: the "
                f"call waited all that time for one of the client's {self._max_connections} "
                "connections (max_connections)"
            )
        try:
            # The answer's reads (status line and headers too) are bounded by the deadline.
            with answer_deadline(deadline):
                response = self._pool.request(
                    method,
                    self.server + path,
                    body=body,
                    headers=dict(headers or {}),
                    timeout=urllib3.Timeout(total=None if deadline is None else deadline - now),
                    retries=False,
                    redirect=False,
                    preload_content=False,
                )
            try:
                data = _read_before(response, deadline)
            except BaseException:
                # Close the connection: the rest of this answer, still on its way, must not be
                # read as the answer of the next request that reuses it from the pool.
                response.close()
                raise
            finally:
                response.release_conn()
        except SSLError as error:
            # The handshake failed: an untrusted certificate or a refused client
            # certificate. A retry would fail the same way.
            raise UnavailableError(
                f"TLS with server {self._shown} failed: {error}{tls_hint(str(error))}"
            ) from None
        except NewConnectionError as error:
            # Connect phase only: nothing was sent, a retry cannot run the request twice.
            failure = _connect_failure(error)
            if failure is not None:
                raise RetryableError(UnavailableError(f"server {self._shown} {failure}")) from None
            raise UnavailableError(f"cannot connect to server {self._shown}: {error}") from None
        except (Urllib3Timeout, TimeoutError):
            raise DeadlineExceededError(
                f"server {self._shown} did not answer {method} {path} within {timeout} s"
            ) from None
        except (ProtocolError, ConnectionError) as error:
            if answered_in_http2(error):  # the gRPC port: a retry gets the same frames
                raise UnavailableError(http2_hint(self._shown)) from None
            # The connection dropped before an answer (a server restarting, an idle pooled
            # connection closed): retried like gRPC's UNAVAILABLE; inference is idempotent.
            raise RetryableError(
                UnavailableError(
                    f"server {self._shown}: {method} {path} failed: {error}{self._drop_hint}"
                )
            ) from None
        except (HTTPError, OSError) as error:
            raise UnavailableError(
                f"server {self._shown}: {method} {path} failed: {error}"
            ) from None
        return _Answer(response.status, response.headers, data)

    def _error(self, response: _Answer) -> RecserveError | RetryableError:
        error = codec.http_error(self._shown, response.status, response.data)
        return RetryableError(error) if response.status == 503 else error

    def _ok(self, response: _Answer) -> _Answer:
        if response.status >= 300:
            raise self._error(response)
        return response

    def _flag(self, path: str, timeout: float | None) -> bool:
        """A KServe v2 health answer: 200 is true, 400 false (the spec's "4xx": recserve and
        Triton answer 400), and 503 false too (a proxy or a server refusing new work). 404
        (no such model or route) and anything else raise."""
        response = self._request("GET", path, timeout=timeout)
        if response.status == 200:
            return True
        if response.status in _HEALTH_FALSE_STATUSES:
            return False
        raise self._error(response)

    # ------------------------------------------------------------------ calls
    def live(self, timeout: float | None) -> bool:
        return self._flag("/v2/health/live", timeout)

    def ready(self, timeout: float | None) -> bool:
        return self._flag("/v2/health/ready", timeout)

    def model_ready(self, model: str, timeout: float | None) -> bool:
        return self._flag(f"/v2/models/{quote(model, safe='')}/ready", timeout)

    def metadata(self, model: str, timeout: float | None) -> ModelInfo:
        response = self._ok(
            self._request("GET", f"/v2/models/{quote(model, safe='')}", timeout=timeout)
        )
        return codec.model_info_from_json(codec.parse_json(response.data))

    def infer(
        self, model: str, tensors: Mapping[str, np.ndarray], timeout: float | None
    ) -> PredictResult:
        body, headers = codec.encode_http_infer(tensors, timeout=timeout)
        response = self._ok(
            self._request(
                "POST",
                f"/v2/models/{quote(model, safe='')}/infer",
                body=body,
                headers=headers,
                timeout=timeout,
            )
        )
        return codec.decode_http_infer(response.data, response.headers.get(codec.HEADER_LENGTH))

    def predict_rows(
        self, model: str, rows: Sequence[Mapping[str, Any]], timeout: float | None
    ) -> PredictResult:
        response = self._ok(
            self._request(
                "POST",
                f"/v1/models/{quote(model, safe='')}:predict",
                body=codec.encode_rows(rows),
                headers={"Content-Type": "application/json"},
                timeout=timeout,
            )
        )
        return codec.decode_rows_response(response.data)

    def close(self) -> None:
        self._pool.clear()
