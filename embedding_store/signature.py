"""The feature signature of a model: which features a batch carries, in which order and shape.

Training records it from the batches it sees and stores it in the checkpoint; serving uses it
to validate requests and to name the model's inputs (KServe v2 metadata). ID features keep
their order because the dense model receives its embedding tensors in that order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from embedding_store.batch import Batch, IDTypeFeatureWithSingleID, NonIDTypeFeature
from embedding_store.errors import BatchValidationError, CheckpointError

_FLOAT64 = np.dtype(np.float64)
_FLOAT32 = np.dtype(np.float32)


def model_dtype(dtype: np.dtype | str) -> np.dtype:
    """The dtype the dense model receives a non-ID feature of ``dtype`` in, in training
    (``training.ctx``) and serving alike: float64 becomes float32, any other dtype stays (an
    int64 timestamp reaches the model as int64, so ``ts // 3600`` answers the same in both)."""
    dtype = np.dtype(dtype)
    return _FLOAT32 if dtype == _FLOAT64 else dtype


def first_inexact(data: np.ndarray, target: np.dtype) -> int | None:
    """The flat index of the first value of ``data`` (a numeric or bool array) that does
    not convert exactly to the integer dtype ``target`` (NaN, +-Inf, a fraction, or out of
    its range), or None when all do. The caller runs it only when ``data``'s dtype is not
    ``target`` and cannot be cast to it safely: a few numpy passes, not on the usual path."""
    info = np.iinfo(target)
    flat = data.reshape(-1)
    if flat.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            # In float64, [min, max + 1) is exact for every integer dtype's bounds (+-2**k).
            wide = flat.astype(np.float64)
            bad = ~((wide == np.trunc(wide)) & (wide >= info.min) & (wide < float(info.max) + 1))
    else:  # integers of another width or signedness (bools cast safely: never here)
        # The target's bounds clipped to what the data's dtype holds, in that dtype.
        have = np.iinfo(flat.dtype)
        low = flat.dtype.type(max(info.min, have.min))
        high = flat.dtype.type(min(info.max, have.max))
        bad = (flat < low) | (flat > high)
    return int(np.argmax(bad)) if bad.any() else None


def describe_inexact(data: np.ndarray, target: np.dtype) -> str | None:
    """Where ``data`` ([batch, ...]) first fails to convert exactly to the integer dtype
    ``target`` (:func:`first_inexact`), as "value V at sample S[, position P] is not a whole
    number in the range of T"; None when every value converts."""
    first = first_inexact(data, target)
    if first is None:
        return None
    index = [int(i) for i in np.unravel_index(first, data.shape)]
    return (
        f"value {data.reshape(-1)[first]!s} at sample {index[0]}"
        + (f", position {index[1:]}" if len(index) > 1 else "")
        + f" is not a whole number in the range of {target}"
    )


@dataclass(frozen=True)
class IdFeatureSpec:
    """An ID feature: jagged (``single_id`` False) or exactly one ID per sample."""

    name: str
    single_id: bool


def _id_kind(single_id: bool) -> str:
    return "single-ID (one ID per sample)" if single_id else "jagged (a list of IDs per sample)"


@dataclass(frozen=True)
class NonIdFeatureSpec:
    """A non-ID feature: numpy dtype name and the shape of one sample (without the batch)."""

    name: str
    dtype: str
    sample_shape: tuple[int, ...]


@dataclass(frozen=True)
class FeatureSignature:
    """Every input of a model, in the order the dense model consumes them."""

    id_features: tuple[IdFeatureSpec, ...]
    non_id_features: tuple[NonIdFeatureSpec, ...]
    label_names: tuple[str, ...] = ()

    @property
    def model_dtypes(self) -> tuple[np.dtype, ...]:
        """:func:`model_dtype` of each non-ID feature, in order (cached per signature: read
        on every merged batch)."""
        return _model_dtypes(self)

    def __hash__(self) -> int:
        # Serving keys per-signature caches by the signature on every request; hashing 16-27
        # nested specs costs ~7 us, so hash once (the fields are immutable).
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.id_features, self.non_id_features, self.label_names))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        # str hashes differ between processes (hash randomization): never carry the cache.
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    @classmethod
    def from_batch(cls, batch: Batch) -> FeatureSignature:
        # A Batch names every non-ID feature and label (positional default): no name is None.
        return cls(
            id_features=tuple(
                IdFeatureSpec(f.name, isinstance(f, IDTypeFeatureWithSingleID))
                for f in batch.id_type_features
            ),
            non_id_features=tuple(
                NonIdFeatureSpec(
                    cast(str, f.name), str(f.data.dtype), tuple(int(d) for d in f.data.shape[1:])
                )
                for f in batch.non_id_type_features
            ),
            label_names=tuple(cast(str, label.name) for label in batch.labels),
        )

    def check(self, batch: Batch) -> None:
        """Raise BatchValidationError naming the first feature that does not match.

        Order matters for both kinds: the dense model takes its embedding tensors and its
        non-ID tensors by position, and merged requests are joined column by column.
        """
        names = [f.name for f in batch.id_type_features]
        expected = [f.name for f in self.id_features]
        if names != expected:
            raise BatchValidationError(
                f"ID features {names} do not match the model's {expected} (names and order)"
            )
        for spec, feature in zip(self.id_features, batch.id_type_features):
            single_id = isinstance(feature, IDTypeFeatureWithSingleID)
            if single_id != spec.single_id:
                raise BatchValidationError(
                    f"ID feature {spec.name!r} is {_id_kind(single_id)} here; the model's is "
                    f"{_id_kind(spec.single_id)}"
                )
        # A Batch names every non-ID feature (positional default): no name is None.
        by_name = cast(
            "dict[str, NonIDTypeFeature]", {f.name: f for f in batch.non_id_type_features}
        )
        for dense_spec, target in zip(self.non_id_features, self.model_dtypes, strict=True):
            dense = by_name.get(dense_spec.name)
            if dense is None:
                raise BatchValidationError(f"non-ID feature {dense_spec.name!r} is missing")
            shape = tuple(dense.data.shape[1:])
            if shape != dense_spec.sample_shape:
                raise BatchValidationError(
                    f"non-ID feature {dense_spec.name!r} has sample shape {list(shape)}; the "
                    f"model expects {list(dense_spec.sample_shape)}"
                )
            _check_dtype(dense_spec.name, target, dense.data)
        extra = set(by_name) - {s.name for s in self.non_id_features}
        if extra:
            raise BatchValidationError(f"unknown non-ID feature(s): {sorted(extra)}")
        order = [f.name for f in batch.non_id_type_features]
        expected = [f.name for f in self.non_id_features]
        if order != expected:
            raise BatchValidationError(
                f"non-ID features come in the order {order}; the model takes them as {expected}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id_features": [{"name": f.name, "single_id": f.single_id} for f in self.id_features],
            "non_id_features": [
                {"name": f.name, "dtype": f.dtype, "sample_shape": list(f.sample_shape)}
                for f in self.non_id_features
            ],
            "label_names": list(self.label_names),
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "signature") -> FeatureSignature:
        try:
            signature = cls(
                id_features=tuple(
                    IdFeatureSpec(str(f["name"]), bool(f["single_id"])) for f in data["id_features"]
                ),
                non_id_features=tuple(
                    NonIdFeatureSpec(
                        str(f["name"]), str(f["dtype"]), tuple(int(d) for d in f["sample_shape"])
                    )
                    for f in data["non_id_features"]
                ),
                label_names=tuple(str(n) for n in data.get("label_names", ())),
            )
            for spec in signature.non_id_features:
                np.dtype(spec.dtype)
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"{source}: malformed feature signature: {error!r}") from None
        return signature


def _check_dtype(name: str, target: np.dtype, data: np.ndarray) -> None:
    """BatchValidationError unless ``data`` (the batch's array of feature ``name``) converts
    exactly to ``target``, the dtype the model takes it in: an integer feature (the model
    may index with it) takes integers of any width and whole numbers in its range, never
    3.7 (which would be cut to 3), NaN or 1e30 (arbitrary integers); a float feature takes
    any number (float64 -> float32 as in training). One dtype comparison when they match."""
    if data.dtype == target or target.kind not in "iu" or np.can_cast(data.dtype, target):
        return
    problem = describe_inexact(data, target)
    if problem is not None:
        raise BatchValidationError(
            f"non-ID feature {name!r} is an integer feature of the model ({target}), given "
            f"as {data.dtype}: {problem}"
        )


@functools.lru_cache(maxsize=64)
def _model_dtypes(signature: FeatureSignature) -> tuple[np.dtype, ...]:
    # Keyed by the signature, whose hash is cached: a hit costs one dict lookup.
    return tuple(model_dtype(spec.dtype) for spec in signature.non_id_features)
