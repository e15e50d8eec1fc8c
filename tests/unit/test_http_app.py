"""HTTP front end, served for real by uvicorn on 127.0.0.1, driven by http.client and the real
tritonclient.http client."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import orjson
import pytest
import tritonclient.http as triton_http
import uvicorn
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from starlette.responses import Response
from tritonclient.utils import InferenceServerException

from serving.http_admin import AdminHooks
from serving.http_app import create_app
from serving.http_fast_path import InferFastPath
from tests.unit.fake_core import FakeCore, expected_predictions

MAX_BODY = 256 * 1024
TOKEN = "s3cret-token"


class LiveServer:
    """uvicorn running ``app`` in a thread on a free loopback port."""

    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            connection.close()

    def json(self, method: str, path: str, document=None, headers: dict | None = None):
        body = None if document is None else orjson.dumps(document)
        status, _, payload = self.request(method, path, body, headers)
        return status, orjson.loads(payload) if payload else None


@pytest.fixture(scope="module")
def core() -> FakeCore:
    return FakeCore()


@pytest.fixture(scope="module", params=["fastapi-routes", "infer-fast-path"])
def server(core, request) -> Iterator[LiveServer]:
    """The app as built, and behind InferFastPath as `recserve serve` runs it: every test
    must hold for both."""
    reloads: list[str | None] = []

    def reload(checkpoint: str | None) -> dict:
        reloads.append(checkpoint)
        return {"reloaded": checkpoint, "count": len(reloads)}

    app = create_app(core, max_body_bytes=MAX_BODY, admin=AdminHooks(reload, TOKEN))
    with LiveServer(InferFastPath(app) if request.param == "infer-fast-path" else app) as live:
        live.reloads = reloads
        yield live


@pytest.fixture
def admin_server(server) -> LiveServer:
    """`server` with its record of reload calls emptied: the server is shared by the module's
    tests, and a test that counts reloads must not depend on which admin tests ran first."""
    server.reloads.clear()
    return server


@pytest.fixture(autouse=True)
def _reset(core):
    core.is_ready, core.fail_with, core.fallback_ids = True, None, 0
    core.calls.clear()
    yield


def _tensors(users, ages, *, lengths_name="user.lengths"):
    ids = [i for row in users for i in row]
    return [
        {"name": "user", "shape": [len(ids)], "datatype": "UINT64", "data": ids},
        {
            "name": lengths_name,
            "shape": [len(users)],
            "datatype": "INT32",
            "data": [len(r) for r in users],
        },
        {"name": "age", "shape": [len(ages), 1], "datatype": "FP32", "data": [[a] for a in ages]},
    ]


USERS = [[1, 2], [3000], [2**63 + 5, 4, 9]]
AGES = [0.5, 1.0, -2.0]


# --------------------------------------------------------------------------- health, metadata
def test_health_and_server_metadata(server, core):
    metadata = {"name": "recserve-fake", "version": "0.1.0", "extensions": ["binary_tensor_data"]}
    assert server.json("GET", "/v2") == (200, metadata)
    # The path of the spec's OpenAPI documents (open_inference_rest.yaml: "/v2/").
    assert server.json("GET", "/v2/") == (200, metadata)
    assert server.json("GET", "/v2/health/live") == (200, {"live": True})
    assert server.json("GET", "/v2/health/ready") == (200, {"ready": True})
    core.is_ready = False
    # The KServe v2 REST spec: 200 is true, a 4xx false (Triton answers 400 too).
    assert server.json("GET", "/v2/health/ready") == (400, {"error": "server is not ready"})
    status, body = server.json("GET", "/v2/models/tiny/ready")
    assert (status, body) == (400, {"error": "model 'tiny' is not ready"})


def test_model_metadata_and_ready_routes(server):
    status, body = server.json("GET", "/v2/models/tiny")
    assert status == 200
    assert body["name"] == "tiny" and body["versions"] == ["1"]
    assert body["inputs"][0] == {"name": "user", "datatype": "UINT64", "shape": [-1]}
    assert body["outputs"] == [{"name": "prediction", "datatype": "FP32", "shape": [-1, 1]}]
    assert server.json("GET", "/v2/models/tiny/versions/1")[1] == body
    assert server.json("GET", "/v2/models/tiny/ready") == (200, {"name": "tiny", "ready": True})
    assert server.json("GET", "/v2/models/tiny/versions/1/ready")[0] == 200
    for path in ("/v2/models/nope", "/v2/models/tiny/versions/9", "/v2/models/nope/ready"):
        status, body = server.json("GET", path)
        assert status == 404 and set(body) == {"error"}, path


def test_unknown_route_and_method_are_json_errors(server):
    assert server.json("GET", "/v3/nothing") == (404, {"error": "Not Found"})
    assert server.json("GET", "/v2/models/tiny/infer") == (405, {"error": "Method Not Allowed"})


def test_infer_fast_path_needs_an_app_of_create_app():
    from fastapi import FastAPI

    with pytest.raises(TypeError, match="create_app"):
        InferFastPath(FastAPI())


def test_chunked_infer_body(server, core):
    """A body sent in several chunks (http.client: Transfer-Encoding: chunked) is joined."""
    document = orjson.dumps({"inputs": _tensors([[1, 2]], [30.0])})
    chunks = [document[:7], document[7:40], document[40:]]
    status, _, payload = server.request("POST", "/v2/models/tiny/infer", iter(chunks))
    assert status == 200, payload
    np.testing.assert_allclose(
        orjson.loads(payload)["outputs"][0]["data"],
        expected_predictions([[1, 2]], [30.0]).ravel(),
        atol=1e-6,
    )


# --------------------------------------------------------------------------- v2 infer
def test_infer_json_round_trip(server, core):
    request = {"id": "req-7", "inputs": _tensors(USERS, AGES), "parameters": {"timeout": 2_000_000}}
    status, body = server.json("POST", "/v2/models/tiny/infer", request)
    assert status == 200, body
    assert body["model_name"] == "tiny" and body["model_version"] == "1" and body["id"] == "req-7"
    assert body["parameters"] == {"fallback_ids": 0, "unknown_ids": 2}
    (output,) = body["outputs"]
    assert output["name"] == "prediction" and output["datatype"] == "FP32"
    assert output["shape"] == [3, 1]
    np.testing.assert_allclose(
        np.asarray(output["data"]).reshape(3, 1), expected_predictions(USERS, AGES), rtol=1e-6
    )
    (call,) = core.calls
    assert call["protocol"] == "http" and call["timeout"] == pytest.approx(2.0)
    assert call["inputs"]["user"].dtype == np.uint64
    # The model ran in a worker thread, not on the event loop's thread.
    assert call["thread"] != server.thread.ident


def test_infer_version_route_output_selection_and_fallback_ids(server, core):
    core.fallback_ids = 4
    request = {"inputs": _tensors(USERS, AGES), "outputs": [{"name": "prediction"}]}
    status, body = server.json("POST", "/v2/models/tiny/versions/1/infer", request)
    assert status == 200 and "id" not in body
    assert body["parameters"]["fallback_ids"] == 4
    assert core.calls[0]["version"] == "1"
    request["outputs"] = [{"name": "nope"}]
    status, body = server.json("POST", "/v2/models/tiny/infer", request)
    assert status == 400 and "unknown output 'nope'" in body["error"]


def test_infer_binary_extension_round_trip(server):
    ids = np.array([i for row in USERS for i in row], np.uint64)
    age = np.array(AGES, np.float32).reshape(-1, 1)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "user",
                    "shape": [ids.size],
                    "datatype": "UINT64",
                    "parameters": {"binary_data_size": ids.nbytes},
                },
                {"name": "user.lengths", "shape": [3], "datatype": "INT64", "data": [2, 1, 3]},
                {
                    "name": "age",
                    "shape": [3, 1],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": age.nbytes},
                },
            ],
            "parameters": {"binary_data_output": True},
        }
    )
    status, headers, body = server.request(
        "POST",
        "/v2/models/tiny/infer",
        header + ids.tobytes() + age.tobytes(),
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 200, body
    size = int(headers["inference-header-content-length"])
    document = orjson.loads(body[:size])
    assert document["outputs"][0]["parameters"] == {"binary_data_size": 12}
    predictions = np.frombuffer(body[size:], "<f4").reshape(3, 1)
    np.testing.assert_allclose(predictions, expected_predictions(USERS, AGES), rtol=1e-6)


def test_gzip_request_body(server):
    body = gzip.compress(orjson.dumps({"inputs": _tensors(USERS, AGES)}))
    status, _, payload = server.request(
        "POST", "/v2/models/tiny/infer", body, {"Content-Encoding": "gzip"}
    )
    assert status == 200, payload


def test_a_repeated_inference_header_content_length_is_refused(server):
    body = orjson.dumps({"inputs": _tensors(USERS, AGES)})
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        connection.putrequest("POST", "/v2/models/tiny/infer")
        connection.putheader("Content-Length", str(len(body)))
        for value in (len(body), 5):  # the first alone would be valid
            connection.putheader("Inference-Header-Content-Length", str(value))
        connection.endheaders(body)
        response = connection.getresponse()
        status, document = response.status, orjson.loads(response.read())
    finally:
        connection.close()
    assert status == 400
    assert document == {
        "error": f"Inference-Header-Content-Length must be sent once, got '{len(body)}, 5' "
        "(it was repeated)"
    }


@pytest.mark.parametrize(
    ("document", "status", "message"),
    [
        (b"{nope", 400, "request body is not valid JSON"),
        (
            {"inputs": _tensors([[1], [2]], [1.0, 2.0])[:1] + _tensors([[1]], [1.0])[1:]},
            400,
            "input 'user.lengths'",
        ),
        (
            {
                "inputs": [
                    {"name": "user.lengths", "shape": [3], "datatype": "INT32", "data": [1, 2]}
                ]
            },
            400,
            "input 'user.lengths': shape [3] has 3 elements but data has 2",
        ),
        (
            {"inputs": [{"name": "user", "shape": [1], "datatype": "BYTES", "data": ["a"]}]},
            400,
            "BYTES is not supported",
        ),
        ({"inputs": _tensors([[1]], [1.0], lengths_name="len")}, 400, "unknown input 'len'"),
    ],
)
def test_infer_bad_input_is_400(server, document, status, message):
    body = document if isinstance(document, bytes) else orjson.dumps(document)
    got, _, payload = server.request("POST", "/v2/models/tiny/infer", body)
    assert got == status
    assert message in orjson.loads(payload)["error"]


def test_infer_errors_map_to_statuses(server, core, caplog):
    body = {"inputs": _tensors(USERS, AGES)}
    status, payload = server.json("POST", "/v2/models/other/infer", body)
    assert status == 404 and "unknown model 'other'" in payload["error"]
    core.is_ready = False
    assert server.json("POST", "/v2/models/tiny/infer", body) == (
        503,
        {"error": "model 'tiny' is not ready"},
    )
    core.is_ready = True
    core.fail_with = RuntimeError("secret internals")
    with caplog.at_level(logging.ERROR, logger="serving.http_responses"):
        for path in ("/v2/models/tiny/infer", "/v1/models/tiny:predict"):
            status, payload = server.json(
                "POST", path, body if "v2" in path else {"instances": [{"user": [1], "age": [1.0]}]}
            )
            assert status == 500 and "secret" not in payload["error"]
            assert payload == {"error": "internal error (details are in the server log)"}
    # Each log line names its request; the traceback with the details is attached to it.
    failed = [r for r in caplog.records if r.name == "serving.http_responses" and r.exc_info]
    assert [r.getMessage() for r in failed] == [
        "POST '/v2/models/tiny/infer' failed",
        "POST '/v1/models/tiny:predict' failed",
    ]
    assert all(str(r.exc_info[1]) == "secret internals" for r in failed)


def test_body_too_large_is_413(server):
    big = b'{"inputs": [' + b" " * MAX_BODY + b"]}"
    status, _, payload = server.request("POST", "/v2/models/tiny/infer", big)
    assert status == 413 and "exceeds" in orjson.loads(payload)["error"]

    # Without a Content-Length (chunked), the limit is enforced while streaming.
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        chunks = (b" " * 65536 for _ in range(MAX_BODY // 65536 + 2))
        connection.request("POST", "/v1/models/tiny:predict", body=chunks, encode_chunked=True)
        response = connection.getresponse()
        assert response.status == 413
        assert "error" in orjson.loads(response.read())
    finally:
        connection.close()
    status, _, _ = server.request(
        "POST",
        "/v2/models/tiny/infer",
        gzip.compress(b" " * (MAX_BODY + 1)),
        {"Content-Encoding": "gzip"},
    )
    assert status == 413


@pytest.mark.parametrize("route", ["/v2/models/tiny/infer", "/v1/models/tiny:predict"])
def test_compressed_bodies_have_their_own_inflated_limit(core, route):
    # 1 KB of gzip inflating to megabytes (a bomb) stops at the inflated limit, on both
    # paths (the FastAPI routes and InferFastPath); a body under it is answered.
    app = create_app(core, max_body_bytes=MAX_BODY, max_decompressed_bytes=4096)
    document = (
        {"inputs": _tensors(USERS, AGES)}
        if "infer" in route
        else {"instances": [{"user": row, "age": [age]} for row, age in zip(USERS, AGES)]}
    )
    small = orjson.dumps(document)
    assert len(small) < 4096
    bomb = small + b" " * (MAX_BODY - len(small))  # valid JSON, within --max-body-bytes
    for wrapped in (app, InferFastPath(app)):
        with LiveServer(wrapped) as live:
            status, _, payload = live.request(
                "POST", route, gzip.compress(bomb), {"Content-Encoding": "gzip"}
            )
            assert status == 413
            assert orjson.loads(payload) == {
                "error": "decompressed request body exceeds 4096 bytes"
            }
            status, _, payload = live.request(
                "POST", route, gzip.compress(small), {"Content-Encoding": "gzip"}
            )
            assert status == 200, payload


# --------------------------------------------------------------------------- v1 friendly route
def test_v1_predict(server, core):
    instances = [{"user": row, "age": [age]} for row, age in zip(USERS, AGES)]
    instances[1]["user"] = 3000  # a scalar works as well as a list
    status, body = server.json("POST", "/v1/models/tiny:predict", {"instances": instances})
    assert status == 200, body
    np.testing.assert_allclose(body["predictions"], expected_predictions(USERS, AGES), rtol=1e-6)
    assert body["model_version"] == "1" and body["unknown_ids"] == 2 and body["fallback_ids"] == 0
    assert core.calls[0]["protocol"] == "http"
    status, body = server.json("POST", "/v1/models/tiny:predict", {"instances": [{"zip": 1}]})
    assert status == 400 and "unknown feature 'zip'" in body["error"]
    status, body = server.json("POST", "/v1/models/tiny:predict", {"rows": []})
    assert status == 400 and "instances" in body["error"]
    assert server.json("POST", "/v1/models/x:predict", {"instances": [{"age": 1}]})[0] == 404


# --------------------------------------------------------------------------- admin
def test_admin_reload_from_loopback_or_with_token(admin_server):
    server = admin_server
    assert server.json("POST", "/admin/reload", {"checkpoint": "/ckpt/7"}) == (
        200,
        {"reloaded": "/ckpt/7", "count": 1},
    )
    assert server.json("POST", "/admin/reload")[0] == 200
    assert server.reloads == ["/ckpt/7", None]
    # A web page open on this host posting to loopback (a form: no CORS preflight): its
    # browser's Origin header keeps it out, and only the token would let it in.
    page = {"Origin": "http://attacker.example", "Content-Type": "text/plain"}
    status, body = server.json("POST", "/admin/reload", {"checkpoint": "/ckpt/6"}, page)
    assert status == 403 and body == {
        "error": "admin routes need a loopback client (not a browser page: no Origin header) or "
        "a valid token"
    }
    assert server.reloads == ["/ckpt/7", None]
    wrong = {"Authorization": "Bearer wrong"}
    assert server.json("POST", "/admin/reload", {}, wrong)[0] == 403
    # A remote client (uvicorn trusts X-Forwarded-For from loopback proxies) needs the token.
    remote = {"X-Forwarded-For": "203.0.113.9"}
    status, body = server.json("POST", "/admin/reload", {}, remote)
    assert status == 403 and "error" in body
    good = {**remote, "Authorization": f"Bearer {TOKEN}"}
    assert server.json("POST", "/admin/reload", {"checkpoint": "c"}, good)[0] == 200
    status, body = server.json("POST", "/admin/reload", {"checkpoint": 5})
    assert status == 400
    assert body == {"error": "'checkpoint' must be a string or null, got a JSON int"}
    assert len(server.reloads) == 3


def test_without_admin_hooks_there_is_no_admin_route(core):
    with LiveServer(create_app(core)) as live:
        assert live.json("POST", "/admin/reload")[0] == 404
        assert live.json("GET", "/v2/health/live")[0] == 200


@pytest.mark.parametrize(
    "path",
    [
        "/v2",
        "/v2/",
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/tiny",
        "/v2/models/tiny/ready",
        "/v2/models/tiny/versions/1",
        "/v2/models/tiny/versions/1/ready",
        "/v2/models/nope/ready",
    ],
)
def test_every_get_route_answers_head_with_the_get_status_and_no_body(server, path):
    get_status, _, _ = server.request("GET", path)
    status, headers, body = server.request("HEAD", path)
    assert (status, body) == (get_status, b"")
    assert headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v2/health/ready/"),
        ("GET", "/v2/models/tiny/"),
        ("POST", "/v2/models/tiny/infer/"),
    ],
)
def test_a_trailing_slash_is_not_found_not_redirected(server, method, path):
    status, headers, body = server.request(method, path, body=b"{}" if method == "POST" else None)
    assert status == 404 and "location" not in headers
    assert orjson.loads(body) == {"error": "Not Found"}


# --------------------------------------------------------------------------- OpenAPI
def test_openapi_describes_the_routes(server):
    status, spec = server.json("GET", "/openapi.json")
    assert status == 200
    infer = spec["paths"]["/v2/models/{name}/infer"]["post"]
    schema = infer["requestBody"]["content"]["application/json"]["schema"]
    assert schema["required"] == ["inputs"]
    assert "application/octet-stream" in infer["requestBody"]["content"]
    assert "400" in infer["responses"] and "413" in infer["responses"]
    predict = spec["paths"]["/v1/models/{name}:predict"]["post"]
    assert (
        "instances" in predict["requestBody"]["content"]["application/json"]["schema"]["properties"]
    )
    assert {"/v2", "/v2/health/live", "/v2/health/ready", "/admin/reload"} <= set(spec["paths"])
    # GET routes answer HEAD too, but the document lists each operation once (unique ids).
    operations = [op for path in spec["paths"].values() for op in path.values()]
    assert not any("head" in path for path in spec["paths"].values())
    ids = [op["operationId"] for op in operations]
    assert len(ids) == len(set(ids))
    # Every route may answer an unexpected error: 500 {"error"} is documented everywhere.
    for operation in operations:
        if operation["operationId"] != "reload_admin_reload_post":
            assert "500" in operation["responses"], operation["operationId"]
    status, _, page = server.request("GET", "/docs")
    assert status == 200 and b"swagger" in page.lower()


# --------------------------------------------------------------------------- tritonclient.http
def _triton_inputs(binary: bool) -> list:
    ids = np.array([i for row in USERS for i in row], np.uint64)
    inputs = [
        triton_http.InferInput("user", [ids.size], "UINT64"),
        triton_http.InferInput("user.lengths", [3], "INT32"),
        triton_http.InferInput("age", [3, 1], "FP32"),
    ]
    inputs[0].set_data_from_numpy(ids, binary_data=binary)
    inputs[1].set_data_from_numpy(np.array([2, 1, 3], np.int32), binary_data=binary)
    inputs[2].set_data_from_numpy(np.array(AGES, np.float32).reshape(-1, 1), binary_data=binary)
    return inputs


def test_tritonclient_http(server, core):
    client = triton_http.InferenceServerClient(f"127.0.0.1:{server.port}")
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("tiny")
        assert client.get_server_metadata()["name"] == "recserve-fake"
        metadata = client.get_model_metadata("tiny")
        assert [i["name"] for i in metadata["inputs"]] == ["user", "user.lengths", "age"]
        expected = expected_predictions(USERS, AGES)
        for binary in (False, True):
            outputs = [triton_http.InferRequestedOutput("prediction", binary_data=binary)]
            result = client.infer("tiny", _triton_inputs(binary), request_id="t1", outputs=outputs)
            np.testing.assert_allclose(result.as_numpy("prediction"), expected, rtol=1e-6)
            response = result.get_response()
            assert response["id"] == "t1" and response["parameters"]["unknown_ids"] == 2
        # No outputs named: tritonclient asks for binary outputs (binary_data_output).
        result = client.infer("tiny", _triton_inputs(True), model_version="1")
        np.testing.assert_allclose(result.as_numpy("prediction"), expected, rtol=1e-6)
        with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
            client.get_model_metadata("nope")
        core.is_ready = False
        assert not client.is_server_ready()
        with pytest.raises(InferenceServerException, match="not ready"):
            client.infer("tiny", _triton_inputs(True))
    finally:
        client.close()


def test_tritonclient_http_tensors_naming_a_shared_memory_region_are_refused(server, core):
    # An output answered in the response while the client reads the region it named would
    # be a silent wrong answer; an input's data would be in a region none can register here.
    client = triton_http.InferenceServerClient(f"127.0.0.1:{server.port}")
    try:
        output = triton_http.InferRequestedOutput("prediction")
        output.set_shared_memory("out_region", 12)
        with pytest.raises(InferenceServerException) as error:
            client.infer("tiny", _triton_inputs(True), outputs=[output])
        assert error.value.status() == "400"
        assert error.value.message() == (
            "output 'prediction': parameter 'shared_memory_region': the shared-memory "
            "extensions are not supported (this server registers no region); ask for the "
            "output without one: it comes back in the response"
        )
        for binary in (False, True):
            inputs = _triton_inputs(binary)
            inputs[1].set_shared_memory("lengths_region", 12)
            with pytest.raises(InferenceServerException) as error:
                client.infer("tiny", inputs)
            assert error.value.status() == "400"
            assert error.value.message() == (
                "input 'user.lengths': parameter 'shared_memory_region': the shared-memory "
                "extensions are not supported (this server registers no region); send the "
                "input's data in the request (JSON 'data', binary data or raw contents)"
            )
        assert core.calls == []
    finally:
        client.close()


# --------------------------------------------------------------------------- fuzz
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**65), 2**65),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=5),
)
_json = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=20,
)
_tensor = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["user", "user.lengths", "age", "x"]) | _scalars,
        "datatype": st.sampled_from(
            ["UINT64", "INT64", "INT32", "FP32", "BOOL", "FP16", "BYTES", "?"]
        ),
        "shape": st.lists(st.integers(-2, 4), max_size=3)
        | st.lists(st.sampled_from([0, 1, 2**40, 2**62, 2**64]), max_size=5)
        | _json,
    },
    optional={
        "data": st.lists(st.integers(-3, 2**64) | st.floats(-5, 5) | st.booleans(), max_size=8)
        | st.lists(st.lists(st.integers(0, 9), max_size=3), max_size=3)
        | _json,
        "parameters": st.fixed_dictionaries(
            {}, optional={"binary_data_size": st.integers(-1, 40) | _scalars}
        ),
    },
)
_v2_body = st.fixed_dictionaries(
    {"inputs": st.lists(_tensor, max_size=4) | _json},
    optional={
        "id": _scalars,
        "outputs": st.lists(
            st.fixed_dictionaries({"name": st.sampled_from(["prediction", "z"]) | _scalars}),
            max_size=2,
        )
        | _json,
        "parameters": st.fixed_dictionaries(
            {}, optional={"binary_data_output": _scalars, "timeout": _scalars}
        ),
    },
)


@st.composite
def _near_valid_body(draw):
    """A valid request, sometimes with one field of one tensor replaced by junk."""
    users = draw(st.lists(st.lists(st.integers(0, 2**64 - 1), max_size=3), max_size=4))
    ages = draw(st.lists(st.floats(-10, 10, width=32), min_size=len(users), max_size=len(users)))
    tensors = _tensors(users, ages)
    tensors[0]["datatype"] = draw(st.sampled_from(["UINT64", "INT64"]))
    tensors[1]["datatype"] = draw(st.sampled_from(["INT32", "INT64"]))
    if draw(st.booleans()):
        tensor = draw(st.sampled_from(tensors))
        tensor[draw(st.sampled_from(["name", "shape", "datatype", "data"]))] = draw(_json)
    return {"inputs": tensors}


_v1_body = st.fixed_dictionaries(
    {
        "instances": st.lists(
            st.dictionaries(st.sampled_from(["user", "age", "q"]), _json, max_size=3), max_size=3
        )
        | _json
    }
)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    route=st.sampled_from(
        ["/v2/models/tiny/infer", "/v2/models/tiny/versions/1/infer", "/v1/models/tiny:predict"]
    ),
    document=st.one_of(_near_valid_body(), _v2_body, _v1_body, _json),
    raw=st.none() | st.binary(max_size=64),
    tail=st.binary(max_size=48),
    header_length=st.none() | st.integers(-2, 400) | st.just("x"),
)
def test_fuzzed_bodies_never_cause_a_500(server, route, document, raw, tail, header_length):
    body = raw if raw is not None else json.dumps(document).encode() + tail
    headers = (
        {} if header_length is None else {"Inference-Header-Content-Length": str(header_length)}
    )
    status, _, payload = server.request("POST", route, body, headers)
    event(f"HTTP {status}")
    assert status in (200, 400, 404, 413), (status, payload)
    if status != 200:
        assert set(orjson.loads(payload)) == {"error"}


def test_inflating_waits_for_its_own_two_tokens_not_the_shared_pool(monkeypatch):
    # Waiting inside a pool thread held one of anyio's 40 shared tokens per waiting bomb, and
    # every in_thread route (metadata, large infers, admin) queued behind them.
    from serving import http_body

    seen = []
    real_run_sync = anyio.to_thread.run_sync

    async def spy(function, *args, limiter=None, **kwargs):
        seen.append(limiter)
        return await real_run_sync(function, *args, limiter=limiter, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", spy)

    async def main():
        async def chunks():
            yield gzip.compress(b'{"inputs": []}')

        for _ in range(2):
            body = await http_body.read_chunks(chunks(), None, "gzip", 1 << 20)
            assert body == b'{"inputs": []}'

    asyncio.run(main())
    assert len(seen) == 2 and seen[0] is seen[1]  # one limiter per event loop
    assert seen[0].total_tokens == 2


def test_body_limits_are_inclusive_with_or_without_a_content_length():
    from embedding_store.errors import CapacityError
    from serving.http_body import read_chunks

    async def read(parts: list[bytes], declared: str | None) -> bytes:
        async def chunks():
            for part in parts:
                yield part

        return await read_chunks(chunks(), declared, None, 10)

    assert asyncio.run(read([b"12345", b"67890"], "10")) == b"1234567890"
    assert asyncio.run(read([b"12345", b"67890"], None)) == b"1234567890"
    with pytest.raises(CapacityError, match=r"^request body of 11 bytes exceeds the limit of 10$"):
        asyncio.run(read([b"12345", b"678901"], "11"))
    # Chunked (no Content-Length): counted while streaming.
    with pytest.raises(CapacityError, match=r"^request body exceeds the limit of 10 bytes$"):
        asyncio.run(read([b"12345", b"678901"], None))


def test_admin_token_scheme_is_case_insensitive_and_mapped_loopback_is_local(admin_server):
    server = admin_server
    from serving.http_admin import _is_loopback

    remote = {"X-Forwarded-For": "203.0.113.9"}
    for scheme in ("bearer", "BEARER"):
        headers = {**remote, "Authorization": f"{scheme} {TOKEN}"}
        assert server.json("POST", "/admin/reload", {"checkpoint": scheme}, headers)[0] == 200
    assert server.reloads == ["bearer", "BEARER"]
    assert server.json("POST", "/admin/reload", {}, {**remote, "Authorization": TOKEN})[0] == 403
    # An IPv4 loopback client as a dual-stack socket reports it is local; others are not.
    for host, local in (
        ("127.0.0.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("localhost", True),
        ("::ffff:203.0.113.9", False),
        ("203.0.113.9", False),
        ("", False),
        (None, False),
    ):
        assert _is_loopback(host) is local, host


def test_admin_reload_checks_its_body_before_calling_the_hook(core):
    """The reload hook sees only a checkpoint path of 1 to 4096 characters without NUL, or
    None (an empty or blank body); the body is capped at 1 MiB whatever --max-body-bytes is."""
    reloads: list[str | None] = []

    def reload(checkpoint: str | None) -> dict:
        reloads.append(checkpoint)
        return {"reloaded": checkpoint}

    app = create_app(core, max_body_bytes=4 * 1024 * 1024, admin=AdminHooks(reload, TOKEN))
    bad_path = {"error": "'checkpoint' must be a path of 1 to 4096 characters with no NUL"}
    longest = "/" + "c" * 4095
    with LiveServer(app) as live:
        for body, status, answer in (
            (orjson.dumps({"checkpoint": ""}), 400, bad_path),
            (orjson.dumps({"checkpoint": "/a\0b"}), 400, bad_path),
            (orjson.dumps({"checkpoint": longest + "c"}), 400, bad_path),
            (b"[1]", 400, {"error": 'body must be {"checkpoint": "<path>"}'}),
            (
                b'{"checkpoint": "/x"}' + b" " * (1024 * 1024),
                413,
                {"error": "request body of 1048596 bytes exceeds the limit of 1048576"},
            ),
            (orjson.dumps({"checkpoint": longest}), 200, {"reloaded": longest}),
            (b" \n ", 200, {"reloaded": None}),
            (orjson.dumps({"checkpoint": None}), 200, {"reloaded": None}),
        ):
            got, _, payload = live.request("POST", "/admin/reload", body)
            assert (got, orjson.loads(payload)) == (status, answer), body[:40]
    assert reloads == [longest, None, None]


def test_a_sent_authorization_must_match_the_token_even_from_loopback():
    """Bearer credentials are compared after trimming spaces; with no token configured, no
    credential is accepted (a loopback client must then send no Authorization at all)."""
    from starlette.requests import Request

    from serving.http_admin import admin_allowed

    def request(authorization: str | None, host: str = "127.0.0.1") -> Request:
        headers = [] if authorization is None else [(b"authorization", authorization.encode())]
        return Request({"type": "http", "headers": headers, "client": (host, 5000)})

    assert admin_allowed(request(f"Bearer  {TOKEN} "), TOKEN)
    assert admin_allowed(request(f"Bearer {TOKEN}", "203.0.113.9"), TOKEN)
    assert not admin_allowed(request(f"Basic {TOKEN}"), TOKEN)
    assert not admin_allowed(request(f"Bearer {TOKEN}x"), TOKEN)
    assert not admin_allowed(request("Bearer anything"), None)
    assert not admin_allowed(request("Bearer "), None)
    assert admin_allowed(request(None), None)
    assert not admin_allowed(request(None, "203.0.113.9"), TOKEN)


class _CountingCore(FakeCore):
    """FakeCore that can be not live and is told of requests refused before reaching it."""

    def __init__(self) -> None:
        super().__init__()
        self.is_live = True
        self.rejected: list[tuple[str, str, str]] = []

    def live(self) -> bool:
        return self.is_live

    def record_rejected(self, protocol: str, name: str, error: BaseException) -> None:
        self.rejected.append((protocol, name, type(error).__name__))


@pytest.mark.parametrize("fast_path", [False, True])
def test_requests_refused_before_the_core_are_reported_to_it_once(fast_path: bool) -> None:
    """Bodies too large or undecodable never reach predict(): the front end reports them to
    the core's record_rejected (so they are counted); requests that reach predict() are not."""
    counting = _CountingCore()
    app = create_app(counting, max_body_bytes=1024)
    good = orjson.dumps({"inputs": _tensors(USERS, AGES)})
    with LiveServer(InferFastPath(app) if fast_path else app) as live:
        assert live.request("POST", "/v2/models/tiny/infer", b"{nope")[0] == 400
        assert live.request("POST", "/v2/models/m2/versions/3/infer", b" " * 1025)[0] == 413
        assert live.request("POST", "/v1/models/m3:predict", b"[1]")[0] == 400
        assert live.request("POST", "/v1/models/m4:predict", b" " * 1025)[0] == 413
        assert live.request("POST", "/v2/models/tiny/infer", good)[0] == 200
        assert live.request("POST", "/v2/models/nope/infer", good)[0] == 404
    assert counting.rejected == [
        ("http", "tiny", "InvalidArgumentError"),
        ("http", "m2", "CapacityError"),
        ("http", "m3", "InvalidArgumentError"),
        ("http", "m4", "CapacityError"),
    ]


def test_liveness_version_readiness_and_the_allow_header() -> None:
    counting = _CountingCore()
    with LiveServer(create_app(counting)) as live:
        assert live.json("GET", "/v2/health/live") == (200, {"live": True})
        counting.is_live = False
        assert live.json("GET", "/v2/health/live") == (400, {"error": "server is not live"})
        # The version in the path is the one asked about: an unknown one is 404.
        status, body = live.json("GET", "/v2/models/tiny/versions/9/ready")
        assert (status, body) == (404, {"error": "model 'tiny' has no version '9'"})
        status, headers, payload = live.request("POST", "/v2/health/ready")
        assert (status, orjson.loads(payload)) == (405, {"error": "Method Not Allowed"})
        assert sorted(headers["allow"].split(", ")) == ["GET", "HEAD"]


def test_the_fast_path_reads_a_body_message_without_more_body_as_the_last() -> None:
    """ASGI: ``more_body`` defaults to false, so a body message without it ends the body."""
    app = InferFastPath(create_app(FakeCore()))
    body = orjson.dumps({"inputs": _tensors(USERS, AGES)})
    messages = [{"type": "http.request", "body": body}]
    sent: list[dict] = []

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        # As uvicorn: nothing more until the connection is lost (an http.disconnect before
        # the answer is a client gone, whose answer is not sent) or the response is sent.
        await asyncio.Event().wait()
        raise AssertionError("not reached: waited for until cancelled")

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v2/models/tiny/infer",
        "headers": [(b"content-length", str(len(body)).encode())],
    }
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 200, sent
    predictions = orjson.loads(sent[1]["body"])["outputs"][0]["data"]
    np.testing.assert_allclose(predictions, expected_predictions(USERS, AGES).ravel(), rtol=1e-6)


def _gone_mid_body(app: Any, scope: dict, first: bytes, refused_by_protocol: bool) -> list[dict]:
    """The messages ``app`` sends for a request whose client sent ``first`` (more to come)
    and then disconnected; ``refused_by_protocol`` marks the request's cycle, whose method
    ``receive`` is, with REFUSED_MARK, as the HTTP protocol does for a request it cut short."""
    from serving.http_fast_path import REFUSED_MARK

    class Cycle:
        def __init__(self) -> None:
            self.messages = [
                {"type": "http.request", "body": first, "more_body": True},
                {"type": "http.disconnect"},
            ]
            setattr(self, REFUSED_MARK, refused_by_protocol)

        async def receive(self) -> dict:
            return self.messages.pop(0)

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, Cycle().receive, send))
    return sent


@pytest.mark.parametrize("refused_by_protocol", [False, True])
def test_a_client_gone_mid_body_is_counted_cancelled_once(refused_by_protocol: bool) -> None:
    """A disconnect before the body is complete is a cancelled request, reported to the
    core, unless the HTTP protocol cut the request short and counted it itself (it marks
    the request's cycle, whose method ``receive`` is, with REFUSED_MARK)."""
    counting = _CountingCore()
    app = InferFastPath(create_app(counting))
    scope = {"type": "http", "method": "POST", "path": "/v2/models/tiny/infer", "headers": []}
    sent = _gone_mid_body(app, scope, b'{"inputs": [', refused_by_protocol)
    assert sent[0]["status"] == 400
    assert orjson.loads(sent[1]["body"]) == {
        "error": "the client disconnected before sending its body"
    }
    assert counting.rejected == (
        [] if refused_by_protocol else [("http", "tiny", "CancelledError")]
    )


@pytest.mark.parametrize("refused_by_protocol", [False, True])
@pytest.mark.parametrize("path", ["/v1/models/tiny:predict", "/v2/models/tiny/infer"])
def test_a_client_gone_mid_body_on_the_asgi_routes_is_counted_cancelled_not_as_a_500(
    path: str, refused_by_protocol: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The FastAPI routes (the friendly one always; infer without InferFastPath) count a
    client that disconnects before its body is in as cancelled, once, as the fast path does:
    Starlette's ClientDisconnect was counted as outcome "error" and logged as a 500 with its
    traceback. A request the HTTP protocol cut short (a 408) is counted there only."""
    counting = _CountingCore()
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-length", b"1000")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    with caplog.at_level(logging.ERROR):
        sent = _gone_mid_body(create_app(counting), scope, b'{"instances": [', refused_by_protocol)
    assert sent[0]["status"] == 400
    assert orjson.loads(sent[1]["body"]) == {
        "error": "the client disconnected before sending its body"
    }
    assert counting.rejected == (
        [] if refused_by_protocol else [("http", "tiny", "CancelledError")]
    )
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("declared", ["\u00b2", "1\u00b9", "\u0661\u0660\u0660", "+5", " 5", "5a"])
def test_a_content_length_that_is_not_ascii_digits_is_not_read_as_one(declared: str) -> None:
    """Only ASCII digits make a Content-Length (RFC 9110). Any other value is no declared
    length: the body is counted while it streams. str.isdigit() alone takes "²" (which
    int() then refuses: a 500) and Arabic-Indic digits (which int() reads as 100)."""
    from embedding_store.errors import CapacityError
    from serving.http_body import read_chunks

    async def read(parts: list[bytes]) -> bytes:
        async def chunks():
            for part in parts:
                yield part

        return await read_chunks(chunks(), declared, None, 10)

    assert asyncio.run(read([b"12345", b"6789"])) == b"123456789"
    with pytest.raises(CapacityError, match=r"^request body exceeds the limit of 10 bytes$"):
        asyncio.run(read([b"12345", b"678901"]))


def test_answer_unless_gone_tells_the_core_and_cancels_the_answer_when_the_client_goes():
    """The ASGI path: uvicorn's receive() gives http.disconnect once the connection is lost.
    Then the registered callbacks run (what drops a request queued for the dispatcher), the
    answer's task is cancelled (what drops one queued on the loop) and no answer is made; an
    answer ready first is returned, the watch ended, the callbacks never run."""
    from serving.http_fast_path import answer_unless_gone

    async def main():
        told: list[str] = []
        lost = asyncio.Event()

        async def receive() -> dict:
            await lost.wait()
            return {"type": "http.disconnect"}

        async def slow_answer(gone) -> Response:
            assert gone.add_callback(lambda: told.append("gone"))
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                told.append("cancelled")
                raise
            raise AssertionError("not reached")

        asyncio.get_running_loop().call_later(0.05, lost.set)
        left = await asyncio.wait_for(answer_unless_gone(receive, slow_answer), 5)
        gone_told = list(told)
        told.clear()

        async def quick_answer(gone) -> Response:
            assert gone.add_callback(lambda: told.append("gone"))
            return Response(b"fine")

        lost.clear()
        answered = await asyncio.wait_for(answer_unless_gone(receive, quick_answer), 5)
        return left, gone_told, answered, told

    left, gone_told, answered, told = asyncio.run(main())
    assert gone_told == ["gone", "cancelled"]
    assert left.status_code == 400
    assert orjson.loads(left.body) == {"error": "the client disconnected before its answer"}
    assert answered.body == b"fine" and told == []


def test_model_readiness_answers_while_the_thread_pool_is_full() -> None:
    """Model readiness ran in the thread pool, behind requests waiting there for their
    answers (a slow embedding tier): a probe of it waited as long. It answers from the
    event loop, as server readiness does."""
    from tests.unit.test_serve_lifecycle import asgi_get_while_the_thread_pool_is_full

    app = create_app(FakeCore())
    for path in ("/v2/models/tiny/ready", "/v2/health/ready"):
        status, body = asgi_get_while_the_thread_pool_is_full(app, path)
        assert (status, orjson.loads(body)) == (
            (200, {"name": "tiny", "ready": True}) if "tiny" in path else (200, {"ready": True})
        )


def test_server_and_model_metadata_answer_while_the_thread_pool_is_full() -> None:
    """Server and model metadata ran in the thread pool, behind requests waiting there for
    their answers (8.5 s with 45 friendly requests on a hung shard): a client asking for
    them first (tritonclient) waited as long. They answer from the event loop, unknown
    models too."""
    from serving.http_encode import model_metadata_json
    from tests.unit.fake_core import METADATA
    from tests.unit.test_serve_lifecycle import asgi_get_while_the_thread_pool_is_full

    app = create_app(FakeCore())
    server = {"name": "recserve-fake", "version": "0.1.0", "extensions": ["binary_tensor_data"]}
    model = orjson.loads(orjson.dumps(model_metadata_json(METADATA)))
    assert model["name"] == "tiny" and model["versions"] == ["1"]
    expected = {
        "/v2": (200, server),
        "/v2/models/tiny": (200, model),
        "/v2/models/tiny/versions/1": (200, model),
        "/v2/models/nope": (404, {"error": "unknown model 'nope'; this server serves 'tiny'"}),
        "/v2/models/tiny/versions/9": (404, {"error": "model 'tiny' has no version '9'"}),
    }
    for path, answer in expected.items():
        status, body = asgi_get_while_the_thread_pool_is_full(app, path)
        assert (status, orjson.loads(body)) == answer, path
