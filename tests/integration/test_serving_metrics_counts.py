"""Request metrics of a real :class:`PredictionService` behind its real HTTP (uvicorn with the
fast infer protocol) and gRPC front ends on 127.0.0.1: requests refused before they reach the
core are counted, cancelled gRPC calls are dropped and counted as cancelled, series exist at 0
from start-up and after a reload, and a replaced version's series never come back."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import uvicorn

from embedding_store.batch import Batch
from embedding_store.errors import UnavailableError
from examples.adult_income import features
from serving.grpc_frontend import InferenceStub, build_grpc_server
from serving.http_app import SMALL_BODY_BYTES, create_app
from serving.http_fast_path import InferFastPath
from serving.http_protocol import MAX_HEAD_BYTES, infer_protocol
from serving.model import load_model
from serving.proto import V2
from serving.service import PredictionService
from tests.integration.test_serving import batch_arrays, request

MODEL = "model"
MAX_BODY_BYTES = 256 * 1024
READ_TIMEOUT = 0.5


@dataclass
class Served:
    service: PredictionService
    http: str  # "127.0.0.1:port"
    grpc_port: int
    body_bytes_in_flight: Callable[[], int]  # what the HTTP server's body budget holds now

    def count(self, protocol: str, outcome: str, model: str = MODEL) -> float | None:
        labels = {
            "protocol": protocol,
            "model": model,
            "version": self.service.model.version,
            "outcome": outcome,
        }
        return self.service.metrics.registry.get_sample_value("recserve_requests_total", labels)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")

    def timed(self, protocol: str) -> float | None:
        return self.service.metrics.registry.get_sample_value(
            "recserve_request_latency_seconds_count", {"protocol": protocol}
        )


@contextlib.contextmanager
def serve(service: PredictionService, **caps: Any) -> Iterator[Served]:
    """``service`` behind the HTTP and gRPC front ends, as ``recserve serve`` runs them;
    ``caps``: more keyword arguments of ``infer_protocol`` (``max_connections``, ...)."""
    fast_path = InferFastPath(create_app(service, max_body_bytes=MAX_BODY_BYTES))
    config = uvicorn.Config(
        fast_path,
        log_level="critical",
        lifespan="off",
        http=infer_protocol(fast_path.handler, SMALL_BODY_BYTES, read_timeout=READ_TIMEOUT, **caps),
    )
    protocol = config.http
    http_server = uvicorn.Server(config)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=http_server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    grpc_server, grpc_port, health = build_grpc_server(service, host="127.0.0.1", port=0)
    grpc_server.start()
    deadline = time.monotonic() + 10
    while not http_server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert http_server.started
    host, port = listener.getsockname()
    try:
        yield Served(service, f"{host}:{port}", grpc_port, protocol.body_bytes_in_flight)
    finally:
        health.shutdown()
        grpc_server.stop(None)
        http_server.should_exit = True
        thread.join(timeout=10)
        service.close()


def _batch(rows: int) -> Batch:
    return next(features.read_batches(features.TEST_PATH, rows, requires_grad=False))


def grpc_request(arrays: dict[str, np.ndarray], model: str = MODEL) -> Any:
    datatypes = {"uint64": "UINT64", "int64": "INT64", "float32": "FP32"}
    message = V2.ModelInferRequest(model_name=model)
    for name, array in arrays.items():
        message.inputs.add(name=name, datatype=datatypes[array.dtype.name], shape=array.shape)
        message.raw_input_contents.append(array.tobytes())
    return message


def raw_exchange(address: str, *pieces: bytes, wait: float = 5.0) -> bytes:
    """Send ``pieces`` on a fresh connection, 0.1 s apart (one read each for the server),
    and read until the server closes it."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=wait) as connection:
        for number, piece in enumerate(pieces):
            if number:
                time.sleep(0.1)
            connection.sendall(piece)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    return answer


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# --------------------------------------------------------------------------- refused early
def test_requests_refused_before_the_core_are_counted(adult_checkpoint):
    service = PredictionService(load_model(adult_checkpoint, name=MODEL, warm_up=False))
    arrays = {k: v[:2] for k, v in batch_arrays(_batch(2)).items()}
    infer = f"/v2/models/{MODEL}/infer"
    json_headers = {"Content-Type": "application/json"}
    with serve(service) as served:
        # The fast infer protocol: bad JSON, no inputs (decoded on the event loop).
        assert request(served.http, "POST", infer, b"{", json_headers)[0] == 400
        assert request(served.http, "POST", infer, b'{"inputs": []}', json_headers)[0] == 400
        # The ASGI path: a gzip body that is not gzip; a body over --max-body-bytes (413).
        gzip_headers = {**json_headers, "Content-Encoding": "gzip"}
        assert request(served.http, "POST", infer, b"not gzip", gzip_headers)[0] == 400
        too_large = b" " * (MAX_BODY_BYTES + 1)
        assert request(served.http, "POST", infer, too_large, json_headers)[0] == 413
        # A body too large to decode on the loop, decoded in a worker thread.
        large_bad = b"[" + b" " * SMALL_BODY_BYTES + b"]"
        assert request(served.http, "POST", infer, large_bad, json_headers)[0] == 400
        # The friendly route, and a model this server does not serve.
        predict = f"/v1/models/{MODEL}:predict"
        assert request(served.http, "POST", predict, b"{", json_headers)[0] == 400
        assert request(served.http, "POST", "/v2/models/nope/infer", b"{", json_headers)[0] == 400
        # The HTTP layer itself: a head over 64 KiB (431), a body that never ends (408),
        # malformed HTTP (400); the same refusals of another route are not requests.
        for path in (infer + "?q=1", "/v2/health/live"):
            start = b"POST %s HTTP/1.1\r\nHost: x\r\n" % path.encode()
            padding = b"X-Pad: " + b"a" * MAX_HEAD_BYTES  # all read: no reset at the close
            assert raw_exchange(served.http, start, padding).startswith(b"HTTP/1.1 431 ")
            malformed = start + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\nab"
            assert raw_exchange(served.http, malformed).startswith(b"HTTP/1.1 400 ")
        slow = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{" % infer.encode()
        assert raw_exchange(served.http, slow).startswith(b"HTTP/1.1 408 ")
        # The same on the ASGI path (a body too large for the fast one): counted once, as
        # the 408 it got, not again when the app then finds the client gone.
        slow_large = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{" % (
            infer.encode(),
            SMALL_BODY_BYTES * 4,
        )
        assert raw_exchange(served.http, slow_large).startswith(b"HTTP/1.1 408 ")
        # A client that leaves halfway through its upload: cancelled, as on the fast path.
        host, port = served.http.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as leaving:
            leaving.sendall(slow_large + b" " * 1000)
            time.sleep(0.1)
        _wait_until(lambda: served.count("http", "cancelled") == 1, 5, "the cancelled count")
        # gRPC: raw contents of the wrong size for their shape, refused while decoding.
        bad = grpc_request(arrays)
        bad.raw_input_contents[0] = b"\0" * 3
        with (
            grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel,
            pytest.raises(grpc.RpcError) as raised,
        ):
            InferenceStub(channel).ModelInfer(bad, timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        # Bad JSON x3 (small, large, friendly), no inputs, bad gzip, malformed HTTP.
        assert served.count("http", "InvalidArgumentError") == 6
        assert served.count("http", "CapacityError") == 2  # 413, 431
        assert served.count("http", "DeadlineExceededError") == 2  # 408 x2
        assert served.count("http", "InvalidArgumentError", model="unknown") == 1
        assert served.count("grpc", "InvalidArgumentError") == 1
        assert served.count("http", "ok") == 0 and served.count("grpc", "ok") == 0
        # Never reached the core: not timed.
        assert served.timed("http") is None and served.timed("grpc") is None


def test_friendly_requests_the_http_layer_cuts_short_are_counted_by_what_they_got(
    adult_checkpoint, caplog
):
    # The friendly route as the infer one: an upload left halfway is "cancelled" (it was
    # "error", logged as a 500 with Starlette's ClientDisconnect traceback), a 408 is
    # DeadlineExceededError once (it was "error" too), a 431 CapacityError (not counted),
    # a 503 over the body budget UnavailableError (not counted); the name percent-decoded.
    service = PredictionService(load_model(adult_checkpoint, name=MODEL, warm_up=False))
    predict = f"/v1/models/{MODEL}:predict".encode()
    with serve(service, max_body_bytes_in_flight=MAX_BODY_BYTES) as served:
        host, port = served.http.rsplit(":", 1)
        slow = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{" % predict
        with caplog.at_level(logging.ERROR):
            with socket.create_connection((host, int(port))) as leaving:
                leaving.sendall(slow)
                time.sleep(0.1)
            _wait_until(lambda: served.count("http", "cancelled") == 1, 5, "the cancelled count")
            assert raw_exchange(served.http, slow).startswith(b"HTTP/1.1 408 ")
            start = b"POST /v1/models/mod%65l:predict HTTP/1.1\r\nHost: x\r\n"
            padding = b"X-Pad: " + b"a" * MAX_HEAD_BYTES
            assert raw_exchange(served.http, start, padding).startswith(b"HTTP/1.1 431 ")
            with socket.create_connection((host, int(port))) as holding:
                holding.sendall(
                    b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{"
                    % (predict, MAX_BODY_BYTES)
                )
                _wait_until(
                    lambda: served.body_bytes_in_flight() == MAX_BODY_BYTES, 5, "the budget taken"
                )
                assert request(served.http, "POST", predict.decode(), b"{}")[0] == 503
            # The request holding the budget is left halfway too.
            _wait_until(lambda: served.count("http", "cancelled") == 2, 5, "the second one")
        time.sleep(0.2)  # a late, second count of the 408 would show by now
        assert served.count("http", "cancelled") == 2
        assert served.count("http", "DeadlineExceededError") == 1
        assert served.count("http", "CapacityError") == 1
        assert served.count("http", "UnavailableError") == 1
        assert served.count("http", "error") == 0
        assert served.count("http", "InvalidArgumentError", model="unknown") is None
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_an_infer_request_over_the_body_budget_is_counted_as_unavailable(adult_checkpoint):
    service = PredictionService(load_model(adult_checkpoint, name=MODEL, warm_up=False))
    infer = f"/v2/models/{MODEL}/infer"
    with serve(service, max_body_bytes_in_flight=MAX_BODY_BYTES) as served:
        host, port = served.http.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as holding:
            # Declares the whole budget and sends a byte of it: the budget is taken.
            holding.sendall(
                b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{"
                % (infer.encode(), MAX_BODY_BYTES)
            )
            _wait_until(
                lambda: served.body_bytes_in_flight() == MAX_BODY_BYTES, 5, "the budget taken"
            )
            status, body = request(served.http, "POST", infer, b"{}")
        assert status == 503 and "--max-body-bytes-in-flight" in json.loads(body)["error"]
        assert served.count("http", "UnavailableError") == 1
        assert served.timed("http") is None  # never reached the core


# --------------------------------------------------------------------------- cancelled gRPC
def _service_that_counts_batches(
    checkpoint: Path, max_queue_delay: float
) -> tuple[PredictionService, list[int]]:
    """A service whose merged batches wait ``max_queue_delay`` s in the dispatcher and whose
    model calls are listed (their sizes)."""
    service = PredictionService(
        load_model(checkpoint, name=MODEL, warm_up=False), max_queue_delay=max_queue_delay
    )
    ran: list[int] = []
    run = service._run

    def counting_run(merged: Batch) -> Any:
        ran.append(merged.batch_size)
        return run(merged)

    service._run = counting_run  # type: ignore[method-assign]
    return service, ran


def test_a_grpc_call_cancelled_while_queued_is_dropped_and_counted_as_cancelled(
    adult_checkpoint,
):
    service, ran = _service_that_counts_batches(adult_checkpoint, max_queue_delay=0.5)
    arrays = batch_arrays(_batch(3))
    with serve(service) as served, served.channel() as channel:
        call = InferenceStub(channel).ModelInfer.future(grpc_request(arrays), timeout=30)
        time.sleep(0.1)  # queued: the dispatcher collects for 0.5 s
        assert call.cancel()
        _wait_until(lambda: served.count("grpc", "cancelled") == 1, 5, "the count")
        time.sleep(0.6)  # past the merged batch's start
        assert ran == []  # dropped before its merged batch ran
        assert served.count("grpc", "ok") == 0
        assert served.count("grpc", "cancelled") == 1
        # A call that is not cancelled is answered and counted as before.
        answer = InferenceStub(channel).ModelInfer(grpc_request(arrays), timeout=30)
        assert list(answer.outputs[0].shape) == [3, 1]
        assert ran == [3]
        assert served.count("grpc", "ok") == 1 and served.count("grpc", "cancelled") == 1


def test_a_grpc_call_past_its_deadline_is_dropped_and_counted_as_such(adult_checkpoint):
    # A 0.5 s deadline in a 1 s batching delay: long enough for the call to reach the
    # servicer on a loaded machine (one that never got there is not the server's to count).
    service, ran = _service_that_counts_batches(adult_checkpoint, max_queue_delay=1.0)
    with serve(service) as served, served.channel() as channel:
        with pytest.raises(grpc.RpcError) as raised:
            InferenceStub(channel).ModelInfer(grpc_request(batch_arrays(_batch(2))), timeout=0.5)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        _wait_until(lambda: served.count("grpc", "DeadlineExceededError") == 1, 5, "the count")
        time.sleep(1.1)  # past the merged batch's start
        assert ran == []
        assert served.count("grpc", "ok") == 0 and served.count("grpc", "cancelled") == 0


# --------------------------------------------------------------------------- series at 0
def _series(service: PredictionService) -> dict[tuple[str, str, str, str], float]:
    return {
        (s.labels["protocol"], s.labels["model"], s.labels["version"], s.labels["outcome"]): (
            s.value
        )
        for metric in service.metrics.registry.collect()
        if metric.name == "recserve_requests"
        for s in metric.samples
        if s.name == "recserve_requests_total"
    }


def test_request_and_reload_series_exist_at_zero_from_start_and_after_a_reload(
    adult_checkpoint, adult_checkpoint_b
):
    def loader(path: str | None):
        return load_model(path or adult_checkpoint, name=MODEL, warm_up=False)

    service = PredictionService(loader(None), loader=loader)
    sample = service.metrics.registry.get_sample_value
    try:
        first = service.model.version
        expected = {
            (protocol, MODEL, first, outcome): 0.0
            for protocol in ("http", "grpc")
            for outcome in (
                "ok",
                "InvalidArgumentError",
                "ModelInputError",
                "CapacityError",
                "UnavailableError",
                "DeadlineExceededError",
                "cancelled",
                "error",
            )
        }
        assert _series(service) == expected
        assert sample("recserve_reloads_total", {"outcome": "ok"}) == 0.0
        assert sample("recserve_reloads_total", {"outcome": "failed"}) == 0.0

        service.reload(str(adult_checkpoint_b))
        second = service.model.version
        assert second != first
        # The new version's series at 0, the old one's gone.
        assert _series(service) == {(p, m, second, o): 0.0 for p, m, _, o in expected}
        assert sample("recserve_reloads_total", {"outcome": "ok"}) == 1.0
        assert sample("recserve_reloads_total", {"outcome": "failed"}) == 0.0
    finally:
        service.close()


# --------------------------------------------------------------------------- reload race
def test_a_request_answered_by_a_replaced_version_never_brings_its_series_back(
    adult_checkpoint, adult_checkpoint_b
):
    # The answer comes from the old version, the reload forgets that version's series, and
    # only then is the request counted: the late sample is dropped, not a series recreated
    # (it used to stay exported for the server's life).
    def loader(path: str | None):
        return load_model(path or adult_checkpoint, name=MODEL, warm_up=False)

    service = PredictionService(loader(None), loader=loader)
    old = service.model.version
    answered, reloaded = threading.Event(), threading.Event()
    answer = service._answer

    def late_answer(batch: Batch, result: Any, version: str | None = None) -> Any:
        answered.set()
        assert reloaded.wait(30)
        return answer(batch, result, version)

    service._answer = late_answer  # type: ignore[method-assign]
    versions: list[str] = []
    inputs = batch_arrays(_batch(2))
    worker = threading.Thread(
        target=lambda: versions.append(
            service.predict(MODEL, None, inputs, protocol="python").model_version
        )
    )
    try:
        worker.start()
        assert answered.wait(30)
        service.reload(str(adult_checkpoint_b))
        reloaded.set()
        worker.join(30)
        assert versions == [old]  # answered by the replaced version
        assert {key[2] for key in _series(service)} == {service.model.version}
        labels = {"protocol": "python", "model": MODEL, "version": old, "outcome": "ok"}
        assert service.metrics.registry.get_sample_value("recserve_requests_total", labels) is None
        # A later request of the served version is counted as ever.
        service._answer = answer  # type: ignore[method-assign]
        assert service.predict(MODEL, None, inputs, protocol="python").model_version != old
        labels["version"] = service.model.version
        assert service.metrics.registry.get_sample_value("recserve_requests_total", labels) == 1
    finally:
        reloaded.set()
        service.close()


def test_closing_waits_for_the_batch_still_running_before_closing_its_model(adult_checkpoint):
    """A stop whose drain gave up (a slow tier) must not close the model's channels under a
    batch still running: that batch's request would fail with "closed channel". Requests
    still queued are answered at once (503: another replica can take them), not run late
    against a closing model."""
    service = PredictionService(
        load_model(adult_checkpoint, name=MODEL, warm_up=False), max_batch_size=2
    )
    events: list[str] = []
    started = threading.Event()
    run = service._run

    def slow_run(merged: Batch) -> Any:
        started.set()
        time.sleep(0.5)
        result = run(merged)
        events.append("batch done")
        return result

    service._run = slow_run  # type: ignore[method-assign]
    model_close = service.model.close
    service.model.close = lambda: (events.append("model closed"), model_close())  # type: ignore[method-assign]
    answers: dict[str, Any] = {}

    def ask(key: str) -> None:
        try:
            answers[key] = service.predict(
                MODEL, None, batch_arrays(_batch(2)), protocol="grpc", timeout=10
            )
        except Exception as error:
            answers[key] = error

    running = threading.Thread(target=ask, args=("running",))
    running.start()
    assert started.wait(10)
    queued = threading.Thread(target=ask, args=("queued",))
    queued.start()
    _wait_until(lambda: service.pending == 2, 5, "the second request queued")
    service.close()
    running.join(10)
    queued.join(10)
    assert events == ["batch done", "model closed"]
    assert answers["running"].outputs["prediction"].shape == (2, 1)
    assert isinstance(answers["queued"], UnavailableError)
    assert "stopped before this request's batch ran" in str(answers["queued"])


def test_closing_waits_for_a_batch_running_on_an_event_loop(adult_checkpoint):
    """Batches of requests decoded on an event loop run outside the dispatcher thread (under
    the same run lock), so joining the dispatcher does not wait for them: close() must wait
    for the run lock before it closes the model."""
    service = PredictionService(load_model(adult_checkpoint, name=MODEL, warm_up=False))
    events: list[str] = []
    model_close = service.model.close
    service.model.close = lambda: (events.append("model closed"), model_close())  # type: ignore[method-assign]
    holding = threading.Event()

    def loop_batch() -> None:  # what a LoopBatcher's batch does: run under the run lock
        with service._run_lock:
            holding.set()
            time.sleep(0.5)
            events.append("batch done")

    running = threading.Thread(target=loop_batch)
    running.start()
    assert holding.wait(10)
    service.close()
    running.join(10)
    assert events == ["batch done", "model closed"]
