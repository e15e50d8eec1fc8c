"""A served model outside the fallback policy and the oneDNN path: which output transforms it
takes, what warm-up refuses, and how ``infer`` splits its time."""

from __future__ import annotations

import time
from pathlib import Path
from typing import List  # noqa: UP035  (TorchScript reads the forward signature)

import numpy as np
import pytest
import torch
from torch import nn

from embedding_store.errors import CheckpointError, InvalidArgumentError
from serving.model import load_model
from tests.unit.test_fallback_policy import _batch
from tests.unit.test_onednn_linear import Mlp, _checkpoint


class TwoColumns(nn.Module):
    """Returns [batch, 2]: the right number of rows, not one score per row."""

    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        return torch.cat(embedding_tensors + non_id_tensors, dim=1)[:, :2]


class SumsTheBatch(nn.Module):
    """Returns [1, 1] whatever the batch: right for a batch of one only."""

    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        return torch.cat(embedding_tensors + non_id_tensors, dim=1).sum().reshape(1, 1)


class _SlowTier:
    """A tier whose lookups take ``seconds`` longer."""

    def __init__(self, tier, seconds: float) -> None:
        self._tier, self._seconds = tier, seconds

    def lookup(self, batch, *, train):
        time.sleep(self._seconds)
        return self._tier.lookup(batch, train=train)

    def __getattr__(self, name):
        return getattr(self._tier, name)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("loaded") / "checkpoint", Mlp())


def test_output_transform_sigmoid_and_unknown_ones_are_refused(checkpoint):
    with pytest.raises(InvalidArgumentError, match="output transform must be one of"):
        load_model(checkpoint, name="m", output_transform="softmax", onednn_min_rows=0)
    identity = load_model(checkpoint, name="m", onednn_min_rows=0)
    sigmoid = load_model(checkpoint, name="m", output_transform="sigmoid", onednn_min_rows=0)
    try:
        raw = identity.infer(_batch()).predictions
        squashed = sigmoid.infer(_batch()).predictions
        np.testing.assert_allclose(squashed, 1 / (1 + np.exp(-raw)), rtol=0, atol=1e-6)
    finally:
        identity.close()
        sigmoid.close()


def test_warm_up_refuses_a_dense_model_without_one_score_per_row(tmp_path):
    directory = _checkpoint(tmp_path / "two", TwoColumns())
    with pytest.raises(
        CheckpointError, match=r"returns shape \[1, 2\] for a batch of 1; expected \[1, 1\]"
    ):
        load_model(directory, name="m", onednn_min_rows=0)


def test_warm_up_runs_batches_of_more_than_one_row(tmp_path):
    directory = _checkpoint(tmp_path / "sum", SumsTheBatch())
    with pytest.raises(CheckpointError, match="cannot be served"):
        load_model(directory, name="m", onednn_min_rows=0)


def test_infer_counts_the_lookup_as_lookup_time_not_compute_time(checkpoint):
    model = load_model(checkpoint, name="m", onednn_min_rows=0)
    working = model.tier
    try:
        model.tier = _SlowTier(working, 0.2)
        output = model.infer(_batch())
        assert output.lookup_seconds >= 0.2
        assert 0 <= output.compute_seconds < output.lookup_seconds  # a tiny model, no sleep
    finally:
        model.tier = working
        model.close()
