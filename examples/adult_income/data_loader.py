"""Data loader of the Adult example: streams its share of the training set to the NN workers.

    recserve data-loader --entry examples/adult_income/data_loader.py \
        --replica-index 0 --replica-size 1 --nn-worker-addresses 127.0.0.1:7500 -- --epochs 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from embedding_store.cli_types import non_negative_int, positive_int
from examples.adult_income import features
from examples.adult_income.hparams import AdultHParams
from training.data import DataCtx


def main() -> int:
    defaults = AdultHParams()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--epochs",
        type=non_negative_int,
        default=defaults.epochs,
        help="passes over the training set (default %(default)s)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=defaults.batch_size,
        help="samples per batch sent (default %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=non_negative_int,
        default=defaults.seed,
        help="seeds each epoch's data order (default %(default)s)",
    )
    args = parser.parse_args()
    train = features.read_encoded(features.TRAIN_PATH)
    with DataCtx() as ctx:
        for epoch in range(args.epochs):
            order = np.random.default_rng(args.seed * 1000 + epoch).permutation(len(train))
            starts = range(0, len(train), args.batch_size)
            # Loader r of R sends batches r, r + R, ... of each epoch.
            for index in range(ctx.replica_index, len(starts), ctx.replica_size):
                start = starts[index]
                rows = order[start : start + args.batch_size]
                ctx.send_data(train.take(rows).to_batch(requires_grad=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
