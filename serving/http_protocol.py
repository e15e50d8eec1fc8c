"""uvicorn's httptools protocol, answering small KServe v2 infer requests without ASGI.

At batch 1 a request's own work (decode, validation, its share of the batched model call) is
~100 us, and uvicorn's ASGI cycle around it (scope dict, proxy-headers middleware, request
and response messages, header re-validation, the ``Response`` object's send) added ~40 us more
on the one core the event loop has. :func:`infer_protocol` returns a subclass of uvicorn's
``HttpToolsProtocol`` that takes the common case off that path:

``POST /v2/models/{name}[/versions/{version}]/infer`` with a ``Content-Length`` body of at
most ``max_fast_body_bytes``, no ``Content-Encoding``, ``Transfer-Encoding``, ``Expect`` or
query string, on a connection with no request in progress. Its body is collected as the
parser hands it over, and one task runs the same :class:`~serving.http_fast_path.InferHandler` as
the ASGI routes, then writes status line, headers and body in one write.

Everything else (other routes, large, compressed or chunked bodies, pipelined requests)
takes uvicorn's ordinary ASGI path, through :class:`~serving.http_fast_path.InferFastPath`
and the FastAPI app. Keep-alive, pipelining order, graceful shutdown (the task is one of the
server's tasks; a closing connection answers with ``connection: close``) and client
disconnects follow uvicorn's own rules, reusing its methods.

On every connection, fast or not, the protocol also guards what uvicorn's leaves open:

- A request line plus headers over :data:`MAX_HEAD_BYTES` is answered 431 and closed (the
  parser would otherwise keep concatenating them, in quadratic time, on the event loop).
- A connection that sends nothing is closed after uvicorn's keep-alive timeout, as an idle
  one is after a response; a request whose head and body are not all in within
  ``read_timeout`` seconds of its first byte is answered 408 and closed (slow clients would
  otherwise hold their sockets, and the process's file descriptors, forever).
- Beyond ``max_connections`` open connections, a new one is answered 503 at its first bytes
  and closed (nothing of it is parsed); beyond ``max_body_bytes_in_flight`` bytes of bodies
  being read, counted from ``Content-Length`` when a request's head is in (a chunked body
  counts as the largest allowed), a request is answered 503 without its body being kept
  (the rest of it is read and dropped). Together with ``max_body_bytes`` they bound the
  memory clients can make one process hold; each costs a comparison and a counter per
  connection or request.
- Malformed HTTP gets a 400 with a JSON ``{"error": ...}`` naming the parser's complaint.
- A client that half-closes its side right after a request still gets the answer (over
  plain TCP: asyncio's SSL transport closes a TLS connection on EOF).
- A request asking to switch protocols (``Connection: upgrade`` with ``Upgrade: h2c`` from
  ``curl --http2``, or ``websocket``) is answered over HTTP/1.1 as if it had not asked, body
  included (llhttp would drop the body and every later byte); CONNECT is answered 405.

Over HTTPS (``recserve serve --tls-cert``) asyncio's SSL transport sits below the protocol;
every path here reads and writes through ``self.transport`` only, so all of this holds there.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import httptools
import orjson
from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from embedding_store.errors import (
    CapacityError,
    DeadlineExceededError,
    InvalidArgumentError,
    RecserveError,
    UnavailableError,
)
from serving.http_fast_path import REFUSED_MARK, InferHandler
from serving.http_responses import error_response, note_request

#: The most bytes a request line plus headers may take (431 above it).
MAX_HEAD_BYTES = 64 * 1024
#: Default seconds from a request's first byte to its last (408 after it).
DEFAULT_READ_TIMEOUT = 60.0

_INFER_PATH = re.compile(rb"/v2/models/([^/?%]+)(?:/versions/([^/?%]+))?/infer")
#: The prediction routes (KServe v2 infer, the friendly predict) whose requests this layer
#: counts when it refuses them, the model name (percent-encoded) their first group.
_PREDICTION_PATHS = (
    re.compile(rb"/v2/models/([^/?]+)(?:/versions/[^/?]+)?/infer"),
    re.compile(rb"/v1/models/([^/?]+):predict"),
)
_HEADER_LENGTH = b"inference-header-content-length"
# Request headers that send a request down the ASGI path (it handles them in full).
_NOT_FAST = frozenset((b"content-encoding", b"transfer-encoding", b"expect", b"upgrade"))
_HTTP2_HERE = (
    "this port speaks HTTP/1.1 only, and this is an HTTP/2 connection preface: send "
    "HTTP/1.1 here, and gRPC to the server's gRPC port"
)
#: The error class a refusal of this layer is counted as (outcome label of a prediction request):
#: these statuses are the HTTP layer's own, with no class of their own in the error table.
_REFUSED_AS: dict[int, type[RecserveError]] = {
    400: InvalidArgumentError,  # malformed HTTP
    408: DeadlineExceededError,  # not all in within the read timeout
    431: CapacityError,  # head too large
    503: UnavailableError,  # over max_body_bytes_in_flight
}
#: ``on_refused``'s reasons: over ``max_connections``, over ``max_body_bytes_in_flight``.
REFUSED_REASONS = ("connections", "body_bytes")


class _NoEvent:
    """Stands in for the ASGI cycle's ``message_event``: nothing waits on a fast request."""

    def set(self) -> None:
        """uvicorn sets it on disconnect; the fast path checks ``disconnected`` instead."""


class _FastCycle:
    """The state uvicorn's protocol keeps in ``self.cycle``, for a request answered here."""

    __slots__ = ("body", "disconnected", "keep_alive", "response_complete", "task")
    message_event = _NoEvent()

    def __init__(self, keep_alive: bool) -> None:
        self.body = bytearray()
        self.keep_alive = keep_alive
        self.disconnected = False
        self.response_complete = False
        self.task: asyncio.Task | None = None  # the handler's, once the body is in


class _ReadDeadlines:
    """Closes, with a 408, connections whose request has been coming in for longer than
    ``timeout`` seconds: one timer per event loop, ticking while it has connections, instead
    of a timer per request."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._ticking: dict[asyncio.AbstractEventLoop, set[Any]] = {}

    def watch(self, loop: asyncio.AbstractEventLoop, connections: set[Any]) -> None:
        """Start ticking on ``loop`` over the server's ``connections`` if not already."""
        if loop not in self._ticking:
            self._ticking[loop] = connections
            loop.call_later(self._period, self._tick, loop)

    @property
    def _period(self) -> float:
        return min(1.0, self.timeout / 4)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        connections = self._ticking.get(loop)
        if not connections:  # none left: the next connection starts the timer again
            self._ticking.pop(loop, None)
            return
        expired = loop.time() - self.timeout
        for protocol in list(connections):
            since = getattr(protocol, "reading_since", None)
            if since is not None and since < expired:
                protocol.reject(
                    408,
                    f"the request was not received within {self.timeout:g} s of its first "
                    "byte; the connection is closed",
                )
        loop.call_later(self._period, self._tick, loop)


class _BodyBudget:
    """Bytes of request bodies being read by one server (its connections share one loop)."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0


def _refusal_app(status: int, message: str) -> Callable[..., Any]:
    """An ASGI app answering every request ``status`` with ``{"error": message}``, without
    reading its body (uvicorn drops what arrives once the response is complete)."""
    body = orjson.dumps({"error": message})
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
    ]

    async def refuse(scope: dict, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return refuse


def infer_protocol(
    handler: InferHandler,
    max_fast_body_bytes: int,
    *,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
    max_connections: int | None = None,
    max_body_bytes_in_flight: int | None = None,
    on_refused: Callable[[str], None] | None = None,
) -> type[HttpToolsProtocol]:
    """A uvicorn HTTP protocol class (``uvicorn.Config(http=...)``) that answers small infer
    requests with ``handler`` directly; bodies over ``max_fast_body_bytes`` (or the handler's
    own limit) go through the ASGI app. ``read_timeout``: seconds a request may take to
    arrive, from its first byte (408 after it). ``max_connections``: open connections of the
    server (a new one beyond them is answered 503 and closed); ``max_body_bytes_in_flight``:
    bytes of bodies being read at once (a request beyond them is answered 503); None: no
    limit. ``on_refused(reason)`` is called for each refusal of these two (a reason of
    :data:`REFUSED_REASONS`)."""
    body_limit = min(max_fast_body_bytes, handler.max_body_bytes)
    deadlines = _ReadDeadlines(read_timeout)
    # Bodies over the handler's limit are refused at once (413), never held: they reserve
    # nothing, and chunked ones (their size unknown) reserve the most one may hold.
    largest_body = handler.max_body_bytes
    budget = _BodyBudget(max_body_bytes_in_flight or 2**62)
    too_many_connections = (
        f"this server process has its limit of {max_connections} connections open "
        "(--max-connections); the connection is closed: retry later, or on another server"
    )
    too_many_bytes = (
        f"the request bodies this server process is reading would exceed "
        f"{max_body_bytes_in_flight} bytes at once (--max-body-bytes-in-flight): retry "
        "later, or on another server"
    )
    busy_app = _refusal_app(503, too_many_bytes)

    class InferHttpToolsProtocol(HttpToolsProtocol):
        #: The body bytes this server's connections hold now (read it, never write it): for
        #: operators' debugging and for tests that must know the budget is taken.
        @staticmethod
        def body_bytes_in_flight() -> int:
            return budget.used

        # ------------------------------------------------------------ connection guards
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.reading_since: float | None = None  # loop time of the request's first byte
            self._in_head = False
            self._head_bytes = 0
            self._messages = 0
            self._cycle_of = 0  # which request (by _messages) self.cycle is for
            self._eof = False
            self._upgrading = False  # the request being parsed asks to switch protocols
            self._in_body = False  # between a request's head and its end (it has a cycle)
            self._refusal: tuple[int, str] | None = None  # waiting for earlier answers
            self._ignored_upgrade: bytes | None = None  # its head without that, to read again
            self._body_reserved = 0  # bytes of the budget the request being read holds
            self._refused_on_arrival = False
            if max_connections is not None and len(self.connections) > max_connections:
                # Answered at its first bytes (a response before any request would reach
                # the client as an unsolicited one), and parsed no further; an idle one is
                # closed by the keep-alive timer below.
                self._refusal = (503, too_many_connections)
                self._refused_on_arrival = True
                if on_refused is not None:
                    on_refused("connections")
            # Idle until the first request as after a response: uvicorn's keep-alive timer.
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            deadlines.watch(self.loop, self.connections)

        def data_received(self, data: bytes) -> None:
            # uvicorn's, with JSON errors and the head counted.
            if self._refusal is not None:
                # The connection ends with that refusal: nothing more is parsed.
                if self._refused_on_arrival and not self.transport.is_closing():
                    self._write_refusal(*self._refusal)
                return
            self._unset_keepalive_if_required()
            in_head, messages = self._in_head, self._messages
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade as upgrade:
                self._parse_without_upgrade(data, upgrade)
                return
            except httptools.HttpParserError as error:
                if not self.transport.is_closing():  # a callback may have answered already
                    if self.parser.get_method() == b"PRI":
                        # The HTTP/2 connection preface: a gRPC client (or an HTTP/2 one)
                        # on the HTTP port. llhttp's own words are "Pause on PRI/Upgrade".
                        self.reject(400, _HTTP2_HERE)
                    else:
                        self.reject(400, f"malformed HTTP request: {error}")
                return
            # Count only chunks that were head from start to end (a chunk that also ended
            # the previous request is not counted: off by less than one chunk, never over).
            if self._in_head and in_head and messages == self._messages:
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                    self.reject(
                        431,
                        f"the request line and headers exceed {MAX_HEAD_BYTES} bytes",
                    )

        # ------------------------------------------------------------ upgrades
        def _should_upgrade(self) -> bool:
            """Never: this server speaks HTTP/1.1 only (no WebSocket route, no h2c)."""
            return False

        def _head_without_upgrade(self) -> bytes:
            """The head of the request being parsed, minus ``Upgrade`` and the ``upgrade``
            token of ``Connection``: what a fresh parser reads as a plain HTTP/1.1 request."""
            version = self.parser.get_http_version().encode("ascii")
            lines = [self.parser.get_method() + b" " + self.url + b" HTTP/" + version]
            for name, value in self.headers:
                if name == b"upgrade":
                    continue
                if name == b"connection":
                    tokens = [t.strip() for t in value.split(b",")]
                    value = b", ".join(t for t in tokens if t and t.lower() != b"upgrade")
                    if not value:
                        continue
                lines.append(name + b": " + value)
            return b"\r\n".join(lines) + b"\r\n\r\n"

        def _parse_without_upgrade(self, data: bytes, upgrade: httptools.HttpParserUpgrade) -> None:
            """llhttp stops at the head of a request that asks to switch protocols
            (``Connection: upgrade`` plus ``Upgrade``, e.g. h2c from ``curl --http2``, or
            CONNECT): it completes the message without its body and takes every later byte
            for the new protocol. The server switches to none: as RFC 9110 7.8 allows, it
            ignores the header, and a fresh parser reads the request again without it, then
            its body and whatever follows. CONNECT is refused (405)."""
            head, self._ignored_upgrade = self._ignored_upgrade, None
            if head is None:  # CONNECT (or nothing to read again)
                method = self.parser.get_method().decode("latin-1")
                self.reject(405, f"method {method} is not supported")
                return
            self.parser = httptools.HttpRequestParser(self)
            with contextlib.suppress(AttributeError):  # httptools < 0.6.3, as uvicorn
                self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
            offset = upgrade.args[0] if upgrade.args else len(data)
            self.data_received(head + data[offset:])

        def send_400_response(self, msg: str) -> None:
            self.reject(400, msg)

        def reject(self, status: int, message: str) -> None:
            """Answer ``status`` with ``{"error": message}`` and close the connection. A
            prediction request (infer or friendly) cut short this way is counted as refused
            (``record_rejected``)."""
            in_request, self.reading_since = self.reading_since is not None, None
            if self.transport.is_closing() or self._refusal is not None:
                return
            if self._answered_already():
                # The app answered before the body was in (a 405 on a route that takes no
                # body): a second response would reach the client as an unsolicited one.
                self.transport.close()
                return
            if in_request and self._count_refused(status, message):
                cycle = self.cycle
                if self._cycle_of == self._messages and not isinstance(cycle, _FastCycle):
                    # The app is reading this request's body: it must not count it again.
                    setattr(cycle, REFUSED_MARK, True)
            cycle = self.cycle
            if not self._in_body and cycle is not None and not cycle.response_complete:
                # Refused in its head, pipelined behind requests not answered yet: answers
                # go out in request order, or the client would read this one as theirs.
                # Written once they are (on_response_complete); nothing more is read.
                self._refusal = (status, message)
                self.flow.pause_reading()
                return
            self._write_refusal(status, message)

        def _write_refusal(self, status: int, message: str) -> None:
            """Write ``status`` with ``{"error": message}`` and close the connection."""
            body = orjson.dumps({"error": message})
            content: list[bytes] = [STATUS_LINE[status]]
            for name, value in self.server_state.default_headers:
                content += (name, b": ", value, b"\r\n")
            content += (
                b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body),
                b"connection: close\r\n\r\n",
                body,
            )
            self.transport.write(b"".join(content))
            self.transport.close()

        def _answered_already(self) -> bool:
            """Whether the request coming in now has had its response started."""
            cycle = self.cycle
            return (
                cycle is not None
                and self._cycle_of == self._messages
                and (getattr(cycle, "response_started", False) or cycle.response_complete)
            )

        def _count_refused(self, status: int, message: str) -> bool:
            """Count the request coming in, refused with ``status``, if it is a prediction
            request; whether it was counted."""
            path = getattr(self, "url", b"").partition(b"?")[0]
            refused_as = _REFUSED_AS.get(status)
            if refused_as is None or handler.record_rejected is None:
                return False
            for route in _PREDICTION_PATHS:
                match = route.fullmatch(path)
                if match is not None:
                    # The name as the app reads it (ASGI paths are percent-decoded).
                    name = unquote(match[1].decode("latin-1"))
                    handler.record_rejected(name, refused_as(message))
                    return True
            return False

        def on_message_begin(self) -> None:
            self._upgrading = False
            super().on_message_begin()
            self.reading_since = self.loop.time()
            self._in_head = True
            self._head_bytes = 0
            self._messages += 1

        # asyncio.Protocol.eof_received may return True to keep the transport open; uvicorn
        # annotates its override as returning None, narrower than the protocol it implements.
        def eof_received(self) -> bool | None:  # type: ignore[override]
            if self.scheme == "https":
                # asyncio's SSL transport closes on EOF whatever this returns (and logs a
                # warning for True): over TLS a half-close ends the connection.
                return None
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete and self.reading_since is None:
                # Half-closed after a whole request: keep the socket open to answer it.
                self._eof = True
                return True
            return None  # nothing to answer (or a request cut short): close

        def on_response_complete(self) -> None:
            super().on_response_complete()
            cycle = self.cycle
            if (
                self._refusal is not None
                and cycle.response_complete
                and not self.transport.is_closing()
            ):
                # Every request before the refused one is answered (self.cycle is the last
                # of them, and answers complete in order): its refusal goes out now.
                status, message = self._refusal
                self._write_refusal(status, message)
                return
            if self._eof and not self.transport.is_closing() and cycle.response_complete:
                self.transport.close()

        # ------------------------------------------------------------ fast infer path
        def on_headers_complete(self) -> None:
            self._in_head = False
            if self.parser.should_upgrade():
                # Read again without the upgrade (_parse_without_upgrade): nothing starts
                # now, and llhttp's bodiless completion of this message is ignored.
                connect = self.parser.get_method() == b"CONNECT"
                self._ignored_upgrade = None if connect else self._head_without_upgrade()
                self._upgrading = True
                return
            self._cycle_of = self._messages  # the request self.cycle belongs to
            self._in_body = True
            cycle = self._fast_cycle()
            reserve = self._fast_length if cycle is not None else self._body_reservation()
            if reserve:
                if budget.used + reserve > budget.limit:
                    self._refuse_body()
                    return
                budget.used += reserve
                self._body_reserved = reserve
            if cycle is None:
                super().on_headers_complete()
            else:
                self.cycle = cycle  # type: ignore[assignment]

        def _body_reservation(self) -> int:
            """Bytes the body of the request whose head is in may hold: its Content-Length,
            the most allowed when chunked, 0 when over that (refused at once, 413)."""
            length = 0
            for name, value in self.headers:
                if name == b"content-length":
                    length = int(value) if value.isdigit() else 0
                elif name == b"transfer-encoding":
                    return largest_body
            return length if length <= largest_body else 0

        def _refuse_body(self) -> None:
            """Answer the request whose head is in 503 (over the body budget), through the
            ASGI path: uvicorn keeps answers in request order and drops the body."""
            if on_refused is not None:
                on_refused("body_bytes")
            self._count_refused(503, too_many_bytes)
            app, self.app = self.app, busy_app
            try:
                super().on_headers_complete()
            finally:
                self.app = app

        def _release_body(self) -> None:
            """Give back the budget the request being read holds (it is in, or gone)."""
            budget.used -= self._body_reserved
            self._body_reserved = 0

        def _fast_cycle(self) -> _FastCycle | None:
            """A cycle for a request this protocol answers itself, else None."""
            previous = self.cycle
            if (previous is not None and not previous.response_complete) or (
                self.limit_concurrency is not None
            ):
                return None  # pipelined behind another request, or admission control is on
            if self.parser.get_method() != b"POST":
                return None
            match = _INFER_PATH.fullmatch(self.url)
            if match is None:
                return None
            length = -1
            header_length = None
            for name, value in self.headers:
                if name == b"content-length":
                    length = int(value) if value.isdigit() else -1
                elif name == _HEADER_LENGTH:
                    text = value.decode("latin-1")
                    # Repeated: combined as RFC 9110 does, so the decoder refuses it.
                    header_length = text if header_length is None else f"{header_length}, {text}"
                elif name in _NOT_FAST:
                    return None
            if not 0 <= length <= body_limit:
                return None
            version = self.parser.get_http_version()
            cycle = _FastCycle(version != "1.0" and self.parser.should_keep_alive())
            self._fast_length = length
            self._fast_request = (
                match[1].decode("ascii"),
                None if match[2] is None else match[2].decode("ascii"),
                header_length,
            )
            return cycle

        def on_body(self, body: bytes) -> None:
            if self._upgrading:
                return
            cycle = self.cycle
            if type(cycle) is _FastCycle:
                cycle.body += body  # at most body_limit bytes: Content-Length framed it
            else:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self._upgrading:
                return  # not all in: it is read again (_parse_without_upgrade)
            reserved = self._body_reserved
            if reserved:  # the body is in: what it holds now is the queue's to bound
                budget.used -= reserved
                self._body_reserved = 0
            self.reading_since = None
            self._in_body = False
            cycle = self.cycle
            if type(cycle) is not _FastCycle:
                super().on_message_complete()
                return
            name, version, header_length = self._fast_request
            task = self.loop.create_task(
                self._answer(cycle, bytes(cycle.body), header_length, name, version)
            )
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)  # graceful shutdown waits for it, as for ASGI tasks
            cycle.task = task

        def connection_lost(self, exc: Exception | None) -> None:
            if self._body_reserved:  # cut short while its body came in
                self._release_body()
            cycle = self.cycle
            if type(cycle) is _FastCycle and not cycle.response_complete and cycle.task:
                # Nobody is left to answer: a request still queued is dropped before its
                # merged batch runs (its future is cancelled) and counted as cancelled.
                cycle.task.cancel()
            super().connection_lost(exc)

        async def _answer(
            self,
            cycle: _FastCycle,
            body: bytes,
            header_length: str | None,
            name: str,
            version: str | None,
        ) -> None:
            versioned = "" if version is None else f"/versions/{version}"
            note_request("POST", f"/v2/models/{name}{versioned}/infer")  # for a 500's log line
            try:
                response = await handler.handle(body, header_length, name, version)
            except Exception as error:  # the handler answers errors itself: a bug, logged
                response = error_response(error)
            if cycle.disconnected or self.transport.is_closing():
                return
            self._write(cycle, response)

        def _write(self, cycle: _FastCycle, response: Response) -> None:
            content: list[Any] = [STATUS_LINE[response.status_code]]
            for name, value in self.server_state.default_headers:  # date, server
                content += (name, b": ", value, b"\r\n")
            for name, value in response.raw_headers:  # content-length, content-type, ...
                content += (name, b": ", value, b"\r\n")
            if not cycle.keep_alive:  # HTTP/1.0, "connection: close", or shutting down
                content.append(b"connection: close\r\n")
            content += (b"\r\n", response.body)
            self.transport.write(b"".join(content))
            cycle.response_complete = True
            if not cycle.keep_alive:
                self.transport.close()
            self.on_response_complete()  # resume reading, start a pipelined request, keep-alive

    return InferHttpToolsProtocol


def protocol_is_supported() -> bool:
    """Whether this uvicorn's HttpToolsProtocol has the members the subclass relies on."""
    needed = ("on_headers_complete", "on_body", "on_message_complete", "on_response_complete")
    return all(hasattr(HttpToolsProtocol, member) for member in needed) and bool(STATUS_LINE)
