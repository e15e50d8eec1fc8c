"""Training-side checkpoint calls: rank 0 writes, every rank waits (format in
:mod:`embedding_store.model_checkpoint`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from embedding_store.errors import CheckpointError
from embedding_store.model_checkpoint import (
    RNG_KINDS,
    CheckpointManifest,
    load_checkpoint,
    load_jit_model,
    read_manifest,
    read_rng_states,
    verify,
    write_checkpoint,
)
from embedding_store.signature import FeatureSignature
from embedding_store.tier import EmbeddingTier
from training import distributed

__all__ = [
    "CheckpointManifest",
    "dump_checkpoint",
    "load_checkpoint",
    "load_jit_model",
    "read_manifest",
    "read_rng_states",
    "verify",
]


def dump_checkpoint(
    directory: Path,
    model: torch.nn.Module,
    dense_optimizer: torch.optim.Optimizer | None,
    tier: EmbeddingTier,
    *,
    step: int = 0,
    signature: FeatureSignature | None = None,
    with_jit_model: bool = True,
    overwrite: bool = False,
    grad_scaler: torch.amp.GradScaler | None = None,
    train_state: dict[str, Any] | None = None,
    rng_state: dict[str, torch.Tensor] | None = None,
) -> CheckpointManifest | None:
    """Write a checkpoint from rank 0 while the other ranks wait; returns its manifest on
    rank 0 and None elsewhere. Every rank calls it once its own embedding updates are
    applied (``TrainCtx.dump_checkpoint`` flushes first): the barrier here makes rank 0 wait
    for all of them, so the checkpoint holds every rank's updates. If rank 0 fails to write,
    every rank raises.

    ``rng_state``: this rank's random number generator states (kinds of
    :data:`~embedding_store.model_checkpoint.RNG_KINDS`, uint8 [n] each); every rank passes
    its own, or none does. Rank 0 gathers them and writes them all: each rank draws its own
    numbers (its dropout masks), so each resumes from its own state."""
    distributed.checkpoint_barrier()
    rng_states = None if rng_state is None else _gather_rng_states(rng_state)
    if distributed.rank() != 0:
        if not distributed.checkpoint_agree(True):
            raise CheckpointError(
                f"rank 0 failed to write checkpoint {directory}; its log has the error"
            )
        return None
    try:
        manifest = write_checkpoint(
            directory,
            model,
            dense_optimizer,
            tier,
            step=step,
            signature=signature,
            with_jit_model=with_jit_model,
            overwrite=overwrite,
            grad_scaler=grad_scaler,
            train_state=train_state,
            rng_states=rng_states,
        )
    except BaseException:
        distributed.checkpoint_agree(False)
        raise
    distributed.checkpoint_agree(True)
    return manifest


def _gather_rng_states(state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Every rank's ``state`` by rank (one gather per kind: a kind a rank has not, e.g. a
    GPU's on a CPU rank, is an empty tensor in the gather and left out)."""
    gathered: list[dict[str, torch.Tensor]] = []
    for kind in RNG_KINDS:
        parts = distributed.all_gather_bytes(state.get(kind, torch.zeros(0, dtype=torch.uint8)))
        gathered += [{} for _ in range(len(parts) - len(gathered))]
        for rank_state, part in zip(gathered, parts):
            if part.numel():
                rank_state[kind] = part
    return gathered
