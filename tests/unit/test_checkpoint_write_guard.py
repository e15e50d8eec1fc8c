"""Writers refuse what loads refuse: a checkpoint whose embedding rows or dense values hold
NaN or Inf (training diverged) is never published, so it cannot replace the last good one.

The writer names the tensor and its first bad value; the checkpoint already at the path, its
files byte for byte, stays; no staging directory or shard part is left behind. Tiny tables
and models: the whole file runs in well under a second.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch

from embedding_store import checkpoint_dump, checkpoint_load, model_checkpoint, nonfinite
from embedding_store.config import embedding_config_from_mapping
from embedding_store.errors import CheckpointError
from embedding_store.optimizers import SGD, Adagrad
from embedding_store.shard import EmbeddingShard
from embedding_store.tier import InProcessEmbeddingTier

CONFIG = embedding_config_from_mapping({"slots_config": {"user": {"dim": 2}}})
IDS = np.arange(1, 6, dtype=np.uint64)  # rows 0..4 hold IDs 1..5, in lookup order


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _diverge(shard: EmbeddingShard, row: int, gradient: float = 1e10) -> None:
    """One SGD step with a learning rate far too high: row ``row`` (ID ``row + 1``) gets
    -Inf in column 0, as a diverged run's rows do (the kernel stores what float32 gives)."""
    grads = np.zeros((len(IDS), 2), np.float32)
    grads[row, 0] = gradient
    shard.configure(optimizer=SGD(lr=1e30))
    assert shard.update(IDS, grads) == len(IDS)


def _tier() -> InProcessEmbeddingTier:
    tier = InProcessEmbeddingTier(CONFIG, capacity=100, optimizer=SGD(lr=0.1))
    tier.shards[0].lookup(IDS, 2, train=True)
    return tier


def test_a_diverged_embedding_row_is_not_written_over_the_last_good_checkpoint(
    tmp_path: Path,
) -> None:
    target = tmp_path / "ckpt"
    model, tier = torch.nn.Linear(2, 1), _tier()
    first = model_checkpoint.write_checkpoint(target, model, None, tier, with_jit_model=False)
    published = _files(target)
    _diverge(tier.shards[0], row=3)
    with pytest.raises(CheckpointError) as raised:
        model_checkpoint.write_checkpoint(
            target, model, None, tier, with_jit_model=False, overwrite=True
        )
    assert raised.value.message == (
        f"checkpoint {target} not written: embedding shard 0 cannot be dumped: the weights of "
        "its rows of dim 2 hold 1 non-finite value(s) (NaN or Inf), the first at [3, 0]: "
        f"-inf (the row of ID 4). {nonfinite.NOT_WRITTEN}"
    )
    assert _files(target) == published  # the last good checkpoint, byte for byte
    assert model_checkpoint.verify(target).version == first.version
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging directory left

    # The embedding-only dump refuses the same rows and leaves no directory either.
    with pytest.raises(CheckpointError, match=r"^embedding shard 0 cannot be dumped: the weig"):
        tier.dump(tmp_path / "emb")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_nan_optimizer_state_is_not_written_but_an_infinite_accumulator_is(
    tmp_path: Path,
) -> None:
    """As loads do: an Adagrad accumulator of +Inf (its kernel stores it for a huge finite
    gradient, and the row stays finite) is written and loads back; NaN is refused."""
    shard = EmbeddingShard(100, optimizer=Adagrad(lr=0.1))
    shard.lookup(IDS, 2, train=True)
    grads = np.zeros((len(IDS), 2), np.float32)
    grads[2, 1] = 3e38
    shard.update(IDS, grads)
    checkpoint_dump.dump_embeddings([shard], tmp_path / "inf", CONFIG)
    rows = checkpoint_load.read_rows_for_replica(
        checkpoint_load.verify(tmp_path / "inf"), 0, 1, keep_state_of=shard.optimizer
    )
    assert rows[0].state is not None
    assert rows[0].state[2].tolist() == [np.float32(0.01), float("inf")]

    # No update path makes state NaN (the kernel drops NaN gradients): set it as damage would.
    shard._tables[2].state[4, 0] = np.nan
    with pytest.raises(CheckpointError) as raised:
        checkpoint_dump.dump_embeddings([shard], tmp_path / "nan", CONFIG)
    assert raised.value.message == (
        "embedding shard 0 cannot be dumped: the optimizer state of its rows of dim 2 hold 1 "
        f"NaN value(s), the first at [4, 0]: nan (the row of ID 5). {nonfinite.NOT_WRITTEN}"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inf"]


class Masked(torch.nn.Module):
    """A linear layer and a -inf mask buffer (as an attention mask: a legitimate Inf)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
        self.register_buffer("mask", torch.tensor([0.0, float("-inf")]))


@pytest.mark.parametrize(
    ("poison", "refused"),
    [
        (
            lambda m, o: m.linear.weight.data.__setitem__((0, 1), float("nan")),
            "the dense model's parameter 'linear.weight' holds 1 non-finite value(s) (NaN or "
            "Inf), the first at [0, 1]: nan",
        ),
        (
            lambda m, o: m.linear.bias.data.fill_(float("inf")),
            "the dense model's parameter 'linear.bias' holds 1 non-finite value(s) (NaN or "
            "Inf), the first at [0]: inf",
        ),
        (
            lambda m, o: m.mask.__setitem__(0, float("nan")),
            "the dense model's buffer 'mask' holds 1 NaN value(s), the first at [0]: nan",
        ),
        (
            lambda m, o: o.state[m.linear.weight]["exp_avg"].__setitem__((0, 0), float("nan")),
            "tensor 'state.0.exp_avg' of the dense optimizer's state (opt.pt) holds 1 NaN "
            "value(s), the first at [0, 0]: nan",
        ),
    ],
    ids=["nan-parameter", "inf-parameter", "nan-buffer", "nan-optimizer-state"],
)
def test_dense_values_a_load_refuses_are_not_written(tmp_path: Path, poison, refused) -> None:
    model = Masked()
    optimizer = torch.optim.Adam(model.parameters())
    model.linear(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # Adam's state exists
    target = tmp_path / "ckpt"
    model_checkpoint.write_checkpoint(target, model, optimizer, _tier(), with_jit_model=False)
    published = _files(target)  # the -inf mask buffer was written: loads keep it too
    with torch.no_grad():
        poison(model, optimizer)
    with pytest.raises(CheckpointError) as raised:
        model_checkpoint.write_checkpoint(
            target, model, optimizer, _tier(), with_jit_model=False, overwrite=True
        )
    assert raised.value.message == (
        f"checkpoint {target} not written: {refused}. {nonfinite.NOT_WRITTEN}"
    )
    assert _files(target) == published
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_rows_are_checked_in_the_pass_that_hashes_them() -> None:
    """The digest is the file's SHA-256 whatever the chunking, and a bad value is found in
    any chunk (the weights span three chunks here, the state the boundary after them)."""
    n = nonfinite.CHUNK // 2 + 7  # rows of dim 4: the weights take 2 chunks and a bit
    weights = np.linspace(-1, 1, n * 4, dtype=np.float32).reshape(n, 4)
    state = np.ones((n, 2), np.float32)
    ids = np.arange(n, dtype=np.uint64)

    def checked(w: np.ndarray, s: np.ndarray) -> str | None:
        payload = safetensors.numpy.save(checkpoint_dump.row_tensors(ids, w, s, None))
        digest, bad = checkpoint_dump.digest_and_check_rows(payload)
        assert digest == hashlib.sha256(payload).hexdigest()
        return bad

    assert checked(weights, state) is None
    for row, column in ((0, 0), (n // 2, 3), (n - 1, 3)):
        damaged = weights.copy()
        damaged[row, column] = np.inf
        assert checked(damaged, state) == "weights", (row, column)
    state_inf, state_nan = state.copy(), state.copy()
    state_inf[n - 1, 1], state_nan[n - 1, 1] = np.inf, np.nan
    assert checked(weights, state_inf) is None  # +Inf state loads (an Adagrad accumulator)
    assert checked(weights, state_nan) == "state"
    both = weights.copy()
    both[n - 1, 0] = np.nan
    assert checked(both, state_nan) == "weights"  # named first, as loads do
