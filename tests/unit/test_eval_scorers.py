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
