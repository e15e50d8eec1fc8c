"""Train the UCI Adult example with the in-process embedding tier and report test AUC.

A plain loop: embedding lookup -> leaf tensors -> AdultDNN -> BCEWithLogits -> backward ->
dense optimizer step -> embedding gradients back to the tier. Run from the repository root:

    python -m examples.adult_income.tune                     # the defaults of AdultHParams
    python -m examples.adult_income.tune --seeds 0 1 2 --embedding-lr 0.1 --epochs 4
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import numpy as np
import torch

from embedding_store.config import embedding_config_from_mapping
from embedding_store.tier import InProcessEmbeddingTier
from examples.adult_income import features
from examples.adult_income.hparams import AdultHParams
from examples.adult_income.metrics import roc_auc
from examples.adult_income.model import AdultDNN

EVAL_BATCH_SIZE = 8192


def predict(
    tier: InProcessEmbeddingTier, model: AdultDNN, data: features.EncodedRows
) -> np.ndarray:
    """Logits float64 [n] of every row of ``data`` (eval lookups: nothing is inserted)."""
    model.eval()
    out = []
    with torch.no_grad():
        for batch in features.iter_batches(data, EVAL_BATCH_SIZE, requires_grad=False):
            result = tier.lookup(batch, train=False)
            numeric = [torch.tensor(f.data) for f in batch.non_id_type_features]
            logits = model(numeric, [s.embeddings for s in result.slots])
            out.append(logits.numpy().reshape(-1))
    model.train()
    return np.concatenate(out).astype(np.float64)


def train_and_evaluate(
    hp: AdultHParams,
    train: features.EncodedRows,
    test: features.EncodedRows,
    *,
    embedding_dim: int | None = None,
    verbose: bool = False,
) -> tuple[list[float], float]:
    """Train for ``hp.epochs``; return (test AUC after each epoch, training seconds)."""
    torch.manual_seed(hp.seed)
    torch.set_num_threads(hp.torch_threads)
    mapping = features.embedding_config_mapping()
    if embedding_dim is not None:
        for slot in mapping["slots_config"].values():
            slot["dim"] = embedding_dim
    config = embedding_config_from_mapping(mapping)
    dims = [config.slot(name).dim for name in features.SLOT_NAMES]
    tier = InProcessEmbeddingTier(
        config,
        optimizer=hp.make_embedding_optimizer(),
        initialization=hp.make_initialization(),
    )
    model = AdultDNN(dims, features.NUM_NON_ID_FEATURES, hp.hidden)
    dense_opt = torch.optim.Adam(
        model.parameters(), lr=hp.dense_lr, weight_decay=hp.dense_weight_decay
    )
    if test.labels is None:
        raise ValueError("the test rows have no labels to score the AUC against")
    test_labels = test.labels
    loss_fn = torch.nn.BCEWithLogitsLoss()
    aucs = []
    seconds = 0.0
    for epoch in range(hp.epochs):
        start = time.perf_counter()
        seed = hp.seed * 1000 + epoch
        total, count = 0.0, 0
        for batch in features.iter_batches(train, hp.batch_size, shuffle_seed=seed):
            result = tier.lookup(batch, train=True)
            leaves = [s.embeddings.detach().requires_grad_(True) for s in result.slots]
            numeric = [torch.tensor(f.data) for f in batch.non_id_type_features]
            labels = torch.tensor(batch.labels[0].data)
            logits = model(numeric, leaves)
            loss = loss_fn(logits, labels)
            dense_opt.zero_grad(set_to_none=True)
            loss.backward()
            dense_opt.step()
            if result.ref is None:
                raise RuntimeError("a train lookup returned no ref to send its gradients to")
            grads = {}
            for output, leaf in zip(result.slots, leaves):
                if leaf.grad is None:
                    raise RuntimeError(f"slot {output.name} got no gradient from the loss")
                grads[output.name] = leaf.grad
            tier.backward(result.ref, grads)
            total += loss.item() * batch.batch_size
            count += batch.batch_size
        seconds += time.perf_counter() - start
        auc = roc_auc(test_labels, predict(tier, model, test))
        aucs.append(auc)
        if verbose:
            print(f"  epoch {epoch + 1}: train loss {total / count:.4f}  test AUC {auc:.4f}")
    return aucs, seconds


def main(argv: list[str] | None = None) -> None:
    defaults = AdultHParams()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0, 1, 2],
        help="one training run per seed (default 0 1 2)",
    )
    parser.add_argument(
        "--embedding-dim",
        type=int,
        default=None,
        help="every slot's embedding width (default: the example's, from features.py)",
    )
    for field in dataclasses.fields(AdultHParams):
        if field.name == "seed":
            continue
        flag = "--" + field.name.replace("_", "-")
        value = getattr(defaults, field.name)
        if isinstance(value, bool):
            raise TypeError(f"no flag for boolean field {field.name}")
        shown = " ".join(map(str, value)) if isinstance(value, tuple) else value
        help_text = f"AdultHParams.{field.name} (default {shown})"
        if isinstance(value, tuple):
            parser.add_argument(flag, type=int, nargs="+", default=list(value), help=help_text)
        else:
            parser.add_argument(flag, type=type(value), default=value, help=help_text)
    parser.add_argument("--quiet", action="store_true", help="no per-epoch lines")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    train = features.read_encoded(features.TRAIN_PATH)
    test = features.read_encoded(features.TEST_PATH)
    print(f"encoded {len(train)} train / {len(test)} test rows in {time.perf_counter() - t0:.2f}s")

    overrides: dict[str, Any] = {
        f.name: (tuple(getattr(args, f.name)) if f.name == "hidden" else getattr(args, f.name))
        for f in dataclasses.fields(AdultHParams)
        if f.name != "seed"
    }
    final = []
    for seed in args.seeds:
        hp = AdultHParams(**overrides, seed=seed)
        start = time.perf_counter()
        aucs, train_s = train_and_evaluate(
            hp, train, test, embedding_dim=args.embedding_dim, verbose=not args.quiet
        )
        wall = time.perf_counter() - start
        final.append(aucs[-1])
        print(
            f"seed {seed}: test AUC {aucs[-1]:.4f} (per epoch "
            + ", ".join(f"{a:.4f}" for a in aucs)
            + f"); training {train_s:.1f}s, with evaluation {wall:.1f}s"
        )
    print(f"settings {overrides} dim {args.embedding_dim}")
    print(f"test AUC min {min(final):.4f} mean {np.mean(final):.4f} max {max(final):.4f}")


if __name__ == "__main__":
    main()
