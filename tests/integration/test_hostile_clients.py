"""``recserve serve`` against clients that misbehave: what reached the server as valid HTTP
or gRPC but is wrong, and connections that abuse the transport.

One server (the Adult checkpoint, logits out, the Adult preprocessor, a 1 s read timeout)
answers every test over raw sockets, ``http.client`` and tritonclient. Each test ends by
checking that the server still answers a good request.
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import socket
import time
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from examples.adult_income import features
from examples.adult_income.quickstart import SAMPLE_ROW
from tests.integration.test_serving import (
    ADULT_PREPROCESSOR,
    MODEL,
    assert_error,
    batch_arrays,
    json_prediction,
    kserve_json,
    read_rows,
    request,
    triton_inputs,
)

INFER = f"/v2/models/{MODEL}/infer"
READ_TIMEOUT = 1.0
KEEP_ALIVE = 5.0  # uvicorn's default keep-alive timeout
MAX_CONNECTIONS = 32  # above what the other tests hold at once


@pytest.fixture(scope="module")
def server(serve_process, adult_checkpoint):
    return serve_process(
        adult_checkpoint,
        "--preprocessor",
        ADULT_PREPROCESSOR,
        "--read-timeout-seconds",
        str(READ_TIMEOUT),
        "--max-connections",
        str(MAX_CONNECTIONS),
    )


@pytest.fixture(scope="module")
def arrays() -> dict[str, np.ndarray]:
    batch = features.rows_to_batch(read_rows(3), with_labels=False, requires_grad=False)
    return batch_arrays(batch)


def _post(server, path: str, document: Any, headers: dict[str, str] | None = None):
    return request(server.http_url, "POST", path, json.dumps(document).encode(), headers)


def _assert_serving(server, arrays) -> None:
    status, body = _post(server, INFER, kserve_json(arrays))
    assert status == 200, body
    assert json_prediction(json.loads(body)).shape == (3, 1)


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=15)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _status_and_error(raw: bytes) -> tuple[int, str]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    document = json.loads(body)
    assert set(document) == {"error"}, document
    return status, document["error"]


# --------------------------------------------------------------------------- what is asked
def test_predictions_that_overflow_are_refused_naming_the_sample(server, arrays):
    # Finite inputs near FP32's limit overflow inside the model: the logit is Inf or NaN,
    # which JSON would carry as null with a 200.
    bad = {k: v.copy() for k, v in arrays.items()}
    bad["numeric"][1, :] = 3.4e38
    status, body = _post(server, INFER, kserve_json(bad))
    assert_error(status, body, 400, "not finite", "1 sample(s)", "first at sample 1")
    with httpclient.InferenceServerClient(server.http_url) as client:
        with pytest.raises(InferenceServerException) as raised:
            client.infer(MODEL, triton_inputs(httpclient, bad, binary_data=True))
        assert raised.value.status() == "400"
        assert "first at sample 1" in raised.value.message()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(InferenceServerException) as raised:
            client.infer(MODEL, triton_inputs(grpcclient, bad))
        assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "first at sample 1" in raised.value.message()
    _assert_serving(server, arrays)


@pytest.mark.parametrize(
    ("column", "value", "needle"),
    [
        ("age", 1e300, "row 0: column 'age' is out of range"),
        ("age", True, "row 0: column 'age' must be a number, got True"),
        ("hours-per-week", "1_000", "must be a number, got '1_000'"),
        ("workclass", None, "row 0: column 'workclass' must be a string, got None"),
        ("race", 5, "column 'race' must be a string, got 5"),
    ],
)
def test_friendly_rows_out_of_range_or_mistyped_are_refused(server, arrays, column, value, needle):
    row = dict(SAMPLE_ROW, **{column: value})
    status, body = _post(server, f"/v1/models/{MODEL}:predict", {"instances": [row]})
    assert_error(status, body, 400, needle)
    status, body = _post(server, f"/v1/models/{MODEL}:predict", {"instances": [SAMPLE_ROW]})
    assert status == 200, body


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ("numeric as INT32", "input 'numeric' must be FP32, got INT32"),
        ("numeric as FP64", "input 'numeric' must be FP32, got FP64"),
        ("IDs as INT32", "input 'race': IDs must be INT64 or UINT64, got INT32"),
    ],
)
def test_declared_datatypes_must_be_the_models(server, arrays, change, needle):
    # FP32 bytes sent as INT32 would be read as huge integers and answered.
    header: dict[str, Any] = {"inputs": []}
    payload = b""
    for name, array in arrays.items():
        datatype = "UINT64" if array.dtype == np.uint64 else "FP32"
        data = array.tobytes()
        if name == "numeric" and change == "numeric as INT32":
            datatype = "INT32"  # the bytes stay FP32's
        elif name == "numeric" and change == "numeric as FP64":
            datatype, data = "FP64", array.astype(np.float64).tobytes()
        elif name == "race" and change == "IDs as INT32":
            datatype, data = "INT32", array.astype(np.int32).tobytes()
        header["inputs"].append(
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": datatype,
                "parameters": {"binary_data_size": len(data)},
            }
        )
        payload += data
    head = json.dumps(header).encode()
    status, body = request(
        server.http_url,
        "POST",
        INFER,
        head + payload,
        {"Inference-Header-Content-Length": str(len(head))},
    )
    assert_error(status, body, 400, needle)
    _assert_serving(server, arrays)


def test_true_and_false_among_numbers_are_refused(server, arrays):
    document = kserve_json(arrays)
    race = next(t for t in document["inputs"] if t["name"] == "race")
    race["data"][1] = True  # numpy would read it as ID 1
    status, body = _post(server, INFER, document)
    assert_error(status, body, 400, "input 'race'", "must be numbers, got true/false")
    _assert_serving(server, arrays)


def test_bodies_that_say_two_things_are_refused(server, arrays):
    # gzip data followed by anything (junk, a second member) would be dropped unread.
    body = json.dumps(kserve_json(arrays)).encode()
    for tail in (b"junk!", gzip.compress(b"{}")):
        status, answer = request(
            server.http_url, "POST", INFER, gzip.compress(body) + tail, {"Content-Encoding": "gzip"}
        )
        assert_error(status, answer, 400, f"{len(tail)} byte(s) after the end of its gzip data")
    # An input with both JSON data and binary bytes.
    document = kserve_json(arrays)
    race = next(t for t in document["inputs"] if t["name"] == "race")
    race["parameters"] = {"binary_data_size": 24}
    head = json.dumps(document).encode()
    status, answer = request(
        server.http_url,
        "POST",
        INFER,
        head + bytes(24),
        {"Inference-Header-Content-Length": str(len(head))},
    )
    assert_error(status, answer, 400, "input 'race' has both 'data' and parameters")
    _assert_serving(server, arrays)


def test_an_empty_outputs_list_asks_for_every_output(server, arrays):
    for size in (1, 300):  # a small body, and one over the 12 KiB of the simdjson path
        rows = {k: np.concatenate([v] * 100)[:size] for k, v in arrays.items()}
        document = dict(kserve_json(rows), outputs=[])
        status, body = _post(server, INFER, document)
        assert status == 200, body
        assert json_prediction(json.loads(body)).shape == (size, 1)


def test_long_names_in_errors_keep_their_status(server, arrays):
    long_name = "C" * 16000
    inputs = triton_inputs(grpcclient, arrays)
    inputs[0] = grpcclient.InferInput(long_name, list(arrays["workclass"].shape), "UINT64")
    inputs[0].set_data_from_numpy(arrays["workclass"])
    with (
        grpcclient.InferenceServerClient(server.grpc_url) as client,
        pytest.raises(InferenceServerException) as raised,
    ):
        client.infer(MODEL, inputs)
    # Not RESOURCE_EXHAUSTED: a message quoting 16 KB would overflow gRPC's metadata limit.
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "more characters)" in raised.value.message()
    assert len(raised.value.message()) < 2200
    document = kserve_json(arrays)
    document["inputs"][0]["name"] = long_name
    status, body = _post(server, INFER, document)
    message = assert_error(status, body, 400, "unknown input(s)", "more characters)")
    assert len(message) < 2200
    _assert_serving(server, arrays)


def test_405_names_the_allowed_methods_and_health_answers_head(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    try:
        connection.request("DELETE", "/v2/health/live")
        response = connection.getresponse()
        response.read()
        assert response.status == 405
        assert set(response.getheader("allow").replace(" ", "").split(",")) == {"GET", "HEAD"}
        for path in ("/v2/health/live", "/v2/health/ready"):
            connection.request("HEAD", path)
            response = connection.getresponse()
            assert response.status == 200 and response.read() == b""
    finally:
        connection.close()


def test_reload_paths_that_cannot_be_paths_are_bad_requests(server, arrays):
    for path in ("x" * 5000, "/tmp/a\0b", ""):
        status, body = _post(server, "/admin/reload", {"checkpoint": path})
        assert_error(status, body, 400, "'checkpoint' must be a path of 1 to 4096 characters")
    _assert_serving(server, arrays)


def test_reloads_load_only_under_the_reload_root(server, arrays, adult_checkpoint, tmp_path):
    # A checkpoint's TorchScript model is code: by default only directories next to the
    # served one load, and a symlink out of there counts as where it points.
    root = adult_checkpoint.resolve().parent
    for path in ("/etc", str(tmp_path / "elsewhere")):
        status, body = _post(server, "/admin/reload", {"checkpoint": path})
        assert_error(status, body, 403, f"checkpoint {path} is outside --reload-root {root}")
    link = root / "link-to-elsewhere"
    link.symlink_to(tmp_path)
    try:
        status, body = _post(server, "/admin/reload", {"checkpoint": str(link)})
        assert_error(status, body, 403, "is outside --reload-root")
    finally:
        link.unlink()
    _assert_serving(server, arrays)


# --------------------------------------------------------------------------- the transport
def test_request_heads_over_64_kib_get_431(server, arrays):
    with _connect(server) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: ")
        # The server answers and closes long before 4 MiB: the send failing is expected.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(64):
                sock.sendall(b"a" * 65536)
        raw = _read_until_closed(sock)
    status, message = _status_and_error(raw)
    assert status == 431 and "exceed 65536 bytes" in message
    _assert_serving(server, arrays)


def test_malformed_http_gets_a_json_400(server, arrays):
    for raw_request in (
        b"GET /v2/health/\x01live HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /v2/health/live HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    ):
        with _connect(server) as sock:
            sock.sendall(raw_request)
            status, message = _status_and_error(_read_until_closed(sock))
        assert status == 400 and message.startswith("malformed HTTP request: "), message
    _assert_serving(server, arrays)


def test_idle_and_slow_connections_are_closed(server, arrays):
    idle = _connect(server)  # sends nothing at all
    slow = _connect(server)  # starts a request and stalls
    started = time.monotonic()
    slow.sendall(b"POST " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n")
    with slow:
        raw = _read_until_closed(slow)
    slow_seconds = time.monotonic() - started
    status, message = _status_and_error(raw)
    assert status == 408 and f"within {READ_TIMEOUT:g} s of its first byte" in message
    assert READ_TIMEOUT <= slow_seconds < READ_TIMEOUT + 3
    with idle:
        assert _read_until_closed(idle) == b""  # closed without a word, as after keep-alive
    assert time.monotonic() - started < KEEP_ALIVE + 3
    _assert_serving(server, arrays)


def test_a_request_answered_before_its_body_is_in_gets_one_response_only(server, arrays):
    """A route that takes no body answers at once (405); when the announced body never
    comes, the connection is closed at the read deadline without a second, unsolicited
    response (it used to add a 408)."""
    with _connect(server) as sock:
        sock.sendall(b"POST /v2/health/live HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123")
        raw = _read_until_closed(sock)
    assert raw.startswith(b"HTTP/1.1 405 ")
    assert raw.count(b"HTTP/1.1 ") == 1, raw
    _assert_serving(server, arrays)


@pytest.mark.parametrize("path", ["infer", "health"])
def test_a_client_that_half_closes_after_its_request_gets_the_answer(server, arrays, path):
    if path == "infer":  # the fast path
        body = json.dumps(kserve_json(arrays)).encode()
        raw_request = (
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
            % (INFER.encode(), len(body))
            + body
        )
    else:  # the ASGI path
        raw_request = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
    with _connect(server) as sock:
        sock.sendall(raw_request)
        sock.shutdown(socket.SHUT_WR)
        raw = _read_until_closed(sock)
    assert raw.startswith(b"HTTP/1.1 200 OK\r\n"), raw[:200]


@pytest.mark.parametrize("gzip_it", [False, True])  # the fast protocol, then the ASGI path
def test_a_repeated_inference_header_content_length_is_refused(server, arrays, gzip_it):
    head = json.dumps(kserve_json(arrays)).encode()
    body = gzip.compress(head) if gzip_it else head
    lines = [
        f"POST {INFER} HTTP/1.1",
        "Host: x",
        "Connection: close",
        f"Content-Length: {len(body)}",
        f"Inference-Header-Content-Length: {len(head)}",
        f"Inference-Header-Content-Length: {len(head)}",
    ] + (["Content-Encoding: gzip"] if gzip_it else [])
    with _connect(server) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        status, error = _status_and_error(_read_until_closed(sock))
    assert status == 400
    assert error == (
        f"Inference-Header-Content-Length must be sent once, got '{len(head)}, {len(head)}' "
        "(it was repeated)"
    )
    _assert_serving(server, arrays)


def _refused_connections(server) -> tuple[int, float]:
    """(status of GET /metrics, its count of connections refused; -1 when not 200)."""
    status, body = request(server.http_url, "GET", "/metrics")
    if status != 200:
        return status, -1.0
    for line in body.decode().splitlines():
        if line.startswith('recserve_http_refused_total{reason="connections"}'):
            return status, float(line.split()[-1])
    raise AssertionError("no recserve_http_refused_total for connections in /metrics")


def test_connections_beyond_max_connections_get_503_and_the_server_serves_on(server, arrays):
    """--max-connections 32: connections held open one by one, each answered, until one is
    refused (the 33rd at the latest; earlier when others are still open): a 503 naming the
    flag, then closed. Once they are closed, the server serves again, and /metrics counted
    every refusal."""
    _, refused_before = _refused_connections(server)
    held: list[socket.socket] = []
    raw = b""
    try:
        for _ in range(MAX_CONNECTIONS + 1):
            sock = _connect(server)
            held.append(sock)
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            raw = sock.recv(65536)
            if not raw.startswith(b"HTTP/1.1 200"):
                break
        status, message = _status_and_error(raw + _read_until_closed(held[-1]))
        assert status == 503
        assert message == (
            f"this server process has its limit of {MAX_CONNECTIONS} connections open "
            "(--max-connections); the connection is closed: retry later, or on another server"
        )
    finally:
        for sock in held:
            sock.close()
    refused = 1
    for _ in range(100):  # the server sees the closes a moment later
        status, count = _refused_connections(server)
        if status == 200:
            break
        assert status == 503
        refused += 1
        time.sleep(0.02)
    assert count == refused_before + refused
    _assert_serving(server, arrays)
