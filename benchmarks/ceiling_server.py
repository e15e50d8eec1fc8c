"""A KServe v2 infer endpoint that does no work: the ceiling of any Python ASGI server.

benchmarks/peers.py serves this with uvicorn (``--ceiling-workers`` processes, like a
``recserve serve --workers N`` variant) and drives it with the same locust profile as
recserve and TorchServe. It reads each request body and answers one fixed, valid KServe v2
response: no JSON decoding, validation, batching, embedding lookup or model. Its req/s is
therefore what uvicorn (uvloop + httptools) alone reaches under this load generator on this
machine, an upper bound for recserve or any other server written in Python on uvicorn.

Run by hand: ``python -m uvicorn ceiling_server:app --app-dir benchmarks --port 8000``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

#: A KServe v2 answer of one prediction (batch-64 answers are ~0.6 KB longer: negligible).
RESPONSE = json.dumps(
    {
        "model_name": "model",
        "model_version": "ceiling",
        "outputs": [{"name": "prediction", "datatype": "FP32", "shape": [1, 1], "data": [0.5]}],
    },
    separators=(",", ":"),
).encode()
_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(RESPONSE)).encode()),
]

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """Raw ASGI: lifespan events are acknowledged, every HTTP request answered 200."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    more_body = True
    while more_body:  # read (and drop) the whole body, as a real server must
        message = await receive()
        more_body = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    await send({"type": "http.response.body", "body": RESPONSE})
