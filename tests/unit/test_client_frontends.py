"""RecserveClient / AsyncRecserveClient against the real HTTP and gRPC front ends (in-process,
on loopback) over a fake core: multi-ID features with lengths, parameters, errors, retries."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import uvicorn

from clients import AsyncRecserveClient, RecserveClient
from embedding_store.batch import Batch, IDTypeFeature, NonIDTypeFeature
from embedding_store.errors import (
    CapacityError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    RecserveError,
    UnavailableError,
)
from serving.grpc_frontend import build_grpc_server
from serving.http_app import create_app
from tests.unit.fake_core import MODEL, VERSION, FakeCore, expected_predictions

USERS = [[1, 2], [3000], [2**63 + 5, 4, 9], []]
AGES = [0.5, 1.0, -2.0, 0.25]
FAST = {"retries": 2, "backoff": (0.001, 0.002), "timeout": 5.0}


def _batch() -> Batch:
    return Batch(
        [IDTypeFeature.from_lists("user", USERS)],
        [NonIDTypeFeature(np.asarray(AGES, dtype=np.float32).reshape(-1, 1), "age")],
        requires_grad=False,
    )


class _Uvicorn:
    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def core() -> FakeCore:
    return FakeCore()


@pytest.fixture(autouse=True)
def _reset(core):
    core.is_ready = True
    core.fallback_ids = 0
    core.fail_with = None
    core.calls.clear()
    yield


@pytest.fixture(scope="module")
def urls(core) -> Iterator[dict[str, str]]:
    http = _Uvicorn(create_app(core))
    server, port, health = build_grpc_server(core, host="127.0.0.1", port=0, max_workers=4)
    server.start()
    try:
        yield {"http": f"http://127.0.0.1:{http.port}", "grpc": f"grpc://127.0.0.1:{port}"}
    finally:
        health.shutdown()
        server.stop(None)
        http.stop()


@pytest.fixture(params=["http", "grpc"])
def client(request, urls) -> Iterator[RecserveClient]:
    with RecserveClient(urls[request.param], model_name=MODEL, **FAST) as client:
        yield client


def test_batch_with_lengths(client, core):
    core.fallback_ids = 3
    result = client.predict(_batch())
    np.testing.assert_allclose(result.predictions, expected_predictions(USERS, AGES), atol=1e-6)
    assert result.predictions.dtype == np.float32 and result.predictions.shape == (4, 1)
    assert (result.model_name, result.model_version) == (MODEL, VERSION)
    assert (result.fallback_ids, result.unknown_ids) == (3, 2)
    assert result.latency_seconds > 0
    inputs = core.calls[-1]["inputs"]
    assert inputs["user"].dtype == np.uint64 and inputs["user.lengths"].dtype == np.int64
    assert core.calls[-1]["protocol"] == client.protocol
    # The per-attempt timeout reaches the server (HTTP parameter / gRPC deadline). gRPC sends
    # the deadline as a relative grpc-timeout header and the server re-anchors it on its own
    # clock, so it can come back a few milliseconds over the client's 5 s; 0.25 s of slack
    # still tells "the 5 s attempt timeout arrived" apart from the 10 s default.
    assert 0 < core.calls[-1]["timeout"] <= 5.25


def test_infer_named_tensors(client):
    result = client.infer(
        {
            "user": np.array([5, 6], dtype=np.int64),
            "user.lengths": np.array([1, 1], dtype=np.int32),
            "age": np.array([[0.0], [1.0]], dtype=np.float32),
        }
    )
    np.testing.assert_allclose(
        result.predictions, expected_predictions([[5], [6]], [0.0, 1.0]), atol=1e-6
    )


def test_infer_python_integer_ids_at_and_over_2_63(client, core):
    # A list mixing IDs >= 2**63 with small ones became FP64 and the server refused it.
    result = client.infer(
        {
            "user": [2**63 + 5, 7],
            "user.lengths": [1, 1],
            "age": np.array([[0.0], [1.0]], dtype=np.float32),
        }
    )
    np.testing.assert_allclose(
        result.predictions, expected_predictions([[2**63 + 5], [7]], [0.0, 1.0]), atol=1e-6
    )
    user = core.calls[-1]["inputs"]["user"]
    assert user.dtype == np.uint64 and user.tolist() == [2**63 + 5, 7]


def test_health_and_metadata(client, core):
    assert client.live() and client.ready() and client.model_ready()
    core.is_ready = False
    assert not client.ready()
    assert not client.model_ready()
    core.is_ready = True
    # An unknown model is an error on both protocols (the gRPC server answers ready=false
    # for it, as Triton does; the client asks the metadata to tell the two apart).
    with (
        RecserveClient(client.url, model_name="no-such-model", retries=0) as unknown,
        pytest.raises(NotFoundError, match="unknown model 'no-such-model'"),
    ):
        unknown.model_ready()
    info = client.metadata()
    assert info.name == MODEL and info.versions == (VERSION,)
    assert [spec.name for spec in info.inputs] == ["user", "user.lengths", "age"]
    assert info.input("age").shape == (-1, 1) and info.outputs[0].name == "prediction"


def test_rows(urls):
    rows = [{"user": ids, "age": age} for ids, age in zip(USERS, AGES)]
    with RecserveClient(urls["http"], model_name=MODEL) as client:
        result = client.predict(rows)
    np.testing.assert_allclose(result.predictions, expected_predictions(USERS, AGES), atol=1e-6)
    with (
        RecserveClient(urls["grpc"], model_name=MODEL) as client,
        pytest.raises(InvalidArgumentError, match="need an HTTP server URL"),
    ):
        client.predict(rows)


def test_async_rows(urls):
    rows = [{"user": ids, "age": age} for ids, age in zip(USERS, AGES)]

    async def main():
        async with AsyncRecserveClient(urls["http"], model_name=MODEL, **FAST) as client:
            result = await client.predict(rows)
        async with AsyncRecserveClient(urls["grpc"], model_name=MODEL, **FAST) as client:
            with pytest.raises(InvalidArgumentError, match="need an HTTP server URL"):
                await client.predict(rows)
        return result

    result = asyncio.run(main())
    np.testing.assert_allclose(result.predictions, expected_predictions(USERS, AGES), atol=1e-6)


def test_wrong_input_type(client):
    with pytest.raises(TypeError, match="Batch or a list of dict rows"):
        client.predict({"user": [1]})


@pytest.mark.parametrize(
    "timeout",
    [0, -1, float("nan"), True, "5", float("inf"), float("-inf"), 1e10, 1_000_000.5, 10**400],
)
def test_a_call_timeout_that_is_no_duration_is_refused(urls, core, timeout):
    # As the constructor refuses it, naming it; it used to reach urllib3 (a ValueError, or a
    # raw OverflowError for inf and 1e10) or become an instant DEADLINE_EXCEEDED over gRPC.
    message = (
        r"^timeout must be > 0 and <= 1000000 seconds, or None, "
        rf"got {re.escape(repr(timeout))}$"
    )
    for url in urls.values():
        with RecserveClient(url, model_name=MODEL, **FAST) as client:
            with pytest.raises(InvalidArgumentError, match=message):
                client.predict(_batch(), timeout=timeout)
            with pytest.raises(InvalidArgumentError, match=message):
                client.ready(timeout=timeout)
        with pytest.raises(InvalidArgumentError, match=message):
            RecserveClient(url, model_name=MODEL, timeout=timeout)

        async def main(url=url):
            async with AsyncRecserveClient(url, model_name=MODEL, **FAST) as client:
                with pytest.raises(InvalidArgumentError, match=message):
                    await client.predict(_batch(), timeout=timeout)

        asyncio.run(main())
    assert core.calls == []


def test_the_longest_timeout_is_accepted(urls, core):
    for url in urls.values():
        with RecserveClient(url, model_name=MODEL, **{**FAST, "timeout": 1e6}) as client:
            assert client.timeout == 1e6
            assert client.ready(timeout=1_000_000)
            result = client.predict(_batch(), timeout=1e6)
        np.testing.assert_allclose(result.predictions, expected_predictions(USERS, AGES), atol=1e-6)


def test_unknown_model_is_not_found(urls):
    for url in urls.values():
        with RecserveClient(url, model_name="nope", **FAST) as client:
            with pytest.raises(NotFoundError, match=r"unknown model 'nope'") as caught:
                client.predict(_batch())
            assert url in caught.value.message
            with pytest.raises(NotFoundError):
                client.metadata()


def test_unavailable_is_retried_then_raised(client, core):
    core.fail_with = UnavailableError("overloaded")
    with pytest.raises(UnavailableError, match=r"overloaded.*gave up after 3 attempts"):
        client.predict(_batch())
    assert len(core.calls) == 3


def test_invalid_argument_is_not_retried(client, core):
    core.fail_with = InvalidArgumentError("input 'age' is bad")
    with pytest.raises(InvalidArgumentError, match="input 'age' is bad"):
        client.predict(_batch())
    assert len(core.calls) == 1


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_async_client(urls, core, protocol):
    async def main():
        async with AsyncRecserveClient(urls[protocol], model_name=MODEL, **FAST) as client:
            assert await client.ready() and await client.live() and await client.model_ready()
            unknown = AsyncRecserveClient(urls[protocol], model_name="no-such-model", **FAST)
            async with unknown:
                with pytest.raises(NotFoundError, match="unknown model 'no-such-model'"):
                    await unknown.model_ready()
            results = await asyncio.gather(*(client.predict(_batch()) for _ in range(4)))
            info = await client.metadata()
            core.fail_with = UnavailableError("busy")
            with pytest.raises(UnavailableError, match="busy"):
                await client.predict(_batch())
            core.fail_with = None
            return results, info

    results, info = asyncio.run(main())
    for result in results:
        np.testing.assert_allclose(result.predictions, expected_predictions(USERS, AGES), atol=1e-6)
    assert info.name == MODEL
    assert len(core.calls) == 4 + 3


@pytest.mark.parametrize(
    ("error", "expected_class", "http_status", "grpc_code"),
    [
        (DeadlineExceededError("lookup too slow"), DeadlineExceededError, 504, "DEADLINE_EXCEEDED"),
        (CapacityError("batch too big"), CapacityError, 413, "RESOURCE_EXHAUSTED"),
        (FailedPreconditionError("draining"), FailedPreconditionError, 409, "FAILED_PRECONDITION"),
        (RuntimeError("secret detail"), RecserveError, 500, "INTERNAL"),
    ],
)
def test_every_client_raises_the_same_class_for_a_server_error(
    urls, core, error, expected_class, http_status, grpc_code
):
    """Sync and async, HTTP and gRPC: one class per server error, a message naming the server
    and what it answered, and none of an internal error's own text."""
    core.fail_with = error

    async def call_async(url: str) -> None:
        async with AsyncRecserveClient(url, model_name=MODEL, **FAST) as client:
            await client.predict(_batch())

    for protocol, url in urls.items():
        answered = f"HTTP {http_status}" if protocol == "http" else f"gRPC {grpc_code}"
        for run in ("sync", "async"):
            with pytest.raises(RecserveError) as caught:
                if run == "sync":
                    with RecserveClient(url, model_name=MODEL, **FAST) as client:
                        client.predict(_batch())
                else:
                    asyncio.run(call_async(url))
            assert type(caught.value) is expected_class, (protocol, run)
            assert caught.value.message.startswith(f"server {url} answered {answered}: ")
            assert "secret detail" not in caught.value.message
    assert len(core.calls) == 4  # none of them is retried


def test_async_http_timeout_counts_the_wait_for_a_connection(urls, core, monkeypatch):
    # The asyncio HTTP client runs at most max_connections calls at a time; the others wait
    # for a worker thread, and their timeout used to start only when they got one: with one
    # connection and a server taking 0.6 s, three 1 s calls answered at 0.6, 1.2 and 1.8 s.
    # Now the second runs out of time at 1 s and the third is never sent (margins of 0.4 s
    # either side, for a loaded machine).
    answer = core.predict

    def slow(*args, **kwargs):
        time.sleep(0.6)
        return answer(*args, **kwargs)

    monkeypatch.setattr(core, "predict", slow)

    async def main() -> list[tuple[str, float]]:
        async with AsyncRecserveClient(
            urls["http"], model_name=MODEL, timeout=1.0, retries=0, max_connections=1
        ) as client:
            started = time.monotonic()

            async def one() -> tuple[str, float]:
                try:
                    await client.predict(_batch())
                    outcome = "ok"
                except DeadlineExceededError as error:
                    outcome = error.message
                return outcome, time.monotonic() - started

            return await asyncio.gather(*(one() for _ in range(3)))

    outcomes = asyncio.run(main())
    assert outcomes[0][0] == "ok"
    for message, _ in outcomes[1:]:  # the second runs out of time; the third never runs
        assert message.startswith(
            f"server {urls['http']} did not answer POST /v2/models/tiny/infer within 1.0 s"
        )
    assert all(seconds < 1.4 for _, seconds in outcomes)


def test_an_attempt_that_waited_out_its_timeout_for_a_thread_is_not_sent():
    from clients._http import HttpBackend, attempt_started

    backend = HttpBackend("http://127.0.0.1:9", max_connections=2)  # nothing listens there
    with attempt_started(time.monotonic() - 0.6), pytest.raises(DeadlineExceededError) as caught:
        backend.ready(timeout=0.5)
    assert caught.value.message == (
        "server http://127.0.0.1:9 did not answer GET /v2/health/ready within 0.5 s: the call "
        "waited all that time for one of the client's 2 connections (max_connections)"
    )
    backend.close()
