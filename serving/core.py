"""The serving core as the front ends see it: one object, protocol-neutral.

HTTP (FastAPI) and gRPC (KServe v2) front ends only decode a request into named numpy arrays
(or friendly JSON instances), call :class:`PredictionCore`, and encode the answer. Everything
else (validation of names/dtypes/shapes, batching, deadlines, model versions, metrics,
readiness) lives behind this interface.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

#: KServe v2 datatype names and the numpy dtypes they map to.
KSERVE_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(bool),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
#: numpy dtype -> KServe v2 datatype name.
DTYPE_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in KSERVE_DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of the model: KServe v2 ``name``, ``datatype`` and ``shape``
    (-1 for a variable dimension). ``datatypes`` lists every datatype accepted for it."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    datatypes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelMetadata:
    """What ``GET /v2/models/{name}`` and gRPC ModelMetadata report."""

    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int


@dataclass(frozen=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...] = ()


@dataclass(frozen=True)
class Prediction:
    """A served answer: ``outputs`` maps output names to arrays (``prediction``: float32
    [batch, 1]); ``model_version`` names the (dense, embedding) checkpoint pair that
    answered; ``fallback_ids`` counts IDs answered with default vectors after a lookup
    timeout; ``unknown_ids`` counts the ID occurrences of this request's own samples that
    the embedding tier did not hold (also when it was merged with other requests)."""

    outputs: Mapping[str, np.ndarray]
    model_name: str
    model_version: str
    fallback_ids: int = 0
    unknown_ids: int = 0
    parameters: Mapping[str, Any] = field(default_factory=dict)


class PredictionCore(Protocol):
    """The one object both front ends call. All methods are thread-safe.

    Errors are raised as :mod:`embedding_store.errors` classes; the front ends map them with
    ``http_status_of`` / ``grpc_code_name_of`` and send ``public_message_of`` only.
    """

    def live(self) -> bool: ...

    def ready(self) -> bool:
        """True once the model is loaded and warmed, until shutdown starts. Called on the
        event loop for every probe: it must not block (a flag, not a check of peers)."""
        ...

    def server_metadata(self) -> ServerMetadata:
        """Called on the event loop, as :meth:`ready`: it must not block."""
        ...

    def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        """Raises NotFoundError for an unknown model name or version. Called on the event
        loop, as :meth:`ready`: it must not block (in-memory state only)."""
        ...

    def model_ready(self, name: str, version: str | None = None) -> bool:
        """Raises NotFoundError for an unknown model name or version. Called on the event
        loop, as :meth:`ready`: it must not block."""
        ...

    def predict(
        self,
        name: str,
        version: str | None,
        inputs: Mapping[str, np.ndarray],
        *,
        protocol: str,
        timeout: float | None = None,
    ) -> Prediction:
        """Score named input tensors (KServe v2 naming, see serving/tensor_specs.py).

        ``protocol`` labels metrics ("http", "grpc"). Invalid inputs raise
        InvalidArgumentError naming the input; overload/not ready raise UnavailableError.
        """
        ...

    def predict_instances(
        self,
        name: str,
        instances: Sequence[Mapping[str, Any]],
        *,
        protocol: str,
        timeout: float | None = None,
    ) -> Prediction:
        """Score friendly JSON rows: ``{"<feature>": value or list, ...}`` per instance."""
        ...
