"""The served dense model per merged batch: oneDNN thresholds against the model as loaded.

What serving runs once a batch is merged and looked up (``LoadedModel.forward``: tensors from
the batch, the dense model, the output transform), on one loaded checkpoint three ways:

- ``loaded`` (the baseline): ``--onednn-min-rows 0``, every batch on the TorchScript model as
  loaded (MKL's sgemm for its linear layers);
- ``fixed256``: ``--onednn-min-rows 256``, the default before session 26;
- ``auto``: ``--onednn-min-rows auto`` (the default), the threshold timed at load.

Workloads, each reported in microseconds per 64 rows:
- ``merged``: merged batch sizes drawn uniformly from 1..``--max-merged-rows`` (seeded), as
  a server merging mixed-size requests sees them (run Y's mix merged ~100-150 rows);
- one cell per fixed size in ``--sizes``.

Timing: ``--rounds`` rounds, each running every (workload, model) pair for its slice in turn,
so a noisy neighbour hits baseline and contender alike; a ratio is the median over rounds of
``loaded`` time / contender time (above 1: the contender is faster). One torch thread, as a
server process runs it.

Run: ``python benchmarks/dense_model.py --checkpoint DIR [--rounds 5] [--calls 40]``; without
``--checkpoint`` a synthetic Criteo-like model (``load_tests/synthetic_model.py``) is built into
a temporary folder first.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from machine_info import describe_machine

from embedding_store.cli_types import positive_int
from serving.model import LoadedModel, load_model

#: The models compared, by ``--onednn-min-rows`` value (None: auto).
THRESHOLDS: dict[str, int | None] = {"loaded": 0, "fixed256": 256, "auto": None}


def batch_runner(model: LoadedModel, sizes: list[int]) -> Callable[[], int]:
    """A function running ``model.forward`` once per size in ``sizes`` (batches and zero
    lookups built once, here), returning the rows it ran."""
    prepared = []
    for rows in sizes:
        batch = model.example_batch(rows)
        prepared.append((batch, model.default_lookup(batch)))
    total = sum(sizes)

    def run() -> int:
        for batch, lookup in prepared:
            model.forward(batch, lookup)
        return total

    return run


def time_per_64_rows(run: Callable[[], int], calls: int) -> float:
    """Microseconds per 64 rows over ``calls`` runs of ``run`` (bounded in count)."""
    rows = 0
    started = time.perf_counter()
    for _ in range(calls):
        rows += run()
    return (time.perf_counter() - started) / rows * 64 * 1e6


#: Bounds that keep a run short: the largest batch a server merges, and the work per round.
MAX_ROWS = 1024
MAX_CALLS = 10_000
MAX_ROUNDS = 100


def batch_sizes(text: str) -> list[int]:
    """``--sizes``: a comma list of batch sizes in 1..MAX_ROWS (argparse error otherwise)."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of integers, got {text!r}"
        ) from None
    bad = [size for size in sizes if not 1 <= size <= MAX_ROWS]
    if bad:
        raise argparse.ArgumentTypeError(f"sizes must be in 1..{MAX_ROWS}, got {bad[0]}")
    return sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; argparse error (exit 2) for a run that would measure nothing or
    run unbounded, or a checkpoint folder that is not there."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="default: build the synthetic model"
    )
    parser.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds")
    parser.add_argument(
        "--calls", type=positive_int, default=40, help="runs of a workload per round and model"
    )
    parser.add_argument(
        "--sizes",
        type=batch_sizes,
        default=[1, 32, 64, 150, 256, 1024],
        help="fixed merged batch sizes, one cell each (comma list; default 1,32,64,150,256,1024)",
    )
    parser.add_argument(
        "--max-merged-rows",
        type=positive_int,
        default=300,
        help="the merged workload draws sizes from 1..this (at most 1024)",
    )
    parser.add_argument(
        "--merged-batches", type=positive_int, default=64, help="sizes in the merged workload"
    )
    args = parser.parse_args(argv)
    if args.max_merged_rows > MAX_ROWS:
        parser.error(f"--max-merged-rows: at most {MAX_ROWS}, got {args.max_merged_rows}")
    if args.rounds > MAX_ROUNDS or args.calls > MAX_CALLS or args.merged_batches > MAX_CALLS:
        parser.error(
            f"bounded runs only: at most {MAX_ROUNDS} --rounds, {MAX_CALLS} --calls and "
            f"{MAX_CALLS} --merged-batches"
        )
    if args.checkpoint is not None and not args.checkpoint.is_dir():
        parser.error(f"--checkpoint {args.checkpoint}: no such directory")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print a table, then one JSON line, and return that report."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="recserve-dense-bench-") as scratch:
        checkpoint = args.checkpoint
        if checkpoint is None:
            from load_tests.synthetic_model import build_synthetic_checkpoint

            checkpoint = Path(scratch) / "synthetic"
            build_synthetic_checkpoint(checkpoint)
        models: dict[str, LoadedModel] = {}
        load_seconds: dict[str, float] = {}
        for name, threshold in THRESHOLDS.items():
            started = time.perf_counter()
            models[name] = load_model(checkpoint, name=name, onednn_min_rows=threshold)
            load_seconds[name] = time.perf_counter() - started
        rng = np.random.default_rng(0)
        workloads = {
            "merged": [
                int(r) for r in rng.integers(1, args.max_merged_rows + 1, args.merged_batches)
            ]
        }
        workloads |= {str(size): [size] for size in args.sizes}
        runners = {
            (workload, name): batch_runner(model, sizes)
            for workload, sizes in workloads.items()
            for name, model in models.items()
        }
        for run in runners.values():
            run()  # warm-up: TorchScript's profiling runs, allocations
        times: dict[tuple[str, str], list[float]] = {key: [] for key in runners}
        for _ in range(args.rounds):
            for key, run in runners.items():
                times[key].append(time_per_64_rows(run, args.calls))
        results = {}
        print(f"{'workload':>9} " + " ".join(f"{n + ' us/64':>15}" for n in models), end="")
        print("  ratios (loaded / model)")
        for workload in workloads:
            us = {name: statistics.median(times[(workload, name)]) for name in models}
            ratios = {
                name: statistics.median(
                    base / own
                    for base, own in zip(
                        times[(workload, "loaded")], times[(workload, name)], strict=True
                    )
                )
                for name in models
                if name != "loaded"
            }
            results[workload] = {"us_per_64_rows": us, "speedup_over_loaded": ratios}
            cells = " ".join(f"{us[name]:15.0f}" for name in models)
            print(f"{workload:>9} {cells}  " + ", ".join(f"{n} {r:.2f}" for n, r in ratios.items()))
        report = {
            "machine": describe_machine("torch", "numpy"),
            "checkpoint": str(args.checkpoint) if args.checkpoint else "synthetic (built)",
            "thresholds": {
                name: models[name].large_batch_rows if models[name].large_batch_dense else None
                for name in models
            },
            "load_seconds": {name: round(s, 3) for name, s in load_seconds.items()},
            "merged_sizes": workloads["merged"],
            "rounds": args.rounds,
            "calls": args.calls,
            "results": results,
        }
        for model in models.values():
            model.close()
        print(json.dumps(report))
        return report


if __name__ == "__main__":
    main()
