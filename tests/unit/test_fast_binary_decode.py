"""Binary-extension infer bodies: lazy BinaryTensors and the fast binary batch builder.

The reference is the eager decoder: the same tensors sent with one harmless extra key in each
input's ``parameters`` take the eager decode loop (a dict of zero-copy arrays) and then the
general path of ``tensors_to_batch``. The fast path must give an equal Batch, or exactly the
same exception type and message.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from embedding_store.batch import Batch, IDTypeFeatureWithSingleID
from embedding_store.errors import InvalidArgumentError, RecserveError
from embedding_store.signature import FeatureSignature, IdFeatureSpec, NonIdFeatureSpec
from serving import fast_batch, http_decode, lazy_tensors, tensors
from tests.unit.fast_path_signatures import MAX_BATCH, SINGLE

JAGGED = FeatureSignature(
    id_features=(IdFeatureSpec("user", True), IdFeatureSpec("history", False)),
    non_id_features=(NonIdFeatureSpec("dense", "float32", (2,)),),
)

Tensor = tuple[str, str, list[Any], bytes]  # name, datatype, shape, little-endian bytes


def _binary_body(inputs: list[Tensor], *, eager: bool = False) -> tuple[bytes, str]:
    """(body, Inference-Header-Content-Length). ``eager``: an extra parameter in every input,
    which the eager loop ignores and the lazy path does not take."""
    header = {
        "inputs": [
            {
                "name": name,
                "datatype": datatype,
                "shape": shape,
                "parameters": {"binary_data_size": len(raw), **({"note": 1} if eager else {})},
            }
            for name, datatype, shape, raw in inputs
        ]
    }
    head = orjson.dumps(header)
    return head + b"".join(raw for *_, raw in inputs), str(len(head))


def _ids(name: str, values: list[int] | np.ndarray, datatype: str = "INT64") -> Tensor:
    array = np.asarray(values, dtype="<i8" if datatype == "INT64" else "<u8")
    return name, datatype, [len(array)], array.tobytes()


def _floats(name: str, values: np.ndarray, shape: list[Any]) -> Tensor:
    return name, "FP32", shape, np.asarray(values, dtype="<f4").tobytes()


def _random_inputs(batch: int, rng: np.random.Generator, datatype: str) -> list[Tensor]:
    high = 2**64 if datatype == "UINT64" else 2**63
    inputs = [
        _ids(f"C{i}", rng.integers(0, high, batch, dtype=np.uint64), datatype) for i in range(1, 6)
    ]
    inputs.append(_floats("dense", rng.standard_normal((batch, 6)), [batch, 6]))
    age = rng.standard_normal(batch)
    inputs.append(_floats("age", age, [batch] if rng.random() < 0.5 else [batch, 1]))
    return inputs


def _outcome(signature: FeatureSignature, inputs: list[Tensor], *, eager: bool) -> Any:
    body, header_length = _binary_body(inputs, eager=eager)
    try:
        request = http_decode.decode_http_request(body, header_length)
        kind = lazy_tensors.BinaryTensors if not eager else dict
        assert type(request.inputs) is kind
        return tensors.tensors_to_batch(signature, request.inputs, max_batch_size=MAX_BATCH)
    except RecserveError as error:
        return error


def _fast_path_taken(signature: FeatureSignature, inputs: list[Tensor]) -> bool:
    body, header_length = _binary_body(inputs)
    lazy = http_decode.decode_http_request(body, header_length).inputs
    assert isinstance(lazy, lazy_tensors.BinaryTensors)
    return fast_batch.batch_from_binary(signature, lazy, MAX_BATCH) is not None


def _assert_same_outcome(signature: FeatureSignature, inputs: list[Tensor]) -> Any:
    expected = _outcome(signature, inputs, eager=True)
    got = _outcome(signature, inputs, eager=False)
    if isinstance(expected, Exception):
        assert type(got) is type(expected), (got, expected)
        assert str(got) == str(expected)
        return got
    assert isinstance(got, Batch), got
    assert got.equals(expected) and expected.equals(got)
    assert got.num_ids == expected.num_ids
    for feature in (*got.id_type_features, *got.non_id_type_features):
        array = feature.values if hasattr(feature, "values") else feature.data
        assert not array.flags.writeable and array.dtype.isnative
    return got


@pytest.mark.parametrize("datatype", ["INT64", "UINT64"])
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_random_valid_requests_take_the_fast_path_and_equal_the_eager_batch(datatype, batch):
    rng = np.random.default_rng([batch, len(datatype)])
    for _ in range(10):
        inputs = _random_inputs(batch, rng, datatype)
        assert _fast_path_taken(SINGLE, inputs)
        _assert_same_outcome(SINGLE, inputs)
        rng.shuffle(inputs)  # not side by side in signature order: one concatenation
        assert _fast_path_taken(SINGLE, inputs)
        _assert_same_outcome(SINGLE, inputs)


def test_the_fast_batch_holds_the_request_values_without_copying_them():
    inputs = [_ids(f"C{i}", [i, 2**63 - 1 - i]) for i in range(1, 6)]
    inputs.append(_floats("dense", np.arange(12).reshape(2, 6), [2, 6]))
    inputs.append(_floats("age", np.array([30, 40.25]), [2]))
    body, header_length = _binary_body(inputs)
    request = http_decode.decode_http_request(body, header_length)
    batch = tensors.tensors_to_batch(SINGLE, request.inputs, max_batch_size=MAX_BATCH)
    assert all(isinstance(f, IDTypeFeatureWithSingleID) for f in batch.id_type_features)
    assert batch.id_feature("C3").values.tolist() == [3, 2**63 - 4]
    assert batch.non_id_feature("age").data.tolist() == [[30.0], [40.25]]
    assert batch.num_ids == 10
    rows = batch._single_id_rows
    assert rows is not None and rows.shape == (5, 2)
    assert np.shares_memory(rows, np.frombuffer(body, np.uint8))  # a view of the body


@pytest.mark.parametrize(
    "change",
    [
        "negative id",
        "mixed id datatypes",
        "id datatype FP32",
        "short id bytes",
        "ids of another batch size",
        "bool in shape",
        "dense datatype INT64",
        "dense shape",
        "dense bytes",
        "non-finite dense value",
        "missing input",
        "unknown input",
        "too large a batch",
    ],
)
def test_unusual_requests_fall_back_and_match_the_eager_outcome(change):
    inputs = [_ids(f"C{i}", [i, i + 1]) for i in range(1, 6)]
    inputs += [_floats("dense", np.ones((2, 6)), [2, 6]), _floats("age", np.ones(2), [2])]
    if change == "negative id":
        inputs[1] = _ids("C2", [4, -1])
    elif change == "mixed id datatypes":
        inputs[2] = _ids("C3", [4, 5], "UINT64")
    elif change == "id datatype FP32":
        inputs[0] = ("C1", "FP32", [2], np.ones(2, "<f4").tobytes())
    elif change == "short id bytes":
        inputs[0] = ("C1", "INT64", [2], np.ones(1, "<i8").tobytes())
    elif change == "ids of another batch size":
        inputs[4] = _ids("C5", [1, 2, 3])
    elif change == "bool in shape":
        inputs[0] = ("C1", "INT64", [True], np.ones(1, "<i8").tobytes())
    elif change == "dense datatype INT64":
        inputs[5] = ("dense", "INT64", [2, 6], np.ones(12, "<i8").tobytes())
    elif change == "dense shape":
        inputs[5] = _floats("dense", np.ones((2, 6)), [12])
    elif change == "dense bytes":
        inputs[5] = ("dense", "FP32", [2, 6], np.ones(11, "<f4").tobytes())
    elif change == "non-finite dense value":
        inputs[6] = _floats("age", np.array([1.0, np.nan]), [2])
    elif change == "missing input":
        del inputs[6]
    elif change == "unknown input":
        inputs.append(_ids("C9", [1, 2]))
    elif change == "too large a batch":
        inputs = [_ids(f"C{i}", range(MAX_BATCH + 1)) for i in range(1, 6)]
        inputs += [
            _floats("dense", np.ones((MAX_BATCH + 1, 6)), [MAX_BATCH + 1, 6]),
            _floats("age", np.ones(MAX_BATCH + 1), [MAX_BATCH + 1]),
        ]
    assert not _fast_path_taken(SINGLE, inputs)
    outcome = _assert_same_outcome(SINGLE, inputs)
    # The general path accepts mixed ID datatypes (both listed in the model's metadata); dense
    # data must be FP32, as the metadata says (INT64 bytes are not FP32 numbers).
    accepted = change == "mixed id datatypes"
    assert isinstance(outcome, Batch if accepted else RecserveError), outcome


def test_jagged_signatures_take_the_general_path():
    inputs = [
        _ids("user", [1, 2]),
        _ids("history", [5, 6, 7]),
        ("history.lengths", "INT64", [2], np.array([1, 2], "<i8").tobytes()),
        _floats("dense", np.ones((2, 2)), [2, 2]),
    ]
    assert not _fast_path_taken(JAGGED, inputs)
    batch = _assert_same_outcome(JAGGED, inputs)
    assert batch.id_feature("history").lengths.tolist() == [1, 2]


def test_a_malformed_input_raises_the_eager_error_on_first_touch():
    inputs = [("a", "INT64", [3], np.ones(2, "<i8").tobytes()), ("b", "NOPE", [1], b"x")]
    body, header_length = _binary_body(inputs)
    lazy = http_decode.decode_http_request(body, header_length).inputs
    assert isinstance(lazy, lazy_tensors.BinaryTensors)
    with pytest.raises(InvalidArgumentError) as error:
        lazy["b"]
    assert str(error.value) == (
        "input 'a': shape [3] of INT64 needs 24 bytes but binary_data_size has 16"
    )


@pytest.mark.parametrize(
    ("tail", "message"),
    [
        (b"extra", "5 bytes of binary tensor data are not claimed by any input"),
        (None, "input 'a': binary_data_size 16 runs past the end of the body (8 bytes left)"),
    ],
)
def test_layout_errors_are_raised_by_the_decoder_as_before(tail, message):
    body, header_length = _binary_body([_ids("a", [1, 2])])
    body = body + tail if tail is not None else body[:-8]
    with pytest.raises(InvalidArgumentError) as error:
        http_decode.decode_http_request(body, header_length)
    assert str(error.value) == message


def test_a_bad_output_request_reports_the_first_bad_input_first():
    inputs = [("a", "NOPE", [1], b"x")]
    header = {
        "inputs": [
            {"name": "a", "datatype": "NOPE", "shape": [1], "parameters": {"binary_data_size": 1}}
        ],
        "outputs": "not a list",
    }
    head = orjson.dumps(header)
    with pytest.raises(InvalidArgumentError) as error:
        http_decode.decode_http_request(head + inputs[0][3], str(len(head)))
    assert "unknown datatype 'NOPE'" in str(error.value)
