"""benchmarks/ceiling_server.py: how the model-only server reads a request's batch size."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import ceiling_server  # noqa: E402

from load_tests import traffic  # noqa: E402

ARRAYS = {
    "user": np.array([3, 4, 5, 6, 7], dtype=np.int64),
    "dense": np.zeros((5, 2), dtype=np.float32),
}


def test_rows_come_from_the_first_inputs_shape_in_both_encodings():
    assert ceiling_server.ModelOnly.rows_of(traffic.encode_kserve_json(ARRAYS)) == 5
    binary, _ = traffic.encode_kserve_binary(ARRAYS)
    assert ceiling_server.ModelOnly.rows_of(binary) == 5
    spaced = json.dumps({"inputs": [{"name": "user", "shape": [12], "data": []}]})
    assert ceiling_server.ModelOnly.rows_of(spaced.encode()) == 12


@pytest.mark.parametrize(
    "body",
    [
        b"{}",
        b'{"inputs": [{"name": "user", "shape": [0], "data": []}]}',
        b'{"inputs": [{"name": "user", "shape": [4097], "data": []}]}',
        b'{"inputs": [{"name": "user", "shape": [-1], "data": []}]}',
        b" " * 5000 + b'{"inputs": [{"name": "user", "shape": [4], "data": []}]}',
    ],
)
def test_a_body_without_a_usable_batch_size_has_none(body):
    assert ceiling_server.ModelOnly.rows_of(body) is None


def test_a_model_whose_first_input_is_a_list_of_ids_is_refused_at_start(monkeypatch):
    from embedding_store.signature import FeatureSignature, IdFeatureSpec
    from serving import model as serving_model

    class ListFirstModel:
        signature = FeatureSignature(
            id_features=(IdFeatureSpec("history", False), IdFeatureSpec("user", True)),
            non_id_features=(),
        )

    monkeypatch.setattr(serving_model, "load_model", lambda *args, **kwargs: ListFirstModel())
    with pytest.raises(ValueError, match="the first input 'history' is a list of IDs"):
        ceiling_server.ModelOnly("unused")
