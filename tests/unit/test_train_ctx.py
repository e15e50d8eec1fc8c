"""TrainCtx: hybrid updates, bounded staleness, eval_ctx, checkpoints (embedded tier)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import logging
import re
import threading
import time
import zipfile
from collections.abc import Callable

import numpy as np
import pytest
import torch

from embedding_store.batch import Batch, IDTypeFeature, Label, NonIDTypeFeature
from embedding_store.config import embedding_config_from_mapping, global_config_from_mapping
from embedding_store.errors import (
    AlreadyExistsError,
    BatchValidationError,
    CheckpointError,
    ConfigError,
    FailedPreconditionError,
    InvalidArgumentError,
)
from embedding_store.optimizers import SGD, Adam
from embedding_store.tier import InProcessEmbeddingTier, TierStatus
from embedding_store.worker import BackwardStats
from training import checkpoint as training_checkpoint
from training.ctx import EmbeddingCtx, PreprocessMode, TrainCtx, eval_ctx
from training.env import EMBEDDING_WORKERS_ENV

CONFIG = embedding_config_from_mapping(
    {"slots_config": {"user": {"dim": 4}, "item": {"dim": 4, "sqrt_scaling": True}}}
)
GLOBAL = global_config_from_mapping({"embedding_parameter_server_config": {"capacity": 10_000}})


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4 + 4 + 2, 1)

    def forward(self, non_id_tensors: list[torch.Tensor], embedding_tensors: list[torch.Tensor]):
        return self.linear(torch.cat(embedding_tensors + non_id_tensors, dim=1))


def make_batch(seed: int, batch_size: int = 16, labels: bool = True) -> Batch:
    rng = np.random.default_rng(seed)
    user = rng.integers(0, 50, batch_size)
    items = [rng.integers(0, 100, rng.integers(1, 4)).tolist() for _ in range(batch_size)]
    dense = rng.normal(size=(batch_size, 2)).astype(np.float32)
    target = ((user % 2) == 0).astype(np.float32).reshape(-1, 1)
    return Batch(
        [
            IDTypeFeature.from_lists("user", [[int(u)] for u in user]),
            IDTypeFeature.from_lists("item", items),
        ],
        [NonIDTypeFeature(dense, name="dense")],
        [Label(target)] if labels else [],
        requires_grad=labels,
    )


def train_steps(ctx: TrainCtx, steps: int, offset: int = 0) -> list[float]:
    losses = []
    for step in range(steps):
        output, labels = ctx.forward(make_batch(offset + step))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(output, labels[0])
        ctx.backward(loss)
        losses.append(float(loss.detach()))
    return losses


DENSE_SGD = functools.partial(torch.optim.SGD, lr=0.1)


def new_ctx(
    staleness: int = 1,
    embedding_lr: float = 0.5,
    *,
    model_class: Callable[[], torch.nn.Module] = TinyModel,
    dense_optimizer: Callable[..., torch.optim.Optimizer] = DENSE_SGD,
    **overrides,
) -> TrainCtx:
    """A TrainCtx with SGD (``embedding_lr``) for embeddings over a ``model_class()`` built
    after torch is seeded with 0 and ``dense_optimizer(its parameters)``; ``overrides`` are
    more TrainCtx keyword arguments."""
    torch.manual_seed(0)
    model = model_class()
    return TrainCtx(
        SGD(lr=embedding_lr),
        dense_optimizer(model.parameters()),
        model,
        embedding_staleness=staleness,
        embedding_config=CONFIG,
        global_config=GLOBAL,
        **overrides,
    )


def sgd_ctx(**overrides) -> TrainCtx:
    """A TrainCtx over a TinyModel with SGD (lr 0.1) for embeddings and dense parameters;
    ``overrides`` are TrainCtx keyword arguments (global_config defaults to GLOBAL)."""
    model = TinyModel()
    return TrainCtx(
        SGD(lr=0.1),
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        embedding_config=CONFIG,
        **{"global_config": GLOBAL, **overrides},
    )


class QueuingTier(InProcessEmbeddingTier):
    """A tier that applies gradients only in flush(), as the remote worker does; records how
    many batches had been looked up without their gradients applied at each train lookup.

    flush() holds the gradients back until ``hold`` batches are unapplied (or ``draining``
    is set): the trainer then runs as far ahead as TrainCtx lets it, whatever the timing."""

    def __init__(self, hold: int) -> None:
        super().__init__(CONFIG, capacity=10_000, optimizer=SGD(lr=0.5))
        self.hold = hold
        self.draining = False
        self.queued: list = []
        self.unapplied = 0
        self.seen: list[int] = []
        self.changed = threading.Condition()

    def lookup(self, batch, *, train):
        result = super().lookup(batch, train=train)
        if train:
            with self.changed:
                self.unapplied += 1
                self.seen.append(self.unapplied)
                self.changed.notify_all()
        return result

    def backward(self, ref, grads):
        with self.changed:
            self.queued.append((ref, grads))
        return BackwardStats(rows_pushed=0, nonfinite_rows_skipped=0)

    def flush(self):
        with self.changed:
            # The timeout only keeps a broken TrainCtx from hanging the test.
            self.changed.wait_for(
                lambda: not self.queued or self.unapplied >= self.hold or self.draining, 10
            )
            queued, self.queued = self.queued, []
            for ref, grads in queued:
                super().backward(ref, grads)
                self.unapplied -= 1

    def drain(self) -> None:
        with self.changed:
            self.draining = True
            self.changed.notify_all()


@pytest.mark.parametrize("staleness", [1, 2, 4])
def test_staleness_bound_holds_when_the_tier_applies_gradients_later(staleness):
    tier = QueuingTier(hold=staleness)
    with new_ctx(staleness, embedding_tier=tier) as ctx:
        train_steps(ctx, 30)
        tier.drain()
    assert max(tier.seen) == staleness
    assert tier.unapplied == 0


def test_training_lowers_the_loss_and_updates_both_sides():
    with new_ctx() as ctx:
        before = ctx.dense_model.linear.weight.detach().clone()
        first = ctx.embedding_tier.lookup(make_batch(0), train=False)
        losses = train_steps(ctx, 60)
        assert np.mean(losses[-10:]) < np.mean(losses[:10])
        assert not torch.equal(before, ctx.dense_model.linear.weight)
        after = ctx.embedding_tier.lookup(make_batch(0), train=False)
        assert not torch.equal(first.slots[0].embeddings, after.slots[0].embeddings)


def test_embedding_update_equals_manual_sgd_step():
    """Synchronous (staleness 1): rows move by exactly -lr * dLoss/dEmbedding."""
    with new_ctx(staleness=1, embedding_lr=0.5) as ctx:
        batch = make_batch(3, batch_size=1)
        output, labels = ctx.forward(batch)
        leaves = ctx._pending[2]
        before = [leaf.detach().clone() for leaf in leaves]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(output, labels[0])
        ctx.backward(loss)
        grads = [leaf.grad.clone() for leaf in leaves]
        after = ctx.embedding_tier.lookup(batch, train=False)
        # user: one ID, so its row is the pooled value.
        torch.testing.assert_close(
            after.slot("user").embeddings, before[0] - 0.5 * grads[0], rtol=0, atol=1e-6
        )


def test_staleness_one_is_a_synchronous_loop_bit_for_bit():
    """Eight steps with embedding_staleness=1 leave the rows and dense weights of a plain
    loop that looks up, steps the model and applies each batch's embedding gradients before
    the next lookup."""
    torch.manual_seed(0)
    model = TinyModel()
    dense = torch.optim.SGD(model.parameters(), lr=0.1)
    tier = InProcessEmbeddingTier(CONFIG, capacity=10_000, optimizer=SGD(lr=0.5))
    for step in range(8):
        batch = make_batch(step)
        looked_up = tier.lookup(batch, train=True)
        leaves = [slot.embeddings.detach().clone().requires_grad_(True) for slot in looked_up.slots]
        dense_input = [torch.tensor(f.data) for f in batch.non_id_type_features]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(dense_input, leaves), torch.tensor(batch.labels[0].data)
        )
        loss.backward()
        dense.step()
        dense.zero_grad()
        assert looked_up.ref is not None
        tier.backward(
            looked_up.ref, {s.name: leaf.grad for s, leaf in zip(looked_up.slots, leaves)}
        )
    probe = make_batch(0)
    with new_ctx(staleness=1) as ctx:
        train_steps(ctx, 8)
        for mine, theirs in zip(
            ctx.embedding_tier.lookup(probe, train=False).slots,
            tier.lookup(probe, train=False).slots,
        ):
            assert torch.equal(mine.embeddings, theirs.embeddings)
        assert torch.equal(ctx.dense_model.linear.weight, model.linear.weight)
        assert torch.equal(ctx.dense_model.linear.bias, model.linear.bias)


def test_staleness_bounds_updates_in_flight():
    with new_ctx(staleness=3) as ctx:
        train_steps(ctx, 5)
        ctx.wait_for_embedding_updates()
        assert ctx._in_flight._value == 3  # every slot returned once updates are applied
    with pytest.raises(InvalidArgumentError, match="embedding_staleness must be >= 1"):
        new_ctx(staleness=0)


def test_a_forward_without_backward_gives_its_staleness_slot_back():
    with new_ctx(staleness=3) as ctx:
        worker = ctx.embedding_tier.worker
        ctx.forward(make_batch(0))  # abandoned: no backward
        ctx.forward(make_batch(1))  # abandoned too
        # ... and its forward context: it waited in the worker's buffer until it expired.
        assert worker.pending_backward == 1
        train_steps(ctx, 1, offset=2)
        ctx.wait_for_embedding_updates()
        assert ctx._in_flight._value == 3  # no slot lost to the abandoned forwards
        assert (worker.pending_backward, worker.expired_forward_contexts) == (0, 0)


def test_a_forward_without_backward_does_not_block_a_synchronous_run():
    """embedding_staleness=1 has one slot, held by the abandoned forward: the next forward
    waited for it forever (its slot was given back only after taking a new one)."""
    steps: list[int] = []

    def run(ctx: TrainCtx) -> None:
        ctx.forward(make_batch(0))  # abandoned: no backward
        train_steps(ctx, 2, offset=1)
        steps.append(ctx.step)

    with new_ctx(staleness=1) as ctx:
        worker = threading.Thread(target=run, args=(ctx,), daemon=True)
        worker.start()
        worker.join(timeout=10)
        assert not worker.is_alive(), "the forward after an abandoned one hung"
        assert steps == [2]
        assert ctx._in_flight._value == 1


def test_a_staleness_above_the_workers_forward_buffer_is_refused():
    """The worker keeps forward_buffer_size lookups' contexts: with more batches looked up
    before their gradients went back, the oldest expired and the run failed at a backward
    ("no forward context 1"), or not, depending on timing."""
    small = global_config_from_mapping({"embedding_worker_config": {"forward_buffer_size": 2}})
    with pytest.raises(InvalidArgumentError) as refused:
        sgd_ctx(embedding_staleness=3, global_config=small)
    assert refused.value.message == (
        "embedding_staleness 3 is above the embedding worker's forward_buffer_size 2 "
        "(embedding_worker_config in global_config (a GlobalConfig object)): lookups would "
        "expire before their gradients come back; lower embedding_staleness or raise "
        "forward_buffer_size"
    )
    tier = InProcessEmbeddingTier(CONFIG, capacity=100, forward_buffer_size=2)
    with pytest.raises(InvalidArgumentError) as refused:
        sgd_ctx(embedding_staleness=3, embedding_tier=tier)
    assert refused.value.message == (
        "embedding_staleness 3 is above the embedding worker's forward_buffer_size 2 (the given "
        "tier): lookups would expire before their gradients come back; lower "
        "embedding_staleness or raise forward_buffer_size"
    )
    with sgd_ctx(embedding_staleness=2, embedding_tier=tier) as ctx:  # as many as it keeps
        train_steps(ctx, 4)
        assert ctx.step == 4


def _sharing_refusal(staleness: int, ranks: int, address: str) -> str:
    return (
        f"embedding_staleness {staleness} x {ranks} ranks sharing embedding worker {address} "
        f"= {staleness * ranks} lookups waiting for their gradients, above its "
        "forward_buffer_size 10 (embedding_worker_config in global_config (a GlobalConfig "
        "object)), one buffer for all its ranks: lookups would expire before their gradients "
        "come back; lower embedding_staleness, raise forward_buffer_size or give more "
        "embedding workers"
    )


@pytest.mark.parametrize(
    ("world", "workers", "staleness", "refusal"),
    [
        # Two ranks on one worker (`recserve train --nproc-per-node 2 --embedding-workers
        # w:7201`): 2 x 6 contexts in its one buffer of 10.
        (2, ["w:7201"], 6, (2, "w:7201")),
        (2, ["w:7201"], 5, None),  # 2 x 5 = 10: as many as it keeps
        (1, ["w:7201"], 10, None),
        # Rank r talks to workers[r % 2]: ranks 0 and 2 share a:1, rank 1 has b:1.
        (3, ["a:1", "b:1"], 6, (2, "a:1")),
        (4, ["a:1", "b:1"], 5, None),
        (5, ["a:1", "b:1"], 4, (3, "a:1")),
        # One worker listed twice is one buffer.
        (2, ["a:1", " a:1"], 6, (2, "a:1")),
    ],
)
def test_a_staleness_times_the_ranks_sharing_a_worker_above_its_buffer_is_refused(
    monkeypatch, world, workers, staleness, refusal
):
    """The worker keeps one buffer of forward_buffer_size contexts for every rank that
    looks up through it: each rank may have embedding_staleness lookups waiting for their
    gradients, so the ranks sharing it together expired each other's contexts (their
    backward failed, "no forward context"), though each was within the buffer alone."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    ten = global_config_from_mapping({"embedding_worker_config": {"forward_buffer_size": 10}})
    options = {"embedding_staleness": staleness, "global_config": ten}
    if refusal is None:
        assert sgd_ctx(embedding_workers=workers, **options).embedding_staleness == staleness
        return
    with pytest.raises(InvalidArgumentError) as refused:
        sgd_ctx(embedding_workers=workers, **options)
    assert refused.value.message == _sharing_refusal(staleness, *refusal)
    # The addresses of RECSERVE_EMBEDDING_WORKERS count alike.
    monkeypatch.setenv(EMBEDDING_WORKERS_ENV, ",".join(workers))
    with pytest.raises(InvalidArgumentError) as refused:
        sgd_ctx(**options)
    assert refused.value.message == _sharing_refusal(staleness, *refusal)


class ReportingTier(InProcessEmbeddingTier):
    """An in-process tier standing for the remote worker at ``address`` that reports
    keeping ``reported`` forward contexts (its own config's forward_buffer_size)."""

    def __init__(self, address: str, reported: int) -> None:
        super().__init__(CONFIG, capacity=10_000)
        self.address, self.reported, self.closed = address, reported, False

    def status(self, partial: bool = False) -> TierStatus:
        assert partial  # a shard away at the start must not fail the check
        return dataclasses.replace(super().status(), forward_buffer_size=self.reported)

    def close(self) -> None:
        self.closed = True
        super().close()


@pytest.mark.parametrize(
    ("address", "reported", "refused"),
    [
        ("a:1", 10, True),  # ranks 0 and 2 share a:1: 2 x 6 > 10
        ("b:1", 10, False),  # rank 1 has b:1 alone
        ("a:1", 12, False),
        ("a:1", 0, False),  # a worker that predates the report: the global config's counts
    ],
)
def test_a_workers_own_forward_buffer_size_is_checked_on_enter(
    monkeypatch, address, reported, refused
):
    """The trainer's global config need not be the worker's (`recserve train` without
    --global-config reads the defaults, 1000): on enter, the number the worker reports is
    checked too, for the ranks that share it."""
    import training.ctx as ctx_module
    from training import distributed

    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr(distributed, "init_distributed", lambda *args: False)
    tier = ReportingTier(address, reported)
    monkeypatch.setattr(ctx_module, "make_embedding_tier", lambda *args, **kwargs: tier)
    ctx = sgd_ctx(embedding_staleness=6, embedding_workers=["a:1", "b:1"])  # buffer 1000
    if not refused:
        with ctx:
            train_steps(ctx, 1)
        return
    with pytest.raises(InvalidArgumentError) as refusal:
        ctx.__enter__()
    assert refusal.value.message == (
        "embedding_staleness 6 x 2 ranks sharing embedding worker a:1 = 12 lookups waiting "
        "for their gradients, above its forward_buffer_size 10 (as embedding worker a:1 "
        "reports it), one buffer for all its ranks: lookups would expire before their "
        "gradients come back; lower embedding_staleness, raise forward_buffer_size or give "
        "more embedding workers"
    )
    assert tier.closed


def test_a_given_tier_is_checked_for_its_rank_alone(monkeypatch):
    """Who else holds a tier given to TrainCtx cannot be told: an in-process one is this
    process's own, whatever WORLD_SIZE says."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    tier = InProcessEmbeddingTier(CONFIG, capacity=100, forward_buffer_size=6)
    assert sgd_ctx(embedding_staleness=6, embedding_tier=tier).embedding_staleness == 6


def test_a_loss_over_two_forwards_is_refused_and_applies_nothing():
    """Gradient accumulation (forward A, forward B, backward(loss_A + loss_B)) trained the
    dense model on both and dropped A's embedding gradients without a word: A's slot and
    context went at B's forward."""
    a, b = make_batch(0), make_batch(1)
    with new_ctx(staleness=2) as ctx:
        weight_before = ctx.dense_model.linear.weight.detach().clone()
        out_a, labels_a = ctx.forward(a)
        out_b, labels_b = ctx.forward(b)
        rows_before = ctx.embedding_tier.lookup(a, train=False).slots[0].embeddings.clone()
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        with pytest.raises(FailedPreconditionError) as refused:
            ctx.backward(bce(out_a, labels_a[0]) + bce(out_b, labels_b[0]))
        assert refused.value.message == (
            "backward(): the loss depends on the output of an earlier forward() than the "
            "last one; one backward() per forward() (accumulating a loss over several "
            "forwards would drop all but the last batch's embedding gradients): nothing was "
            "applied"
        )
        ctx.wait_for_embedding_updates()
        assert ctx.step == 0
        assert torch.equal(ctx.dense_model.linear.weight, weight_before)
        assert all(p.grad is None for p in ctx.dense_model.parameters())
        after = ctx.embedding_tier.lookup(a, train=False).slots[0].embeddings
        assert torch.equal(after, rows_before)
        # An abandoned forward whose output the loss does not use is fine.
        ctx.forward(a)
        train_steps(ctx, 2, offset=5)
        ctx.wait_for_embedding_updates()
        assert ctx.step == 2 and ctx._in_flight._value == 2


def test_a_backward_after_the_ctx_exited_is_refused_not_left_waiting():
    """Its gradients were queued with no thread left to apply them, and the wait for them
    (at once with staleness 1) never ended."""
    outcome: list[str] = []
    ctx = new_ctx(staleness=1)
    with ctx:
        output, labels = ctx.forward(make_batch(0))
    loss = torch.nn.functional.binary_cross_entropy_with_logits(output, labels[0])

    def late_backward() -> None:
        try:
            ctx.backward(loss)
            outcome.append("applied")
        except FailedPreconditionError as error:
            outcome.append(error.message)

    worker = threading.Thread(target=late_backward, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "backward() after exit waited forever"
    assert outcome == ["TrainCtx is not entered; use it as a context manager"]


def test_a_backward_for_a_forward_taken_before_load_checkpoint_is_refused(tmp_path):
    """Its gradients (of the old dense weights and rows) moved the loaded weights and the
    loaded rows of the same IDs. Nothing is applied; training goes on from the checkpoint."""
    batch = make_batch(7)
    with new_ctx(staleness=2) as ctx:
        train_steps(ctx, 2)
        ctx.dump_checkpoint(tmp_path / "ckpt", with_jit_model=False)
        loaded_weight = ctx.dense_model.linear.weight.detach().clone()
        loaded_rows = ctx.embedding_tier.lookup(batch, train=False).slots[0].embeddings
        train_steps(ctx, 1, offset=2)
        output, labels = ctx.forward(batch)
        ctx.load_checkpoint(tmp_path / "ckpt")
        loss = torch.nn.functional.binary_cross_entropy_with_logits(output, labels[0])
        with pytest.raises(FailedPreconditionError) as refused:
            ctx.backward(loss)
        assert refused.value.message == (
            f"backward(): the last forward() was taken before load_checkpoint({tmp_path / 'ckpt'}) "
            "replaced the dense weights and embedding rows it used: its gradients belong to "
            "the old ones; nothing was applied (call forward() on the batch again)"
        )
        ctx.wait_for_embedding_updates()
        assert ctx.step == 2
        assert torch.equal(ctx.dense_model.linear.weight, loaded_weight)
        rows = ctx.embedding_tier.lookup(batch, train=False).slots[0].embeddings
        assert torch.equal(rows, loaded_rows)
        assert ctx.embedding_tier.status().pending_backward == 0
        train_steps(ctx, 2, offset=2)  # its staleness slot was given back
        ctx.wait_for_embedding_updates()
        assert ctx.step == 4 and ctx._in_flight._value == 2


class SlowTier(InProcessEmbeddingTier):
    """An in-process tier whose embedding updates take a while to apply."""

    def __init__(self) -> None:
        super().__init__(CONFIG, capacity=10_000, optimizer=SGD(lr=0.5))

    def backward(self, ref, grads):
        time.sleep(0.1)
        return super().backward(ref, grads)


def test_a_checkpoint_holds_every_embedding_update_queued_before_it(tmp_path):
    from embedding_store import checkpoint_load, checkpoint_manifest

    tier = SlowTier()
    with new_ctx(4, embedding_tier=tier) as ctx:
        train_steps(ctx, 3)  # up to 3 batches' updates still queued
        manifest = ctx.dump_checkpoint(tmp_path / "ckpt", with_jit_model=False)
        ctx.wait_for_embedding_updates()
        trained = tier.shards[0].export_rows(4)
    embeddings = checkpoint_manifest.read_manifest(manifest.embeddings_directory)
    [saved] = checkpoint_load.read_rows_for_replica(embeddings, 0, 1, keep_state_of=None)
    order, saved_order = np.argsort(trained.ids), np.argsort(saved.ids)
    np.testing.assert_array_equal(saved.ids[saved_order], trained.ids[order])
    np.testing.assert_array_equal(saved.weights[saved_order], trained.weights[order])


def test_eval_ctx_keeps_embedding_hyperparameters():
    with new_ctx() as ctx:
        train_steps(ctx, 3)
        optimizer = ctx.embedding_tier.shards[0].optimizer
        with eval_ctx(ctx) as evaluator:
            output, _ = evaluator.forward(make_batch(100, labels=True))
            assert output.shape == (16, 1) and not output.requires_grad
            rows = ctx.embedding_tier.status().rows_per_shard
            evaluator.forward(make_batch(999, labels=False))  # unseen IDs: not inserted
            assert ctx.embedding_tier.status().rows_per_shard == rows
        assert ctx.embedding_tier.shards[0].optimizer == optimizer
        train_steps(ctx, 2, offset=10)  # training continues with the same tier


class DropoutModel(torch.nn.Module):
    """Dropout after the first layer; ``frozen`` is one a test puts in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4 + 4 + 2, 16)
        self.dropout = torch.nn.Dropout(0.5)
        self.frozen = torch.nn.Dropout(0.5)
        self.last = torch.nn.Linear(16, 1)

    def forward(self, non_id_tensors: list[torch.Tensor], embedding_tensors: list[torch.Tensor]):
        x = torch.relu(self.first(torch.cat(embedding_tensors + non_id_tensors, dim=1)))
        return self.last(self.frozen(self.dropout(x)))


def test_eval_ctx_scores_in_eval_mode_as_the_server_does(tmp_path):
    """TrainCtx leaves its model in training mode: an eval_ctx sharing it scored with dropout
    on (different numbers on every call, and not the server's). It must score as the
    checkpoint's served model does, and leave each module's mode as it was."""
    from serving.infer_ctx import InferCtx

    with new_ctx(model_class=DropoutModel) as ctx:
        model = ctx.dense_model
        train_steps(ctx, 2)
        ctx.dump_checkpoint(tmp_path / "checkpoint")
        model.frozen.eval()  # the modes as they were come back, module by module
        batch = make_batch(100, labels=False)
        first, _ = eval_ctx(ctx).forward(batch)
        second, _ = eval_ctx(ctx).forward(batch)
        assert torch.equal(first, second)
        assert model.training and model.dropout.training and not model.frozen.training
    with InferCtx(checkpoint=tmp_path / "checkpoint") as infer:
        served = infer.forward(batch)
    np.testing.assert_array_equal(first.numpy(), served)


def _dropout_ctx() -> TrainCtx:
    """A synchronous TrainCtx over a DropoutModel, torch seeded with 0 first (as a training
    script seeds itself, resumed or not)."""
    return new_ctx(model_class=DropoutModel)


def _dense_weights(ctx: TrainCtx) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in ctx.dense_model.state_dict().items()}


def test_a_resumed_run_draws_the_dropout_masks_of_an_uninterrupted_one(tmp_path):
    """6 steps of a model with dropout equal 3 steps, a checkpoint and 3 more steps in a
    fresh TrainCtx resumed from it, bit for bit: the checkpoint keeps torch's generator
    state. Without it the resumed steps drew their masks from the script's seed again."""
    with _dropout_ctx() as ctx:
        train_steps(ctx, 6)
        expected = _dense_weights(ctx)
    with _dropout_ctx() as ctx:
        train_steps(ctx, 3)
        ctx.dump_checkpoint(tmp_path / "ckpt", with_jit_model=False)
    with _dropout_ctx() as resumed:
        resumed.load_checkpoint(tmp_path / "ckpt")
        train_steps(resumed, 3, offset=3)
        resumed_weights = _dense_weights(resumed)
    assert sorted(resumed_weights) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(resumed_weights[name], tensor), name


def _rewrite_rng_file(directory, payload: bytes | None) -> None:
    """Replace a checkpoint's rng_state.safetensors by ``payload`` (None: remove it, as in a
    checkpoint written before it was kept), the manifest following."""
    manifest_path = directory / "manifest.json"
    raw = json.loads(manifest_path.read_text())
    if payload is None:
        (directory / "rng_state.safetensors").unlink()
        del raw["files"]["rng_state.safetensors"]
    else:
        (directory / "rng_state.safetensors").write_bytes(payload)
        raw["files"]["rng_state.safetensors"] = {
            "bytes": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
    manifest_path.write_text(json.dumps(raw))


def test_a_checkpoint_without_the_generator_states_of_this_run_resumes_with_a_note(
    tmp_path, caplog
):
    """A checkpoint written before the generators were kept, or by another number of
    ranks: it resumes (weights and step), the generators as the script seeded them, and
    the log says why. A damaged generator file is refused like any damaged file."""
    from clients import checkpoint_inspect
    from embedding_store import model_checkpoint

    with _dropout_ctx() as ctx:
        train_steps(ctx, 2)
        ctx.dump_checkpoint(tmp_path / "ckpt", with_jit_model=False)
        weights = _dense_weights(ctx)
        state = torch.get_rng_state()
    ckpt = tmp_path / "ckpt"
    assert checkpoint_inspect.verify(ckpt)[0] == []
    two_ranks = model_checkpoint.rng_payload([{"cpu": state}, {"cpu": state}])
    notes = {
        None: f"note: checkpoint {ckpt} holds no random number generator states (written "
        "before checkpoints kept them)",
        two_ranks: f"note: checkpoint {ckpt} holds the random number generator states of 2 "
        "rank(s), this run has 1",
    }
    for payload, note in notes.items():
        _rewrite_rng_file(ckpt, payload)
        caplog.clear()
        with _dropout_ctx() as resumed, caplog.at_level(logging.WARNING, "training.ctx"):
            seeded = torch.get_rng_state()
            assert resumed.load_checkpoint(ckpt).step == 2
            assert torch.equal(torch.get_rng_state(), seeded)
            assert all(torch.equal(v, weights[k]) for k, v in _dense_weights(resumed).items())
        assert [r.getMessage() for r in caplog.records] == [
            f"{note}: the random number generators stay as this run seeded them, so a model "
            "that draws random numbers while training (dropout) draws otherwise than the "
            "uninterrupted run"
        ]
    _rewrite_rng_file(ckpt, b"not safetensors")
    message = f"{ckpt / 'rng_state.safetensors'} cannot be loaded: "
    assert checkpoint_inspect.verify(ckpt)[0][0].startswith(message)
    with _dropout_ctx() as resumed:
        before = _dense_weights(resumed)
        with pytest.raises(CheckpointError, match=re.escape(message)):
            resumed.load_checkpoint(ckpt)
        assert all(torch.equal(v, before[k]) for k, v in _dense_weights(resumed).items())


def test_a_rank_on_a_gpu_keeps_and_gets_back_that_gpus_generator_too(monkeypatch, caplog):
    """What a rank training on cuda:1 saves and restores, with torch.cuda's generator calls
    stood in for (no GPU here): its CPU generator's state and cuda:1's, each put back where
    it came from; from a checkpoint of a CPU run only the CPU one, with a note."""
    from pathlib import Path
    from types import SimpleNamespace

    from embedding_store import model_checkpoint

    device = torch.device("cuda", 1)
    gpus = {device: torch.arange(16, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: gpus[device].clone())
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device: gpus.__setitem__(device, state)
    )
    ctx = new_ctx()  # not entered: nothing moves to the (absent) GPU
    ctx.device = device
    saved = ctx._rng_state()
    assert sorted(saved) == ["cpu", "cuda"] and torch.equal(saved["cuda"], gpus[device])
    payload = model_checkpoint.rng_payload([saved])
    manifest = SimpleNamespace(directory=Path("ckpt"), files={"rng_state.safetensors": {}})
    monkeypatch.setattr(model_checkpoint, "read_verified_file", lambda manifest, name: payload)
    states = model_checkpoint.read_rng_states(manifest)
    torch.rand(3)
    gpus[device] = torch.zeros(16, dtype=torch.uint8)
    ctx._restore_rng_state(manifest, states)
    assert torch.equal(torch.get_rng_state(), saved["cpu"])
    assert torch.equal(gpus[device], torch.arange(16, dtype=torch.uint8))

    gpus[device] = torch.zeros(16, dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, "training.ctx"):
        ctx._restore_rng_state(manifest, [{"cpu": saved["cpu"]}])
    assert torch.equal(gpus[device], torch.zeros(16, dtype=torch.uint8))
    assert [r.getMessage() for r in caplog.records] == [
        "note: rank 0: checkpoint ckpt's cuda generator state was not restored (it has none: "
        "written by a run on the CPU): the random number generators stay as this run seeded "
        "them, so a model that draws random numbers while training (dropout) draws otherwise "
        "than the uninterrupted run"
    ]


def test_training_keeps_a_part_kept_in_eval_mode_so():
    """TrainCtx.forward switched every module to training on every step, so a layer its
    trainer froze in eval mode (here a dropout) trained with it on. Only a model switched to
    eval as a whole is switched back."""
    torch.manual_seed(0)
    model = DropoutModel()
    model.frozen.eval()
    with TrainCtx(
        SGD(lr=0.5),
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        embedding_staleness=1,
        embedding_config=CONFIG,
        global_config=GLOBAL,
    ) as ctx:
        train_steps(ctx, 1)
        assert model.training and model.dropout.training and not model.frozen.training
        model.eval()  # an evaluation, by hand: the next step trains the whole model again
        train_steps(ctx, 1)
        assert model.training and model.dropout.training and model.frozen.training


def test_backward_without_forward_and_unlabeled_batches_are_refused():
    with new_ctx() as ctx:
        with pytest.raises(FailedPreconditionError, match="without a forward"):
            ctx.backward(torch.tensor(0.0, requires_grad=True))
        with pytest.raises(InvalidArgumentError, match="requires_grad=True"):
            ctx.forward(make_batch(0, labels=False))


def test_checkpoint_round_trip_resumes_identically(tmp_path):
    with new_ctx(staleness=1) as ctx:
        train_steps(ctx, 10)
        manifest = ctx.dump_checkpoint(tmp_path / "ckpt")
        assert manifest.step == 10
        for name in ("dense.pt", "jit_dense.pt", "opt.pt", "manifest.json", "DONE"):
            assert (tmp_path / "ckpt" / name).exists()
        continued = train_steps(ctx, 5, offset=10)
        scripted = training_checkpoint.load_jit_model(manifest)
    with new_ctx(staleness=1) as resumed:
        resumed.load_checkpoint(tmp_path / "ckpt")
        assert resumed.step == 10
        assert train_steps(resumed, 5, offset=10) == continued
        batch = make_batch(50)
        with eval_ctx(resumed) as evaluator:
            non_ids, embeddings, _ = evaluator.prepare_features(batch)
        # The TorchScript file holds the dense weights of step 10, before the last 5 steps.
        fresh = new_ctx(staleness=1)
        with fresh:
            fresh.load_checkpoint(tmp_path / "ckpt")
            expected = fresh.dense_model.eval()(non_ids, embeddings)
        torch.testing.assert_close(scripted(non_ids, embeddings), expected, rtol=0, atol=0)


class WideTinyModel(TinyModel):
    """TinyModel for an "item" slot of dim ``item_dim``."""

    def __init__(self, item_dim: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4 + item_dim + 2, 1)


def _adam_ctx(capacity: int, item_dim: int) -> TrainCtx:
    """A synchronous TrainCtx with Adam for embeddings (per-row moments and step counts) and
    for the dense model (its moments), over a tier of ``capacity`` rows; "user" rows have
    dim 4 and "item" rows ``item_dim``."""
    torch.manual_seed(0)
    model = WideTinyModel(item_dim)
    config = embedding_config_from_mapping(
        {"slots_config": {"user": {"dim": 4}, "item": {"dim": item_dim, "sqrt_scaling": True}}}
    )
    return TrainCtx(
        Adam(lr=0.05),
        torch.optim.Adam(model.parameters(), lr=0.01),
        model,
        embedding_staleness=1,
        embedding_config=config,
        global_config=global_config_from_mapping(
            {"embedding_parameter_server_config": {"capacity": capacity}}
        ),
    )


def _training_state(ctx: TrainCtx) -> tuple[dict, dict, dict]:
    """(dense weights, dense optimizer state, {id: (row, optimizer state)}) of ``ctx``."""
    rows = {}
    for shard in ctx.embedding_tier.shards:
        for dim in shard.dims():
            block = shard.export_rows(dim)
            for i, row_id in enumerate(block.ids.tolist()):
                rows[row_id] = (block.weights[i].tolist(), block.state[i].tolist())
    dense = {k: v.clone() for k, v in ctx.dense_model.state_dict().items()}
    return dense, ctx.dense_optimizer.state_dict()["state"], rows


@pytest.mark.parametrize("item_dim", [4, 8])
def test_a_resumed_run_evicts_and_trains_exactly_as_an_uninterrupted_one(tmp_path, item_dim):
    """20 steps, a checkpoint, 20 more steps equals the same 20 more steps after resuming
    the checkpoint in a fresh TrainCtx, bit for bit: dense weights, dense Adam moments,
    embedding rows with their Adam moments and step counts, and which rows the LRU evicted.
    The 150 distinct IDs do not fit the 100 rows, so rows are evicted after the checkpoint
    (a checkpoint used to keep rows in insertion order, and a resumed shard evicted others
    than the LRU ones: different rows, then different weights everywhere). With item_dim 8
    the rows live in two dim tables, whose LRU order is one over both."""
    with _adam_ctx(capacity=100, item_dim=item_dim) as ctx:
        train_steps(ctx, 20)
        ctx.dump_checkpoint(tmp_path / "ckpt", with_jit_model=False)
        evictions_before = ctx.embedding_tier.shards[0].stats().evictions
        train_steps(ctx, 20, offset=20)
        assert ctx.embedding_tier.shards[0].stats().evictions > evictions_before
        dense, dense_state, rows = _training_state(ctx)
    with _adam_ctx(capacity=100, item_dim=item_dim) as resumed:
        resumed.load_checkpoint(tmp_path / "ckpt")
        train_steps(resumed, 20, offset=20)
        resumed_dense, resumed_dense_state, resumed_rows = _training_state(resumed)
    assert sorted(resumed_rows) == sorted(rows)
    assert resumed_rows == rows
    for name, tensor in dense.items():
        assert torch.equal(resumed_dense[name], tensor), name
    for index, state in dense_state.items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(resumed_dense_state[index][key], state[key]), (index, key)


def test_a_resumed_lr_schedule_goes_on_as_documented(tmp_path):
    """The recipe of TrainCtx.load_checkpoint: opt.pt restores the current lr (StepLR halves
    it every 2 steps: 0.1, 0.05, 0.025 ...) and the scheduler's last_epoch is set to the
    manifest's step; steps 4-6 then have the uninterrupted run's rates and weights."""

    def run(resume_from=None) -> tuple[list[float], torch.Tensor]:
        torch.manual_seed(0)
        model = TinyModel()
        dense = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(dense, step_size=2, gamma=0.5)
        rates = []
        with TrainCtx(
            SGD(lr=0.5),
            dense,
            model,
            embedding_staleness=1,
            embedding_config=CONFIG,
            global_config=GLOBAL,
        ) as ctx:
            start = 0
            if resume_from is not None:
                start = ctx.load_checkpoint(resume_from).step
                schedule.last_epoch = start
            for step in range(start, 6):
                train_steps(ctx, 1, offset=step)
                schedule.step()
                rates.append(dense.param_groups[0]["lr"])
                if step == 2 and resume_from is None:
                    ctx.dump_checkpoint(tmp_path / "ckpt", with_jit_model=False)
        return rates, model.linear.weight.detach().clone()

    rates, weight = run()
    assert rates == [0.1, 0.05, 0.05, 0.025, 0.025, 0.0125]
    resumed_rates, resumed_weight = run(tmp_path / "ckpt")
    assert resumed_rates == rates[3:]
    assert torch.equal(resumed_weight, weight)


def test_corrupt_dense_file_is_refused_and_nothing_changes(tmp_path):
    with new_ctx() as ctx:
        train_steps(ctx, 3)
        ctx.dump_checkpoint(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "dense.pt"
    path.write_bytes(path.read_bytes()[:-3] + b"xyz")
    with new_ctx() as other:
        weight = other.dense_model.linear.weight.detach().clone()
        with pytest.raises(CheckpointError, match=r"dense\.pt is corrupt"):
            other.load_checkpoint(tmp_path / "ckpt")
        assert torch.equal(weight, other.dense_model.linear.weight)
        assert sum(other.embedding_tier.status().rows_per_shard) == 0


def _ctx_with_momentum() -> TrainCtx:
    """new_ctx with a dense optimizer that keeps state (SGD's momentum buffers), staleness
    TrainCtx's default (10)."""
    return new_ctx(10, dense_optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))


def test_corrupt_embedding_file_is_refused_and_dense_state_is_put_back(tmp_path):
    with _ctx_with_momentum() as ctx:
        train_steps(ctx, 3)
        ctx.dump_checkpoint(tmp_path / "ckpt")
    victim = next((tmp_path / "ckpt").rglob("*.safetensors"))
    payload = bytearray(victim.read_bytes())
    payload[-5] ^= 0xFF
    victim.write_bytes(bytes(payload))
    with _ctx_with_momentum() as other:
        train_steps(other, 2, offset=20)  # optimizer state of its own
        weights = {k: v.clone() for k, v in other.dense_model.state_dict().items()}
        optimizer_state = other.dense_optimizer.state_dict()
        steps = [
            {key: torch.as_tensor(value).clone() for key, value in state.items()}
            for state in optimizer_state["state"].values()
        ]
        # Momentum buffers to put back, which differ from the checkpoint's.
        assert steps and all("momentum_buffer" in state for state in steps)
        rows = other.embedding_tier.status().rows_per_shard
        with pytest.raises(CheckpointError, match="corrupt: SHA-256 mismatch"):
            other.load_checkpoint(tmp_path / "ckpt")
        for name, value in other.dense_model.state_dict().items():
            assert torch.equal(value, weights[name]), name
        after = other.dense_optimizer.state_dict()["state"].values()
        for before_state, after_state in zip(steps, after, strict=True):
            for key, value in before_state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(after_state[key]))
        assert other.embedding_tier.status().rows_per_shard == rows
        assert other.step == 2


def test_another_dense_optimizer_is_refused_on_resume(tmp_path):
    with new_ctx() as ctx:
        train_steps(ctx, 2)
        ctx.dump_checkpoint(tmp_path / "ckpt")
    assert training_checkpoint.read_manifest(tmp_path / "ckpt").dense_optimizer_class == (
        "torch.optim.sgd.SGD"
    )
    torch.manual_seed(0)
    model = TinyModel()
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    with TrainCtx(SGD(lr=0.5), adam, model, embedding_config=CONFIG, global_config=GLOBAL) as other:
        weight = other.dense_model.linear.weight.detach().clone()
        with pytest.raises(
            CheckpointError,
            match=re.escape(
                "written by torch.optim.sgd.SGD; this run's dense optimizer is "
                "torch.optim.adam.Adam"
            ),
        ):
            other.load_checkpoint(tmp_path / "ckpt")
        assert torch.equal(weight, other.dense_model.linear.weight)
        assert adam.param_groups[0]["lr"] == 0.01 and "betas" in adam.param_groups[0]
    # A checkpoint from before the class was recorded: the param groups' settings tell.
    manifest_path = tmp_path / "ckpt" / "manifest.json"
    raw = json.loads(manifest_path.read_text())
    del raw["dense_optimizer_class"]
    manifest_path.write_text(json.dumps(raw))
    with (
        TrainCtx(
            SGD(lr=0.5),
            torch.optim.Adam(model.parameters()),
            model,
            embedding_config=CONFIG,
            global_config=GLOBAL,
        ) as other,
        pytest.raises(CheckpointError, match=r"opt\.pt does not fit torch\.optim\.adam"),
    ):
        other.load_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda m: m["files"]["opt.pt"].pop("sha256"), r"files\['opt.pt'\]\.sha256 must be"),
        (
            lambda m: m["files"].update({"dense.pt": "x"}),
            r"files\['dense.pt'\] must be an object, got a JSON str",
        ),
        (lambda m: m["files"]["dense.pt"].update(bytes=-1), r"\.bytes must be an integer >= 0"),
        (lambda m: m["files"].update({"../x": m["files"]["dense.pt"]}), "not a plain name"),
        (lambda m: m.update(files=[]), "'files' must be an object, got a JSON list"),
        (
            lambda m: m.update(dense_parameters="linear.weight"),
            "dense_parameters must be a list of names, got 'linear.weight'",
        ),
    ],
)
def test_damaged_manifest_entries_are_named(tmp_path, damage, message):
    with new_ctx() as ctx:
        train_steps(ctx, 1)
        ctx.dump_checkpoint(tmp_path / "ckpt")
    manifest_path = tmp_path / "ckpt" / "manifest.json"
    raw = json.loads(manifest_path.read_text())
    damage(raw)
    manifest_path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message):
        training_checkpoint.verify(tmp_path / "ckpt")


def test_manifest_numbers_json_allows_but_python_cannot_take_are_a_checkpoint_error(tmp_path):
    """Infinity, 1e400 and nesting too deep for the JSON parser: a CheckpointError (the
    hot-reload watcher used to die of the OverflowError, silently and for good)."""
    from embedding_store import checkpoint_manifest

    with new_ctx() as ctx:
        train_steps(ctx, 1)
        ctx.dump_checkpoint(tmp_path / "ckpt")
    model_manifest = tmp_path / "ckpt" / "manifest.json"
    embedding_manifest = tmp_path / "ckpt" / "embeddings" / "embedding_manifest.json"
    originals = {p: p.read_text() for p in (model_manifest, embedding_manifest)}
    for path, key in ((model_manifest, "step"), (embedding_manifest, "num_shards")):
        for text in ("Infinity", "1e400"):
            path.write_text(originals[path].replace(f'"{key}": ', f'"{key}": {text}, "_x": ', 1))
            with pytest.raises(CheckpointError, match="is malformed"):
                training_checkpoint.verify(tmp_path / "ckpt")
        path.write_text("[" * 100_000)
        with pytest.raises(CheckpointError, match="is not valid JSON"):
            training_checkpoint.verify(tmp_path / "ckpt")
        path.write_text(originals[path])
    with pytest.raises(CheckpointError, match="does not exist or is not a directory"):
        checkpoint_manifest.read_manifest(tmp_path / ("x" * 300))  # ENAMETOOLONG


def test_damaged_embedding_manifest_entries_are_named(tmp_path):
    with new_ctx() as ctx:
        train_steps(ctx, 1)
        ctx.dump_checkpoint(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "embeddings" / "embedding_manifest.json"
    original = json.loads(path.read_text())
    for key, value, message in (
        ("rows", "many", "rows must be an integer >= 0, got 'many'"),
        ("sha256", "xyz", "sha256 must be 64 hex digits, got 'xyz'"),
        ("dim", None, "dim must be an integer >= 0, got None"),
    ):
        raw = json.loads(json.dumps(original))
        raw["files"][0][key] = value
        path.write_text(json.dumps(raw))
        with pytest.raises(CheckpointError, match=f"is malformed: .*{message}"):
            training_checkpoint.verify(tmp_path / "ckpt")


def test_embedding_ctx_inference_mode_is_read_only():
    with EmbeddingCtx(
        PreprocessMode.INFERENCE, TinyModel(), embedding_config=CONFIG, global_config=GLOBAL
    ) as ctx:
        output, _ = ctx.forward(make_batch(1, labels=False))
        assert output.shape == (16, 1)
        assert sum(ctx.embedding_tier.status().rows_per_shard) == 0


def test_nonfinite_embedding_gradients_skip_the_update():
    with new_ctx(staleness=1) as ctx:
        batch = make_batch(7)
        before = ctx.embedding_tier.lookup(batch, train=True)
        output, _ = ctx.forward(batch)
        ctx.backward((output * float("inf")).sum())
        assert ctx.nonfinite_embedding_steps == 1
        after = ctx.embedding_tier.lookup(batch, train=False)
        for x, y in zip(before.slots, after.slots):
            assert torch.equal(x.embeddings, y.embeddings)


def test_a_nan_label_skips_the_step_and_training_goes_on(caplog):
    """One NaN label makes the loss and every gradient NaN. On CPU (fp32, no GradScaler) the
    dense step used to run: every dense weight became NaN, and so did every later loss and
    embedding gradient (all later embedding updates skipped, silently). Now the whole step
    is skipped, said in the log, and the next batches train as before."""
    with new_ctx() as ctx, new_ctx() as clean:
        train_steps(ctx, 2)
        train_steps(clean, 2)
        good = make_batch(5)
        labels = good.labels[0].data.copy()
        labels[3, 0] = np.nan
        poisoned = Batch(good.id_type_features, good.non_id_type_features, [Label(labels)])
        before = ctx.embedding_tier.lookup(good, train=True)  # inserts the new IDs first
        weight = ctx.dense_model.linear.weight.detach().clone()
        with caplog.at_level(logging.WARNING, logger="training.ctx"):
            output, batch_labels = ctx.forward(poisoned)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(output, batch_labels[0])
            ctx.backward(loss)
        assert torch.isnan(loss)
        assert torch.equal(ctx.dense_model.linear.weight, weight)
        assert (ctx.step, ctx.nonfinite_dense_steps, ctx.nonfinite_embedding_steps) == (3, 1, 1)
        after = ctx.embedding_tier.lookup(good, train=False)
        for x, y in zip(before.slots, after.slots):
            assert torch.equal(x.embeddings, y.embeddings), x.name
        assert [r.getMessage() for r in caplog.records] == [
            "step 2: non-finite gradients (NaN or Inf: check the batch's labels and features), "
            f"its {what} was skipped (1 skipped so far)"
            for what in ("dense step", "embedding update")
        ]
        # The skipped step changed nothing: the next steps train exactly as in a run
        # without the poisoned batch.
        assert train_steps(ctx, 3, offset=10) == train_steps(clean, 3, offset=10)
        assert torch.equal(ctx.dense_model.linear.weight, clean.dense_model.linear.weight)


def test_a_batch_with_one_nonfinite_slot_moves_no_row_of_any_slot():
    """The whole batch's embedding update is skipped, the finite slot's rows included."""
    with new_ctx(staleness=1) as ctx:
        batch = make_batch(7)
        before = ctx.embedding_tier.lookup(batch, train=True)
        with torch.no_grad():  # inputs: user [0:4], item [4:8], dense [8:10]
            ctx.dense_model.linear.weight[:, 4:8] = float("inf")
        output, _ = ctx.forward(batch)
        ctx.backward(output.sum())  # user's gradient is finite, item's is not
        assert ctx.nonfinite_embedding_steps == 1
        after = ctx.embedding_tier.lookup(batch, train=False)
        for x, y in zip(before.slots, after.slots):
            assert torch.equal(x.embeddings, y.embeddings), x.name


class UserOnlyModel(torch.nn.Module):
    """Reads the "user" slot and the dense feature; ignores "item"."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4 + 2, 1)

    def forward(self, non_id_tensors: list[torch.Tensor], embedding_tensors: list[torch.Tensor]):
        return self.linear(torch.cat([embedding_tensors[0], *non_id_tensors], dim=1))


def _table(ctx: TrainCtx) -> dict[int, np.ndarray]:
    """Every row of the (one-shard, dim-4) tier: weights and Adam state side by side."""
    block = ctx.embedding_tier.shards[0].export_rows(4)
    return {
        int(i): np.concatenate([block.weights[k], block.state[k]]) for k, i in enumerate(block.ids)
    }


@pytest.mark.parametrize("case", ["nonfinite loss", "slot the loss ignores"])
def test_adam_rows_without_a_gradient_do_not_move(case):
    """Under Adam (and weight decay) a zero gradient still moves a row and counts a step, so
    a skipped batch and a slot the loss does not read must push nothing: rows and optimizer
    state stay bit for bit (torch.optim.Adam skips parameters without a gradient)."""
    torch.manual_seed(0)
    model = UserOnlyModel() if case == "slot the loss ignores" else TinyModel()
    with TrainCtx(
        Adam(lr=0.05, weight_decay=0.1),
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        embedding_staleness=1,
        embedding_config=CONFIG,
        global_config=GLOBAL,
    ) as ctx:
        batch = make_batch(7)
        output, labels = ctx.forward(batch)  # one real step: every row has Adam moments
        ctx.backward(torch.nn.functional.binary_cross_entropy_with_logits(output, labels[0]))
        before = _table(ctx)
        output, labels = ctx.forward(batch)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(output, labels[0])
        ctx.backward(loss * float("inf") if case == "nonfinite loss" else loss)
        after = _table(ctx)
    item_ids = batch.id_type_features[1].values & np.uint64(CONFIG.id_mask)
    item_rows = {int(i) for i in item_ids | np.uint64(CONFIG.index_prefix("item"))}
    frozen = before.keys() if case == "nonfinite loss" else item_rows
    assert after.keys() == before.keys() and frozen
    for row in frozen:
        assert np.array_equal(after[row], before[row]), row
    if case == "slot the loss ignores":
        assert any(not np.array_equal(after[r], before[r]) for r in before.keys() - item_rows)


def test_the_loss_scaler_state_is_checkpointed_and_resumed(tmp_path):
    # Mixed precision runs on CUDA only; an enabled CPU GradScaler has the same state dict,
    # which is what the checkpoint carries (scaler.pt) and gives back on resume.
    with new_ctx() as ctx:
        train_steps(ctx, 2)
        ctx.grad_scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
        ctx.grad_scaler.scale(torch.tensor(1.0))  # the scale exists once first used
        ctx.grad_scaler.update(new_scale=128.0)  # what backing off after an overflow does
        ctx.dump_checkpoint(tmp_path / "ckpt")
    manifest = training_checkpoint.read_manifest(tmp_path / "ckpt")
    assert "scaler.pt" in manifest.files
    with new_ctx() as resumed:
        resumed.grad_scaler = torch.amp.GradScaler("cpu")  # starts at 65536
        resumed.load_checkpoint(tmp_path / "ckpt")
        state = resumed.grad_scaler.state_dict()
        assert state["scale"] == 128.0 and state["growth_interval"] == 7
    with new_ctx() as plain:  # no mixed precision here: the scaler is disabled, none written
        train_steps(plain, 1)
        plain.dump_checkpoint(tmp_path / "plain")
    assert "scaler.pt" not in training_checkpoint.read_manifest(tmp_path / "plain").files


def test_a_checkpoint_dumped_before_any_batch_warns_that_it_cannot_be_served(tmp_path, caplog):
    # No batch went through forward(): no feature signature, and serving refuses such a
    # checkpoint much later. Said at the dump; resuming it still works.
    with new_ctx() as ctx:
        with caplog.at_level(logging.WARNING, logger="training.ctx"):
            ctx.dump_checkpoint(tmp_path / "early")
        assert any(
            "before any batch went through forward()" in r.getMessage()
            and "cannot be served" in r.getMessage()
            for r in caplog.records
        )
        caplog.clear()
        train_steps(ctx, 1)
        with caplog.at_level(logging.WARNING, logger="training.ctx"):
            ctx.dump_checkpoint(tmp_path / "later")
        assert not [r for r in caplog.records if "forward()" in r.getMessage()]
    with new_ctx() as resumed:
        assert resumed.load_checkpoint(tmp_path / "early").signature is None


def test_a_batch_the_tier_refused_does_not_become_the_runs_signature():
    """The signature is taken from the first batch the tier accepts: a first batch with a
    slot-name typo is refused, and the corrected batch after it trains (it used to be
    refused too, against the typo's 'model signature')."""
    good = make_batch(0)
    typo = Batch(
        [
            IDTypeFeature.from_lists("usr", [[1]] * 16),
            good.id_type_features[1],
        ],
        good.non_id_type_features,
        good.labels,
        requires_grad=True,
    )
    with new_ctx() as ctx:
        with pytest.raises(InvalidArgumentError, match="'usr' is not a slot"):
            ctx.forward(typo)
        assert ctx.signature is None
        output, labels = ctx.forward(good)
        ctx.backward(torch.nn.functional.binary_cross_entropy_with_logits(output, labels[0]))
        assert [spec.name for spec in ctx.signature.id_features] == ["user", "item"]


def test_a_train_ctx_refuses_an_infer_global_config(tmp_path):
    """job_type Infer (read-only lookups) would otherwise train and publish a checkpoint."""
    path = tmp_path / "global_config.yml"
    path.write_text("common_config:\n  job_type: Infer\n")
    with pytest.raises(ConfigError) as refused:
        sgd_ctx(global_config=path)
    assert str(refused.value) == (
        f"{path}: common_config.job_type: TrainCtx trains, got 'Infer' (read-only lookups, "
        "for serving): use 'Train'"
    )


# --------------------------------------------------------------------- argument checks, dtypes


@pytest.mark.parametrize("size", ["backward_buffer_size", "backward_workers_size"])
def test_backward_buffer_and_workers_must_be_at_least_one(size):
    with pytest.raises(InvalidArgumentError) as refused:
        sgd_ctx(**{size: 0})
    assert str(refused.value) == "backward_buffer_size and backward_workers_size must be >= 1"


def test_finite_check_every_zero_checks_every_step():
    with new_ctx(finite_check_every=0) as ctx:
        assert ctx.finite_check_every == 1
        train_steps(ctx, 2)
        output, _ = ctx.forward(make_batch(5))
        ctx.backward((output * float("inf")).sum())
        assert ctx.step == 3 and ctx.nonfinite_embedding_steps == 1


def test_a_nonfinite_gradient_in_one_row_skips_the_whole_update():
    """One sample's NaN makes that row's gradient NaN while every other row's is finite:
    the batch's embedding update is skipped all the same."""
    with new_ctx(staleness=1) as ctx:
        batch = make_batch(7)
        before = ctx.embedding_tier.lookup(batch, train=True)
        output, _ = ctx.forward(batch)
        weights = torch.ones(16)
        weights[3] = float("nan")
        ctx.backward((output.squeeze(1) * weights).sum())
        assert ctx.nonfinite_embedding_steps == 1
        after = ctx.embedding_tier.lookup(batch, train=False)
        for x, y in zip(before.slots, after.slots):
            assert torch.equal(x.embeddings, y.embeddings), x.name


def test_mixed_precision_is_ignored_on_cpu_which_trains_in_fp32():
    with new_ctx() as ctx:  # mixed_precision=True by default
        assert ctx.mixed_precision is False
        assert not ctx.grad_scaler.is_enabled()
        output, _ = ctx.forward(make_batch(0))
        assert output.dtype == torch.float32


def test_float64_inputs_and_labels_become_float32_and_integer_labels_stay_integers():
    good = make_batch(0)
    batch = Batch(
        good.id_type_features,
        [NonIDTypeFeature(good.non_id_type_features[0].data.astype(np.float64), name="dense")],
        [Label(good.labels[0].data.astype(np.float64)), Label(np.arange(16, dtype=np.int64))],
        requires_grad=True,
    )
    with new_ctx() as ctx:
        non_ids, embeddings, labels = ctx.prepare_features(batch)
        assert [t.dtype for t in non_ids] == [torch.float32]
        assert [t.dtype for t in embeddings] == [torch.float32, torch.float32]
        assert [t.dtype for t in labels] == [torch.float32, torch.int64]
        assert labels[1].tolist() == list(range(16))


def test_an_inference_ctx_builds_a_read_only_tier_and_an_eval_ctx_does_not():
    batch = make_batch(1)
    with EmbeddingCtx(
        PreprocessMode.INFERENCE, TinyModel(), embedding_config=CONFIG, global_config=GLOBAL
    ) as ctx:
        assert [shard.read_only for shard in ctx.embedding_tier.shards] == [True]
        with pytest.raises(FailedPreconditionError):
            ctx.embedding_tier.lookup(batch, train=True)
    with EmbeddingCtx(
        PreprocessMode.EVAL, TinyModel(), embedding_config=CONFIG, global_config=GLOBAL
    ) as ctx:
        assert [shard.read_only for shard in ctx.embedding_tier.shards] == [False]


def test_a_distributed_run_without_embedding_workers_is_refused(monkeypatch):
    from training.ctx import make_embedding_tier
    from training.env import EMBEDDING_WORKERS_ENV

    monkeypatch.delenv(EMBEDDING_WORKERS_ENV, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(FailedPreconditionError) as refused:
        make_embedding_tier(CONFIG, GLOBAL, None)
    assert str(refused.value) == (
        "WORLD_SIZE > 1 needs one shared embedding tier: pass embedding_workers or set "
        "RECSERVE_EMBEDDING_WORKERS (the embedded tier is per process)"
    )


def test_training_retries_calls_to_a_remote_worker_it_cannot_reach(monkeypatch):
    """A shard or worker restarting mid-run must not end the run at its first refused call
    (embedding_store.worker_client's retries; serving and admin clients do not retry)."""
    from embedding_store.worker_client import RemoteEmbeddingWorker
    from training.ctx import TIER_RETRY_SECONDS, make_embedding_tier

    monkeypatch.setattr(RemoteEmbeddingWorker, "wait_for_serving", lambda self, timeout: None)
    tier = make_embedding_tier(CONFIG, GLOBAL, ["127.0.0.1:1"])
    try:
        assert isinstance(tier, RemoteEmbeddingWorker)
        assert tier.retry_seconds == TIER_RETRY_SECONDS == 30.0
    finally:
        tier.close()


@pytest.mark.parametrize("job_type", ["Eval", "Infer"])
def test_a_train_ctx_refuses_a_global_config_object_that_does_not_train(job_type):
    config = global_config_from_mapping({"common_config": {"job_type": job_type}})
    with pytest.raises(ConfigError) as refused:
        sgd_ctx(global_config=config)
    assert str(refused.value) == (
        f"global_config (a GlobalConfig object): common_config.job_type: TrainCtx trains, "
        f"got {job_type!r} (read-only lookups, for serving): use 'Train'"
    )


# --------------------------------------------------------------------- signature, failures


def test_a_batch_that_does_not_match_the_runs_signature_is_refused():
    good = make_batch(0)
    swapped = Batch(
        list(reversed(good.id_type_features)),  # the model takes its embeddings by position
        good.non_id_type_features,
        good.labels,
        requires_grad=True,
    )
    with new_ctx(staleness=1) as ctx:
        train_steps(ctx, 1)
        with pytest.raises(BatchValidationError) as refused:
            ctx.forward(swapped)
        assert str(refused.value) == (
            "ID features ['item', 'user'] do not match the model's ['user', 'item'] "
            "(names and order)"
        )
        train_steps(ctx, 1, offset=1)  # the refusal took no staleness slot
        assert ctx.step == 2


class IndexingModel(torch.nn.Module):
    """Indexes an nn.Embedding with its int64 non-ID feature ``city`` [B, 1], which only
    takes integer tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.city = torch.nn.Embedding(10, 2)
        self.linear = torch.nn.Linear(4 + 2, 1)

    def forward(self, non_id_tensors: list[torch.Tensor], embedding_tensors: list[torch.Tensor]):
        return self.linear(torch.cat([embedding_tensors[0], self.city(non_id_tensors[0][:, 0])], 1))


def test_an_eval_ctx_holds_batches_to_the_runs_signature_as_training_does():
    """A later batch's integer feature sent as whole floats (a pandas column with a missing
    value) trains as the int64 of the first batch; eval_ctx gave the model float32 (an
    nn.Embedding then raised), and took 2.5 or a missing feature that training refuses."""

    def batch(city: np.ndarray, users: list[int] = [1, 2, 3, 4]) -> Batch:  # noqa: B006
        return Batch(
            [IDTypeFeature.from_lists("user", [[u] for u in users])],
            [NonIDTypeFeature(city.reshape(-1, 1), name="city")],
            [Label(np.ones((len(users), 1), dtype=np.float32))],
            requires_grad=True,
        )

    with new_ctx(embedding_lr=0.1, model_class=IndexingModel) as ctx:
        output, labels = ctx.forward(batch(np.array([1, 2, 3, 4], dtype=np.int64)))
        ctx.backward(torch.nn.functional.binary_cross_entropy_with_logits(output, labels[0]))
        with eval_ctx(ctx) as evaluator:
            as_ints, _ = evaluator.forward(batch(np.array([1, 2, 3, 4], dtype=np.int64)))
            as_floats, _ = evaluator.forward(batch(np.array([1.0, 2.0, 3.0, 4.0])))
            assert torch.equal(as_floats, as_ints)
            with pytest.raises(BatchValidationError) as refused:
                evaluator.forward(batch(np.array([1.0, 2.5, 3.0, 4.0])))
            assert str(refused.value) == (
                "non-ID feature 'city' is an integer feature of the model (int64), given as "
                "float64: value 2.5 at sample 1, position [0] is not a whole number in the "
                "range of int64"
            )
            unlabeled = Batch(
                [IDTypeFeature.from_lists("user", [[1]])], [], [], requires_grad=False
            )
            with pytest.raises(BatchValidationError) as refused:
                evaluator.forward(unlabeled)
            assert str(refused.value) == "non-ID feature 'city' is missing"


def test_a_resumed_run_takes_the_checkpoints_signature(tmp_path):
    with new_ctx() as ctx:
        train_steps(ctx, 1)
        ctx.dump_checkpoint(tmp_path / "ckpt", with_jit_model=False)
    with new_ctx() as resumed:
        resumed.load_checkpoint(tmp_path / "ckpt")
        assert resumed.signature == ctx.signature
        assert [spec.name for spec in resumed.signature.id_features] == ["user", "item"]
        good = make_batch(1)
        swapped = Batch(
            list(reversed(good.id_type_features)),
            good.non_id_type_features,
            good.labels,
            requires_grad=True,
        )
        with pytest.raises(BatchValidationError, match="do not match the model's"):
            resumed.forward(swapped)


class FailingTier(InProcessEmbeddingTier):
    """An in-process tier whose embedding updates fail."""

    def __init__(self) -> None:
        super().__init__(CONFIG, capacity=10_000, optimizer=SGD(lr=0.5))

    def backward(self, ref, grads):
        raise RuntimeError("shard 0 is gone")


def _failing_ctx(tier: InProcessEmbeddingTier) -> TrainCtx:
    return new_ctx(staleness=10, embedding_tier=tier)


def test_a_failed_embedding_update_is_raised_by_the_next_forward():
    ctx = _failing_ctx(FailingTier())
    ctx.__enter__()
    try:
        train_steps(ctx, 1)
        ctx._backward_queue.join()  # the update has failed, nothing waited for it yet
        with pytest.raises(RuntimeError, match=r"^shard 0 is gone$"):
            ctx.forward(make_batch(1))
    finally:
        ctx.__exit__(None, None, None)


def test_a_failed_last_embedding_update_is_raised_when_the_ctx_exits():
    ctx = _failing_ctx(FailingTier())
    with pytest.raises(RuntimeError, match=r"^shard 0 is gone$"), ctx:
        train_steps(ctx, 1)
    assert ctx._backward_workers == []


class StuckTier(InProcessEmbeddingTier):
    """A tier whose embedding updates hang (a worker that cannot be reached, its calls
    retried) until the tier is closed, or ``limit`` seconds."""

    def __init__(self, limit: float) -> None:
        super().__init__(CONFIG, capacity=10_000, optimizer=SGD(lr=0.5))
        self.limit = limit
        self.closed = threading.Event()
        self.updates = 0

    def backward(self, ref, grads):
        self.closed.wait(self.limit)
        self.updates += 1
        return super().backward(ref, grads)

    def close(self) -> None:
        self.closed.set()


def test_a_ctx_left_on_an_exception_drops_the_queued_updates_and_keeps_that_exception(
    monkeypatch, caplog
):
    """A run that failed (here the loop's own error) used to wait for every queued update, a
    tier call each (30 s of retries for a worker that cannot be reached): minutes before it
    ended, and then with the tier's error instead of its own."""
    monkeypatch.setattr("training.ctx._STOP_JOIN_SECONDS", 0.2)
    tier = StuckTier(limit=1.0)
    ctx = new_ctx(staleness=4, embedding_tier=tier)
    started = time.monotonic()
    with pytest.raises(ZeroDivisionError, match=r"^the loop's own error$"), ctx:
        train_steps(ctx, 3)  # 3 updates queued: the first one taken and stuck in the tier
        for _ in range(200):
            if ctx._backward_queue.qsize() == 2:
                break
            time.sleep(0.01)
        started = time.monotonic()
        raise ZeroDivisionError("the loop's own error")
    assert time.monotonic() - started < 0.8  # not 3 x 1 s
    assert ctx._backward_workers == [] and tier.updates == 0
    assert "training stopped (ZeroDivisionError): 2 queued embedding update(s) not applied" in (
        caplog.text
    )
    assert ctx._in_flight._value == 3  # the dropped updates' staleness slots given back
    for _ in range(300):  # the update under way ends by itself, and gives its slot back
        if ctx._in_flight._value == 4:
            break
        time.sleep(0.01)
    assert (tier.updates, ctx._in_flight._value) == (1, 4)


# --------------------------------------------------------------------- TrainCtx.dump_checkpoint


def test_dump_checkpoint_passes_train_state_jit_choice_signature_and_step(tmp_path):
    """The loop's train_state, the step and the skipped non-finite steps (run totals like the
    step: they used to start again at 0 on resume, under a step count that went on)."""
    with new_ctx() as ctx:
        train_steps(ctx, 2)
        output, _ = ctx.forward(make_batch(7))
        ctx.backward((output * float("inf")).sum())  # skipped: its gradients are not finite
        state = {"epochs_done": 2, "seed": 7, "nonfinite_dense_steps": 5}  # the ctx's count wins
        written = ctx.dump_checkpoint(tmp_path / "ckpt", with_jit_model=False, train_state=state)
    manifest = training_checkpoint.read_manifest(tmp_path / "ckpt")
    assert written.version == manifest.version
    assert manifest.step == 3
    saved = {
        "epochs_done": 2,
        "seed": 7,
        "nonfinite_embedding_steps": 1,
        "nonfinite_dense_steps": 1,
    }
    assert manifest.train_state == saved
    assert not manifest.has_jit_model and "jit_dense.pt" not in manifest.files
    assert manifest.signature == ctx.signature and manifest.signature is not None
    with new_ctx() as resumed:
        loaded = resumed.load_checkpoint(tmp_path / "ckpt")
        assert loaded.train_state == saved and resumed.step == 3
        assert (resumed.nonfinite_embedding_steps, resumed.nonfinite_dense_steps) == (1, 1)


def test_dump_checkpoint_refuses_an_existing_checkpoint_unless_told_to_overwrite(tmp_path):
    target = tmp_path / "ckpt"
    with new_ctx() as ctx:
        train_steps(ctx, 1)
        first = ctx.dump_checkpoint(target, with_jit_model=False)
        train_steps(ctx, 1, offset=1)
        with pytest.raises(AlreadyExistsError, match="already exists; refusing to overwrite"):
            ctx.dump_checkpoint(target, with_jit_model=False)
        assert training_checkpoint.read_manifest(target).version == first.version
        second = ctx.dump_checkpoint(target, with_jit_model=False, overwrite=True)
    assert training_checkpoint.read_manifest(target).step == 2
    assert second.version != first.version


def test_the_warning_about_rows_left_in_the_tier_gives_the_whole_clear_command(caplog) -> None:
    """It said "run `recserve embedding-tier clear` first", a command that then refuses to
    run without its required --worker."""
    import types

    from embedding_store.tier import TierStatus

    class LeftRows:
        address = "127.0.0.1:7201"

        def status(self) -> TierStatus:
            return TierStatus((180, 194), (1000, 1000), 0, 0, 0)

    with caplog.at_level("WARNING", logger="training.ctx"):
        TrainCtx._warn_if_tier_holds_rows(types.SimpleNamespace(embedding_tier=LeftRows()))
    assert caplog.messages == [
        "the embedding tier already holds 374 rows (an earlier run's?): training continues "
        "from them and their optimizer state unless a checkpoint is loaded; for a fresh start "
        "run `recserve embedding-tier clear --worker 127.0.0.1:7201` first"
    ]


def test_a_device_id_beyond_the_machines_gpus_is_refused_with_the_count(monkeypatch):
    """device_id is LOCAL_RANK: a third rank on a two-GPU node is told why, at once (torch
    would only fail at the first tensor moved there, "invalid device ordinal")."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(InvalidArgumentError) as refused:
        new_ctx(device_id=2)
    assert str(refused.value) == (
        "device_id=2 but this machine has 2 CUDA device(s) (0..1, as CUDA_VISIBLE_DEVICES "
        "shows them): one GPU per NN worker, so run at most 2 worker(s) per node "
        "(recserve train --nproc-per-node)"
    )
    assert new_ctx(device_id=1).device == torch.device("cuda", 1)  # nothing moves before enter


def _amp_ctx(finite_check_every: int) -> TrainCtx:
    """An entered-to-be TrainCtx whose mixed precision runs on CPU (fp16 autocast and a
    GradScaler starting at 1024): the CUDA code path, device-generic, on this machine."""
    ctx = new_ctx(staleness=1, finite_check_every=finite_check_every)
    ctx.mixed_precision = True
    ctx.grad_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return ctx


def test_an_overflow_the_loss_scaler_skips_sends_no_embedding_gradients_unchecked_either():
    """With mixed precision the GradScaler skips a step whose dense gradients overflowed;
    that step's embedding gradients (Inf here) used to reach the tier on the steps
    finite_check_every does not check, and made its rows Inf/NaN for good."""
    with _amp_ctx(finite_check_every=2) as ctx:
        train_steps(ctx, 1)  # step 0, checked
        assert ctx.grad_scaler.get_scale() == 1024.0
        batch = make_batch(7)
        before = ctx.embedding_tier.lookup(batch, train=True)
        bias = ctx.dense_model.linear.bias.detach().clone()
        output, _ = ctx.forward(batch)  # step 1: not checked
        ctx.backward((output.float() * float("inf")).sum())
        assert ctx.grad_scaler.get_scale() == 512.0  # the scaler found the overflow
        assert torch.equal(ctx.dense_model.linear.bias, bias)
        assert ctx.nonfinite_embedding_steps == 1
        after = ctx.embedding_tier.lookup(batch, train=False)
        for x, y in zip(before.slots, after.slots):
            assert torch.equal(x.embeddings, y.embeddings), x.name
        train_steps(ctx, 2, offset=20)  # and training goes on at the lower scale
        assert ctx.grad_scaler.get_scale() == 512.0 and ctx.nonfinite_embedding_steps == 1


def test_an_overflow_in_the_embedding_gradients_only_backs_the_loss_scale_off():
    """The GradScaler sees only the dense gradients: when only the embedding gradients
    overflow, the step is skipped (dense and embeddings) and the scale halved, as the
    GradScaler does; it used to stay where it overflowed, every such update skipped."""
    with _amp_ctx(finite_check_every=1) as ctx:
        train_steps(ctx, 2)
        assert ctx.grad_scaler.state_dict()["_growth_tracker"] == 2  # steps without overflow
        batch = make_batch(7)
        before = ctx.embedding_tier.lookup(batch, train=True)
        with torch.no_grad():  # inputs: user [0:4], item [4:8], dense [8:10]
            ctx.dense_model.linear.weight[:, 4:8] = float("inf")
        bias = ctx.dense_model.linear.bias.detach().clone()
        output, _ = ctx.forward(batch)
        ctx.backward(output.sum())  # dense gradients finite, item's gradient is not
        state = ctx.grad_scaler.state_dict()
        assert (state["scale"], state["_growth_tracker"]) == (512.0, 0)
        assert torch.equal(ctx.dense_model.linear.bias, bias)
        assert (ctx.step, ctx.nonfinite_embedding_steps) == (3, 1)
        after = ctx.embedding_tier.lookup(batch, train=False)
        for x, y in zip(before.slots, after.slots):
            assert torch.equal(x.embeddings, y.embeddings), x.name


def test_with_mixed_precision_every_rank_skips_when_one_ranks_embeddings_overflowed(
    monkeypatch,
):
    """DDP ranks must keep one loss scale (their allreduced dense gradients are unscaled by
    it) and take the same dense steps: the embedding gradients' verdict is all-reduced, and
    a rank whose own gradients are finite skips with the one whose are not."""
    agreed: list[bool] = []

    def another_rank_overflowed(ok: bool) -> bool:
        agreed.append(ok)
        return False

    with _amp_ctx(finite_check_every=1) as ctx:
        monkeypatch.setattr("training.distributed.all_agree", another_rank_overflowed)
        bias = ctx.dense_model.linear.bias.detach().clone()
        train_steps(ctx, 1)
        assert agreed == [True]  # this rank's own gradients were finite
        assert ctx.grad_scaler.get_scale() == 512.0
        assert torch.equal(ctx.dense_model.linear.bias, bias)
        assert ctx.nonfinite_embedding_steps == 1


# How torch.save and torch.jit.save (pickle protocol 2) write a storage's location.
_ON_CPU, _ON_GPU = b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0"


def _as_if_saved_on_a_gpu(directory) -> list[str]:
    """Rewrite a checkpoint's dense files as a GPU-trained run writes them: every tensor
    storage says cuda:0 (torch.load without map_location then fails on a CPU-only machine,
    as torch.jit.load does). The manifest's sizes and SHA-256 follow. Returns the files
    that had tensors."""
    manifest_path = directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    rewritten = []
    for name in manifest["files"]:
        if name == "rng_state.safetensors":
            continue  # no zip, no storage locations: written the same on a GPU
        path = directory / name
        source = zipfile.ZipFile(io.BytesIO(path.read_bytes()))
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
            for info in source.infolist():
                data = source.read(info.filename)
                if info.filename.endswith("/data.pkl") and _ON_CPU in data:
                    data = data.replace(_ON_CPU, _ON_GPU)
                    rewritten.append(name)
                target.writestr(info.filename, data)
        path.write_bytes(out.getvalue())
        manifest["files"][name].update(
            bytes=len(out.getvalue()), sha256=hashlib.sha256(out.getvalue()).hexdigest()
        )
    manifest_path.write_text(json.dumps(manifest))
    return rewritten


def _adam_dense_ctx() -> TrainCtx:
    """A TrainCtx over a TinyModel seeded with 0 whose dense optimizer (Adam) keeps
    tensors in its state."""
    return new_ctx(embedding_lr=0.1, dense_optimizer=functools.partial(torch.optim.Adam, lr=0.01))


def test_a_checkpoint_written_on_a_gpu_resumes_and_serves_on_a_cpu_only_machine(tmp_path):
    """Every dense file is loaded with map_location="cpu": dense.pt and opt.pt on resume,
    jit_dense.pt for serving (TorchScript: the model as it was on the GPU)."""
    from serving.model import load_model

    with _adam_dense_ctx() as ctx:
        train_steps(ctx, 3)
        ctx.dump_checkpoint(tmp_path / "ckpt")
        batch = make_batch(9, labels=False)
        with eval_ctx(ctx) as evaluator:
            expected, _ = evaluator.forward(batch)
        weight = ctx.dense_model.linear.weight.detach().clone()
        moments = ctx.dense_optimizer.state_dict()["state"][0]["exp_avg"].clone()
    written = _as_if_saved_on_a_gpu(tmp_path / "ckpt")
    assert sorted(written) == ["dense.pt", "jit_dense.pt", "opt.pt"]
    with pytest.raises(RuntimeError, match="CUDA"):  # what a load without map_location does
        torch.load(tmp_path / "ckpt" / "dense.pt", weights_only=True)

    model = load_model(tmp_path / "ckpt", name="m", warm_up=False, onednn_min_rows=0)
    try:
        assert model.dense.linear.weight.device == torch.device("cpu")
        predictions = model.infer(batch).predictions
    finally:
        model.close()
    np.testing.assert_allclose(predictions, expected.numpy(), rtol=0, atol=1e-6)

    with _adam_dense_ctx() as resumed:
        resumed.load_checkpoint(tmp_path / "ckpt")
        assert torch.equal(resumed.dense_model.linear.weight, weight)
        state = resumed.dense_optimizer.state_dict()["state"][0]["exp_avg"]
        assert state.device == torch.device("cpu") and torch.equal(state, moments)


def test_optimizers_in_each_others_place_are_refused_by_name():
    """Both libraries name one Adam: torch's as the embedding optimizer used to fail at the
    tier's configure ("must be an SGD, Adagrad or Adam instance, got Adam"), and the
    embeddings' Adam as the dense one was accepted, failing at the first step with an
    AttributeError. Both are refused as TrainCtx is made, saying which goes where."""
    model = TinyModel()
    torch_adam = torch.optim.Adam(model.parameters(), lr=0.01)
    options = {"embedding_config": CONFIG, "global_config": GLOBAL}
    with pytest.raises(InvalidArgumentError) as refused:
        TrainCtx(torch_adam, torch_adam, model, **options)
    assert refused.value.message == (
        "TrainCtx's first argument, the embedding optimizer, must be SGD, Adagrad or Adam from "
        "embedding_store.optimizers, got torch.optim.adam.Adam (a torch optimizer is the dense "
        "one, TrainCtx's second argument)"
    )
    with pytest.raises(InvalidArgumentError) as refused:
        TrainCtx(Adam(lr=0.1), Adam(lr=0.1), model, **options)
    assert refused.value.message == (
        "TrainCtx's second argument, the dense optimizer, must be a torch.optim.Optimizer over "
        "the model's parameters, got embedding_store.optimizers.Adam (embedding_store."
        "optimizers' optimizers are for the embeddings, TrainCtx's first argument)"
    )
    with pytest.raises(InvalidArgumentError) as refused:
        TrainCtx("adam", torch_adam, model, **options)  # type: ignore[arg-type]
    assert refused.value.message.endswith("from embedding_store.optimizers, got str")


def test_a_dense_optimizer_over_another_models_parameters_is_refused():
    """Made over another instance of the model, it stepped parameters without gradients:
    the dense model never trained, and nothing said so."""
    model, other = TinyModel(), TinyModel()
    options = {"embedding_config": CONFIG, "global_config": GLOBAL}
    with pytest.raises(InvalidArgumentError) as refused:
        TrainCtx(SGD(lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1), model, **options)
    assert refused.value.message == (
        "TrainCtx's dense optimizer holds none of the model's parameters (made over another "
        "model instance?): the dense model would never train; make it over model.parameters()"
    )
    extra = torch.nn.Parameter(torch.zeros(1))  # a learned loss weight, say: allowed
    both = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    with TrainCtx(SGD(lr=0.1), both, model, **options) as ctx:
        train_steps(ctx, 1)
        assert ctx.step == 1


# ------------------------------------------------------------------------------------------
# dense gradient clipping (dense_grad_clip_norm)


def _clip_ctx(clip: float | None, dense_lr: float = 1.0) -> TrainCtx:
    """A synchronous TrainCtx over a TinyModel seeded with 0, plain SGD on both sides (dense
    lr ``dense_lr``: with 1, a step subtracts the gradient as it is), clipping the dense
    gradients to ``clip``."""
    return new_ctx(
        dense_optimizer=functools.partial(torch.optim.SGD, lr=dense_lr),
        dense_grad_clip_norm=clip,
    )


def _bce(output: torch.Tensor, labels: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy_with_logits(output.float(), labels[0])


def _clipped_by_hand(
    loss: torch.Tensor, params: list[torch.Tensor], limit: float
) -> tuple[list[torch.Tensor], float]:
    """``loss``'s gradients for ``params``, clipped to ``limit`` by clip_grad_norm_ on copies
    (the graph is kept for the ctx's own backward), and their norm before clipping."""
    grads = torch.autograd.grad(loss, params, retain_graph=True)
    copies = [p.detach().clone() for p in params]
    for copy, grad in zip(copies, grads):
        copy.grad = grad.clone()
    norm = float(torch.nn.utils.clip_grad_norm_(copies, limit))
    return [copy.grad for copy in copies], norm


def test_dense_gradients_are_clipped_before_the_step_and_the_embedding_gradients_are_not():
    limit = 0.01
    batch = make_batch(0)
    with _clip_ctx(limit) as ctx, _clip_ctx(None) as plain:
        params = list(ctx.dense_model.parameters())
        before = [p.detach().clone() for p in params]
        output, labels = ctx.forward(batch)
        loss = _bce(output, labels)
        clipped, norm = _clipped_by_hand(loss, params, limit)
        assert norm > 10 * limit  # so the limit is what the step shows
        assert ctx.last_dense_grad_norm is None  # no step clipped yet
        ctx.backward(loss)
        # The norm before clipping, kept to log (clip_grad_norm_ returns it).
        assert ctx.last_dense_grad_norm == norm
        # SGD, lr 1: each parameter moved by exactly its clipped gradient.
        for param, old, grad in zip(params, before, clipped):
            assert torch.equal(param.detach(), old - grad)
        moved = torch.cat([(old - p.detach()).reshape(-1) for p, old in zip(params, before)])
        assert float(moved.norm()) == pytest.approx(limit, rel=1e-5)
        # The embedding rows moved as in a run that clips nothing (same weights, same batch).
        output, labels = plain.forward(batch)
        plain.backward(_bce(output, labels))
        assert plain.last_dense_grad_norm is None  # it clips nothing
        ours = ctx.embedding_tier.lookup(batch, train=False)
        theirs = plain.embedding_tier.lookup(batch, train=False)
        for x, y in zip(ours.slots, theirs.slots):
            assert torch.equal(x.embeddings, y.embeddings), x.name


def test_a_clip_norm_above_the_gradients_norm_changes_nothing():
    with _clip_ctx(1e6, dense_lr=0.1) as ctx, _clip_ctx(None, dense_lr=0.1) as plain:
        assert train_steps(ctx, 3) == train_steps(plain, 3)
        for ours, theirs in zip(ctx.dense_model.parameters(), plain.dense_model.parameters()):
            assert torch.equal(ours, theirs)


def test_with_mixed_precision_the_unscaled_dense_gradients_are_clipped():
    """torch's GradScaler recipe: unscale_, clip, step. Clipping the gradients of the loss
    scaled by 1024 moved the weights 1024 times less than the limit."""
    limit = 0.01
    ctx = _clip_ctx(limit)
    ctx.mixed_precision = True  # the CUDA code path on CPU, as _amp_ctx
    ctx.grad_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with ctx:
        params = list(ctx.dense_model.parameters())
        before = [p.detach().clone() for p in params]
        output, labels = ctx.forward(make_batch(0))
        assert output.dtype == torch.float16  # autocast ran
        loss = _bce(output, labels)
        clipped, norm = _clipped_by_hand(loss, params, limit)
        assert norm > 10 * limit
        ctx.backward(loss)
        assert ctx.grad_scaler.get_scale() == 1024.0  # no overflow: the step was taken
        assert ctx.last_dense_grad_norm == pytest.approx(norm, rel=1e-6)  # unscaled
        for param, old, grad in zip(params, before, clipped):
            torch.testing.assert_close(param.detach(), old - grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "1.0", True])
def test_an_invalid_dense_grad_clip_norm_is_refused_by_name(value):
    with pytest.raises(InvalidArgumentError) as caught:
        _clip_ctx(value)
    assert caught.value.message == (
        "dense_grad_clip_norm must be a positive finite number (the largest L2 norm of the "
        f"dense gradients) or None for no clipping, got {value!r}"
    )


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "1.0"])
def test_a_clip_norm_set_after_construction_is_checked_as_the_constructors(value):
    """Set between steps, a value went to clip_grad_norm_ unchecked: a NaN made every
    dense gradient NaN, a negative one reversed them."""
    with _clip_ctx(1.0) as ctx:
        with pytest.raises(InvalidArgumentError) as caught:
            ctx.dense_grad_clip_norm = value
        assert caught.value.message == (
            "dense_grad_clip_norm must be a positive finite number (the largest L2 norm of "
            f"the dense gradients) or None for no clipping, got {value!r}"
        )
        assert ctx.dense_grad_clip_norm == 1.0  # unchanged
        ctx.dense_grad_clip_norm = 2  # an int, as the constructor takes it
        assert (ctx.dense_grad_clip_norm, type(ctx.dense_grad_clip_norm)) == (2.0, float)
        ctx.dense_grad_clip_norm = None
        assert ctx.dense_grad_clip_norm is None


def test_a_clip_norm_set_between_steps_applies_and_the_last_norm_is_read_only():
    limit = 0.01
    with _clip_ctx(None) as ctx:
        train_steps(ctx, 1)
        assert ctx.last_dense_grad_norm is None
        ctx.dense_grad_clip_norm = limit
        params = list(ctx.dense_model.parameters())
        before = [p.detach().clone() for p in params]
        output, labels = ctx.forward(make_batch(1))
        loss = _bce(output, labels)
        _, norm = _clipped_by_hand(loss, params, limit)
        ctx.backward(loss)
        assert ctx.last_dense_grad_norm == norm and norm > 10 * limit
        moved = torch.cat([(old - p.detach()).reshape(-1) for p, old in zip(params, before)])
        assert float(moved.norm()) == pytest.approx(limit, rel=1e-5)
        ctx.dense_grad_clip_norm = None  # off again: the last clipped step's norm stays
        train_steps(ctx, 1)
        assert ctx.last_dense_grad_norm == norm
        with pytest.raises(AttributeError):  # its message differs between Python versions
            ctx.last_dense_grad_norm = 1.0  # type: ignore[misc]
        assert ctx.last_dense_grad_norm == norm


def test_clipping_a_model_with_sparse_embedding_gradients_is_refused():
    """torch's clip_grad_norm_ cannot take sparse gradients: it failed at the first step."""

    class SparseModel(TinyModel):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Embedding(3, 2, sparse=True)

    model = SparseModel()
    with pytest.raises(InvalidArgumentError, match="model's 'table' makes sparse gradients"):
        TrainCtx(
            SGD(lr=0.5),
            torch.optim.SGD(model.parameters(), lr=0.1),
            model,
            embedding_config=CONFIG,
            global_config=GLOBAL,
            dense_grad_clip_norm=1.0,
        )


# ------------------------------------------------------------------------------------------
# eval_ctx waits for the updates training left pending


class GatedTier(InProcessEmbeddingTier):
    """An in-process tier that applies a batch's gradients only once ``gate`` is set: the
    update stays pending, its backward worker waiting, for as long as the test wants."""

    def __init__(self) -> None:
        super().__init__(CONFIG, capacity=10_000, optimizer=SGD(lr=0.5))
        self.gate = threading.Event()

    def backward(self, ref, grads):
        self.gate.wait(10)  # the timeout only keeps a broken TrainCtx from hanging the test
        return super().backward(ref, grads)


def test_an_eval_ctx_sees_every_embedding_update_training_left_pending(monkeypatch):
    """With embedding_staleness > 1 a batch's update may still be pending when evaluation
    starts: eval_ctx used to score with the rows as they were before it, unless the caller
    waited first. Here the updates land only once someone waits for them."""
    tier = GatedTier()
    ctx = new_ctx(staleness=4, embedding_tier=tier)
    wait = ctx.wait_for_embedding_updates

    def open_gate_and_wait() -> None:
        tier.gate.set()
        try:
            wait()
        finally:
            tier.gate.clear()

    monkeypatch.setattr(ctx, "wait_for_embedding_updates", open_gate_and_wait)
    with ctx:
        evaluator = eval_ctx(ctx)  # made once, used after each of two training steps
        for seed in (0, 1):
            batch = make_batch(seed)
            train_steps(ctx, 1, offset=seed)
            pending = tier.lookup(batch, train=False)  # its update not applied yet
            scored, _ = evaluator.forward(batch)
            again, _ = evaluator.forward(batch)  # no new step: no wait, the same rows
            wait()
            updated = tier.lookup(batch, train=False)
            with torch.no_grad():
                expected = ctx.dense_model(
                    [torch.from_numpy(np.array(batch.non_id_type_features[0].data))],
                    [slot.embeddings for slot in updated.slots],
                )
            assert not torch.equal(pending.slots[0].embeddings, updated.slots[0].embeddings)
            assert torch.equal(scored, expected) and torch.equal(again, expected)
