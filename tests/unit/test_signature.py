"""FeatureSignature.check: a batch matches the model's inputs in names, kinds and order."""

from __future__ import annotations

import numpy as np
import pytest

from embedding_store.batch import (
    Batch,
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    NonIDTypeFeature,
)
from embedding_store.errors import BatchValidationError, CheckpointError
from embedding_store.signature import FeatureSignature


def _batch(*, user_jagged: bool = False, non_id_order: tuple[str, ...] = ("price", "age")) -> Batch:
    user = (
        IDTypeFeature.from_lists("user", [[1], [2]])
        if user_jagged
        else IDTypeFeatureWithSingleID.from_ids("user", [1, 2])
    )
    history = IDTypeFeature.from_lists("history", [[5, 6], []])
    dense = {
        "price": NonIDTypeFeature(np.array([[1.0], [2.0]], dtype=np.float32), name="price"),
        "age": NonIDTypeFeature(np.array([[30.0], [40.0]], dtype=np.float32), name="age"),
    }
    return Batch(
        [user, history],
        non_id_type_features=[dense[n] for n in non_id_order],
        requires_grad=False,
    )


SIGNATURE = FeatureSignature.from_batch(_batch())


def test_the_batch_the_signature_was_taken_from_matches() -> None:
    SIGNATURE.check(_batch())


def test_non_id_features_in_another_order_are_refused_by_name() -> None:
    # The dense model takes non-ID tensors by position: swapped columns would be scored.
    with pytest.raises(
        BatchValidationError,
        match=r"non-ID features come in the order \['age', 'price'\]; "
        r"the model takes them as \['price', 'age'\]",
    ):
        SIGNATURE.check(_batch(non_id_order=("age", "price")))


def test_a_jagged_feature_for_a_single_id_slot_is_refused() -> None:
    with pytest.raises(
        BatchValidationError,
        match=r"ID feature 'user' is jagged \(a list of IDs per sample\) here; "
        r"the model's is single-ID",
    ):
        SIGNATURE.check(_batch(user_jagged=True))


def test_a_single_id_feature_for_a_jagged_slot_is_refused() -> None:
    jagged = FeatureSignature.from_batch(_batch(user_jagged=True))
    with pytest.raises(BatchValidationError, match=r"'user' is single-ID .* model's is jagged"):
        jagged.check(_batch())


def test_missing_and_unknown_non_id_features_are_named() -> None:
    with pytest.raises(BatchValidationError, match=r"non-ID feature 'age' is missing"):
        SIGNATURE.check(_batch(non_id_order=("price",)))
    extra = NonIDTypeFeature(np.zeros((2, 1), dtype=np.float32), name="city")
    batch = _batch()
    with pytest.raises(BatchValidationError, match=r"unknown non-ID feature\(s\): \['city'\]"):
        SIGNATURE.check(
            Batch(
                batch.id_type_features,
                [*batch.non_id_type_features, extra],
                requires_grad=False,
            )
        )


def test_a_stored_signature_round_trips_and_an_unknown_dtype_is_refused() -> None:
    assert FeatureSignature.from_dict(SIGNATURE.to_dict()) == SIGNATURE
    data = SIGNATURE.to_dict()
    data["non_id_features"][0]["dtype"] = "float33"
    with pytest.raises(CheckpointError, match=r"model\.json: malformed feature signature"):
        FeatureSignature.from_dict(data, source="model.json")


def test_a_non_id_feature_of_another_sample_shape_is_refused() -> None:
    batch = _batch()
    wide = NonIDTypeFeature(np.zeros((2, 3), dtype=np.float32), name="price")
    with pytest.raises(
        BatchValidationError,
        match=r"non-ID feature 'price' has sample shape \[3\]; the model expects \[1\]",
    ):
        SIGNATURE.check(
            Batch(
                batch.id_type_features, [wide, batch.non_id_type_features[1]], requires_grad=False
            )
        )


def test_label_names_and_sample_shapes_are_recorded_and_round_trip() -> None:
    from embedding_store.batch import Label

    batch = _batch()
    labelled = Batch(
        batch.id_type_features,
        batch.non_id_type_features,
        [Label(np.zeros(2, np.float32), "click"), Label(np.zeros(2, np.float32), "buy")],
    )
    signature = FeatureSignature.from_batch(labelled)
    assert signature.label_names == ("click", "buy")
    assert [(s.name, s.dtype, s.sample_shape) for s in signature.non_id_features] == [
        ("price", "float32", (1,)),
        ("age", "float32", (1,)),
    ]
    back = FeatureSignature.from_dict(signature.to_dict())
    assert back == signature and back.label_names == ("click", "buy")


def test_id_features_in_another_order_are_refused() -> None:
    batch = _batch()
    swapped = Batch(
        list(reversed(batch.id_type_features)), batch.non_id_type_features, requires_grad=False
    )
    with pytest.raises(
        BatchValidationError,
        match=r"ID features \['history', 'user'\] do not match the model's \['user', 'history'\]",
    ):
        SIGNATURE.check(swapped)


def _hour_batch(hour: np.ndarray) -> Batch:
    return Batch(
        [IDTypeFeatureWithSingleID.from_ids("user", [1, 2])],
        non_id_type_features=[NonIDTypeFeature(hour, name="hour")],
        requires_grad=False,
    )


#: The model takes "hour" as int64 (it may index an embedding table with it).
HOURS = FeatureSignature.from_batch(_hour_batch(np.array([[3], [4]], dtype=np.int64)))


@pytest.mark.parametrize(
    "hour",
    [
        np.array([[3], [23]], dtype=np.int32),  # an integer that casts safely
        np.array([[3], [23]], dtype=np.uint64),  # another signedness, values in range
        np.array([[3.0], [23.0]], dtype=np.float64),  # whole numbers: converted exactly
        np.array([[True], [False]]),
    ],
)
def test_an_integer_feature_takes_what_converts_exactly(hour: np.ndarray) -> None:
    HOURS.check(_hour_batch(hour))


@pytest.mark.parametrize(
    ("hour", "shown"),
    [
        (np.array([[3.0], [3.5]], dtype=np.float64), "float64: value 3.5 at sample 1"),
        (np.array([[np.nan], [3.0]], dtype=np.float32), "float32: value nan at sample 0"),
        (
            np.array([[3.0], [2.0**63]], dtype=np.float64),
            "float64: value 9.223372036854776e+18 at sample 1",
        ),
        (
            np.array([[2**63], [1]], dtype=np.uint64),
            "uint64: value 9223372036854775808 at sample 0",
        ),
    ],
)
def test_an_integer_feature_refuses_what_would_change(hour: np.ndarray, shown: str) -> None:
    """3.5 would be cut to 3, NaN and 2**63 become arbitrary int64 values: the model would
    answer for another input than the one sent."""
    with pytest.raises(BatchValidationError) as raised:
        HOURS.check(_hour_batch(hour))
    assert str(raised.value) == (
        f"non-ID feature 'hour' is an integer feature of the model (int64), given as {shown}, "
        "position [0] is not a whole number in the range of int64"
    )


def test_a_float_feature_takes_any_number() -> None:
    SIGNATURE.check(
        Batch(
            _batch().id_type_features,
            [
                NonIDTypeFeature(np.array([[1], [2]], dtype=np.int64), name="price"),
                NonIDTypeFeature(np.array([[0.5], [1e300]], dtype=np.float64), name="age"),
            ],
            requires_grad=False,
        )
    )
