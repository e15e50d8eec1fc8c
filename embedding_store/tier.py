"""The embedding tier as seen by training and serving: one interface, two implementations.

:class:`EmbeddingTier` is everything a TrainCtx or InferCtx needs from the embedding tier.
:class:`InProcessEmbeddingTier` (this module) runs shards and the worker core inside the
calling process: the embedded default, no services. ``RemoteEmbeddingWorker``
(:mod:`embedding_store.worker_client`) talks to an ``embedding-worker`` service over gRPC.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from embedding_store import checkpoint_dump, checkpoint_load, checkpoint_manifest
from embedding_store.batch import Batch
from embedding_store.config import EmbeddingConfig
from embedding_store.initializer import InitializationConfig
from embedding_store.optimizers import Optimizer
from embedding_store.shard import EmbeddingShard
from embedding_store.tier_types import (
    BackwardStats,
    IdFeature,
    LookupResult,
    ProgressCallback,
    TierStatus,
)
from embedding_store.worker import EmbeddingWorker

#: Why a forward context taken before a tier's clear() is refused its backward (worker's
#: take_forward_context: "forward context N was taken before REASON replaced the rows ...").
CLEAR_REASON = "a clear of the embedding tier"


class DownReasons:
    """Why a peer checked in the background (the embedding tier, a worker's shards) is not
    serving, for its log lines: the check logs when :meth:`down` says the reason is new (it
    went down, or was down for another reason: a shard back from a crash as an empty,
    unconfigured one is another problem than the crash) and when :meth:`up` says it is back.
    Used by one checking thread; others may read :attr:`reason`."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def down(self, reason: str) -> bool:
        """Not serving for ``reason``; True when that is news (down until now, or another
        reason): the caller logs it."""
        news = reason != self.reason
        self.reason = reason
        return news

    def up(self) -> bool:
        """Serving; True when it was not (the caller logs the return)."""
        was_down = self.reason is not None
        self.reason = None
        return was_down


@runtime_checkable
class EmbeddingTier(Protocol):
    """Lookups, gradients and checkpoints of the embedding tier."""

    embedding_config: EmbeddingConfig

    def lookup(self, batch: Batch | Sequence[IdFeature], *, train: bool) -> LookupResult: ...

    def backward(self, ref: int, grads: Mapping[str, torch.Tensor | np.ndarray]) -> BackwardStats:
        """Send the gradients of train lookup ``ref``: ``grads[slot]`` has that slot's output
        shape, float32 [batch, dim] (pooled) or [batch, sample_fixed_size, dim] (raw); a slot
        without one trains nothing (``grads={}`` just drops the lookup's context). Applied
        now (in-process) or queued until :meth:`flush` (remote); a wrong shape or slot raises
        before anything is applied."""
        ...

    def flush(self) -> None:
        """Block until every gradient handed to :meth:`backward` has reached its shard."""
        ...

    def configure(
        self,
        *,
        optimizer: Optimizer | None = None,
        initialization: InitializationConfig | None = None,
    ) -> None: ...

    def dump(
        self,
        directory: str | os.PathLike,
        *,
        overwrite: bool = False,
        progress: ProgressCallback | None = None,
    ) -> checkpoint_manifest.EmbeddingManifest: ...

    def load(
        self, directory: str | os.PathLike, *, progress: ProgressCallback | None = None
    ) -> checkpoint_manifest.EmbeddingManifest: ...

    def clear(self) -> None: ...

    def status(self) -> TierStatus: ...

    def close(self) -> None: ...


class InProcessEmbeddingTier:
    """Shards and worker core in this process (the embedded default).

    ``num_shards`` > 1 is useful to test sharding without services; rows and results are the
    same whatever the count.
    """

    def __init__(
        self,
        embedding_config: EmbeddingConfig,
        *,
        capacity: int = 1_000_000,
        num_shards: int = 1,
        optimizer: Optimizer | None = None,
        initialization: InitializationConfig | None = None,
        read_only: bool = False,
        forward_buffer_size: int = 1000,
    ) -> None:
        self.embedding_config = embedding_config
        self.shards = [
            EmbeddingShard(
                capacity,
                optimizer=optimizer,
                initialization=initialization or InitializationConfig(),
                read_only=read_only,
                replica_index=i,
                replica_size=num_shards,
            )
            for i in range(num_shards)
        ]
        self.worker = EmbeddingWorker(
            embedding_config, self.shards, forward_buffer_size=forward_buffer_size
        )

    def lookup(self, batch: Batch | Sequence[IdFeature], *, train: bool) -> LookupResult:
        return self.worker.lookup(batch, train=train)

    def backward(self, ref: int, grads: Mapping[str, torch.Tensor | np.ndarray]) -> BackwardStats:
        return self.worker.backward(ref, grads)

    def drop_forward_contexts(self, refs: Sequence[int]) -> None:
        """Drop the contexts of train lookups ``refs`` abandoned without a backward (see
        :meth:`EmbeddingWorker.drop_forward_contexts`)."""
        self.worker.drop_forward_contexts(refs)

    def flush(self) -> None:
        """Nothing to wait for: in-process gradients are applied inside :meth:`backward`."""

    def configure(
        self,
        *,
        optimizer: Optimizer | None = None,
        initialization: InitializationConfig | None = None,
    ) -> None:
        for shard in self.shards:
            shard.configure(optimizer=optimizer, initialization=initialization)

    def dump(
        self,
        directory: str | os.PathLike,
        *,
        overwrite: bool = False,
        progress: ProgressCallback | None = None,
    ) -> checkpoint_manifest.EmbeddingManifest:
        manifest = checkpoint_dump.dump_embeddings(
            self.shards, directory, self.embedding_config, overwrite=overwrite
        )
        if progress:
            progress("dump", len(self.shards), len(self.shards))
        return manifest

    def load(
        self, directory: str | os.PathLike, *, progress: ProgressCallback | None = None
    ) -> checkpoint_manifest.EmbeddingManifest:
        manifest = checkpoint_load.load_embeddings(directory, self.shards, self.embedding_config)
        # Rows replaced: a backward for a lookup made before would apply gradients computed
        # against the old rows to the loaded ones (a failed load changed none: kept).
        self.worker.invalidate_forward_contexts(
            f"the load of embedding checkpoint {os.path.abspath(directory)}"
        )
        if progress:
            progress("load", len(self.shards), len(self.shards))
        return manifest

    def clear(self) -> None:
        try:
            for shard in self.shards:
                shard.clear()
        finally:
            # Rows dropped (new ones initialized at the next lookup), as by a load: a backward
            # for a lookup made before would move the fresh rows by stale gradients. Also when
            # a shard failed: the ones before it were cleared.
            self.worker.invalidate_forward_contexts(CLEAR_REASON)

    def status(self) -> TierStatus:
        return TierStatus(
            rows_per_shard=tuple(s.size() for s in self.shards),
            capacity_per_shard=tuple(s.capacity for s in self.shards),
            pending_backward=self.worker.pending_backward,
            pending_gradient_batches=0,
            nonfinite_rows_skipped=self.worker.nonfinite_rows_skipped,
            # In-process dumps and loads finish inside the call that starts them.
            shard_tasks=("",) * len(self.shards),
            shard_task_progress=(0.0,) * len(self.shards),
            # In-process shards answer from the moment they exist (no checkpoint to wait for).
            shard_serving=(True,) * len(self.shards),
            shard_checkpoint_versions=tuple(s.checkpoint_version for s in self.shards),
            forward_buffer_size=self.worker.forward_buffer_size,
        )

    def close(self) -> None:
        """Nothing to release."""

    def __enter__(self) -> InProcessEmbeddingTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
