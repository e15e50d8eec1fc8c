"""Request bodies of the HTTP front end: read size-capped, then content-decoded.

A body over ``max_bytes`` is refused (CapacityError -> 413) while it streams, or at once when
its Content-Length says so; a ``Content-Encoding`` is undone off the event loop, two bodies at a
time per loop, to at most :data:`DEFAULT_MAX_DECOMPRESSED_BYTES`.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from concurrent.futures import CancelledError

import anyio
import anyio.to_thread
from fastapi import Request
from starlette.requests import ClientDisconnect

from embedding_store.errors import CapacityError
from serving import http_decode


async def read_body(
    request: Request, max_bytes: int, max_decompressed_bytes: int | None = None
) -> bytes:
    """The request body, at most ``max_bytes`` (CapacityError -> 413), content-decoded.
    A client gone before its body was in raises CancelledError, as on the fast path
    (:class:`serving.http_fast_path.InferFastPath`): a cancelled request, not a server error."""
    try:
        return await read_chunks(
            request.stream(),
            request.headers.get("content-length"),
            request.headers.get("content-encoding"),
            max_bytes,
            max_decompressed_bytes,
        )
    except ClientDisconnect:  # Starlette's, an Exception: it was counted and logged as a 500
        raise CancelledError(CLIENT_GONE_MID_BODY) from None


#: What a request whose client disconnected before sending all its body is answered (never
#: sent: nobody is left to read it).
CLIENT_GONE_MID_BODY = "the client disconnected before sending its body"


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
