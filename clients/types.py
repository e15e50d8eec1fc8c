"""What the clients return: typed results instead of protocol dictionaries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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
    or not); ``latency_seconds``: wall time of the client call, retries included;
    ``parameters``: the answer's parameters as the server sent them (KServe v2 response
    ``parameters``; the friendly route's fields but ``predictions``), e.g. to tell an answer
    that carried no ``unknown_ids`` (read as 0 above) from one that counted none.
    """

    predictions: np.ndarray
    model_name: str
    model_version: str
    fallback_ids: int = 0
    unknown_ids: int = 0
    latency_seconds: float = 0.0
    parameters: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __len__(self) -> int:
        return int(self.predictions.shape[0])
