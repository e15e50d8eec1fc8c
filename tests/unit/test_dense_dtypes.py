"""A non-ID feature reaches the dense model in the dtype training handed it, in serving too:
an int64 feature as int64 (float32 would round values past 2**24), float64 as float32."""

from __future__ import annotations

from pathlib import Path
from typing import List  # noqa: UP035  (TorchScript reads the forward signature)

import numpy as np
import pytest
import torch
from torch import nn

from embedding_store import model_checkpoint
from embedding_store.batch import Batch, IDTypeFeatureWithSingleID, Label, NonIDTypeFeature
from embedding_store.config import embedding_config_from_mapping, global_config_from_mapping
from embedding_store.errors import BatchValidationError
from embedding_store.optimizers import SGD
from embedding_store.signature import FeatureSignature, model_dtype
from embedding_store.tier import InProcessEmbeddingTier
from serving.model import load_model
from serving.service import PredictionService
from training.ctx import EmbeddingCtx, PreprocessMode, TrainCtx

CONFIG = embedding_config_from_mapping(
    {"feature_index_prefix_bit": 8, "slots_config": {"user": {"dim": 2}}}
)


class SecondsPastTheHour(nn.Module):
    """Integer arithmetic on an int64 timestamp: ``(ts + 1) % 3600``. In float32, ``ts + 1``
    rounds back to ``ts`` past 2**24 and the answer is one less."""

    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        ts = non_id_tensors[0]  # [batch, 1]
        seconds = ((ts + 1) % 3600).to(torch.float32)
        return seconds + 0.0 * embedding_tensors[0].sum(dim=1, keepdim=True)


def test_model_dtype_is_training_rule():
    assert model_dtype("float64") == np.float32
    assert model_dtype("float32") == np.float32
    assert model_dtype("int64") == np.int64
    assert model_dtype(np.dtype(np.int32)) == np.int32


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_int64_feature_served_as_training_evaluates_it(tmp_path: Path):
    # Multiples of 128 past 2**30: exact in FP32 (what the wire carries), but ts + 1 is not.
    ts = np.array([[2**30 + 128], [2**30 + 3 * 128], [1_700_000_000]], dtype=np.int64)
    assert (ts.astype(np.float32).astype(np.int64) == ts).all()
    user = np.arange(3, dtype=np.uint64)
    batch = Batch(
        [IDTypeFeatureWithSingleID("user", user)],
        [NonIDTypeFeature(ts, "ts")],
        requires_grad=False,
    )
    signature = FeatureSignature.from_batch(batch)
    assert signature.non_id_features[0].dtype == "int64"
    model = SecondsPastTheHour()
    tier = InProcessEmbeddingTier(CONFIG, capacity=100)
    with EmbeddingCtx(
        PreprocessMode.EVAL, model, embedding_config=CONFIG, embedding_tier=tier
    ) as ctx:
        trained, _ = ctx.forward(batch)
    expected = ((ts + 1) % 3600).astype(np.float32)
    np.testing.assert_array_equal(trained.numpy(), expected)

    directory = tmp_path / "checkpoint"
    model_checkpoint.write_checkpoint(directory, model, None, tier, signature=signature)
    served = load_model(directory, name="m", warm_up=False, onednn_min_rows=0)
    service = PredictionService(served)
    try:
        inputs = {"user": user, "ts": ts.astype(np.float32)}  # the wire's FP32
        prediction = service.predict("m", None, inputs, protocol="http", timeout=30.0)
    finally:
        service.close(wait=1.0)
    np.testing.assert_array_equal(prediction.outputs["prediction"], expected)


class HourIndex(nn.Module):
    """Indexes an embedding table with the int64 feature "hour" (floats are refused)."""

    def __init__(self) -> None:
        super().__init__()
        self.hours = nn.Embedding(24, 1)
        self.out = nn.Linear(2 + 1, 1)

    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        hour = self.hours(non_id_tensors[0][:, 0])
        return self.out(torch.cat([embedding_tensors[0], hour], dim=1))


def test_training_takes_whole_floats_for_an_integer_feature_as_integers() -> None:
    """The first batch records "hour" as int64; a later batch of whole float64 hours (a
    pandas column with a missing value becomes float64) reaches the model as int64 again,
    and 3.5 is refused by name instead of being cut to 3."""

    def batch(hour: np.ndarray) -> Batch:
        return Batch(
            [IDTypeFeatureWithSingleID("user", np.array([1, 2], np.uint64))],
            [NonIDTypeFeature(hour, "hour")],
            labels=[Label(np.array([[1.0], [0.0]], np.float32))],
            requires_grad=True,
        )

    torch.manual_seed(0)
    model = HourIndex()
    global_config = global_config_from_mapping(
        {"embedding_parameter_server_config": {"capacity": 100}}
    )
    with TrainCtx(
        SGD(lr=0.1),
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        embedding_config=CONFIG,
        global_config=global_config,
    ) as ctx:
        for hour in (np.array([[3], [23]], np.int64), np.array([[3.0], [23.0]], np.float64)):
            output, labels = ctx.forward(batch(hour))
            ctx.backward(nn.functional.binary_cross_entropy_with_logits(output, labels[0]))
        with pytest.raises(BatchValidationError) as raised:
            ctx.forward(batch(np.array([[3.5], [23.0]], np.float64)))
    assert str(raised.value) == (
        "non-ID feature 'hour' is an integer feature of the model (int64), given as float64: "
        "value 3.5 at sample 0, position [0] is not a whole number in the range of int64"
    )
