"""Several training steps through the in-process tier against a torch reference.

The reference keeps one ``nn.Parameter`` per table ID, initialized with the ID's initial
vector, pools with ``nn.functional.embedding_bag(mode="sum")`` (sqrt scaling: per-sample
weights ``1/sqrt(n)``) and pads raw slots with ``nn.functional.embedding(padding_idx=...)``,
back-propagates with autograd and steps one ``torch.optim`` optimizer per row, only for the rows
the batch used: the tier's semantics (docs/architecture.md, "Embedding numerics").
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from embedding_store.batch import Batch, IDTypeFeature, IDTypeFeatureWithSingleID
from embedding_store.config import embedding_config_from_mapping
from embedding_store.initializer import InitializationConfig, initial_vectors
from embedding_store.optimizers import SGD, Adagrad, Adam, Optimizer
from embedding_store.tier import InProcessEmbeddingTier
from embedding_store.worker import hash_stack

CONFIG = embedding_config_from_mapping(
    {
        "slots_config": {
            "user": {"dim": 4},
            "items": {"dim": 4, "sqrt_scaling": True},
            "history": {"dim": 4, "embedding_summation": False, "sample_fixed_size": 3},
            "city": {"dim": 2},
            "tags": {
                "dim": 2,
                "sqrt_scaling": True,
                "hash_stack_config": {"hash_stack_rounds": 2, "embedding_size": 7},
            },
        },
        # user, items and history share one ID space: ID 3 of each is one row
        "feature_groups": {"people": ["user", "items", "history"]},
    }
)
INIT = InitializationConfig(low=-0.5, high=0.5, seed=3)
STEPS = 6
TRUNCATED = 99


def batch_of(step: int) -> Batch:
    """Small IDs (so rows repeat within a sample, across samples, slots and steps), empty
    samples, and now and then a slot empty in every sample."""
    rng = np.random.default_rng(step)
    size = int(rng.integers(1, 6))

    def lists(high: int, most: int) -> list[list[int]]:
        if step % 4 == 3:
            return [[] for _ in range(size)]
        return [rng.integers(0, high, rng.integers(0, most + 1)).tolist() for _ in range(size)]

    user, items, history = lists(8, 3), lists(8, 4), lists(12, 5)  # 8..11: history only
    if step == 1:
        history[0] = [1, 2, 3, TRUNCATED]  # past sample_fixed_size: never looked up
    return Batch(
        [
            IDTypeFeature.from_lists("user", user),
            IDTypeFeature.from_lists("items", items),
            IDTypeFeature.from_lists("history", history),
            IDTypeFeatureWithSingleID.from_ids("city", rng.integers(0, 5, size).tolist()),
            IDTypeFeature.from_lists("tags", lists(1000, 3)),
        ],
        requires_grad=False,
    )


def gradients(result, step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return {s.name: torch.randn(s.embeddings.shape, generator=generator) for s in result.slots}


class TorchReference:
    """One parameter and one torch optimizer per table ID, created at first use."""

    def __init__(self, make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]):
        self.make_optimizer = make_optimizer
        self.rows: dict[int, torch.nn.Parameter] = {}
        self.optimizers: dict[int, torch.optim.Optimizer] = {}

    def row(self, key: int, dim: int) -> torch.nn.Parameter:
        if key not in self.rows:
            vector = initial_vectors(np.array([key], np.uint64), dim, INIT)[0]
            self.rows[key] = torch.nn.Parameter(torch.from_numpy(vector))
            self.optimizers[key] = self.make_optimizer([self.rows[key]])
        return self.rows[key]

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        out = {}
        for feature in batch.id_type_features:
            config = CONFIG.slots_config[feature.name]
            rounds = max(config.hash_stack_config.hash_stack_rounds, 1)
            values = feature.values
            if config.hash_stack_config.hash_stack_rounds:
                values = hash_stack(values, rounds, config.hash_stack_config.embedding_size)
            prefix = np.uint64(CONFIG.index_prefix(feature.name))
            keys = ((values & np.uint64(CONFIG.id_mask)) | prefix).tolist()
            lengths = feature.lengths
            if config.embedding_summation:
                table = torch.zeros(0, config.dim)
                if keys:
                    table = torch.stack([self.row(k, config.dim) for k in keys])
                weights = None
                if config.sqrt_scaling:  # 1/sqrt(IDs of the sample), each of its rows
                    scale = 1 / np.sqrt(np.maximum(lengths, 1))
                    weights = torch.from_numpy(
                        np.repeat(scale, lengths * rounds).astype(np.float32)
                    )
                out[feature.name] = torch.nn.functional.embedding_bag(
                    torch.arange(len(keys)),
                    table,
                    torch.from_numpy(feature.offsets[:-1] * rounds),
                    mode="sum",
                    per_sample_weights=weights,
                )
            else:  # positions past sample_fixed_size are dropped: never looked up nor trained
                fixed = config.sample_fixed_size
                kept = [
                    keys[start : start + min(n, fixed)]
                    for start, n in zip(feature.offsets[:-1], lengths)
                ]
                flat = [k for sample in kept for k in sample]
                pad = len(flat)  # a row of zeros after the kept ones
                zeros = torch.zeros(config.dim)
                table = torch.stack([self.row(k, config.dim) for k in flat] + [zeros])
                index = torch.full((len(lengths), fixed), pad, dtype=torch.int64)
                position = 0
                for b, sample in enumerate(kept):
                    index[b, : len(sample)] = torch.arange(position, position + len(sample))
                    position += len(sample)
                out[feature.name] = torch.nn.functional.embedding(index, table, padding_idx=pad)
        return out

    def step(self, out: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
        for row in self.rows.values():
            row.grad = None
        sum((out[name] * grads[name]).sum() for name in out).backward()
        for key, row in self.rows.items():
            if row.grad is not None:  # rows the batch did not use are not stepped at all
                self.optimizers[key].step()


def held_rows(tier: InProcessEmbeddingTier) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Every row the tier holds: table ID -> (weights, optimizer state)."""
    rows = {}
    for shard in tier.shards:
        for dim in shard.dims():
            block = shard.export_rows(dim)
            for key, weights, state in zip(block.ids.tolist(), block.weights, block.state):
                rows[key] = (weights, state)
    return rows


OPTIMIZERS = [
    (
        SGD(lr=0.1, weight_decay=0.05),
        lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.05),
    ),
    (
        Adagrad(lr=0.1, initial_accumulator_value=0.2, eps=1e-6, weight_decay=0.05),
        lambda p: torch.optim.Adagrad(
            p, lr=0.1, initial_accumulator_value=0.2, eps=1e-6, weight_decay=0.05
        ),
    ),
    (
        Adam(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05),
        lambda p: torch.optim.Adam(p, lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05),
    ),
]


@pytest.mark.parametrize(
    ("optimizer", "make_reference"), OPTIMIZERS, ids=["sgd", "adagrad", "adam"]
)
def test_training_steps_match_torch_with_one_optimizer_per_row(
    optimizer: Optimizer, make_reference
) -> None:
    reference = TorchReference(make_reference)
    # One shard pools inside the shard; three deduplicate, gather and call embedding_bag.
    tiers = [
        InProcessEmbeddingTier(CONFIG, num_shards=n, optimizer=optimizer, initialization=INIT)
        for n in (1, 3)
    ]
    tiers[1].worker.deduplicate = True
    with tiers[0], tiers[1]:
        _train_and_compare(optimizer, reference, tiers)


def _train_and_compare(
    optimizer: Optimizer, reference: TorchReference, tiers: list[InProcessEmbeddingTier]
) -> None:
    for step in range(STEPS):
        batch = batch_of(step)
        results = [tier.lookup(batch, train=True) for tier in tiers]
        expected = reference.forward(batch)
        for result in results:
            for slot in result.slots:
                torch.testing.assert_close(
                    slot.embeddings, expected[slot.name].detach(), rtol=1e-6, atol=1e-6
                )
                assert torch.equal(slot.embeddings, results[0].slot(slot.name).embeddings)
        for tier, result in zip(tiers, results):
            tier.backward(result.ref, gradients(result, step))
        reference.step(expected, gradients(results[0], step))

    rows = held_rows(tiers[0])
    assert sorted(rows) == sorted(reference.rows)
    assert TRUNCATED | CONFIG.index_prefix("history") not in rows
    steps = set()
    for key, (weights, state) in rows.items():
        np.testing.assert_allclose(weights, reference.rows[key].detach(), rtol=1e-6, atol=1e-6)
        torch_state = reference.optimizers[key].state[reference.rows[key]]
        if isinstance(optimizer, Adagrad):
            np.testing.assert_allclose(state, torch_state["sum"], rtol=1e-6)
        if isinstance(optimizer, Adam):  # [m | v | t]: t counts the steps of this row
            dim = len(weights)
            np.testing.assert_allclose(state[:dim], torch_state["exp_avg"], rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(state[dim : 2 * dim], torch_state["exp_avg_sq"], rtol=1e-6)
            assert state[2 * dim] == torch_state["step"].item()
            steps.add(int(state[2 * dim]))
    if isinstance(optimizer, Adam):
        assert len(steps) > 2  # rows were first seen at different steps
    other = held_rows(tiers[1])  # the other pooling path: the same bits
    assert sorted(other) == sorted(rows)
    for key, (weights, state) in rows.items():
        np.testing.assert_array_equal(other[key][0], weights)
        np.testing.assert_array_equal(other[key][1], state)
