"""Row encoders of ``recserve eval``: rows (``{column: value}`` dicts) -> a
:class:`~embedding_store.batch.Batch`, by a feature mapping (:mod:`clients.eval_mapping`).

:class:`PreprocessorEncoder` calls the mapping's preprocessor function; :class:`GenericEncoder`
follows its ``id_features`` / ``non_id_features`` (IDs hashed with :func:`stable_id` or read as
integers, dense values checked and standardized). Both return the batch of the rows that
encoded and, for every row that did not, its index and the reason: a *bad row*.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from clients.eval_mapping import FeatureMapping
from embedding_store.batch import (
    Batch,
    IDFeature,
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    NonIDTypeFeature,
)
from embedding_store.errors import (
    PREPROCESSOR_INPUT_ERRORS,
    ConfigError,
    InvalidArgumentError,
    RecserveError,
    summary_with_origin,
)
from embedding_store.signature import FeatureSignature

__all__ = ["GenericEncoder", "PreprocessorEncoder", "import_function", "stable_id"]

_ROW_PREFIX = re.compile(r"^row \d+:\s*")
#: A row's own fault: what the generic encoder raises for it, and what a preprocessor raises
#: on rows that do not fit it (``recserve serve`` answers a 400 for the same).
_ENCODE_ERRORS: tuple[type[Exception], ...] = (*PREPROCESSOR_INPUT_ERRORS, RecserveError)


def _reason(error: BaseException) -> str:
    text = error.message if isinstance(error, RecserveError) else str(error)
    if isinstance(error, KeyError):
        text = f"missing column {error.args[0]!r}" if error.args else "missing column"
    return _ROW_PREFIX.sub("", text) or type(error).__name__


def import_function(spec: str, source: str) -> Callable[[list[dict[str, Any]]], Batch]:
    """``module:function``; modules of the current directory are importable (as for
    ``recserve serve --preprocessor``)."""
    if os.getcwd() not in sys.path:
        # After installed modules, as for serve: a module planted in a folder others can
        # write to shadows none of them.
        sys.path.append(os.getcwd())
    module_name, _, attribute = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"{source}: preprocessor: cannot import {spec!r}: {error}") from None
    except Exception as error:
        # The module raised on import (its SyntaxError, NameError...): a bare traceback that
        # named neither the mapping nor the spec otherwise.
        raise ConfigError(
            f"{source}: preprocessor: cannot import {spec!r}: importing {module_name!r} raised "
            f"{summary_with_origin(error)}"
        ) from None
    if not callable(function):
        raise ConfigError(f"{source}: preprocessor: {spec!r} is not callable")
    return function


class _PreprocessorFailedError(ValueError):
    """The preprocessor function raised ``error`` (its reason: :func:`_preprocessor_reason`)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(_preprocessor_reason(error))


def _preprocessor_reason(error: BaseException) -> str:
    """A bad row's reason for an error the preprocessor raised: said to be its, with the
    error's type, so that it is not read as recserve's own complaint. A KeyError is most
    often a row without the column the function reads: named so."""
    kind = type(error).__name__
    if isinstance(error, KeyError) and error.args:
        return f"missing column {error.args[0]!r} (the preprocessor raised {kind})"
    text = _reason(error)
    return f"the preprocessor raised {kind}" + ("" if text == kind else f": {text}")


class PreprocessorEncoder:
    """Rows -> Batch with a preprocessor function. A chunk that fails is re-encoded row by row
    to find its bad rows (and their reasons); then the good rows are encoded together."""

    def __init__(self, function: Callable[[list[dict[str, Any]]], Batch]) -> None:
        self._function = function

    def _call(self, rows: list[dict[str, Any]]) -> Batch:
        try:
            batch = self._function(rows)
        except _ENCODE_ERRORS as error:
            raise _PreprocessorFailedError(error) from error
        if not isinstance(batch, Batch):
            raise InvalidArgumentError(
                f"the preprocessor returned {type(batch).__name__}, not a Batch"
            )
        if batch.batch_size != len(rows):
            raise InvalidArgumentError(
                f"the preprocessor returned {batch.batch_size} samples for {len(rows)} rows"
            )
        return batch

    def encode(self, rows: list[dict[str, Any]]) -> tuple[Batch | None, list[tuple[int, str]]]:
        if not rows:
            return None, []
        # A bad row fails the whole chunk: then encode the rows one by one to name each.
        with contextlib.suppress(*_ENCODE_ERRORS):
            return self._call(rows), []
        bad: list[tuple[int, str]] = []
        good: list[dict[str, Any]] = []
        for index, row in enumerate(rows):
            try:
                self._call([row])
                good.append(row)
            except _ENCODE_ERRORS as error:
                bad.append((index, _reason(error)))
        return (self._call(good) if good else None), bad


def stable_id(text: str) -> int:
    """BLAKE2b, 8-byte digest, of ``text`` in UTF-8, read little-endian."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


class _NotAnIntegerIDError(ValueError):
    """A value of an ``int`` ID column that is not an integer at all (not one out of range)."""


#: An integer ID as text: ASCII digits, optionally followed by a point and zeros (a whole
#: float as pandas writes it, "7.0"), read exactly. Not int()'s wider syntax: it took "1_23"
#: and "12_3" both for ID 123, and other scripts' digits ("١٢") for ASCII ones.
_INT_TEXT = re.compile(r"([+-]?[0-9]+)(?:\.0*)?")


#: A number as text: ASCII digits, a point, an exponent (and inf/nan, refused later as not
#: finite, with that reason). Not float()'s wider syntax, as for :data:`_INT_TEXT`: it read
#: "1_0" as 10 and other scripts' digits ("١٢") as ASCII ones.
_FLOAT_TEXT = re.compile(
    r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|infinity|nan)", re.IGNORECASE
)


def _int_id(value: Any, column: str) -> int:
    if isinstance(value, bool):
        raise _NotAnIntegerIDError(f"column {column!r}: {value!r} is not an integer ID")
    if isinstance(value, (int, np.integer)) or (isinstance(value, float) and value.is_integer()):
        number = int(value)
    else:
        match = _INT_TEXT.fullmatch(str(value).strip())
        if match is None:
            raise _NotAnIntegerIDError(f"column {column!r}: {value!r} is not an integer ID")
        number = int(match.group(1))
    if not 0 <= number < 2**64:
        raise ValueError(f"column {column!r}: ID {number} is outside [0, 2**64)")
    return number


def _separated_by(separator: str) -> str:
    """How a multi-ID column reads, for error messages: "spaces, e.g. '71 282 62'"."""
    example = separator.join(("71", "282", "62"))
    if separator == " ":
        return f"spaces, e.g. {example!r}"
    return f"{separator!r}, e.g. {example!r}"


def _missing_dense_column(
    name: str, columns: Sequence[str], missing: str, row: Mapping[str, Any]
) -> str:
    """The reason for a row without one of non-ID feature ``name``'s columns: which columns
    the feature is read from, and a hint when the data has one column named like the feature
    (its values written into one cell, e.g. "[0.1, 0.2]")."""
    if len(columns) == 1:
        reason = f"missing column {missing!r} (non-ID feature {name!r} is read from it)"
    else:
        listed = ", ".join(repr(c) for c in columns)
        reason = (
            f"missing column {missing!r}: non-ID feature {name!r} takes {len(columns)} values "
            f"per row, one per column: {listed}"
        )
    if name in row and name not in columns:
        reason += f" (the data has a column {name!r}: write each of its values to its own column)"
    return reason


class GenericEncoder:
    """Rows -> Batch from ``id_features`` / ``non_id_features``, checking every value: a row
    with a missing, non-numeric or non-finite value is a bad row with that reason."""

    def __init__(
        self, mapping: FeatureMapping, signature: FeatureSignature | None, source: str
    ) -> None:
        self.mapping = mapping
        if signature is not None:
            _check_against_signature(mapping, signature, source)
            self.id_order = [f.name for f in signature.id_features]
            self.single = {f.name: f.single_id for f in signature.id_features}
            self.shapes = {f.name: f.sample_shape for f in signature.non_id_features}
            self.non_id_order = [f.name for f in signature.non_id_features]
        else:
            self.id_order = list(mapping.id_features)
            self.single = {n: m.separator is None for n, m in mapping.id_features.items()}
            self.shapes = {n: (len(m.columns),) for n, m in mapping.non_id_features.items()}
            self.non_id_order = list(mapping.non_id_features)

    def _id_cell(self, name: str, row: Mapping[str, Any]) -> Any:
        """The value of ID feature ``name``'s column in ``row``; ValueError naming the
        column and the feature when the row has no such column."""
        column = self.mapping.id_features[name].column
        if column not in row:
            raise ValueError(f"missing column {column!r} (ID feature {name!r} is read from it)")
        return row[column]

    def _ids(self, name: str, value: Any) -> list[int]:
        spec = self.mapping.id_features[name]
        if value is None:
            if self.single[name]:
                raise ValueError(f"column {spec.column!r} is empty (null)")
            return []
        if isinstance(value, (list, tuple)):
            items = list(value)
        elif spec.separator is not None:
            items = [t for t in str(value).split(spec.separator) if t.strip()]
        else:
            items = [value]
        if self.single[name] and len(items) != 1:
            raise ValueError(f"column {spec.column!r}: exactly one ID expected, got {len(items)}")
        if spec.hash != "int":
            return [stable_id(str(v).strip()) for v in items]
        if spec.separator is None or not isinstance(value, str):
            return [_int_id(v, spec.column) for v in items]
        try:
            return [_int_id(v, spec.column) for v in items]
        except _NotAnIntegerIDError:
            raise ValueError(
                f"column {spec.column!r}: {value!r} is not a list of integer IDs: expected IDs "
                f"separated by {_separated_by(spec.separator)}"
            ) from None

    def _floats(self, name: str, row: Mapping[str, Any]) -> list[float]:
        spec = self.mapping.non_id_features[name]
        out = []
        for i, column in enumerate(spec.columns):
            if column not in row:
                raise ValueError(_missing_dense_column(name, spec.columns, column, row))
            value = row[column]
            if value is None:
                raise ValueError(f"column {column!r} is empty (null)")
            if isinstance(value, (int, float)):
                number = float(value)
            else:
                text = str(value).strip()
                if _FLOAT_TEXT.fullmatch(text) is None:
                    raise ValueError(f"column {column!r}: {value!r} is not a number")
                number = float(text)
            if not math.isfinite(number):
                raise ValueError(f"column {column!r}: {value!r} is not a finite number")
            if spec.mean is not None:
                number -= spec.mean[i]
            if spec.std is not None:
                number /= spec.std[i]
            out.append(number)
        return out

    def encode(self, rows: list[dict[str, Any]]) -> tuple[Batch | None, list[tuple[int, str]]]:
        bad: list[tuple[int, str]] = []
        ids: dict[str, list[list[int]]] = {name: [] for name in self.id_order}
        dense: dict[str, list[list[float]]] = {name: [] for name in self.non_id_order}
        for index, row in enumerate(rows):
            try:
                row_ids = {n: self._ids(n, self._id_cell(n, row)) for n in self.id_order}
                row_dense = {n: self._floats(n, row) for n in self.non_id_order}
            except (ValueError, KeyError) as error:
                bad.append((index, _reason(error)))
                continue
            for name, values in row_ids.items():
                ids[name].append(values)
            for name, floats in row_dense.items():
                dense[name].append(floats)
        n = len(rows) - len(bad)
        if n == 0:
            return None, bad
        id_features: list[IDFeature] = []
        for name in self.id_order:
            per_row = ids[name]
            flat = np.fromiter(
                (v for row in per_row for v in row), dtype=np.uint64, count=sum(map(len, per_row))
            )
            if self.single[name]:
                id_features.append(IDTypeFeatureWithSingleID(name, flat))
            else:
                lengths = np.fromiter(map(len, per_row), dtype=np.int64, count=n)
                id_features.append(IDTypeFeature(name, flat, lengths))
        non_ids = [
            NonIDTypeFeature(
                np.asarray(dense[name], dtype=np.float32).reshape(n, *self.shapes[name]), name
            )
            for name in self.non_id_order
        ]
        return Batch(id_features, non_ids, requires_grad=False), bad


def _check_against_signature(
    mapping: FeatureMapping, signature: FeatureSignature, source: str
) -> None:
    """ConfigError naming the mapping file and key when it cannot feed this model."""
    model_ids = [f.name for f in signature.id_features]
    model_dense = {f.name: f for f in signature.non_id_features}
    problems = []
    missing = [n for n in model_ids if n not in mapping.id_features]
    if missing:
        problems.append(f"id_features: missing {missing} (the model's ID features: {model_ids})")
    unknown = sorted(set(mapping.id_features) - set(model_ids))
    if unknown:
        problems.append(f"id_features: {unknown} are not ID features of the model")
    for spec in signature.id_features:
        entry = mapping.id_features.get(spec.name)
        if entry is not None and spec.single_id and entry.separator is not None:
            problems.append(
                f"id_features.{spec.name}.separator: the model takes exactly one ID per row "
                f"for {spec.name!r}, got separator {entry.separator!r}"
            )
    missing = [n for n in model_dense if n not in mapping.non_id_features]
    if missing:
        problems.append(
            f"non_id_features: missing {missing} (the model's non-ID features: {list(model_dense)})"
        )
    unknown = sorted(set(mapping.non_id_features) - set(model_dense))
    if unknown:
        problems.append(f"non_id_features: {unknown} are not non-ID features of the model")
    for name, dense_entry in mapping.non_id_features.items():
        dense_spec = model_dense.get(name)
        if dense_spec is not None and len(dense_entry.columns) != math.prod(
            dense_spec.sample_shape
        ):
            problems.append(
                f"non_id_features.{name}.columns: the model takes "
                f"{math.prod(dense_spec.sample_shape)} values (sample shape "
                f"{list(dense_spec.sample_shape)}), got {len(dense_entry.columns)} columns"
            )
    if problems:
        raise ConfigError(f"{source}: " + f"; {source}: ".join(problems))
