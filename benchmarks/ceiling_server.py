"""A KServe v2 infer endpoint that does no work: the ceiling of any Python ASGI server.

benchmarks/peers.py serves this with uvicorn (``--ceiling-workers`` processes, like a
``recserve serve --workers N`` variant) and drives it with the same locust profile as
recserve and TorchServe. It reads each request body and answers one fixed, valid KServe v2
response: no JSON decoding, validation, batching, embedding lookup or model. Its req/s is
therefore what uvicorn (uvloop + httptools) alone reaches under this load generator on this
machine, an upper bound for recserve or any other server written in Python on uvicorn.

With ``RECSERVE_CEILING_CHECKPOINT=DIR`` set it is the *model-only* server instead: every
request also runs DIR's dense model (TorchScript, one torch thread, sigmoid output as peers.py
serves it) on as many rows as the request's first ``"shape"`` gives. The embeddings of those
rows are looked up once, at the first request of that size, so a request costs uvicorn plus
the dense model's forward and nothing else: no decoding, no validation, no lookup, no merging
of requests. At batch sizes where a model call per request is as efficient as a merged one
(64 rows: ~10% dearer than 1024 on this machine's MLP), its req/s is what a Python server that
runs this model can reach here. peers.py starts it with ``--model-only-workers``.

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

#: Set to a checkpoint directory to run its dense model per request (the model-only server).
CHECKPOINT_ENV = "RECSERVE_CEILING_CHECKPOINT"
#: The most rows one request may ask the model-only server for.
MAX_ROWS = 4096
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
    """A checkpoint's dense model, run on ``rows`` rows whose embeddings were looked up once."""

    def __init__(self, checkpoint: str) -> None:
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
        self._inputs: dict[int, tuple[Any, Any]] = {}

    @staticmethod
    def rows_of(body: bytes) -> int | None:
        """The first input's batch size, from the JSON header at the start of ``body``."""
        match = _FIRST_SHAPE.search(body, 0, 4096)
        rows = int(match[1]) if match else 0
        return rows if 1 <= rows <= MAX_ROWS else None

    def run(self, rows: int) -> None:
        """One forward of the dense model over ``rows`` rows: float32 [rows, 1], dropped."""
        inputs = self._inputs.get(rows)
        if inputs is None:
            batch = self.model.example_batch(rows)
            inputs = self._inputs[rows] = (batch, self.model.lookup(batch)[0])
        self.model.forward(*inputs)


_model_only = ModelOnly(os.environ[CHECKPOINT_ENV]) if os.environ.get(CHECKPOINT_ENV) else None
