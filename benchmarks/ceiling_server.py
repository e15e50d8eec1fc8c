"""A KServe v2 infer endpoint that does no work: the ceiling of any Python ASGI server.

benchmarks/peers.py serves this with uvicorn (``--ceiling-workers`` processes, like a
``recserve serve --workers N`` variant) and drives it with the same locust profile as
recserve and TorchServe. It reads each request body and answers one fixed, valid KServe v2
response: no JSON decoding, validation, batching, embedding lookup or model. Its req/s is
therefore what uvicorn (uvloop + httptools) alone reaches under this load generator on this
machine, an upper bound for recserve or any other server written in Python on uvicorn.

With ``RECSERVE_CEILING_CHECKPOINT=DIR`` set it is the *model-only* server instead: it also
pays for DIR's dense model (TorchScript, one torch thread, sigmoid output as peers.py serves
it) as a server that merges requests would. It counts each request's rows (the first input's
``"shape"``) and, for every ``MERGED_ROWS`` rows counted, runs the model once on
``MERGED_ROWS`` rows (recserve's ``--max-batch-size`` in peers.py) whose embeddings were
looked up once at start-up. Nothing else: no decoding, no validation, no lookup, no queue.
Its req/s is thus what a Python server on uvicorn that runs this model on merged batches can
reach here, at most; its latencies mean nothing (answers never wait for the model).
peers.py starts it with ``--model-only-workers``.

Run by hand: ``python -m uvicorn ceiling_server:app --app-dir benchmarks --port 8000``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

#: A checkpoint directory: the server then pays for its dense model (the model-only server).
CHECKPOINT_ENV = "RECSERVE_CEILING_CHECKPOINT"
#: The most rows one request may ask the model-only server for.
MAX_ROWS = 4096
#: Rows per dense-model call of the model-only server: recserve's --max-batch-size in peers.py.
MERGED_ROWS = 1024
#: ``"shape":[N`` of the first input: both KServe v2 encodings start with the JSON header.
_FIRST_SHAPE = re.compile(rb'"shape"\s*:\s*\[\s*(\d{1,6})')

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
    chunks = []
    more_body = True
    while more_body:  # read the whole body, as a real server must
        message = await receive()
        chunks.append(message.get("body", b""))
        more_body = message.get("more_body", False)
    if _model_only is not None and scope.get("method") == "POST":
        rows = _model_only.rows_of(b"".join(chunks))
        if rows is None:
            await send({"type": "http.response.start", "status": 400, "headers": _ERROR_HEADERS})
            await send({"type": "http.response.body", "body": _ERROR})
            return
        _model_only.run(rows)
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    await send({"type": "http.response.body", "body": RESPONSE})


_ERROR = json.dumps(
    {"error": f'model-only server: no "shape":[rows (1..{MAX_ROWS}) in the request'}
).encode()
_ERROR_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(_ERROR)).encode()),
]


class ModelOnly:
    """A checkpoint's dense model, paid for per request as if requests were merged."""

    def __init__(self, checkpoint: str, merged_rows: int = MERGED_ROWS) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import torch

        from serving.model import load_model

        torch.set_num_threads(1)  # as `recserve serve` runs it (its --threads default)
        self.model = load_model(checkpoint, name="model", output_transform="sigmoid")
        first = next(iter(self.model.signature.id_features), None)
        if first is not None and not first.single_id:
            raise ValueError(
                f"model-only server: the first input {first.name!r} is a list of IDs, so its "
                "shape does not give the batch size"
            )
        batch = self.model.example_batch(merged_rows)
        self._merged = (batch, self.model.lookup(batch)[0])
        self.merged_rows = merged_rows
        self.pending_rows = 0  # counted, not yet paid for
        self.calls = 0

    @staticmethod
    def rows_of(body: bytes) -> int | None:
        """The first input's batch size, from the JSON header at the start of ``body``."""
        match = _FIRST_SHAPE.search(body, 0, 4096)
        rows = int(match[1]) if match else 0
        return rows if 1 <= rows <= MAX_ROWS else None

    def run(self, rows: int) -> None:
        """Count ``rows``; for every ``merged_rows`` counted, one forward of the dense model
        over ``merged_rows`` rows (its float32 [merged_rows, 1] answer is dropped)."""
        self.pending_rows += rows
        while self.pending_rows >= self.merged_rows:
            self.model.forward(*self._merged)
            self.pending_rows -= self.merged_rows
            self.calls += 1


_model_only = ModelOnly(os.environ[CHECKPOINT_ENV]) if os.environ.get(CHECKPOINT_ENV) else None
