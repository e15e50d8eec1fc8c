"""Retries and timeouts of the clients against tiny scripted servers on loopback.

Only what the server could not take is retried (HTTP 503, gRPC UNAVAILABLE, refused
connections); a 400 goes out once; timeouts are honored (and not retried).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import math
import socket
import threading
import time
import types
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import numpy as np
import orjson
import pytest

from clients import AsyncRecserveClient, RecserveClient
from clients._proto import METHODS, SERVICE_NAME, V2
from clients.retry import RetryPolicy
from embedding_store.batch import Batch, IDTypeFeatureWithSingleID, NonIDTypeFeature
from embedding_store.errors import (
    CapacityError,
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    RecserveError,
    UnavailableError,
)

FAST = {"backoff": (0.01, 0.05)}
ANSWER = {
    "model_name": "m",
    "model_version": "v1",
    "parameters": {"fallback_ids": 0, "unknown_ids": 1},
    "outputs": [{"name": "prediction", "datatype": "FP32", "shape": [2, 1], "data": [0.25, 0.5]}],
}


def _batch() -> Batch:
    return Batch(
        [IDTypeFeatureWithSingleID.from_ids("item", [1, 2])],
        [NonIDTypeFeature(np.zeros((2, 3), dtype=np.float32), "dense")],
        requires_grad=False,
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------- HTTP fake
class FakeHttp:
    """Answers each POST with the next scripted (status, delay) (then 200 forever); counts
    requests. GETs (health) answer ``health_status``."""

    def __init__(self, script: list[tuple[int, float]] | None = None, port: int = 0) -> None:
        self.script = list(script or [])
        self.requests = 0
        self.health_status = 200
        self.paths: list[str] = []  # of the GETs, as sent
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, document: dict) -> None:
                body = orjson.dumps(document)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                fake.paths.append(self.path)
                if fake.health_status == 200:
                    self._send(200, {"ready": True})
                else:
                    self._send(fake.health_status, {"error": f"scripted {fake.health_status}"})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with fake.lock:
                    fake.requests += 1
                    status, delay = fake.script.pop(0) if fake.script else (200, 0.0)
                time.sleep(delay)
                if status == 200:
                    self._send(200, ANSWER)
                else:
                    self._send(status, {"error": f"scripted {status}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_http() -> Iterator[callable]:
    started: list[FakeHttp] = []

    def start(script=None, port: int = 0) -> FakeHttp:
        server = FakeHttp(script, port)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def test_http_503_is_retried_until_success(fake_http):
    server = fake_http([(503, 0.0), (503, 0.0)])
    with RecserveClient(server.url, model_name="m", retries=3, **FAST) as client:
        result = client.predict(_batch())
    assert server.requests == 3
    np.testing.assert_array_equal(result.predictions, [[0.25], [0.5]])
    assert (result.model_version, result.unknown_ids) == ("v1", 1)


def test_http_503_gives_up_after_the_retries(fake_http):
    server = fake_http([(503, 0.0)] * 10)
    with (
        RecserveClient(server.url, model_name="m", retries=2, **FAST) as client,
        pytest.raises(UnavailableError, match=r"scripted 503.*gave up after 3 attempts"),
    ):
        client.predict(_batch())
    assert server.requests == 3


@pytest.mark.parametrize("status", [400, 503])
def test_http_health_false_is_400_as_the_spec_says_or_503(fake_http, status):
    # KServe v2 REST: "a 4xx status code indicates false" (recserve and Triton send 400);
    # a proxy or a draining server may answer 503.
    server = fake_http()
    server.health_status = status
    with RecserveClient(server.url, model_name="m", retries=0) as client:
        assert client.live() is False
        assert client.ready() is False
        assert client.model_ready() is False


@pytest.mark.parametrize(
    ("status", "error"), [(202, RecserveError), (404, NotFoundError), (500, RecserveError)]
)
def test_http_health_answers_other_than_true_or_false_raise(fake_http, status, error):
    server = fake_http()
    server.health_status = status
    with (
        RecserveClient(server.url, model_name="m", retries=0) as client,
        pytest.raises(error, match=f"scripted {status}"),
    ):
        client.model_ready()


def test_http_400_is_not_retried(fake_http):
    server = fake_http([(400, 0.0)])
    with (
        RecserveClient(server.url, model_name="m", retries=3, **FAST) as client,
        pytest.raises(InvalidArgumentError, match="scripted 400") as caught,
    ):
        client.predict(_batch())
    assert server.url in caught.value.message
    assert server.requests == 1


def test_http_timeout_is_honored_and_not_retried(fake_http):
    server = fake_http([(200, 1.5)])
    with RecserveClient(server.url, model_name="m", timeout=0.2, retries=3, **FAST) as client:
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError, match=r"within 0\.2 s"):
            client.predict(_batch())
        assert time.monotonic() - started < 1.0
    assert server.requests == 1


class RawServer:
    """A loopback socket server that runs ``behaviour(connection)`` for each connection
    (at most ``limit``, then it stops); counts the connections."""

    def __init__(self, behaviour, limit: int = 10) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.stop = threading.Event()

        def serve() -> None:
            while not self.stop.is_set() and self.connections < limit:
                try:
                    connection, _ = self.listener.accept()
                except TimeoutError:
                    continue
                self.connections += 1
                with connection:
                    behaviour(connection, self.stop)

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.listener.close()


def _drip(connection: socket.socket, stop: threading.Event) -> None:
    connection.recv(65536)
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
    for _ in range(100):  # one byte every 0.1 s: 10 s for the body (bounded)
        if stop.wait(0.1):
            return
        try:
            connection.sendall(b" ")
        except OSError:
            return


def _hang_up(connection: socket.socket, stop: threading.Event) -> None:
    connection.recv(65536)  # takes the request, answers nothing, closes


def test_http_timeout_bounds_the_whole_answer_not_each_read():
    server = RawServer(_drip)
    try:
        with RecserveClient(server.url, model_name="m", timeout=0.5, retries=3, **FAST) as client:
            started = time.monotonic()
            with pytest.raises(DeadlineExceededError, match=r"within 0\.5 s"):
                client.metadata()
            assert time.monotonic() - started < 1.5  # not the 10 s the body takes to drip
        assert server.connections == 1  # a timeout is not retried
    finally:
        server.close()


def _drip_headers(connection: socket.socket, stop: threading.Event) -> None:
    connection.recv(65536)
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    for byte in answer:  # one byte every 0.1 s: 7 s for the status line and headers
        if stop.wait(0.1):
            return
        try:
            connection.sendall(bytes([byte]))
        except OSError:
            return


def test_http_timeout_bounds_the_status_line_and_headers_too():
    # Each read of the status line and headers used to get the whole timeout: a server that
    # dripped them a byte at a time held a 0.5 s call for the 7 s they took.
    server = RawServer(_drip_headers)
    try:
        with RecserveClient(server.url, model_name="m", timeout=0.5, retries=3, **FAST) as client:
            started = time.monotonic()
            with pytest.raises(DeadlineExceededError, match=r"GET /v2/models/m within 0\.5 s"):
                client.metadata()
            assert time.monotonic() - started < 1.5
        assert server.connections == 1  # a timeout is not retried
    finally:
        server.close()


def test_eval_timeout_bounds_the_whole_answer_not_each_read():
    """``recserve eval --url --timeout``: the same for the eval job's own HTTP calls (urllib,
    whose timeout bounds each socket read alone)."""
    from clients.eval_scorers import ServerScorer

    for behaviour in (_drip_headers, _drip):
        server = RawServer(behaviour)
        try:
            started = time.monotonic()
            with pytest.raises(DeadlineExceededError, match=r"did not answer within 0\.5 s"):
                ServerScorer(server.url, "m", timeout=0.5, retries=3)
            assert time.monotonic() - started < 1.5
            assert server.connections == 1
        finally:
            server.close()


def test_http_connection_dropped_before_an_answer_is_retried_like_grpc_unavailable():
    server = RawServer(_hang_up)
    try:
        client = RecserveClient(server.url, model_name="m", retries=2, **FAST)
        with client, pytest.raises(UnavailableError, match=r"gave up after 3 attempts"):
            client.predict(_batch())
        assert server.connections == 3
    finally:
        server.close()


def test_http_connection_refused_then_server_starts(fake_http):
    port = _free_port()
    with RecserveClient(f"http://127.0.0.1:{port}", model_name="m", retries=0) as client:
        assert not client.ready()
        with pytest.raises(UnavailableError, match="refused"):
            client.predict(_batch())
    timer = threading.Timer(0.3, lambda: fake_http(port=port))
    timer.start()
    try:
        with RecserveClient(
            f"http://127.0.0.1:{port}", model_name="m", retries=20, backoff=(0.05, 0.2)
        ) as client:
            result = client.predict(_batch())
    finally:
        timer.join()
    assert result.model_version == "v1"


@pytest.mark.parametrize(
    "reset",
    [
        ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
        BrokenPipeError(errno.EPIPE, "Broken pipe"),
    ],
)
def test_http_connection_reset_while_connecting_is_retried(fake_http, monkeypatch, reset):
    # urllib3 wraps a reset during connect() in NewConnectionError, which was raised at once
    # (gRPC retries it, and nothing was sent): it is now retried like a refused connection.
    import urllib3.util.connection

    server = fake_http()
    real = urllib3.util.connection.create_connection
    attempts: list[int] = []

    def flaky(*args, **kwargs):
        attempts.append(1)
        if len(attempts) <= 2:
            raise reset
        return real(*args, **kwargs)

    monkeypatch.setattr(urllib3.util.connection, "create_connection", flaky)
    with RecserveClient(server.url, model_name="m", retries=3, **FAST) as client:
        result = client.predict(_batch())
    assert (len(attempts), server.requests, result.model_version) == (3, 1, "v1")

    attempts.clear()
    client = RecserveClient(server.url, model_name="m", retries=1, **FAST)
    with client, pytest.raises(UnavailableError) as caught:
        client.predict(_batch())
    assert caught.value.message == (
        f"server {server.url} reset the connection while connecting (gave up after 2 attempts)"
    )
    assert (len(attempts), server.requests) == (2, 1)


def test_async_http_retries(fake_http):
    server = fake_http([(503, 0.0), (503, 0.0), (400, 0.0)])

    async def main():
        async with AsyncRecserveClient(server.url, model_name="m", retries=3, **FAST) as client:
            with pytest.raises(InvalidArgumentError):
                await client.predict(_batch())
            return await client.predict(_batch())

    result = asyncio.run(main())
    assert server.requests == 4
    assert result.model_version == "v1"


# --------------------------------------------------------------------------- gRPC fake
class FakeGrpc:
    """A KServe v2 gRPC server whose ModelInfer aborts with the scripted codes first."""

    def __init__(self, script: list[grpc.StatusCode] | None = None, port: int = 0, delay=0.0):
        from concurrent import futures

        self.script = list(script or [])
        self.delay = delay
        self.requests = 0
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handlers = {}
        for name, request_class, response_class in METHODS:
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                getattr(self, name, self._unimplemented),
                request_deserializer=request_class.FromString,
                response_serializer=response_class.SerializeToString,
            )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.url = f"grpc://127.0.0.1:{self.port}"
        self.server.start()

    def _unimplemented(self, request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not here")

    def ServerReady(self, request, context):
        return V2.ServerReadyResponse(ready=True)

    def ModelInfer(self, request, context):
        with self.lock:
            self.requests += 1
            code = self.script.pop(0) if self.script else None
        time.sleep(self.delay)
        if code is not None:
            context.abort(code, f"scripted {code.name}")
        response = V2.ModelInferResponse(model_name="m", model_version="v2")
        response.parameters["unknown_ids"].int64_param = 4
        response.outputs.add(name="prediction", datatype="FP32", shape=[2, 1])
        response.raw_output_contents.append(np.array([0.5, 0.75], dtype="<f4").tobytes())
        return response

    def stop(self) -> None:
        self.server.stop(0)


@pytest.fixture
def fake_grpc() -> Iterator[callable]:
    started: list[FakeGrpc] = []

    def start(script=None, port: int = 0, delay: float = 0.0) -> FakeGrpc:
        server = FakeGrpc(script, port, delay)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.mark.parametrize(
    "code",
    # CANCELLED: what grpc answers the calls still open when a server stops (a drain).
    [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED],
)
def test_grpc_unavailable_is_retried_until_success(fake_grpc, code):
    server = fake_grpc([code] * 2)
    with RecserveClient(server.url, model_name="m", retries=3, **FAST) as client:
        result = client.predict(_batch())
    assert server.requests == 3
    np.testing.assert_array_equal(result.predictions, [[0.5], [0.75]])
    assert (result.model_version, result.unknown_ids) == ("v2", 4)


def test_grpc_invalid_argument_is_not_retried(fake_grpc):
    server = fake_grpc([grpc.StatusCode.INVALID_ARGUMENT])
    with (
        RecserveClient(server.url, model_name="m", retries=3, **FAST) as client,
        pytest.raises(InvalidArgumentError, match="scripted INVALID_ARGUMENT"),
    ):
        client.predict(_batch())
    assert server.requests == 1


def test_grpc_deadline_is_honored(fake_grpc):
    server = fake_grpc(delay=1.0)
    with RecserveClient(server.url, model_name="m", timeout=0.2, retries=3, **FAST) as client:
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="DEADLINE_EXCEEDED"):
            client.predict(_batch())
        assert time.monotonic() - started < 0.9
    assert server.requests == 1


def test_grpc_connection_refused_then_server_starts(fake_grpc):
    port = _free_port()
    timer = threading.Timer(0.3, lambda: fake_grpc(port=port))
    timer.start()
    try:
        with RecserveClient(
            f"grpc://127.0.0.1:{port}", model_name="m", retries=20, backoff=(0.05, 0.2)
        ) as client:
            assert not client.ready(timeout=0.1)
            result = client.predict(_batch())
            assert client.ready()
    finally:
        timer.join()
    assert result.model_version == "v2"


class _ClosingListener:
    """A port that accepts connections and closes them at once (a server not up yet, as
    gRPC sees it: each connection attempt fails); records when each attempt came."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.attempts: list[float] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.attempts.append(time.monotonic())
            connection.close()

    def next_attempt(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) for the channel's next connection attempt."""
        seen, deadline = len(self.attempts), time.monotonic() + timeout
        while len(self.attempts) == seen and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(self.attempts) > seen, "no connection attempt"

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_grpc_retries_reach_a_server_that_came_back_while_the_channel_waited(fake_grpc, flavour):
    """A channel whose connection attempts failed for a while waits longer and longer between
    them (gRPC's reconnect backoff), failing every call at once meanwhile. That wait used to
    grow to 1 s, longer than all the waits of the default retries (0.35 s at most): a server
    that came back just after an attempt was unreachable for every retry of the next call
    ("Connection refused", gave up after 4 attempts). The channel now tries again within half
    the retries' shortest total wait."""
    listener = _ClosingListener()
    url = f"grpc://127.0.0.1:{listener.port}"
    client_class = RecserveClient if flavour == "sync" else AsyncRecserveClient
    client = client_class(url, model_name="m", timeout=2.0)  # default retries and backoff
    loop = asyncio.new_event_loop()

    def predict():
        call = client.predict(_batch())
        return loop.run_until_complete(call) if flavour == "async" else call

    try:
        started = time.monotonic()
        while time.monotonic() - started < 1.0:  # 1 s of failed attempts: the wait grows
            with pytest.raises(UnavailableError):
                predict()
            time.sleep(0.02)
        listener.next_attempt(timeout=2.0)  # just tried: the longest wait until the next
        listener.close()
        fake_grpc(port=listener.port)
        result = predict()
    finally:
        listener.close()
        if flavour == "async":
            loop.run_until_complete(client.close())
        else:
            client.close()
        loop.close()
    assert result.model_version == "v2"


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_grpc_connection_refused_says_there_was_no_connection_not_an_answer(flavour):
    """gRPC makes up the UNAVAILABLE of a channel that could not connect; the message used to
    say "server grpc://... answered gRPC UNAVAILABLE", which reads as a server up and refusing
    work (a full queue, a drain), not as nothing listening on that port."""
    port = _free_port()
    url = f"grpc://127.0.0.1:{port}"
    client_class = RecserveClient if flavour == "sync" else AsyncRecserveClient
    client = client_class(url, model_name="m", retries=1, **FAST)

    async def predict_async():
        async with client:
            return await client.predict(_batch())

    with pytest.raises(UnavailableError) as refused:
        if flavour == "sync":
            with client:
                client.predict(_batch())
        else:
            asyncio.run(predict_async())
    message = refused.value.message
    assert message.startswith(
        f"cannot connect to server {url}: gRPC UNAVAILABLE: failed to connect to all addresses"
    ), message
    assert "Connection refused" in message and "answered" not in message
    assert message.endswith("(gave up after 2 attempts)")


def test_grpc_client_on_an_http_port_is_told_so_at_once(fake_http):
    """An HTTP/1.1 server answers gRPC's HTTP/2 preface the same way every time: the call
    used to be retried (gave up after 4 attempts), with no word of the port mix-up that the
    HTTP client names in the opposite case."""
    server = fake_http()
    port = server.url.rsplit(":", 1)[1]
    url = f"grpc://127.0.0.1:{port}"
    with (
        RecserveClient(url, model_name="m", retries=3, **FAST) as client,
        pytest.raises(UnavailableError) as refused,
    ):
        client.metadata()
    message = refused.value.message
    assert message.startswith(f"cannot connect to server {url}: gRPC UNAVAILABLE: "), message
    assert message.endswith(  # no "(gave up after 4 attempts)": not retried
        f" (server {url} does not speak HTTP/2: is that the server's HTTP port? grpc:// URLs "
        "use its --grpc-port (8001 by default), http:// URLs its --http-port (8000))"
    ), message


def test_async_grpc_retries(fake_grpc):
    server = fake_grpc([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE])

    async def main():
        async with AsyncRecserveClient(server.url, model_name="m", retries=3, **FAST) as client:
            return await client.predict(_batch())

    assert asyncio.run(main()).model_version == "v2"
    assert server.requests == 3


def test_async_clients_work_across_event_loops(fake_http, fake_grpc):
    # One client, two asyncio.run() calls: the gRPC channel belonged to the first loop, and
    # the second call failed with a raw "RuntimeError: Event loop is closed" for good. It now
    # reopens its channel on the new loop, as the HTTP client (a thread pool) always worked.
    servers = {"http": fake_http(), "grpc": fake_grpc()}
    for protocol, server in servers.items():
        client = AsyncRecserveClient(server.url, model_name="m", retries=0, **FAST)

        async def once(client=client):
            return (await client.predict(_batch())).predictions.ravel().tolist()

        first, second = asyncio.run(once()), asyncio.run(once())
        loop = asyncio.new_event_loop()  # a loop left open, then another one
        try:
            third = loop.run_until_complete(once())
        finally:
            loop.close()
        fourth = asyncio.run(once())
        asyncio.run(client.close())
        expected = [0.25, 0.5] if protocol == "http" else [0.5, 0.75]
        assert [first, second, third, fourth] == [expected] * 4, protocol
        assert server.requests == 4, protocol


def test_async_grpc_client_refuses_a_second_loop_while_the_first_one_runs(fake_grpc):
    from embedding_store.errors import FailedPreconditionError

    server = fake_grpc()
    client = AsyncRecserveClient(server.url, model_name="m", retries=0, **FAST)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(client.predict(_batch()), loop).result(5)
        with pytest.raises(
            FailedPreconditionError,
            match=r"the gRPC client of grpc://127\.0\.0\.1:\d+ is in use on another event loop "
            r"\(running, or with calls pending\); use one client per event loop \(or one loop "
            r"at a time\)",
        ):
            asyncio.run(client.predict(_batch()))
        asyncio.run_coroutine_threadsafe(client.close(), loop).result(5)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    assert server.requests == 1


def _silent(connection: socket.socket, stop: threading.Event) -> None:
    connection.recv(65536)
    stop.wait(10)  # takes the request and never answers (bounded: 10 s)


def test_eval_does_not_retry_a_timeout_and_calls_it_a_deadline():
    from clients.eval_scorers import ServerScorer

    server = RawServer(_silent)
    try:
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError, match=r"did not answer within 0\.3 s"):
            ServerScorer(server.url, "m", timeout=0.3, retries=3)
        assert time.monotonic() - started < 2.0
        assert server.connections == 1
    finally:
        server.close()


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_calls_after_close_raise_the_same_error_on_every_client(scheme):
    from embedding_store.errors import FailedPreconditionError

    url = f"{scheme}://127.0.0.1:{_free_port()}"
    client = RecserveClient(url, model_name="m", retries=0)
    client.close()
    client.close()  # idempotent
    for call in (client.metadata, client.live, lambda: client.predict(_batch())):
        with pytest.raises(FailedPreconditionError, match="is closed; create a new client"):
            call()

    async def closed_async() -> None:
        async_client = AsyncRecserveClient(url, model_name="m", retries=0)
        await async_client.close()
        await async_client.close()
        for call in (async_client.metadata, async_client.ready):
            with pytest.raises(FailedPreconditionError, match="is closed"):
                await call()

    asyncio.run(closed_async())


@dataclasses.dataclass(frozen=True)
class _SignallingPolicy(RetryPolicy):
    """A RetryPolicy whose every wait is ``backoff_max`` s, and that sets ``waiting`` as one
    begins (the attempt before it has failed)."""

    waiting: threading.Event = dataclasses.field(default_factory=threading.Event)

    def delay(self, attempt: int) -> float:
        self.waiting.set()
        return self.backoff_max


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_a_retry_after_the_client_was_closed_is_not_sent(fake_http, fake_grpc, scheme, flavour):
    """A retry waiting out its delay while another thread (task) closed the client used to go
    on: over HTTP on a new connection, over gRPC as a raw ValueError ("Cannot invoke RPC on
    closed channel!"), with asyncio on a new channel that nothing closed. Only the asyncio
    HTTP client refused it, as every client now does."""
    from embedding_store.errors import FailedPreconditionError

    server = (
        fake_http([(503, 0.0)]) if scheme == "http" else fake_grpc([grpc.StatusCode.UNAVAILABLE])
    )
    # The retry waits 0.3 s from `waiting`: close() comes well within that.
    policy = _SignallingPolicy(2, 0.3, 0.3)
    waiting = policy.waiting
    options = {"model_name": "m", "retries": 2}
    outcome: list[object] = []
    if flavour == "sync":
        client = RecserveClient(server.url, **options)
        client.policy = policy

        def call() -> None:
            try:
                outcome.append(client.predict(_batch()))
            except Exception as error:
                outcome.append(error)

        caller = threading.Thread(target=call)
        caller.start()
        assert waiting.wait(5), "no retry"
        client.close()
        caller.join(5)
    else:
        async_client = AsyncRecserveClient(server.url, **options)
        async_client.policy = policy
        client = async_client  # for the message below

        async def main() -> None:
            task = asyncio.create_task(async_client.predict(_batch()))
            assert await asyncio.to_thread(waiting.wait, 5), "no retry"
            await async_client.close()
            try:
                outcome.append(await task)
            except Exception as error:
                outcome.append(error)

        asyncio.run(main())
    [error] = outcome
    assert isinstance(error, FailedPreconditionError), error
    assert error.message == f"{client!r} is closed; create a new client"
    assert server.requests == 1


def test_grpc_backends_refuse_calls_once_closed():
    """What a call that raced close() meets: a FailedPreconditionError, not grpc's raw
    ValueError, nor a new asyncio channel."""
    from clients._grpc import AsyncGrpcBackend, GrpcBackend
    from embedding_store.errors import FailedPreconditionError

    url = f"grpc://127.0.0.1:{_free_port()}"
    message = f"the gRPC client of {url} is closed; create a new client"
    backend = GrpcBackend(url.removeprefix("grpc://"), url)
    backend.close()
    with pytest.raises(FailedPreconditionError) as refused:
        backend.live(1.0)
    assert refused.value.message == message

    async def main() -> None:
        async_backend = AsyncGrpcBackend(url.removeprefix("grpc://"), url)
        await async_backend.close()
        with pytest.raises(FailedPreconditionError) as refused:
            await async_backend.live(1.0)
        assert refused.value.message == message
        assert async_backend._channel is None

    asyncio.run(main())


def test_async_grpc_client_refuses_a_second_loop_while_the_first_has_calls_pending(fake_grpc):
    """A loop stopped with a call pending on it may run again: its channel stays (closing it
    cancelled that call with a raw CancelledError), and a second loop is refused. Once the
    call is done, a second loop may take over, though the first is not closed (a loop left
    open after run_until_complete)."""
    from embedding_store.errors import FailedPreconditionError

    server = fake_grpc()
    client = AsyncRecserveClient(server.url, model_name="m", retries=0, **FAST)
    loop = asyncio.new_event_loop()
    try:
        pending = loop.create_task(client.predict(_batch()))
        loop.run_until_complete(asyncio.sleep(0))  # the call starts; the loop stops
        with pytest.raises(FailedPreconditionError, match="with calls pending"):
            asyncio.run(client.predict(_batch()))
        assert loop.run_until_complete(pending).predictions.ravel().tolist() == [0.5, 0.75]
        second = asyncio.run(client.predict(_batch()))  # the first loop is idle, still open
        assert second.predictions.ravel().tolist() == [0.5, 0.75]
        asyncio.run(client.close())
    finally:
        loop.close()
    assert server.requests == 2


@pytest.mark.parametrize("status", [300, 404])
def test_http_answers_from_300_up_are_errors_not_retried(fake_http, status):
    # A redirect is not an answer: the client neither follows nor decodes it.
    server = fake_http([(status, 0.0)])
    with (
        RecserveClient(server.url, model_name="m", retries=3, **FAST) as client,
        pytest.raises(RecserveError, match=f"scripted {status}") as caught,
    ):
        client.predict(_batch())
    assert caught.value.message == (
        f"server {server.url} answered HTTP {status}: scripted {status}"
        + (" (HTTP 300)" if status == 300 else "")
    )
    assert server.requests == 1


def test_async_health_is_false_when_the_server_does_not_answer_in_time():
    # Accepts connections, never answers: each health call ends in DeadlineExceededError,
    # which a health check reports as False, as RecserveClient does.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"

        async def main():
            async with AsyncRecserveClient(url, model_name="m", retries=0) as client:
                return [
                    await client.live(timeout=0.2),
                    await client.ready(timeout=0.2),
                    await client.model_ready(timeout=0.2),
                ]

        assert asyncio.run(main()) == [False, False, False]


def test_async_retries_wait_the_policys_delay_of_each_attempt(fake_http, monkeypatch):
    server = fake_http([(503, 0.0), (503, 0.0)])
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def recorded_sleep(seconds: float) -> None:
        waits.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr("clients.aio.asyncio.sleep", recorded_sleep)

    async def main():
        async with AsyncRecserveClient(
            server.url, model_name="m", retries=3, backoff=(1.0, 100.0)
        ) as client:
            return await client.predict(_batch())

    assert asyncio.run(main()).model_version == "v1"
    assert server.requests == 3
    # Attempt k waits uniform(c / 2, c) with c = min(max, min * 2**k): [0.5, 1], then [1, 2].
    assert len(waits) == 2
    assert 0.5 <= waits[0] <= 1.0 and 1.0 <= waits[1] <= 2.0


# --------------------------------------------------------------------------- scripted transports
class ScriptedTransport:
    """Stands in for a client's backend: each call takes the next scripted outcome (an
    exception is raised, anything else returned) and is recorded with its arguments."""

    def __init__(self, outcomes: list[object]) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[tuple[str, tuple[object, ...]]] = []
        self.closed = 0

    def _next(self, method: str, *args: object) -> object:
        self.calls.append((method, args))
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def live(self, timeout: float | None) -> object:
        return self._next("live", timeout)

    def ready(self, timeout: float | None) -> object:
        return self._next("ready", timeout)

    def model_ready(self, model: str, timeout: float | None) -> object:
        return self._next("model_ready", model, timeout)

    def metadata(self, model: str, timeout: float | None) -> object:
        return self._next("metadata", model, timeout)

    def close(self) -> None:
        self.closed += 1


class AsyncScriptedTransport(ScriptedTransport):
    async def live(self, timeout: float | None) -> object:
        return self._next("live", timeout)

    async def ready(self, timeout: float | None) -> object:
        return self._next("ready", timeout)

    async def model_ready(self, model: str, timeout: float | None) -> object:
        return self._next("model_ready", model, timeout)

    async def metadata(self, model: str, timeout: float | None) -> object:
        return self._next("metadata", model, timeout)

    async def close(self) -> None:
        self.closed += 1


def _scripted_client(transport: ScriptedTransport, **options: object) -> RecserveClient:
    """A client (nothing listens on its URL) whose calls go to ``transport``."""
    options = {"backoff": (0.0, 0.0), **options}
    client = RecserveClient("http://127.0.0.1:9", model_name="m", **options)
    client._transport.close()
    client._transport = transport
    return client


def _scripted_async_client(
    transport: AsyncScriptedTransport, **options: object
) -> AsyncRecserveClient:
    options = {"backoff": (0.0, 0.0), **options}
    client = AsyncRecserveClient("http://127.0.0.1:9", model_name="m", **options)
    client._transport.sync.close()
    client._transport = transport
    return client


def _health_outcomes() -> list[object]:
    from clients.retry import RetryableError

    return [
        RetryableError(UnavailableError("refused")),
        UnavailableError("cannot connect"),
        DeadlineExceededError("too slow"),
        NotFoundError("no such model"),
    ]


def test_health_is_false_when_the_server_is_unreachable_or_slow_and_raises_otherwise():
    """live/ready/model_ready: unreachable (retryable or not) and timed out read False; any
    other error (an unknown model) raises; nothing is retried."""
    transport = ScriptedTransport(_health_outcomes())
    client = _scripted_client(transport, retries=3)
    assert [client.live(), client.ready(), client.model_ready()] == [False, False, False]
    with pytest.raises(NotFoundError, match="no such model"):
        client.model_ready(timeout=2.0)
    assert [call[0] for call in transport.calls] == ["live", "ready", "model_ready", "model_ready"]
    assert transport.calls[-1] == ("model_ready", ("m", 2.0))


def test_async_health_is_false_when_the_server_is_unreachable_or_slow_and_raises_otherwise():
    transport = AsyncScriptedTransport(_health_outcomes())
    client = _scripted_async_client(transport, retries=3)

    async def main() -> list[bool]:
        flags = [await client.live(), await client.ready(), await client.model_ready()]
        with pytest.raises(NotFoundError, match="no such model"):
            await client.model_ready(timeout=2.0)
        return flags

    assert asyncio.run(main()) == [False, False, False]
    assert [call[0] for call in transport.calls] == ["live", "ready", "model_ready", "model_ready"]
    assert transport.calls[-1] == ("model_ready", ("m", 2.0))


def test_one_failed_attempt_is_raised_as_it_is_and_more_say_how_many():
    """With retries=0 the error is the transport's own (no "gave up" suffix); after retries
    it names the number of attempts, sync and async alike."""
    from clients.retry import RetryableError

    def outcomes() -> list[object]:
        return [RetryableError(UnavailableError("busy")) for _ in range(3)]

    with pytest.raises(UnavailableError) as caught:
        _scripted_client(ScriptedTransport(outcomes()), retries=0).metadata()
    assert caught.value.message == "busy"
    with pytest.raises(UnavailableError) as caught:
        _scripted_client(ScriptedTransport(outcomes()), retries=2).metadata()
    assert caught.value.message == "busy (gave up after 3 attempts)"

    async def exhaust(retries: int) -> None:
        await _scripted_async_client(AsyncScriptedTransport(outcomes()), retries=retries).metadata()

    with pytest.raises(UnavailableError) as caught:
        asyncio.run(exhaust(0))
    assert caught.value.message == "busy"
    with pytest.raises(UnavailableError) as caught:
        asyncio.run(exhaust(2))
    assert caught.value.message == "busy (gave up after 3 attempts)"


class FakeClock:
    """``time.monotonic`` and ``sleep`` on a clock that moves only when slept on."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_wait_until_ready_polls_until_the_deadline_with_capped_timeouts(monkeypatch):
    """Each poll's timeout is the time left, at most 1 s and at least 0.01 s; a poll is made
    at the deadline itself, none after it; True as soon as a poll says so."""
    clock = FakeClock()
    monkeypatch.setattr("clients.client.time", clock)
    transport = ScriptedTransport([False] * 6)
    client = _scripted_client(transport)
    assert client.wait_until_ready(2.5, interval=0.5) is False
    # Polls at 100, 100.5, ..., 102.5 (the deadline): time left 2.5, 2, 1.5, 1, 0.5, 0.
    assert [args[0] for _, args in transport.calls] == [1.0, 1.0, 1.0, 1.0, 0.5, 0.01]
    assert clock.slept == [0.5] * 5

    transport = ScriptedTransport([False, False, True])
    client = _scripted_client(transport)
    assert client.wait_until_ready(10.0, interval=0.5) is True
    assert len(transport.calls) == 3


def test_async_wait_until_ready_polls_until_the_deadline_with_capped_timeouts(monkeypatch):
    clock = FakeClock()

    async def fake_sleep(seconds: float) -> None:
        clock.sleep(seconds)

    monkeypatch.setattr("clients.aio.time", clock)
    monkeypatch.setattr("clients.aio.asyncio.sleep", fake_sleep)
    transport = AsyncScriptedTransport([False] * 6)
    client = _scripted_async_client(transport)
    assert asyncio.run(client.wait_until_ready(2.5, interval=0.5)) is False
    assert [args[0] for _, args in transport.calls] == [1.0, 1.0, 1.0, 1.0, 0.5, 0.01]
    assert clock.slept == [0.5] * 5


@pytest.mark.parametrize(
    ("timeout", "interval", "message"),
    [
        (30.0, math.nan, "wait_until_ready interval must be > 0 and <= 1000000 seconds, got nan"),
        (30.0, -1.0, "wait_until_ready interval must be > 0 and <= 1000000 seconds, got -1.0"),
        (30.0, 0, "wait_until_ready interval must be > 0 and <= 1000000 seconds, got 0"),
        (30.0, math.inf, "wait_until_ready interval must be > 0 and <= 1000000 seconds, got inf"),
        (30.0, "1", "wait_until_ready interval must be > 0 and <= 1000000 seconds, got '1'"),
        (math.nan, 0.5, "wait_until_ready timeout must be >= 0 and <= 1000000 seconds, got nan"),
        (-1, 0.5, "wait_until_ready timeout must be >= 0 and <= 1000000 seconds, got -1"),
        (True, 0.5, "wait_until_ready timeout must be >= 0 and <= 1000000 seconds, got True"),
    ],
)
def test_wait_until_ready_refuses_bad_seconds_before_polling(timeout, interval, message):
    """An interval of NaN or < 0 was a raw ValueError of time.sleep (after a first poll)."""
    transport = ScriptedTransport([False] * 3)
    with pytest.raises(InvalidArgumentError) as caught:
        _scripted_client(transport).wait_until_ready(timeout, interval=interval)
    assert caught.value.message == message
    atransport = AsyncScriptedTransport([False] * 3)
    with pytest.raises(InvalidArgumentError) as caught:
        asyncio.run(_scripted_async_client(atransport).wait_until_ready(timeout, interval=interval))
    assert caught.value.message == message
    assert transport.calls == [] and atransport.calls == []


def test_close_releases_the_transport_once():
    transport = ScriptedTransport([])
    client = _scripted_client(transport)
    with client:
        pass  # entered and left: leaving closes it
    client.close()
    assert transport.closed == 1

    async_transport = AsyncScriptedTransport([])
    async_client = _scripted_async_client(async_transport)

    async def close_twice() -> None:
        async with async_client:
            pass  # entered and left: leaving closes it
        await async_client.close()

    asyncio.run(close_twice())
    assert async_transport.closed == 1


def test_async_http_close_shuts_its_thread_pool_down():
    async def main() -> AsyncRecserveClient:
        client = AsyncRecserveClient("http://127.0.0.1:9", model_name="m")
        await client.close()
        return client

    client = asyncio.run(main())
    with pytest.raises(RuntimeError, match="shutdown"):
        client._transport._executor.submit(int)


def test_a_scalar_backoff_is_the_minimum_and_the_default_maximum_or_itself():
    assert _scripted_client(ScriptedTransport([]), backoff=0.2).policy == RetryPolicy(3, 0.2, 1.0)
    assert _scripted_client(ScriptedTransport([]), backoff=3).policy == RetryPolicy(3, 3.0, 3.0)


@pytest.mark.parametrize("model_name", ["", None, 3])
def test_model_name_must_be_a_non_empty_string(model_name):
    with pytest.raises(InvalidArgumentError, match="model_name must be a non-empty string"):
        RecserveClient("http://127.0.0.1:9", model_name=model_name)


@pytest.mark.parametrize(
    ("option", "value", "bound"),
    [
        ("max_connections", 0, ">= 1"),
        ("max_connections", -1, ">= 1"),
        ("max_connections", "8", ">= 1"),
        ("max_connections", True, ">= 1"),
        ("max_message_bytes", 0, "between 1 and 2147483647"),
        ("max_message_bytes", 2**31, "between 1 and 2147483647"),
        ("max_message_bytes", 1.5, "between 1 and 2147483647"),
    ],
)
def test_connection_and_message_limits_must_be_positive_integers(option, value, bound):
    # They used to be taken as given and fail later, raw or not at all: the asyncio HTTP
    # client's thread pool raised ValueError for 0, gRPC took a 0-byte limit that no message
    # fits and overflowed its C int on 2**31.
    for client_class in (RecserveClient, AsyncRecserveClient):
        for url in ("http://127.0.0.1:9", "grpc://127.0.0.1:9"):
            with pytest.raises(InvalidArgumentError) as caught:
                client_class(url, model_name="m", **{option: value})
            assert caught.value.message == f"{option} must be an integer {bound}, got {value!r}"
    with RecserveClient("grpc://127.0.0.1:9", max_connections=np.int64(1)) as client:
        assert client._max_connections == 1 and type(client._max_connections) is int


@pytest.mark.parametrize("rows", [[], ()])
def test_predict_of_no_rows_is_an_invalid_argument(rows):
    with (
        RecserveClient("http://127.0.0.1:9", model_name="m") as client,
        pytest.raises(InvalidArgumentError, match=r"predict\(\) got no rows"),
    ):
        client.predict(rows)


@pytest.mark.parametrize("data", [[1, 2], [{"a": 1}, "b"], ("row",)])
def test_predict_of_a_list_that_is_not_dict_rows_is_a_type_error(data):
    """Only an empty list is "no rows"; a list of anything but dicts is the wrong type."""
    with (
        RecserveClient("http://127.0.0.1:9", model_name="m") as client,
        pytest.raises(TypeError, match="takes a Batch or a list of dict rows, got"),
    ):
        client.predict(data)


def test_http_model_names_are_quoted_into_one_path_segment(fake_http):
    server = fake_http()
    with RecserveClient(server.url, model_name="a/b c", retries=0) as client:
        assert client.model_ready() is True
    assert server.paths == ["/v2/models/a%2Fb%20c/ready"]


def test_http_close_drops_the_pooled_connections(fake_http):
    server = fake_http()
    client = RecserveClient(server.url, model_name="m", retries=0)
    assert client.live() is True
    pool = client._transport._pool
    assert len(pool.pools) == 1
    client.close()
    assert len(pool.pools) == 0


def test_connect_failures_are_found_along_the_exception_chain():
    """A refusal or a reset while connecting is recognized in the error itself, its cause,
    its context, by errno, or by the text of the error; anything else is no connect failure
    (and a chain that loops back on itself ends)."""
    import errno as errno_codes

    from clients._http import _connect_failure

    refused, reset = "refused the connection", "reset the connection while connecting"
    by_context = RuntimeError("wrapped")
    by_context.__context__ = ConnectionRefusedError()
    assert _connect_failure(by_context) == refused
    by_cause = RuntimeError("wrapped")
    by_cause.__cause__ = BrokenPipeError()
    assert _connect_failure(by_cause) == reset

    class SocketError(OSError):
        """An OSError subclass: unlike OSError itself, not remapped by errno."""

    assert _connect_failure(SocketError(errno_codes.ECONNREFUSED, "no")) == refused
    assert _connect_failure(SocketError(errno_codes.ECONNRESET, "no")) == reset
    assert _connect_failure(SocketError(errno_codes.EPIPE, "no")) == reset
    assert _connect_failure(RuntimeError("[Errno 111] Connection refused")) == refused
    assert _connect_failure(RuntimeError("Connection reset by peer")) == reset
    assert _connect_failure(RuntimeError("Broken pipe")) == reset
    looping = RuntimeError("name resolution failed")
    looping.__context__ = looping
    assert _connect_failure(looping) is None


class _FakeSocket:
    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def settimeout(self, seconds: float) -> None:
        self.timeouts.append(seconds)


class _FakeResponse:
    """An urllib3 response that hands out ``chunks`` one read at a time."""

    def __init__(self, chunks: list[bytes], clock: FakeClock, per_read: float) -> None:
        self.chunks = list(chunks)
        self.clock = clock
        self.per_read = per_read
        self.sock = _FakeSocket()
        self.connection = type("Connection", (), {"sock": self.sock})()
        self.released = 0
        self.closed = 0
        self.status = 200
        self.headers: dict[str, str] = {}

    def read1(self, size: int) -> bytes:
        self.clock.now += self.per_read
        return self.chunks.pop(0) if self.chunks else b""

    def read(self) -> bytes:
        data = b"".join(self.chunks)
        self.chunks.clear()
        return data

    def release_conn(self) -> None:
        self.released += 1

    def close(self) -> None:
        self.closed += 1


def test_http_reads_are_bounded_by_the_time_left_until_the_deadline(monkeypatch):
    """Each read gets the time left as its socket timeout; once the deadline is reached
    (exactly, too) the answer is abandoned as a timeout."""
    from clients._http import _read_before

    clock = FakeClock()
    monkeypatch.setattr("clients._http.time", clock)
    response = _FakeResponse([b"ab", b"cd"], clock, per_read=1.0)
    assert _read_before(response, deadline=110.0) == b"abcd"
    assert response.sock.timeouts == [10.0, 9.0, 8.0]

    response = _FakeResponse([b"ab", b"cd", b"ef"], clock, per_read=1.0)
    with pytest.raises(TimeoutError, match="deadline passed"):
        _read_before(response, deadline=clock.now + 2.0)  # reached after the second read
    assert response.sock.timeouts == [2.0, 1.0]


def test_http_connections_go_back_to_the_pool_even_when_the_read_fails(monkeypatch):
    from clients._http import HttpBackend

    clock = FakeClock()
    monkeypatch.setattr("clients._http.time", clock)
    backend = HttpBackend("http://127.0.0.1:9")
    responses = [
        _FakeResponse([b'{"ready": true}'], clock, per_read=0.0),
        _FakeResponse([b"slow"] * 5, clock, per_read=1.0),
    ]
    served = list(responses)
    monkeypatch.setattr(backend._pool, "request", lambda *args, **kwargs: served.pop(0))
    assert backend.live(timeout=None) is True
    with pytest.raises(DeadlineExceededError, match=r"did not answer GET /v2/health/ready"):
        backend.ready(timeout=2.0)
    assert [response.released for response in responses] == [1, 1]
    # The abandoned answer's connection is closed, so that no later request reads the rest
    # of it as its own answer; the one read to the end stays open for reuse.
    assert [response.closed for response in responses] == [0, 1]
    backend.close()


def test_a_grpc_error_without_a_status_code_is_unknown_and_not_retried():
    from clients._grpc import _failure
    from clients.retry import RetryableError

    error = _failure("grpc://h:1", grpc.RpcError("no code"))
    assert not isinstance(error, RetryableError)
    assert type(error) is RecserveError
    assert error.message == "server grpc://h:1 answered gRPC UNKNOWN: no code"


def test_eval_server_scorer_retries_503_with_doubling_waits_and_nothing_else(
    fake_http, monkeypatch
):
    """``recserve eval --url``: a 503 is retried (waits 0.2 s, 0.4 s, ...) up to ``retries``
    times, then raised; a 400 is raised at once."""
    from clients.eval_scorers import ServerScorer

    waits: list[float] = []
    # The module's own clock only: the fake server's threads sleep on the real one.
    monkeypatch.setattr("clients.eval_scorers.time", types.SimpleNamespace(sleep=waits.append))

    def scorer(url: str, retries: int) -> ServerScorer:
        instance = object.__new__(ServerScorer)
        instance.url, instance.timeout, instance.retries = url, 5.0, retries
        return instance

    server = fake_http([(503, 0.0), (503, 0.0)])
    body, _ = scorer(server.url, 3)._call("POST", "/v2/models/m/infer", b"{}")
    assert orjson.loads(body)["model_version"] == "v1"
    assert server.requests == 3 and waits == [0.2, 0.4]

    waits.clear()
    server = fake_http([(503, 0.0)] * 3)
    with pytest.raises(UnavailableError, match="scripted 503"):
        scorer(server.url, 1)._call("POST", "/v2/models/m/infer", b"{}")
    assert server.requests == 2 and waits == [0.2]

    waits.clear()
    server = fake_http([(400, 0.0)])
    with pytest.raises(InvalidArgumentError, match="scripted 400"):
        scorer(server.url, 3)._call("POST", "/v2/models/m/infer", b"{}")
    assert server.requests == 1 and waits == []


@pytest.mark.parametrize("backoff", [(1.0,), (0.1, 0.2, 0.3), "ab", None, ("a", "b"), True])
def test_a_backoff_that_is_no_duration_or_pair_is_an_invalid_argument(backoff):
    """As for ``timeout``: a bad ``backoff`` is an InvalidArgumentError naming it (it used to
    be a raw "not enough values to unpack" ValueError, or a TypeError)."""
    with pytest.raises(InvalidArgumentError, match=r"backoff must be seconds or \(min, max\)"):
        RecserveClient("http://127.0.0.1:9", model_name="m", backoff=backoff)


@pytest.mark.parametrize("retries", ["3", 1.5, None, True])
def test_retries_that_are_no_integer_are_an_invalid_argument(retries):
    with pytest.raises(InvalidArgumentError, match=f"retries must be an integer, got {retries!r}"):
        RecserveClient("http://127.0.0.1:9", model_name="m", retries=retries)


def test_retries_may_be_a_numpy_integer():
    with RecserveClient("http://127.0.0.1:9", model_name="m", retries=np.int64(2)) as client:
        assert client.policy.retries == 2 and type(client.policy.retries) is int


def test_async_grpc_client_takes_a_new_loop_once_the_first_closed_with_a_call_pending(fake_grpc):
    """A loop closed with a call still pending on it will never run it: the call is lost,
    and a new loop may take over the client (only a loop that may still run is guarded)."""
    server = fake_grpc(delay=0.5)
    client = AsyncRecserveClient(server.url, model_name="m", retries=0, **FAST)
    loop = asyncio.new_event_loop()
    pending = loop.create_task(client.predict(_batch()))
    loop.run_until_complete(asyncio.sleep(0))  # the call starts; the loop stops
    assert client._transport._in_flight == 1
    loop.close()
    server.delay = 0.0

    async def again():
        try:
            return await client.predict(_batch())
        finally:
            await client.close()

    assert asyncio.run(again()).predictions.ravel().tolist() == [0.5, 0.75]
    del pending


def test_http_clients_pointed_at_a_grpc_port_say_so_and_do_not_retry(fake_grpc):
    """`recserve predict` / `eval --url` given the gRPC port (8001 for 8000): the HTTP/2
    frames it answers with were a retried "BadStatusLine('\\x00\\x00\\x18\\x04...')" (predict)
    and a traceback (eval)."""
    from clients.eval_scorers import ServerScorer

    server = fake_grpc()
    url = f"http://127.0.0.1:{server.port}"
    expected = (
        f"server {url} answered in HTTP/2, not HTTP/1.1: is that the server's gRPC port? "
        "HTTP clients use its --http-port (8000 by default), grpc:// URLs its --grpc-port (8001)"
    )
    with (
        RecserveClient(url, model_name="m", retries=3, **FAST) as client,
        pytest.raises(UnavailableError) as raised,
    ):
        client.predict(_batch())
    assert raised.value.message == expected  # one attempt: no "(gave up after 4 attempts)"
    with pytest.raises(UnavailableError) as raised:
        ServerScorer(url, "m", timeout=5, retries=3)
    assert raised.value.message == expected


class _ClockedStubs:
    """gRPC stubs of a ModelReady that answers false after ``ready_s`` seconds of a fake
    clock, and a ModelMetadata that records the timeout it was given."""

    def __init__(self, ready_s: float) -> None:
        self.now, self.ready_s = 100.0, ready_s
        self.metadata_timeouts: list[float | None] = []

    def clock(self) -> float:
        return self.now

    def model_ready(self, request, timeout=None):
        self.now += self.ready_s
        return V2.ModelReadyResponse(ready=False)

    def metadata(self, request, timeout=None):
        self.metadata_timeouts.append(timeout)
        return V2.ModelMetadataResponse(name=request.name)

    def stubs(self, wrap=lambda f: f) -> dict:
        return {"ModelReady": wrap(self.model_ready), "ModelMetadata": wrap(self.metadata)}


@pytest.mark.parametrize(
    ("ready_s", "timeout", "metadata_timeouts"),
    [
        (1.5, 2.0, [0.5]),  # the metadata call gets what is left of the one timeout
        (2.0, 2.0, []),  # none left: not ready, and no second call
        (2.5, 2.0, []),
        (1.5, None, [None]),  # no limit: none for either call
    ],
)
def test_grpc_model_ready_takes_one_timeout_for_both_of_its_calls(
    monkeypatch, ready_s, timeout, metadata_timeouts
):
    """A model that answered "not ready" got a second call (to tell an unknown model apart)
    with a whole timeout of its own: up to twice the timeout in all."""
    import clients._grpc as grpc_backend

    stubs = _ClockedStubs(ready_s)
    monkeypatch.setattr(grpc_backend, "_clock", stubs.clock)
    backend = grpc_backend.GrpcBackend("127.0.0.1:9", "grpc://127.0.0.1:9")
    backend._stubs = stubs.stubs()
    try:
        assert backend.model_ready("m", timeout) is False
    finally:
        backend.close()
    assert stubs.metadata_timeouts == metadata_timeouts

    async_stubs = _ClockedStubs(ready_s)
    monkeypatch.setattr(grpc_backend, "_clock", async_stubs.clock)
    async_backend = grpc_backend.AsyncGrpcBackend("127.0.0.1:9", "grpc://127.0.0.1:9")

    def awaitable(function):
        async def call(request, timeout=None):
            return function(request, timeout=timeout)

        return call

    async def main() -> bool:
        async_backend._channel = types.SimpleNamespace(close=lambda: None)  # no real channel
        async_backend._loop = asyncio.get_running_loop()
        async_backend._stubs = async_stubs.stubs(awaitable)
        return await async_backend.model_ready("m", timeout)

    assert asyncio.run(main()) is False
    assert async_stubs.metadata_timeouts == metadata_timeouts


def test_closing_the_async_http_client_fails_the_calls_waiting_for_a_connection(fake_http):
    """Calls queued for the asyncio HTTP client's worker threads ran after close(), sent to
    the server once a thread was free; now each fails at once, unsent, and says why."""
    from embedding_store.errors import FailedPreconditionError

    server = fake_http([(200, 0.8)])  # the first call holds the one connection 0.8 s

    async def main() -> list[tuple[str, float]]:
        client = AsyncRecserveClient(server.url, model_name="m", retries=0, max_connections=1)

        async def one() -> tuple[str, float]:
            try:
                await client.predict(_batch())
                outcome = "ok"
            except FailedPreconditionError as error:
                outcome = error.message
            return outcome, time.monotonic()

        calls = [asyncio.create_task(one()) for _ in range(3)]
        await asyncio.sleep(0.2)  # the first is sent; the two others wait for its thread
        closed = time.monotonic()
        await client.close()
        results = await asyncio.gather(*calls)
        with pytest.raises(FailedPreconditionError, match="is closed; create a new client"):
            await client._transport.infer("m", {}, 1.0)  # a retry's later attempt
        return [(outcome, at - closed) for outcome, at in results]

    first, *queued = asyncio.run(main())
    message = (
        f"AsyncRecserveClient({server.url!r}, model_name='m') was closed while this call "
        "waited for one of its connections (max_connections): it was not sent; create a new "
        "client"
    )
    assert [outcome for outcome, _ in queued] == [message, message]
    assert all(seconds < 0.4 for _, seconds in queued)  # at once, not after the first call
    assert first[0] == "ok"  # the one already sent is answered
    assert server.requests == 1


@pytest.mark.parametrize(
    ("details", "retried"),
    [
        ("Concurrent RPC limit exceeded!", True),  # grpcio, over --max-concurrent-rpcs
        ("Received message larger than max (70000000 vs. 67108864)", False),
        ("request of 9000 samples exceeds the limit of 4096", False),
    ],
)
def test_grpc_retries_a_servers_concurrent_call_limit_but_no_other_resource_exhausted(
    details, retried
):
    from clients._grpc import _failure
    from clients.retry import RetryableError
    from tests.unit.test_rpc_errors import FailedCall

    failure = _failure(
        "grpc://127.0.0.1:1", FailedCall(grpc.StatusCode.RESOURCE_EXHAUSTED, details)
    )
    assert isinstance(failure, RetryableError) is retried
    error = failure.error if isinstance(failure, RetryableError) else failure
    assert isinstance(error, CapacityError) and details in error.message
