"""What the clients return: typed results instead of protocol dictionaries."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TensorInfo:
    """One model input or output: KServe v2 ``name``, ``datatype`` and ``shape`` (-1 for a
    variable dimension)."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ModelInfo:
    """A model's metadata (``GET /v2/models/{name}`` / gRPC ModelMetadata)."""

    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]

    def input(self, name: str) -> TensorInfo:
        """The input called ``name`` (KeyError if the model has none)."""
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(name)


@dataclass(frozen=True)
class PredictResult:
    """A served answer.

    ``predictions``: float32 [batch, 1]; ``model_version``: the checkpoint version that
    answered; ``fallback_ids``: IDs answered with default vectors after an embedding lookup
    timeout; ``unknown_ids``: ID occurrences of this request the embedding tier did not
    hold (an ID sent twice counts twice; the same on every tier, merged with other requests
    or not); ``latency_seconds``: wall time of the client call, retries included.
    """

    predictions: np.ndarray
    model_name: str
    model_version: str
    fallback_ids: int = 0
    unknown_ids: int = 0
    latency_seconds: float = 0.0

    def __len__(self) -> int:
        return int(self.predictions.shape[0])
