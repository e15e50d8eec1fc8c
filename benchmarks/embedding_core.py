"""Embedding store core vs plain torch.nn.EmbeddingBag, measured in the same run.

Workload (Criteo-like): 26 ID slots with one ID per sample each, dim 16, 1M distinct IDs in all
(26 vocabularies of ~38.5k), Zipf-distributed (s = 1.05), batch 64 and 1024. 32 different
batches are cycled, so the caches see a realistic spread of IDs.

Measured, each in IDs/s:
- baseline: one fused ``torch.nn.EmbeddingBag`` over all slots (per-slot offsets into one
  [1M, 16] table, direct row indices), forward only; and forward + sparse-SGD step for updates.
- ``infer``: pooled lookup through the worker core with ``train=False`` (one in-process shard
  holding all 1M rows).
- ``train``: pooled lookup with ``train=True`` (get-or-insert, LRU stamps, forward context kept;
  contexts beyond ``forward_buffer_size`` expire, no backward).
- ``update``: train lookup + worker backward (scatter to unique IDs, push to the shard, Adagrad
  applied), against the baseline's forward + backward + sparse SGD step.

Timing: each measurement runs in ``--rounds`` slices that interleave all five functions, so a
noisy neighbour hits baseline and store alike. Rates are the median over rounds; a ratio is the
median of the per-round ratios (store / baseline measured in the same round).

Run: ``python benchmarks/embedding_core.py [--seconds 2] [--rounds 5] [--shards 1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from embedding_store.batch import Batch, IDTypeFeatureWithSingleID
from embedding_store.cli_types import positive_float, positive_int
from embedding_store.config import embedding_config_from_mapping
from embedding_store.optimizers import Adagrad
from embedding_store.shard import EmbeddingShard
from embedding_store.worker import EmbeddingWorker

NUM_SLOTS = 26
DIM = 16
DISTINCT_IDS = 1_000_000
VOCAB = DISTINCT_IDS // NUM_SLOTS


def zipf_ids(rng: np.random.Generator, count: int, vocab: int) -> np.ndarray:
    """Zipf(1.05)-distributed ranks in [0, vocab), scrambled so hot IDs are not adjacent."""
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    probabilities = ranks**-1.05
    probabilities /= probabilities.sum()
    permutation = rng.permutation(vocab)
    return permutation[rng.choice(vocab, size=count, p=probabilities)].astype(np.uint64)


def make_batches(rng: np.random.Generator, batch_size: int, count: int) -> list[np.ndarray]:
    """``count`` arrays of raw IDs, uint64 [NUM_SLOTS, batch_size]."""
    ids = zipf_ids(rng, count * NUM_SLOTS * batch_size, VOCAB)
    return list(ids.reshape(count, NUM_SLOTS, batch_size))


def rate(fn: Callable[[int], None], items: int, seconds: float, num_inputs: int) -> float:
    """Items per second of ``fn(i)`` over a bounded number of calls (time and count)."""
    calls = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline and calls < 100_000:
        fn(calls % num_inputs)
        calls += 1
    return items * calls / (time.perf_counter() - start)


def interleaved_rates(
    fns: dict[str, Callable[[int], None]], items: int, seconds: float, rounds: int, num_inputs: int
) -> dict[str, list[float]]:
    """Per-round rates of every function; each round runs each function ``seconds / rounds``."""
    for fn in fns.values():
        fn(0)  # warm-up (JIT, allocations)
    rates: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            rates[name].append(rate(fn, items, seconds / rounds, num_inputs))
    return rates


def median_ratio(numerator: list[float], denominator: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; argparse error (exit 2) for a zero, negative or non-finite value."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=positive_float, default=2.0, help="time per measurement")
    parser.add_argument(
        "--rounds", type=positive_int, default=5, help="interleaved rounds per measurement"
    )
    parser.add_argument("--shards", type=positive_int, default=1, help="in-process shards")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print its results (a table, then one JSON line)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)

    slot_names = [f"slot_{i:02d}" for i in range(NUM_SLOTS)]
    config = embedding_config_from_mapping(
        {"slots_config": {name: {"dim": DIM} for name in slot_names}}, source="benchmark"
    )
    shards = [
        EmbeddingShard(
            2 * DISTINCT_IDS,
            optimizer=Adagrad(lr=0.01),
            replica_index=i,
            replica_size=args.shards,
        )
        for i in range(args.shards)
    ]
    worker = EmbeddingWorker(config, shards, forward_buffer_size=4)

    # Preload every ID so infer lookups hit (the baseline table is fully populated too).
    table = torch.empty(NUM_SLOTS * VOCAB, DIM).uniform_(-0.01, 0.01)
    every_id = np.arange(VOCAB, dtype=np.uint64)
    features = [IDTypeFeatureWithSingleID(name, every_id) for name in slot_names]
    worker.lookup(features, train=True)
    del features

    results = []
    for batch_size in (64, 1024):
        raw = make_batches(rng, batch_size, 32)
        batches = [
            Batch(
                [IDTypeFeatureWithSingleID(n, ids[i]) for i, n in enumerate(slot_names)],
                requires_grad=False,
            )
            for ids in raw
        ]
        row_offsets = (np.arange(NUM_SLOTS, dtype=np.int64) * VOCAB)[:, None]
        rows = [torch.from_numpy((ids.astype(np.int64) + row_offsets).reshape(-1)) for ids in raw]
        # Bag per (slot, sample), slot-major: one ID per bag.
        offsets = torch.arange(NUM_SLOTS * batch_size, dtype=torch.int64)
        bag = torch.nn.EmbeddingBag.from_pretrained(table, mode="sum", freeze=True)
        sparse_bag = torch.nn.EmbeddingBag.from_pretrained(
            table.clone(), mode="sum", freeze=False, sparse=True
        )
        sgd = torch.optim.SGD(sparse_bag.parameters(), lr=0.01)
        ids_per_batch = NUM_SLOTS * batch_size

        def baseline_forward(i: int) -> None:
            with torch.no_grad():
                bag(rows[i], offsets)

        def baseline_update(i: int) -> None:
            sgd.zero_grad()
            sparse_bag(rows[i], offsets).sum().backward()
            sgd.step()

        def infer(i: int) -> None:
            worker.lookup(batches[i], train=False)

        def train(i: int) -> None:
            worker.lookup(batches[i], train=True)  # its forward context expires later

        grads = {n: torch.full((batch_size, DIM), 1e-3) for n in slot_names}

        def update(i: int) -> None:
            result = worker.lookup(batches[i], train=True)
            assert result.ref is not None  # a train lookup keeps its forward context
            worker.backward(result.ref, grads)

        r = interleaved_rates(
            {
                "base_fwd": baseline_forward,
                "infer": infer,
                "train": train,
                "base_upd": baseline_update,
                "update": update,
            },
            ids_per_batch,
            args.seconds,
            args.rounds,
            len(batches),
        )
        med = {name: statistics.median(values) for name, values in r.items()}
        results.append(
            {
                "batch_size": batch_size,
                "baseline_forward_ids_per_s": med["base_fwd"],
                "baseline_forward_backward_sgd_ids_per_s": med["base_upd"],
                "infer_ids_per_s": med["infer"],
                "train_lookup_ids_per_s": med["train"],
                "train_lookup_and_update_ids_per_s": med["update"],
                "infer_ratio": median_ratio(r["infer"], r["base_fwd"]),
                "train_ratio": median_ratio(r["train"], r["base_fwd"]),
                "update_ratio": median_ratio(r["update"], r["base_upd"]),
                "infer_us_per_batch": ids_per_batch / med["infer"] * 1e6,
                "baseline_forward_us_per_batch": ids_per_batch / med["base_fwd"] * 1e6,
            }
        )

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch "
        f"thread(s), shards: {args.shards}, torch {torch.__version__}, "
        f"{args.rounds} rounds x {args.seconds / args.rounds:.2f} s per measurement"
    )
    header = (
        f"{'batch':>6} {'baseline fwd':>14} {'infer':>12} {'ratio':>6} {'train':>12} "
        f"{'ratio':>6} {'baseline upd':>13} {'update':>12} {'ratio':>6}"
    )
    print(header)
    for row in results:
        print(
            f"{row['batch_size']:>6} {row['baseline_forward_ids_per_s'] / 1e6:>12.1f}M/s "
            f"{row['infer_ids_per_s'] / 1e6:>10.1f}M/s {row['infer_ratio']:>6.2f} "
            f"{row['train_lookup_ids_per_s'] / 1e6:>10.1f}M/s {row['train_ratio']:>6.2f} "
            f"{row['baseline_forward_backward_sgd_ids_per_s'] / 1e6:>11.1f}M/s "
            f"{row['train_lookup_and_update_ids_per_s'] / 1e6:>10.1f}M/s "
            f"{row['update_ratio']:>6.2f}"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
