"""Embedding store core vs plain torch.nn.EmbeddingBag, measured in the same run.

Workload (Criteo-like): 26 ID slots with one ID per sample each, dim 16, 1M distinct IDs in all
(26 vocabularies of ~38.5k), Zipf-distributed (s = 1.05), batch 64 and 1024.

Measured, each in IDs/s:
- baseline: one fused ``torch.nn.EmbeddingBag`` over all slots (per-slot offsets into one
  [1M, 16] table, direct row indices), forward only; and forward + sparse-SGD step for updates.
- ``infer``: pooled lookup through the worker core with ``train=False`` (one in-process shard
  holding all 1M rows).
- ``train``: pooled lookup with ``train=True`` (get-or-insert, LRU stamps).
- ``update``: worker backward (scatter to unique IDs, push to the shard, Adagrad applied).

Run: ``python benchmarks/embedding_store.py [--seconds 2] [--shards 1]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# embedding_store package; drop that entry (python -m benchmarks.embedding_store also works).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import platform
import time
from collections.abc import Callable

import numpy as np
import torch

from embedding_store.batch import Batch, IDTypeFeatureWithSingleID
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


def make_batches(rng, batch_size: int, count: int) -> list[np.ndarray]:
    """``count`` arrays of raw IDs, uint64 [NUM_SLOTS, batch_size]."""
    ids = zipf_ids(rng, count * NUM_SLOTS * batch_size, VOCAB)
    return list(ids.reshape(count, NUM_SLOTS, batch_size))


def rate(fn: Callable[[int], None], items: int, seconds: float, num_inputs: int) -> float:
    """Items per second of ``fn(i)`` over a bounded number of calls (time and count)."""
    fn(0)  # warm-up (JIT, allocations)
    calls = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline and calls < 100_000:
        fn(calls % num_inputs)
        calls += 1
    return items * calls / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    parser.add_argument("--shards", type=int, default=1, help="in-process shards")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
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
            result = worker.lookup(batches[i], train=True)
            worker.backward(result.ref, {})  # release the context; no gradient pushed

        grads = {n: torch.full((batch_size, DIM), 1e-3) for n in slot_names}

        def update(i: int) -> None:
            result = worker.lookup(batches[i], train=True)
            worker.backward(result.ref, grads)

        base_fwd = rate(baseline_forward, ids_per_batch, args.seconds, len(rows))
        base_upd = rate(baseline_update, ids_per_batch, args.seconds, len(rows))
        infer_rate = rate(infer, ids_per_batch, args.seconds, len(batches))
        train_rate = rate(train, ids_per_batch, args.seconds, len(batches))
        update_rate = rate(update, ids_per_batch, args.seconds, len(batches))
        results.append(
            {
                "batch_size": batch_size,
                "baseline_forward_ids_per_s": base_fwd,
                "baseline_forward_backward_sgd_ids_per_s": base_upd,
                "infer_ids_per_s": infer_rate,
                "train_lookup_ids_per_s": train_rate,
                "train_lookup_and_update_ids_per_s": update_rate,
                "infer_ratio": infer_rate / base_fwd,
                "train_ratio": train_rate / base_fwd,
                "update_ratio": update_rate / base_upd,
            }
        )

    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} torch thread(s), "
        f"shards: {args.shards}, torch {torch.__version__}"
    )
    header = (
        f"{'batch':>6} {'baseline fwd':>14} {'infer':>12} {'ratio':>6} {'train':>12} "
        f"{'ratio':>6} {'baseline upd':>13} {'update':>12} {'ratio':>6}"
    )
    print(header)
    for r in results:
        print(
            f"{r['batch_size']:>6} {r['baseline_forward_ids_per_s'] / 1e6:>12.1f}M/s "
            f"{r['infer_ids_per_s'] / 1e6:>10.1f}M/s {r['infer_ratio']:>6.2f} "
            f"{r['train_lookup_ids_per_s'] / 1e6:>10.1f}M/s {r['train_ratio']:>6.2f} "
            f"{r['baseline_forward_backward_sgd_ids_per_s'] / 1e6:>11.1f}M/s "
            f"{r['train_lookup_and_update_ids_per_s'] / 1e6:>10.1f}M/s {r['update_ratio']:>6.2f}"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
