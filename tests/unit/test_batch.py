"""Tests for the batch data model (embedding_store.batch)."""

from __future__ import annotations

import numpy as np
import pytest

from embedding_store.batch import (
    MAX_NAME_BYTES,
    Batch,
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    Label,
    NonIDTypeFeature,
    PersiaBatch,
)
from embedding_store.errors import BatchValidationError, InvalidArgumentError

U64 = np.uint64

EXAMPLE_LISTS = [[3, 1], [], [7], [], [2**64 - 1, 0, 5]]
EXAMPLE_VALUES = np.array([3, 1, 7, 2**64 - 1, 0, 5], dtype=U64)
EXAMPLE_LENGTHS = np.array([2, 0, 1, 0, 3], dtype=np.int64)
EXAMPLE_OFFSETS = np.array([0, 2, 2, 3, 3, 6], dtype=np.int64)


def _check_example(f: IDTypeFeature) -> None:
    assert f.name == "f"
    assert f.values.dtype == U64 and f.lengths.dtype == np.int64 and f.offsets.dtype == np.int64
    np.testing.assert_array_equal(f.values, EXAMPLE_VALUES)
    np.testing.assert_array_equal(f.lengths, EXAMPLE_LENGTHS)
    np.testing.assert_array_equal(f.offsets, EXAMPLE_OFFSETS)
    assert f.batch_size == 5
    assert f.num_ids == 6
    assert f.to_lists() == EXAMPLE_LISTS


def _simple_batch(**kwargs: object) -> Batch:
    ids = [IDTypeFeature.from_lists("a", [[1], [2, 3]])]
    return Batch(ids, labels=[Label(np.zeros(2, np.float32))], **kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ constructors


def test_from_lists_python_ints() -> None:
    _check_example(IDTypeFeature.from_lists("f", EXAMPLE_LISTS))


def test_from_lists_numpy_samples() -> None:
    f = IDTypeFeature.from_lists("f", [np.array(s, dtype=U64) for s in EXAMPLE_LISTS])
    _check_example(f)


def test_from_lists_mixed_samples_and_tuples() -> None:
    lists = [np.array([3, 1], dtype=U64), (), [7], range(0), (2**64 - 1, 0, 5)]
    _check_example(IDTypeFeature.from_lists("f", lists))


def test_from_lists_2d_array() -> None:
    f = IDTypeFeature.from_lists("f", np.array([[1, 2], [3, 4], [5, 6]], dtype=U64))
    assert f.to_lists() == [[1, 2], [3, 4], [5, 6]]
    np.testing.assert_array_equal(f.lengths, [2, 2, 2])


def test_from_lengths_and_offsets() -> None:
    _check_example(IDTypeFeature.from_lengths("f", EXAMPLE_LENGTHS, EXAMPLE_VALUES))
    _check_example(IDTypeFeature.from_lengths("f", [2, 0, 1, 0, 3], EXAMPLE_VALUES))
    _check_example(IDTypeFeature.from_offsets("f", EXAMPLE_OFFSETS, EXAMPLE_VALUES))
    _check_example(IDTypeFeature("f", EXAMPLE_VALUES, EXAMPLE_LENGTHS.astype(np.uint8)))


def test_all_empty_samples() -> None:
    f = IDTypeFeature.from_lists("f", [[], [], []])
    assert f.values.dtype == U64 and f.values.shape == (0,)
    np.testing.assert_array_equal(f.offsets, [0, 0, 0, 0])
    assert f.to_lists() == [[], [], []]


def test_single_id_feature() -> None:
    f = IDTypeFeatureWithSingleID.from_ids("s", [5, 0, 2**64 - 1])
    assert f.values.dtype == U64
    np.testing.assert_array_equal(f.values, np.array([5, 0, 2**64 - 1], dtype=U64))
    np.testing.assert_array_equal(f.lengths, [1, 1, 1])
    assert f.lengths.dtype == np.int64
    np.testing.assert_array_equal(f.offsets, [0, 1, 2, 3])
    assert f.batch_size == 3 and f.num_ids == 3
    assert f.to_lists() == [[5], [0], [2**64 - 1]]
    g = IDTypeFeatureWithSingleID("s", np.array([5, 0, 2**64 - 1], dtype=U64))
    assert g.equals(f)


def test_arrays_are_readonly_and_copied() -> None:
    values = EXAMPLE_VALUES.copy()
    f = IDTypeFeature("f", values, EXAMPLE_LENGTHS.copy())
    values[0] = 99  # the caller's array is not the feature's
    assert f.values[0] == 3
    for arr in (f.values, f.lengths, f.offsets):
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[0] = 1
    dense = NonIDTypeFeature(np.ones((2, 3), np.float32))
    assert not dense.data.flags.writeable
    s = IDTypeFeatureWithSingleID("s", np.arange(3, dtype=U64))
    assert not s.values.flags.writeable and not s.lengths.flags.writeable


def test_readonly_arrays_are_shared() -> None:
    values = EXAMPLE_VALUES.copy()
    values.flags.writeable = False
    f = IDTypeFeature("f", values, EXAMPLE_LENGTHS)
    assert f.values is values


def test_non_contiguous_and_big_endian_inputs() -> None:
    data = np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2]
    dense = NonIDTypeFeature(data, "d")
    assert dense.data.flags.c_contiguous
    np.testing.assert_array_equal(dense.data, data)
    be = NonIDTypeFeature(np.arange(3, dtype=">i4"), "be")
    assert be.data.dtype == np.int32
    np.testing.assert_array_equal(be.data, [0, 1, 2])
    f = IDTypeFeatureWithSingleID("s", np.array([1, 2], dtype=">u8"))
    assert f.values.dtype == U64 and f.values.tolist() == [1, 2]


def test_batch_basics_and_default_names() -> None:
    ids = [
        IDTypeFeature.from_lists("clicks", [[1, 2], []]),
        IDTypeFeatureWithSingleID.from_ids("user", [10, 11]),
    ]
    dense = [NonIDTypeFeature(np.ones((2, 3), np.float32)), NonIDTypeFeature(np.zeros(2), "age")]
    labels = [Label(np.array([1.0, 0.0], np.float32)), Label(np.array([0, 1], np.int64))]
    b = Batch(ids, dense, labels, meta=b"m", batch_id=7)
    assert PersiaBatch is Batch
    assert b.batch_size == 2
    assert b.id_feature_names == ("clicks", "user")
    assert b.non_id_feature_names == ("non_id_feature_0", "age")
    assert b.label_names == ("label_0", "label_1")
    assert b.id_feature("user") is ids[1]
    assert b.non_id_feature("non_id_feature_0").data.shape == (2, 3)
    assert b.label("label_1").data.dtype == np.int64
    assert b.requires_grad and b.meta == b"m" and b.batch_id == 7
    assert dense[0].name is None  # the caller's object is not renamed
    assert b.equals(b) and not b.equals(_simple_batch())


def test_inference_batch_without_labels() -> None:
    b = Batch([IDTypeFeatureWithSingleID.from_ids("u", [1])], requires_grad=False)
    assert b.labels == () and not b.requires_grad and b.meta is None and b.batch_id is None
    dense_only = Batch([], [NonIDTypeFeature(np.ones(4))], requires_grad=False)
    assert dense_only.batch_size == 4


# ------------------------------------------------------------------------- validation errors


def _raises(fn: object, *substrings: str) -> BatchValidationError:
    with pytest.raises(BatchValidationError) as info:
        fn()  # type: ignore[operator]
    for s in substrings:
        assert s in str(info.value), (s, str(info.value))
    assert isinstance(info.value, InvalidArgumentError)
    return info.value


@pytest.mark.parametrize(
    "bad",
    [
        np.array([1, 2], dtype=np.int64),
        np.array([1.0, 2.0]),
        np.array([1, 2], dtype=object),
        np.array([1, 2], dtype=np.uint32),
    ],
)
def test_values_must_be_uint64(bad: np.ndarray) -> None:
    _raises(
        lambda: IDTypeFeature("clicks", bad, np.array([2])),
        "'clicks'",
        str(bad.dtype),
        "expected uint64 (convert with .astype(np.uint64))",
    )
    _raises(
        lambda: IDTypeFeatureWithSingleID("user", bad),
        "'user'",
        str(bad.dtype),
        "expected uint64 (convert with .astype(np.uint64))",
    )
    _raises(
        lambda: IDTypeFeature.from_lists("clicks", [np.array([1], U64), bad]),
        "'clicks'",
        "sample 1",
        "expected uint64 (convert with .astype(np.uint64))",
    )


def test_values_must_be_1d_numpy() -> None:
    _raises(lambda: IDTypeFeature("f", np.zeros((2, 2), U64), [2, 2]), "'f'", "1-D", "(2, 2)")
    _raises(lambda: IDTypeFeature("f", [1, 2], [2]), "'f'", "numpy uint64 array", "list")  # type: ignore[arg-type]
    _raises(lambda: IDTypeFeatureWithSingleID("s", np.zeros((1, 1), U64)), "'s'", "1-D")


def test_lengths_errors() -> None:
    v = np.arange(3, dtype=U64)
    _raises(lambda: IDTypeFeature("f", v, np.array([4, -1])), "'f'", ">= 0", "sample 1", "-1")
    _raises(lambda: IDTypeFeature("f", v, np.array([1, 1])), "'f'", "sum to 2", "3 IDs")
    _raises(lambda: IDTypeFeature("f", v, np.array([1, 5])), "'f'", "sample 1", "length 5")
    _raises(lambda: IDTypeFeature("f", v, np.array([1.0, 2.0])), "'f'", "float64", "integer")
    _raises(lambda: IDTypeFeature("f", v, np.array([[3]])), "'f'", "1-D")
    _raises(lambda: IDTypeFeature("f", v, np.array([2**63, 0], dtype=U64)), "'f'", "too large")


def test_offsets_errors() -> None:
    v = np.arange(3, dtype=U64)
    _raises(lambda: IDTypeFeature.from_offsets("f", np.array([1, 3]), v), "'f'", "start at 0")
    _raises(
        lambda: IDTypeFeature.from_offsets("f", np.array([0, 2, 1, 3]), v),
        "'f'",
        "non-decreasing",
        "offsets[2] = 1 < offsets[1] = 2",
    )
    _raises(lambda: IDTypeFeature.from_offsets("f", np.array([0, 2]), v), "'f'", "end at 2")
    _raises(lambda: IDTypeFeature.from_offsets("f", np.array([], np.int64), v), "'f'", "batch+1")


@pytest.mark.parametrize(
    ("lists", "needle"),
    [
        ([[1], [2, -3]], "sample 1 contains ID -3"),
        ([[1], [], [2**64]], "sample 2 contains 18446744073709551616"),
        ([[2**63], [-1]], "sample 1 contains -1"),
        ([[1.5]], "sample 0 contains 1.5"),
        ([[1], ["2"]], "sample 1 contains '2'"),
        ([[1], [[2]]], "sample 1 contains [2]"),
        ([[1], [2, True]], "sample 1 contains True"),  # np.array would read it as 1
        ([[False]], "sample 0 contains False"),
        ([[np.True_, 3]], "sample 0 contains np.True_"),  # numpy's bool, read as 1 too
    ],
)
def test_from_lists_bad_ids(lists: list[list[object]], needle: str) -> None:
    _raises(lambda: IDTypeFeature.from_lists("clicks", lists), "'clicks'", needle, "2**64")


def test_from_lists_bad_samples() -> None:
    _raises(lambda: IDTypeFeature.from_lists("f", [[1], 2]), "'f'", "sample 1", "int")
    _raises(lambda: IDTypeFeature.from_lists("f", ["ab"]), "'f'", "sample 0", "str")
    _raises(lambda: IDTypeFeature.from_lists("f", 5), "'f'", "int")  # type: ignore[arg-type]
    _raises(lambda: IDTypeFeature.from_lists("f", np.zeros(3, U64)), "'f'", "2-D")


def test_from_ids_bad() -> None:
    _raises(lambda: IDTypeFeatureWithSingleID.from_ids("u", [0, 1, -5]), "'u'", "sample 2")
    _raises(
        lambda: IDTypeFeatureWithSingleID.from_ids("u", np.array([1], np.int64)),
        "'u'",
        "expected uint64",
    )


@pytest.mark.parametrize("dtype", [object, str, complex, "datetime64[s]", np.float128, "V4"])
def test_dense_unsupported_dtypes(dtype: object) -> None:
    data = np.zeros(2, dtype=dtype)
    _raises(lambda: NonIDTypeFeature(data, "dense"), "non-ID feature 'dense'", str(data.dtype))
    _raises(lambda: Label(data, "y"), "label 'y'", str(data.dtype))
    _raises(lambda: Label(data), "label (unnamed)", "unsupported dtype")


def test_dense_shape_and_type_errors() -> None:
    _raises(lambda: NonIDTypeFeature(np.float32(1.0), "d"), "'d'", "numpy array")  # type: ignore[arg-type]
    _raises(lambda: NonIDTypeFeature(np.array(1.0), "d"), "'d'", "ndim >= 1")
    _raises(lambda: NonIDTypeFeature([1.0], "d"), "'d'", "numpy array", "list")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("", "non-empty str"),
        (None, "non-empty str"),
        (3, "non-empty str"),
        ("x" * (MAX_NAME_BYTES + 1), "256 UTF-8 bytes; the limit is 255"),
        ("é" * 128, "256 UTF-8 bytes"),
        ("bad\ud800", "UTF-8"),
    ],
)
def test_bad_names(name: object, needle: str) -> None:
    _raises(lambda: IDTypeFeature.from_lists(name, [[1]]), needle)  # type: ignore[arg-type]
    _raises(lambda: IDTypeFeatureWithSingleID(name, np.zeros(1, U64)), needle)  # type: ignore[arg-type]
    if name is not None:
        _raises(lambda: NonIDTypeFeature(np.zeros(1), name), needle)  # type: ignore[arg-type]


def test_name_at_limit_ok() -> None:
    assert IDTypeFeature.from_lists("x" * MAX_NAME_BYTES, [[1]]).batch_size == 1


def test_empty_batch() -> None:
    _raises(lambda: Batch([], requires_grad=False), "empty batch")
    _raises(lambda: Batch([], labels=[Label(np.zeros(2))]), "empty batch")
    _raises(
        lambda: Batch([IDTypeFeature.from_lists("f", [])], requires_grad=False),
        "empty batch",
        "batch size is 0",
        "'f'",
    )


def test_batch_size_mismatch() -> None:
    ids = [IDTypeFeature.from_lists("a", [[1], [2]]), IDTypeFeature.from_lists("b", [[1]])]
    _raises(
        lambda: Batch(ids, requires_grad=False),
        "ID-type feature 'b' has batch size 1",
        "'a' has batch size 2",
    )
    _raises(
        lambda: Batch(ids[:1], labels=[Label(np.zeros(3))]),
        "label 'label_0' has batch size 3",
        "'a' has batch size 2",
    )
    _raises(
        lambda: Batch(ids[:1], [NonIDTypeFeature(np.zeros((5, 2)), "dense")], requires_grad=False),
        "non-ID feature 'dense' has batch size 5",
        "batch size 2",
    )


def test_duplicate_names_across_kinds() -> None:
    a = IDTypeFeature.from_lists("a", [[1]])
    _raises(lambda: Batch([a, a], requires_grad=False), "duplicate feature name 'a'")
    _raises(
        lambda: Batch([a], [NonIDTypeFeature(np.zeros(1), "a")], requires_grad=False),
        "duplicate feature name 'a'",
        "ID-type feature and a non-ID feature",
    )
    _raises(
        lambda: Batch([a], labels=[Label(np.zeros(1), "a")]),
        "duplicate feature name 'a'",
        "label",
    )
    # a default name colliding with an explicit one
    _raises(
        lambda: Batch(
            [a],
            [NonIDTypeFeature(np.zeros(1)), NonIDTypeFeature(np.zeros(1), "non_id_feature_0")],
            requires_grad=False,
        ),
        "duplicate feature name 'non_id_feature_0'",
    )


def test_requires_grad_needs_labels() -> None:
    a = IDTypeFeature.from_lists("a", [[1]])
    _raises(lambda: Batch([a]), "requires_grad=True", "no labels", "requires_grad=False")
    _raises(lambda: Batch([a], requires_grad=1), "requires_grad must be a bool")  # type: ignore[arg-type]


def test_meta_and_batch_id_checks() -> None:
    _raises(lambda: _simple_batch(meta="text"), "meta must be bytes or None", "str")
    _raises(lambda: _simple_batch(meta=bytearray(b"x")), "meta must be bytes or None")
    _raises(lambda: _simple_batch(batch_id=-1), "batch_id")
    _raises(lambda: _simple_batch(batch_id=2**64), "batch_id")
    _raises(lambda: _simple_batch(batch_id=True), "batch_id")
    assert _simple_batch(batch_id=2**64 - 1).batch_id == 2**64 - 1
    assert _simple_batch(meta=b"").meta == b""


def test_wrong_feature_types() -> None:
    a = IDTypeFeature.from_lists("a", [[1]])
    d = NonIDTypeFeature(np.zeros(1), "d")
    _raises(lambda: Batch([d], requires_grad=False), "id_type_features[0]", "NonIDTypeFeature")
    _raises(
        lambda: Batch([a], [Label(np.zeros(1))], requires_grad=False), "non_id_type_features[0]"
    )
    _raises(lambda: Batch([a], labels=[d]), "labels[0]", "expected Label")
    _raises(lambda: Batch(a, requires_grad=False), "id_type_features must be a sequence")  # type: ignore[arg-type]
    _raises(lambda: Batch([a], np.zeros((1, 2)), requires_grad=False), "must be a sequence")  # type: ignore[arg-type]


def test_unknown_feature_lookup() -> None:
    b = Batch(
        [IDTypeFeature.from_lists("a", [[1]]), IDTypeFeatureWithSingleID.from_ids("b", [2])],
        labels=[Label(np.zeros(1), "y")],
    )
    _raises(lambda: b.id_feature("zz"), "unknown ID-type feature 'zz'", "['a', 'b']")
    _raises(lambda: b.id_feature("y"), "unknown ID-type feature 'y'", "'y' is a label")
    _raises(lambda: b.label("a"), "unknown label 'a'", "['y']")
    _raises(lambda: b.non_id_feature("a"), "unknown non-ID feature 'a'", "[]")


def test_lengths_that_do_not_fit_the_values_name_the_sample_or_the_sum() -> None:
    values = np.array([1, 2], dtype=np.uint64)
    with pytest.raises(BatchValidationError, match="sample 1 has length 3 but values holds only 2"):
        IDTypeFeature("f", values, np.array([0, 3]))
    with pytest.raises(BatchValidationError, match="lengths sum to 4 but values holds 2 IDs"):
        IDTypeFeature("f", values, np.array([2, 2]))
    assert IDTypeFeature("f", values, np.array([0, 2, 0])).to_lists() == [[], [1, 2], []]


def test_readonly_but_non_contiguous_or_big_endian_inputs_are_copied() -> None:
    """Only read-only arrays that are already C-contiguous and native-order are shared; other
    read-only inputs are copied into that layout (later tiers rely on it)."""
    strided = np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2]
    strided.flags.writeable = False
    dense = NonIDTypeFeature(strided, "d")
    assert dense.data is not strided and dense.data.flags.c_contiguous
    assert not dense.data.flags.writeable
    np.testing.assert_array_equal(dense.data, strided)
    big_endian = np.array([1, 2**40], dtype=">u8")
    big_endian.flags.writeable = False
    single = IDTypeFeatureWithSingleID("s", big_endian)
    assert single.values.dtype.isnative and single.values.dtype == U64
    assert single.values.tolist() == [1, 2**40]


def _equality_batch(
    meta: bytes | None = b"m",
    batch_id: int | None = 7,
    dense_count: int = 1,
    label_count: int = 1,
    requires_grad: bool = True,
) -> Batch:
    ids = [IDTypeFeature.from_lists("a", [[1], [2, 3]])]
    dense = [NonIDTypeFeature(np.ones(2, np.float32)) for _ in range(dense_count)]
    labels = [Label(np.zeros(2, np.float32)) for _ in range(label_count)]
    return Batch(ids, dense, labels, requires_grad=requires_grad, meta=meta, batch_id=batch_id)


@pytest.mark.parametrize(
    "changes",
    [
        {"meta": b"n"},
        {"meta": None},
        {"batch_id": 8},
        {"batch_id": None},
        {"dense_count": 2},
        {"dense_count": 0},
        {"label_count": 2},
        {"requires_grad": False},
    ],
)
def test_batch_equals_compares_meta_batch_id_flags_and_feature_counts(changes: dict) -> None:
    """equals() is exact: a batch differing only in meta, batch_id, requires_grad or in how
    many non-ID features / labels it holds (zip() alone would stop at the shorter) is not
    equal, in either direction."""
    base = _equality_batch()
    assert base.equals(_equality_batch())
    other = _equality_batch(**changes)
    assert not base.equals(other) and not other.equals(base)


def test_feature_equals_compares_name_lengths_dtype_and_bytes() -> None:
    """Feature equality is exact: same kind, name, split into samples, dtype and bytes (so a
    NaN equals itself and -0.0 differs from 0.0)."""
    f = IDTypeFeature.from_lists("a", [[1], [2, 3]])
    assert f.equals(IDTypeFeature.from_lists("a", [[1], [2, 3]]))
    assert not f.equals(IDTypeFeature.from_lists("b", [[1], [2, 3]]))
    assert not f.equals(IDTypeFeature.from_lists("a", [[1, 2], [3]]))  # same values, other split
    assert not f.equals(IDTypeFeatureWithSingleID.from_ids("a", [1, 2, 3]))
    zeros = NonIDTypeFeature(np.zeros(2, np.float32), "d")
    assert not zeros.equals(NonIDTypeFeature(np.zeros(2, np.int32), "d"))  # same bytes
    assert not zeros.equals(NonIDTypeFeature(np.array([0.0, -0.0], np.float32), "d"))
    assert not zeros.equals(Label(np.zeros(2, np.float32), "d"))
    nan = NonIDTypeFeature(np.array([np.nan], np.float64), "d")
    assert nan.equals(NonIDTypeFeature(np.array([np.nan], np.float64), "d"))


def test_empty_lengths_and_zero_width_arrays_give_empty_samples() -> None:
    """An empty Python sequence of lengths is an empty integer array (np.asarray would make it
    float64), and a [batch, 0] array is `batch` samples without IDs."""
    empty = IDTypeFeature("f", np.empty(0, U64), [])
    assert empty.batch_size == 0 and empty.lengths.dtype == np.int64
    assert IDTypeFeature.from_offsets("f", [0], np.empty(0, U64)).batch_size == 0
    no_ids = IDTypeFeature.from_lists("f", np.zeros((3, 0), U64))
    assert no_ids.lengths.tolist() == [0, 0, 0] and no_ids.to_lists() == [[], [], []]


def test_negative_offsets_name_the_offset() -> None:
    _raises(
        lambda: IDTypeFeature.from_offsets("f", np.array([0, -1, 2]), np.arange(2, dtype=U64)),
        "feature 'f': offsets must be >= 0, offsets[1] is -1",
    )


def test_from_ids_refuses_a_string() -> None:
    _raises(
        lambda: IDTypeFeatureWithSingleID.from_ids("u", "12"),  # type: ignore[arg-type]
        "feature 'u': from_ids takes a sequence of IDs, got str",
    )


def test_batch_size_mismatch_is_measured_against_the_first_feature() -> None:
    a = IDTypeFeature.from_lists("a", [[1], [2]])
    b = IDTypeFeature.from_lists("b", [[1]])
    error = _raises(lambda: Batch([a, b], requires_grad=False))
    assert str(error).startswith(
        "ID-type feature 'b' has batch size 1 but ID-type feature 'a' has batch size 2;"
    )
    dense = NonIDTypeFeature(np.zeros(3), "d")
    error = _raises(lambda: Batch([], [dense], [Label(np.zeros(2), "y")]))
    assert str(error).startswith("label 'y' has batch size 2 but non-ID feature 'd' has batch")


def test_lookup_by_an_unhashable_name_is_a_validation_error() -> None:
    b = _simple_batch()
    _raises(lambda: b.id_feature(["a"]), "unknown ID-type feature ['a']", "['a']")  # type: ignore[arg-type]


def test_trusted_inference_batch_equals_the_validated_one() -> None:
    """The serving hot path's batch holds what __init__ would have built: the same features,
    num_ids (taken from the single-ID rows array when every ID feature is one of its rows)
    and name lookups."""
    rows = np.arange(6, dtype=U64).reshape(2, 3)
    rows.flags.writeable = False
    singles = IDTypeFeatureWithSingleID.trusted_rows(["u", "i"], rows)
    dense = NonIDTypeFeature(np.ones((3, 2), np.float32), "d")
    fast = Batch._trusted_inference(singles, [dense], 3, single_id_rows=rows)
    assert fast.num_ids == 6 and fast.batch_size == 3
    assert fast.equals(Batch(singles, [dense], requires_grad=False))
    assert fast.id_feature("i").values.tolist() == [3, 4, 5]
    _raises(lambda: fast.label("d"), "unknown label 'd' ('d' is a non-ID feature)")
    jagged = IDTypeFeature.from_lists("j", [[1, 2], [], [3, 4, 5]])
    mixed = Batch._trusted_inference([*singles, jagged], [], 3, single_id_rows=rows)
    assert mixed.num_ids == 6 + 5


def test_wrong_item_types_are_named_by_type() -> None:
    """The messages name the type as "of type int" (they read "is a int" before)."""
    with pytest.raises(BatchValidationError) as sample:
        IDTypeFeature.from_lists("user", [[1], 7])
    assert str(sample.value) == (
        "feature 'user': sample 1 is of type int; expected a sequence of IDs (list, tuple or "
        "uint64 array)"
    )
    with pytest.raises(BatchValidationError) as item:
        Batch([IDTypeFeature.from_lists("user", [[1]]), 3], requires_grad=False)
    assert str(item.value).startswith("id_type_features[1] is of type int; expected ")
