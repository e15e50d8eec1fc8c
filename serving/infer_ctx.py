"""InferCtx: PERSIA's inference context, for scripts and custom servers.

Read-only embedding lookups (unknown IDs give the slot default, zeros) plus the dense model,
either in-process from a checkpoint (the embedded default) or through remote embedding
workers that serve a checkpoint in infer mode.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import numpy as np
import torch

from embedding_store.batch import Batch
from embedding_store.config import EmbeddingConfig, load_embedding_config
from embedding_store.errors import FailedPreconditionError, InvalidArgumentError
from embedding_store.signature import model_dtype
from embedding_store.tier import EmbeddingTier
from embedding_store.worker import LookupResult
from serving import tensors
from serving.model import LoadedModel, load_model


class InferCtx:
    """``InferCtx(checkpoint=DIR)`` (in-process) or
    ``InferCtx(["host:port"], checkpoint=DIR)`` (remote embeddings, local dense model) or
    ``InferCtx(["host:port"], embedding_config=...)`` (lookups only).

    ``timeout`` bounds each lookup; ``startup_timeout`` how long a checkpoint's remote
    embedding worker may take to report SERVING before UnavailableError."""

    def __init__(
        self,
        embedding_worker_addresses: Sequence[str] | None = None,
        *,
        checkpoint: str | os.PathLike | None = None,
        embedding_config: EmbeddingConfig | str | os.PathLike | None = None,
        output_transform: str = "identity",
        timeout: float = 10.0,
        startup_timeout: float = 60.0,
    ) -> None:
        self.addresses = list(embedding_worker_addresses or [])
        self.model: LoadedModel | None = None
        self._remote = None
        if checkpoint is not None:
            self.model = load_model(
                Path(checkpoint),
                # Only log lines show it: name them after the checkpoint they came from.
                name=Path(checkpoint).resolve().name or "model",
                embedding_workers=self.addresses or None,
                output_transform=output_transform,
                lookup_timeout=timeout,
                warm_up=False,
                startup_timeout=startup_timeout,
            )
            self.embedding_config = self.model.embedding_config
            self._tier = self.model.tier
        elif self.addresses:
            from embedding_store.worker_client import RemoteEmbeddingWorker

            if embedding_config is None:
                raise InvalidArgumentError(
                    "InferCtx with worker addresses and no checkpoint needs embedding_config"
                )
            config = (
                embedding_config
                if isinstance(embedding_config, EmbeddingConfig)
                else load_embedding_config(embedding_config)
            )
            self.embedding_config = config
            # Built with a config, so its embedding_config is not None as EmbeddingTier wants
            # (the class also takes None, for admin clients that need no config).
            self._tier = cast(
                EmbeddingTier, RemoteEmbeddingWorker(self.addresses[0], config, timeout=timeout)
            )
        else:
            raise InvalidArgumentError("InferCtx needs a checkpoint or embedding worker addresses")

    def wait_for_serving(self, timeout: float = 60.0) -> None:
        """Block until the embedding tier answers (remote workers SERVING)."""
        wait = getattr(self._tier, "wait_for_serving", None)
        if wait is not None:
            wait(timeout)

    def get_embedding_from_data(self, batch: Batch) -> LookupResult:
        """Read-only lookups for ``batch``'s ID features."""
        return self._tier.lookup(batch, train=False)

    def get_embedding_from_bytes(self, batch_bytes: bytes) -> LookupResult:
        """Same, for a batch in recserve's binary format."""
        return self.get_embedding_from_data(Batch.from_bytes(batch_bytes))

    def prepare_features(
        self, batch: Batch
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(non-ID tensors, embedding tensors, label tensors) for the dense model: the
        model's inputs by position, so with a checkpoint the batch must match its signature
        (BatchValidationError names the first feature that does not)."""
        features = batch.non_id_type_features
        # In the dtypes training hands the model (float64 -> float32, integers as they are):
        # the signature's with a checkpoint (check: only exact conversions, as serving).
        dtypes = [model_dtype(f.data.dtype) for f in features]
        if self.model is not None:
            self.model.signature.check(batch)
            dtypes = list(self.model.signature.model_dtypes)
        lookup = self.get_embedding_from_data(batch)
        non_ids = [
            torch.from_numpy(np.array(f.data, dtype=dtype, copy=True))
            for f, dtype in zip(features, dtypes, strict=True)
        ]
        labels = [torch.from_numpy(np.array(label.data, copy=True)) for label in batch.labels]
        return non_ids, [s.embeddings for s in lookup.slots], labels

    def forward(self, batch: Batch) -> np.ndarray:
        """Predictions float32 [batch, 1] (after the output transform), as the server gives.

        The batch must match the checkpoint's feature signature in names, kinds and order
        (BatchValidationError otherwise): the dense model takes its inputs by position.
        As the server, it refuses NaN/Inf non-ID features and predictions that come out
        NaN/Inf (InvalidArgumentError naming the feature or the first sample).
        """
        if self.model is None:
            raise FailedPreconditionError("InferCtx.forward needs a checkpoint (dense model)")
        self.model.signature.check(batch)
        tensors.require_finite_features(batch)
        predictions = self.model.forward(batch, self.get_embedding_from_data(batch))
        tensors.require_finite_predictions(predictions)
        return predictions

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
        elif self._tier is not None:
            self._tier.close()

    def __enter__(self) -> InferCtx:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
