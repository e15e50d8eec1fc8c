"""``recserve serve`` end to end: real server subprocesses on loopback, real clients.

One small Adult checkpoint (1 epoch) is trained per session (conftest.py). Served predictions
are compared with the offline :class:`serving.infer_ctx.InferCtx` on every route (friendly JSON
with the Adult preprocessor, KServe v2 JSON, the HTTP binary tensor extension, gRPC raw
contents); the unchanged tritonclient API is exercised over HTTP and gRPC; errors, hot reload
under load, a failed reload, the SIGTERM drain, fuzzed bodies and ``/metrics`` are checked.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import gzip
import hashlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, List  # noqa: UP035 (TorchScript reads List)

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from embedding_store.batch import Batch, IDTypeFeatureWithSingleID, NonIDTypeFeature
from embedding_store.errors import BatchValidationError, InvalidArgumentError, UnavailableError
from embedding_store.signature import FeatureSignature, IdFeatureSpec, NonIdFeatureSpec
from examples.adult_income import features
from serving import json_arrays, tensors
from serving.infer_ctx import InferCtx
from serving.model import load_model
from serving.service import PredictionService

ADULT_PREPROCESSOR = "examples.adult_income.preprocess:instances_to_batch"
MODEL = "model"
N_ROWS = 64
ATOL = 1e-6


# --------------------------------------------------------------------------- helpers
def read_rows(count: int) -> list[dict[str, Any]]:
    """The first ``count`` raw test rows as a JSON client would send them (numbers as numbers,
    no label)."""
    rows = []
    with gzip.open(features.TEST_PATH, "rt", encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            row = {k.strip(): v.strip() for k, v in row.items()}
            row.pop(features.LABEL_COLUMN, None)
            for column in features.NUMERIC_COLUMNS:
                row[column] = int(row[column])
            rows.append(row)
            if len(rows) == count:
                break
    return rows


def batch_arrays(batch: Batch) -> dict[str, np.ndarray]:
    """KServe v2 inputs of a batch: ``<slot>`` UINT64 [batch] and ``numeric`` FP32 [batch, 6]."""
    arrays = {
        f.name: np.ascontiguousarray(f.values, dtype=np.uint64) for f in batch.id_type_features
    }
    for feature in batch.non_id_type_features:
        arrays[feature.name] = np.ascontiguousarray(feature.data, dtype=np.float32)
    return arrays


def _datatype(array: np.ndarray) -> str:
    return {"uint64": "UINT64", "int64": "INT64", "float32": "FP32", "int32": "INT32"}[
        array.dtype.name
    ]


def kserve_json(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    return {
        "inputs": [
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": _datatype(array),
                "data": array.reshape(-1).tolist(),
            }
            for name, array in arrays.items()
        ]
    }


def triton_inputs(module: Any, arrays: dict[str, np.ndarray], **kwargs: Any) -> list[Any]:
    inputs = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, list(array.shape), _datatype(array))
        tensor.set_data_from_numpy(array, **kwargs)
        inputs.append(tensor)
    return inputs


def request(
    address: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def post_json(address: str, path: str, document: Any) -> tuple[int, Any]:
    status, body = request(
        address, "POST", path, json.dumps(document).encode(), {"Content-Type": "application/json"}
    )
    return status, json.loads(body)


def json_prediction(document: dict[str, Any]) -> np.ndarray:
    (output,) = document["outputs"]
    assert output["name"] == "prediction" and output["datatype"] == "FP32"
    return np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])


def metric_families(address: str) -> dict[str, Any]:
    status, body = request(address, "GET", "/metrics")
    assert status == 200
    return {family.name: family for family in text_string_to_metric_families(body.decode())}


def manifest_version(checkpoint: Path) -> str:
    return json.loads((checkpoint / "manifest.json").read_text())["version"]


def assert_error(status: int, body: bytes, expected_status: int, *needles: str) -> str:
    assert status == expected_status, body
    document = json.loads(body)
    assert set(document) == {"error"}, document
    for needle in needles:
        assert needle in document["error"], document
    return document["error"]


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def served(serve_process, adult_checkpoint):
    """The main server: sigmoid outputs, the Adult preprocessor on the friendly route."""
    return serve_process(
        adult_checkpoint, "--output-transform", "sigmoid", "--preprocessor", ADULT_PREPROCESSOR
    )


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    return read_rows(N_ROWS)


@pytest.fixture(scope="module")
def batch(rows) -> Batch:
    return features.rows_to_batch(rows, with_labels=False, requires_grad=False)


@pytest.fixture(scope="module")
def offline(adult_checkpoint):
    with InferCtx(checkpoint=adult_checkpoint, output_transform="sigmoid") as ctx:
        yield ctx


@pytest.fixture(scope="module")
def http_client(served):
    client = httpclient.InferenceServerClient(served.http_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def grpc_client(served):
    client = grpcclient.InferenceServerClient(served.grpc_url)
    yield client
    client.close()


# --------------------------------------------------------------------------- 1. parity
def test_every_route_matches_offline_inferctx(
    served, rows, batch, offline, http_client, grpc_client
):
    expected = offline.forward(batch)
    assert expected.shape == (N_ROWS, 1)
    arrays = batch_arrays(batch)

    # friendly route: raw Adult rows through the --preprocessor
    status, document = post_json(
        served.http_url, f"/v1/models/{MODEL}:predict", {"instances": rows}
    )
    assert status == 200, document
    assert document["model_version"] == served.version
    np.testing.assert_allclose(np.asarray(document["predictions"]), expected, rtol=0, atol=ATOL)

    # KServe v2 JSON tensors
    status, document = post_json(served.http_url, f"/v2/models/{MODEL}/infer", kserve_json(arrays))
    assert status == 200, document
    assert document["model_name"] == MODEL and document["model_version"] == served.version
    np.testing.assert_allclose(json_prediction(document), expected, rtol=0, atol=ATOL)

    # HTTP binary tensor extension (inputs and outputs binary)
    result = http_client.infer(
        MODEL,
        triton_inputs(httpclient, arrays, binary_data=True),
        outputs=[httpclient.InferRequestedOutput("prediction", binary_data=True)],
    )
    assert result.get_response()["model_version"] == served.version
    assert result.get_output("prediction")["parameters"]["binary_data_size"] == N_ROWS * 4
    np.testing.assert_allclose(result.as_numpy("prediction"), expected, rtol=0, atol=ATOL)

    # gRPC ModelInfer with raw_input_contents
    result = grpc_client.infer(MODEL, triton_inputs(grpcclient, arrays))
    assert result.get_response().model_version == served.version
    np.testing.assert_allclose(result.as_numpy("prediction"), expected, rtol=0, atol=ATOL)

    # other IDs -> other predictions (and still the offline ones)
    rolled = {
        name: np.roll(array, 7) if name in ("relationship", "marital-status") else array
        for name, array in arrays.items()
    }
    changed_batch = Batch(
        [
            IDTypeFeatureWithSingleID(f.name, rolled[f.name].astype(np.uint64))
            for f in batch.id_type_features
        ],
        [NonIDTypeFeature(rolled["numeric"], "numeric")],
        requires_grad=False,
    )
    changed = grpc_client.infer(MODEL, triton_inputs(grpcclient, rolled)).as_numpy("prediction")
    np.testing.assert_allclose(changed, offline.forward(changed_batch), rtol=0, atol=ATOL)
    assert np.abs(changed - expected).max() > 1e-3


def test_inferctx_refuses_a_batch_whose_features_come_in_another_order(batch, offline):
    # The dense model takes embeddings and non-ID tensors by position: a reordered batch
    # would be scored with swapped inputs, so it is refused by name instead.
    swapped_ids = Batch(
        [batch.id_type_features[1], batch.id_type_features[0], *batch.id_type_features[2:]],
        batch.non_id_type_features,
        requires_grad=False,
    )
    first, second = (f.name for f in batch.id_type_features[:2])
    with pytest.raises(BatchValidationError, match=rf"\['{second}', '{first}'"):
        offline.forward(swapped_ids)
    with pytest.raises(BatchValidationError, match="names and order"):
        offline.prepare_features(swapped_ids)


def test_inferctx_refuses_what_the_server_refuses(batch, offline, adult_checkpoint):
    # NaN dense inputs are refused as the server refuses them, not scored as NaN (and so are
    # predictions that come out NaN/Inf: the server's check, serving.tensors).
    dense = batch.non_id_type_features[0]
    data = np.array(dense.data, dtype=np.float32, copy=True)
    data[1, 0] = np.nan
    with_nan = Batch(
        batch.id_type_features,
        [NonIDTypeFeature(data, name=dense.name), *batch.non_id_type_features[1:]],
        requires_grad=False,
    )
    with pytest.raises(InvalidArgumentError, match=rf"input '{dense.name}'.*NaN"):
        offline.forward(with_nan)
    # A remote worker that is not there: the startup timeout is the caller's.
    started = time.monotonic()
    with pytest.raises(UnavailableError):
        InferCtx(["127.0.0.1:1"], checkpoint=adult_checkpoint, timeout=1, startup_timeout=0.5)
    assert time.monotonic() - started < 30  # not the 60 s default


def test_large_batches_run_on_onednn_and_answer_as_small_ones(served, batch, offline, grpc_client):
    """A request of 5 x 64 rows takes the dense model rewritten for oneDNN (batches of 256 rows
    or more, the default) and answers, row for row, what the model as loaded answers for the
    64 rows alone."""
    assert "3 linear layers run as oneDNN kernels for batches of >= 256 rows" in served.log()
    expected = offline.forward(batch)  # 64 rows: below the threshold, the model as loaded
    tiled = {name: np.concatenate([array] * 5) for name, array in batch_arrays(batch).items()}
    result = grpc_client.infer(MODEL, triton_inputs(grpcclient, tiled)).as_numpy("prediction")
    assert result.shape == (5 * N_ROWS, 1)
    np.testing.assert_allclose(result, np.concatenate([expected] * 5), rtol=0, atol=ATOL)


def _large_json_request(arrays: dict[str, np.ndarray]) -> tuple[bytes, dict[str, np.ndarray]]:
    """A KServe v2 JSON body of ``arrays`` repeated until the body is large enough for the
    simdjson route (IDs as INT64, as clients send them), and the arrays it holds."""
    for copies in range(1, 1000):
        tiled = {
            name: np.concatenate(
                [array.astype(np.int64) if array.dtype == np.uint64 else array] * copies
            )
            for name, array in arrays.items()
        }
        body = json.dumps(kserve_json(tiled)).encode()
        if len(body) >= json_arrays.LARGE_BODY_BYTES:
            return body, tiled
    raise AssertionError("the body never reached LARGE_BODY_BYTES")


def test_large_json_bodies_answer_as_the_binary_extension(served, batch, http_client):
    small_ids = {  # below 2**63: INT64 in JSON
        name: array % 1000 if array.dtype == np.uint64 else array
        for name, array in batch_arrays(batch).items()
    }
    body, arrays = _large_json_request(small_ids)
    assert json_arrays.parse_number_arrays(body) is not None  # the route under test
    status, answer = request(
        served.http_url,
        "POST",
        f"/v2/models/{MODEL}/infer",
        body,
        {"Content-Type": "application/json"},
    )
    assert status == 200, answer
    binary = http_client.infer(
        MODEL,
        triton_inputs(httpclient, arrays, binary_data=True),
        outputs=[httpclient.InferRequestedOutput("prediction", binary_data=True)],
    ).as_numpy("prediction")
    assert binary.shape == (len(arrays["race"]), 1)
    np.testing.assert_array_equal(json_prediction(json.loads(answer)), binary)

    # A negative ID in a large body: a 400 naming the input, and the server goes on.
    document = json.loads(body)
    document["inputs"][1]["data"][3] = -5
    status, refused = request(
        served.http_url, "POST", f"/v2/models/{MODEL}/infer", json.dumps(document).encode()
    )
    name = document["inputs"][1]["name"]
    assert_error(status, refused, 400, f"input {name!r}: IDs must be non-negative, got -5")
    status, again = request(served.http_url, "POST", f"/v2/models/{MODEL}/infer", body)
    assert status == 200
    np.testing.assert_array_equal(json_prediction(json.loads(again)), binary)


# --------------------------------------------------------------------------- 2. tritonclient
def _expected_inputs() -> list[tuple[str, str, list[int]]]:
    return [(slot, "INT64", [-1]) for slot in features.SLOT_NAMES] + [
        ("numeric", "FP32", [-1, features.NUM_NON_ID_FEATURES])
    ]


def test_tritonclient_http_api(served, http_client):
    assert http_client.is_server_live()
    assert http_client.is_server_ready()
    assert http_client.is_model_ready(MODEL)
    assert not http_client.is_model_ready("no-such-model")
    metadata = http_client.get_server_metadata()
    assert metadata["name"] == "recserve"
    assert metadata["extensions"] == ["binary_tensor_data"]
    metadata = http_client.get_model_metadata(MODEL)
    assert metadata["name"] == MODEL and metadata["versions"] == [served.version]
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == (
        _expected_inputs()
    )
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["outputs"]] == [
        ("prediction", "FP32", [-1, 1])
    ]
    # the client code of the metadata, unchanged: INT64 IDs as listed, JSON (non-binary) data
    inputs = []
    for spec in metadata["inputs"]:
        shape = [3, *spec["shape"][1:]]
        dtype = np.int64 if spec["datatype"] == "INT64" else np.float32
        tensor = httpclient.InferInput(spec["name"], shape, spec["datatype"])
        tensor.set_data_from_numpy(
            np.arange(np.prod(shape)).reshape(shape).astype(dtype), binary_data=False
        )
        inputs.append(tensor)
    result = http_client.infer(MODEL, inputs)
    assert result.get_response()["model_version"] == served.version
    prediction = result.as_numpy("prediction")
    assert prediction.shape == (3, 1) and np.all((prediction >= 0) & (prediction <= 1))


def test_tritonclient_grpc_api(served, grpc_client):
    assert grpc_client.is_server_live()
    assert grpc_client.is_server_ready()
    assert grpc_client.is_model_ready(MODEL)
    assert not grpc_client.is_model_ready("no-such-model")  # as over HTTP: False, no error
    metadata = grpc_client.get_server_metadata()
    assert metadata.name == "recserve" and list(metadata.extensions) == ["binary_tensor_data"]
    metadata = grpc_client.get_model_metadata(MODEL)
    assert metadata.name == MODEL and list(metadata.versions) == [served.version]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == _expected_inputs()
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [
        ("prediction", "FP32", [-1, 1])
    ]
    inputs = []
    for spec in metadata.inputs:
        shape = [5, *spec.shape[1:]]
        dtype = np.int64 if spec.datatype == "INT64" else np.float32
        tensor = grpcclient.InferInput(spec.name, shape, spec.datatype)
        tensor.set_data_from_numpy(np.arange(np.prod(shape)).reshape(shape).astype(dtype))
        inputs.append(tensor)
    result = grpc_client.infer(MODEL, inputs, client_timeout=30.0)
    assert result.get_response().model_version == served.version
    assert result.as_numpy("prediction").shape == (5, 1)


# --------------------------------------------------------------------------- 3. errors
def _bad_inputs(case: str, arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], str]:
    """A broken copy of ``arrays`` and the input name the error must mention."""
    bad = dict(arrays)
    if case == "unknown input":
        bad["bogus_feature"] = np.zeros(len(arrays["race"]), np.int64)
        return bad, "bogus_feature"
    if case == "wrong dtype":
        bad["education"] = arrays["education"].astype(np.float32)
        return bad, "education"
    if case == "batch size mismatch":
        bad["race"] = arrays["race"][:-1]
        return bad, "race"
    if case == "negative id":
        ids = (arrays["gender"] % 1000).astype(np.int64)
        ids[1] = -5
        bad["gender"] = ids
        return bad, "gender"
    raise AssertionError(case)


ERROR_CASES = ["unknown input", "wrong dtype", "batch size mismatch", "negative id"]


@pytest.mark.parametrize("case", ERROR_CASES)
def test_bad_inputs_are_rejected_naming_the_input(served, batch, grpc_client, case):
    arrays = {k: v[:4] for k, v in batch_arrays(batch).items()}
    bad, name = _bad_inputs(case, arrays)
    status, body = request(
        served.http_url,
        "POST",
        f"/v2/models/{MODEL}/infer",
        json.dumps(kserve_json(bad)).encode(),
        {"Content-Type": "application/json"},
    )
    assert_error(status, body, 400, name)
    with pytest.raises(InferenceServerException) as raised:
        grpc_client.infer(MODEL, triton_inputs(grpcclient, bad))
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert name in raised.value.message()
    # the server is fine afterwards
    assert grpc_client.infer(MODEL, triton_inputs(grpcclient, arrays)).as_numpy(
        "prediction"
    ).shape == (4, 1)


def test_unknown_model_is_not_found(served, batch, grpc_client):
    arrays = {k: v[:2] for k, v in batch_arrays(batch).items()}
    body = json.dumps(kserve_json(arrays)).encode()
    assert_error(*request(served.http_url, "POST", "/v2/models/nope/infer", body), 404, "nope")
    assert_error(*request(served.http_url, "GET", "/v2/models/nope"), 404, "nope")
    assert_error(*request(served.http_url, "GET", "/v2/models/nope/ready"), 404, "nope")
    assert_error(
        *request(served.http_url, "POST", "/v1/models/nope:predict", b'{"instances": [{}]}'),
        404,
        "nope",
    )
    assert_error(
        *request(served.http_url, "POST", f"/v2/models/{MODEL}/versions/v0/infer", body),
        404,
        "v0",
    )
    for call in (
        lambda: grpc_client.infer("nope", triton_inputs(grpcclient, arrays)),
        lambda: grpc_client.get_model_metadata("nope"),
    ):
        with pytest.raises(InferenceServerException) as raised:
            call()
        assert raised.value.status() == "StatusCode.NOT_FOUND"
        assert "nope" in raised.value.message()
    # Client-chosen names never become label values: one "unknown" series, not one per name.
    requests_total = [
        sample
        for sample in metric_families(served.http_url)["recserve_requests"].samples
        if sample.name == "recserve_requests_total"
    ]
    assert {s.labels["model"] for s in requests_total} <= {MODEL, "unknown"}
    assert any(
        s.labels["model"] == "unknown" and s.labels["outcome"] == "NotFoundError"
        for s in requests_total
    )


def test_cli_errors_are_one_line_naming_the_problem(served, adult_checkpoint):
    def serve(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "embedding_store.cli", "serve"]
        command += ["--checkpoint", str(adult_checkpoint), "--host", "127.0.0.1", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # each process spends its ~2 s importing torch
        taken_http, taken_grpc, negative = pool.map(
            lambda args: serve(*args),
            [
                ("--http-port", str(served.http_port), "--grpc-port", "0"),
                ("--http-port", "0", "--grpc-port", str(served.grpc_port)),
                ("--max-queue-delay-ms", "-1"),
            ],
        )
    assert taken_http.returncode == 1
    assert f"cannot listen for HTTP on 127.0.0.1:{served.http_port}" in taken_http.stderr
    assert taken_grpc.returncode == 1
    assert f"cannot listen for gRPC on 127.0.0.1:{served.grpc_port}" in taken_grpc.stderr
    for result in (taken_http, taken_grpc):
        assert "Traceback" not in result.stderr
    assert negative.returncode == 2
    assert "--max-queue-delay-ms: expected a number >= 0, got '-1'" in negative.stderr


def test_non_finite_dense_values_are_rejected_naming_the_input(
    served, batch, http_client, grpc_client
):
    arrays = {k: v[:3] for k, v in batch_arrays(batch).items()}
    needles = ("numeric", "non-finite", "sample 1")
    # JSON has no NaN: a number beyond FP32's range is what turns into Inf there.
    document = kserve_json(arrays)
    numeric = next(t for t in document["inputs"] if t["name"] == "numeric")
    numeric["data"][numeric["shape"][1]] = 1e300  # sample 1, first column
    status, body = request(
        served.http_url,
        "POST",
        f"/v2/models/{MODEL}/infer",
        json.dumps(document).encode(),
        {"Content-Type": "application/json"},
    )
    assert_error(status, body, 400, *needles)
    bad = dict(arrays)
    bad["numeric"] = arrays["numeric"].copy()
    bad["numeric"][1, 2] = np.nan
    with pytest.raises(InferenceServerException) as raised:
        http_client.infer(MODEL, triton_inputs(httpclient, bad, binary_data=True))
    assert raised.value.status() == "400"
    assert all(n in raised.value.message() for n in (*needles, "position [2]"))
    bad["numeric"][1, 2] = np.inf
    with pytest.raises(InferenceServerException) as raised:
        grpc_client.infer(MODEL, triton_inputs(grpcclient, bad))
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert all(n in raised.value.message() for n in needles)


def test_classification_is_refused_over_both_protocols(batch, http_client, grpc_client):
    arrays = {k: v[:2] for k, v in batch_arrays(batch).items()}
    for client_module, client in ((httpclient, http_client), (grpcclient, grpc_client)):
        outputs = [client_module.InferRequestedOutput("prediction", class_count=2)]
        with pytest.raises(InferenceServerException) as raised:
            client.infer(MODEL, triton_inputs(client_module, arrays), outputs=outputs)
        assert raised.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
        assert "classification extension is not supported" in raised.value.message()


def test_callers_that_give_up_do_not_stop_the_server(served, batch, grpc_client):
    # Requests whose client deadline passes while they wait in the dynamic batcher are
    # cancelled there; later requests, small and large, must still be answered.
    arrays = {k: v[:1] for k, v in batch_arrays(batch).items()}
    inputs = triton_inputs(grpcclient, arrays)
    with grpcclient.InferenceServerClient(served.grpc_url) as impatient:
        for _ in range(30):
            with contextlib.suppress(InferenceServerException):  # most of them time out
                impatient.infer(MODEL, inputs, client_timeout=0.002)
    assert grpc_client.infer(MODEL, inputs, client_timeout=30).as_numpy("prediction").shape == (
        1,
        1,
    )
    large = {k: np.concatenate([v] * 40) for k, v in batch_arrays(batch).items()}  # > 64 KiB
    body = json.dumps(kserve_json(large)).encode()
    assert len(body) > 64 * 1024
    status, answer = request(served.http_url, "POST", f"/v2/models/{MODEL}/infer", body, timeout=30)
    assert status == 200, answer


def test_friendly_route_rejects_bad_rows(served, rows):
    broken = [dict(rows[0]), {k: v for k, v in rows[1].items() if k != "occupation"}]
    status, body = request(
        served.http_url,
        "POST",
        f"/v1/models/{MODEL}:predict",
        json.dumps({"instances": broken}).encode(),
    )
    assert_error(status, body, 400, "occupation")


def test_lengths_not_summing_in_process():
    """The same validation the server runs, on a signature with a jagged slot."""
    signature = FeatureSignature(
        id_features=(IdFeatureSpec("history", single_id=False), IdFeatureSpec("user", True)),
        non_id_features=(NonIdFeatureSpec("dense", "float32", (2,)),),
    )
    inputs = {
        "history": np.array([1, 2, 3], np.uint64),
        "history.lengths": np.array([1, 1], np.int64),
        "user": np.array([5, 6], np.uint64),
        "dense": np.zeros((2, 2), np.float32),
    }
    with pytest.raises(InvalidArgumentError, match=r"history\.lengths"):
        tensors.tensors_to_batch(signature, inputs, max_batch_size=16)
    inputs["history.lengths"] = np.array([1, 2], np.int64)
    assert tensors.tensors_to_batch(signature, inputs, max_batch_size=16).batch_size == 2


# --------------------------------------------------------------------------- 4. hot reload
class _Traffic:
    """Threads sending small requests in a loop (HTTP KServe JSON and gRPC) until stopped."""

    def __init__(self, server, arrays: dict[str, np.ndarray], deadline_s: float = 60.0) -> None:
        self.server = server
        self.arrays = arrays
        self.stop = threading.Event()
        self.deadline = time.monotonic() + deadline_s
        self.versions: dict[str, list[str]] = {"http": [], "grpc": []}
        self.failures: list[str] = []
        self.last: dict[str, np.ndarray] = {}
        self._threads = [
            threading.Thread(target=self._http, daemon=True),
            threading.Thread(target=self._grpc, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    MAX_REQUESTS = 20_000  # per protocol: a bound in count as well as in time

    def running(self) -> bool:
        sent = max(len(versions) + len(self.failures) for versions in self.versions.values())
        return (
            not self.stop.is_set() and time.monotonic() < self.deadline and sent < self.MAX_REQUESTS
        )

    def _http(self) -> None:
        host, port = self.server.http_url.rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        body = json.dumps(kserve_json(self.arrays)).encode()
        while self.running():
            try:
                connection.request("POST", f"/v2/models/{MODEL}/infer", body=body)
                response = connection.getresponse()
                payload = response.read()
                if response.status != 200:
                    self.failures.append(f"http {response.status}: {payload[:200]!r}")
                    continue
                document = json.loads(payload)
                self.versions["http"].append(document["model_version"])
                self.last["http"] = json_prediction(document)
            except Exception as error:
                self.failures.append(f"http {type(error).__name__}: {error}")
                connection.close()
        connection.close()

    def _grpc(self) -> None:
        client = grpcclient.InferenceServerClient(self.server.grpc_url)
        inputs = triton_inputs(grpcclient, self.arrays)
        while self.running():
            try:
                result = client.infer(MODEL, inputs, client_timeout=30.0)
                self.versions["grpc"].append(result.get_response().model_version)
                self.last["grpc"] = result.as_numpy("prediction")
            except Exception as error:
                self.failures.append(f"grpc {type(error).__name__}: {error}")
        client.close()

    def seen(self, version: str) -> bool:
        return all(version in versions for versions in self.versions.values())

    def join(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(30)


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def test_reload_under_load_then_failed_reload(
    serve_process, adult_checkpoint, adult_checkpoint_b, tmp_path, batch
):
    served_dir = tmp_path / "served"
    shutil.copytree(adult_checkpoint, served_dir)
    old_version, new_version = (
        manifest_version(adult_checkpoint),
        manifest_version(adult_checkpoint_b),
    )
    assert old_version != new_version
    server = serve_process(served_dir, "--watch-seconds", "0.5", "--output-transform", "sigmoid")
    assert server.version == old_version
    arrays = {k: v[:8] for k, v in batch_arrays(batch).items()}

    traffic = _Traffic(server, arrays)
    try:
        _wait_until(lambda: traffic.seen(old_version), 30, "traffic on the old version")
        # a new version arrives the way a trainer publishes one: staged next to the served
        # directory, then swapped in with two renames
        staging = tmp_path / "staging"
        shutil.copytree(adult_checkpoint_b, staging)
        os.rename(served_dir, tmp_path / "previous")
        os.rename(staging, served_dir)
        _wait_until(lambda: traffic.seen(new_version), 30, "the new version in responses")
        time.sleep(0.3)
    finally:
        traffic.join()
    assert traffic.failures == [], traffic.failures[:5]
    for protocol, versions in traffic.versions.items():
        first_new = versions.index(new_version)
        assert set(versions[:first_new]) == {old_version}, protocol
        assert set(versions[first_new:]) == {new_version}, protocol  # no flapping back
    with InferCtx(checkpoint=adult_checkpoint_b, output_transform="sigmoid") as ctx:
        expected = ctx.forward(
            Batch(
                [IDTypeFeatureWithSingleID(n, arrays[n]) for n in features.SLOT_NAMES],
                [NonIDTypeFeature(arrays["numeric"], "numeric")],
                requires_grad=False,
            )
        )
    for prediction in traffic.last.values():
        np.testing.assert_allclose(prediction, expected, rtol=0, atol=ATOL)

    # failed reloads (POST /admin/reload from loopback): the error names the problem and the
    # served version stays
    missing = tmp_path / "missing-checkpoint"
    status, body = request(
        server.http_url, "POST", "/admin/reload", json.dumps({"checkpoint": str(missing)}).encode()
    )
    assert status == 409  # CheckpointError: does not exist
    assert str(missing) in json.loads(body)["error"]
    corrupt = Path(shutil.copytree(adult_checkpoint, tmp_path / "corrupt"))
    (corrupt / "jit_dense.pt").write_bytes(b"not a torchscript file")
    status, body = request(
        server.http_url, "POST", "/admin/reload", json.dumps({"checkpoint": str(corrupt)}).encode()
    )
    assert status == 409  # CheckpointError: cannot be loaded
    assert "jit_dense.pt" in json.loads(body)["error"]
    assert_serves(server, arrays, new_version, expected)
    assert reload_counts(server) == {"ok": 1.0, "failed": 2.0}
    # an explicit reload of the served directory works (and is a no-op version-wise)
    status, document = post_json(server.http_url, "/admin/reload", {})
    assert status == 200 and document["version"] == new_version

    # the watcher picks up a new version whose embeddings are corrupt (same size, other
    # bytes): the reload fails on the checksum and the served version stays
    bad = Path(shutil.copytree(adult_checkpoint, tmp_path / "bad-embeddings"))
    for table in (bad / "embeddings").rglob("*.safetensors"):
        table.write_bytes(bytes(len(table.read_bytes())))
    os.rename(served_dir, tmp_path / "previous-2")
    os.rename(bad, served_dir)
    _wait_until(lambda: reload_counts(server)["failed"] == 3.0, 30, "the watcher's failed reload")
    assert "SHA-256" in server.log()
    time.sleep(1.0)  # a few more polls: the failed version is not retried
    assert reload_counts(server) == {"ok": 2.0, "failed": 3.0}
    assert_serves(server, arrays, new_version, expected)


class _WrongWidthModel(torch.nn.Module):
    """Scripts and loads, but fails on the Adult inputs (its linear layer is too narrow)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(7, 1)

    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006 (TorchScript reads the signature)
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        return self.linear(torch.cat(non_id_tensors + embedding_tensors, dim=1))


def _rewrite_manifest(checkpoint: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = checkpoint / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_unservable_checkpoints_are_refused_and_the_watcher_goes_on(
    serve_process, adult_checkpoint, adult_checkpoint_b, tmp_path, batch
):
    served_dir = Path(shutil.copytree(adult_checkpoint, tmp_path / "served"))
    server = serve_process(served_dir, "--watch-seconds", "0.3")
    arrays = {k: v[:4] for k, v in batch_arrays(batch).items()}

    # Another feature signature (an input becomes a list feature): 409, not a server error.
    other_inputs = Path(shutil.copytree(adult_checkpoint, tmp_path / "other-inputs"))
    _rewrite_manifest(
        other_inputs, lambda m: m["signature"]["id_features"][0].update(single_id=False)
    )
    status, body = request(
        server.http_url,
        "POST",
        "/admin/reload",
        json.dumps({"checkpoint": str(other_inputs)}).encode(),
    )
    assert_error(status, body, 409, "feature signature differs")

    # A dense model that verifies and loads but fails on the inputs: 409 naming the failure
    # (no TorchScript traceback for the client), counted, logged.
    unservable = Path(shutil.copytree(adult_checkpoint, tmp_path / "unservable"))
    torch.jit.script(_WrongWidthModel()).save(str(unservable / "jit_dense.pt"))
    payload = (unservable / "jit_dense.pt").read_bytes()

    def rehash(manifest: dict[str, Any]) -> None:
        manifest["files"]["jit_dense.pt"] = {
            "bytes": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
        manifest["version"] = "99999999-unservable"

    _rewrite_manifest(unservable, rehash)
    status, body = request(
        server.http_url,
        "POST",
        "/admin/reload",
        json.dumps({"checkpoint": str(unservable)}).encode(),
    )
    error = assert_error(status, body, 409, "cannot be served: RuntimeError", "mat1 and mat2")
    assert "Traceback" not in error and "\n" not in error
    assert reload_counts(server) == {"ok": 0.0, "failed": 2.0}  # both exist from the start

    # The watcher meets the same checkpoint, counts it, and still loads the next good one.
    os.rename(served_dir, tmp_path / "previous")
    os.rename(unservable, served_dir)
    _wait_until(lambda: reload_counts(server)["failed"] == 3.0, 30, "the watcher's failed reload")
    staging = Path(shutil.copytree(adult_checkpoint_b, tmp_path / "staging"))
    os.rename(served_dir, tmp_path / "previous-2")
    os.rename(staging, served_dir)
    new_version = manifest_version(adult_checkpoint_b)
    _wait_until(lambda: reload_counts(server).get("ok") == 1.0, 30, "the next good version")
    status, document = post_json(server.http_url, f"/v2/models/{MODEL}/infer", kserve_json(arrays))
    assert status == 200 and document["model_version"] == new_version
    assert "Exception in thread" not in server.log()

    # A checkpoint loaded from elsewhere by POST /admin/reload stays served: the watcher
    # follows its path's version, not the served one (it used to reload the path at once).
    old_version = manifest_version(adult_checkpoint)
    elsewhere = shutil.copytree(adult_checkpoint, tmp_path / "elsewhere")  # under --reload-root
    status, document = post_json(server.http_url, "/admin/reload", {"checkpoint": str(elsewhere)})
    assert status == 200 and document["version"] == old_version
    time.sleep(1.5)  # five polls
    status, document = post_json(server.http_url, f"/v2/models/{MODEL}/infer", kserve_json(arrays))
    assert status == 200 and document["model_version"] == old_version
    # ... until the watched path gets a new version.
    staging = Path(shutil.copytree(adult_checkpoint_b, tmp_path / "staging-next"))
    _rewrite_manifest(staging, lambda m: m.update(version="77777777-next"))
    os.rename(served_dir, tmp_path / "previous-3")
    os.rename(staging, served_dir)
    _wait_until(lambda: reload_counts(server).get("ok") == 3.0, 30, "the path's new version")
    status, document = post_json(server.http_url, f"/v2/models/{MODEL}/infer", kserve_json(arrays))
    assert status == 200 and document["model_version"] == "77777777-next"

    # A version that fails to load is tried again later: here its files were still being
    # copied in (the manifest first), so the second try loads it. It used to be given up.
    failed_before = reload_counts(server)["failed"]
    late = Path(shutil.copytree(adult_checkpoint_b, tmp_path / "late"))
    _rewrite_manifest(late, lambda m: m.update(version="88888888-late"))
    os.rename(late / "jit_dense.pt", tmp_path / "late-jit_dense.pt")
    os.rename(served_dir, tmp_path / "previous-4")
    os.rename(late, served_dir)
    _wait_until(
        lambda: reload_counts(server)["failed"] == failed_before + 1, 30, "the first try's failure"
    )
    os.rename(tmp_path / "late-jit_dense.pt", served_dir / "jit_dense.pt")
    _wait_until(lambda: reload_counts(server).get("ok") == 4.0, 30, "the retried version")
    status, document = post_json(server.http_url, f"/v2/models/{MODEL}/infer", kserve_json(arrays))
    assert status == 200 and document["model_version"] == "88888888-late"
    assert "will try version 88888888-late again in 5 s" in server.log()


def reload_counts(server) -> dict[str, float]:
    return {
        s.labels["outcome"]: s.value
        for s in metric_families(server.http_url)["recserve_reloads"].samples
        if s.name == "recserve_reloads_total"
    }


def assert_serves(server, arrays, version: str, expected: np.ndarray) -> None:
    status, document = post_json(server.http_url, f"/v2/models/{MODEL}/infer", kserve_json(arrays))
    assert status == 200 and document["model_version"] == version
    np.testing.assert_allclose(json_prediction(document), expected, rtol=0, atol=ATOL)


# --------------------------------------------------------------------------- 5. SIGTERM drain
def test_sigterm_drains_in_flight_requests(serve_process, adult_checkpoint, rows):
    # Slow requests without sleeping in the server: the batcher waits up to 2.5 s to merge
    # (max batch far above what we send), so every request sits in the server when SIGTERM
    # arrives.
    grace = 10.0
    server = serve_process(
        adult_checkpoint,
        "--grace-seconds",
        str(grace),
        "--max-queue-delay-ms",
        "2500",
        "--max-batch-size",
        "1000000",
        "--max-request-batch-size",
        "8192",
    )
    big = features.rows_to_batch(rows * 8, with_labels=False, requires_grad=False)  # 512 rows
    arrays = batch_arrays(big)
    body = json.dumps(kserve_json(arrays)).encode()
    results: dict[str, Any] = {}

    def http_call(key: str) -> None:
        try:
            status, payload = request(server.http_url, "POST", f"/v2/models/{MODEL}/infer", body)
            results[key] = (status, json.loads(payload)) if status == 200 else (status, payload)
        except Exception as error:
            results[key] = ("exception", repr(error))

    def grpc_call(key: str) -> None:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            result = client.infer(MODEL, triton_inputs(grpcclient, arrays), client_timeout=30)
            results[key] = (200, result.as_numpy("prediction"))
        except Exception as error:
            results[key] = ("exception", repr(error))
        finally:
            client.close()

    threads = [
        threading.Thread(target=http_call if i % 2 else grpc_call, args=(f"request-{i}",))
        for i in range(6)
    ]
    for thread in threads:
        thread.start()

    def pending() -> float:
        family = metric_families(server.http_url)["recserve_pending_requests"]
        return family.samples[0].value

    _wait_until(lambda: pending() >= len(threads), 10, "all requests queued in the server")
    sent = time.monotonic()
    server.terminate()
    saw_not_ready = False
    while server.process.poll() is None and time.monotonic() - sent < grace:
        try:
            status, _ = request(server.http_url, "GET", "/v2/health/ready", timeout=2)
        except OSError:
            break  # the listener is gone: shutdown went past readiness
        if status == 400:  # KServe v2: a 4xx is "false"
            saw_not_ready = True
            status, body = request(
                server.http_url, "POST", f"/v2/models/{MODEL}/infer", body, timeout=5
            )
            assert status == 503, body  # new work is refused while draining
            break
        time.sleep(0.01)
    for thread in threads:
        thread.join(grace + 10)
    assert saw_not_ready, "readiness never reported 400 (not ready) while draining"
    assert server.process.wait(grace + 5) == 0, server.log()[-2000:]
    assert time.monotonic() - sent < grace + 5
    assert sorted(results) == sorted(f"request-{i}" for i in range(len(threads)))
    for key, (status, payload) in results.items():
        assert status == 200, (key, payload)
        prediction = json_prediction(payload) if isinstance(payload, dict) else payload
        assert prediction.shape == (big.batch_size, 1)


# --------------------------------------------------------------------------- 6. fuzzing
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
_JSON = st.recursive(
    _SCALARS,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=16,
)
_NAMES = st.sampled_from([*features.SLOT_NAMES, "numeric", "bogus", ""])
_DATATYPES = st.sampled_from(["UINT64", "INT64", "INT32", "FP32", "FP16", "BOOL", "BYTES", "x"])
_NUMBER_LISTS = st.lists(
    st.integers(min_value=-(2**65), max_value=2**65)
    | st.floats(allow_nan=True, allow_infinity=True),
    max_size=8,
)
_TENSORS = st.fixed_dictionaries(
    {
        "name": _NAMES,
        "datatype": _DATATYPES,
        "shape": st.lists(st.integers(min_value=-2, max_value=2**40), max_size=3),
    },
    optional={
        "data": _NUMBER_LISTS | _JSON,
        "parameters": st.fixed_dictionaries(
            {}, optional={"binary_data_size": st.integers(min_value=-5, max_value=64)}
        ),
    },
)
_KSERVE = st.fixed_dictionaries(
    {"inputs": st.lists(_TENSORS, max_size=5)},
    optional={
        "id": _SCALARS,
        "parameters": st.dictionaries(
            st.sampled_from(["timeout", "binary_data_output", "x"]), _SCALARS, max_size=2
        ),
        "outputs": st.lists(
            st.fixed_dictionaries({"name": st.sampled_from(["prediction", "y"])}), max_size=2
        ),
    },
)
_ROW_VALUES = st.one_of(_SCALARS, st.lists(_SCALARS, max_size=3))
_INSTANCES = st.fixed_dictionaries(
    {
        "instances": st.lists(
            st.dictionaries(
                st.sampled_from([*features.NUMERIC_COLUMNS, *features.CATEGORICAL_COLUMNS, "x"]),
                _ROW_VALUES,
                max_size=16,
            ),
            max_size=3,
        )
    }
)
_SMALL_NUMBERS = st.lists(
    st.integers(min_value=-3, max_value=2**64) | st.floats(width=32), min_size=0, max_size=14
)
_REAL_INPUTS = [*features.SLOT_NAMES, "numeric"]


@st.composite
def _near_valid_kserve(draw) -> tuple[bytes, str | None]:
    """Every real input present, with drawn datatypes, shapes and data (JSON or binary)."""
    binary = draw(st.booleans())
    tensors_json, blobs = [], []
    for name in _REAL_INPUTS:
        datatype = draw(st.sampled_from(["UINT64", "INT64", "INT32", "FP32", "FP64", "BOOL"]))
        shape = draw(st.sampled_from([[2], [2, 6], [12], [1, 2], [0], [3]]))
        tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
        if binary:
            blob = draw(st.binary(max_size=100))
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = draw(_SMALL_NUMBERS)
        tensors_json.append(tensor)
    header = json.dumps({"inputs": tensors_json}).encode()
    if not binary:
        return header, None
    return header + b"".join(blobs), str(len(header))


_ADULT_ROW = {
    "age": 39,
    "workclass": "State-gov",
    "fnlwgt": 77516,
    "education": "Bachelors",
    "educational-num": 13,
    "marital-status": "Never-married",
    "occupation": "Adm-clerical",
    "relationship": "Not-in-family",
    "race": "White",
    "gender": "Male",
    "capital-gain": 2174,
    "capital-loss": 0,
    "hours-per-week": 40,
    "native-country": "United-States",
}


@st.composite
def _near_valid_instances(draw) -> bytes:
    """Real Adult rows with a few columns replaced by drawn JSON values."""
    instances = []
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        row = dict(_ADULT_ROW)
        for column in draw(st.lists(st.sampled_from(sorted(row)), max_size=3)):
            row[column] = draw(_ROW_VALUES | _JSON)
        instances.append(row)
    return json.dumps({"instances": instances}).encode()


_BODIES = st.one_of(
    st.binary(max_size=256),
    _JSON.map(lambda doc: json.dumps(doc).encode()),
    _KSERVE.map(lambda doc: json.dumps(doc).encode()),
    _INSTANCES.map(lambda doc: json.dumps(doc).encode()),
)
FUZZ_EXAMPLES = int(os.environ.get("RECSERVE_FUZZ_EXAMPLES", "60"))


_FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,  # RECSERVE_FUZZ_EXAMPLES=5000 for a longer hunt
    deadline=None,
    derandomize=FUZZ_EXAMPLES <= 60,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _post_fuzzed(server, path: str, body: bytes, headers: dict[str, str], gzip_it: bool) -> None:
    headers = {"Content-Type": "application/json", **headers}
    if gzip_it:
        body = gzip.compress(body)
        headers["Content-Encoding"] = "gzip"
    status, answer = request(server.http_url, "POST", path, body, headers)
    assert status < 500, (status, answer, body[:300])
    if status != 200:
        assert set(json.loads(answer)) == {"error"}, answer
    assert request(server.http_url, "GET", "/v2/health/live")[0] == 200


@_FUZZ_SETTINGS
@given(
    path=st.sampled_from([f"/v2/models/{MODEL}/infer", f"/v1/models/{MODEL}:predict"]),
    body=_BODIES,
    header_length=st.none() | st.integers(min_value=-3, max_value=300).map(str),
    gzip_it=st.booleans(),
)
def test_fuzzed_bodies_never_500(served, path, body, header_length, gzip_it):
    headers = {} if header_length is None else {"Inference-Header-Content-Length": header_length}
    _post_fuzzed(served, path, body, headers, gzip_it)


@_FUZZ_SETTINGS
@given(request_body=_near_valid_kserve(), gzip_it=st.booleans())
def test_fuzzed_near_valid_tensors_never_500(served, request_body, gzip_it):
    body, header_length = request_body
    headers = {} if header_length is None else {"Inference-Header-Content-Length": header_length}
    _post_fuzzed(served, f"/v2/models/{MODEL}/infer", body, headers, gzip_it)


@_FUZZ_SETTINGS
@given(body=_near_valid_instances())
def test_fuzzed_adult_rows_never_500(served, body):
    _post_fuzzed(served, f"/v1/models/{MODEL}:predict", body, {}, False)


# --------------------------------------------------------------------------- 7. metrics
def test_metrics_are_valid_prometheus_text(served, batch, grpc_client, tmp_path):
    arrays = {k: v[:4] for k, v in batch_arrays(batch).items()}
    assert post_json(served.http_url, f"/v2/models/{MODEL}/infer", kserve_json(arrays))[0] == 200
    grpc_client.infer(MODEL, triton_inputs(grpcclient, arrays))
    bad, _ = _bad_inputs("wrong dtype", arrays)
    assert post_json(served.http_url, f"/v2/models/{MODEL}/infer", kserve_json(bad))[0] == 400

    status, text = request(served.http_url, "GET", "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}

    requests_total = {
        (s.labels["protocol"], s.labels["model"], s.labels["version"], s.labels["outcome"]): s.value
        for s in families["recserve_requests"].samples
        if s.name == "recserve_requests_total"
    }
    assert families["recserve_requests"].type == "counter"
    assert requests_total[("http", MODEL, served.version, "ok")] >= 1
    assert requests_total[("grpc", MODEL, served.version, "ok")] >= 1
    assert requests_total[("http", MODEL, served.version, "InvalidArgumentError")] >= 1

    latency = families["recserve_request_latency_seconds"]
    assert latency.type == "histogram"
    counts = {s.labels["protocol"]: s.value for s in latency.samples if s.name.endswith("_count")}
    assert counts["http"] >= 2 and counts["grpc"] >= 1
    assert any(s.labels.get("le") == "+Inf" for s in latency.samples)

    batch_sizes = families["recserve_batch_size"]
    assert batch_sizes.type == "histogram"
    (count,) = [s.value for s in batch_sizes.samples if s.name == "recserve_batch_size_count"]
    assert count >= 2

    (age,) = families["recserve_checkpoint_age_seconds"].samples
    assert 0 <= age.value < 3600
    (info,) = families["recserve_model_info"].samples
    assert info.labels == {"model": MODEL, "version": served.version}

    promtool = shutil.which("promtool")
    if promtool:
        path = tmp_path / "metrics.txt"
        path.write_bytes(text)
        with open(path, "rb") as stdin:
            check = subprocess.run(
                [promtool, "check", "metrics"], stdin=stdin, capture_output=True, timeout=30
            )
        assert check.returncode == 0, check.stdout + check.stderr


class _ShardsNotAllServing:
    """The model's tier, reporting shard 1 as answering but not serving (a restarted
    inference shard that has not loaded its checkpoint) while ``serving`` is False."""

    def __init__(self, tier) -> None:
        self.tier = tier
        self.serving = False

    def status(self):
        status = self.tier.status()
        return dataclasses.replace(status, shard_serving=(True, self.serving))

    def __getattr__(self, name: str):
        return getattr(self.tier, name)


def test_a_shard_that_cannot_serve_shows_in_the_metric_not_in_readiness(adult_checkpoint):
    # Every server shares the tier: readiness that followed it would take every server out
    # of its Service while one shard restarts. The metric and last_tier_error tell instead.
    model = load_model(adult_checkpoint, name=MODEL)
    tier = model.tier = _ShardsNotAllServing(model.tier)
    service = PredictionService(model, tier_check_seconds=0.05)
    gauge = service.metrics.registry.get_sample_value
    try:
        _wait_until(lambda: not service.tier_serving, 10, "the tier check")
        assert service.last_tier_error == "embedding shard 1 cannot serve yet"  # in-process
        assert gauge("recserve_embedding_tier_serving") == 0.0
        assert service.ready() and gauge("recserve_ready") == 1.0
        tier.serving = True
        _wait_until(lambda: service.tier_serving, 10, "the tier serving again")
        assert service.last_tier_error is None
        assert gauge("recserve_embedding_tier_serving") == 1.0
    finally:
        service.close()


def test_close_after_a_reload_refuses_every_path_at_once(adult_checkpoint, batch):
    import asyncio

    from embedding_store.errors import UnavailableError

    def loader(path: str | None):
        return load_model(path or adult_checkpoint, name=MODEL)

    first = loader(None)
    closed: list[str] = []
    close_first = first.close
    first.close = lambda: (closed.append("first"), close_first())  # type: ignore[method-assign]
    service = PredictionService(first, loader=loader)
    inputs = batch_arrays(batch)
    answer = service.predict(MODEL, None, inputs, protocol="python")
    assert answer.outputs["prediction"].shape == (batch.batch_size, 1)
    service.reload(None)
    assert closed == ["first"]  # closed by the reload, no timer left behind
    service.close()
    assert not [t for t in threading.enumerate() if isinstance(t, threading.Timer)]
    assert not service.ready()
    with pytest.raises(UnavailableError, match="shutting down"):
        service.predict(MODEL, None, inputs, protocol="python")
    with pytest.raises(UnavailableError, match="shutting down"):
        asyncio.run(service.predict_async(MODEL, None, inputs, protocol="python"))


def test_too_many_rows_are_refused_before_the_preprocessor_runs(adult_checkpoint):
    # The preprocessor holds the GIL for every row: 150k rows used to be preprocessed for
    # seconds before the batch limit refused them.
    seen: list[int] = []

    def preprocessor(rows):
        seen.append(len(rows))
        return features.rows_to_batch(rows, with_labels=False, requires_grad=False)

    model = load_model(adult_checkpoint, name=MODEL, warm_up=False)
    service = PredictionService(model, max_request_batch_size=4, preprocessor=preprocessor)
    try:
        rows = [{"age": 30}] * 5
        with pytest.raises(
            InvalidArgumentError, match="batch size 5 exceeds this server's max batch size 4"
        ):
            service.predict_instances(MODEL, rows, protocol="python")
        assert seen == []
    finally:
        service.close()


def test_a_reload_closes_the_replaced_model_at_once_and_forgets_its_counters(
    adult_checkpoint, adult_checkpoint_b
):
    # Reloads in a burst used to keep every replaced table alive for 30 s, and each version
    # left request-counter series behind for good.
    def loader(path: str | None):
        return load_model(path or adult_checkpoint, name=MODEL, warm_up=False)

    service = PredictionService(loader(None), loader=loader)
    closed: list[str] = []
    counters = service.metrics.registry.get_sample_value
    try:
        batch = next(features.read_batches(features.TEST_PATH, 4, requires_grad=False))
        inputs = batch_arrays(batch)
        for round_ in range(3):
            model = service.model
            close = model.close
            model.close = lambda close=close, n=round_: (closed.append(n), close())  # type: ignore[method-assign]
            service.predict(MODEL, None, inputs, protocol="python")
            version = model.version
            labels = {"protocol": "python", "model": MODEL, "version": version, "outcome": "ok"}
            assert counters("recserve_requests_total", labels) == 1.0
            answer = service.reload(str((adult_checkpoint_b, adult_checkpoint)[round_ % 2]))
            assert answer["previous_version"] == version != answer["version"]
            assert closed == list(range(round_ + 1))  # closed by the reload itself
            assert counters("recserve_requests_total", labels) is None
    finally:
        service.close()


def test_a_request_cancelled_while_queued_is_skipped_and_counted_as_cancelled(adult_checkpoint):
    # What a reset connection does to its request (serving.http_protocol): the merged batch
    # runs without it and the request counter says "cancelled", not "ok".
    import asyncio

    model = load_model(adult_checkpoint, name=MODEL, warm_up=False)
    service = PredictionService(model, max_queue_delay=0.5)  # it waits in the queue
    ran: list[int] = []
    run = service._run

    def counting_run(merged):
        ran.append(merged.batch_size)
        return run(merged)

    service._run = counting_run  # type: ignore[method-assign]
    batch = next(features.read_batches(features.TEST_PATH, 3, requires_grad=False))

    async def main() -> None:
        cancelled = asyncio.create_task(
            service.predict_async(MODEL, None, batch_arrays(batch), protocol="http")
        )
        await asyncio.sleep(0.1)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await asyncio.sleep(0.6)  # past the flush

    try:
        asyncio.run(main())
        labels = {"protocol": "http", "model": MODEL, "version": model.version}
        sample = service.metrics.registry.get_sample_value
        assert sample("recserve_requests_total", {**labels, "outcome": "cancelled"}) == 1.0
        assert sample("recserve_requests_total", {**labels, "outcome": "ok"}) == 0.0
        assert ran == []  # the batch was skipped: nobody waited for it
    finally:
        service.close()


def test_each_request_of_a_merged_batch_reports_its_own_fallback_and_unknown_ids(
    adult_checkpoint,
):
    # When every ID of a merged batch fell back (or was unknown), each request's answer
    # counts its own IDs, not the merged batch's.
    model = load_model(adult_checkpoint, name=MODEL, warm_up=False)
    merged_sizes: list[int] = []
    real_infer = model.infer

    def infer_all_falling_back(merged: Batch):
        merged_sizes.append(merged.batch_size)
        output = real_infer(merged)
        # No split by sample (as from a tier that predates it): each request gets its share.
        return dataclasses.replace(
            output,
            fallback_ids=merged.num_ids,
            unknown_ids=merged.num_ids,
            unknown_per_sample=None,
        )

    model.infer = infer_all_falling_back  # type: ignore[method-assign]
    service = PredictionService(model, max_queue_delay=0.5)
    try:
        small, large = (
            features.rows_to_batch(read_rows(n), with_labels=False, requires_grad=False)
            for n in (3, 5)
        )
        answers: dict[int, Any] = {}

        def ask(batch: Batch) -> None:
            answers[batch.batch_size] = service.predict(
                MODEL, None, batch_arrays(batch), protocol="python"
            )

        threads = [threading.Thread(target=ask, args=(b,)) for b in (small, large)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        assert merged_sizes == [8]  # one merged batch of both requests
        for batch in (small, large):
            answer = answers[batch.batch_size]
            assert (answer.fallback_ids, answer.unknown_ids) == (batch.num_ids, batch.num_ids)
    finally:
        service.close()


def test_a_failed_reload_is_counted_and_noted_until_a_reload_succeeds(adult_checkpoint):
    from embedding_store.errors import CheckpointError

    def loader(path: str | None):
        if path == "broken":
            raise CheckpointError("checkpoint broken: manifest.json is missing")
        return load_model(adult_checkpoint, name=MODEL, warm_up=False)

    service = PredictionService(loader(None), loader=loader)
    count = service.metrics.registry.get_sample_value
    try:
        with pytest.raises(CheckpointError):
            service.reload("broken")
        assert service.last_reload_error == "checkpoint broken: manifest.json is missing"
        assert count("recserve_reloads_total", {"outcome": "failed"}) == 1.0
        assert count("recserve_reloads_total", {"outcome": "ok"}) == 0.0
        service.reload(None)
        assert service.last_reload_error is None
        assert count("recserve_reloads_total", {"outcome": "failed"}) == 1.0
        assert count("recserve_reloads_total", {"outcome": "ok"}) == 1.0
    finally:
        service.close()


def test_drain_says_when_a_request_batched_on_an_event_loop_outlives_the_grace(
    adult_checkpoint, batch
):
    import asyncio

    model = load_model(adult_checkpoint, name=MODEL, warm_up=False)
    service = PredictionService(model, max_queue_delay=1.0)  # queued on the loop for 1 s
    inputs = {k: v[:2] for k, v in batch_arrays(batch).items()}
    answers: list[Any] = []

    def ask() -> None:
        answers.append(asyncio.run(service.predict_async(MODEL, None, inputs, protocol="python")))

    asker = threading.Thread(target=ask)
    try:
        asker.start()
        _wait_until(lambda: service.pending == 1, 5, "the request to be queued")
        assert service.drain(0.2) is False  # still queued after the grace
        assert not service.ready()
        assert service.drain(5.0) is True  # the queued request still gets its answer
        asker.join(timeout=5)
        assert answers[0].outputs["prediction"].shape == (2, 1)
    finally:
        asker.join(timeout=5)
        service.close()


class _ShardsHoldingVersions:
    """The model's tier, reporting each shard's embedding checkpoint version as given."""

    def __init__(self, tier, versions: tuple[str, ...]) -> None:
        self.tier = tier
        self.versions = versions

    def status(self):
        status = self.tier.status()
        serving = (True,) * len(self.versions)
        return dataclasses.replace(
            status, shard_serving=serving, shard_checkpoint_versions=self.versions
        )

    def __getattr__(self, name: str):
        return getattr(self.tier, name)


def test_only_shards_that_name_another_embedding_checkpoint_count_as_mismatched(
    adult_checkpoint,
):
    # Shards that do not say ("": training shards, older builds) are not counted.
    model = load_model(adult_checkpoint, name=MODEL, warm_up=False)
    expected = model.embedding_version
    assert expected
    tier = model.tier = _ShardsHoldingVersions(model.tier, ("", expected, "other", ""))
    service = PredictionService(model, tier_check_seconds=0.05)
    gauge = service.metrics.registry.get_sample_value
    try:
        _wait_until(lambda: service.foreign_embedding_versions, 10, "the tier check")
        assert service.foreign_embedding_versions == {2: "other"}
        assert gauge("recserve_embedding_tier_version_mismatch") == 1.0
        tier.versions = ("", expected, expected, "")
        _wait_until(lambda: not service.foreign_embedding_versions, 10, "the shards to match")
        assert gauge("recserve_embedding_tier_version_mismatch") == 0.0
        assert service.tier_serving
    finally:
        service.close()


def test_only_the_served_version_is_found(adult_checkpoint, batch):
    from embedding_store.errors import NotFoundError

    model = load_model(adult_checkpoint, name=MODEL, warm_up=False)
    service = PredictionService(model)
    served = model.version
    inputs = {k: v[:2] for k, v in batch_arrays(batch).items()}
    try:
        for version in (None, "", served):
            assert service.model_metadata(MODEL, version).versions == (served,)
            assert service.model_ready(MODEL, version)
            answer = service.predict(MODEL, version, inputs, protocol="python")
            assert answer.model_version == served
        message = f"model {MODEL!r} has no version 'v0'; the served version is {served!r}"
        for call in (
            lambda: service.model_metadata(MODEL, "v0"),
            lambda: service.model_ready(MODEL, "v0"),
            lambda: service.predict(MODEL, "v0", inputs, protocol="python"),
        ):
            with pytest.raises(NotFoundError) as failure:
                call()
            assert failure.value.message == message
    finally:
        service.close()
