"""load_tests/synthetic_model.py: the Criteo-like model's layout, its embedding config, and a
checkpoint that holds a row for every vocabulary ID of every slot."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from load_tests import synthetic_model, traffic


def _layers(module: nn.Sequential) -> list[str]:
    return [
        f"Linear({layer.in_features}, {layer.out_features})"
        if isinstance(layer, nn.Linear)
        else type(layer).__name__
        for layer in module
    ]


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_the_model_is_a_dlrm_with_a_relu_bottom_and_a_logit_top():
    """Bottom 13-512-256-16 (ReLU after every layer), top 432-256-128-1 (no ReLU after the
    last: the output is a logit, negative too)."""
    model = synthetic_model.SyntheticDLRM()
    assert _layers(model.bottom) == [
        "Linear(13, 512)", "ReLU", "Linear(512, 256)", "ReLU", "Linear(256, 16)", "ReLU",
    ]  # fmt: skip
    assert _layers(model.top) == [
        "Linear(432, 256)", "ReLU", "Linear(256, 128)", "ReLU", "Linear(128, 1)",
    ]  # fmt: skip
    small = synthetic_model.SyntheticDLRM(num_slots=2, dim=3, num_dense=4, bottom=(5,), top=(6,))
    assert _layers(small.bottom) == ["Linear(4, 5)", "ReLU", "Linear(5, 3)", "ReLU"]
    assert _layers(small.top) == ["Linear(9, 6)", "ReLU", "Linear(6, 1)"]
    torch.manual_seed(0)
    scripted = torch.jit.script(small)
    logits = scripted([torch.randn(64, 4)], [torch.randn(64, 3), torch.randn(64, 3)])
    assert logits.shape == (64, 1)
    with torch.no_grad():
        small.top[-1].bias.fill_(-100.0)
        assert (small([torch.randn(8, 4)], [torch.randn(8, 3)] * 2) < 0).all()


def test_the_embedding_config_sums_every_slot_under_an_8_bit_prefix():
    assert synthetic_model.slot_names(3) == ["C1", "C2", "C3"]
    assert synthetic_model.embedding_config_mapping(2, dim=4) == {
        "feature_index_prefix_bit": 8,
        "slots_config": {
            "C1": {"dim": 4, "embedding_summation": True},
            "C2": {"dim": 4, "embedding_summation": True},
        },
    }


def test_every_vocabulary_id_of_every_slot_gets_a_row(tmp_path):
    checkpoint = synthetic_model.build_synthetic_checkpoint(
        tmp_path / "synthetic", vocab=50, num_slots=2, dim=4, batch_size=16, extra_steps=2
    )
    vocab = traffic.vocab_from_checkpoint(checkpoint)
    assert sorted(vocab) == ["C1", "C2"]
    for ids in vocab.values():
        np.testing.assert_array_equal(ids, np.arange(50, dtype=np.uint64))
