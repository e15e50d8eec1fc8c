"""The feature mapping of ``recserve eval`` (``feature_mapping.yml``): how raw rows become
model inputs, and which column is the label.

A mapping (:class:`FeatureMapping`) is either a preprocessor function (``preprocessor:
MODULE:FUNCTION``, the same hook ``recserve serve --preprocessor`` takes) or a generic column ->
feature description (:class:`IdFeatureMapping`, :class:`NonIdFeatureMapping`);
:class:`LabelMapping` says which column is the label and how its values read.
:func:`load_mapping` reads the file strictly; :func:`default_mapping` is the layout used without
``--mapping``. The encoders that apply a mapping to rows are in :mod:`clients.eval_encoders`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from embedding_store.config.strict import ConfigFieldError, load_yaml, require_non_empty_str
from embedding_store.signature import FeatureSignature

__all__ = [
    "FeatureMapping",
    "IdFeatureMapping",
    "LabelMapping",
    "NonIdFeatureMapping",
    "default_mapping",
    "load_mapping",
]


def _as_tuple(value: str | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _label_key(value: str) -> str:
    return value.strip().removesuffix(".").strip()


def _check_label_values(key: str, values: str | list[str] | None) -> None:
    """``positive`` / ``negative``: None, or a non-empty string or list of non-empty strings.

    An empty list or value would silently label every row 0 (nothing compares equal to it,
    or every blank label would), so both are configuration errors.
    """
    if values is None:
        return
    if isinstance(values, str):
        items: list[tuple[str, Any]] = [(key, values)]
    else:
        if not values:
            raise ConfigFieldError(key, f"expected a non-empty list of label values, got {values}")
        items = [(f"{key}[{i}]", value) for i, value in enumerate(values)]
    for where, value in items:
        if not isinstance(value, str) or not _label_key(value):
            raise ConfigFieldError(
                where,
                f"expected a non-empty label value (compared after stripping spaces and one "
                f"trailing dot), got {value!r}",
            )


@dataclass(frozen=True)
class LabelMapping:
    """Which column is the label and how its values read.

    ``positive`` (a string or a list): values that mean 1; ``negative``: values that mean 0
    (when given, any other value is a bad row; when not, every non-positive value is 0).
    Values are compared after stripping spaces and one trailing dot (``>50K.`` is ``>50K``).
    Without ``positive`` the label must be a number (0/1 or a probability).
    """

    column: str
    positive: str | list[str] | None = None
    negative: str | list[str] | None = None

    def __post_init__(self) -> None:
        require_non_empty_str("column", self.column)
        for key in ("positive", "negative"):
            _check_label_values(key, getattr(self, key))
        if self.negative is not None and self.positive is None:
            raise ConfigFieldError("negative", "needs 'positive' as well")
        both = {_label_key(v) for v in _as_tuple(self.positive)} & {
            _label_key(v) for v in _as_tuple(self.negative)
        }
        if both:
            raise ConfigFieldError("negative", f"values {sorted(both)} are also positive")

    def parse(self, value: Any) -> float:
        """The label of one raw value; ValueError naming the column and the value."""
        if value is None:
            raise ValueError(f"label column {self.column!r} is empty (null)")
        if self.positive is not None:
            key = _label_key(str(value))
            if key in {_label_key(v) for v in _as_tuple(self.positive)}:
                return 1.0
            negatives = {_label_key(v) for v in _as_tuple(self.negative)}
            if not negatives or key in negatives:
                return 0.0
            allowed = [*_as_tuple(self.positive), *_as_tuple(self.negative)]
            raise ValueError(
                f"label column {self.column!r}: {value!r} is none of {', '.join(allowed)}"
            )
        if isinstance(value, bool):
            return float(value)
        try:
            label = float(str(value).strip())
        except ValueError:
            raise ValueError(f"label column {self.column!r}: {value!r} is not a number") from None
        if not 0.0 <= label <= 1.0:
            raise ValueError(f"label column {self.column!r}: {value!r} is not in [0, 1]")
        return label


@dataclass(frozen=True)
class IdFeatureMapping:
    """An ID feature read from one column.

    ``hash``: ``blake2b64`` (the 8-byte BLAKE2b digest, little-endian, of the value's text with
    surrounding spaces stripped: what ``examples.adult_income.features.stable_id`` computes)
    or ``int`` (the value is the ID, an integer in [0, 2**64)). ``separator``: the column holds
    several IDs per row separated by it (a Parquet list column needs no separator); without it
    the feature has exactly one ID per row.
    """

    column: str
    hash: Literal["blake2b64", "int"] = "blake2b64"
    separator: str | None = None

    def __post_init__(self) -> None:
        require_non_empty_str("column", self.column)
        if self.separator is not None and self.separator == "":
            raise ConfigFieldError("separator", "must not be empty")


@dataclass(frozen=True)
class NonIdFeatureMapping:
    """A non-ID (dense) feature: float32 [batch, len(columns)], optionally standardized as
    ``(value - mean[i]) / std[i]``."""

    columns: list[str]
    mean: list[float] | None = None
    std: list[float] | None = None

    def __post_init__(self) -> None:
        if not self.columns:
            raise ConfigFieldError("columns", "expected at least one column, got []")
        for i, column in enumerate(self.columns):
            require_non_empty_str(f"columns[{i}]", column)
        for key in ("mean", "std"):
            values = getattr(self, key)
            if values is not None and len(values) != len(self.columns):
                raise ConfigFieldError(
                    key, f"expected {len(self.columns)} numbers (one per column), got {values}"
                )
        for i, value in enumerate(self.mean or ()):
            if not math.isfinite(value):
                raise ConfigFieldError(f"mean[{i}]", f"expected a finite number, got {value}")
        for i, value in enumerate(self.std or ()):
            if not (value > 0 and math.isfinite(value)):
                raise ConfigFieldError(f"std[{i}]", f"expected a finite number > 0, got {value}")


@dataclass(frozen=True)
class FeatureMapping:
    """``feature_mapping.yml``: how raw rows become model inputs, and which column is the label.

    Either ``preprocessor: MODULE:FUNCTION`` (called with a list of row dicts, returns a
    Batch; the same hook ``recserve serve --preprocessor`` takes) or ``id_features`` /
    ``non_id_features`` (see :class:`IdFeatureMapping`, :class:`NonIdFeatureMapping`).
    """

    preprocessor: str | None = None
    id_features: dict[str, IdFeatureMapping] = field(default_factory=dict)
    non_id_features: dict[str, NonIdFeatureMapping] = field(default_factory=dict)
    label: LabelMapping | None = None

    def __post_init__(self) -> None:
        if self.preprocessor is not None:
            module, _, function = self.preprocessor.partition(":")
            if not module.strip() or not function.strip():
                raise ConfigFieldError(
                    "preprocessor", f"expected MODULE:FUNCTION, got {self.preprocessor!r}"
                )
            if self.id_features or self.non_id_features:
                raise ConfigFieldError(
                    "preprocessor",
                    "give either a preprocessor or id_features/non_id_features, not both",
                )
        elif not self.id_features and not self.non_id_features:
            raise ConfigFieldError(
                "", "expected a 'preprocessor' or at least one of id_features / non_id_features"
            )


def load_mapping(path: str | os.PathLike[str]) -> FeatureMapping:
    """Read ``feature_mapping.yml`` strictly (ConfigError names file, key and value)."""
    return load_yaml(FeatureMapping, path)


def default_mapping(signature: FeatureSignature) -> FeatureMapping:
    """The mapping used without ``--mapping``: ID feature ``s`` from column ``s`` (integer IDs,
    several separated by spaces for a multi-ID feature), non-ID feature ``f`` of sample shape
    [k] from column ``f`` (k = 1) or columns ``f_0 .. f_{k-1}``."""
    ids = {
        f.name: IdFeatureMapping(f.name, "int", None if f.single_id else " ")
        for f in signature.id_features
    }
    non_ids = {}
    for f in signature.non_id_features:
        width = math.prod(f.sample_shape)
        columns = [f.name] if width == 1 else [f"{f.name}_{i}" for i in range(width)]
        non_ids[f.name] = NonIdFeatureMapping(columns)
    return FeatureMapping(id_features=ids, non_id_features=non_ids)
