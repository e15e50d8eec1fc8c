"""ServerScorer's reading of KServe v2 answers (clients/eval_scorers.py)."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from clients.eval_scorers import ServerScorer
from embedding_store.batch import Batch, IDTypeFeatureWithSingleID
from embedding_store.errors import InvalidArgumentError


def _scorer(answer: bytes, headers: dict[str, str]) -> ServerScorer:
    scorer = ServerScorer.__new__(ServerScorer)  # no metadata call to a server
    scorer.url = "http://server"
    scorer.version = None
    scorer._infer_path = "/v2/models/model/infer"
    scorer._call = lambda *args, **kwargs: (answer, headers)  # type: ignore[method-assign]
    return scorer


def _batch() -> Batch:
    ids = IDTypeFeatureWithSingleID("f", np.array([1, 2], dtype=np.uint64))
    return Batch([ids], requires_grad=False)


def test_binary_predictions_without_the_header_length_are_an_invalid_argument() -> None:
    answer = orjson.dumps(
        {"outputs": [{"name": "prediction", "parameters": {"binary_data_size": 8}}]}
    )
    with pytest.raises(InvalidArgumentError, match="Inference-Header-Content-Length"):
        _scorer(answer, {})._v2(_batch())


def test_binary_predictions_follow_the_json_header() -> None:
    header = orjson.dumps(
        {"outputs": [{"name": "prediction", "parameters": {"binary_data_size": 8}}]}
    )
    body = header + np.array([0.25, 0.5], dtype="<f4").tobytes()
    scores = _scorer(body, {"Inference-Header-Content-Length": str(len(header))})._v2(_batch())
    np.testing.assert_array_equal(scores.predictions, np.array([0.25, 0.5], dtype=np.float32))


_NOT_RECSERVE = "answered something other than a recserve (KServe v2) answer"


@pytest.mark.parametrize(
    ("answer", "detail"),
    [
        (b"<html>a proxy's page</html>", "JSONDecodeError: unexpected character"),
        (b"[1, 2]", "ValueError: expected a JSON object, got list"),
        (b'{"outputs": [{"datatype": "FP32"}]}', "KeyError: 'name'"),
        (b'{"outputs": 3}', "TypeError: 'int' object is not iterable"),
        (b'{"outputs": [{"name": "prediction", "data": ["a", "b"]}]}', "ValueError: could not"),
    ],
)
def test_an_infer_answer_no_recserve_server_sends_names_the_server(answer, detail) -> None:
    # `recserve eval --url` at another service used to die with a raw JSONDecodeError,
    # KeyError or TypeError and its traceback.
    with pytest.raises(InvalidArgumentError) as caught:
        _scorer(answer, {})._v2(_batch())
    assert caught.value.message.startswith(
        f"server http://server/v2/models/model/infer {_NOT_RECSERVE} ({detail}"
    )
    assert caught.value.message.endswith("); is --url a recserve server?")


@pytest.mark.parametrize(
    ("answer", "detail"),
    [
        (b"not json", "JSONDecodeError"),
        (b'"a string"', "ValueError: expected a JSON object, got str"),
        (b'{"predictions": {"a": 1}}', "TypeError"),
    ],
)
def test_a_metadata_or_friendly_answer_no_recserve_server_sends_names_the_server(
    monkeypatch, answer, detail
) -> None:
    if not answer.startswith(b"{"):  # an object without "inputs" has its own message
        monkeypatch.setattr(ServerScorer, "_call", lambda *args, **kwargs: (answer, {}))
        with pytest.raises(InvalidArgumentError) as caught:
            ServerScorer("http://server", "m")
        assert caught.value.message.startswith(
            f"server http://server/v2/models/m {_NOT_RECSERVE} ({detail}"
        )
    scorer = _scorer(answer, {})
    scorer._predict_path, scorer.label_column = "/v1/models/m:predict", None
    with pytest.raises(InvalidArgumentError) as caught:
        scorer._friendly([{"x": 1}])
    assert caught.value.message.startswith(
        f"server http://server/v1/models/m:predict {_NOT_RECSERVE} ({detail}"
    )


@pytest.mark.parametrize(
    ("refusal", "hinted"),
    [
        # The route without a --preprocessor, given the CSV's raw columns.
        ("instances[0] has unknown feature(s) ['dense_0', 'dense_1']; known: ['dense']", True),
        ("instances[0].hist_items: IDs must be integers, got '10 11' (str)", True),
        # A preprocessor's own refusal, a missing value: no layout matter.
        ("instances could not be preprocessed: row 0: column 'age': expected a number, got 'x'",
         False),
        ("instances[0].user: IDs must be integers, got '' (str)", False),
    ],
)  # fmt: skip
def test_friendly_rows_a_server_without_a_preprocessor_refuses_point_to_protocol_v2(
    refusal, hinted
) -> None:
    """`recserve eval --protocol friendly` against a server without --preprocessor (the
    own_model walk-through's) sent the CSV's columns as they are, and the 400 said only which
    features were unknown."""
    from clients.eval_scorers import FRIENDLY_WITHOUT_PREPROCESSOR

    message = f"server http://server/v1/models/m:predict: {refusal}"

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise InvalidArgumentError(message)

    scorer = _scorer(b"", {})
    scorer._call = refuse  # type: ignore[method-assign]
    scorer._predict_path, scorer.label_column = "/v1/models/m:predict", "click"
    with pytest.raises(InvalidArgumentError) as caught:
        scorer._friendly([{"dense_0": 1, "click": 1}])
    assert caught.value.message == message + (FRIENDLY_WITHOUT_PREPROCESSOR if hinted else "")
