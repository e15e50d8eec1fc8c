"""What the embedding tier answers, as plain types that import no torch: lookup results,
backward statistics and the tier's status.

A client of a remote tier (``RemoteEmbeddingWorker``, and ``recserve embedding-tier`` through
it) builds these from messages; importing them from the worker core or the tier
(:mod:`embedding_store.worker`, :mod:`embedding_store.tier`, which import torch and re-export
them) would cost every ``recserve embedding-tier status`` ~1 s of CPU for torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from embedding_store.batch import IDTypeFeature, IDTypeFeatureWithSingleID
from embedding_store.config import EmbeddingConfig
from embedding_store.errors import NotFoundError

if TYPE_CHECKING:  # the tensors of a lookup's answer; importing torch here is what this avoids
    import torch

#: What a lookup takes in place of a batch: its ID-type features.
IdFeature = IDTypeFeature | IDTypeFeatureWithSingleID


@dataclass(frozen=True)
class SlotOutput:
    """Embeddings of one slot for one batch.

    ``embeddings`` is float32 [batch, dim] for summation slots, or float32
    [batch, sample_fixed_size, dim] for raw slots, whose ``mask`` (bool [batch,
    sample_fixed_size]) is True where a real ID sits; padding rows are zeros.
    """

    name: str
    embeddings: torch.Tensor
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class LookupResult:
    """The worker's answer to one batch: slot outputs in the batch's feature order.

    ``ref`` identifies the forward context kept for :meth:`EmbeddingWorker.backward`
    (train lookups only, else None).
    """

    slots: tuple[SlotOutput, ...]
    ref: int | None = None
    #: IDs answered with the slot default (zeros): unknown to an eval lookup, or refused
    #: admission by a train lookup. Counted per ID occurrence of the batch, whatever the
    #: tier (a worker that deduplicates IDs before it asks its shards counts each
    #: occurrence): an unknown ID that occurs 3 times counts 3. Counted per looked-up row:
    #: each round of a hash-stacked ID; IDs past a raw slot's ``sample_fixed_size`` are
    #: never looked up and not counted. Only a shard that predates
    #: ``LookupResponse.missing`` makes it a count per distinct ID of that shard's lookups.
    unknown_ids: int = 0
    #: ``unknown_ids`` split by sample: int64 [batch], summing to it (what each request of
    #: a merged batch is told). None where it is not known: a lookup not made by a worker
    #: (a fallback's default answer), a worker or shard that predates the split.
    unknown_per_sample: np.ndarray | None = field(default=None, compare=False)

    def slot(self, name: str) -> SlotOutput:
        for output in self.slots:
            if output.name == name:
                return output
        raise NotFoundError(f"no slot {name!r} in this lookup result")


@dataclass(frozen=True)
class BackwardStats:
    """What one backward pass pushed: unique rows sent, and rows skipped for NaN/Inf."""

    rows_pushed: int
    nonfinite_rows_skipped: int


#: Called with (stage, done, total) while a dump or load makes progress.
ProgressCallback = Callable[[str, int, int], None]


@dataclass(frozen=True)
class TierStatus:
    """A summary of the tier: rows held per shard, work waiting, checkpoint tasks running.

    ``shard_tasks[i]`` is what shard i reports it is busy with (``""``, ``"loading"``,
    ``"dumping"``) and ``shard_task_progress[i]`` how far it is (0..1); ``task`` and
    ``task_progress`` are the same for a dump or load run through the tier itself
    (``""``, ``"dumping"``, ``"loading"``; shards done / shards). ``shard_serving[i]`` is
    whether shard i can answer lookups now (an inference shard has loaded its checkpoint, a
    training shard has an optimizer); empty where a tier does not report it.
    ``shard_checkpoint_versions[i]`` is the embedding checkpoint version shard i's rows were
    loaded from (``""``: none, or changed since by training); empty where not reported.
    ``shard_errors[i]`` is why shard i did not answer (``""``: it did; its other fields are
    then zeros); empty unless a partial status was asked for (``status(partial=True)`` of a
    remote tier): otherwise a shard that does not answer raises. ``embedding_config`` is
    the config the tier routes IDs by, where the tier reports one (an embedding worker's
    Status); None otherwise. ``forward_buffer_size`` is how many train lookups' forward
    contexts the tier's worker keeps for their gradients, one buffer for all its callers
    (0: not reported, by a worker that predates it). ``shard_addresses[i]`` is shard i's
    address (``host:port``) where the shards are remote; empty for in-process shards.
    """

    rows_per_shard: tuple[int, ...]
    capacity_per_shard: tuple[int, ...]
    pending_backward: int
    pending_gradient_batches: int
    nonfinite_rows_skipped: int
    shard_tasks: tuple[str, ...] = ()
    shard_task_progress: tuple[float, ...] = ()
    task: str = ""
    task_progress: float = 0.0
    shard_serving: tuple[bool, ...] = ()
    shard_checkpoint_versions: tuple[str, ...] = ()
    shard_errors: tuple[str, ...] = ()
    embedding_config: EmbeddingConfig | None = None
    forward_buffer_size: int = 0
    shard_addresses: tuple[str, ...] = ()
