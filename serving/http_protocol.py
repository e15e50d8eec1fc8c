"""uvicorn's httptools protocol, answering small KServe v2 infer requests without ASGI.

At batch 1 a request's own work (decode, validation, its share of the batched model call) is
~100 us, and uvicorn's ASGI cycle around it (scope dict, proxy-headers middleware, request
and response messages, header re-validation, the ``Response`` object's send) added ~40 us more
on the one core the event loop has. :func:`infer_protocol` returns a subclass of uvicorn's
``HttpToolsProtocol`` that takes the common case off that path:

``POST /v2/models/{name}[/versions/{version}]/infer`` with a ``Content-Length`` body of at
most ``max_fast_body_bytes``, no ``Content-Encoding``, ``Transfer-Encoding``, ``Expect`` or
query string, on a connection with no request in progress. Its body is collected as the
parser hands it over, and one task runs the same :class:`~serving.http_app.InferHandler` as
the ASGI routes, then writes status line, headers and body in one write.

Everything else (other routes, large, compressed or chunked bodies, pipelined requests,
upgrades) takes uvicorn's ordinary ASGI path, through :class:`~serving.http_app.InferFastPath`
and the FastAPI app. Keep-alive, pipelining order, graceful shutdown (the task is one of the
server's tasks; a closing connection answers with ``connection: close``) and client
disconnects follow uvicorn's own rules, reusing its methods.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from serving.http_app import InferHandler, error_response

_INFER_PATH = re.compile(rb"/v2/models/([^/?%]+)(?:/versions/([^/?%]+))?/infer")
_HEADER_LENGTH = b"inference-header-content-length"
# Request headers that send a request down the ASGI path (it handles them in full).
_NOT_FAST = frozenset((b"content-encoding", b"transfer-encoding", b"expect", b"upgrade"))


class _NoEvent:
    """Stands in for the ASGI cycle's ``message_event``: nothing waits on a fast request."""

    def set(self) -> None:
        """uvicorn sets it on disconnect; the fast path checks ``disconnected`` instead."""


class _FastCycle:
    """The state uvicorn's protocol keeps in ``self.cycle``, for a request answered here."""

    __slots__ = ("body", "disconnected", "keep_alive", "response_complete")
    message_event = _NoEvent()

    def __init__(self, keep_alive: bool) -> None:
        self.body = bytearray()
        self.keep_alive = keep_alive
        self.disconnected = False
        self.response_complete = False


def infer_protocol(handler: InferHandler, max_fast_body_bytes: int) -> type[HttpToolsProtocol]:
    """A uvicorn HTTP protocol class (``uvicorn.Config(http=...)``) that answers small infer
    requests with ``handler`` directly; bodies over ``max_fast_body_bytes`` (or the handler's
    own limit) go through the ASGI app."""
    body_limit = min(max_fast_body_bytes, handler.max_body_bytes)

    class InferHttpToolsProtocol(HttpToolsProtocol):
        def on_headers_complete(self) -> None:
            cycle = self._fast_cycle()
            if cycle is None:
                super().on_headers_complete()
            else:
                self.cycle = cycle  # type: ignore[assignment]

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
                    header_length = value.decode("latin-1")
                elif name in _NOT_FAST:
                    return None
            if not 0 <= length <= body_limit:
                return None
            version = self.parser.get_http_version()
            cycle = _FastCycle(version != "1.0" and self.parser.should_keep_alive())
            self._fast_request = (
                match[1].decode("ascii"),
                None if match[2] is None else match[2].decode("ascii"),
                header_length,
            )
            return cycle

        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            if type(cycle) is _FastCycle:
                cycle.body += body  # at most body_limit bytes: Content-Length framed it
            else:
                super().on_body(body)

        def on_message_complete(self) -> None:
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

        async def _answer(
            self,
            cycle: _FastCycle,
            body: bytes,
            header_length: str | None,
            name: str,
            version: str | None,
        ) -> None:
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
