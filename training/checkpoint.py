"""Training-side checkpoint calls: rank 0 writes, every rank waits (format in
:mod:`embedding_store.model_checkpoint`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from embedding_store.errors import CheckpointError
from embedding_store.model_checkpoint import (
    CheckpointManifest,
    load_checkpoint,
    load_jit_model,
    read_manifest,
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
) -> CheckpointManifest | None:
    """Write a checkpoint from rank 0 while the other ranks wait; returns its manifest on
    rank 0 and None elsewhere. Every rank calls it once its own embedding updates are
    applied (``TrainCtx.dump_checkpoint`` flushes first): the barrier here makes rank 0 wait
    for all of them, so the checkpoint holds every rank's updates. If rank 0 fails to write,
    every rank raises."""
    distributed.checkpoint_barrier()
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
        )
    except BaseException:
        distributed.checkpoint_agree(False)
        raise
    distributed.checkpoint_agree(True)
    return manifest
