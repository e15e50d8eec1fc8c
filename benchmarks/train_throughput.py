"""End-to-end training throughput: recserve's TrainCtx vs plain PyTorch, in the same run.

Workload (Criteo-like, synthetic): 26 ID slots with one ID per sample each (40k IDs per slot,
~1M in all, Zipf s = 1.05, scrambled) and 13 dense features; labels are drawn from a hidden
logistic model (one hidden weight per ID and per dense feature), so the task is learnable and
its Bayes log loss is known. Embedding dim 16, MLP 429 -> 256 -> 128 -> 1, batch 1024.

Trainers (same model, same initial dense weights, same batches in the same order):

- ``pytorch``: plain PyTorch in one process: one fused ``nn.EmbeddingBag(sparse=True)`` over
  all slots (per-slot row offsets), the same MLP, ``torch.optim.Adagrad`` on the sparse
  embedding gradients and Adam on the dense parameters;
- ``embedded``: ``TrainCtx`` with the in-process embedding tier (recserve's Adagrad on the
  rows, the same Adam on the dense parameters), default staleness (``--staleness``);
- ``embedded-sync``: the same with ``embedding_staleness=1`` (fully synchronous);
- ``2-shards``: ``TrainCtx`` against a :class:`LocalCluster` (2 ``embedding-parameter-server``
  processes + 1 ``embedding-worker`` process on 127.0.0.1, gRPC), default staleness.

Timing: ``--rounds`` rounds; in each, every trainer runs ``--steps-per-round`` steps (ending
with ``wait_for_embedding_updates`` for TrainCtx, so every gradient is applied) and its
samples/s is recorded. Rates are medians over rounds; a ratio is the median of per-round
ratios against ``pytorch`` (measured in the same round). Rounds stop early once
``--max-seconds`` have passed. The first ``--warmup`` steps (numba compilation, allocation)
are not timed. Each trainer also reports its mean training loss over the first and last 10%
of steps and its log loss and AUC on held-out batches, next to the Bayes log loss.

Run: ``python benchmarks/train_throughput.py [--rounds 10] [--steps-per-round 30]
[--max-seconds 240]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import yaml
from machine_info import describe_machine

from embedding_store.batch import Batch, IDTypeFeatureWithSingleID, Label, NonIDTypeFeature
from embedding_store.cli_types import non_negative_int, positive_float, positive_int
from embedding_store.config import EmbeddingConfig, embedding_config_from_mapping
from embedding_store.initializer import InitializationConfig
from embedding_store.launcher import LocalCluster
from embedding_store.optimizers import Adagrad
from training.ctx import TrainCtx, eval_ctx

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # load_tests/ is not installed
from load_tests.stack import sigterm_exits

NUM_SLOTS = 26
NUM_DENSE = 13
DIM = 16
VOCAB = 40_000  # per slot
HIDDEN = (256, 128)
EMBEDDING_LR = 0.05
DENSE_LR = 1e-3
INIT_BOUND = 0.01
SLOT_NAMES = [f"C{i + 1}" for i in range(NUM_SLOTS)]
#: The most samples the synthetic data may hold (~2 GB; the defaults hold 139,264).
MAX_SAMPLES = 1 << 22


class MLP(torch.nn.Module):
    """``concat(embeddings..., dense) -> MLP -> logit``; the recserve dense-model signature."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        width = NUM_SLOTS * DIM + NUM_DENSE
        for h in HIDDEN:
            layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
            width = h
        layers.append(torch.nn.Linear(width, 1))
        self.mlp = torch.nn.Sequential(*layers)

    def forward(
        self, non_id_tensors: list[torch.Tensor], embedding_tensors: list[torch.Tensor]
    ) -> torch.Tensor:
        return self.mlp(torch.cat(embedding_tensors + non_id_tensors, dim=1))


class Data:
    """Synthetic batches, as recserve Batches and as plain tensors (built before timing)."""

    def __init__(self, batch_size: int, num_train: int, num_test: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        ranks = np.arange(1, VOCAB + 1, dtype=np.float64)
        probabilities = ranks**-1.05
        probabilities /= probabilities.sum()
        self.id_weights = rng.normal(0.0, 0.3, size=(NUM_SLOTS, VOCAB))
        self.dense_weights = rng.normal(0.0, 0.3, size=NUM_DENSE)
        scramble = np.stack([rng.permutation(VOCAB) for _ in range(NUM_SLOTS)])
        self.batch_size = batch_size
        self.train: list[tuple[Batch, tuple[torch.Tensor, ...]]] = []
        self.test: list[tuple[Batch, tuple[torch.Tensor, ...]]] = []
        self.bayes_losses: list[float] = []
        row_offsets = (np.arange(NUM_SLOTS, dtype=np.int64) * VOCAB)[None, :]
        for index in range(num_train + num_test):
            picks = rng.choice(VOCAB, size=(batch_size, NUM_SLOTS), p=probabilities)
            ids = scramble[np.arange(NUM_SLOTS)[None, :], picks]  # [batch, slot]
            dense = rng.normal(size=(batch_size, NUM_DENSE)).astype(np.float32)
            logit = self.id_weights[np.arange(NUM_SLOTS)[None, :], ids].sum(1)
            logit += dense @ self.dense_weights - 0.5
            p = 1.0 / (1.0 + np.exp(-logit))
            labels = (rng.random(batch_size) < p).astype(np.float32).reshape(-1, 1)
            batch = Batch(
                [
                    IDTypeFeatureWithSingleID(name, ids[:, s].astype(np.uint64))
                    for s, name in enumerate(SLOT_NAMES)
                ],
                [NonIDTypeFeature(dense, name="dense")],
                [Label(labels)],
                requires_grad=True,
            )
            # Plain PyTorch: slot-major rows into one fused table, one ID per bag.
            rows = torch.from_numpy((ids.astype(np.int64) + row_offsets).T.reshape(-1).copy())
            tensors = (rows, torch.from_numpy(dense), torch.from_numpy(labels))
            (self.train if index < num_train else self.test).append((batch, tensors))
            if index >= num_train:
                y = labels.reshape(-1)
                self.bayes_losses.append(float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))))
        self.bag_offsets = torch.arange(NUM_SLOTS * batch_size, dtype=torch.int64)

    @property
    def bayes_logloss(self) -> float:
        return float(np.mean(self.bayes_losses))


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC by ranks (ties averaged)."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), dtype=np.float64)
    sorted_scores = scores[order]
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    average = first + (counts - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(average, counts)
    positives = labels == 1
    n_pos, n_neg = positives.sum(), (~positives).sum()
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def held_out(predict: Callable[[int], torch.Tensor], data: Data) -> tuple[float, float]:
    """(log loss, AUC) on the held-out batches."""
    logits, labels = [], []
    for index, (_, (_, _, label)) in enumerate(data.test):
        logits.append(predict(index).reshape(-1).double())
        labels.append(label.reshape(-1).double())
    logit, label = torch.cat(logits), torch.cat(labels)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, label)
    return float(loss), auc(label.numpy(), logit.numpy())


class PlainTrainer:
    """Plain PyTorch: sparse EmbeddingBag + Adagrad, MLP + Adam, one process."""

    name = "pytorch"

    def __init__(self, data: Data, initial_mlp: dict) -> None:
        self.data = data
        generator = torch.Generator().manual_seed(1)
        weight = torch.empty(NUM_SLOTS * VOCAB, DIM).uniform_(
            -INIT_BOUND, INIT_BOUND, generator=generator
        )
        self.bag = torch.nn.EmbeddingBag.from_pretrained(
            weight, mode="sum", freeze=False, sparse=True
        )
        self.model = MLP()
        self.model.load_state_dict(initial_mlp)
        # recserve's Adagrad default accumulator start is 0.01; use the same here.
        self.sparse_opt = torch.optim.Adagrad(
            self.bag.parameters(), lr=EMBEDDING_LR, initial_accumulator_value=0.01
        )
        self.dense_opt = torch.optim.Adam(self.model.parameters(), lr=DENSE_LR)
        self.losses: list[float] = []

    def _embed(self, rows: torch.Tensor) -> list[torch.Tensor]:
        flat = self.bag(rows, self.data.bag_offsets)  # [slots * batch, dim], slot-major
        return list(flat.view(NUM_SLOTS, self.data.batch_size, DIM).unbind(0))

    def step(self, index: int) -> None:
        rows, dense, labels = self.data.train[index][1]
        output = self.model([dense], self._embed(rows))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(output, labels)
        self.sparse_opt.zero_grad(set_to_none=True)
        self.dense_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.sparse_opt.step()
        self.dense_opt.step()
        self.losses.append(float(loss.detach()))

    def sync(self) -> None:
        pass

    def evaluate(self) -> tuple[float, float]:
        def predict(index: int) -> torch.Tensor:
            rows, dense, _ = self.data.test[index][1]
            with torch.no_grad():
                return self.model([dense], self._embed(rows))

        return held_out(predict, self.data)

    def close(self) -> None:
        pass


class RecserveTrainer:
    """TrainCtx with an in-process tier, or with ``embedding_workers`` (a remote tier)."""

    def __init__(
        self,
        name: str,
        data: Data,
        initial_mlp: dict,
        config: EmbeddingConfig,
        *,
        staleness: int,
        embedding_workers: list[str] | None = None,
    ) -> None:
        self.name = name
        self.data = data
        self.model = MLP()
        self.model.load_state_dict(initial_mlp)
        self.ctx = TrainCtx(
            Adagrad(lr=EMBEDDING_LR),
            torch.optim.Adam(self.model.parameters(), lr=DENSE_LR),
            self.model,
            embedding_config=config,
            embedding_staleness=staleness,
            embedding_workers=embedding_workers,
            initialization=InitializationConfig(low=-INIT_BOUND, high=INIT_BOUND, seed=1),
        ).__enter__()
        self.losses: list[float] = []

    def step(self, index: int) -> None:
        output, labels = self.ctx.forward(self.data.train[index][0])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(output, labels[0])
        self.ctx.backward(loss)
        self.losses.append(float(loss.detach()))

    def sync(self) -> None:
        self.ctx.wait_for_embedding_updates()

    def evaluate(self) -> tuple[float, float]:
        self.sync()
        with eval_ctx(self.ctx) as evaluator:
            self.ctx.model.eval()  # the evaluator shares this model

            def predict(index: int) -> torch.Tensor:
                output, _ = evaluator.forward(self.data.test[index][0])
                return output

            result = held_out(predict, self.data)
            self.ctx.model.train()
        return result

    def close(self) -> None:
        self.ctx.__exit__(None, None, None)


def machine() -> dict:
    info = describe_machine("torch", "numpy", "numba", "grpcio")
    info["torch_threads"] = torch.get_num_threads()
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; argparse error (exit 2) before the data is built for a value that
    would measure nothing (0 rounds, steps or test batches: a ratio of nothing, found only
    after every trainer ran) or that TrainCtx refuses (staleness 0)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batch-size", type=positive_int, default=1024, help="samples per step (default 1024)"
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=10, help="rounds over every trainer (default 10)"
    )
    parser.add_argument(
        "--steps-per-round",
        type=positive_int,
        default=30,
        help="timed steps of each trainer per round (default 30)",
    )
    parser.add_argument(
        "--warmup", type=non_negative_int, default=3, help="untimed steps per trainer"
    )
    parser.add_argument(
        "--max-seconds", type=positive_float, default=240.0, help="stop rounds after"
    )
    parser.add_argument(
        "--staleness", type=positive_int, default=10, help="embedding staleness (>= 1)"
    )
    parser.add_argument(
        "--train-batches", type=positive_int, default=128, help="distinct batches, cycled"
    )
    parser.add_argument(
        "--test-batches",
        type=positive_int,
        default=8,
        help="held-out batches for the log loss and AUC (default 8)",
    )
    parser.add_argument(
        "--threads", type=non_negative_int, default=0, help="torch threads (0: default)"
    )
    parser.add_argument("--no-remote", action="store_true", help="skip the 2-shard cluster")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args(argv)
    samples = args.batch_size * (args.train_batches + args.test_batches)
    if samples > MAX_SAMPLES:
        # built up front and held in memory, twice (Batches and tensors): ~0.5 KB a sample
        parser.error(
            f"--batch-size x (--train-batches + --test-batches) is {samples:,} samples; at "
            f"most {MAX_SAMPLES:,}"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print its results. SIGTERM (``timeout``, a CI job's end) unwinds
    it as SystemExit(143), so the cluster started here is stopped: it used to live on."""
    with sigterm_exits():
        benchmark(argv)


def benchmark(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # torch.optim.Adagrad builds its sparse update with invariant checks off and says so.
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")

    started = time.perf_counter()
    data = Data(args.batch_size, args.train_batches, args.test_batches)
    print(f"data: {time.perf_counter() - started:.1f} s to build", flush=True)
    torch.manual_seed(0)
    initial_mlp = MLP().state_dict()
    mapping = {"slots_config": {name: {"dim": DIM} for name in SLOT_NAMES}}
    config = embedding_config_from_mapping(mapping, source="benchmark")

    trainers: list = []
    cluster = None
    workdir = tempfile.TemporaryDirectory(prefix="recserve-bench-training-")
    try:  # trainers started inside: one that fails to start must not leave the others open
        trainers.append(PlainTrainer(data, initial_mlp))
        trainers.append(
            RecserveTrainer("embedded", data, initial_mlp, config, staleness=args.staleness)
        )
        trainers.append(RecserveTrainer("embedded-sync", data, initial_mlp, config, staleness=1))
        if not args.no_remote:
            config_path = Path(workdir.name) / "embedding_config.yml"
            config_path.write_text(yaml.safe_dump(mapping))
            cluster = LocalCluster(
                config_path, num_shards=2, num_workers=1, log_dir=Path(workdir.name) / "logs"
            ).start()
            trainers.append(
                RecserveTrainer(
                    "2-shards",
                    data,
                    initial_mlp,
                    config,
                    staleness=args.staleness,
                    embedding_workers=cluster.worker_addresses,
                )
            )
        num_train = len(data.train)
        position = {t.name: 0 for t in trainers}

        def run(trainer: PlainTrainer | RecserveTrainer, steps: int) -> float:
            begin = time.perf_counter()
            for _ in range(steps):
                trainer.step(position[trainer.name] % num_train)
                position[trainer.name] += 1
            trainer.sync()
            return time.perf_counter() - begin

        for trainer in trainers:
            run(trainer, args.warmup)
        rates: dict[str, list[float]] = {t.name: [] for t in trainers}
        bench_start = time.perf_counter()
        for round_index in range(args.rounds):
            for trainer in trainers:
                seconds = run(trainer, args.steps_per_round)
                rates[trainer.name].append(args.steps_per_round * args.batch_size / seconds)
            line = ", ".join(f"{n} {r[-1]:,.0f}" for n, r in rates.items())
            print(f"round {round_index + 1}: samples/s {line}", flush=True)
            if time.perf_counter() - bench_start > args.max_seconds:
                break

        results = []
        for trainer in trainers:
            losses = trainer.losses
            window = max(1, len(losses) // 10)
            test_loss, test_auc = trainer.evaluate()
            results.append(
                {
                    "trainer": trainer.name,
                    "samples_per_s": statistics.median(rates[trainer.name]),
                    "ratio_vs_pytorch": statistics.median(
                        a / b for a, b in zip(rates[trainer.name], rates["pytorch"])
                    ),
                    "steps": len(losses),
                    "train_loss_first": float(np.mean(losses[:window])),
                    "train_loss_last": float(np.mean(losses[-window:])),
                    "test_logloss": test_loss,
                    "test_auc": test_auc,
                }
            )
    finally:
        for trainer in trainers:
            trainer.close()
        if cluster is not None:
            cluster.stop()
        workdir.cleanup()

    info = machine()
    print(
        f"machine: {info['nproc']} CPUs ({info['cpu']}), {info['torch_threads']} torch "
        f"threads, python {info['python']}, torch {info['torch']}, numpy {info['numpy']}, "
        f"numba {info['numba']}, grpcio {info['grpcio']}"
    )
    print(
        f"batch {args.batch_size}, {len(rates['pytorch'])} rounds x {args.steps_per_round} "
        f"steps, staleness {args.staleness}, Bayes log loss {data.bayes_logloss:.4f}"
    )
    print(
        f"{'trainer':<14} {'samples/s':>10} {'vs pytorch':>10} {'steps':>6} "
        f"{'loss first':>10} {'loss last':>10} {'test loss':>10} {'test AUC':>9}"
    )
    for r in results:
        print(
            f"{r['trainer']:<14} {r['samples_per_s']:>10,.0f} {r['ratio_vs_pytorch']:>10.2f} "
            f"{r['steps']:>6} {r['train_loss_first']:>10.4f} {r['train_loss_last']:>10.4f} "
            f"{r['test_logloss']:>10.4f} {r['test_auc']:>9.4f}"
        )
    report = {
        "machine": info,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "bayes_logloss": data.bayes_logloss,
        "results": results,
    }
    print(json.dumps(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
