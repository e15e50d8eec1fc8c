"""serving.http_protocol on a real uvicorn server on loopback, over raw sockets.

The infer handler answers with what it was given ({"via": "fast", ...}); the ASGI app behind
it answers {"via": "asgi", ...}. So every test sees which path served a request, and that
keep-alive, pipelining, HTTP/1.0, ``connection: close`` and disconnects behave as HTTP says.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator

import orjson
import pytest
import uvicorn
from starlette.responses import Response

from serving.http_fast_path import InferHandler
from serving.http_protocol import infer_protocol
from serving.http_responses import error_response

FAST_LIMIT = 1024


CANCELLED: list[bytes] = []  # bodies whose handler was cancelled


async def _handle(body: bytes, header_length: str | None, name: str, version: str | None):
    if body == b"slow":
        await asyncio.sleep(0.3)
    if body == b"hang":
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            CANCELLED.append(body)
            raise
    if body == b"boom":
        raise RuntimeError("a bug in the handler")
    if body == b"caught":  # as the real handler does: it answers its own errors
        return error_response(RuntimeError("a bug the handler caught"))
    answer = {
        "via": "fast",
        "name": name,
        "version": version,
        "body": body.decode(),
        "header_length": header_length,
    }
    return Response(orjson.dumps(answer), media_type="application/json")


async def _asgi_app(scope, receive, send) -> None:
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    answer = orjson.dumps({"via": "asgi", "path": scope["path"], "body_bytes": len(body)})
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


def _config(protocol: type) -> uvicorn.Config:
    """The test app on 127.0.0.1 behind ``protocol`` (an :func:`infer_protocol` class)."""
    return uvicorn.Config(
        _asgi_app,
        host="127.0.0.1",
        port=0,
        log_level="critical",
        lifespan="off",
        http=protocol,
    )


def _running(config: uvicorn.Config) -> Iterator[tuple[str, int]]:
    """Serve ``config`` on a free loopback port in a thread; yield its address, then stop."""
    instance = uvicorn.Server(config)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=instance.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not instance.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert instance.started
    yield listener.getsockname()
    instance.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, int]]:
    protocol = infer_protocol(InferHandler(_handle, max_body_bytes=64 * 1024), FAST_LIMIT)
    yield from _running(_config(protocol))


def _request(path: str, body: bytes, *, version: str = "1.1", headers: dict | None = None) -> bytes:
    lines = [f"POST {path} HTTP/{version}", "Host: test", f"Content-Length: {len(body)}"]
    lines += [f"{key}: {value}" for key, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _Connection:
    """A raw HTTP/1.x client connection that reads Content-Length framed responses."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.socket = socket.create_connection(address, timeout=5)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.socket.sendall(data)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            self._read()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in header_lines:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        length = int(headers["content-length"])
        while len(self.buffer) < length:
            self._read()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status_line.split()[1]), headers, body

    def closed_by_server(self) -> bool:
        try:
            return self.socket.recv(1) == b""
        except ConnectionResetError:
            return True

    def _read(self) -> None:
        chunk = self.socket.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        self.buffer += chunk

    def close(self) -> None:
        self.socket.close()

    def __enter__(self) -> _Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def test_small_infer_requests_take_the_fast_path_on_one_keep_alive_connection(server):
    with _Connection(server) as connection:
        for index in range(3):
            connection.send(_request("/v2/models/adult/infer", b"body-%d" % index))
            status, headers, body = connection.response()
            assert status == 200
            assert headers["content-type"] == "application/json"
            assert "date" in headers and "connection" not in headers
            assert json.loads(body) == {
                "via": "fast",
                "name": "adult",
                "version": None,
                "body": f"body-{index}",
                "header_length": None,
            }
        connection.send(
            _request(
                "/v2/models/adult/versions/7/infer",
                b"x",
                headers={"Inference-Header-Content-Length": "1"},
            )
        )
        assert json.loads(connection.response()[2]) == {
            "via": "fast",
            "name": "adult",
            "version": "7",
            "body": "x",
            "header_length": "1",
        }


@pytest.mark.parametrize(
    ("path", "body", "headers", "expected_path"),
    [
        ("/v2/models/adult/infer", b"y" * (FAST_LIMIT + 1), {}, "/v2/models/adult/infer"),
        ("/v2/models/adult/infer", gzip.compress(b"z"), {"Content-Encoding": "gzip"}, None),
        ("/v2/models/adult/infer?x=1", b"q", {}, "/v2/models/adult/infer"),
        ("/v2/models/a%20b/infer", b"q", {}, "/v2/models/a b/infer"),
        ("/v2/models/adult/ready", b"", {}, "/v2/models/adult/ready"),
        ("/v1/models/adult:predict", b"{}", {}, "/v1/models/adult:predict"),
    ],
    ids=["over-limit", "gzip", "query", "escaped", "other-route", "friendly-route"],
)
def test_everything_else_goes_through_the_asgi_app(server, path, body, headers, expected_path):
    with _Connection(server) as connection:
        connection.send(_request(path, body, headers=headers))
        status, _, answer = connection.response()
        document = json.loads(answer)
        assert status == 200
        assert document["via"] == "asgi"
        assert document["body_bytes"] == len(body)
        assert document["path"] == (expected_path or path)


def test_chunked_bodies_go_through_the_asgi_app(server):
    with _Connection(server) as connection:
        connection.send(
            b"POST /v2/models/adult/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n0\r\n\r\n"
        )
        status, _, answer = connection.response()
        assert status == 200
        assert json.loads(answer)["via"] == "asgi"


def test_pipelined_requests_are_answered_in_order(server):
    with _Connection(server) as connection:
        connection.send(
            _request("/v2/models/adult/infer", b"slow")  # answered after 0.3 s
            + _request("/v2/models/adult/infer", b"second")
            + _request("/v2/health/ready", b"")
        )
        answers = [json.loads(connection.response()[2]) for _ in range(3)]
        assert answers[0]["via"] == "fast" and answers[0]["body"] == "slow"
        # The pipelined infer request waited behind the first, so the ASGI path took it.
        assert answers[1] == {"via": "asgi", "path": "/v2/models/adult/infer", "body_bytes": 6}
        assert answers[2] == {"via": "asgi", "path": "/v2/health/ready", "body_bytes": 0}


def test_http_1_0_and_connection_close_answer_then_close(server):
    for version, headers in (("1.0", {}), ("1.1", {"Connection": "close"})):
        with _Connection(server) as connection:
            connection.send(
                _request("/v2/models/adult/infer", b"bye", version=version, headers=headers)
            )
            status, response_headers, answer = connection.response()
            assert status == 200
            assert response_headers["connection"] == "close"
            assert json.loads(answer)["via"] == "fast"
            assert connection.closed_by_server()


def test_a_failing_handler_answers_500_and_the_connection_stays_usable(server, caplog):
    with _Connection(server) as connection:
        connection.send(_request("/v2/models/adult/versions/3/infer", b"boom"))
        status, _, answer = connection.response()
        assert status == 500
        assert json.loads(answer) == {"error": "internal error (details are in the server log)"}
        # The log line names the request; the traceback is attached to it.
        connection.send(_request("/v2/models/adult/infer", b"caught"))
        assert connection.response()[0] == 500
        failed = [r for r in caplog.records if r.exc_info and r.name == "serving.http_responses"]
        assert [r.getMessage() for r in failed] == [
            "POST '/v2/models/adult/versions/3/infer' failed",
            "POST '/v2/models/adult/infer' failed",
        ]
        assert str(failed[0].exc_info[1]) == "a bug in the handler"
        assert str(failed[1].exc_info[1]) == "a bug the handler caught"
        connection.send(_request("/v2/models/adult/infer", b"after"))
        assert json.loads(connection.response()[2])["body"] == "after"


def test_a_connection_reset_before_its_answer_cancels_the_work(server):
    # Nobody is left to answer: the handler (and, in the server, the queued request behind
    # it) is cancelled at once instead of being computed and counted as a success. (A FIN
    # is a half-close, whose answer is still owed: see the half-close test.)
    gone = _Connection(server)
    gone.send(_request("/v2/models/adult/infer", b"hang"))
    time.sleep(0.2)  # the handler is waiting
    gone.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    gone.close()  # RST
    deadline = time.monotonic() + 5
    while not CANCELLED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert CANCELLED == [b"hang"]
    with _Connection(server) as connection:
        connection.send(_request("/v2/models/adult/infer", b"still"))
        assert json.loads(connection.response()[2])["body"] == "still"


def test_a_client_gone_mid_request_leaves_the_server_serving(server):
    gone = _Connection(server)
    gone.send(_request("/v2/models/adult/infer", b"slow"))
    gone.close()
    time.sleep(0.4)  # the slow answer finds its connection closed
    with _Connection(server) as connection:
        connection.send(_request("/v2/models/adult/infer", b"still"))
        assert json.loads(connection.response()[2])["body"] == "still"


def test_a_body_of_exactly_the_fast_limit_takes_the_fast_path(server):
    with _Connection(server) as connection:
        connection.send(_request("/v2/models/adult/infer", b"f" * FAST_LIMIT))
        status, _, answer = connection.response()
        assert status == 200
        document = json.loads(answer)
        assert document["via"] == "fast" and document["body"] == "f" * FAST_LIMIT


def test_http_1_0_closes_even_when_it_asks_for_keep_alive(server):
    # HTTP/1.0 keep-alive is not served: the answer says so and the socket closes.
    with _Connection(server) as connection:
        connection.send(
            _request(
                "/v2/models/adult/infer",
                b"old",
                version="1.0",
                headers={"Connection": "keep-alive"},
            )
        )
        status, headers, answer = connection.response()
        assert status == 200 and json.loads(answer)["via"] == "fast"
        assert headers["connection"] == "close"
        assert connection.closed_by_server()


def test_a_head_just_over_64_kib_gets_431_and_one_under_it_is_served(server):
    with _Connection(server) as connection:
        connection.send(b"POST /v2/models/adult/infer HTTP/1.1\r\n")
        time.sleep(0.05)  # the request line arrives alone: every later chunk is counted
        connection.send(b"Host: t\r\nX-Big: " + b"a" * (66 * 1024))
        status, headers, answer = connection.response()
        assert status == 431 and headers["connection"] == "close"
        assert json.loads(answer) == {"error": "the request line and headers exceed 65536 bytes"}
        assert connection.closed_by_server()
    with _Connection(server) as connection:
        connection.send(_request("/v2/models/adult/infer", b"ok", headers={"X-Big": "a" * 60000}))
        status, _, answer = connection.response()
        assert status == 200 and json.loads(answer)["body"] == "ok"


def test_a_head_of_exactly_64_kib_is_served_and_one_byte_more_gets_431(server):
    # Counted: the chunks after the request line that were head from start to end.
    def send_head(connection: _Connection, counted: int) -> None:
        connection.send(b"POST /v2/models/adult/infer HTTP/1.1\r\n")
        time.sleep(0.05)
        start = b"Host: t\r\nX-Big: "
        connection.send(start + b"a" * (counted - len(start)))
        time.sleep(0.05)
        connection.send(b"\r\nContent-Length: 2\r\n\r\nok")

    with _Connection(server) as connection:
        send_head(connection, 64 * 1024)
        status, _, answer = connection.response()
        assert status == 200 and json.loads(answer)["body"] == "ok"
    with _Connection(server) as connection:
        send_head(connection, 64 * 1024 + 1)
        status, headers, answer = connection.response()
        assert status == 431 and headers["connection"] == "close"
        assert json.loads(answer) == {"error": "the request line and headers exceed 65536 bytes"}


def test_each_request_on_a_keep_alive_connection_has_its_own_head_limit(server):
    with _Connection(server) as connection:
        for body in (b"r1", b"r2", b"r3"):  # 40 KiB heads: 120 KiB on the connection
            connection.send(b"POST /v2/models/adult/infer HTTP/1.1\r\n")
            time.sleep(0.05)
            connection.send(b"Host: t\r\nX-Big: " + b"a" * (40 * 1024))
            time.sleep(0.05)
            connection.send(b"\r\nContent-Length: 2\r\n\r\n" + body)
            status, _, answer = connection.response()
            assert status == 200 and json.loads(answer)["body"] == body.decode()


def test_expect_100_continue_goes_through_the_asgi_app_which_sends_100(server):
    with _Connection(server) as connection:
        connection.send(
            b"POST /v2/models/adult/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n"
            b"Expect: 100-continue\r\n\r\n"
        )
        while b"\r\n\r\n" not in connection.buffer:
            connection._read()
        interim, connection.buffer = connection.buffer.split(b"\r\n\r\n", 1)
        assert interim == b"HTTP/1.1 100 Continue"
        connection.send(b"ok")
        status, _, answer = connection.response()
        assert status == 200 and json.loads(answer) == {
            "via": "asgi",
            "path": "/v2/models/adult/infer",
            "body_bytes": 2,
        }


@pytest.mark.parametrize("sent", [b"", b"POST /v2/models/adult/infer HTTP/1.1\r\nHost"])
def test_a_client_that_half_closes_with_nothing_to_answer_is_closed_at_once(server, sent):
    with _Connection(server) as connection:
        connection.socket.settimeout(1.0)
        if sent:
            connection.send(sent)
        connection.socket.shutdown(socket.SHUT_WR)
        assert connection.socket.recv(1024) == b""  # closed, no answer (not after a timeout)


@pytest.mark.parametrize(
    "upgrade",
    [
        # What `curl --http2 http://...` sends.
        {"Connection": "Upgrade, HTTP2-Settings", "Upgrade": "h2c", "HTTP2-Settings": "AAMAAABk"},
        {"Connection": "Upgrade", "Upgrade": "websocket"},
    ],
    ids=["h2c", "websocket"],
)
def test_an_upgrade_the_server_does_not_make_is_ignored_and_the_body_is_read(server, upgrade):
    # llhttp stops parsing at an Upgrade request's head, so its body used to be lost (an
    # infer request answered 400 "empty document") and the connection went deaf. The server
    # speaks HTTP/1.1 only: it ignores the header (RFC 9110 7.8) and answers as without it.
    with _Connection(server) as connection:
        connection.send(
            _request("/v2/models/adult/infer", b"fast-body", headers=upgrade)
            + _request("/v2/models/adult/infer", b"y" * (FAST_LIMIT + 1), headers=upgrade)
            + _request("/v2/models/adult/infer", b"after")
        )
        answers = [connection.response() for _ in range(3)]
        assert [status for status, _, _ in answers] == [200, 200, 200]
        assert "upgrade" not in answers[0][1] and "connection" not in answers[0][1]
        assert json.loads(answers[0][2]) == {
            "via": "fast",
            "name": "adult",
            "version": None,
            "body": "fast-body",
            "header_length": None,
        }
        assert json.loads(answers[1][2]) == {
            "via": "asgi",
            "path": "/v2/models/adult/infer",
            "body_bytes": FAST_LIMIT + 1,
        }
        # Pipelined behind the others: the ASGI path took it.
        assert json.loads(answers[2][2]) == {
            "via": "asgi",
            "path": "/v2/models/adult/infer",
            "body_bytes": 5,
        }


def test_connect_is_refused_with_405(server):
    with _Connection(server) as connection:
        connection.send(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
        status, headers, body = connection.response()
        assert status == 405
        assert headers["connection"] == "close"
        assert json.loads(body) == {"error": "method CONNECT is not supported"}
        assert connection.closed_by_server()


@pytest.mark.parametrize(
    ("first", "answer"),
    [
        # The fast path, answered after 0.3 s.
        (
            _request("/v2/models/adult/infer", b"slow"),
            {
                "via": "fast",
                "name": "adult",
                "version": None,
                "body": "slow",
                "header_length": None,
            },
        ),
        (
            _request("/v2/models/adult/infer", b"slow", headers={"Content-Encoding": "identity"}),
            {"via": "asgi", "path": "/v2/models/adult/infer", "body_bytes": 4},
        ),
    ],
    ids=["fast", "asgi"],
)
def test_a_malformed_request_pipelined_behind_a_valid_one_is_refused_after_its_answer(
    server, first, answer
):
    # Answers go out in request order: the 400 of the malformed second request used to be
    # written at once, so the client read it as the answer to its valid first request, whose
    # answer was then dropped.
    with _Connection(server) as connection:
        connection.send(first + b"NOT HTTP\r\n\r\n")
        status, _, body = connection.response()
        assert status == 200 and json.loads(body) == answer
        status, headers, body = connection.response()
        assert status == 400 and headers["connection"] == "close"
        assert json.loads(body) == {"error": "malformed HTTP request: Invalid method encountered"}
        assert connection.closed_by_server()


def test_an_http2_preface_is_told_this_port_speaks_http_1_1(server):
    # What a gRPC client (or curl --http2-prior-knowledge) sends first; llhttp's own words
    # were "malformed HTTP request: Pause on PRI/Upgrade".
    with _Connection(server) as connection:
        connection.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        status, headers, body = connection.response()
        assert status == 400 and headers["connection"] == "close"
        assert json.loads(body) == {
            "error": "this port speaks HTTP/1.1 only, and this is an HTTP/2 connection "
            "preface: send HTTP/1.1 here, and gRPC to the server's gRPC port"
        }


# ------------------------------------------------------------------ caps on what is held
CAPPED_CONNECTIONS = 2
CAPPED_BODY_BYTES = 6000  # bytes of bodies being read at once
REFUSED: list[str] = []  # on_refused's reasons, in order


@pytest.fixture(scope="module")
def capped_server() -> Iterator[tuple[str, int]]:
    protocol = infer_protocol(
        InferHandler(_handle, max_body_bytes=8192),
        FAST_LIMIT,
        max_connections=CAPPED_CONNECTIONS,
        max_body_bytes_in_flight=CAPPED_BODY_BYTES,
        on_refused=REFUSED.append,
    )
    yield from _running(_config(protocol))


def _served(connection: _Connection, body: bytes = b"ok") -> dict:
    connection.send(_request("/v2/models/adult/infer", body))
    status, _, answer = connection.response()
    assert status == 200, answer
    return json.loads(answer)


def test_a_connection_beyond_max_connections_gets_503_and_is_closed(capped_server):
    REFUSED.clear()
    with _Connection(capped_server) as first, _Connection(capped_server) as second:
        # Answered: both are open on the server before the third arrives.
        assert _served(first)["via"] == _served(second)["via"] == "fast"
        with _Connection(capped_server) as third:
            third.send(_request("/v2/models/adult/infer", b"ok"))
            status, headers, answer = third.response()
            assert status == 503
            assert headers["connection"] == "close"
            assert json.loads(answer) == {
                "error": "this server process has its limit of 2 connections open "
                "(--max-connections); the connection is closed: retry later, or on another "
                "server"
            }
            assert third.closed_by_server()
        assert REFUSED == ["connections"]
        assert _served(first)["body"] == "ok"  # the open ones keep being served
    # Once they are closed, new connections are served again (the server sees the closes
    # a moment later: a few tries, each refused at once).
    for _ in range(50):
        with _Connection(capped_server) as fourth:
            fourth.send(_request("/v2/models/adult/infer", b"again"))
            status, _, answer = fourth.response()
        if status == 200:
            break
        time.sleep(0.02)
    assert status == 200 and json.loads(answer)["body"] == "again"


def test_a_request_beyond_the_body_budget_gets_503_and_the_connection_stays_usable(
    capped_server,
):
    REFUSED.clear()
    expected = {
        "error": "the request bodies this server process is reading would exceed 6000 bytes "
        "at once (--max-body-bytes-in-flight): retry later, or on another server"
    }
    with _Connection(capped_server) as slow, _Connection(capped_server) as other:
        # 5500 bytes declared, 10 sent: the budget holds 5500 until the rest is in.
        slow.send(_request("/v2/models/adult/infer", b"s" * 5500)[:-5490])
        # 600 more would exceed 6000: refused on the fast path's route, body dropped. The
        # server reads the slow head first a moment after it was sent: a few tries.
        for _ in range(50):
            other.send(_request("/v2/models/adult/infer", b"f" * 600))
            status, headers, answer = other.response()
            if status == 503:
                break
            time.sleep(0.02)
        assert status == 503 and json.loads(answer) == expected
        assert "connection" not in headers  # kept alive: the body was read and dropped
        # 500 more fit (6000 in all), on the same connection.
        assert _served(other, b"f" * 500) == {
            "via": "fast",
            "name": "adult",
            "version": None,
            "body": "f" * 500,
            "header_length": None,
        }
        slow.send(b"s" * 5490)
        status, _, answer = slow.response()
        assert status == 200 and json.loads(answer)["body_bytes"] == 5500
        # The budget is given back once a body is in: 600 fits now.
        assert _served(other, b"f" * 600)["via"] == "fast"
    assert REFUSED[0] == "body_bytes" and set(REFUSED) == {"body_bytes"}


def test_a_request_cut_short_gives_its_body_budget_back(capped_server):
    REFUSED.clear()
    with _Connection(capped_server) as gone:
        gone.send(_request("/v1/models/adult:predict", b"x" * 5800)[:-5000])
        time.sleep(0.05)
    # Its 5800 bytes are released when the server sees the close: 5800 more then fit.
    for _ in range(50):
        with _Connection(capped_server) as next_one:
            next_one.send(_request("/v1/models/adult:predict", b"y" * 5800))
            status, _, answer = next_one.response()
        if status == 200:
            break
        time.sleep(0.02)
    assert status == 200 and json.loads(answer)["body_bytes"] == 5800
