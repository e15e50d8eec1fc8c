"""Locust users for recserve serving: KServe v2 over HTTP (binary and JSON), the friendly JSON
route, and KServe v2 over gRPC; plus TorchServe users (JSON and binary) for benchmarks/peers.py.

Traffic comes from :mod:`load_tests.traffic`, built against the served model's metadata
(``GET /v2/models/{name}``), so the same file drives the Adult model and the synthetic
Criteo-like one. Request names carry the batch size (``v2-binary b64``) so locust's stats split
by it. Run through ``load_tests/run.py``, or by hand::

    RECSERVE_LT_GRPC=127.0.0.1:8001 locust -f load_tests/locustfile.py --headless \\
        -u 8 -r 8 -t 30s --host http://127.0.0.1:8000 KServeBinaryUser GrpcUser

Settings (environment):

* ``RECSERVE_LT_MODEL``: model name (default ``model``);
* ``RECSERVE_LT_GRPC``: gRPC HOST:PORT (needed by :class:`GrpcUser`);
* ``RECSERVE_LT_VOCAB``: ``.npz`` of known IDs per slot (load_tests/run.py writes one from
  the checkpoint); without it IDs are ``0 .. 9999``;
* ``RECSERVE_LT_BATCHES``: batch size mix, ``SIZE:WEIGHT,...`` (default ``1:6,8:3,64:1``);
* ``RECSERVE_LT_UNKNOWN``: share of unknown IDs (default 0.02); ``RECSERVE_LT_ZIPF``: Zipf
  exponent (default 1.1); ``RECSERVE_LT_SEED``;
* ``RECSERVE_LT_WAIT``: seconds each user waits between requests (default 0: closed loop);
* ``RECSERVE_LT_METADATA_FILE`` / ``RECSERVE_LT_METADATA_URL``: the model metadata JSON (a
  file, or a recserve base URL) when ``--host`` is not a recserve server (TorchServe);
* ``RECSERVE_LT_TS_MODEL``: TorchServe model name (default: ``RECSERVE_LT_MODEL``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from locust import FastHttpUser, User, constant, task
from locust.contrib.fasthttp import ResponseContextManager

try:  # gRPC's own threads must cooperate with locust's gevent loop
    import grpc.experimental.gevent as grpc_gevent

    grpc_gevent.init_gevent()
except (ImportError, AttributeError):  # pragma: no cover - depends on the grpcio build
    pass

from load_tests import traffic

MODEL = os.environ.get("RECSERVE_LT_MODEL", "model")
WAIT = float(os.environ.get("RECSERVE_LT_WAIT", "0"))
POOL_PER_SIZE = int(os.environ.get("RECSERVE_LT_POOL", "64"))

_pools: dict[str, traffic.PayloadPool] = {}
_inputs: list[traffic.ModelInputs] = []


def model_inputs(host: str) -> traffic.ModelInputs:
    """The served model's inputs, read once per load-generator process."""
    if not _inputs and os.environ.get("RECSERVE_LT_METADATA_FILE"):
        metadata = json.loads(Path(os.environ["RECSERVE_LT_METADATA_FILE"]).read_text())
        _inputs.append(traffic.ModelInputs.from_metadata(metadata))
    if not _inputs:
        base = os.environ.get("RECSERVE_LT_METADATA_URL") or host
        for attempt in range(20):
            try:
                metadata = traffic.fetch_metadata(base, MODEL)
                break
            except OSError:
                if attempt == 19:
                    raise
                time.sleep(0.5)
        if not _inputs:
            _inputs.append(traffic.ModelInputs.from_metadata(metadata))
    return _inputs[0]


def payload_pool(kind: str, host: str) -> traffic.PayloadPool:
    """A pool of pre-encoded requests of ``kind``, shared by the users of this process."""
    pool = _pools.get(kind)
    if pool is None:
        vocab_path = os.environ.get("RECSERVE_LT_VOCAB")
        vocab = traffic.load_vocab(vocab_path) if vocab_path else None
        generator = traffic.TrafficGenerator(
            model_inputs(host), traffic.TrafficProfile.from_env(), vocab
        )
        pool = _pools.setdefault(
            kind, traffic.PayloadPool(generator, kind, per_size=POOL_PER_SIZE, model=MODEL)
        )
    return pool


def _check(response: ResponseContextManager, what: str) -> None:
    if response.status_code != 200:
        text = (response.text or "")[:200] if response.content else str(response.error)
        response.failure(f"{what}: HTTP {response.status_code}: {text}")
    else:
        response.success()


class _InferUser(FastHttpUser):
    abstract = True
    wait_time = constant(WAIT)
    kind = "json"
    label = "v2-json"
    path = f"/v2/models/{MODEL}/infer"
    content_type = "application/json"

    def on_start(self) -> None:
        self.pool = payload_pool(self.kind, self.host)

    def headers(self, payload: traffic.Payload) -> dict[str, str]:
        return {"Content-Type": self.content_type}

    @task
    def infer(self) -> None:
        payload = self.pool.pick()
        with self.client.post(
            self.path,
            data=payload.body,
            headers=self.headers(payload),
            name=f"{self.label} b{payload.batch_size}",
            catch_response=True,
        ) as response:
            _check(response, self.label)


class KServeJsonUser(_InferUser):
    """``POST /v2/models/{name}/infer`` with KServe v2 JSON tensors."""


def binary_headers(content_type: str, payload: traffic.Payload) -> dict[str, str]:
    """Headers of a binary tensor extension request: the JSON header's length."""
    return {
        "Content-Type": content_type,
        "Inference-Header-Content-Length": str(payload.header_length),
    }


class KServeBinaryUser(_InferUser):
    """``POST /v2/models/{name}/infer`` with the binary tensor extension (binary outputs)."""

    kind = "binary"
    label = "v2-binary"
    content_type = "application/octet-stream"

    def headers(self, payload: traffic.Payload) -> dict[str, str]:
        return binary_headers(self.content_type, payload)


class FriendlyJsonUser(_InferUser):
    """``POST /v1/models/{name}:predict`` with ``{"instances": [...]}``."""

    kind = "friendly"
    label = "v1-predict"
    path = f"/v1/models/{MODEL}:predict"


class TorchServeJsonUser(_InferUser):
    """TorchServe's ``POST /predictions/{name}`` with the same KServe v2 JSON bodies as
    :class:`KServeJsonUser` (benchmarks/peers_handler.py decodes them)."""

    label = "torchserve-json"
    path = f"/predictions/{os.environ.get('RECSERVE_LT_TS_MODEL', MODEL)}"


class TorchServeBinaryUser(TorchServeJsonUser):
    """TorchServe's ``POST /predictions/{name}`` with the same binary tensor extension bodies
    and headers as :class:`KServeBinaryUser` (binary outputs; peers_handler.py decodes them)."""

    kind = "binary"
    label = "torchserve-binary"
    content_type = "application/octet-stream"

    def headers(self, payload: traffic.Payload) -> dict[str, str]:
        return binary_headers(self.content_type, payload)


class GrpcUser(User):
    """KServe v2 ``ModelInfer`` over gRPC through the project's client
    (:class:`clients.RecserveClient`, raw tensor contents), reported to locust as ``grpc``.

    Retries are off, so every failed call is counted, like the HTTP users' failures."""

    wait_time = constant(WAIT)

    def on_start(self) -> None:
        from clients import RecserveClient

        target = os.environ.get("RECSERVE_LT_GRPC")
        if not target:
            raise RuntimeError("GrpcUser needs RECSERVE_LT_GRPC=HOST:PORT")
        self.pool = payload_pool("grpc", self.host)
        self.client = RecserveClient(f"grpc://{target}", model_name=MODEL, timeout=10.0, retries=0)

    def on_stop(self) -> None:
        self.client.close()

    @task
    def infer(self) -> None:
        from embedding_store.errors import RecserveError

        payload = self.pool.pick()
        started = time.perf_counter()
        length, exception = 0, None
        try:
            result = self.client.infer(payload.arrays)
            length = result.predictions.nbytes
        except RecserveError as error:
            exception = error
        self.environment.events.request.fire(
            request_type="grpc",
            name=f"v2-grpc b{payload.batch_size}",
            response_time=(time.perf_counter() - started) * 1000.0,
            response_length=length,
            exception=exception,
            context={},
        )


#: Short names (load_tests/run.py --users-of) -> user classes.
USER_CLASSES = {
    "binary": KServeBinaryUser,
    "json": KServeJsonUser,
    "friendly": FriendlyJsonUser,
    "grpc": GrpcUser,
    "torchserve": TorchServeJsonUser,
    "torchserve-binary": TorchServeBinaryUser,
}
