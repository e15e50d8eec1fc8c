"""A small but real :class:`serving.core.PredictionCore` for front-end tests.

Model ``"tiny"`` (version ``"1"``): inputs ``user`` (UINT64 or INT64 [total_ids]),
``user.lengths`` (INT32 or INT64 [batch]) and ``age`` (FP32 [batch, 1]); output ``prediction``
(FP32 [batch, 1]) = sigmoid(0.1 * sum(user_id % 7 over the sample's IDs) + age - 1). IDs at or
above :data:`KNOWN_IDS` count as ``unknown_ids``; ``fallback_ids`` is a settable attribute.
Inputs are validated like the real core: InvalidArgumentError naming the input.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from embedding_store.errors import InvalidArgumentError, NotFoundError, UnavailableError
from serving.core import ModelMetadata, Prediction, ServerMetadata, TensorSpec

MODEL = "tiny"
VERSION = "1"
KNOWN_IDS = 1000
INPUTS = ("user", "user.lengths", "age")

METADATA = ModelMetadata(
    name=MODEL,
    versions=(VERSION,),
    platform="recserve_fake",
    inputs=(
        TensorSpec("user", "UINT64", (-1,), ("UINT64", "INT64")),
        TensorSpec("user.lengths", "INT32", (-1,), ("INT32", "INT64")),
        TensorSpec("age", "FP32", (-1, 1), ("FP32",)),
    ),
    outputs=(TensorSpec("prediction", "FP32", (-1, 1), ("FP32",)),),
    max_batch_size=256,
)


def expected_predictions(users: Sequence[Sequence[int]], ages: Sequence[float]) -> np.ndarray:
    """Reference answer, computed the slow and obvious way: float32 [batch, 1]."""
    rows = []
    for ids, age in zip(users, ages, strict=True):
        x = 0.1 * sum(int(i) % 7 for i in ids) + float(np.float32(age)) - 1.0
        rows.append([1.0 / (1.0 + np.exp(-x))])
    return np.asarray(rows, dtype=np.float32).reshape(-1, 1)


class FakeCore:
    """Thread-safe; records every predict call in :attr:`calls`."""

    def __init__(self, *, ready: bool = True) -> None:
        self.is_ready = ready
        self.fallback_ids = 0
        self.fail_with: BaseException | None = None
        self.calls: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ PredictionCore
    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.is_ready

    def server_metadata(self) -> ServerMetadata:
        return ServerMetadata("recserve-fake", "0.1.0", ("binary_tensor_data",))

    def _check_model(self, name: str, version: str | None) -> None:
        if name != MODEL:
            raise NotFoundError(f"unknown model {name!r}; this server serves {MODEL!r}")
        if version not in (None, VERSION):
            raise NotFoundError(f"model {name!r} has no version {version!r}")

    def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        self._check_model(name, version)
        return METADATA

    def model_ready(self, name: str, version: str | None = None) -> bool:
        self._check_model(name, version)
        return self.is_ready

    def predict(
        self,
        name: str,
        version: str | None,
        inputs: Mapping[str, np.ndarray],
        *,
        protocol: str,
        timeout: float | None = None,
    ) -> Prediction:
        self._check_model(name, version)
        with self._lock:
            self.calls.append(
                {
                    "protocol": protocol,
                    "timeout": timeout,
                    "version": version,
                    "inputs": inputs,
                    "thread": threading.get_ident(),
                }
            )
        if self.fail_with is not None:
            raise self.fail_with
        if not self.is_ready:
            raise UnavailableError(f"model {name!r} is not ready")
        ids, lengths, age = self._validate(inputs)
        batch = lengths.size
        sample = np.repeat(np.arange(batch), lengths)
        sums = np.bincount(sample, weights=(ids % 7).astype(np.float64), minlength=batch)
        x = 0.1 * sums + age[:, 0].astype(np.float64) - 1.0
        with np.errstate(over="ignore", invalid="ignore"):
            prediction = (1.0 / (1.0 + np.exp(-x))).astype(np.float32).reshape(batch, 1)
        return Prediction(
            outputs={"prediction": prediction},
            model_name=MODEL,
            model_version=VERSION,
            fallback_ids=self.fallback_ids,
            unknown_ids=int(np.count_nonzero(ids >= KNOWN_IDS)),
        )

    def predict_instances(
        self,
        name: str,
        instances: Sequence[Mapping[str, Any]],
        *,
        protocol: str,
        timeout: float | None = None,
    ) -> Prediction:
        self._check_model(name, None)
        users: list[int] = []
        lengths: list[int] = []
        ages: list[float] = []
        for position, instance in enumerate(instances):
            unknown = sorted(set(instance) - {"user", "age"})
            if unknown:
                raise InvalidArgumentError(
                    f"instances[{position}]: unknown feature {unknown[0]!r}; expected user, age"
                )
            user = instance.get("user", [])
            user = user if isinstance(user, list) else [user]
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in user):
                raise InvalidArgumentError(
                    f"instances[{position}]: feature 'user' must be non-negative integer IDs"
                )
            age = instance.get("age")
            age = age[0] if isinstance(age, list) and len(age) == 1 else age
            if isinstance(age, bool) or not isinstance(age, (int, float)):
                raise InvalidArgumentError(f"instances[{position}]: feature 'age' must be a number")
            users.extend(user)
            lengths.append(len(user))
            ages.append(float(age))
        if any(i >= 2**64 for i in users):
            raise InvalidArgumentError("feature 'user': IDs must fit in 64 bits")
        inputs = {
            "user": np.asarray(users, dtype=np.uint64),
            "user.lengths": np.asarray(lengths, dtype=np.int64),
            "age": np.asarray(ages, dtype=np.float32).reshape(-1, 1),
        }
        return self.predict(name, None, inputs, protocol=protocol, timeout=timeout)

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _validate(inputs: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        for name in inputs:
            if name not in INPUTS:
                raise InvalidArgumentError(f"unknown input {name!r}; expected {list(INPUTS)}")
        for name in INPUTS:
            if name not in inputs:
                raise InvalidArgumentError(f"input {name!r} is missing")
        ids, lengths, age = (np.asarray(inputs[name]) for name in INPUTS)
        if ids.dtype not in (np.uint64, np.int64) or ids.ndim != 1:
            raise InvalidArgumentError(
                f"input 'user': expected UINT64 or INT64 [-1], got {ids.dtype} {list(ids.shape)}"
            )
        if ids.dtype == np.int64 and ids.size and ids.min() < 0:
            raise InvalidArgumentError("input 'user': IDs must be non-negative")
        if lengths.dtype not in (np.int32, np.int64) or lengths.ndim != 1:
            raise InvalidArgumentError(
                f"input 'user.lengths': expected INT32 or INT64 [-1], got {lengths.dtype} "
                f"{list(lengths.shape)}"
            )
        if lengths.size and (lengths.min() < 0 or lengths.max() > ids.size):
            raise InvalidArgumentError(
                f"input 'user.lengths': lengths must be within [0, {ids.size}]"
            )
        total = int(lengths.sum(dtype=np.int64))
        if total != ids.size:
            raise InvalidArgumentError(
                f"input 'user.lengths': lengths sum to {total} but input 'user' has {ids.size} IDs"
            )
        if age.dtype != np.float32 or age.ndim != 2 or age.shape[1:] != (1,):
            raise InvalidArgumentError(
                f"input 'age': expected FP32 [-1, 1], got {age.dtype} {list(age.shape)}"
            )
        if age.shape[0] != lengths.size:
            raise InvalidArgumentError(
                f"input 'age': batch size {age.shape[0]} differs from input 'user.lengths' "
                f"({lengths.size})"
            )
        return ids.astype(np.uint64, copy=False), lengths, age
