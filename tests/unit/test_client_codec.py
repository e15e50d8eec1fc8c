"""clients/: wire encoding against the server's own codec, URLs, errors, retry policy, the
``recserve predict`` file readers, and the rule that clients/ never imports the server."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from google.protobuf import descriptor_pb2

from clients import codec
from clients._proto import V2 as CLIENT_V2
from clients.client import RecserveClient, is_rows, parse_url
from clients.commands import check_file, detect_format, iter_batches, locate, parse_value
from clients.retry import RetryableError, RetryPolicy, exhausted
from embedding_store.batch import Batch, IDTypeFeature, IDTypeFeatureWithSingleID, NonIDTypeFeature
from embedding_store.errors import (
    CapacityError,
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    RecserveError,
    UnavailableError,
)
from embedding_store.signature import FeatureSignature, IdFeatureSpec, NonIdFeatureSpec
from serving import grpc_codec, http_decode, http_encode, infer_request, instance_inputs
from serving.core import Prediction
from serving.proto import V2 as SERVER_V2

CLIENTS = Path(__file__).resolve().parents[2] / "clients"
#: The client library's modules (other tools living in clients/ have their own rules).
CLIENT_MODULES = (
    "__init__",
    "_grpc",
    "_http",
    "_proto",
    "_tls",
    "_v2_descriptor",
    "aio",
    "client",
    "codec",
    "commands",
    "retry",
    "types",
)


def _batch() -> Batch:
    return Batch(
        [
            IDTypeFeature.from_lists("user", [[1, 2], [2**63 + 5], []]),
            IDTypeFeatureWithSingleID.from_ids("item", [7, 8, 9]),
        ],
        [NonIDTypeFeature(np.arange(6, dtype=np.float32).reshape(3, 2), "dense")],
        requires_grad=False,
    )


def _prediction(batch: int = 3) -> Prediction:
    return Prediction(
        outputs={"prediction": np.linspace(0, 1, batch, dtype=np.float32).reshape(batch, 1)},
        model_name="m",
        model_version="v7",
        fallback_ids=2,
        unknown_ids=5,
    )


# --------------------------------------------------------------------------- isolation
def test_clients_never_import_serving_or_training():
    for path in (CLIENTS / f"{module}.py" for module in CLIENT_MODULES):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top not in ("serving", "training", "examples"), f"{path.name}: {name}"
                if top == "embedding_store":
                    assert name in (
                        "embedding_store.batch",
                        "embedding_store.errors",
                        "embedding_store.cli_types",
                        "embedding_store.tls",
                    ), name


def _without_json_names(
    file: descriptor_pb2.FileDescriptorProto,
) -> descriptor_pb2.FileDescriptorProto:
    copy = descriptor_pb2.FileDescriptorProto()
    copy.CopyFrom(file)
    copy.name = ""

    def strip(messages):
        for message in messages:
            for field in message.field:
                field.ClearField("json_name")
            strip(message.nested_type)

    strip(copy.message_type)
    return copy


def test_client_messages_match_the_server_proto():
    mine = descriptor_pb2.FileDescriptorProto()
    CLIENT_V2.file.CopyToProto(mine)
    theirs = descriptor_pb2.FileDescriptorProto()
    SERVER_V2.file.CopyToProto(theirs)
    assert _without_json_names(mine) == _without_json_names(theirs)
    # Private pools: the classes are distinct from the server's (and from tritonclient's).
    assert CLIENT_V2.ModelInferRequest is not SERVER_V2.ModelInferRequest


def test_client_proto_shares_a_process_with_tritonclient():
    import tritonclient.grpc  # noqa: F401  (registers inference.* in the default pool)

    request = CLIENT_V2.ModelInferRequest(model_name="m")
    assert CLIENT_V2.ModelInferRequest.FromString(request.SerializeToString()).model_name == "m"


# --------------------------------------------------------------------------- tensors
def test_batch_to_tensors_follows_kserve_naming():
    tensors = codec.batch_to_tensors(_batch())
    assert list(tensors) == ["user", "user.lengths", "item", "dense"]
    assert tensors["user"].dtype == np.uint64
    np.testing.assert_array_equal(tensors["user"], np.array([1, 2, 2**63 + 5], dtype=np.uint64))
    assert tensors["user.lengths"].dtype == np.int64
    np.testing.assert_array_equal(tensors["user.lengths"], [2, 1, 0])
    np.testing.assert_array_equal(tensors["item"], np.array([7, 8, 9], dtype=np.uint64))
    assert tensors["dense"].dtype == np.float32 and tensors["dense"].shape == (3, 2)


@pytest.mark.parametrize("sample_shape", [(), (1,)])
def test_a_one_dimensional_dense_feature_is_taken_by_a_model_trained_on_it(sample_shape):
    # A model trained on [B] data records sample shape (); [B, 1] was refused by it.
    from embedding_store.batch import Batch, IDTypeFeatureWithSingleID, NonIDTypeFeature
    from embedding_store.signature import FeatureSignature, IdFeatureSpec, NonIdFeatureSpec
    from serving.tensors import tensors_to_batch

    values = np.array([0.5, 1.5, -2.0], np.float32)
    batch = Batch(
        [IDTypeFeatureWithSingleID.from_ids("user", [1, 2, 3])],
        [NonIDTypeFeature(values, "x")],
        requires_grad=False,
    )
    tensors = codec.batch_to_tensors(batch)
    assert tensors["x"].shape == (3,)
    signature = FeatureSignature(
        (IdFeatureSpec("user", True),), (NonIdFeatureSpec("x", "float32", sample_shape),)
    )
    served = tensors_to_batch(signature, tensors, max_batch_size=16)
    np.testing.assert_array_equal(np.ravel(served.non_id_type_features[0].data), values)


def test_http_infer_request_decodes_on_the_server():
    tensors = codec.batch_to_tensors(_batch())
    body, headers = codec.encode_http_infer(tensors, timeout=1.5)
    request = http_decode.decode_http_request(body, headers[codec.HEADER_LENGTH])
    assert request.binary_output is True
    assert request.timeout == pytest.approx(1.5)
    assert set(request.inputs) == set(tensors)
    for name, array in tensors.items():
        np.testing.assert_array_equal(request.inputs[name], array)
        assert request.inputs[name].dtype == array.dtype


def test_http_infer_response_decodes_binary_and_json():
    binary = infer_request.InferRequest(inputs={}, binary_output=True)
    payload, json_size = http_encode.encode_http_response(_prediction(), binary)
    assert json_size is not None
    result = codec.decode_http_infer(payload, str(json_size))
    np.testing.assert_array_equal(result.predictions, _prediction().outputs["prediction"])
    assert (result.model_version, result.fallback_ids, result.unknown_ids) == ("v7", 2, 5)
    payload, json_size = http_encode.encode_http_response(
        _prediction(), infer_request.InferRequest(inputs={})
    )
    assert json_size is None
    result = codec.decode_http_infer(payload, None)
    assert result.predictions.dtype == np.float32 and result.predictions.shape == (3, 1)
    np.testing.assert_allclose(result.predictions, _prediction().outputs["prediction"])


def test_rows_response_decodes():
    result = codec.decode_rows_response(http_encode.encode_instances_response(_prediction(2)))
    assert result.predictions.shape == (2, 1) and result.predictions.dtype == np.float32
    assert (result.model_name, result.model_version, result.unknown_ids) == ("m", "v7", 5)
    # The answer's fields as sent, but the predictions: the load tests tell an answer without
    # unknown_ids (read as 0) from one that counted none.
    assert result.parameters == {"model_name": "m", "model_version": "v7", "fallback_ids": 2,
                                 "unknown_ids": 5}  # fmt: skip


def test_grpc_round_trip_through_the_server_codec():
    tensors = codec.batch_to_tensors(_batch())
    request = codec.encode_grpc_infer("m", tensors)
    on_server = SERVER_V2.ModelInferRequest.FromString(request.SerializeToString())
    decoded = grpc_codec.decode_grpc_request(on_server)
    assert decoded.raw
    for name, array in tensors.items():
        np.testing.assert_array_equal(decoded.inputs[name], array)
    for raw in (True, False):
        answer = grpc_codec.encode_grpc_response(
            _prediction(), infer_request.InferRequest(inputs={}, raw=raw)
        )
        response = CLIENT_V2.ModelInferResponse.FromString(answer.SerializeToString())
        result = codec.decode_grpc_infer(response)
        np.testing.assert_array_equal(result.predictions, _prediction().outputs["prediction"])
        assert (result.model_version, result.fallback_ids, result.unknown_ids) == ("v7", 2, 5)
        assert {k: result.parameters[k] for k in ("fallback_ids", "unknown_ids")} == {
            "fallback_ids": 2,
            "unknown_ids": 5,
        }


def test_check_tensors_rejects_unsupported_dtypes():
    with pytest.raises(InvalidArgumentError, match="'names'"):
        codec.check_tensors({"names": np.array(["a", "b"])})
    with pytest.raises(InvalidArgumentError):
        codec.check_tensors({})


@pytest.mark.parametrize(
    ("value", "dtype", "expected"),
    [
        # numpy alone made FP64 of these (the server refused "IDs must be INT64 or UINT64")
        ([2**63 + 5, 7], np.uint64, [2**63 + 5, 7]),
        ([[2**63, 1], [2, 3]], np.uint64, [[2**63, 1], [2, 3]]),
        ([np.uint64(2**63), 5], np.uint64, [2**63, 5]),
        ([2**64 - 1], np.uint64, [2**64 - 1]),
        ([-5, 7], np.int64, [-5, 7]),
        ([-(2**63), 2**63 - 1], np.int64, [-(2**63), 2**63 - 1]),
        ([1, 2.5], np.float64, [1.0, 2.5]),
        # an ID feature with no IDs in this batch (numpy made FP64 of it)
        ([], np.int64, []),
        ([[], []], np.int64, [[], []]),
        # a bool counts as 0 or 1 wherever it stands (a big ID made FP64 of this mix)
        ([101, True, 2**63], np.uint64, [101, 1, 2**63]),
        ([1, True, 3], np.int64, [1, 1, 3]),
    ],
)
def test_check_tensors_makes_int64_or_uint64_of_python_integers(value, dtype, expected):
    array = codec.check_tensors({"user": value})["user"]
    assert array.dtype == dtype
    assert array.tolist() == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            [-1, 2**63],
            "input 'user' mixes negative integers (-1) with integers >= 2**63 "
            "(9223372036854775808): neither INT64 nor UINT64 holds both",
        ),
        ([2**64, 1], "input 'user': integer 18446744073709551616 fits neither INT64 nor UINT64"),
        (
            [-(2**63) - 1],
            "input 'user': integer -9223372036854775809 fits neither INT64 nor UINT64",
        ),
    ],
)
def test_check_tensors_refuses_integers_no_id_type_holds(value, message):
    with pytest.raises(InvalidArgumentError) as caught:
        codec.check_tensors({"user": value})
    assert caught.value.message == message


def test_check_tensors_names_a_ragged_input():
    # It used to be numpy's bare ValueError, outside the RecserveError hierarchy.
    with pytest.raises(InvalidArgumentError) as caught:
        codec.check_tensors({"user.lengths": [1, 2], "user": [[1, 2], [3]]})
    assert caught.value.message.startswith(
        "input 'user' is not a rectangular array of numbers (setting an array element with a "
        "sequence."
    )


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, InvalidArgumentError),
        (404, NotFoundError),
        (413, CapacityError),
        (503, UnavailableError),
        (504, DeadlineExceededError),
        (500, RecserveError),
    ],
)
def test_http_errors_map_by_status(status, cls):
    error = codec.http_error("http://h:1", status, b'{"error": "bad input \'x\'"}')
    assert type(error) is cls
    assert "http://h:1" in error.message and "bad input 'x'" in error.message


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        ("INVALID_ARGUMENT", InvalidArgumentError),
        ("NOT_FOUND", NotFoundError),
        ("RESOURCE_EXHAUSTED", CapacityError),
        ("UNAVAILABLE", UnavailableError),
        ("DEADLINE_EXCEEDED", DeadlineExceededError),
        ("INTERNAL", RecserveError),
    ],
)
def test_grpc_errors_map_by_code(code, cls):
    error = codec.grpc_error("grpc://h:1", code, "details here")
    assert type(error) is cls and "grpc://h:1" in error.message and "details here" in error.message


def test_non_json_error_body_is_kept():
    error = codec.http_error("http://h:1", 502, b"Bad Gateway")
    assert "Bad Gateway" in error.message


# --------------------------------------------------------------------------- URLs, inputs
def test_parse_url():
    assert parse_url("http://127.0.0.1:8000/").base == "http://127.0.0.1:8000"
    assert parse_url("127.0.0.1:8000").protocol == "http"
    grpc_endpoint = parse_url("grpc://localhost:8001")
    assert (grpc_endpoint.protocol, grpc_endpoint.base) == ("grpc", "localhost:8001")
    for bad in ("ftp://h:1", "grpc://h", "", "grpc://h:1/path", "http://h:x"):
        with pytest.raises(InvalidArgumentError):
            parse_url(bad)


def test_is_rows():
    assert is_rows([{"a": 1}])
    assert not is_rows([])
    assert not is_rows({"a": 1})
    assert not is_rows([{"a": 1}, 3])


# --------------------------------------------------------------------------- retry policy
def test_backoff_grows_exponentially_with_jitter_and_a_cap():
    policy = RetryPolicy(5, 0.05, 1.0)
    for attempt in range(8):
        ceiling = min(1.0, 0.05 * 2**attempt)
        delays = [policy.delay(attempt) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(set(delays)) > 1
    with pytest.raises(InvalidArgumentError, match="retries must be >= 0, got -1"):
        RetryPolicy(-1)
    with pytest.raises(InvalidArgumentError, match=r"0 <= min <= max, got \(2\.0, 1\.0\)"):
        RetryPolicy(1, 2.0, 1.0)


@pytest.mark.parametrize(
    ("backoff", "got"),
    [
        (math.inf, "(inf, inf)"),
        (1e300, "(1e+300, 1e+300)"),
        ((0.05, math.inf), "(0.05, inf)"),
        ((0.05, 1e6 + 1), "(0.05, 1000001.0)"),
    ],
)
def test_a_backoff_too_long_for_the_clock_is_an_invalid_argument(backoff, got):
    """backoff=inf used to fail the first retry with a raw ValueError from time.sleep
    ("Invalid value NaN"), and 1e300 with an OverflowError; (0.05, inf) once the doubling
    passed what a float holds. One number is both the least and the most wait."""
    with pytest.raises(InvalidArgumentError) as refused:
        RecserveClient("http://127.0.0.1:9", model_name="m", backoff=backoff)
    assert refused.value.message == (
        f"backoff must be (min, max) seconds, at most 1000000, with 0 <= min <= max, got {got}"
    )


def test_the_backoff_of_a_late_retry_is_the_maximum():
    """2.0**1024 overflows: the 1025th retry of a client with many used to raise it, raw."""
    policy = RetryPolicy(5000, 0.05, 1.0)
    assert all(0.5 <= policy.delay(attempt) <= 1.0 for attempt in (1023, 1024, 4999))


def test_exhausted_keeps_the_class_and_counts_attempts():
    error = exhausted(RetryableError(UnavailableError("server x: busy")), 4)
    assert type(error) is UnavailableError
    assert error.message == "server x: busy (gave up after 4 attempts)"
    single = UnavailableError("server x: busy")
    assert exhausted(RetryableError(single), 1) is single  # one attempt: nothing to add


# --------------------------------------------------------------------------- predict files
def test_parse_value():
    assert parse_value(" 39 ") == 39
    assert parse_value("-2.5e3") == -2500.0
    assert parse_value("State-gov") == "State-gov"
    assert parse_value("") == ""
    assert parse_value("nan") == "nan"


def test_detect_format(tmp_path):
    assert detect_format(Path("a.jsonl"), None) == "jsonl"
    assert detect_format(Path("a.csv.gz"), None) == "csv"
    assert detect_format(Path("a.txt"), "csv") == "csv"
    with pytest.raises(InvalidArgumentError, match="--format"):
        detect_format(Path("a.txt"), None)


def test_jsonl_bad_lines_are_reported_with_numbers(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2\n[1]\n{"a": 3}\n')
    with pytest.raises(InvalidArgumentError) as caught:
        check_file(path, "jsonl")
    message = caught.value.message
    assert "2 bad lines" in message
    assert "line 3: not valid JSON" in message
    assert "line 4: expected a JSON object, got list" in message


def test_csv_rows_and_bad_lines(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text('age,workclass,note\n39, State-gov ,"a, b"\n\n50,Private,x\n')
    assert check_file(path, "csv") == 2
    batches = list(iter_batches(path, "csv", 1))
    assert batches == [
        ([2], [{"age": 39, "workclass": "State-gov", "note": "a, b"}]),
        ([4], [{"age": 50, "workclass": "Private", "note": "x"}]),
    ]
    path.write_text("age,workclass\n39,State-gov\n40\n")
    with pytest.raises(InvalidArgumentError, match="line 3: has 1 fields, the header has 2"):
        check_file(path, "csv")


def test_a_utf8_byte_order_mark_is_no_part_of_the_first_name(tmp_path):
    # It used to make the first CSV column "\ufeffage" (the server then missed "age"), and
    # the first JSONL line "not valid JSON".
    path = tmp_path / "rows.csv"
    path.write_bytes(b"\xef\xbb\xbfage,workclass\n39,State-gov\n")
    assert list(iter_batches(path, "csv", 5)) == [([2], [{"age": 39, "workclass": "State-gov"}])]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"age": 39}\n{"age": 40}\n')
    assert list(iter_batches(path, "jsonl", 5)) == [([1, 2], [{"age": 39}, {"age": 40}])]


def test_locate_names_input_lines():
    error = InvalidArgumentError("server s answered HTTP 400: instances[1] lacks feature 'age'")
    located = locate(error, Path("rows.jsonl"), [3, 5, 9])
    assert type(located) is InvalidArgumentError
    assert located.message == (
        "rows.jsonl: rows on lines 3-9: server s answered HTTP 400: instances[1] (line 5) lacks "
        "feature 'age'"
    )


class _FriendlyRoute:
    """A RecserveClient whose server is the friendly route of the own_model walk-through's
    model (no --preprocessor): rows answer as the real route answers them."""

    signature = FeatureSignature(
        id_features=(IdFeatureSpec("user_id", True), IdFeatureSpec("hist_items", False)),
        non_id_features=(NonIdFeatureSpec("dense", "float32", (3,)),),
    )

    def __init__(self, url: str, **_options: object) -> None:
        self.url = url

    def __enter__(self) -> _FriendlyRoute:
        return self

    def __exit__(self, *_exc: object) -> None:
        pass

    def predict(self, rows: list[dict]) -> None:
        if "age" in rows[0]:  # a preprocessor's raw row, refused as the Adult one refuses it
            raise InvalidArgumentError(
                "server answered HTTP 400: instances could not be preprocessed: row 0: column "
                f"'age': expected a number, got {rows[0]['age']!r}"
            )
        try:
            instance_inputs.instances_to_inputs(self.signature, rows)
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"server answered HTTP 400: {error.message}") from None
        raise AssertionError("every row of these tests is refused")


@pytest.mark.parametrize(
    ("name", "text", "server_message", "hint"),
    [
        # recserve eval's layout (the walk-through's test.csv): columns per dense value, a
        # label column.
        (
            "eval.csv",
            "user_id,hist_items,dense_0,dense_1,dense_2,click\n1,10 11,0.1,1.0,0.5,1\n",
            "instances[0] (line 2) has unknown feature(s) ['click', 'dense_0', 'dense_1', "
            "'dense_2']; known: ['dense', 'hist_items', 'user_id']",
            True,
        ),
        # Keyed by feature name, but a list of IDs is one string in a CSV cell.
        (
            "named.csv",
            "user_id,hist_items,dense\n1,10 11,0.5\n",
            "instances[0] (line 2).hist_items: IDs must be integers, got '10 11' (str)",
            True,
        ),
        # The same rows as JSON lines are no CSV matter; nor is a bad value in a CSV.
        (
            "named.jsonl",
            '{"user_id": 1, "hist_items": "10 11", "dense": [0.1, 1.0, 0.5]}\n',
            "instances[0] (line 1).hist_items: IDs must be integers, got '10 11' (str)",
            False,
        ),
        # Numbers for a [3] feature as one cell.
        (
            "dense.csv",
            "user_id,hist_items,dense\n1,10,0.1 1.0 0.5\n",
            "instances[0] (line 2).dense: expected a list of 3 numbers, got '0.1 1.0 0.5'",
            True,
        ),
        # Raw rows for a preprocessor: its errors are its own.
        (
            "raw.csv",
            "user_id,hist_items,dense,age\n1,10,0.5,abc\n",
            "instances could not be preprocessed: row 0 (line 2): column 'age': expected a "
            "number, got 'abc'",
            False,
        ),
        (
            "empty.csv",
            "user_id,hist_items,dense\n,10,0.5\n",
            "instances[0] (line 2).user_id: IDs must be integers, got '' (str)",
            False,
        ),
        (
            "negative.csv",
            "user_id,hist_items,dense\n-1,10,0.5\n",
            "instances[0] (line 2).user_id: IDs must be in [0, 2**64), got -1",
            False,
        ),
    ],
)
def test_recserve_predict_tells_a_csv_user_what_the_friendly_route_takes(
    name, text, server_message, hint, tmp_path, monkeypatch, capsys
):
    """A CSV that is not keyed by single-valued features gets the server's error and what to
    do instead (JSON lines, or recserve eval for its own CSV layout)."""
    import clients.client
    from clients.commands import CSV_LAYOUT_HINT
    from embedding_store.cli import main

    monkeypatch.setattr(clients.client, "RecserveClient", _FriendlyRoute)
    rows = tmp_path / name
    rows.write_text(text)
    assert main(["predict", "--url", "http://127.0.0.1:9", "--input", str(rows)]) == 1
    lines = "line 2" if name.endswith(".csv") else "line 1"
    expected = (
        f"recserve predict: error: {rows}: rows on {lines}: server answered HTTP 400: "
        f"{server_message}{CSV_LAYOUT_HINT if hint else ''}\n"
    )
    assert capsys.readouterr().err == expected


@pytest.mark.parametrize(
    ("body", "header_length"),
    [
        (b'{"outputs":[{}]}', None),
        (b'{"outputs":[null]}', None),
        (b"{}", "abc"),
        (
            b'{"outputs":[{"name":"p","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":"x"}}]}',
            None,
        ),
        (b'{"outputs":[{"name":"p","datatype":"FP32","shape":[-1,-1],"data":[1]}]}', None),
        (b'{"outputs":[{"name":"p","datatype":"FP32","shape":5,"data":[1]}]}', None),
        (b'{"outputs":[{"name":"p","datatype":"FP32","shape":[1],"data":"abc"}]}', None),
        (
            b'{"outputs":[{"name":"p","datatype":"FP32","shape":[1],"data":[1]}],"parameters":"x"}',
            None,
        ),
    ],
)
def test_a_malformed_http_answer_is_a_recserve_error(body, header_length):
    with pytest.raises(RecserveError, match=r"malformed|bad|not valid|does not fit"):
        codec.decode_http_infer(body, header_length)


def test_a_header_length_past_the_answer_is_refused():
    body = b'{"outputs":[{"name":"p","datatype":"FP32","shape":[1],"data":[0.5]}]}'
    assert codec.decode_http_infer(body, str(len(body))).predictions.tolist() == [[0.5]]
    with pytest.raises(
        RecserveError, match=f"bad Inference-Header-Content-Length '{len(body) + 1}'"
    ):
        codec.decode_http_infer(body, str(len(body) + 1))


def test_malformed_grpc_and_rows_answers_are_recserve_errors():
    response = CLIENT_V2.ModelInferResponse()
    for name in ("a", "b"):
        response.outputs.add(name=name, datatype="FP32", shape=[1])
    response.raw_output_contents.append(b"\0\0\0\0")  # one blob for two outputs
    with pytest.raises(RecserveError, match="malformed"):
        codec.decode_grpc_infer(response)
    with pytest.raises(RecserveError, match="malformed"):
        codec.decode_rows_response(b'{"predictions":[[1],[1,2]]}')


# --------------------------------------------------------------------------- exact wire details
# (each found unchecked by mutation testing)
def test_error_messages_of_odd_bodies_and_missing_details():
    server = "http://h:1"
    assert codec.http_error(server, 503, b"").message == (
        "server http://h:1 answered HTTP 503: (no message)"
    )
    # A JSON error that is not a string: the body is quoted as text.
    assert codec.http_error(server, 400, b'{"error": 3}').message == (
        'server http://h:1 answered HTTP 400: {"error": 3}'
    )
    # A long text body is cut to its first 200 bytes.
    long_body = b"x" * 150 + b"y" * 150
    assert codec.http_error(server, 404, long_body).message == (
        "server http://h:1 answered HTTP 404: " + "x" * 150 + "y" * 50
    )
    assert codec.grpc_error("grpc://h:1", "INTERNAL", None).message == (
        "server grpc://h:1 answered gRPC INTERNAL: (no details)"
    )


def test_big_endian_arrays_are_sent_little_endian():
    """The binary tensor extension and raw_input_contents are little-endian whatever the
    array's byte order; a big-endian array keeps its KServe datatype."""
    array = np.array([1, 2], dtype=">i4")
    assert codec.datatype_of(array) == "INT32"
    body, headers = codec.encode_http_infer({"x": array})
    assert body[int(headers[codec.HEADER_LENGTH]) :] == b"\x01\0\0\0\x02\0\0\0"
    request = codec.encode_grpc_infer("m", {"x": array})
    assert request.raw_input_contents[0] == b"\x01\0\0\0\x02\0\0\0"
    assert request.inputs[0].datatype == "INT32"


def test_batch_to_tensors_sends_dense_features_as_fp32():
    batch = Batch(
        [IDTypeFeatureWithSingleID.from_ids("item", [7, 8])],
        [NonIDTypeFeature(np.array([[0.5], [1.5]], dtype=np.float64), "dense")],
        requires_grad=False,
    )
    dense = codec.batch_to_tensors(batch)["dense"]
    assert dense.dtype == np.float32 and dense.tolist() == [[0.5], [1.5]]


def test_check_tensors_takes_the_lowest_int64_and_refuses_empty_names():
    checked = codec.check_tensors({"x": [-(2**63), 1]})
    assert checked["x"].dtype == np.int64 and checked["x"].tolist() == [-(2**63), 1]
    with pytest.raises(InvalidArgumentError, match="fits neither INT64 nor UINT64"):
        codec.check_tensors({"x": [-(2**63) - 1]})
    # The lowest INT64 with one >= 2**63: a mix no type holds, not an integer out of range.
    with pytest.raises(
        InvalidArgumentError, match=r"mixes negative integers \(-9223372036854775808\)"
    ):
        codec.check_tensors({"x": [-(2**63), 2**63]})
    with pytest.raises(InvalidArgumentError, match="tensor names must be non-empty strings"):
        codec.check_tensors({"": np.zeros(1)})


def test_json_output_data_must_fit_its_shape():
    body = b'{"outputs":[{"name":"p","datatype":"FP32","shape":[2,1],"data":[1,2,3]}]}'
    with pytest.raises(RecserveError, match=r"output 'p': data does not fit shape \[2, 1\]"):
        codec.decode_http_infer(body, None)


def test_the_prediction_output_is_chosen_among_several_binary_outputs():
    """Outputs follow each other in the body at their binary_data_size; the result is the
    one named "prediction", wherever it comes."""
    first = np.array([7, 8, 9], dtype="<i8").tobytes()
    second = np.array([0.25, 0.75], dtype="<f4").tobytes()
    header = (
        b'{"outputs":['
        b'{"name":"extra","datatype":"INT64","shape":[3],"parameters":{"binary_data_size":24}},'
        b'{"name":"prediction","datatype":"FP32","shape":[2],"parameters":{"binary_data_size":8}}'
        b'],"parameters":{"fallback_ids":4}}'
    )
    result = codec.decode_http_infer(header + first + second, str(len(header)))
    assert result.predictions.tolist() == [[0.25], [0.75]]
    assert (result.fallback_ids, result.unknown_ids) == (4, 0)


def test_a_negative_header_length_is_refused():
    body = b'{"outputs":[{"name":"p","datatype":"FP32","shape":[1],"data":[0.5]}]}'
    with pytest.raises(RecserveError, match="bad Inference-Header-Content-Length '-1'"):
        codec.decode_http_infer(body, "-1")


@pytest.mark.parametrize(("timeout", "microseconds"), [(0.5, 500_000), (1e-7, 1), (2.0, 2_000_000)])
def test_the_http_timeout_parameter_is_in_whole_microseconds_at_least_one(timeout, microseconds):
    body, headers = codec.encode_http_infer({"x": np.zeros(1, np.float32)}, timeout=timeout)
    header = json.loads(body[: int(headers[codec.HEADER_LENGTH])])
    assert header["parameters"] == {"binary_data_output": True, "timeout": microseconds}
    body, headers = codec.encode_http_infer({"x": np.zeros(1, np.float32)}, timeout=None)
    header = json.loads(body[: int(headers[codec.HEADER_LENGTH])])
    assert header["parameters"] == {"binary_data_output": True}


def test_answers_without_outputs_or_not_an_object_say_so():
    with pytest.raises(RecserveError, match=r"^the server answered without outputs$"):
        codec.decode_http_infer(b'{"outputs": []}', None)
    with pytest.raises(RecserveError, match=r"^the server's answer is not a JSON object$"):
        codec.decode_http_infer(b"[1, 2]", None)


def test_model_metadata_versions_are_strings():
    info = codec.model_info_from_json(
        {"name": "m", "versions": [3, "v4"], "inputs": [{"name": "x", "datatype": "FP32"}]}
    )
    assert info.versions == ("3", "v4")
    assert info.inputs[0].shape == ()


def test_rows_may_hold_numpy_values_and_integer_keys_but_not_arbitrary_objects():
    body = codec.encode_rows([{"a": np.int64(3), "b": np.array([1.5, 2.0]), 7: "x"}])
    assert body == b'{"instances":[{"a":3,"b":[1.5,2.0],"7":"x"}]}'
    with pytest.raises(InvalidArgumentError, match="rows are not JSON-serializable"):
        codec.encode_rows([{"a": object()}])


def test_url_schemes_are_case_insensitive():
    assert parse_url("HTTP://h:1/") == parse_url("http://h:1")
    assert parse_url("GRPC://h:2").protocol == "grpc"


# --------------------------------------------------------------------------- recserve predict
def test_parse_value_keeps_signs_and_negative_exponents():
    assert parse_value("-39") == -39
    assert isinstance(parse_value("+7"), int) and parse_value("+7") == 7
    assert parse_value("1e-3") == 0.001
    assert parse_value("-.5") == -0.5


def test_parse_value_takes_ascii_digits_only_as_numbers():
    """\\d matched other scripts' digits, and int()/float() then read them as ASCII ones:
    such a field is text, as `recserve eval` refuses it as a number."""
    for text in (
        "\u0661\u0662",
        "\u0967.5",
        "1_0",
        "\uff17",
    ):  # Arabic-Indic, Devanagari, fullwidth
        value = parse_value(text)
        assert type(value) is str and value == text
    assert parse_value("12") == 12 and parse_value("7.0") == 7.0


def test_jsonl_lines_must_be_objects_not_any_json_value(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n3\n"x"\n')
    with pytest.raises(InvalidArgumentError) as caught:
        check_file(path, "jsonl")
    message = caught.value.message
    assert "2 bad lines" in message
    assert "line 2: expected a JSON object, got int" in message
    assert "line 3: expected a JSON object, got str" in message


def test_a_csv_header_with_a_repeated_name_is_refused(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("age,age\n1,2\n")
    with pytest.raises(InvalidArgumentError) as caught:
        check_file(path, "csv")
    assert caught.value.message == (
        f"{path}: 1 bad line:\n  line 1: the header needs non-empty, distinct column names"
    )


def test_csv_lines_of_only_blanks_are_skipped(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("age,workclass\n   \n39,x\n")
    assert check_file(path, "csv") == 1
    assert list(iter_batches(path, "csv", 5)) == [([3], [{"age": 39, "workclass": "x"}])]


@pytest.mark.parametrize(("bad_lines", "more"), [(20, ""), (21, "\n  ... and 1 more")])
def test_at_most_twenty_bad_lines_are_listed(tmp_path, bad_lines: int, more: str):
    """The error lists the first 20 bad lines and counts the rest."""
    path = tmp_path / "rows.jsonl"
    path.write_text("[]\n" * bad_lines)
    with pytest.raises(InvalidArgumentError) as caught:
        check_file(path, "jsonl")
    shown = "\n  ".join(f"line {n}: expected a JSON object, got list" for n in range(1, 21))
    assert caught.value.message == f"{path}: {bad_lines} bad lines:\n  {shown}{more}"


@pytest.mark.parametrize(("text", "fmt"), [("", "jsonl"), ("\n\n", "jsonl"), ("a,b\n", "csv")])
def test_a_file_without_rows_is_refused(tmp_path, text: str, fmt: str):
    path = tmp_path / f"rows.{fmt}"
    path.write_text(text)
    with pytest.raises(InvalidArgumentError) as caught:
        check_file(path, fmt)
    assert caught.value.message == f"{path}: no rows"


def test_a_truncated_gzip_input_is_an_invalid_argument(tmp_path):
    import gzip

    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"a": 1}\n' * 100)[:-12])
    with pytest.raises(InvalidArgumentError, match="cannot read --input"):
        check_file(path, "jsonl")


def test_locate_leaves_indexes_past_the_batch_alone_and_names_a_single_line():
    error = InvalidArgumentError("instances[3] and row 0 are bad")
    located = locate(error, Path("rows.csv"), [7])
    assert located.message == "rows.csv: rows on line 7: instances[3] and row 0 (line 7) are bad"
    located = locate(error, Path("rows.csv"), [2, 4, 6])
    assert located.message == "rows.csv: rows on lines 2-6: instances[3] and row 0 (line 2) are bad"


def test_predict_flag_defaults_and_retries_refuse_negative_values(capsys):
    from embedding_store.cli import build_parser

    args = build_parser().parse_args(["predict", "--input", "rows.jsonl"])
    assert (args.url, args.model, args.batch_size, args.timeout, args.retries, args.format) == (
        "http://127.0.0.1:8000",
        "model",
        256,
        30.0,
        3,
        None,
    )
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["predict", "--input", "rows.jsonl", "--retries", "-1"])
    assert caught.value.code == 2
    assert "--retries" in capsys.readouterr().err


def test_predict_refuses_a_grpc_url_before_reading_the_input(tmp_path):
    from embedding_store.cli import build_parser

    args = build_parser().parse_args(
        ["predict", "--url", "grpc://127.0.0.1:8001", "--input", str(tmp_path / "missing.jsonl")]
    )
    with pytest.raises(InvalidArgumentError, match="need an HTTP server URL"):
        args.handler(args)


def test_predict_refuses_credentials_in_its_url_before_reading_the_input(tmp_path):
    from embedding_store.cli import build_parser

    missing = str(tmp_path / "missing.jsonl")
    args = build_parser().parse_args(["predict", "--url", "ann:s3cret@h:8000", "--input", missing])
    with pytest.raises(InvalidArgumentError) as caught:
        args.handler(args)
    assert caught.value.message == (
        "server URL 'http://ann:***@h:8000' has credentials (user:password@): they are never "
        "sent, and the server takes no credentials in the URL; remove them (to authenticate a "
        "client, use mutual TLS: an https:// or grpcs:// URL with --tls-cert and --tls-key)"
    )


def test_predict_refuses_to_write_its_output_over_its_input(tmp_path):
    # --output is replaced without asking: the predictions used to replace the rows.
    from embedding_store.cli import build_parser

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"user": 1}\n')
    same = tmp_path / "sub" / ".." / "rows.jsonl"
    args = build_parser().parse_args(
        ["predict", "--url", "http://127.0.0.1:9", "--input", str(rows), "--output", str(same)]
    )
    with pytest.raises(InvalidArgumentError) as caught:
        args.handler(args)
    assert caught.value.message == f"--output {same} is the --input file"
    assert rows.read_text() == '{"user": 1}\n'


if TYPE_CHECKING:
    from clients.types import PredictResult


class _ShortAnswerClient:
    """A client whose server answers one prediction fewer than the rows it was sent."""

    url = "http://127.0.0.1:1"

    def __init__(self, *_args: object, **_kwargs: object) -> None:
        """Takes the real client's arguments and connects to nothing."""

    def __enter__(self) -> _ShortAnswerClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        """Nothing to close."""

    def predict(self, rows: list[dict]) -> PredictResult:
        from clients.types import PredictResult

        return PredictResult(np.zeros((len(rows) - 1, 1), np.float32), "m", "v1")


def test_predict_refuses_an_answer_with_a_wrong_number_of_predictions(tmp_path, monkeypatch):
    from clients import client as client_module
    from embedding_store.cli import build_parser
    from embedding_store.errors import RecserveError

    monkeypatch.setattr(client_module, "RecserveClient", _ShortAnswerClient)
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": 3}\n')
    output = tmp_path / "out.jsonl"
    args = build_parser().parse_args(["predict", "--input", str(path), "--output", str(output)])
    with pytest.raises(RecserveError) as caught:
        args.handler(args)
    assert caught.value.message == ("server http://127.0.0.1:1 answered 2 predictions for 3 rows")
    assert not output.exists()


def test_a_missing_input_file_is_an_invalid_argument_naming_it(tmp_path):
    path = tmp_path / "missing.jsonl"
    with pytest.raises(InvalidArgumentError) as caught:
        check_file(path, "jsonl")
    assert caught.value.message == f"cannot read --input {path}: No such file or directory"


def test_csv_header_names_are_stripped_and_ndjson_is_json_lines(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text(" age , workclass\n39,x\n")
    assert list(iter_batches(path, "csv", 5)) == [([2], [{"age": 39, "workclass": "x"}])]
    assert detect_format(Path("rows.NDJSON.gz"), None) == "jsonl"


# --------------------------------------------------------------------------- URL passwords
def test_redact_url_hides_only_the_password():
    from clients._urls import redact_url, redact_userinfo

    assert redact_url("http://ann:s3cret@h:8000/p") == "http://ann:***@h:8000/p"
    assert redact_url("grpcs://ann:p@ss@h:1") == "grpcs://ann:***@h:1"  # up to the last "@"
    assert redact_url("ann:s3cret@h:1") == "ann:***@h:1"
    assert redact_url("http://ann:s3cret@[::1") == "http://ann:***@[::1"  # urlsplit refuses it
    for plain in ("http://ann@h:1", "http://h:1/a:b@c", "h:1", ""):
        assert redact_url(plain) == plain
    details = "errors resolving ann:s3cret@h:1: lookup failed for ann:s3cret@h:1"
    assert redact_userinfo(details, "ann:s3cret@h:1") == (
        "errors resolving ann:***@h:1: lookup failed for ann:***@h:1"
    )


def test_client_refuses_credentials_in_the_url():
    # No transport sends them (urllib3 drops them, gRPC takes them as part of the host name):
    # such a URL would silently never authenticate, so it is refused, its password redacted.
    mtls = "an https:// or grpcs:// URL with tls_cert and tls_key)"
    for url, shown in (
        ("http://ann:s3cret@127.0.0.1:8000", "http://ann:***@127.0.0.1:8000"),
        ("ann:s3cret@127.0.0.1:8000/", "http://ann:***@127.0.0.1:8000"),
        ("https://ann@h:8443/v2", "https://ann@h:8443/v2"),
        ("grpc://ann:s3cret@127.0.0.1:8001", "grpc://ann:***@127.0.0.1:8001"),
        ("grpcs://ann:p@ss@h:1", "grpcs://ann:***@h:1"),
    ):
        with pytest.raises(InvalidArgumentError) as caught:
            RecserveClient(url)
        assert caught.value.message == (
            f"server URL {shown!r} has credentials (user:password@): they are never sent, "
            "and the server takes no credentials in the URL; remove them (to authenticate a "
            "client, use mutual TLS: " + mtls
        )
    with pytest.raises(InvalidArgumentError) as caught:
        parse_url("http://ann:s3cret@h:1", tls_names=("--tls-ca", "--tls-cert", "--tls-key"))
    assert caught.value.message == (
        "server URL 'http://ann:***@h:1' has credentials (user:password@): they are never sent, "
        "and the server takes no credentials in the URL; remove them (to authenticate a "
        "client, use mutual TLS: an https:// or grpcs:// URL with --tls-cert and --tls-key)"
    )
    for bad, message in (  # other faults come first, the password redacted
        ("ftp://ann:s3cret@h", "server URL 'ftp://ann:***@h': scheme must be http, https, grpc "
         "or grpcs, got 'ftp'"),
        ("http://ann:s3cret@h:x", "server URL 'http://ann:***@h:x' has an invalid port"),
        ("grpc://ann:s3cret@h", "gRPC server URL 'grpc://ann:***@h' needs a port"),
        ("http://ann:s3cret@[::1", "server URL 'http://ann:***@[::1': Invalid IPv6 URL"),
    ):  # fmt: skip
        with pytest.raises(InvalidArgumentError) as caught:
            parse_url(bad)
        assert caught.value.message == message
    assert parse_url("http://h:1/a:b@c").base == "http://h:1/a:b@c"  # "@" in the path: no password


def test_eval_server_messages_never_show_the_password_of_the_url():
    from clients.eval_scorers import ServerScorer

    with pytest.raises(InvalidArgumentError) as caught:
        ServerScorer("ftp://ann:s3cret@h", "m")
    assert caught.value.message == "--url must be http(s)://HOST:PORT, got 'ftp://ann:***@h'"
    with pytest.raises(InvalidArgumentError) as caught:
        ServerScorer("http://ann:s3cret@[::1", "m")
    assert caught.value.message == "--url 'http://ann:***@[::1': Invalid IPv6 URL"
    # urllib would resolve "ann:s3cret@127.0.0.1" as the host name: refused up front.
    with pytest.raises(InvalidArgumentError) as caught:
        ServerScorer("ann:s3cret@127.0.0.1:8000", "m", tls_ca=Path("ca.pem"))
    assert caught.value.message == (
        "--url 'http://ann:***@127.0.0.1:8000' has credentials (user:password@): they are "
        "never sent, and the server takes no credentials in the URL; remove them (to "
        "authenticate a client, use mutual TLS: an https:// URL with --tls-cert and --tls-key)"
    )
