"""``--fallback-policy``: when the embedding tier cannot answer in time, a served model either
fails the request (``fail``, the default) or answers with zero embeddings for every ID and
counts them (``default``)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from embedding_store.batch import Batch, IDTypeFeature, IDTypeFeatureWithSingleID, NonIDTypeFeature
from embedding_store.errors import DeadlineExceededError, NotFoundError, UnavailableError
from serving.model import load_model
from tests.unit.test_onednn_linear import Mlp, _checkpoint


class _StalledTier:
    """Stands in for a remote tier whose lookups fail with ``error``."""

    def __init__(self, tier, error: Exception) -> None:
        self._tier, self._error = tier, error

    def lookup(self, batch, *, train):
        raise self._error

    def __getattr__(self, name):
        return getattr(self._tier, name)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return _checkpoint(tmp_path_factory.mktemp("fallback") / "checkpoint", Mlp())


def _batch() -> Batch:
    ids = np.array([1, 2, 3], dtype=np.uint64)
    dense = np.arange(9, dtype=np.float32).reshape(3, 3) / 10
    return Batch(
        [IDTypeFeatureWithSingleID("user", ids), IDTypeFeatureWithSingleID("item", ids[::-1])],
        [NonIDTypeFeature(dense, "dense")],
        requires_grad=False,
    )


@pytest.mark.parametrize("error", [DeadlineExceededError("slow"), UnavailableError("down")])
def test_default_answers_with_zero_embeddings_and_counts_every_id(checkpoint, error):
    model = load_model(checkpoint, name="m", fallback_policy="default", onednn_min_rows=0)
    try:
        batch = _batch()
        zeros = [torch.zeros(3, 4), torch.zeros(3, 4)]
        with torch.inference_mode():
            expected = model.dense(
                [torch.from_numpy(batch.non_id_type_features[0].data.copy())], zeros
            )
        model.tier = _StalledTier(model.tier, error)
        output = model.infer(batch)
        assert output.fallback_ids == 6  # 3 rows x 2 single-ID features
        np.testing.assert_allclose(output.predictions, expected.numpy(), rtol=0, atol=1e-6)
    finally:
        model.tier = getattr(model.tier, "_tier", model.tier)
        model.close()


def test_default_gives_one_zero_vector_per_sample_of_a_list_feature(checkpoint):
    model = load_model(checkpoint, name="m", fallback_policy="default", onednn_min_rows=0)
    try:
        feature = IDTypeFeature.from_lists("user", [[1, 2], [3]])
        config = model.embedding_config.slots_config["user"]
        assert config.embedding_summation  # pooled slot: one zero vector per sample
        lookup = model.default_lookup(Batch([feature], requires_grad=False))
        assert lookup.slots[0].embeddings.shape == (2, 4)
        assert not lookup.slots[0].embeddings.any()
    finally:
        model.close()


def test_fail_raises_the_tier_error_and_other_errors_always_raise(checkpoint):
    failing = load_model(checkpoint, name="m", onednn_min_rows=0)
    lenient = load_model(checkpoint, name="m", fallback_policy="default", onednn_min_rows=0)
    try:
        failing.tier = _StalledTier(failing.tier, DeadlineExceededError("slow shard"))
        with pytest.raises(DeadlineExceededError, match="slow shard"):
            failing.infer(_batch())
        # Only "cannot answer in time" falls back; a wrong request is still an error.
        lenient.tier = _StalledTier(lenient.tier, NotFoundError("no such slot"))
        with pytest.raises(NotFoundError, match="no such slot"):
            lenient.infer(_batch())
    finally:
        for model in (failing, lenient):
            model.tier = getattr(model.tier, "_tier", model.tier)
            model.close()


def test_fallback_is_logged_when_it_starts_and_ends_not_per_batch(checkpoint, caplog):
    # During an outage every batch falls back: one line per batch flooded the log.
    model = load_model(checkpoint, name="m", fallback_policy="default", onednn_min_rows=0)
    working = model.tier
    try:
        with caplog.at_level(logging.INFO, logger="serving.model"):
            model.tier = _StalledTier(working, UnavailableError("shard 0 is down"))
            for _ in range(50):
                assert model.infer(_batch()).fallback_ids == 6
            model.tier = working
            assert model.infer(_batch()).fallback_ids == 0
            model.infer(_batch())
        assert [r.getMessage() for r in caplog.records] == [
            "embedding lookups fail (shard 0 is down); answering with default (zero) vectors "
            "until they work again",
            "embedding lookups work again; 50 batch(es) got default vectors",
        ]
    finally:
        model.tier = working
        model.close()


@pytest.mark.filterwarnings("error::UserWarning")  # torch warns on a read-only array
def test_default_answers_a_raw_slot_as_the_tier_answers_unknown_ids():
    # Fallback is "every ID unknown": zero vectors, and the mask the tier gives for unknown
    # IDs (True where an ID sits), not an all-False one that makes a masked mean 0 / 0.
    from types import SimpleNamespace

    from embedding_store.config import embedding_config_from_mapping
    from embedding_store.tier import InProcessEmbeddingTier
    from serving.model import LoadedModel

    config = embedding_config_from_mapping(
        {
            "slots_config": {
                "user": {"dim": 4},
                "history": {"dim": 4, "embedding_summation": False, "sample_fixed_size": 3},
            }
        }
    )
    batch = Batch(
        [
            IDTypeFeatureWithSingleID.from_ids("user", [1, 2, 3]),
            IDTypeFeature.from_lists("history", [[5, 6], [], [7, 8, 9, 10]]),
        ],
        requires_grad=False,
    )
    fallback = LoadedModel.default_lookup(SimpleNamespace(embedding_config=config), batch)
    tier = InProcessEmbeddingTier(config, capacity=100, read_only=True)  # no rows: all unknown
    unknown = tier.lookup(batch, train=False)
    assert unknown.unknown_ids == 8  # the 4th history ID is past sample_fixed_size
    for got, expected in zip(fallback.slots, unknown.slots):
        assert got.name == expected.name
        torch.testing.assert_close(got.embeddings, expected.embeddings)
        if expected.mask is None:
            assert got.mask is None
        else:
            torch.testing.assert_close(got.mask, expected.mask)
    assert fallback.slots[1].mask.tolist() == [
        [True, True, False],
        [False, False, False],
        [True, True, True],
    ]


def test_each_outage_s_end_counts_only_its_own_batches(checkpoint, caplog):
    model = load_model(checkpoint, name="m", fallback_policy="default", onednn_min_rows=0)
    working = model.tier
    stalled = _StalledTier(working, UnavailableError("shard 0 is down"))
    try:
        with caplog.at_level(logging.INFO, logger="serving.model"):
            for outage in (2, 3):
                model.tier = stalled
                for _ in range(outage):
                    model.infer(_batch())
                model.tier = working
                model.infer(_batch())
        ends = [r.getMessage() for r in caplog.records if "lookups work again" in r.getMessage()]
        assert ends == [
            "embedding lookups work again; 2 batch(es) got default vectors",
            "embedding lookups work again; 3 batch(es) got default vectors",
        ]
    finally:
        model.tier = working
        model.close()
