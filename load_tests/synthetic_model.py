"""A synthetic Criteo-like checkpoint for load tests: 26 single-ID slots + 13 dense features.

DLRM-ish dense model: a bottom MLP over the 13 dense features (13-512-256-16), concatenated
with the 26 pooled embeddings (dim 16), then a top MLP (432-256-128-1). It is trained for a few
steps with :class:`training.ctx.TrainCtx` and the in-process embedding tier, just enough to
insert every vocabulary ID (``C<k>`` slot IDs are ``0 .. vocab - 1``) and move the weights;
labels come from a fixed random logistic model, so the numbers mean nothing beyond load.

    python load_tests/synthetic_model.py --out /tmp/criteo-synth [--vocab 10000]

Inputs as served (KServe v2 metadata): ``C1`` .. ``C26`` INT64 [batch], ``dense`` FP32
[batch, 13]; output ``prediction`` FP32 [batch, 1] (a logit: serve with
``--output-transform sigmoid`` for probabilities).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, List  # noqa: UP035  (TorchScript reads the forward signature)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from embedding_store.batch import Batch

NUM_SLOTS = 26
NUM_DENSE = 13
DENSE_NAME = "dense"
LABEL_NAME = "label"


def slot_names(num_slots: int = NUM_SLOTS) -> list[str]:
    return [f"C{i}" for i in range(1, num_slots + 1)]


def embedding_config_mapping(num_slots: int = NUM_SLOTS, dim: int = 16) -> dict:
    return {
        "feature_index_prefix_bit": 8,
        "slots_config": {
            name: {"dim": dim, "embedding_summation": True} for name in slot_names(num_slots)
        },
    }


def _mlp(widths: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class SyntheticDLRM(nn.Module):
    """``top([bottom(dense), emb_1, ..., emb_k]) -> logit``; scriptable."""

    def __init__(
        self,
        num_slots: int = NUM_SLOTS,
        dim: int = 16,
        num_dense: int = NUM_DENSE,
        bottom: tuple[int, ...] = (512, 256),
        top: tuple[int, ...] = (256, 128),
    ) -> None:
        super().__init__()
        self.bottom = _mlp([num_dense, *bottom, dim], last_relu=True)
        self.top = _mlp([dim * (num_slots + 1), *top, 1], last_relu=False)

    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        x = self.bottom(non_id_tensors[0])
        return self.top(torch.cat([x] + embedding_tensors, dim=1))  # noqa: RUF005 (TorchScript)


def _batch(rng: np.random.Generator, ids: list[np.ndarray], teacher: np.ndarray) -> Batch:
    from embedding_store.batch import Batch, IDTypeFeatureWithSingleID, Label, NonIDTypeFeature

    size = len(ids[0])
    dense = rng.standard_normal((size, NUM_DENSE)).astype(np.float32)
    logit = dense @ teacher[:NUM_DENSE] + sum(
        ((slot_ids % 7).astype(np.float32) - 3.0) * teacher[NUM_DENSE + k] / 3.0
        for k, slot_ids in enumerate(ids)
    )
    labels = (rng.random(size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    names = slot_names(len(ids))
    return Batch(
        [IDTypeFeatureWithSingleID(n, a.astype(np.uint64)) for n, a in zip(names, ids)],
        [NonIDTypeFeature(dense, DENSE_NAME)],
        [Label(labels.reshape(-1, 1), LABEL_NAME)],
        requires_grad=True,
    )


def build_synthetic_checkpoint(
    directory: str | Path,
    *,
    vocab: int = 10_000,
    num_slots: int = NUM_SLOTS,
    dim: int = 16,
    batch_size: int = 2048,
    extra_steps: int = 4,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Train briefly and dump a servable checkpoint (dense TorchScript + embeddings) into
    ``directory``. Every ID ``0 .. vocab - 1`` of every slot gets a row: the first
    ``ceil(vocab / batch_size)`` steps walk a permutation of the vocabulary, then
    ``extra_steps`` Zipf-ish random steps follow. Returns the directory."""
    from embedding_store.config import embedding_config_from_mapping
    from embedding_store.initializer import InitializationConfig
    from embedding_store.optimizers import SGD
    from training.ctx import TrainCtx

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    config = embedding_config_from_mapping(
        embedding_config_mapping(num_slots, dim), source="synthetic criteo"
    )
    model = SyntheticDLRM(num_slots, dim)
    teacher = rng.standard_normal(NUM_DENSE + num_slots).astype(np.float32) * 0.5
    permutations = [rng.permutation(vocab) for _ in range(num_slots)]
    with TrainCtx(
        SGD(lr=0.05),
        torch.optim.Adam(model.parameters(), lr=1e-3),
        model,
        embedding_config=config,
        embedding_staleness=1,
        initialization=InitializationConfig(low=-0.05, high=0.05, seed=seed),
    ) as ctx:
        steps = []
        for start in range(0, vocab, batch_size):
            steps.append([p[start : start + batch_size] for p in permutations])
        for _ in range(extra_steps):
            steps.append(
                [np.minimum(rng.zipf(1.2, batch_size) - 1, vocab - 1) for _ in range(num_slots)]
            )
        for ids in steps:
            output, labels = ctx.forward(_batch(rng, ids, teacher))
            loss = torch.nn.functional.binary_cross_entropy_with_logits(output, labels[0])
            ctx.backward(loss)
        ctx.dump_checkpoint(Path(directory), overwrite=overwrite)
    return Path(directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument(
        "--vocab", type=int, default=10_000, help="IDs per slot (default %(default)s)"
    )
    parser.add_argument(
        "--dim", type=int, default=16, help="embedding width of every slot (default %(default)s)"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the weights, the new rows and the training batches (default %(default)s)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint at --out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    build_synthetic_checkpoint(
        args.out, vocab=args.vocab, dim=args.dim, seed=args.seed, overwrite=args.overwrite
    )
    print(f"synthetic checkpoint: {args.out} ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
