"""The tier boundary between embedding workers and parameter-server shards.

:class:`ParameterServer` is what a worker needs from one shard. The in-process
:class:`embedding_store.shard.EmbeddingShard` satisfies it directly; the gRPC client of a remote
shard implements the same methods, so the worker never knows which one it talks to.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class ParameterServer(Protocol):
    """One shard of the embedding table, as seen by a worker."""

    def lookup(self, ids: np.ndarray, dim: int, *, train: bool) -> np.ndarray:
        """Rows for ``ids`` (uint64 [n]) -> float32 [n, dim].

        ``train=True`` inserts unknown IDs (initialized deterministically); ``train=False``
        never inserts and returns zeros for unknown IDs.
        """
        ...

    def update(self, ids: np.ndarray, grads: np.ndarray, *, generation: int | None = None) -> int:
        """Apply the configured optimizer: ``ids`` uint64 [n] unique, ``grads`` float32 [n, dim].

        Returns the number of rows updated (IDs evicted meanwhile are skipped).
        ``generation``: the shard's ``last_generation`` after the train lookup that the
        gradients were computed against (a worker passes it only to shards that report
        one); a shard whose rows a load or clear replaced since refuses them
        (FailedPreconditionError).
        """
        ...
