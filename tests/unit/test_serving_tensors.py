"""serving.tensors.tensors_to_batch: request tensors -> a validated inference Batch.

Single-ID inputs are converted together in one numpy pass when they agree on dtype and
length; anything unusual falls back to the per-input checks, whose errors name the input.
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import orjson
import pytest

from embedding_store.batch import IDTypeFeature, IDTypeFeatureWithSingleID
from embedding_store.errors import InvalidArgumentError
from embedding_store.signature import FeatureSignature, IdFeatureSpec, NonIdFeatureSpec
from serving import instance_inputs, tensor_specs, tensors
from serving.core import TensorSpec

SIGNATURE = FeatureSignature(
    id_features=(
        IdFeatureSpec("user", True),
        IdFeatureSpec("history", False),
        IdFeatureSpec("item", True),
        IdFeatureSpec("city", True),
    ),
    non_id_features=(NonIdFeatureSpec("dense", "float32", (2,)),),
)


def _inputs(**overrides: np.ndarray) -> dict[str, np.ndarray]:
    inputs = {
        "user": np.array([3, 2**40], np.int64),
        "history": np.array([7, 8, 9], np.int64),
        "history.lengths": np.array([1, 2], np.int64),
        "item": np.array([0, 5], np.int64),
        "city": np.array([11, 12], np.int64),
        "dense": np.array([[0.5, 1.5], [2.5, 3.5]], np.float32),
    }
    inputs.update(overrides)
    return inputs


def _values(batch, name: str) -> list[int]:
    return batch.id_feature(name).values.tolist()


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_single_id_inputs_become_read_only_uint64_features(dtype) -> None:
    inputs = _inputs(**{n: _inputs()[n].astype(dtype) for n in ("user", "item", "city")})
    batch = tensors.tensors_to_batch(SIGNATURE, inputs, max_batch_size=8)
    assert batch.batch_size == 2
    assert [f.name for f in batch.id_type_features] == ["user", "history", "item", "city"]
    assert _values(batch, "user") == [3, 2**40]
    assert _values(batch, "item") == [0, 5]
    assert _values(batch, "city") == [11, 12]
    for name in ("user", "item", "city"):
        feature = batch.id_feature(name)
        assert isinstance(feature, IDTypeFeatureWithSingleID)
        assert feature.values.dtype == np.uint64 and not feature.values.flags.writeable
        assert feature.values.flags.c_contiguous
    history = batch.id_feature("history")
    assert isinstance(history, IDTypeFeature)
    assert history.values.tolist() == [7, 8, 9] and history.lengths.tolist() == [1, 2]
    inputs["user"][0] = 99  # the caller's arrays are not shared with the batch
    assert _values(batch, "user")[0] == 3


def test_mixed_id_dtypes_take_the_per_input_path() -> None:
    inputs = _inputs(item=np.array([0, 2**63 + 1], np.uint64))
    batch = tensors.tensors_to_batch(SIGNATURE, inputs, max_batch_size=8)
    assert _values(batch, "item") == [0, 2**63 + 1]
    assert _values(batch, "user") == [3, 2**40]


def test_a_negative_id_is_named_with_its_position() -> None:
    inputs = _inputs(city=np.array([11, -4], np.int64))
    with pytest.raises(
        InvalidArgumentError, match=r"input 'city': IDs must be non-negative, got -4"
    ):
        tensors.tensors_to_batch(SIGNATURE, inputs, max_batch_size=8)


def test_single_id_inputs_of_different_lengths_are_named() -> None:
    inputs = _inputs(item=np.array([0, 5, 6], np.int64))
    with pytest.raises(InvalidArgumentError, match=r"input 'item' has batch size 3, but 'user'"):
        tensors.tensors_to_batch(SIGNATURE, inputs, max_batch_size=8)


def test_float_ids_are_refused_naming_the_input() -> None:
    inputs = _inputs(user=np.array([3.0, 4.0]))
    with pytest.raises(InvalidArgumentError, match=r"input 'user': IDs must be INT64 or UINT64"):
        tensors.tensors_to_batch(SIGNATURE, inputs, max_batch_size=8)


def test_signature_hash_is_stable_and_equal_for_equal_signatures() -> None:
    twin = FeatureSignature(SIGNATURE.id_features, SIGNATURE.non_id_features)
    assert twin == SIGNATURE and hash(twin) == hash(SIGNATURE) == hash(SIGNATURE)
    other = FeatureSignature(SIGNATURE.id_features[:1], SIGNATURE.non_id_features)
    assert other != SIGNATURE
    # The cached hash stays in this process: a copy or another process computes its own.
    copied = pickle.loads(pickle.dumps(SIGNATURE))
    assert copied == SIGNATURE and "_hash" not in copied.__dict__
    assert hash(copied) == hash(SIGNATURE)


# --------------------------------------------------------------------------- friendly rows
def _row(**overrides):
    row = {"user": 3, "history": [7, 8], "item": 0, "city": 11, "dense": [0.5, 1.5]}
    row.update(overrides)
    return row


def test_friendly_rows_become_the_named_tensors():
    rows = [
        _row(),
        _row(user=2**64 - 1, history=[], item=[5], dense=[2.5, 3.5]),
        _row(history=[9]),
    ]
    inputs = instance_inputs.instances_to_inputs(SIGNATURE, rows)
    assert sorted(inputs) == sorted(["user", "history", "history.lengths", "item", "city", "dense"])
    np.testing.assert_array_equal(inputs["user"], np.array([3, 2**64 - 1, 3], np.uint64))
    assert inputs["user"].dtype == np.uint64
    np.testing.assert_array_equal(inputs["history"], np.array([7, 8, 9], np.uint64))
    np.testing.assert_array_equal(inputs["history.lengths"], [2, 0, 1])
    np.testing.assert_array_equal(inputs["item"], np.array([0, 5, 0], np.uint64))
    np.testing.assert_array_equal(
        inputs["dense"], np.array([[0.5, 1.5], [2.5, 3.5], [0.5, 1.5]], np.float32)
    )
    batch = tensors.tensors_to_batch(SIGNATURE, inputs, max_batch_size=8)
    assert batch.batch_size == 3


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"user": True}, r"instances\[1\]\.user: IDs must be integers, got True \(bool\)"),
        ({"user": 2.0}, r"instances\[1\]\.user: IDs must be integers, got 2\.0 \(float\)"),
        ({"user": "7"}, r"instances\[1\]\.user: IDs must be integers, got '7' \(str\)"),
        (
            {"history": [1, False]},
            r"instances\[1\]\.history: IDs must be integers, got False \(bool\)",
        ),
        ({"user": -1}, r"instances\[1\]\.user: IDs must be in \[0, 2\*\*64\), got -1"),
        (
            {"history": [2**64]},
            r"instances\[1\]\.history: IDs must be in \[0, 2\*\*64\), got 18446744073709551616",
        ),
        ({"item": [1, 2]}, r"instances\[1\]\.item: exactly one ID expected, got 2"),
        ({"item": []}, r"instances\[1\]\.item: exactly one ID expected, got 0"),
    ],
)
def test_a_bad_friendly_row_is_named(row, message):
    with pytest.raises(InvalidArgumentError, match=message):
        instance_inputs.instances_to_inputs(SIGNATURE, [_row(), _row(**row)])


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"user": 2**64}, "instances[1].user: ID 1.8446744073709552e+19"),
        ({"history": [1, -(2**64)]}, "instances[1].history: ID -1.8446744073709552e+19"),
        ({"user": 10**30}, "instances[1].user: ID 1e+30"),
    ],
)
def test_a_friendly_id_beyond_64_bits_is_named_out_of_range(row, message):
    """The server parses bodies with orjson, which reads an integer beyond 64 bits as a
    float: the ID is still named as out of range, not as no integer."""
    rows = orjson.loads(json.dumps([_row(), _row(**row)]))
    with pytest.raises(InvalidArgumentError) as raised:
        instance_inputs.instances_to_inputs(SIGNATURE, rows)
    assert str(raised.value) == f"{message} is out of the uint64 range [0, 2**64)"


def test_a_missing_or_unknown_friendly_feature_is_named():
    missing = _row()
    del missing["city"]
    with pytest.raises(InvalidArgumentError, match=r"instances\[1\] lacks feature 'city'"):
        instance_inputs.instances_to_inputs(SIGNATURE, [_row(), missing])
    with pytest.raises(InvalidArgumentError, match=r"instances\[0\] has unknown feature"):
        instance_inputs.instances_to_inputs(SIGNATURE, [_row(town=1)])


def test_a_friendly_row_that_is_not_an_object_is_named():
    with pytest.raises(
        InvalidArgumentError, match=r"instances\[1\] must be an object .*, got \[1, 2\] \(list\)"
    ):
        instance_inputs.instances_to_inputs(SIGNATURE, [_row(), [1, 2]])
    with pytest.raises(InvalidArgumentError, match=r"got 'xxxxx.*\.\.\. \(str\)"):
        instance_inputs.instances_to_inputs(SIGNATURE, ["x" * 10_000])


def test_a_batch_of_exactly_max_batch_size_is_taken_and_one_more_is_refused() -> None:
    batch = tensors.tensors_to_batch(SIGNATURE, _inputs(), max_batch_size=2)
    assert batch.batch_size == 2
    with pytest.raises(
        InvalidArgumentError, match="batch size 2 exceeds this server's max batch size 1"
    ):
        tensors.tensors_to_batch(SIGNATURE, _inputs(), max_batch_size=1)


# --------------------------------------------------------------------------- general path checks
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"history.lengths": np.array([[1], [2]], np.int64)},
            "input 'history.lengths': lengths must be 1-D [batch], got shape [2, 1]",
        ),
        (
            {"history.lengths": np.array([1.0, 2.0])},
            "input 'history.lengths': lengths must be INT32 or INT64, got FP64",
        ),
        (
            {"history.lengths": np.array([1, 1], np.int32)},
            "input 'history.lengths' sums to 2 but 'history' has 3 IDs",
        ),
        (
            {"history.lengths": np.array([2, 2], np.int64)},
            "input 'history.lengths' sums to 4 but 'history' has 3 IDs",
        ),
        # A later input with a smaller batch size is refused as a larger one is.
        (
            {"city": np.array([11], np.uint64)},
            "input 'city' has batch size 1, but 'user' has 2",
        ),
        (
            {"dense": np.array([0.5], np.float32).repeat(2).reshape(1, 2)},
            "input 'dense' has batch size 1, but 'user' has 2",
        ),
        (
            {"dense": np.array([[0.5, 1.5], [2.5, 3.5]], np.float64)},
            "input 'dense' must be FP32, got FP64",
        ),
        # [batch] stands for [batch, 1] only where the sample shape is (1,).
        (
            {"dense": np.array([0.5, 1.5, 2.5, 3.5], np.float32)},
            "input 'dense' has shape [4]; expected [batch, 2]",
        ),
        (
            {"dense": np.array([[0.5, 1.5], [np.nan, np.inf]], np.float32)},
            "input 'dense' has 2 non-finite value(s) (NaN, Inf, or beyond FP32's range of "
            "+-3.4e38), the first at sample 1, position [0]",
        ),
    ],
)
def test_the_general_path_names_the_input_at_fault(
    overrides: dict[str, np.ndarray], message: str
) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        tensors.tensors_to_batch(SIGNATURE, _inputs(**overrides), max_batch_size=8)
    assert raised.value.message == message


def test_a_non_finite_value_of_a_one_value_sample_is_named_without_a_position() -> None:
    signature = FeatureSignature(
        id_features=(IdFeatureSpec("user", True),),
        non_id_features=(NonIdFeatureSpec("age", "float32", ()),),
    )
    inputs = {"user": np.array([1, 2, 3], np.int64), "age": np.array([1, 2, np.inf], np.float32)}
    with pytest.raises(InvalidArgumentError) as raised:
        tensors.tensors_to_batch(signature, inputs, max_batch_size=8)
    assert raised.value.message == (
        "input 'age' has 1 non-finite value(s) (NaN, Inf, or beyond FP32's range of "
        "+-3.4e38), the first at sample 2"
    )


def test_an_empty_batch_with_a_jagged_feature_is_refused() -> None:
    empty = {
        "user": np.zeros(0, np.int64),
        "history": np.zeros(0, np.int64),
        "history.lengths": np.zeros(0, np.int64),
        "item": np.zeros(0, np.int64),
        "city": np.zeros(0, np.int64),
        "dense": np.zeros((0, 2), np.float32),
    }
    with pytest.raises(InvalidArgumentError) as raised:
        tensors.tensors_to_batch(SIGNATURE, empty, max_batch_size=8)
    assert raised.value.message == "the request has an empty batch (batch size 0)"


def test_a_signature_whose_names_a_batch_refuses_is_refused_not_trusted() -> None:
    """Unchecked batches are built only for signatures whose names are valid and unique:
    two features of one name must still be refused by Batch's own checks."""
    signature = FeatureSignature(
        id_features=(IdFeatureSpec("a", True), IdFeatureSpec("a", True)), non_id_features=()
    )
    with pytest.raises(InvalidArgumentError, match=r"^duplicate feature name 'a'"):
        tensors.tensors_to_batch(signature, {"a": np.array([1, 2], np.int64)}, max_batch_size=8)


def test_finite_predictions_pass_and_the_first_non_finite_sample_is_named() -> None:
    tensors.require_finite_predictions(np.array([[0.5], [0.25]], np.float32))
    # A sample is at fault when any of its outputs is not finite.
    with pytest.raises(InvalidArgumentError, match=r"for 1 sample\(s\) .* at sample 0:"):
        tensors.require_finite_predictions(np.array([[0.5, np.nan], [0.25, 0.5]], np.float32))
    with pytest.raises(InvalidArgumentError) as raised:
        tensors.require_finite_predictions(np.array([[0.5], [np.nan], [0.1], [np.inf]], np.float32))
    assert raised.value.message.startswith(
        "the model's prediction is not finite (NaN or Inf) for 2 sample(s) of this request, "
        "the first at sample 1:"
    )


# --------------------------------------------------------------------------- friendly rows, more
@pytest.mark.parametrize(
    ("instances", "message"),
    [
        ([], '"instances" is empty'),
        ("rows", '"instances" must be a list of objects'),
        ({"user": 3}, '"instances" must be a list of objects'),
    ],
)
def test_instances_that_are_no_list_of_rows_are_refused(instances: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        instance_inputs.instances_to_inputs(SIGNATURE, instances)  # type: ignore[arg-type]
    assert raised.value.message == message


def test_a_row_lacking_a_dense_feature_is_named() -> None:
    missing = _row()
    del missing["dense"]
    with pytest.raises(InvalidArgumentError) as raised:
        instance_inputs.instances_to_inputs(SIGNATURE, [_row(), missing])
    assert raised.value.message == "instances[1] lacks feature 'dense'"


@pytest.mark.parametrize("dense", [[0.5, True], True, [False, False], ["0.5", 1.0], [None, 1.0]])
def test_dense_values_that_are_not_numbers_are_refused(dense: object) -> None:
    """true/false, strings and null are not numbers, even where float32 could read them: the
    row is named with the one form its sample takes (a number alone is no 2-value sample)."""
    with pytest.raises(InvalidArgumentError) as raised:
        instance_inputs.instances_to_inputs(SIGNATURE, [_row(), _row(dense=dense)])
    expected = f"instances[1].dense: expected a list of 2 numbers, got {dense!r}"
    assert raised.value.message == expected


def test_a_string_for_a_multi_dimensional_dense_feature_names_its_nested_form() -> None:
    """A CSV cell (one string) for a [2, 3] feature: the error says the nested lists it takes,
    not "a number or a list of 6 numbers" (neither of which it takes)."""
    grid = FeatureSignature(
        id_features=(IdFeatureSpec("user", True),),
        non_id_features=(NonIdFeatureSpec("grid", "float32", (2, 3)),),
    )
    good = {"user": 1, "grid": [[1, 2, 3], [4, 5, 6]]}
    np.testing.assert_array_equal(
        instance_inputs.instances_to_inputs(grid, [good])["grid"], [[[1, 2, 3], [4, 5, 6]]]
    )
    for value in ("1 2 3 4 5 6", 0.5):
        with pytest.raises(InvalidArgumentError) as raised:
            instance_inputs.instances_to_inputs(grid, [good, {"user": 2, "grid": value}])
        assert raised.value.message == (
            f"instances[1].grid: expected lists of numbers nested as [2, 3], got {value!r}"
        )


_SCALARS = FeatureSignature(
    id_features=(IdFeatureSpec("user", True),),
    non_id_features=(
        NonIdFeatureSpec("age", "float32", ()),  # a 1-D feature [batch] in training
        NonIdFeatureSpec("score", "float32", (1,)),
    ),
)


def test_friendly_rows_fill_scalar_and_one_value_features_in_either_form() -> None:
    """A one-value feature is a number or a list of one number in each row, mixed freely;
    a feature of sample shape () becomes float32 [batch] (it was [batch, 1], which the batch
    refused for every request), one of (1,) float32 [batch, 1]."""
    rows = [
        {"user": 1, "age": 3, "score": [0.5]},
        {"user": 2, "age": [4.5], "score": 0.25},
        {"user": 3, "age": 6.0, "score": [1]},
    ]
    inputs = instance_inputs.instances_to_inputs(_SCALARS, rows)
    assert inputs["age"].dtype == np.float32 and inputs["age"].tolist() == [3.0, 4.5, 6.0]
    assert inputs["score"].dtype == np.float32
    assert inputs["score"].tolist() == [[0.5], [0.25], [1.0]]
    batch = tensors.tensors_to_batch(_SCALARS, inputs, max_batch_size=8)
    assert batch.batch_size == 3
    uniform = instance_inputs.instances_to_inputs(_SCALARS, [{"user": 1, "age": 2, "score": 7}])
    assert uniform["age"].tolist() == [2.0] and uniform["score"].tolist() == [[7.0]]


def test_a_scalar_feature_sent_as_a_column_is_refused_naming_its_shape() -> None:
    inputs = {"user": np.array([1, 2], np.int64), "age": np.ones((2, 1), np.float32)}
    inputs["score"] = np.ones((2, 1), np.float32)
    with pytest.raises(InvalidArgumentError) as raised:
        tensors.tensors_to_batch(_SCALARS, inputs, max_batch_size=8)
    assert raised.value.message == "input 'age' has shape [2, 1]; expected [batch]"


@pytest.mark.parametrize(
    ("dense", "message"),
    [
        ([0.5], "instances[1].dense: expected a list of 2 numbers, got [0.5]"),
        ([[0.5, 1.5]], "instances[1].dense: expected a list of 2 numbers, got [[0.5, 1.5]]"),
        (0.5, "instances[1].dense: expected a list of 2 numbers, got 0.5"),
    ],
)
def test_a_dense_value_of_the_wrong_shape_is_named_with_its_row(dense, message) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        instance_inputs.instances_to_inputs(SIGNATURE, [_row(), _row(dense=dense)])
    assert raised.value.message == message


def test_a_row_that_is_not_an_object_is_quoted_up_to_80_characters() -> None:
    fits = "x" * 78  # repr: 80 characters
    with pytest.raises(InvalidArgumentError) as raised:
        instance_inputs.instances_to_inputs(SIGNATURE, [fits])
    assert (
        raised.value.message
        == f"instances[0] must be an object (feature name -> value), got {fits!r} (str)"
    )
    longer = "x" * 79  # repr: 81 characters, cut to 77 and "..."
    with pytest.raises(InvalidArgumentError) as raised:
        instance_inputs.instances_to_inputs(SIGNATURE, [longer])
    assert raised.value.message.endswith(f"got {repr(longer)[:77]}... (str)")


def test_metadata_lists_every_input_in_signature_order_and_one_output() -> None:
    """What model metadata reports (KServe v2): IDs INT64 [-1] (UINT64 accepted too), lengths
    after their IDs INT64 [-1] (INT32 accepted too), dense FP32 [-1, *sample_shape]."""
    ids, lengths, floats = ("INT64", "UINT64"), ("INT32", "INT64"), ("FP32",)
    assert tensor_specs.input_specs(SIGNATURE) == (
        TensorSpec("user", "INT64", (-1,), ids),
        TensorSpec("history", "INT64", (-1,), ids),
        TensorSpec("history.lengths", "INT64", (-1,), lengths),
        TensorSpec("item", "INT64", (-1,), ids),
        TensorSpec("city", "INT64", (-1,), ids),
        TensorSpec("dense", "FP32", (-1, 2), floats),
    )
    assert tensor_specs.output_specs() == (TensorSpec("prediction", "FP32", (-1, 1), floats),)


def test_the_first_negative_id_is_named_not_the_smallest() -> None:
    inputs = _inputs(item=np.array([0, 2**63 + 1], np.uint64), city=np.array([-1, -7], np.int64))
    with pytest.raises(InvalidArgumentError) as raised:
        tensors.tensors_to_batch(SIGNATURE, inputs, max_batch_size=8)
    assert raised.value.message == "input 'city': IDs must be non-negative, got -1 at position 0"


#: A model that takes "hour" as int64 (an index, say); the wire carries it as FP32.
HOURS = FeatureSignature((IdFeatureSpec("user", True),), (NonIdFeatureSpec("hour", "int64", (1,)),))


def _hours(hour: float) -> dict[str, np.ndarray]:
    return {
        "user": np.array([1, 2], np.uint64),
        "hour": np.array([[3.0], [hour]], np.float32),
    }


def test_an_integer_feature_sent_as_fp32_is_converted_when_whole() -> None:
    batch = tensors.tensors_to_batch(HOURS, _hours(23.0), max_batch_size=8)
    (hour,) = batch.non_id_type_features
    assert (hour.data.dtype, hour.data.tolist()) == (np.dtype(np.int64), [[3], [23]])


@pytest.mark.parametrize(
    ("hour", "message"),
    [
        (
            3.5,  # was cut to 3
            "input 'hour' is an integer feature of the model (int64): value 3.5 at sample 1, "
            "position [0] is not a whole number in the range of int64",
        ),
        (
            1e30,  # was cast to an arbitrary int64
            "input 'hour' is an integer feature of the model (int64): value 1e+30 at sample "
            "1, position [0] is not a whole number in the range of int64",
        ),
        (
            float("nan"),  # was cast to -2**63, which the finiteness check of int64 passed
            "input 'hour' has 1 non-finite value(s) (NaN, Inf, or beyond FP32's range of "
            "+-3.4e38), the first at sample 1, position [0]",
        ),
    ],
)
def test_an_integer_feature_sent_as_fp32_is_refused_unless_whole(hour, message) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        tensors.tensors_to_batch(HOURS, _hours(hour), max_batch_size=8)
    assert str(raised.value) == message
