"""Two DDP NN workers (torchrun, gloo) training against a networked embedding tier.

A :class:`LocalCluster` (2 parameter-server shards + 1 embedding worker, on 127.0.0.1) holds
the embeddings; ``recserve train --nproc-per-node 2 --embedding-workers ADDR`` runs the
training script on two ranks that share it. Every subprocess runs in its own session and is
killed by its process-group ID on teardown; the cluster stops its own processes by PID.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch

from embedding_store.launcher import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "adult_income" / "train.py"
EMBEDDING_CONFIG = ROOT / "examples" / "adult_income" / "embedding_config.yml"
TIMEOUT = 240

# A TrainCtx opened on the tier and closed again (argument: the embedding config).
OPEN_AND_CLOSE_SCRIPT = textwrap.dedent(
    """
    import logging
    import sys

    import torch

    from embedding_store.config import load_embedding_config
    from embedding_store.optimizers import SGD
    from training.ctx import TrainCtx

    logging.basicConfig(level=logging.INFO)
    dense = torch.nn.Linear(3, 1)
    with TrainCtx(
        SGD(lr=0.1),
        torch.optim.SGD(dense.parameters(), lr=0.1),
        dense,
        embedding_config=load_embedding_config(sys.argv[1]),
    ):
        pass
    """
)

# One TrainCtx step on each rank, on a batch that differs per rank; each rank saves its dense
# state before and after the step (after DDP's initial broadcast, so "before" is shared).
# Then a step where rank 1's batch has a NaN label: the allreduced dense gradients are NaN on
# both ranks, and both must skip the dense step (state "after-nan", skip counts "skips").
# Last, a step with the dense gradients clipped (state "after-clip").
ONE_STEP_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import numpy as np
    import torch

    from embedding_store.batch import Batch, IDTypeFeatureWithSingleID, Label, NonIDTypeFeature
    from embedding_store.config import load_embedding_config
    from embedding_store.optimizers import SGD
    from training import distributed
    from training.ctx import TrainCtx

    config_path, out = sys.argv[1], Path(sys.argv[2])
    rank = int(__import__("os").environ["RANK"])
    torch.manual_seed(100 + rank)  # different initial weights: DDP must broadcast rank 0's
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(8 + 8 + 3, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1))


    class Dense(torch.nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

        def forward(self, non_id_tensors, embedding_tensors):
            return self.mlp(torch.cat(embedding_tensors + non_id_tensors, dim=1))


    dense = Dense(model)
    rng = np.random.default_rng(rank)  # rank-specific batch
    size = 64
    batch = Batch(
        [
            IDTypeFeatureWithSingleID("workclass", rng.integers(0, 20, size).astype(np.uint64)),
            IDTypeFeatureWithSingleID("education", rng.integers(0, 20, size).astype(np.uint64)),
        ],
        [NonIDTypeFeature(rng.normal(size=(size, 3)).astype(np.float32))],
        [Label(rng.integers(0, 2, (size, 1)).astype(np.float32))],
        requires_grad=True,
    )
    with TrainCtx(
        SGD(lr=0.1),
        torch.optim.SGD(dense.parameters(), lr=0.5),
        dense,
        embedding_config=load_embedding_config(config_path),
        embedding_staleness=1,
    ) as ctx:
        assert ctx.distributed and distributed.world_size() == 2
        torch.save(ctx.dense_model.state_dict(), out / f"before-{rank}.pt")
        output, labels = ctx.forward(batch)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(output, labels[0])
        ctx.backward(loss)
        ctx.wait_for_embedding_updates()
        torch.save(ctx.dense_model.state_dict(), out / f"after-{rank}.pt")
        (out / f"loss-{rank}.txt").write_text(repr(float(loss)))
        labels = batch.labels[0].data.copy()
        if rank == 1:
            labels[5, 0] = float("nan")
        poisoned = Batch(batch.id_type_features, batch.non_id_type_features, [Label(labels)])
        output, labels = ctx.forward(poisoned)
        ctx.backward(torch.nn.functional.binary_cross_entropy_with_logits(output, labels[0]))
        ctx.wait_for_embedding_updates()
        torch.save(ctx.dense_model.state_dict(), out / f"after-nan-{rank}.pt")
        skips = (ctx.nonfinite_dense_steps, ctx.nonfinite_embedding_steps)
        (out / f"skips-{rank}.txt").write_text(repr(skips))
        ctx.dense_grad_clip_norm = 0.001  # far below the gradients' norm
        output, labels = ctx.forward(batch)
        ctx.backward(torch.nn.functional.binary_cross_entropy_with_logits(output, labels[0]))
        torch.save(ctx.dense_model.state_dict(), out / f"after-clip-{rank}.pt")
        (out / f"norm-{rank}.txt").write_text(repr(ctx.last_dense_grad_norm))
    distributed.shutdown_distributed()
    """
)


# Rank 0 has 3 batches, rank 1 has 2 (what round-robin streaming deals from 5): a DataLoader
# with equal_steps ends both ranks after 2 steps. Then a checkpoint into a directory that
# exists already: rank 0's write fails, and rank 1 must fail with it, not carry on.
EQUAL_STEPS_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import numpy as np
    import torch

    from embedding_store.batch import Batch, IDTypeFeatureWithSingleID, Label, NonIDTypeFeature
    from embedding_store.config import load_embedding_config
    from embedding_store.errors import RecserveError
    from embedding_store.optimizers import SGD
    from training import distributed
    from training.ctx import TrainCtx
    from training.data import DataLoader, IterableDataset

    config_path, out = sys.argv[1], Path(sys.argv[2])
    rank = int(__import__("os").environ["RANK"])
    torch.set_num_threads(1)


    class Dense(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8 + 8 + 3, 1)

        def forward(self, non_id_tensors, embedding_tensors):
            return self.linear(torch.cat(embedding_tensors + non_id_tensors, dim=1))


    def batch(seed):
        rng = np.random.default_rng(seed)
        return Batch(
            [
                IDTypeFeatureWithSingleID("workclass", rng.integers(0, 20, 8).astype(np.uint64)),
                IDTypeFeatureWithSingleID("education", rng.integers(0, 20, 8).astype(np.uint64)),
            ],
            [NonIDTypeFeature(rng.normal(size=(8, 3)).astype(np.float32))],
            [Label(rng.integers(0, 2, (8, 1)).astype(np.float32))],
            requires_grad=True,
        )


    dense = Dense()
    mine = [batch(10 * rank + i) for i in range(3 - rank)]
    steps = 0
    with TrainCtx(
        SGD(lr=0.1),
        torch.optim.SGD(dense.parameters(), lr=0.5),
        dense,
        embedding_config=load_embedding_config(config_path),
        embedding_staleness=2,
    ) as ctx:
        for b in DataLoader(IterableDataset(mine), equal_steps=True):
            output, labels = ctx.forward(b)
            ctx.backward(torch.nn.functional.binary_cross_entropy_with_logits(output, labels[0]))
            steps += 1
        (out / "taken").mkdir(exist_ok=True)
        (out / "taken" / "someone-else.txt").write_text("x")  # not empty: not replaced
        try:
            ctx.dump_checkpoint(out / "taken")
            outcome = "written"
        except RecserveError as error:
            outcome = type(error).__name__ + ": " + error.message
        (out / f"result-{rank}.txt").write_text(f"{steps}\\n{outcome}")
    distributed.shutdown_distributed()
    """
)


# Rank 0 takes 1 s to write, then to load, a checkpoint: longer than the process group's
# collectives wait (0.3 s, set once the ranks have met: a start-up that short could fail on a
# loaded machine). Each rank has its own in-process tier (no cluster needed: only rank 0's is
# written and loaded). Each rank's torch generator is seeded otherwise and moved on after the
# dump: the load puts each rank's own state back ("True"). Its output goes to ``slow/`` in the
# directory given last; it runs last in its run (the 0.3 s wait stays set to the end).
SLOW_CHECKPOINT_SCRIPT = textwrap.dedent(
    """
    import sys
    import time
    from datetime import timedelta
    from pathlib import Path

    import torch
    from torch.distributed.distributed_c10d import _set_pg_timeout

    from embedding_store.config import embedding_config_from_mapping
    from embedding_store.optimizers import SGD
    from embedding_store.tier import InProcessEmbeddingTier
    from training import checkpoint, distributed
    from training.ctx import TrainCtx

    out = Path(sys.argv[-1]) / "slow"
    out.mkdir(exist_ok=True)
    config = embedding_config_from_mapping({"slots_config": {"user": {"dim": 2}}})
    write, load = checkpoint.write_checkpoint, checkpoint.load_checkpoint


    def slowly(function):
        def call(*args, **kwargs):
            time.sleep(1.0)
            return function(*args, **kwargs)

        return call


    if distributed.rank() == 0:
        checkpoint.write_checkpoint = slowly(write)
        checkpoint.load_checkpoint = slowly(load)
    torch.manual_seed(10 + distributed.rank())
    dense = torch.nn.Linear(2, 1)
    with TrainCtx(
        SGD(lr=0.1),
        torch.optim.SGD(dense.parameters(), lr=0.1),
        dense,
        embedding_config=config,
        embedding_tier=InProcessEmbeddingTier(config, capacity=100),
        mixed_precision=False,
    ) as ctx:
        _set_pg_timeout(timedelta(seconds=0.3), None)  # the default group's collectives
        ctx.step = 7
        generator = torch.get_rng_state()
        ctx.dump_checkpoint(out / "checkpoint", with_jit_model=False)
        torch.rand(3)
        ctx.step = 0
        step = ctx.load_checkpoint(out / "checkpoint").step
        restored = torch.equal(torch.get_rng_state(), generator)
        torch.save(generator, out / f"generator-{distributed.rank()}.pt")
        (out / f"rank-{distributed.rank()}.txt").write_text(f"{step} {ctx.step} {restored}")
    distributed.shutdown_distributed()
    """
)


def recserve(*args: str) -> list[str]:
    """The ``recserve`` console script of this interpreter's environment (or ``-m`` fallback)."""
    script = shutil.which("recserve", path=str(Path(sys.executable).parent))
    if script:
        return [script, *args]
    return [sys.executable, "-m", "embedding_store.cli", *args]


def run_in_session(
    args: list[str], log: Path, timeout: float = TIMEOUT, *, env: dict[str, str] | None = None
) -> str:
    """Run ``args`` in a new session; on timeout or failure, kill its process group."""
    env = dict(env or os.environ, PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:
        process = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        code = process.wait(timeout=timeout)
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)  # the group this call started (torchrun + ranks)
            except (ProcessLookupError, PermissionError):
                break
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                continue
    text = log.read_text(errors="replace")
    assert code == 0, f"{args} exited with {code}:\n{text[-4000:]}"
    return text


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("cluster-logs")
    with LocalCluster(EMBEDDING_CONFIG, num_shards=2, num_workers=1, log_dir=logs) as started:
        yield started


def test_two_ddp_ranks_with_two_shards_reach_the_example_auc(cluster, tmp_path):
    checkpoint, metrics = tmp_path / "checkpoint", tmp_path / "metrics.json"
    run_in_session(
        recserve(
            "train",
            "--nproc-per-node",
            "2",
            "--embedding-workers",
            cluster.worker_addresses[0],
            "--entry",
            str(TRAIN),
            "--",
            "--checkpoint-dir",
            str(checkpoint),
            "--metrics-out",
            str(metrics),
        ),
        tmp_path / "train.log",
    )
    result = json.loads(metrics.read_text())
    assert result["world_size"] == 2
    assert result["steps"] > 0
    assert result["test_auc"] >= 0.91, result
    for name in ("dense.pt", "jit_dense.pt", "opt.pt", "manifest.json", "DONE"):
        assert (checkpoint / name).exists(), name
    # The embedding worker wrote the embeddings (both shards' rows) into the same checkpoint.
    assert (checkpoint / "embeddings" / "DONE").exists()
    assert all(cluster.shards[i].alive for i in range(2)) and cluster.workers[0].alive

    # The shards outlive the run: the next one is told it starts from their rows, until
    # they are cleared.
    script = tmp_path / "open_and_close.py"
    script.write_text(OPEN_AND_CLOSE_SCRIPT)
    worker = cluster.worker_addresses[0]
    run = recserve("train", "--embedding-workers", worker, "--entry", str(script), "--")
    log = run_in_session([*run, str(EMBEDDING_CONFIG)], tmp_path / "again.log")
    assert "the embedding tier already holds" in log
    assert f"`recserve embedding-tier clear --worker {worker}` first" in log
    subprocess.run(recserve("embedding-tier", "clear", "--worker", worker), check=True, timeout=60)
    log = run_in_session([*run, str(EMBEDDING_CONFIG)], tmp_path / "cleared.log")
    assert "the embedding tier already holds" not in log


def run_on_two_ranks(cluster, tmp_path: Path, name: str, source: str) -> tuple[Path, str]:
    """Run the script ``source`` with ``recserve train --nproc-per-node 2`` against the
    cluster's worker; its arguments are the embedding config and an output directory.
    Returns (output directory, the run's log)."""
    script = tmp_path / f"{name}.py"
    script.write_text(source)
    out = tmp_path / "out"
    out.mkdir()
    log = run_in_session(
        recserve(
            "train",
            "--nproc-per-node",
            "2",
            "--embedding-workers",
            cluster.worker_addresses[0],
            "--entry",
            str(script),
            "--",
            str(EMBEDDING_CONFIG),
            str(out),
        ),
        tmp_path / f"{name}.log",
    )
    return out, log


@pytest.fixture(scope="module")
def two_rank_run(cluster, tmp_path_factory) -> tuple[Path, str]:
    """ONE_STEP_SCRIPT, then EQUAL_STEPS_SCRIPT, then SLOW_CHECKPOINT_SCRIPT, in one
    ``recserve train --nproc-per-node 2`` run (a launcher and two ranks take seconds to
    start; each later part's TrainCtx joins the process group the first made, and the last
    one's short collectives timeout is set after the others ran): (output directory, the
    run's log)."""
    shutdown = "distributed.shutdown_distributed()\n"
    parts = (ONE_STEP_SCRIPT, EQUAL_STEPS_SCRIPT, SLOW_CHECKPOINT_SCRIPT)
    assert all(part.endswith(shutdown) for part in parts)
    script = "".join(part.removesuffix(shutdown) for part in parts) + shutdown
    return run_on_two_ranks(cluster, tmp_path_factory.mktemp("two-ranks"), "two_ranks", script)


def test_dense_parameters_are_identical_across_ranks_after_a_step(two_rank_run):
    out, _ = two_rank_run
    before = [torch.load(out / f"before-{r}.pt", weights_only=True) for r in range(2)]
    after = [torch.load(out / f"after-{r}.pt", weights_only=True) for r in range(2)]
    losses = [float((out / f"loss-{r}.txt").read_text()) for r in range(2)]
    assert losses[0] != losses[1]  # the ranks really saw different batches
    assert before[0].keys() == after[0].keys() == after[1].keys()
    for name in after[0]:
        # DDP broadcast rank 0's initial weights, then allreduced the gradients.
        assert torch.equal(before[0][name], before[1][name]), name
        assert torch.equal(after[0][name], after[1][name]), name
        assert not torch.equal(after[0][name], before[0][name]), name
    # Rank 1's NaN label: both ranks skipped the dense step (it used to make every dense
    # weight NaN on both); only rank 1's embedding gradients were not finite.
    after_nan = [torch.load(out / f"after-nan-{r}.pt", weights_only=True) for r in range(2)]
    for name in after[0]:
        assert torch.equal(after_nan[0][name], after[0][name]), name
        assert torch.equal(after_nan[1][name], after[0][name]), name
    assert [(out / f"skips-{r}.txt").read_text() for r in range(2)] == ["(1, 0)", "(1, 1)"]
    # Then a step clipped to 0.001: each rank clipped the allreduced (averaged) gradients,
    # the same on both, so both moved alike, by lr 0.5 times the limit in all.
    clipped = [torch.load(out / f"after-clip-{r}.pt", weights_only=True) for r in range(2)]
    for name in after[0]:
        assert torch.equal(clipped[0][name], clipped[1][name]), name
    moved = torch.cat([(clipped[0][n] - after[0][n]).reshape(-1) for n in after[0]])
    assert float(moved.norm()) == pytest.approx(0.5 * 0.001, rel=1e-4)
    # The norm before clipping, of the same averaged gradients on both ranks.
    norms = [float((out / f"norm-{r}.txt").read_text()) for r in range(2)]
    assert norms[0] == norms[1] and norms[0] > 10 * 0.001


def test_ranks_with_unequal_batches_stop_together_and_fail_a_checkpoint_together(two_rank_run):
    out, log = two_rank_run
    results = [(out / f"result-{r}.txt").read_text().split("\n", 1) for r in range(2)]
    assert [steps for steps, _ in results] == ["2", "2"]
    assert "rank 0 dropped its last 1 batch(es)" in log
    assert results[0][1].startswith("AlreadyExistsError")
    assert results[1][1].startswith("CheckpointError: rank 0 failed to write checkpoint")


def test_ranks_wait_for_a_checkpoint_longer_than_the_process_groups_timeout(two_rank_run):
    """Rank 0 writing (then loading) a checkpoint for longer than DDPOption.timeout_seconds:
    the other rank used to give up in its all-reduce ("Timed out waiting 300000ms") and the
    job died in the middle of a checkpoint that was going well (a large remote tier dumps for
    longer than the default 300 s). It waits, and both agree on the step. The checkpoint
    holds each rank's own torch generator state, which each gets back. (The last part of the
    shared two-rank run: a run of its own spent seconds starting two ranks again.)"""
    tmp_path = two_rank_run[0] / "slow"
    assert [(tmp_path / f"rank-{r}.txt").read_text() for r in range(2)] == [
        "7 7 True",
        "7 7 True",
    ]
    assert json.loads((tmp_path / "checkpoint" / "manifest.json").read_text())["step"] == 7
    saved = safetensors.torch.load_file(tmp_path / "checkpoint" / "rng_state.safetensors")
    assert sorted(saved) == ["rank_0.cpu", "rank_1.cpu"]  # no GPU: no CUDA state
    for rank in range(2):
        generator = torch.load(tmp_path / f"generator-{rank}.pt", weights_only=True)
        assert torch.equal(saved[f"rank_{rank}.cpu"], generator), rank
    assert not torch.equal(saved["rank_0.cpu"], saved["rank_1.cpu"])
