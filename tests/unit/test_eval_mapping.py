"""Feature mappings and encoders of ``recserve eval`` (clients/eval_mapping.py,
clients/eval_encoders.py)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from clients.eval_encoders import GenericEncoder, PreprocessorEncoder
from clients.eval_mapping import (
    FeatureMapping,
    IdFeatureMapping,
    LabelMapping,
    NonIdFeatureMapping,
    default_mapping,
    load_mapping,
)
from clients.eval_scorers import signature_from_metadata
from embedding_store.batch import Batch, IDTypeFeature, IDTypeFeatureWithSingleID
from embedding_store.errors import ConfigError, InvalidArgumentError
from embedding_store.signature import FeatureSignature, IdFeatureSpec, NonIdFeatureSpec
from examples.adult_income import features
from examples.adult_income.preprocess import instances_to_batch

ROOT = Path(__file__).resolve().parents[2]
ADULT_MAPPING = ROOT / "examples" / "adult_income" / "feature_mapping.yml"

SIGNATURE = FeatureSignature(
    (IdFeatureSpec("user", True), IdFeatureSpec("tags", False)),
    (NonIdFeatureSpec("dense", "float32", (2,)),),
)
GENERIC = FeatureMapping(
    id_features={
        "tags": IdFeatureMapping("tag_list", "int", "|"),
        "user": IdFeatureMapping("user_name"),
    },
    non_id_features={"dense": NonIdFeatureMapping(["x", "y"], mean=[1.0, 0.0], std=[2.0, 1.0])},
    label=LabelMapping("clicked"),
)


def test_the_adult_mapping_and_its_label():
    mapping = load_mapping(ADULT_MAPPING)
    assert mapping.preprocessor == "examples.adult_income.preprocess:instances_to_batch"
    label = mapping.label
    assert label.column == "income"
    assert [label.parse(v) for v in (">50K", " >50K.", "<=50K", "<=50K.")] == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="'maybe' is none of >50K, <=50K"):
        label.parse("maybe")
    # Same labels as the training side reads.
    for value in (">50K", ">50K.", "<=50K"):
        assert label.parse(value) == features.parse_label(value)


def test_numeric_and_open_ended_labels():
    assert LabelMapping("y").parse("1") == 1.0 and LabelMapping("y").parse(0.25) == 0.25
    with pytest.raises(ValueError, match="not in"):
        LabelMapping("y").parse("2")
    with pytest.raises(ValueError, match="not a number"):
        LabelMapping("y").parse("yes")
    assert LabelMapping("y", positive=["yes", "y"]).parse("no") == 0.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("preprocesor: a:b\n", r"preprocesor: unknown key; did you mean 'preprocessor'\?"),
        ("preprocessor: nocolon\n", r"preprocessor: expected MODULE:FUNCTION, got 'nocolon'"),
        (
            "preprocessor: a:b\nid_features: {s: {column: c}}\n",
            "either a preprocessor or id_features",
        ),
        ("id_features: {s: {column: c, hash: md5}}\n", r"id_features\.s\.hash: expected one of"),
        (
            "non_id_features: {d: {columns: [a, b], mean: [1]}}\n",
            r"non_id_features\.d\.mean: expected 2 numbers",
        ),
        ("label: {column: y}\n", "expected a 'preprocessor' or at least one of"),
        (
            "preprocessor: a:b\nlabel: {column: y, negative: n}\n",
            r"label\.negative: needs 'positive'",
        ),
    ],
)
def test_mapping_errors_name_file_key_and_value(tmp_path, text, message):
    path = tmp_path / "feature_mapping.yml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        load_mapping(path)
    assert str(path) in caught.value.message


def test_generic_encoder_builds_the_batch_in_signature_order():
    encoder = GenericEncoder(GENERIC, SIGNATURE, "m.yml")
    rows = [
        {"user_name": " alice ", "tag_list": "3|4", "x": "3", "y": 0.5, "clicked": "1"},
        {"user_name": "bob", "tag_list": "", "x": 1, "y": "-1", "clicked": "0"},
        {"user_name": "carol", "tag_list": [7], "x": "1", "y": "2", "clicked": "0"},
    ]
    batch, bad = encoder.encode(rows)
    assert bad == []
    user, tags = batch.id_type_features
    assert isinstance(user, IDTypeFeatureWithSingleID) and user.name == "user"
    assert user.values[0] == features.stable_id("alice")  # stripped, same hash as training
    assert isinstance(tags, IDTypeFeature) and tags.to_lists() == [[3, 4], [], [7]]
    dense = batch.non_id_type_features[0]
    np.testing.assert_allclose(dense.data, [[1.0, 0.5], [0.0, -1.0], [0.0, 2.0]])
    assert dense.data.dtype == np.float32


def test_generic_encoder_reports_each_bad_row():
    encoder = GenericEncoder(GENERIC, SIGNATURE, "m.yml")
    rows = [
        {"user_name": "a", "tag_list": "1", "x": "nan", "y": "0"},
        {"user_name": None, "tag_list": "1", "x": "1", "y": "0"},
        {"user_name": "a", "tag_list": "1|-5", "x": "1", "y": "0"},
        {"user_name": "a", "tag_list": "1", "x": "one", "y": "0"},
        {"user_name": "a", "tag_list": "1", "x": "1"},
        {"user_name": "ok", "tag_list": "2", "x": "1", "y": "0"},
    ]
    batch, bad = encoder.encode(rows)
    assert batch.batch_size == 1
    assert dict(bad) == {
        0: "column 'x': 'nan' is not a finite number",
        1: "column 'user_name' is empty (null)",
        2: "column 'tag_list': ID -5 is outside [0, 2**64)",
        3: "column 'x': 'one' is not a number",
        4: "missing column 'y': non-ID feature 'dense' takes 2 values per row, one per "
        "column: 'x', 'y'",
    }


def test_multi_id_and_dense_errors_say_what_the_columns_should_hold():
    """A JSON list in a multi-ID column, or a dense feature's values in one column named like
    the feature (as a new user writes them): the reason says which layout is expected."""
    encoder = GenericEncoder(default_mapping(SIGNATURE), SIGNATURE, "the default mapping")
    rows = [
        {"user": "1", "tags": "[71, 282, 62]", "dense_0": "0", "dense_1": "1"},
        {"user": "1", "tags": "[282]", "dense_0": "0", "dense_1": "1"},
        {"user": "1", "tags": "71 282 62", "dense": "[0.5, 1.0]"},
        {"user": "1", "tags": "71 282 62", "dense_0": "0.5"},
        {"user": "1", "tags": "71 282 62", "dense_0": "0.5", "dense_1": "1"},
    ]
    batch, bad = encoder.encode(rows)
    assert batch.batch_size == 1 and batch.id_type_features[1].to_lists() == [[71, 282, 62]]
    assert dict(bad) == {
        0: "column 'tags': '[71, 282, 62]' is not a list of integer IDs: expected IDs "
        "separated by spaces, e.g. '71 282 62'",
        1: "column 'tags': '[282]' is not a list of integer IDs: expected IDs separated by "
        "spaces, e.g. '71 282 62'",
        2: "missing column 'dense_0': non-ID feature 'dense' takes 2 values per row, one per "
        "column: 'dense_0', 'dense_1' (the data has a column 'dense': write each of its "
        "values to its own column)",
        3: "missing column 'dense_1': non-ID feature 'dense' takes 2 values per row, one per "
        "column: 'dense_0', 'dense_1'",
    }
    # Another separator is named as such; a single-ID column keeps its short reason.
    encoder = GenericEncoder(GENERIC, SIGNATURE, "m.yml")
    _, bad = encoder.encode([{"user_name": "a", "tag_list": "1,2", "x": "1", "y": "0"}])
    assert bad == [
        (0, "column 'tag_list': '1,2' is not a list of integer IDs: expected IDs separated by "
         "'|', e.g. '71|282|62'")
    ]  # fmt: skip
    one = FeatureMapping(
        id_features={"user": IdFeatureMapping("u", "int"), "tags": IdFeatureMapping("t", "int")},
        non_id_features={"dense": NonIdFeatureMapping(["x", "y"])},
    )
    _, bad = GenericEncoder(one, None, "m.yml").encode([{"u": "x", "t": "1", "x": 1, "y": 2}])
    assert bad == [(0, "column 'u': 'x' is not an integer ID")]


def test_generic_mapping_must_fit_the_model():
    wrong = FeatureMapping(
        id_features={"user": IdFeatureMapping("u", separator=",")},
        non_id_features={"dense": NonIdFeatureMapping(["x"])},
    )
    with pytest.raises(ConfigError) as caught:
        GenericEncoder(wrong, SIGNATURE, "m.yml")
    message = caught.value.message
    assert "m.yml: id_features: missing ['tags']" in message
    assert "id_features.user.separator: the model takes exactly one ID" in message
    assert "non_id_features.dense.columns: the model takes 2 values" in message


def test_default_mapping_and_metadata_signature():
    mapping = default_mapping(SIGNATURE)
    assert mapping.id_features["user"] == IdFeatureMapping("user", "int", None)
    assert mapping.id_features["tags"].separator == " "
    assert mapping.non_id_features["dense"].columns == ["dense_0", "dense_1"]
    metadata = {
        "inputs": [
            {"name": "user", "datatype": "INT64", "shape": [-1]},
            {"name": "tags", "datatype": "INT64", "shape": [-1]},
            {"name": "tags.lengths", "datatype": "INT64", "shape": [-1]},
            {"name": "dense", "datatype": "FP32", "shape": [-1, 2]},
        ]
    }
    assert signature_from_metadata(metadata) == SIGNATURE


def test_preprocessor_encoder_finds_bad_rows_row_by_row():
    rows = [dict(zip(_ADULT_HEADER, line.split(","))) for line in _ADULT_ROWS]
    rows[1]["age"] = "forty"
    del rows[2]["workclass"]
    batch, bad = PreprocessorEncoder(instances_to_batch).encode(rows)
    assert batch.batch_size == 2
    reasons = dict(bad)
    assert set(reasons) == {1, 2}
    assert "forty" in reasons[1] and not reasons[1].startswith("row ")
    assert "workclass" in reasons[2]


_ADULT_HEADER = [
    "age", "workclass", "fnlwgt", "education", "educational-num", "marital-status", "occupation",
    "relationship", "race", "gender", "capital-gain", "capital-loss", "hours-per-week",
    "native-country", "income",
]  # fmt: skip
_ADULT_ROWS = [
    "25,Private,226802,11th,7,Never-married,Machine-op-inspct,Own-child,Black,Male,0,0,40,"
    "United-States,<=50K",
    "38,Private,89814,HS-grad,9,Married-civ-spouse,Farming-fishing,Husband,White,Male,0,0,50,"
    "United-States,<=50K",
    "28,Local-gov,336951,Assoc-acdm,12,Married-civ-spouse,Protective-serv,Husband,White,Male,0,"
    "0,40,United-States,>50K",
    "44,Private,160323,Some-college,10,Married-civ-spouse,Machine-op-inspct,Husband,Black,Male,"
    "7688,0,40,United-States,>50K",
]


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        (
            "non_id_features: {d: {columns: [a, b], mean: [.nan, 0]}}\n",
            "non_id_features.d.mean[0]: expected a finite number, got nan",
        ),
        (
            "non_id_features: {d: {columns: [a, b], mean: [0, -.inf]}}\n",
            "non_id_features.d.mean[1]: expected a finite number, got -inf",
        ),
        (
            "non_id_features: {d: {columns: [a, b], std: [1, .inf]}}\n",
            "non_id_features.d.std[1]: expected a finite number > 0, got inf",
        ),
        (
            "non_id_features: {d: {columns: [a], std: [0]}}\n",
            "non_id_features.d.std[0]: expected a finite number > 0, got 0.0",
        ),
        (
            "preprocessor: a:b\nlabel: {column: y, positive: []}\n",
            "label.positive: expected a non-empty list of label values, got []",
        ),
        (
            "preprocessor: a:b\nlabel: {column: y, positive: ['']}\n",
            "label.positive[0]: expected a non-empty label value (compared after stripping "
            "spaces and one trailing dot), got ''",
        ),
        (
            "preprocessor: a:b\nlabel: {column: y, positive: ' . '}\n",
            "label.positive: expected a non-empty label value (compared after stripping "
            "spaces and one trailing dot), got ' . '",
        ),
        (
            "preprocessor: a:b\nlabel: {column: y, positive: [p], negative: [n, '']}\n",
            "label.negative[1]: expected a non-empty label value (compared after stripping "
            "spaces and one trailing dot), got ''",
        ),
        (
            "preprocessor: a:b\nlabel: {column: y, positive: [p], negative: []}\n",
            "label.negative: expected a non-empty list of label values, got []",
        ),
    ],
)
def test_mapping_values_that_would_spoil_every_row_are_refused(tmp_path, text, detail):
    path = tmp_path / "feature_mapping.yml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_mapping(path)
    assert caught.value.message == f"{path}: {detail}"


def test_yaml_1_2_floats_in_a_mapping_are_numbers(tmp_path):
    path = tmp_path / "feature_mapping.yml"
    path.write_text("non_id_features: {d: {columns: [a, b], mean: [1e3, -2], std: [1e-3, .5]}}\n")
    dense = load_mapping(path).non_id_features["d"]
    assert (dense.mean, dense.std) == ([1000.0, -2.0], [0.001, 0.5])


def test_eval_data_that_is_a_directory_says_so(tmp_path):
    from clients.eval import EvalOptions, run_eval

    options = EvalOptions(data=tmp_path, out=tmp_path / "p.csv", url="http://127.0.0.1:9")
    with pytest.raises(InvalidArgumentError) as caught:
        run_eval(options)
    assert caught.value.message == (
        f"{tmp_path}: is a directory, expected a data file "
        "(.csv, .csv.gz, .tsv, .tsv.gz, .parquet, .pq)"
    )
    missing = tmp_path / "missing.csv"
    with pytest.raises(InvalidArgumentError) as caught:
        run_eval(EvalOptions(data=missing, out=tmp_path / "p.csv", url="http://127.0.0.1:9"))
    assert caught.value.message == f"{missing}: no such data file"
    with pytest.raises(InvalidArgumentError) as caught:
        run_eval(EvalOptions(data=missing, out=tmp_path / "p.csv", url="http://x:9", timeout=0))
    assert caught.value.message == "--timeout must be a number of seconds in (0, 1000000], got 0"


def test_eval_bad_choice_flags_name_the_value(tmp_path):
    from clients.eval import OUTPUT_TRANSFORMS, EvalOptions, run_eval

    url = "http://127.0.0.1:9"
    with pytest.raises(InvalidArgumentError) as caught:
        run_eval(EvalOptions(data=tmp_path, out=tmp_path / "p.csv", url=url, bad_rows="drop"))
    assert caught.value.message == "--bad-rows must be skip or fail, got 'drop'"
    with pytest.raises(InvalidArgumentError) as caught:
        run_eval(EvalOptions(data=tmp_path, out=tmp_path / "p.csv", url=url, output_transform="x"))
    assert caught.value.message == (
        f"--output-transform must be one of {OUTPUT_TRANSFORMS}, got 'x'"
    )


def test_int_ids_take_the_whole_uint64_range_and_nothing_beyond():
    encoder = GenericEncoder(GENERIC, SIGNATURE, "m.yml")
    row = {"user_name": "a", "x": "1", "y": "0"}
    batch, bad = encoder.encode(
        [
            {**row, "tag_list": f"0|{2**63}|{2**64 - 1}"},
            {**row, "tag_list": str(2**64)},
        ]
    )
    assert batch.batch_size == 1
    assert batch.id_type_features[1].to_lists() == [[0, 2**63, 2**64 - 1]]
    assert dict(bad) == {1: f"column 'tag_list': ID {2**64} is outside [0, 2**64)"}


@pytest.mark.parametrize(
    ("stated_limit", "sizes"),
    [(2, [5, 2, 2, 1]), (5, [5, 3, 2, 1, 2])],
    ids=["server-limit", "limit-not-below-the-batch"],
)
def test_a_batch_the_server_finds_too_large_is_sent_in_smaller_chunks(stated_limit, sizes):
    # The server takes 2 rows at most. A stated limit below the batch is used for the
    # chunks; one that is not below it (a proxy's rewording, a wrong message) must not
    # send the same batch again for ever: the batch is halved instead.
    from clients.eval_scorers import Scores, ServerScorer, _BatchTooLargeError

    scorer = object.__new__(ServerScorer)
    scorer.protocol, scorer.max_batch_size = "v2", None
    sent: list[int] = []

    def v2(batch):
        size = batch.batch_size
        sent.append(size)
        if size > 2:
            message = f"batch size {size} exceeds this server's max batch size {stated_limit}"
            raise _BatchTooLargeError(message, min(stated_limit, size))
        rows = batch.id_type_features[0].values.astype(np.float32)
        return Scores(rows, None, "7")

    scorer._v2 = v2
    batch = Batch([IDTypeFeatureWithSingleID.from_ids("n", list(range(5)))], requires_grad=False)
    scores = scorer.score(batch, [{}] * 5)
    np.testing.assert_array_equal(scores.predictions, np.arange(5, dtype=np.float32))
    assert scores.model_version == "7"
    assert sent == sizes


# --------------------------------------------------------------------------- found unchecked by
# mutation testing
def test_labels_zero_and_booleans_and_overlapping_label_values():
    label = LabelMapping("y")
    assert [label.parse(v) for v in ("0", 0, "1.0", True, False)] == [0.0, 0.0, 1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match=r"label column 'y': '-0\.1' is not in \[0, 1\]"):
        label.parse("-0.1")
    with pytest.raises(ConfigError, match=r"negative: values \['yes'\] are also positive"):
        LabelMapping("y", positive=["yes", "y"], negative=["no", " yes."])


def test_an_empty_separator_is_refused():
    with pytest.raises(ConfigError, match="separator: must not be empty"):
        IdFeatureMapping("tags", "int", "")


def test_int_ids_must_be_whole_non_negative_numbers_not_booleans():
    """An ``int`` ID column takes integers (or floats that are whole, as Parquet or a CSV
    written by pandas may hold them); a bool, a fraction or a negative number is a bad row."""
    mapping = FeatureMapping(id_features={"user": IdFeatureMapping("user", "int")})
    signature = FeatureSignature((IdFeatureSpec("user", True),), ())
    encoder = GenericEncoder(mapping, signature, "m.yml")
    batch, bad = encoder.encode(
        [{"user": 7.0}, {"user": True}, {"user": 1.5}, {"user": -1}, {"user": " 9 "}]
    )
    assert batch.id_type_features[0].values.tolist() == [7, 9]
    assert dict(bad) == {
        1: "column 'user': True is not an integer ID",
        2: "column 'user': 1.5 is not an integer ID",
        3: "column 'user': ID -1 is outside [0, 2**64)",
    }


def test_int_id_text_is_ascii_digits_read_exactly():
    """int() reads "1_23" and "12_3" both as 123 (two IDs made one) and other scripts' digits
    as ASCII ones; a whole float as pandas writes it ("7.0") is read exactly, never through a
    float (which cannot hold 2**53 + 1)."""
    mapping = FeatureMapping(id_features={"user": IdFeatureMapping("user", "int")})
    signature = FeatureSignature((IdFeatureSpec("user", True),), ())
    encoder = GenericEncoder(mapping, signature, "m.yml")
    cells = ["7.0", f"{2**53 + 1}.0", "+8", "12.", "1_23", "\u0661\u0662", "1e3", "0x10", "5.5"]
    batch, bad = encoder.encode([{"user": cell} for cell in cells])
    assert batch.id_type_features[0].values.tolist() == [7, 2**53 + 1, 8, 12]
    assert dict(bad) == {
        4: "column 'user': '1_23' is not an integer ID",
        5: "column 'user': '\u0661\u0662' is not an integer ID",
        6: "column 'user': '1e3' is not an integer ID",
        7: "column 'user': '0x10' is not an integer ID",
        8: "column 'user': '5.5' is not an integer ID",
    }


def test_dense_text_is_an_ascii_number_as_for_ids():
    """float() reads "1_0" as 10 and other scripts' digits as ASCII ones: refused, as ID text
    is; what a number is written as in a file (exponents, a point, a sign) is read."""
    mapping = FeatureMapping(non_id_features={"x": NonIdFeatureMapping(["x"])})
    signature = FeatureSignature((), (NonIdFeatureSpec("x", "float32", (1,)),))
    encoder = GenericEncoder(mapping, signature, "m.yml")
    cells = [" 7.0 ", "-1.5e1", ".5", "3.", "+2", "1E+1", "1_0", "\u0661\u0662", "0x10", "inf"]
    batch, bad = encoder.encode([{"x": cell} for cell in cells])
    assert batch.non_id_type_features[0].data.ravel().tolist() == [7.0, -15.0, 0.5, 3.0, 2.0, 10.0]
    assert dict(bad) == {
        6: "column 'x': '1_0' is not a number",
        7: "column 'x': '\u0661\u0662' is not a number",
        8: "column 'x': '0x10' is not a number",
        9: "column 'x': 'inf' is not a finite number",
    }


def test_a_single_id_feature_given_an_empty_list_is_a_bad_row():
    mapping = FeatureMapping(id_features={"user": IdFeatureMapping("user", "int")})
    signature = FeatureSignature((IdFeatureSpec("user", True),), ())
    batch, bad = GenericEncoder(mapping, signature, "m.yml").encode([{"user": []}, {"user": [3]}])
    assert batch.id_type_features[0].values.tolist() == [3]
    assert dict(bad) == {0: "column 'user': exactly one ID expected, got 0"}


def test_metadata_lengths_inputs_and_integer_matrices():
    """``X.lengths`` is the lengths of ID feature X only when X is an input too; an integer
    input of rank 1 is an ID feature, of higher rank a dense one."""
    metadata = {
        "inputs": [
            {"name": "orphan.lengths", "datatype": "INT64", "shape": [-1]},
            {"name": "counts", "datatype": "INT64", "shape": [-1, 3]},
        ]
    }
    assert signature_from_metadata(metadata) == FeatureSignature(
        (IdFeatureSpec("orphan.lengths", True),),
        (NonIdFeatureSpec("counts", "float32", (3,)),),
    )


def _scripted_scorer(limit: int, errors: list[Exception] | None = None):
    """A ServerScorer whose server takes ``limit`` rows at most (a 400 stating it), answering
    each row with its ID; ``errors`` are raised first, one per call."""
    from clients.eval_scorers import Scores, ServerScorer, _BatchTooLargeError

    scorer = object.__new__(ServerScorer)
    scorer.protocol, scorer.max_batch_size = "v2", None
    sent: list[int] = []
    pending = list(errors or [])

    def v2(batch):
        size = batch.batch_size
        sent.append(size)
        if pending:
            raise pending.pop(0)
        if size > limit:
            message = f"batch size {size} exceeds this server's max batch size {limit}"
            raise _BatchTooLargeError(message, limit)
        return Scores(batch.id_type_features[0].values.astype(np.float32), None, "7")

    scorer._v2 = v2
    return scorer, sent


def _ids_batch(ids: list[int]) -> Batch:
    return Batch([IDTypeFeatureWithSingleID.from_ids("n", ids)], requires_grad=False)


def test_the_servers_batch_limit_is_kept_for_the_batches_that_follow():
    scorer, sent = _scripted_scorer(limit=2)
    scorer.score(_ids_batch([0, 1, 2]), [{}] * 3)
    assert scorer.max_batch_size == 2 and sent == [3, 2, 1]
    sent.clear()
    scores = scorer.score(_ids_batch([5, 6, 7, 8, 9]), [{}] * 5)
    assert sent == [2, 2, 1]  # no 5-row attempt: the limit is known
    np.testing.assert_array_equal(scores.predictions, [5, 6, 7, 8, 9])


def test_a_single_row_too_large_for_the_server_is_an_error_not_a_loop():
    """One row cannot be split: a 400 over the batch limit, or a 413 (CapacityError), for a
    one-row batch is raised as it is."""
    from clients.eval_scorers import _BatchTooLargeError
    from embedding_store.errors import CapacityError

    scorer, sent = _scripted_scorer(limit=0)
    with pytest.raises(_BatchTooLargeError, match="max batch size 0"):
        scorer.score(_ids_batch([4]), [{}])
    assert sent == [1]
    scorer, sent = _scripted_scorer(limit=5, errors=[CapacityError("413: body too large")])
    with pytest.raises(CapacityError, match="body too large"):
        scorer.score(_ids_batch([4]), [{}])
    assert sent == [1]
    # A 413 for two rows halves the batch.
    scorer, sent = _scripted_scorer(limit=5, errors=[CapacityError("413")])
    scores = scorer.score(_ids_batch([4, 5]), [{}, {}])
    assert sent == [2, 1, 1] and scores.predictions.tolist() == [4.0, 5.0]


def test_friendly_chunks_send_each_chunks_own_rows():
    """Over the friendly route the rows themselves are sent: a split batch sends each chunk
    its own rows, in order."""
    from clients.eval_scorers import Scores, ServerScorer, _BatchTooLargeError

    scorer = object.__new__(ServerScorer)
    scorer.protocol, scorer.max_batch_size = "friendly", None
    sent: list[list[int]] = []

    def friendly(rows):
        sent.append([row["id"] for row in rows])
        if len(rows) > 2:
            raise _BatchTooLargeError("batch size 3 exceeds this server's max batch size 2", 2)
        return Scores(np.array([row["id"] for row in rows], dtype=np.float32), None, "7")

    scorer._friendly = friendly
    scores = scorer.score(_ids_batch([1, 2, 3]), [{"id": 10}, {"id": 20}, {"id": 30}])
    assert sent == [[10, 20, 30], [10, 20], [30]]
    assert scores.predictions.tolist() == [10.0, 20.0, 30.0]


# --------------------------------------------------------------------------- parity, counts and
# options of run_eval, exact on small inputs
def test_parity_counts_nan_as_different_and_keeps_the_worst_difference():
    from clients.eval_parity import SHOWN_DIFFERENCES, Parity

    parity = Parity(0.01)
    diff = parity.add(["a:1", "a:2", "a:3"], np.array([0.0, 1.0, 2.0]), np.array([0.5, 1, np.nan]))
    np.testing.assert_array_equal(diff, [0.5, 0.0, np.nan])
    assert (parity.rows, parity.differing, parity.max_diff) == (3, 2, math.inf)
    assert parity.examples[0] == {"where": "a:1", "in_process": 0.0, "server": 0.5, "abs_diff": 0.5}
    assert parity.examples[1]["where"] == "a:3"

    parity = Parity(0.01)
    parity.add(["a:1"], np.array([0.0]), np.array([0.5]))
    parity.add(["a:2"], np.array([1.0]), np.array([1.2]))  # a smaller worst: 0.5 stays
    assert parity.max_diff == 0.5
    many = 2 * SHOWN_DIFFERENCES
    parity.add([f"b:{i}" for i in range(many)], np.zeros(many), np.ones(many))
    assert len(parity.examples) == SHOWN_DIFFERENCES  # in all, over every chunk
    assert [e["where"] for e in parity.examples[:3]] == ["a:1", "a:2", "b:0"]
    summary = parity.summary()
    assert (summary["rows"], summary["differing_rows"], summary["identical"]) == (
        2 + many,
        2 + many,
        False,
    )
    assert parity.text().startswith(
        f"parity FAILED: {2 + many} of {2 + many} rows differ by more than 0.01"
    )


def test_parity_text_names_an_output_transform_mismatch():
    from clients.eval_parity import Parity

    logits = np.array([-1.0, 0.0, 2.0])
    probabilities = 1.0 / (1.0 + np.exp(-logits))
    parity = Parity(1e-6)
    parity.add(["r:1", "r:2", "r:3"], logits, probabilities)
    assert "every server prediction is the sigmoid of the in-process one" in parity.text()
    parity = Parity(1e-6)
    parity.add(["r:1", "r:2", "r:3"], probabilities, logits)
    assert "every in-process prediction is the sigmoid of the server's" in parity.text()
    parity = Parity(1e-6)
    parity.add(["r:1", "r:2"], np.array([0.25, 0.5]), np.array([0.25, 0.5]))
    assert parity.text() == (
        "parity OK: 2 rows, in-process and server predictions agree within 1e-06 (max abs diff 0)"
    )


def test_positives_are_labels_above_one_half():
    from clients.eval import _count

    labels = np.array([0.5, 1.0, 0.0, 0.7])
    assert (_count(labels, positive=True), _count(labels, positive=False)) == (2, 2)
    assert _count(None, positive=True) is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"batch_size": 0}, "--batch-size must be > 0, got 0"),
        ({"timeout": 0.0}, r"--timeout must be a number of seconds in \(0, 1000000\], got 0"),
        ({"timeout": 1e6 + 1}, r"--timeout must be a number of seconds in \(0, 1000000\]"),
        ({"timeout": math.nan}, "--timeout must be a number of seconds"),
        ({"report": "SAME"}, "--report and --out must differ"),
        # The CLI's flag takes positive integers only; the Python API used to score every row,
        # write the predictions and then fail with numpy's "'list' argument must have no
        # negative elements".
        ({"calibration_bins": 0}, "--calibration-bins must be > 0, got 0"),
        # With --overwrite the output replaced the data file it was computed from.
        ({"out": "DATA", "overwrite": True}, r"--out \S+/rows.csv is one of the --data files"),
        ({"report": "DATA", "overwrite": True}, r"--report \S+rows.csv is one of the --data"),
    ],
)
def test_eval_options_are_checked_before_anything_runs(tmp_path, changes, message):
    from clients.eval import EvalOptions, _check_options

    data = tmp_path / "rows.csv"
    data.write_text("a\n1\n")
    out = tmp_path / "p.csv"
    if changes.get("report") == "SAME":
        changes = {"report": tmp_path / "." / "p.csv"}
    for key in ("out", "report"):
        if changes.get(key) == "DATA":
            changes = {**changes, key: tmp_path / "sub" / ".." / "rows.csv"}
    options = EvalOptions(data=data, **{"out": out, **changes}, checkpoint=tmp_path)
    with pytest.raises(InvalidArgumentError, match=message):
        _check_options(options)
    _check_options(EvalOptions(data=data, out=out, checkpoint=tmp_path, timeout=1e6))


def test_a_server_answering_another_number_of_predictions_is_refused():
    from clients.eval_scorers import ServerScorer

    scorer = object.__new__(ServerScorer)
    scorer.url, scorer.version = "http://h:1", "1"
    with pytest.raises(InvalidArgumentError, match="http://h:1 returned 3 predictions for 2 rows"):
        scorer._checked(np.zeros((3, 1)), 2, "2")
    scores = scorer._checked(np.array([[0.25], [0.5]]), 2, "2")
    assert scores.predictions.dtype == np.float32 and scores.predictions.tolist() == [0.25, 0.5]
    assert scorer.version == "2"
    scorer._checked(np.zeros(1), 1, None)
    assert scorer.version == "2"  # an answer without a version keeps the last one


def test_a_label_column_given_on_the_command_line_keeps_the_mappings_values(tmp_path):
    from clients.eval import EvalOptions, _label_of

    mapping = load_mapping(ADULT_MAPPING)
    base = {"data": tmp_path / "x.csv", "out": tmp_path / "p.csv"}
    label = _label_of(EvalOptions(**base, label="target"), mapping)
    assert label == LabelMapping("target", mapping.label.positive, mapping.label.negative)
    assert label.parse(">50K.") == 1.0
    assert _label_of(EvalOptions(**base, label="target", no_label=True), mapping) is None
    assert _label_of(EvalOptions(**base), mapping) == mapping.label
    assert _label_of(EvalOptions(**base, label="y"), GENERIC) == LabelMapping("y")


def test_null_values_mean_no_ids_for_a_multi_id_feature_and_are_bad_elsewhere():
    encoder = GenericEncoder(GENERIC, SIGNATURE, "m.yml")
    rows = [
        {"user_name": "a", "tag_list": None, "x": "1", "y": "0"},
        {"user_name": "a", "tag_list": "1", "x": None, "y": "0"},
    ]
    batch, bad = encoder.encode(rows)
    assert batch.id_type_features[1].to_lists() == [[]]
    assert dict(bad) == {1: "column 'x' is empty (null)"}


def test_a_missing_single_dense_column_names_the_feature():
    mapping = FeatureMapping(non_id_features={"age": NonIdFeatureMapping(["age_years"])})
    signature = FeatureSignature((), (NonIdFeatureSpec("age", "float32", (1,)),))
    batch, bad = GenericEncoder(mapping, signature, "m.yml").encode([{"other": 1}])
    assert batch is None
    assert bad == [(0, "missing column 'age_years' (non-ID feature 'age' is read from it)")]


def _one_id_batch(rows: list[dict]) -> Batch:
    return Batch(
        [IDTypeFeatureWithSingleID.from_ids("n", [int(row["n"]) for row in rows])],
        requires_grad=False,
    )


def test_preprocessor_results_are_checked_and_failures_become_reasons():
    """A preprocessor that returns no Batch, or another number of samples, fails every row
    with that reason; an error it raised is said to be its (a KeyError reads "missing
    column"), and a leading "row N:" is dropped. When no row is good, no batch is built."""

    def not_a_batch(rows):
        return [1] * len(rows)

    def one_too_many(rows):
        return _one_id_batch([*rows, {"n": 0}])

    def failing(rows):
        if rows[0]["n"] == "k":
            raise KeyError("age")
        if rows[0]["n"] == "v":
            raise ValueError()
        if rows[0]["n"] == "r":
            raise ValueError("row 3: bad age")
        return _one_id_batch(rows)

    rows = [{"n": "1"}, {"n": "2"}]
    assert PreprocessorEncoder(not_a_batch).encode(rows) == (
        None,
        [
            (0, "the preprocessor returned list, not a Batch"),
            (1, "the preprocessor returned list, not a Batch"),
        ],
    )
    assert PreprocessorEncoder(one_too_many).encode(rows[:1]) == (
        None,
        [(0, "the preprocessor returned 2 samples for 1 rows")],
    )
    batch, bad = PreprocessorEncoder(failing).encode(
        [{"n": "k"}, {"n": "5"}, {"n": "v"}, {"n": "r"}]
    )
    assert batch.id_type_features[0].values.tolist() == [5]
    assert bad == [
        (0, "missing column 'age' (the preprocessor raised KeyError)"),
        (2, "the preprocessor raised ValueError"),
        (3, "the preprocessor raised ValueError: bad age"),
    ]
