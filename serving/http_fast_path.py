"""Raw ASGI fast path of the KServe v2 infer routes, in front of the FastAPI app.

:class:`InferFastPath` answers ``POST /v2/models/{name}[/versions/{version}]/infer`` without
FastAPI's per-request machinery (the server runs it in front of the app); it and the app's
routes share one :class:`InferHandler`.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import CancelledError
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from serving import http_decode
from serving.http_body import CLIENT_GONE_MID_BODY, DEFAULT_MAX_DECOMPRESSED_BYTES, read_chunks
from serving.http_responses import error_response, json_response, note_request


class ClientGone:
    """What gRPC's ``context.add_callback`` is to the core (:data:`serving.service.CancelHook`),
    for an HTTP request: :meth:`add_callback` registers a callback run once the client has
    disconnected (False when it already has); :meth:`disconnected` runs them. Thread-safe:
    callbacks are registered from the thread that waits for the core."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.gone = False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self.gone:
                return False
            self._callbacks.append(callback)
            return True

    def disconnected(self) -> None:
        with self._lock:
            if self.gone:
                return
            self.gone = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


async def _until_disconnected(receive: Receive) -> None:
    """Return once the client has disconnected. The request's body was read in full, so what
    ``receive`` gives next is ``http.disconnect`` (uvicorn: when the connection is lost, or
    once the response is sent, by when this is cancelled); anything else means this server
    cannot tell, and this waits to be cancelled."""
    message = await receive()
    if message["type"] != "http.disconnect":
        await asyncio.get_running_loop().create_future()  # never done: cancelled


async def answer_unless_gone(
    receive: Receive, answer: Callable[[ClientGone], Awaitable[Response]]
) -> Response:
    """``await answer(gone)`` while watching ``receive`` for the client's disconnect: if it
    goes first, ``gone`` runs its callbacks (a request queued for the dispatcher thread is
    dropped) and the answer's task is cancelled (one queued on the event loop is); the
    response returned then is never sent. For the ASGI path, where uvicorn does not cancel a
    request's task when its connection is lost (the fast protocol does)."""
    gone = ClientGone()
    work = asyncio.ensure_future(answer(gone))
    watch = asyncio.ensure_future(_until_disconnected(receive))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # this task was cancelled (a shutdown): so are both
        watch.cancel()
        work.cancel()
        raise
    if watch.done():
        if not watch.cancelled():
            watch.exception()  # retrieved: a receive that failed means the client is gone
    else:
        watch.cancel()
    if work.done():
        return work.result()
    gone.disconnected()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)  # ends once the core let it go
    return client_gone_response()


def client_gone_response() -> Response:
    """What a request whose client went away before its answer returns (never sent)."""
    return json_response({"error": "the client disconnected before its answer"}, 400)


@dataclass(frozen=True)
class InferHandler:
    """What the infer routes do after reading the body: ``handle(body, header_length, name,
    version[, gone]) -> Response`` (never raises: errors become their ``{"error": ...}``
    answers; ``gone``, a :class:`ClientGone`, tells the core when the client disconnected).
    ``record_rejected(name, error)``, when given, counts a request for model ``name`` refused
    before ``handle`` (its body or head could not be read, or was too large) as the core
    counts the requests it refuses."""

    handle: Callable[..., Awaitable[Response]]
    max_body_bytes: int
    max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES
    record_rejected: Callable[[str, BaseException], None] | None = None


_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")


class InferFastPath:
    """ASGI app that answers ``POST /v2/models/{name}[/versions/{version}]/infer`` itself and
    hands every other request to ``app`` (the FastAPI app of :func:`serving.http_app.create_app`).

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
                    raise CancelledError(CLIENT_GONE_MID_BODY)
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
            if self.handler.record_rejected is not None and not refused_by_protocol(receive):
                self.handler.record_rejected(name, gone)
            return json_response({"error": str(gone)}, 400)
        except Exception as error:
            if self.handler.record_rejected is not None:
                self.handler.record_rejected(name, error)
            return error_response(error)
        header_length = header(_HEADER_LENGTH_KEY)
        handle = self.handler.handle
        return await answer_unless_gone(
            receive, lambda gone: handle(body, header_length, name, version, gone)
        )


_HEADER_LENGTH_KEY = http_decode.HEADER_LENGTH.lower().encode("latin-1")

#: Set (True) by the HTTP protocol on a request's ASGI cycle when it cut the request short
#: and counted it (serving.http_protocol): the app then does not count it a second time.
REFUSED_MARK = "recserve_refused"


def refused_by_protocol(receive: Receive) -> bool:
    """Whether the HTTP protocol cut short, and counted, the request whose ASGI ``receive``
    this is (it marks the request's cycle, whose method ``receive`` is, with
    :data:`REFUSED_MARK`)."""
    return bool(getattr(getattr(receive, "__self__", None), REFUSED_MARK, False))
