"""KServe v2 tensor codec: JSON, HTTP binary extension, gRPC typed and raw contents."""

from __future__ import annotations

import functools
import gzip
import re
import zlib

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from embedding_store.errors import CapacityError, InvalidArgumentError
from serving import grpc_codec, http_decode, http_encode, infer_request
from serving.core import KSERVE_DTYPES, Prediction
from serving.proto import V2


def _prediction(**outputs: np.ndarray) -> Prediction:
    return Prediction(
        outputs=outputs or {"prediction": np.array([[0.25], [0.75]], np.float32)},
        model_name="tiny",
        model_version="7",
        fallback_ids=2,
        unknown_ids=3,
    )


def _binary_body(header: dict, *blobs: bytes) -> tuple[bytes, int]:
    head = orjson.dumps(header)
    return head + b"".join(blobs), len(head)


# --------------------------------------------------------------------------- JSON tensors
def test_json_flat_and_nested_data_decode_to_the_declared_shape():
    flat = infer_request.array_from_json("age", "FP32", [2, 2], [1, 2.5, 3, 4])
    nested = infer_request.array_from_json("age", "FP32", [2, 2], [[1, 2.5], [3, 4]])
    assert flat.dtype == np.float32 and flat.shape == (2, 2)
    np.testing.assert_array_equal(flat, nested)
    ids = infer_request.array_from_json("user", "UINT64", [2], [2**64 - 1, 0])
    assert ids.dtype == np.uint64 and ids[0] == 2**64 - 1
    assert infer_request.array_from_json("b", "BOOL", [2], [True, False]).tolist() == [True, False]
    empty = infer_request.array_from_json("user", "INT64", [0], [])
    assert empty.dtype == np.int64 and empty.shape == (0,)


@pytest.mark.parametrize(
    ("datatype", "shape", "data", "message"),
    [
        (
            "INT32",
            [3],
            [1, 2],
            "input 'age.lengths': shape [3] has 3 elements but data has 2",
        ),
        ("INT64", [2], [[1, 2], [3]], "ragged"),
        # Regular, but deeper than numpy's 64 dimensions: not called ragged.
        (
            "INT64",
            [1],
            functools.reduce(lambda inner, _: [inner], range(100), [7]),
            "input 'age.lengths': 'data' nests lists 101 deep; nest them at most 1 deep (one "
            "level per dimension of its shape), or send them flat",
        ),
        ("INT64", [2], [1.5, 2], "INT64 data must be integers"),
        ("INT64", [2], ["1", "2"], "INT64 data must be integers"),
        ("INT8", [2], [1, 300], "value 300 is out of range for INT8"),
        ("UINT64", [2], [-1, 2], "value -1 is out of range for UINT64"),
        ("UINT64", [2], [2**63, 1.5], "UINT64 data must be integers"),
        ("UINT64", [2], [2**63, -1], "value -1 is out of range for UINT64"),
        # Floats of integer value: refused as for INT64 (they were taken as IDs).
        ("UINT64", [2], [1.0, 2], "UINT64 data must be integers"),
        ("UINT64", [2], [1000.0, 2**64 - 1], "UINT64 data must be integers"),
        ("UINT64", [2, 1], [[1e19], [2]], "UINT64 data must be integers"),
        ("FP32", [1], ["x"], "FP32 data must be numbers"),
        ("BOOL", [1], [1], "BOOL data must be true/false"),
        ("BYTES", [1], ["abc"], "BYTES is not supported"),
        ("FP8", [1], [1], "unknown datatype 'FP8'"),
        (7, [1], [1], "'datatype' must be a string"),
        ("INT32", [-1], [1], "non-negative integers"),
        ("INT32", [True], [1], "non-negative integers"),
        ("INT32", [0, *[2**20] * 3], [], "shape [0, 1048576, 1048576, 1048576] is too large"),
        ("INT32", "3", [1], "'shape' must be a list"),
        ("INT32", [1], 5, "'data' must be a (flat or nested) list"),
    ],
)
def test_json_tensor_errors_name_the_input(datatype, shape, data, message):
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        infer_request.array_from_json("age.lengths", datatype, shape, data)
    with pytest.raises(InvalidArgumentError, match=r"input 'age\.lengths'"):
        infer_request.array_from_json("age.lengths", datatype, shape, data)


def test_http_json_request_decodes_options():
    body = orjson.dumps(
        {
            "id": "r1",
            "parameters": {"timeout": 250_000, "binary_data_output": True},
            "inputs": [
                {"name": "user", "shape": [2], "datatype": "UINT64", "data": [5, 6]},
                {"name": "age", "shape": [2, 1], "datatype": "FP32", "data": [[1], [2]]},
            ],
            "outputs": [{"name": "prediction", "parameters": {"binary_data": False}}],
        }
    )
    request = http_decode.decode_http_request(body)
    assert request.id == "r1" and request.timeout == pytest.approx(0.25)
    assert request.binary_output is True
    assert request.outputs == (infer_request.RequestedOutput("prediction", False),)
    assert request.inputs["user"].tolist() == [5, 6]
    assert request.inputs["age"].shape == (2, 1)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "request body is not valid JSON"),
        (b"[1, 2]", "must be a JSON object with 'inputs', got a list of 2"),
        (b'{"inputs": []}', "'inputs' must be a non-empty list of tensors, got a list of 0"),
        (b'{"inputs": "x"}', "'inputs' must be a non-empty list of tensors, got the string 'x'"),
        (
            b'{"inputs": [{"shape": [1]}]}',
            r"inputs\[0\] must be an object with a string 'name', got an object without 'name'",
        ),
        (
            b'{"inputs": [{"name": 3, "shape": [1]}]}',
            r"inputs\[0\] must be an object with a string 'name', got an object whose 'name' "
            "is the number 3",
        ),
        (b'{"inputs": [7]}', r"inputs\[0\] must be .*, got the number 7"),
        (b'{"inputs": [{"name": "a", "shape": [1], "datatype": "INT64"}]}', "neither 'data'"),
        (
            b'{"inputs": [{"name": "a", "shape": [1], "datatype": "INT64", "data": [1]},'
            b' {"name": "a", "shape": [1], "datatype": "INT64", "data": [1]}]}',
            "given twice",
        ),
        (
            b'{"id": 5, "inputs": [{"name": "a", "shape": [1], "datatype": "INT64", "data": [1]}]}',
            "'id' must be a string, got the number 5",
        ),
        (
            b'{"parameters": {"timeout": "soon"}, "inputs": [{"name": "a", "shape": [1], '
            b'"datatype": "INT64", "data": [1]}]}',
            "'timeout' must be a non-negative integer",
        ),
        (
            b'{"outputs": [{"name": "p", "parameters": {"binary_data": 1}}], "inputs": '
            b'[{"name": "a", "shape": [1], "datatype": "INT64", "data": [1]}]}',
            "'binary_data' must be true or false, got the number 1",
        ),
        (
            b'{"inputs": [{"name": "a", "shape": [1], "datatype": "INT64", '
            b'"parameters": {"binary_data_size": 8}}]}',
            "no Inference-Header-Content-Length",
        ),
        (
            b'{"parameters": [1], "inputs": [{"name": "a", "shape": [1], "datatype": "INT64", '
            b'"data": [1]}]}',
            "request: 'parameters' must be an object, got a list of 1",
        ),
        (
            b'{"outputs": {"name": "p"}, "inputs": [{"name": "a", "shape": [1], '
            b'"datatype": "INT64", "data": [1]}]}',
            "'outputs' must be a list of .* objects, got an object",
        ),
        (
            b'{"outputs": [null], "inputs": [{"name": "a", "shape": [1], '
            b'"datatype": "INT64", "data": [1]}]}',
            r"outputs\[0\] must be an object with a string 'name', got null",
        ),
    ],
)
def test_http_request_errors(body, message):
    with pytest.raises(InvalidArgumentError, match=message):
        http_decode.decode_http_request(body)


def test_binary_extension_inputs_are_split_by_header_length():
    ids = np.array([1, 2, 3], np.uint64)
    age = np.array([[0.5], [1.5]], np.float32)
    body, size = _binary_body(
        {
            "inputs": [
                {
                    "name": "user",
                    "shape": [3],
                    "datatype": "UINT64",
                    "parameters": {"binary_data_size": 24},
                },
                {"name": "user.lengths", "shape": [2], "datatype": "INT32", "data": [2, 1]},
                {
                    "name": "age",
                    "shape": [2, 1],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 8},
                },
            ]
        },
        ids.tobytes(),
        age.tobytes(),
    )
    request = http_decode.decode_http_request(body, str(size))
    np.testing.assert_array_equal(request.inputs["user"], ids)
    np.testing.assert_array_equal(request.inputs["age"], age)
    assert request.inputs["user.lengths"].dtype == np.int32


@pytest.mark.parametrize(
    ("declared", "blob", "header_length", "message"),
    [
        (24, b"\0" * 16, None, "runs past the end"),
        (16, b"\0" * 16, None, "needs 24 bytes but binary_data_size has 16"),
        (32, b"\0" * 32, None, "needs 24 bytes but binary_data_size has 32"),
        (24, b"\0" * 32, None, "8 bytes of binary tensor data are not claimed"),
        (24, b"\0" * 24, "abc", "must be an integer"),
        (24, b"\0" * 24, "999999", "but the request body has"),
        (
            24,
            b"\0" * 24,
            "7",
            r"the request's JSON header \(its first Inference-Header-Content-Length: 7 bytes\) "
            "is not valid JSON",
        ),
    ],
)
def test_binary_extension_errors(declared, blob, header_length, message):
    body, size = _binary_body(
        {
            "inputs": [
                {
                    "name": "user",
                    "shape": [3],
                    "datatype": "UINT64",
                    "parameters": {"binary_data_size": declared},
                }
            ]
        },
        blob,
    )
    # Layout errors raise from the decoder; a tensor's own size check on first touch (lazy).
    with pytest.raises(InvalidArgumentError, match=message):
        dict(http_decode.decode_http_request(body, header_length or size).inputs)


def _one_binary_input() -> tuple[bytes, int]:
    return _binary_body(
        {
            "inputs": [
                {
                    "name": "user",
                    "shape": [3],
                    "datatype": "UINT64",
                    "parameters": {"binary_data_size": 24},
                }
            ]
        },
        np.arange(3, dtype=np.uint64).tobytes(),
    )


@pytest.mark.parametrize("form", ["+{}", "{}_", " {} ", "0x{}", "{}.0", "\u0661{}"])
def test_header_length_takes_ascii_digits_only_as_content_length(form):
    body, size = _one_binary_input()
    assert dict(http_decode.decode_http_request(body, str(size)).inputs)["user"].tolist() == [
        0,
        1,
        2,
    ]
    value = form.format(size) if "_" not in form else f"{str(size)[:1]}_{str(size)[1:]}"
    with pytest.raises(InvalidArgumentError, match="Inference-Header-Content-Length must be an"):
        http_decode.decode_http_request(body, value)


def test_a_binary_body_without_its_header_length_says_what_is_missing():
    body, _ = _one_binary_input()
    with pytest.raises(
        InvalidArgumentError,
        match=r"not valid JSON: .*looks like the binary tensor extension .* send the "
        r"Inference-Header-Content-Length header",
    ):
        http_decode.decode_http_request(body, None)


@pytest.mark.parametrize(
    ("decode", "body", "message"),
    [
        (http_decode.decode_instances, b'{"instances": [{"age": NaN}]}',
         "unexpected character, expected a JSON value: line 1 column 24 (char 23)"),
        (http_decode.decode_http_request,
         b'{"inputs": [{"name": "age", "shape": [1], "datatype": "FP32",\n"data": [-Infinity]}]}',
         "no digit after sign: line 2 column 11 (char 72)"),
    ],
)  # fmt: skip
def test_nan_and_infinity_in_a_body_are_named_as_the_fault(decode, body, message):
    """Python's json.dumps writes NaN and Infinity; orjson's message ("unexpected
    character") did not say that they are what JSON lacks."""
    with pytest.raises(InvalidArgumentError) as raised:
        decode(body)
    assert raised.value.message == (
        f"request body is not valid JSON: {message} (NaN and Infinity are not JSON numbers; "
        "every value must be finite)"
    )


def test_a_body_that_is_not_utf8_names_its_first_bad_byte():
    """orjson said "str is not valid UTF-8: surrogates not allowed: line 1 column 1 (char 0)"
    for a Latin-1 body: no surrogate, and the wrong place."""
    body = '{"instances": [{"city": "Málaga"}]}'.encode("latin-1")
    with pytest.raises(InvalidArgumentError) as raised:
        http_decode.decode_instances(body)
    assert raised.value.message == (
        "request body is not valid UTF-8: byte 26 is 0xe1 (JSON is UTF-8 text)"
    )


def test_http_response_json_and_binary_outputs():
    prediction = _prediction(
        prediction=np.array([[0.25], [0.75]], np.float32), scores=np.array([1, 2], np.int64)
    )
    request = infer_request.InferRequest(inputs={}, id="q")
    body, size = http_encode.encode_http_response(prediction, request)
    assert size is None
    document = orjson.loads(body)
    assert document["id"] == "q" and document["model_version"] == "7"
    assert document["parameters"] == {"fallback_ids": 2, "unknown_ids": 3}
    assert document["outputs"][0] == {
        "name": "prediction",
        "datatype": "FP32",
        "shape": [2, 1],
        "data": [0.25, 0.75],
    }

    request = infer_request.InferRequest(
        inputs={},
        outputs=(
            infer_request.RequestedOutput("scores"),
            infer_request.RequestedOutput("prediction", False),
        ),
        binary_output=True,
    )
    body, size = http_encode.encode_http_response(prediction, request)
    header = orjson.loads(body[:size])
    assert "id" not in header
    assert [o["name"] for o in header["outputs"]] == ["scores", "prediction"]
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 16}
    assert np.frombuffer(body[size:], "<i8").tolist() == [1, 2]
    assert header["outputs"][1]["data"] == [0.25, 0.75]

    with pytest.raises(InvalidArgumentError, match="unknown output 'nope'"):
        http_encode.encode_http_response(
            prediction,
            infer_request.InferRequest(inputs={}, outputs=(infer_request.RequestedOutput("nope"),)),
        )


def test_content_encoding():
    plain = b'{"a": 1}' * 10
    assert http_decode.decode_body(gzip.compress(plain), "gzip", 1000) == plain
    assert http_decode.decode_body(zlib.compress(plain), "deflate", 1000) == plain
    assert http_decode.decode_body(plain, None, 1000) == plain
    with pytest.raises(CapacityError):
        http_decode.decode_body(gzip.compress(b"0" * 5000), "gzip", 1000)
    with pytest.raises(InvalidArgumentError, match="unsupported Content-Encoding"):
        http_decode.decode_body(plain, "br", 1000)
    with pytest.raises(InvalidArgumentError, match="not valid gzip"):
        http_decode.decode_body(plain, "gzip", 1000)
    with pytest.raises(InvalidArgumentError, match="truncated"):
        http_decode.decode_body(gzip.compress(plain)[:-12], "gzip", 1000)


def test_instances():
    assert http_decode.decode_instances(b'{"instances": [{"user": [1]}]}') == [{"user": [1]}]
    for body in (b'{"instances": []}', b"[]", b'{"instances": [1]}'):
        with pytest.raises(InvalidArgumentError):
            http_decode.decode_instances(body)
    document = orjson.loads(http_encode.encode_instances_response(_prediction()))
    assert document["predictions"] == [[0.25], [0.75]]
    assert document["fallback_ids"] == 2 and document["unknown_ids"] == 3


# --------------------------------------------------------------------------- gRPC
def _grpc_request(raw: bool) -> V2.ModelInferRequest:
    request = V2.ModelInferRequest(model_name="tiny", id="g1")
    request.parameters["timeout"].int64_param = 100_000
    ids = request.inputs.add(name="user", datatype="UINT64", shape=[3])
    age = request.inputs.add(name="age", datatype="FP32", shape=[3, 1])
    small = request.inputs.add(name="small", datatype="INT8", shape=[2])
    if raw:
        request.raw_input_contents.extend(
            [
                np.array([1, 2, 2**63], "<u8").tobytes(),
                np.array([1, 2, 3], "<f4").tobytes(),
                np.array([-5, 7], "i1").tobytes(),
            ]
        )
    else:
        ids.contents.uint64_contents.extend([1, 2, 2**63])
        age.contents.fp32_contents.extend([1, 2, 3])
        small.contents.int_contents.extend([-5, 7])
    return request


@pytest.mark.parametrize("raw", [False, True])
def test_grpc_request_typed_and_raw(raw):
    request = grpc_codec.decode_grpc_request(_grpc_request(raw))
    assert request.raw is raw and request.id == "g1"
    assert request.timeout == pytest.approx(0.1)
    assert request.inputs["user"].dtype == np.uint64
    assert request.inputs["user"].tolist() == [1, 2, 2**63]
    assert request.inputs["age"].shape == (3, 1) and request.inputs["age"].dtype == np.float32
    assert request.inputs["small"].dtype == np.int8
    assert request.inputs["small"].tolist() == [-5, 7]


def test_grpc_request_errors():
    request = _grpc_request(False)
    del request.inputs[0].contents.uint64_contents[-1]
    with pytest.raises(InvalidArgumentError, match=r"input 'user': shape \[3\] has 3 elements"):
        grpc_codec.decode_grpc_request(request)

    request = _grpc_request(False)
    request.inputs[1].contents.Clear()
    request.inputs[1].contents.int64_contents.extend([1, 2, 3])
    with pytest.raises(InvalidArgumentError, match=r"takes contents\.fp32_contents"):
        grpc_codec.decode_grpc_request(request)

    # The right field, complete, plus values in another field: refused, not dropped.
    request = _grpc_request(False)
    request.inputs[1].contents.int64_contents.extend([1, 2, 3])
    with pytest.raises(
        InvalidArgumentError,
        match=r"input 'age': datatype FP32 takes contents\.fp32_contents only, but "
        r"contents\.int64_contents is also set",
    ):
        grpc_codec.decode_grpc_request(request)

    # An empty tensor (shape [0]) whose values sit in another field than its datatype's:
    # refused naming the field, not accepted with the values dropped.
    request = _grpc_request(False)
    request.inputs[0].shape[:] = [0]
    request.inputs[0].contents.Clear()
    request.inputs[0].contents.bytes_contents.append(b"7")
    with pytest.raises(
        InvalidArgumentError,
        match=r"^input 'user': datatype UINT64 takes contents\.uint64_contents, got "
        r"contents\.bytes_contents$",
    ):
        grpc_codec.decode_grpc_request(request)

    request = _grpc_request(False)
    request.inputs[2].contents.int_contents[0] = 1000
    with pytest.raises(InvalidArgumentError, match="value 1000 is out of range for INT8"):
        grpc_codec.decode_grpc_request(request)

    request = _grpc_request(True)
    request.raw_input_contents[1] = b"\0" * 8
    with pytest.raises(InvalidArgumentError, match=r"raw_input_contents\[1\] has 8"):
        grpc_codec.decode_grpc_request(request)

    request = _grpc_request(True)
    del request.raw_input_contents[-1]
    with pytest.raises(InvalidArgumentError, match="raw_input_contents has 2 entries"):
        grpc_codec.decode_grpc_request(request)

    request = _grpc_request(True)
    request.inputs[0].contents.uint64_contents.append(1)
    with pytest.raises(InvalidArgumentError, match="contents must be empty"):
        grpc_codec.decode_grpc_request(request)

    request = V2.ModelInferRequest(model_name="tiny")
    request.inputs.add(name="h", datatype="FP16", shape=[1])
    with pytest.raises(
        InvalidArgumentError,
        match=r"input 'h': FP16 tensors must be sent in raw_input_contents \(and recserve "
        r"models take .* dense features as FP32\)",
    ):
        grpc_codec.decode_grpc_request(request)
    request.inputs[0].datatype = "BYTES"
    with pytest.raises(InvalidArgumentError, match="BYTES is not supported"):
        grpc_codec.decode_grpc_request(request)


def test_an_output_requested_twice_is_named_as_over_http():
    body = orjson.dumps(
        {
            "inputs": [{"name": "user", "datatype": "INT64", "shape": [1], "data": [1]}],
            "outputs": [{"name": "p"}, {"name": "q"}, {"name": "p"}],
        }
    )
    with pytest.raises(InvalidArgumentError) as over_http:
        http_decode.decode_http_request(body)
    request = _grpc_request(False)
    for name in ("p", "q", "p"):
        request.outputs.add(name=name)
    with pytest.raises(InvalidArgumentError) as over_grpc:
        grpc_codec.decode_grpc_request(request)
    assert str(over_grpc.value) == str(over_http.value) == "output 'p' is requested twice"


@pytest.mark.parametrize("raw", [False, True])
def test_grpc_response_raw_iff_request_raw(raw):
    prediction = _prediction()
    response = grpc_codec.encode_grpc_response(
        prediction, infer_request.InferRequest(inputs={}, id="z", raw=raw)
    )
    assert (response.model_name, response.model_version, response.id) == ("tiny", "7", "z")
    assert response.parameters["fallback_ids"].int64_param == 2
    assert response.parameters["unknown_ids"].int64_param == 3
    (output,) = response.outputs
    assert (output.name, output.datatype, list(output.shape)) == ("prediction", "FP32", [2, 1])
    if raw:
        assert np.frombuffer(response.raw_output_contents[0], "<f4").tolist() == [0.25, 0.75]
        assert not output.HasField("contents")
    else:
        assert list(output.contents.fp32_contents) == [0.25, 0.75]
        assert not response.raw_output_contents


def test_parameters_round_trip():
    parameter = V2.InferParameter()
    for value in (True, -3, 2**64 - 1, 0.5, "text"):
        grpc_codec.set_parameter(parameter, value)
        assert grpc_codec.parameter_value(parameter) == value
    assert grpc_codec.parameter_value(V2.InferParameter()) is None


# --------------------------------------------------------------------------- property
_DTYPES = [n for n in KSERVE_DTYPES if n != "BOOL"]


@st.composite
def _tensors(draw):
    datatype = draw(st.sampled_from([*_DTYPES, "BOOL"]))
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4))
    elements = None
    if KSERVE_DTYPES[datatype].kind == "f":
        elements = st.floats(-1e4, 1e4, width=KSERVE_DTYPES[datatype].itemsize * 8)
    array = draw(hnp.arrays(KSERVE_DTYPES[datatype], shape, elements=elements))
    return datatype, array


@settings(max_examples=60, deadline=None)
@given(_tensors())
def test_every_encoding_round_trips(tensor):
    datatype, array = tensor
    shape = list(array.shape)
    # JSON, flat.
    decoded = infer_request.array_from_json("t", datatype, shape, array.reshape(-1).tolist())
    np.testing.assert_array_equal(decoded, array)
    # HTTP binary extension.
    body, size = _binary_body(
        {
            "inputs": [
                {
                    "name": "t",
                    "shape": shape,
                    "datatype": datatype,
                    "parameters": {"binary_data_size": array.nbytes},
                }
            ]
        },
        array.astype(array.dtype.newbyteorder("<")).tobytes(),
    )
    np.testing.assert_array_equal(http_decode.decode_http_request(body, size).inputs["t"], array)
    # gRPC raw, and typed where the protocol has a field for the datatype.
    request = V2.ModelInferRequest()
    request.inputs.add(name="t", datatype=datatype, shape=shape)
    raw = request.__deepcopy__()
    raw.raw_input_contents.append(array.astype(array.dtype.newbyteorder("<")).tobytes())
    np.testing.assert_array_equal(grpc_codec.decode_grpc_request(raw).inputs["t"], array)
    if datatype != "FP16":
        field = grpc_codec._CONTENTS[datatype][0]
        getattr(request.inputs[0].contents, field).extend(array.reshape(-1).tolist())
        got = grpc_codec.decode_grpc_request(request).inputs["t"]
        assert got.dtype == array.dtype
        np.testing.assert_array_equal(got, array)
    # And back out, both ways.
    prediction = Prediction(outputs={"t": array}, model_name="m", model_version="1")
    for raw_out in (False, True):
        response = grpc_codec.encode_grpc_response(
            prediction, infer_request.InferRequest(inputs={}, raw=raw_out)
        )
        assert response.outputs[0].datatype == datatype
    body, size = http_encode.encode_http_response(
        prediction, infer_request.InferRequest(inputs={}, binary_output=True)
    )
    out = np.frombuffer(body[size:], KSERVE_DTYPES[datatype].newbyteorder("<")).reshape(shape)
    np.testing.assert_array_equal(out, array)


# --------------------------------------------------------------------------- boundaries
_ONE_INPUT = b'"inputs": [{"name": "a", "shape": [1], "datatype": "INT64", "data": [1]}]'


@pytest.mark.parametrize("value", [b"true", b"false"])
def test_a_boolean_timeout_is_refused_not_read_as_1_or_0(value):
    body = b'{"parameters": {"timeout": ' + value + b"}, " + _ONE_INPUT + b"}"
    with pytest.raises(InvalidArgumentError) as raised:
        http_decode.decode_http_request(body)
    assert raised.value.message == (
        "parameter 'timeout' must be a non-negative integer (microseconds)"
    )
    assert http_decode.decode_http_request(body.replace(value, b"1500")).timeout == 0.0015


def test_shapes_of_16_dims_are_taken_and_17_refused():
    assert infer_request.shape_of("x", [1] * 16) == (1,) * 16
    array = infer_request.array_from_json("x", "INT64", [1] * 16, [7])
    assert array.shape == (1,) * 16 and array.tolist() == [[[[[[[[[[[[[[[[7]]]]]]]]]]]]]]]]
    with pytest.raises(InvalidArgumentError) as raised:
        infer_request.shape_of("x", [1] * 17)
    assert raised.value.message == (
        "input 'x': 'shape' must be a list of at most 16 non-negative integers"
    )


def test_a_shape_of_exactly_2_to_the_40_elements_is_not_too_large():
    assert infer_request.shape_of("x", [1 << 20, 1 << 20]) == (1 << 20, 1 << 20)
    # The shape passes; the bytes then do not match it.
    with pytest.raises(InvalidArgumentError) as raised:
        infer_request.array_from_bytes("x", "UINT8", [1 << 20, 1 << 20], b"", "binary_data_size")
    assert raised.value.message == (
        f"input 'x': shape [1048576, 1048576] of UINT8 needs {1 << 40} bytes but "
        "binary_data_size has 0"
    )
    with pytest.raises(InvalidArgumentError) as raised:
        infer_request.shape_of("x", [1 << 20, (1 << 20) + 1])
    assert raised.value.message == "input 'x': shape [1048576, 1048577] is too large"


def test_binary_bool_bytes_other_than_0_are_true():
    array = infer_request.array_from_bytes(
        "b", "BOOL", [4], b"\x00\x01\x02\xff", "binary_data_size"
    )
    assert array.tolist() == [False, True, True, True]


@pytest.mark.parametrize(
    ("datatype", "low", "high"),
    [
        ("INT8", -128, 127),
        ("INT16", -(2**15), 2**15 - 1),
        ("INT32", -(2**31), 2**31 - 1),
        ("UINT8", 0, 255),
        ("UINT32", 0, 2**32 - 1),
    ],
)
def test_json_integers_at_the_ends_of_their_range_are_taken(datatype, low, high):
    array = infer_request.array_from_json("n", datatype, [2], [low, high])
    assert array.dtype == KSERVE_DTYPES[datatype] and array.tolist() == [low, high]
    for bad in (low - 1, high + 1):
        with pytest.raises(InvalidArgumentError) as raised:
            infer_request.array_from_json("n", datatype, [2], [0, bad])
        assert raised.value.message == f"input 'n': value {bad} is out of range for {datatype}"


def test_a_body_that_decompresses_to_exactly_the_limit_is_taken():
    plain = b"x" * 1000
    assert http_decode.decode_body(gzip.compress(plain), "gzip", 1000) == plain
    assert http_decode.decode_body(zlib.compress(plain), "deflate", 1000) == plain
    with pytest.raises(CapacityError) as raised:
        http_decode.decode_body(gzip.compress(plain + b"x"), "gzip", 1000)
    assert raised.value.message == "decompressed request body exceeds 1000 bytes"


def test_a_repeated_header_length_is_named_as_repeated():
    body, size = _one_binary_input()
    with pytest.raises(InvalidArgumentError) as raised:
        http_decode.decode_http_request(body, f"{size}, {size}")
    assert raised.value.message == (
        f"Inference-Header-Content-Length must be sent once, got '{size}, {size}' (it was repeated)"
    )


def test_a_negative_binary_data_size_is_refused_even_when_the_sizes_add_up():
    # -8 + 16 == the 8 bytes sent: the layout tiles, but a negative size is still refused.
    header = {
        "inputs": [
            {"name": name, "shape": [1], "datatype": "INT64", "parameters": {"binary_data_size": n}}
            for name, n in (("a", -8), ("b", 16))
        ]
    }
    body, size = _binary_body(header, b"\0" * 8)
    with pytest.raises(InvalidArgumentError) as raised:
        dict(http_decode.decode_http_request(body, size).inputs)
    assert raised.value.message == (
        "input 'a': binary_data_size must be a non-negative integer, got the number -8"
    )


def test_raw_input_contents_with_an_entry_too_many_are_refused():
    request = _grpc_request(True)
    request.raw_input_contents.append(b"\0" * 8)
    with pytest.raises(InvalidArgumentError) as raised:
        grpc_codec.decode_grpc_request(request)
    assert raised.value.message == "raw_input_contents has 4 entries but the request has 3 inputs"


@pytest.mark.parametrize(
    ("datatype", "field", "low", "high"),
    [
        ("INT8", "int_contents", -128, 127),
        ("INT16", "int_contents", -(2**15), 2**15 - 1),
        ("UINT8", "uint_contents", 0, 255),
        ("UINT16", "uint_contents", 0, 2**16 - 1),
    ],
)
def test_grpc_typed_integers_at_the_ends_of_their_range_are_taken(datatype, field, low, high):
    request = V2.ModelInferRequest(model_name="tiny")
    tensor = request.inputs.add(name="n", datatype=datatype, shape=[2])
    getattr(tensor.contents, field).extend([low, high])
    assert grpc_codec.decode_grpc_request(request).inputs["n"].tolist() == [low, high]
    getattr(tensor.contents, field)[1] = high + 1
    with pytest.raises(InvalidArgumentError) as raised:
        grpc_codec.decode_grpc_request(request)
    assert raised.value.message == f"input 'n': value {high + 1} is out of range for {datatype}"


def test_an_empty_outputs_list_asks_for_every_output():
    body = b'{"outputs": [], ' + _ONE_INPUT + b"}"
    request = http_decode.decode_http_request(body)
    assert request.outputs is None
    prediction = _prediction(a=np.array([1.5], np.float32), b=np.array([2], np.int64))
    document = orjson.loads(http_encode.encode_http_response(prediction, request)[0])
    assert [(o["name"], o["data"]) for o in document["outputs"]] == [("a", [1.5]), ("b", [2])]


def test_int_parameters_take_int64_up_to_its_max_then_uint64():
    parameter = V2.InferParameter()
    grpc_codec.set_parameter(parameter, 2**63 - 1)
    assert parameter.WhichOneof("parameter_choice") == "int64_param"
    assert parameter.int64_param == 2**63 - 1
    grpc_codec.set_parameter(parameter, 2**63)
    assert parameter.WhichOneof("parameter_choice") == "uint64_param"
    assert parameter.uint64_param == 2**63
