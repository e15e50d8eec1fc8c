"""Plain JSON infer bodies: lazy JsonTensors, the fast JSON batch builder, trusted batches and
the dynamic batcher's merge.

The reference everywhere is the eager decoder: a JSON body sent with an
``Inference-Header-Content-Length`` covering all of it takes the eager decode loop (a dict of
arrays) and then the general path of ``tensors_to_batch``. The fast path must give an equal
Batch, or exactly the same exception type and message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest

from embedding_store.batch import (
    Batch,
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    NonIDTypeFeature,
)
from embedding_store.errors import BatchValidationError, InvalidArgumentError
from embedding_store.signature import FeatureSignature, IdFeatureSpec, NonIdFeatureSpec
from serving import fast_batch, http_decode, infer_request, lazy_tensors, tensors
from serving.batcher import merge_batches
from serving.json_arrays import LARGE_BODY_BYTES
from tests.unit.fast_path_signatures import MAX_BATCH, SINGLE

#: Single-ID and jagged features interleaved, and dense ones.
JAGGED = FeatureSignature(
    id_features=(
        IdFeatureSpec("user", True),
        IdFeatureSpec("history", False),
        IdFeatureSpec("item", True),
        IdFeatureSpec("tags", False),
    ),
    non_id_features=(
        NonIdFeatureSpec("dense", "float32", (2, 3)),
        NonIdFeatureSpec("age", "float32", (1,)),
    ),
)

SIGNATURES = {"single": SINGLE, "jagged": JAGGED}


# --------------------------------------------------------------------------- request helpers
def _tensor(name: str, datatype: str, shape: list[Any], data: Any) -> dict[str, Any]:
    return {"name": name, "shape": shape, "datatype": datatype, "data": data}


def _random_inputs(
    signature: FeatureSignature, batch: int, rng: np.random.Generator
) -> list[dict[str, Any]]:
    """Valid JSON tensors for ``signature``: INT64 or UINT64 IDs (some at the edges of
    [0, 2**63)), INT32 or INT64 lengths, FP32 data as floats or ints, [B] for sample (1,)."""
    inputs = []

    def ids(count: int) -> list[int]:
        values = rng.integers(0, 2**62, size=count).tolist()
        if count and rng.random() < 0.5:
            values[int(rng.integers(count))] = int(rng.choice([0, 1, 2**63 - 1, 2**63 - 2]))
        return values

    for feature in signature.id_features:
        datatype = str(rng.choice(["INT64", "UINT64"]))
        if feature.single_id:
            inputs.append(_tensor(feature.name, datatype, [batch], ids(batch)))
            continue
        lengths = rng.integers(0, 4, size=batch).tolist()
        total = int(sum(lengths))
        inputs.append(_tensor(feature.name, datatype, [total], ids(total)))
        lengths_type = str(rng.choice(["INT32", "INT64"]))
        inputs.append(_tensor(feature.name + ".lengths", lengths_type, [batch], lengths))
    for spec in signature.non_id_features:
        size = batch * int(np.prod(spec.sample_shape))
        if rng.random() < 0.3:
            data: list[Any] = rng.integers(-1000, 1000, size=size).tolist()  # ints for FP32
        else:
            data = (rng.standard_normal(size) * 100).tolist()
        shape = [batch, *spec.sample_shape]
        if spec.sample_shape == (1,) and rng.random() < 0.5:
            shape = [batch]
        inputs.append(_tensor(spec.name, "FP32", shape, data))
    return inputs


def _body(inputs: list[dict[str, Any]], **extra: Any) -> bytes:
    return orjson.dumps({"inputs": inputs, **extra})


def _eager_batch(signature: FeatureSignature, body: bytes, max_batch_size: int) -> Batch:
    """What the code before JsonTensors did: eager decoding (a JSON body whose
    Inference-Header-Content-Length covers all of it) and the general path."""
    request = http_decode.decode_http_request(body, str(len(body)))
    assert type(request.inputs) is dict
    return tensors.tensors_to_batch(signature, request.inputs, max_batch_size=max_batch_size)


def _lazy_batch(signature: FeatureSignature, body: bytes, max_batch_size: int) -> Batch:
    request = http_decode.decode_http_request(body)
    assert isinstance(request.inputs, lazy_tensors.JsonTensors)
    return tensors.tensors_to_batch(signature, request.inputs, max_batch_size=max_batch_size)


def _outcome(build: Callable[[], Batch]) -> Batch | Exception:
    try:
        return build()
    except Exception as error:  # the comparison is the point
        return error


def _fast_path_taken(signature: FeatureSignature, body: bytes, max_batch_size: int) -> bool:
    inputs = http_decode.decode_http_request(body).inputs
    assert isinstance(inputs, lazy_tensors.JsonTensors)
    return fast_batch.batch_from_json(signature, inputs.raw_entries, max_batch_size) is not None


def _assert_read_only(array: np.ndarray) -> None:
    assert not array.flags.writeable
    assert array.flags.c_contiguous and array.flags.aligned and array.dtype.isnative


def _assert_batches_equal(got: Batch, expected: Batch) -> None:
    assert got.equals(expected)  # kinds, names, order, dtypes, shapes, bytes, flags
    assert got.batch_size == expected.batch_size >= 1
    assert got.requires_grad is False and got.labels == ()
    assert got.meta is None and got.batch_id is None
    for feature in got.id_type_features:
        assert got.id_feature(feature.name) is feature
        assert feature.values.dtype == np.uint64
        _assert_read_only(feature.values)
        if isinstance(feature, IDTypeFeature):
            assert feature.lengths.dtype == np.int64
            _assert_read_only(feature.lengths)
    for feature in got.non_id_type_features:
        assert got.non_id_feature(feature.name) is feature
        assert feature.data.dtype == np.float32
        _assert_read_only(feature.data)


def _assert_same_outcome(
    signature: FeatureSignature, body: bytes, max_batch_size: int = MAX_BATCH
) -> Batch | Exception:
    expected = _outcome(lambda: _eager_batch(signature, body, max_batch_size))
    got = _outcome(lambda: _lazy_batch(signature, body, max_batch_size))
    _assert_outcomes_equal(got, expected)
    return got


def _assert_outcomes_equal(got: Batch | Exception, expected: Batch | Exception) -> None:
    """Equal batches, or exceptions of the same type and message."""
    if isinstance(expected, Exception):
        assert type(got) is type(expected), (got, expected)
        assert str(got) == str(expected)
    else:
        assert isinstance(got, Batch), got
        _assert_batches_equal(got, expected)


def _request_options(request: infer_request.InferRequest) -> tuple[Any, ...]:
    """Everything a decoded request holds besides its inputs."""
    return (request.id, request.parameters, request.outputs, request.binary_output, request.timeout)


# --------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("name", sorted(SIGNATURES))
@pytest.mark.parametrize("batch", [1, 2, 64])
def test_random_valid_requests_take_the_fast_path_and_equal_the_eager_batch(name, batch):
    signature = SIGNATURES[name]
    rng = np.random.default_rng([batch, len(name)])
    for _ in range(25):
        body = _body(_random_inputs(signature, batch, rng))
        assert _fast_path_taken(signature, body, MAX_BATCH)
        _assert_same_outcome(signature, body)


def test_the_fast_batch_holds_the_request_values():
    inputs = [
        _tensor("C1", "INT64", [2], [0, 2**63 - 1]),
        _tensor("C2", "UINT64", [2], [5, 6]),
        _tensor("C3", "INT64", [2], [7, 8]),
        _tensor("C4", "UINT64", [2], [2**63 - 1, 0]),
        _tensor("C5", "INT64", [2], [9, 10]),
        _tensor("dense", "FP32", [2, 6], [1, 2, 3, 4, 5, 6, 0.5, 1.5, 2.5, 3.5, 4.5, 5.5]),
        _tensor("age", "FP32", [2], [30, 40.25]),
    ]
    body = _body(inputs)
    assert _fast_path_taken(SINGLE, body, MAX_BATCH)
    batch = _assert_same_outcome(SINGLE, body)
    assert isinstance(batch, Batch)
    assert batch.id_feature_names == ("C1", "C2", "C3", "C4", "C5")
    assert batch.id_feature("C1").values.tolist() == [0, 2**63 - 1]
    assert batch.id_feature("C4").values.tolist() == [2**63 - 1, 0]
    assert all(isinstance(f, IDTypeFeatureWithSingleID) for f in batch.id_type_features)
    assert batch.non_id_feature("dense").data.shape == (2, 6)
    assert batch.non_id_feature("age").data.tolist() == [[30.0], [40.25]]


def test_inputs_in_another_order_than_the_signature():
    rng = np.random.default_rng(7)
    for name, signature in SIGNATURES.items():
        inputs = _random_inputs(signature, 3, rng)
        rng.shuffle(inputs)
        body = _body(inputs)
        assert _fast_path_taken(signature, body, MAX_BATCH), name
        _assert_same_outcome(signature, body)


@pytest.mark.parametrize(
    "values",
    [
        [2**63],  # UINT64 only: numpy reads it as uint64
        [2**63 + 5, 2**64 - 1],
        [1, 2**63 + 1],  # numpy reads ints from both sides of 2**63 as float64
    ],
)
def test_uint64_ids_from_2_63_up_fall_back_and_stay_exact(values):
    batch = len(values)
    rng = np.random.default_rng(3)
    inputs = _random_inputs(SINGLE, batch, rng)
    inputs[1] = _tensor("C2", "UINT64", [batch], values)
    body = _body(inputs)
    assert not _fast_path_taken(SINGLE, body, MAX_BATCH)
    got = _assert_same_outcome(SINGLE, body)
    assert isinstance(got, Batch)
    assert got.id_feature("C2").values.tolist() == values


@pytest.mark.parametrize(
    ("name", "tensor"),
    [
        # The general path takes these too; the fast one leaves them to it.
        ("nested dense data", _tensor("dense", "FP32", [1, 6], [[1, 2, 3, 4, 5, 6]])),
        ("FP64 dense", _tensor("dense", "FP64", [1, 6], [1.0, 2, 3, 4, 5, 6])),
        ("INT32 dense", _tensor("dense", "INT32", [1, 6], [1, 2, 3, 4, 5, 6])),
        ("nested ID data", _tensor("C2", "INT64", [1], [[4]])),
        ("ID shape with a float", _tensor("C2", "INT64", [1.0], [4])),
        ("UINT64 given as float", _tensor("C2", "UINT64", [1], [4.0])),
    ],
)
def test_unusual_requests_fall_back_to_the_general_path(name, tensor):
    inputs = _random_inputs(SINGLE, len(tensor["data"]), np.random.default_rng(11))
    position = next(i for i, t in enumerate(inputs) if t["name"] == tensor["name"])
    inputs[position] = tensor
    body = _body(inputs)
    assert not _fast_path_taken(SINGLE, body, MAX_BATCH)
    _assert_same_outcome(SINGLE, body)


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (_tensor("C2", "INT64", [2], [4, True]), "input 'C2': INT64 data must be numbers"),
        (_tensor("C2", "INT64", [2], [True, 4]), "input 'C2': INT64 data must be numbers"),
        (_tensor("C1", "UINT64", [2], [True, False]), "input 'C1': UINT64 data must be numbers"),
        (_tensor("C3", "INT64", [1], [True]), "input 'C3': INT64 data must be numbers"),
        (_tensor("age", "FP32", [2], [0.5, False]), "input 'age': FP32 data must be numbers"),
        (_tensor("dense", "FP32", [1, 6], [[1, 2, 3, [True], 5, 6]]), "input 'dense': FP32"),
    ],
)
def test_true_and_false_among_numbers_are_refused(tensor, message):
    # numpy reads [4, true] as int64 [4, 1] and the fast path as 4 and 1: a client that sent
    # a boolean by mistake would get an answer for ID 1.
    inputs = _random_inputs(SINGLE, len(tensor["data"]), np.random.default_rng(12))
    by_name = {t["name"]: i for i, t in enumerate(inputs)}
    inputs[by_name[tensor["name"]]] = tensor
    with pytest.raises(InvalidArgumentError, match=re.escape(message)) as caught:
        http_decode.decode_http_request(_body(inputs))
    assert "true/false" in str(caught.value)


def test_true_and_false_outside_numeric_data_are_left_alone():
    # The check runs only when the body holds a literal true/false, and looks only at data.
    inputs = _random_inputs(SINGLE, 2, np.random.default_rng(13))
    body = orjson.dumps(
        {"inputs": inputs, "parameters": {"binary_data_output": False}, "id": "true false"}
    )
    request = http_decode.decode_http_request(body)
    assert request.binary_output is False
    assert isinstance(tensors.tensors_to_batch(SINGLE, request.inputs, max_batch_size=8), Batch)


# --------------------------------------------------------------------------- errors
def _with(
    signature: FeatureSignature, batch: int, *replacements: dict[str, Any], drop: str = ""
) -> bytes:
    inputs = _random_inputs(signature, batch, np.random.default_rng(5))
    by_name = {t["name"]: i for i, t in enumerate(inputs)}
    for tensor in replacements:
        if tensor["name"] in by_name:
            inputs[by_name[tensor["name"]]] = tensor
        else:
            inputs.append(tensor)
    return _body([t for t in inputs if t["name"] != drop])


ERRORS: list[tuple[str, str, bytes, type[Exception], str | None]] = [
    (
        "negative INT64 ID",
        "single",
        _with(SINGLE, 1, _tensor("C2", "INT64", [1], [-3])),
        InvalidArgumentError,
        "input 'C2': IDs must be non-negative, got -3 at position 0",
    ),
    (
        "negative UINT64 ID",
        "single",
        _with(SINGLE, 1, _tensor("C2", "UINT64", [1], [-3])),
        InvalidArgumentError,
        "input 'C2': value -3 is out of range for UINT64",
    ),
    (
        "float ID",
        "single",
        _with(SINGLE, 1, _tensor("C3", "INT64", [1], [1.5])),
        InvalidArgumentError,
        "input 'C3': INT64 data must be integers within its range",
    ),
    (
        "float ID after an int",
        "single",
        _with(SINGLE, 2, _tensor("C3", "INT64", [2], [4, 2.5])),
        InvalidArgumentError,
        "input 'C3': INT64 data must be integers within its range",
    ),
    (
        "string ID after an int",
        "single",
        _with(SINGLE, 2, _tensor("C3", "INT64", [2], [4, "5"])),
        InvalidArgumentError,
        None,
    ),
    (
        "INT64 ID from 2**63",
        "single",
        _with(SINGLE, 1, _tensor("C1", "INT64", [1], [2**63])),
        InvalidArgumentError,
        "input 'C1': value 9223372036854775808 is out of range for INT64",
    ),
    (
        "ID shape [B, 1]",
        "single",
        _with(SINGLE, 1, _tensor("C4", "INT64", [1, 1], [4])),
        InvalidArgumentError,
        "input 'C4': IDs must be 1-D, got shape [1, 1]",
    ),
    (
        "ID shape [true]",
        "single",
        _with(SINGLE, 1, _tensor("C4", "INT64", [True], [4])),
        InvalidArgumentError,
        None,
    ),
    (
        "ID shape not a list",
        "single",
        _with(SINGLE, 1, _tensor("C4", "INT64", 1, [4])),
        InvalidArgumentError,
        None,
    ),
    (
        "ID data length",
        "single",
        _with(SINGLE, 1, _tensor("C5", "INT64", [1], [4, 5])),
        InvalidArgumentError,
        "input 'C5': shape [1] has 1 elements but data has 2",
    ),
    (
        "ID batch size differs",
        "single",
        _with(SINGLE, 1, _tensor("C5", "INT64", [2], [4, 5])),
        InvalidArgumentError,
        None,
    ),
    (
        "ID data not a list",
        "single",
        _with(SINGLE, 1, _tensor("C5", "INT64", [1], 4)),
        InvalidArgumentError,
        None,
    ),
    (
        "ID data of strings",
        "single",
        _with(SINGLE, 1, _tensor("C5", "INT64", [1], ["4"])),
        InvalidArgumentError,
        None,
    ),
    (
        "ID data with a null",
        "single",
        _with(SINGLE, 2, _tensor("C5", "INT64", [2], [4, None])),
        InvalidArgumentError,
        None,
    ),
    (
        "ID data ragged",
        "single",
        _with(SINGLE, 2, _tensor("C5", "INT64", [2], [4, [5]])),
        InvalidArgumentError,
        None,
    ),
    (
        "missing input",
        "single",
        _with(SINGLE, 1, drop="C3"),
        InvalidArgumentError,
        "missing input(s) ['C3']; the model takes ['C1', 'C2', 'C3', 'C4', 'C5', 'age', 'dense']",
    ),
    (
        "unknown input",
        "single",
        _with(SINGLE, 1, _tensor("C9", "INT64", [1], [4])),
        InvalidArgumentError,
        None,
    ),
    (
        "ID datatype FP32",
        "single",
        _with(SINGLE, 1, _tensor("C1", "FP32", [1], [4.0])),
        InvalidArgumentError,
        "input 'C1': IDs must be INT64 or UINT64, got FP32",
    ),
    (
        "ID datatype INT32",
        "single",
        _with(SINGLE, 1, _tensor("C1", "INT32", [1], [4])),
        InvalidArgumentError,  # only the datatypes the model's metadata lists
        "input 'C1': IDs must be INT64 or UINT64, got INT32",
    ),
    (
        "ID datatype BYTES",
        "single",
        _with(SINGLE, 1, _tensor("C1", "BYTES", [1], ["a"])),
        InvalidArgumentError,
        None,
    ),
    (
        "ID datatype missing",
        "single",
        _with(SINGLE, 1, {"name": "C1", "shape": [1], "data": [4]}),
        InvalidArgumentError,
        None,
    ),
    (
        "dense datatype BOOL",
        "single",
        _with(SINGLE, 1, _tensor("age", "BOOL", [1], [True])),
        InvalidArgumentError,
        None,
    ),
    (
        "dense shape",
        "single",
        _with(SINGLE, 1, _tensor("dense", "FP32", [1, 3, 2], [1.0] * 6)),
        InvalidArgumentError,
        None,
    ),
    (
        "dense shape [B] for a sample shape (6,)",
        "single",
        _with(SINGLE, 1, _tensor("dense", "FP32", [6], [1.0] * 6)),
        InvalidArgumentError,
        None,
    ),
    (
        # [B] is accepted for a sample shape (1,) only: for (6,) it is a shape that does not
        # match its data, whatever the data's length.
        "dense shape [B] with B * 6 values for a sample shape (6,)",
        "single",
        _with(SINGLE, 1, _tensor("dense", "FP32", [1], [1.0] * 6)),
        InvalidArgumentError,
        "input 'dense': shape [1] has 1 elements but data has 6",
    ),
    (
        "dense shape with a bool",
        "single",
        _with(SINGLE, 1, _tensor("age", "FP32", [1, True], [1.0])),
        InvalidArgumentError,
        None,
    ),
    (
        "dense data length",
        "single",
        _with(SINGLE, 1, _tensor("dense", "FP32", [1, 6], [1.0] * 5)),
        InvalidArgumentError,
        None,
    ),
    (
        "dense batch size differs",
        "single",
        _with(SINGLE, 1, _tensor("dense", "FP32", [2, 6], [1.0] * 12)),
        InvalidArgumentError,
        None,
    ),
    (
        "dense strings",
        "single",
        _with(SINGLE, 1, _tensor("age", "FP32", [1], ["1.5"])),
        InvalidArgumentError,
        None,
    ),
    (
        "empty batch",
        "single",
        _body(
            [_tensor(f"C{i}", "INT64", [0], []) for i in range(1, 6)]
            + [_tensor("dense", "FP32", [0, 6], []), _tensor("age", "FP32", [0, 1], [])]
        ),
        InvalidArgumentError,
        "the request has an empty batch (batch size 0)",
    ),
    (
        "batch over the maximum",
        "single",
        _with(SINGLE, MAX_BATCH + 1),
        InvalidArgumentError,
        f"batch size {MAX_BATCH + 1} exceeds this server's max batch size {MAX_BATCH}",
    ),
    (
        "lengths do not sum to the IDs",
        "jagged",
        _with(
            JAGGED,
            2,
            _tensor("history", "INT64", [1], [4]),
            _tensor("history.lengths", "INT64", [2], [1, 1]),
        ),
        InvalidArgumentError,
        "input 'history.lengths' sums to 2 but 'history' has 1 IDs",
    ),
    (
        # [true] == [1] in Python, but shape_of refuses bools (the batch size comes from the
        # single-ID inputs here, so only the lengths' own check sees it).
        "lengths shape [true]",
        "jagged",
        _with(
            JAGGED,
            1,
            _tensor("history", "INT64", [1], [4]),
            _tensor("history.lengths", "INT64", [True], [1]),
        ),
        InvalidArgumentError,
        None,
    ),
    (
        "lengths sum to fewer than the IDs",
        "jagged",
        _with(
            JAGGED,
            2,
            _tensor("history", "INT64", [3], [4, 5, 6]),
            _tensor("history.lengths", "INT64", [2], [1, 1]),
        ),
        InvalidArgumentError,
        "input 'history.lengths' sums to 2 but 'history' has 3 IDs",
    ),
    (
        "negative length",
        "jagged",
        _with(
            JAGGED,
            2,
            _tensor("history", "INT64", [1], [4]),
            _tensor("history.lengths", "INT64", [2], [2, -1]),
        ),
        InvalidArgumentError,
        "input 'history.lengths': lengths must be non-negative",
    ),
    (
        "INT32 length out of range",
        "jagged",
        _with(JAGGED, 1, _tensor("history.lengths", "INT32", [1], [2**31])),
        InvalidArgumentError,
        None,
    ),
    (
        "lengths batch size differs",
        "jagged",
        _with(
            JAGGED,
            2,
            _tensor("history", "INT64", [3], [4, 5, 6]),
            _tensor("history.lengths", "INT64", [3], [1, 1, 1]),
        ),
        InvalidArgumentError,
        None,
    ),
    (
        "negative jagged ID",
        "jagged",
        _with(
            JAGGED,
            1,
            _tensor("tags", "INT64", [1], [-1]),
            _tensor("tags.lengths", "INT64", [1], [1]),
        ),
        InvalidArgumentError,
        None,
    ),
    (
        "missing lengths",
        "jagged",
        _with(JAGGED, 1, drop="tags.lengths"),
        InvalidArgumentError,
        "missing input(s) ['tags.lengths']; the model takes ['age', 'dense', 'history', "
        "'history.lengths', 'item', 'tags', 'tags.lengths', 'user']",
    ),
    (
        "jagged batch over the maximum",
        "jagged",
        _with(JAGGED, MAX_BATCH + 3),
        InvalidArgumentError,
        None,
    ),
    (
        # numpy's int64 sum of these wraps around to 0, the number of IDs: trusted, the
        # batch crashed the server (a segmentation fault in the embedding lookup).
        "lengths whose int64 sum wraps around",
        "jagged",
        _with(
            JAGGED,
            4,
            _tensor("tags", "INT64", [0], []),
            _tensor("tags.lengths", "INT64", [4], [2**62] * 4),
        ),
        InvalidArgumentError,
        "input 'tags.lengths' sums to 18446744073709551616 but 'tags' has 0 IDs",
    ),
    (
        "lengths whose int64 sum wraps around to the number of IDs",
        "jagged",
        _with(
            JAGGED,
            3,
            _tensor("tags", "UINT64", [1], [7]),
            _tensor("tags.lengths", "INT64", [3], [2**63 - 1, 2**63 - 1, 3]),
        ),
        InvalidArgumentError,
        "input 'tags.lengths' sums to 18446744073709551617 but 'tags' has 1 IDs",
    ),
]


@pytest.mark.parametrize(
    ("name", "signature", "body", "error", "message"), ERRORS, ids=[e[0] for e in ERRORS]
)
def test_requests_the_fast_path_refuses_give_the_eager_outcome(
    name, signature, body, error, message
):
    signature = SIGNATURES[signature]
    assert not _fast_path_taken(signature, body, MAX_BATCH)
    got = _assert_same_outcome(signature, body)
    if error is None:
        assert isinstance(got, Batch)
        return
    assert type(got) is error
    if message is not None:  # the message the code before JsonTensors gave, verbatim
        assert str(got) == message


def test_an_empty_batch_of_jagged_features_only_is_refused() -> None:
    """With no single-ID or dense input, the batch size is the lengths' shape: 0 is an empty
    batch, refused as the general path refuses it."""
    signature = FeatureSignature(id_features=(IdFeatureSpec("history", False),), non_id_features=())
    body = _body(
        [
            _tensor("history", "INT64", [0], []),
            _tensor("history.lengths", "INT32", [0], []),
        ]
    )
    assert not _fast_path_taken(signature, body, MAX_BATCH)
    got = _assert_same_outcome(signature, body)
    assert type(got) is InvalidArgumentError
    assert str(got) == "the request has an empty batch (batch size 0)"


def test_a_float64_dense_feature_gets_the_general_paths_float64_batch() -> None:
    """The fast builder makes float32 arrays: a signature whose dense feature is float64 is
    left to the general path, which converts the FP32 input to the feature's dtype."""
    signature = FeatureSignature(
        id_features=(IdFeatureSpec("user", True), IdFeatureSpec("item", True)),
        non_id_features=(NonIdFeatureSpec("dense", "float64", (2,)),),
    )
    body = _body(
        [
            _tensor("user", "INT64", [2], [1, 2]),
            _tensor("item", "INT64", [2], [3, 4]),
            _tensor("dense", "FP32", [2, 2], [0.5, 1.5, 2.5, 3.5]),
        ]
    )
    assert not _fast_path_taken(signature, body, MAX_BATCH)
    got = _lazy_batch(signature, body, MAX_BATCH)
    assert got.non_id_feature("dense").data.dtype == np.float64
    assert got.non_id_feature("dense").data.tolist() == [[0.5, 1.5], [2.5, 3.5]]
    assert got.equals(_eager_batch(signature, body, MAX_BATCH))


# Neither path warns: numpy's overflow warning on the float32 cast would add a log line per
# such request (serving.infer_request silences it; the refusal names the input).
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_dense_value_beyond_fp32_is_refused_by_the_fast_path_too() -> None:
    """JSON has no NaN: a number beyond FP32's range is what becomes Inf. The fast builder
    must not take it, so the general path names the input and the first bad sample."""
    body = _with(SINGLE, 2, _tensor("age", "FP32", [2], [1.5, 1e300]))
    assert not _fast_path_taken(SINGLE, body, MAX_BATCH)
    got = _assert_same_outcome(SINGLE, body)
    assert type(got) is InvalidArgumentError
    assert str(got) == (
        "input 'age' has 1 non-finite value(s) (NaN, Inf, or beyond FP32's range of "
        "+-3.4e38), the first at sample 1, position [0]"
    )


@pytest.mark.parametrize(
    "inputs",
    [
        # A malformed tensor before a name given twice: the eager loop raised the former.
        [_tensor("a", "INT64", [2], [1]), _tensor("b", "INT64", [1], [1])] * 2,
        # ... before a nameless input.
        [_tensor("a", "FP32", [1], ["x"]), {"shape": [1]}],
        # ... before an input without data.
        [_tensor("a", "INT64", [1], [1.5]), {"name": "b", "shape": [1], "datatype": "INT64"}],
        # A name given twice, everything else fine.
        [_tensor("a", "INT64", [1], [1])] * 2,
        # An input with parameters takes the eager loop.
        [{**_tensor("a", "INT64", [1], [1.5]), "parameters": {}}],
    ],
)
def test_decode_errors_are_raised_by_decode_as_before(inputs):
    body = _body(inputs)
    with pytest.raises(InvalidArgumentError) as expected:
        http_decode.decode_http_request(body, str(len(body)))
    with pytest.raises(InvalidArgumentError) as got:
        http_decode.decode_http_request(body)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize(
    "extra",
    [
        {"outputs": [{"name": "p", "parameters": {"binary_data": 1}}]},
        {"outputs": "prediction"},
        {"parameters": {"timeout": -1}},
    ],
)
def test_a_malformed_tensor_still_wins_over_later_request_errors(extra):
    body = _body([_tensor("a", "INT64", [1], [1.5])], **extra)
    with pytest.raises(InvalidArgumentError) as expected:
        http_decode.decode_http_request(body, str(len(body)))
    with pytest.raises(InvalidArgumentError) as got:
        http_decode.decode_http_request(body)
    assert (
        str(got.value)
        == str(expected.value)
        == ("input 'a': INT64 data must be integers within its range")
    )
    valid = _body([_tensor("a", "INT64", [1], [1])], **extra)
    with pytest.raises(InvalidArgumentError) as expected:
        http_decode.decode_http_request(valid, str(len(valid)))
    with pytest.raises(InvalidArgumentError) as got:
        http_decode.decode_http_request(valid)
    assert str(got.value) == str(expected.value)


def test_request_options_are_decoded_as_before():
    body = _body(
        [_tensor("a", "INT64", [1], [1])],
        id="r7",
        parameters={"timeout": 1500, "binary_data_output": True},
        outputs=[{"name": "prediction", "parameters": {"binary_data": False}}],
    )
    lazy = http_decode.decode_http_request(body)
    eager = http_decode.decode_http_request(body, str(len(body)))
    assert isinstance(lazy.inputs, lazy_tensors.JsonTensors)
    assert _request_options(lazy) == _request_options(eager)


# --------------------------------------------------------------------------- JsonTensors
def _mapping_body() -> bytes:
    return _body(
        [
            _tensor("zeta", "INT64", [1], [3]),
            _tensor("alpha", "UINT64", [2], [4, 5]),
            _tensor("mid", "FP32", [1, 2], [[0.5, 1.5]]),
            _tensor("small", "INT8", [1], [-7]),
        ]
    )


def test_json_tensors_behave_like_the_eager_dict():
    body = _mapping_body()
    lazy = http_decode.decode_http_request(body).inputs
    eager = http_decode.decode_http_request(body, str(len(body))).inputs
    assert isinstance(lazy, lazy_tensors.JsonTensors) and type(eager) is dict
    assert list(lazy) == list(eager) == ["zeta", "alpha", "mid", "small"]
    assert list(lazy.keys()) == list(eager.keys())
    assert len(lazy) == 4
    assert "alpha" in lazy and "nope" not in lazy and 5 not in lazy
    assert lazy.get("nope") is None and lazy.get("nope", 1) == 1
    with pytest.raises(KeyError):
        lazy["nope"]
    for (name, array), (eager_name, eager_array) in zip(lazy.items(), eager.items(), strict=True):
        assert name == eager_name
        assert array.dtype == eager_array.dtype and array.shape == eager_array.shape
        np.testing.assert_array_equal(array, eager_array)
        assert lazy[name] is array and lazy.get(name) is array  # converted once, cached
    assert [a.dtype for a in lazy.values()] == [np.int64, np.uint64, np.float32, np.int8]
    materialized = lazy.materialize()
    assert type(materialized) is dict and list(materialized) == list(eager)
    assert materialized is not lazy.materialize()  # a new dict each time
    assert all(materialized[name] is lazy[name] for name in lazy)
    # Equality as between dicts of arrays (one-element arrays compare as booleans).
    single = _body([_tensor("a", "INT64", [1], [3]), _tensor("b", "FP32", [1], [0.5])])
    lazy_single = http_decode.decode_http_request(single).inputs
    eager_single = http_decode.decode_http_request(single, str(len(single))).inputs
    assert lazy_single == eager_single and eager_single == lazy_single
    assert dict(lazy_single) == eager_single
    assert lazy_single != {"a": np.array([4])}
    assert "JsonTensors" in repr(lazy_single)


def test_json_tensors_are_read_only():
    lazy = http_decode.decode_http_request(_mapping_body()).inputs
    with pytest.raises(TypeError):
        lazy["zeta"] = np.zeros(1)  # type: ignore[index]
    with pytest.raises(AttributeError):
        lazy.extra = 1  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "touch",
    [
        lambda m: m["a"],
        lambda m: m.get("b"),
        lambda m: len(m),
        lambda m: "a" in m,
        lambda m: list(m),
        lambda m: list(m.items()),
        lambda m: m.materialize(),
    ],
)
def test_a_malformed_tensor_raises_the_eager_error_on_first_touch(touch):
    body = _body(
        [
            _tensor("a", "INT64", [1], [1]),
            _tensor("b", "INT64", [2], [1]),  # first error in request order
            _tensor("c", "BYTES", [1], ["x"]),
        ]
    )
    with pytest.raises(InvalidArgumentError) as expected:
        http_decode.decode_http_request(body, str(len(body)))
    lazy = http_decode.decode_http_request(body).inputs  # decode itself does not convert
    assert isinstance(lazy, lazy_tensors.JsonTensors)
    assert list(lazy.raw_entries) == ["a", "b", "c"]
    with pytest.raises(InvalidArgumentError) as got:
        touch(lazy)
    assert (
        str(got.value)
        == str(expected.value)
        == "input 'b': shape [2] has 2 elements but data has 1"
    )
    with pytest.raises(InvalidArgumentError):  # and again: nothing half-converted is kept
        lazy.materialize()


def test_mixed_binary_bodies_and_json_inputs_with_parameters_stay_eager():
    ids = np.array([1, 2], np.int64)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "ids",
                    "shape": [2],
                    "datatype": "INT64",
                    "parameters": {"binary_data_size": 16},
                },
                _tensor("a", "INT64", [1], [1]),
            ]
        }
    )
    request = http_decode.decode_http_request(header + ids.tobytes(), str(len(header)))
    assert type(request.inputs) is dict
    with_parameters = _body([{**_tensor("a", "INT64", [1], [1]), "parameters": {}}])
    assert type(http_decode.decode_http_request(with_parameters).inputs) is dict


# --------------------------------------------------------------------------- trusted batches
def _features(batch: int, rng: np.random.Generator) -> tuple[list, list]:
    single = IDTypeFeatureWithSingleID("user", rng.integers(0, 100, batch).astype(np.uint64))
    lengths = rng.integers(0, 3, batch)
    jagged = IDTypeFeature(
        "history", rng.integers(0, 100, lengths.sum()).astype(np.uint64), lengths
    )
    dense = NonIDTypeFeature(rng.standard_normal((batch, 2)).astype(np.float32), "dense")
    return [single, jagged], [dense]


def test_trusted_inference_batches_equal_validated_ones():
    ids, dense = _features(3, np.random.default_rng(1))
    validated = Batch(ids, dense, requires_grad=False)
    trusted = Batch._trusted_inference(ids, dense, 3)
    assert trusted.equals(validated) and validated.equals(trusted)
    assert trusted.batch_size == 3 and trusted.id_feature_names == ("user", "history")
    for attribute in (
        "_ids",
        "_dense",
        "_labels",
        "_batch_size",
        "_requires_grad",
        "_meta",
        "_batch_id",
        "_kinds",
        "_id_index",
        "_dense_index",
        "_label_index",
    ):
        assert getattr(trusted, attribute) == getattr(validated, attribute), attribute
    assert list(trusted._kinds.items()) == list(validated._kinds.items())
    assert trusted.id_feature("history") is ids[1]
    assert trusted.non_id_feature("dense") is dense[0]
    for batch in (trusted, validated):
        with pytest.raises(BatchValidationError) as error:
            batch.non_id_feature("user")
        assert "('user' is a ID-type feature)" in str(error.value)
    assert str(trusted) == str(validated)


def test_trusted_batches_of_single_id_rows_count_their_ids():
    rows = np.arange(12, dtype=np.uint64).reshape(3, 4)
    rows.setflags(write=False)
    features = IDTypeFeatureWithSingleID.trusted_rows(["a", "b", "c"], rows)
    trusted = Batch._trusted_inference(features, [], 4, rows)
    assert trusted.num_ids == 12 == Batch(features, [], requires_grad=False).num_ids
    # Rows for only some of the ID features: the jagged ones count too.
    ids, dense = _features(4, np.random.default_rng(2))
    single_rows = ids[0].values.reshape(1, 4)
    mixed = Batch._trusted_inference(ids, dense, 4, single_rows)
    assert mixed.num_ids == 4 + ids[1].num_ids == Batch(ids, dense, requires_grad=False).num_ids


# --------------------------------------------------------------------------- merge_batches
def _reference_merge(batches: list[Batch]) -> Batch:
    """merge_batches as it was: concatenate and validate."""
    first = batches[0]
    id_features = []
    for index, feature in enumerate(first.id_type_features):
        parts = [b.id_type_features[index] for b in batches]
        values = np.concatenate([p.values for p in parts])
        if isinstance(feature, IDTypeFeatureWithSingleID):
            id_features.append(IDTypeFeatureWithSingleID(feature.name, values))
        else:
            lengths = np.concatenate([p.lengths for p in parts])
            id_features.append(IDTypeFeature(feature.name, values, lengths))
    dense = [
        NonIDTypeFeature(np.concatenate([b.non_id_type_features[i].data for b in batches]), f.name)
        for i, f in enumerate(first.non_id_type_features)
    ]
    return Batch(id_features, dense, requires_grad=False)


def _decoded_batches(signature: FeatureSignature, sizes: list[int], seed: int) -> list[Batch]:
    rng = np.random.default_rng(seed)
    return [
        tensors.tensors_to_batch(
            signature,
            http_decode.decode_http_request(_body(_random_inputs(signature, size, rng))).inputs,
            max_batch_size=MAX_BATCH,
        )
        for size in sizes
    ]


def _assert_merged(batches: list[Batch]) -> Batch:
    merged = merge_batches(batches)
    expected = _reference_merge(batches)
    _assert_batches_equal(merged, expected)  # includes read-only, contiguous, dtypes
    assert merged.batch_size == sum(b.batch_size for b in batches)
    return merged


@pytest.mark.parametrize("name", sorted(SIGNATURES))
@pytest.mark.parametrize("sizes", [[1] * 20, [1, 3, 1, 64, 2], [5, 1]])
def test_merge_of_decoded_batches_is_their_concatenation(name, sizes):
    batches = _decoded_batches(SIGNATURES[name], sizes, len(sizes))
    assert all(b._single_id_rows is not None for b in batches)
    merged = _assert_merged(batches)
    # The single-ID features of the merge are rows of one array, kept for the next merge.
    rows = merged._single_id_rows
    assert rows is not None and not rows.flags.writeable
    singles = [f for f in merged.id_type_features if isinstance(f, IDTypeFeatureWithSingleID)]
    assert rows.shape == (len(singles), merged.batch_size)
    for row, feature in zip(rows, singles, strict=True):
        np.testing.assert_array_equal(row, feature.values)
        assert np.shares_memory(rows, feature.values)
    _assert_merged([merged, *batches[:2]])  # merges of merges


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_merge_of_batches_without_single_id_rows(name):
    signature = SIGNATURES[name]
    decoded = _decoded_batches(signature, [1, 2, 1], 9)
    validated = [
        Batch(list(b.id_type_features), list(b.non_id_type_features), requires_grad=False)
        for b in decoded
    ]
    assert all(b._single_id_rows is None for b in validated)
    _assert_merged(validated)
    merged = _assert_merged([decoded[0], validated[1], decoded[2]])  # a mix
    assert merged._single_id_rows is None


def test_merge_of_eagerly_decoded_batches():
    # The general path (binary and gRPC requests) records its stacked single-ID rows too.
    rng = np.random.default_rng(4)
    batches = []
    for size in (1, 2, 1):
        inputs = _random_inputs(SINGLE, size, rng)
        for tensor in inputs[:5]:
            tensor["datatype"] = "INT64"  # one ID dtype: stacked in one numpy pass
        batches.append(_eager_batch(SINGLE, _body(inputs), MAX_BATCH))
    assert all(b._single_id_rows is not None for b in batches)
    _assert_merged(batches)


def test_merge_of_one_batch_is_that_batch():
    (batch,) = _decoded_batches(JAGGED, [3], 1)
    assert merge_batches([batch]) is batch


def test_merge_of_jagged_only_batches():
    signature = FeatureSignature(id_features=(IdFeatureSpec("history", False),), non_id_features=())
    batches = _decoded_batches(signature, [1, 4, 2], 6)
    assert all(b._single_id_rows is None for b in batches)
    merged = _assert_merged(batches)
    assert (
        merged.id_feature("history").lengths.tolist()
        == np.concatenate([b.id_feature("history").lengths for b in batches]).tolist()
    )


@pytest.mark.parametrize(
    ("datatype", "data", "shown"),
    [
        # orjson reads an integer literal beyond 64 bits as a float: still an integer sent.
        ("INT64", [5, 2**64], "1.8446744073709552e+19"),
        ("UINT64", [5, 2**64], "1.8446744073709552e+19"),
        ("INT64", [5, -(2**63) - 1], "-9.2233720368547758e+18"),
        # numpy reads -1 and 2**63 together as floats: the int beyond the range is named.
        ("INT64", [2**63, -1], "9223372036854775808"),
        ("UINT64", [-1, 2**63], "-1"),
    ],
)
@pytest.mark.parametrize("batch", [2, MAX_BATCH])  # MAX_BATCH: a large body (simdjson first)
def test_an_integer_beyond_its_datatype_is_named_out_of_range(datatype, data, shown, batch):
    inputs = _random_inputs(SINGLE, batch, np.random.default_rng(3))
    (tensor,) = [t for t in inputs if t["name"] == "C2"]
    tensor["datatype"] = datatype
    tensor["data"][: len(data)] = data
    body = json.dumps({"inputs": inputs}).encode()  # orjson cannot write 2**64
    assert (len(body) >= LARGE_BODY_BYTES) == (batch == MAX_BATCH)
    got = _assert_same_outcome(SINGLE, body)
    assert type(got) is InvalidArgumentError
    assert str(got) == f"input 'C2': value {shown} is out of range for {datatype}"
