"""``recserve eval``: score a data set with a checkpoint or a running server, write predictions
and an evaluation report, and (``--compare``) check that both paths agree before a rollout.

Pipeline, one chunk of ``--batch-size`` rows at a time (files never sit in memory whole):

1. :mod:`clients.eval_readers` reads CSV / Parquet rows with their line (row) numbers;
2. the label is parsed and the row encoded into a :class:`~embedding_store.batch.Batch` by the
   feature mapping (:class:`FeatureMapping`: a preprocessor function, or a generic column ->
   feature description); a row that fails either is a *bad row* (``file:line: reason``),
   skipped (``--bad-rows skip``) or fatal (``--bad-rows fail``, the default);
3. the batch is scored in-process (:class:`InProcessScorer`) and/or by a server
   (:class:`ServerScorer`, KServe v2 REST with binary tensors, or the friendly JSON route);
4. predictions go to a temporary file renamed into place at the end; labels and scores are
   kept (a few bytes per row) for the exact metrics of :mod:`clients.eval_report`.

Import rule: ``clients`` talks to servers over the wire only and never imports ``training``.
The one exception is the in-process path, which imports :mod:`serving.infer_ctx` lazily inside
:class:`InProcessScorer` (``InferCtx`` *is* the in-process inference API: the same TorchScript
model and embedding lookups the server runs), so ``recserve eval --url`` never loads it.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import importlib
import math
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np
import orjson

from clients import eval_report
from clients.eval_readers import RowChunk, check_data_file, iter_chunks, where_of
from embedding_store.batch import Batch, IDTypeFeature, IDTypeFeatureWithSingleID, NonIDTypeFeature
from embedding_store.cli_types import MAX_FLOAT_VALUE as MAX_TIMEOUT_SECONDS
from embedding_store.config.strict import ConfigFieldError, load_yaml, require_non_empty_str
from embedding_store.errors import (
    CapacityError,
    ConfigError,
    DeadlineExceededError,
    InvalidArgumentError,
    RecserveError,
    UnavailableError,
    error_for_http_status,
)
from embedding_store.signature import FeatureSignature, IdFeatureSpec, NonIdFeatureSpec

__all__ = [
    "EvalOptions",
    "EvalResult",
    "FeatureMapping",
    "IdFeatureMapping",
    "InProcessScorer",
    "LabelMapping",
    "NonIdFeatureMapping",
    "ServerScorer",
    "default_mapping",
    "load_mapping",
    "run_eval",
]

OUTPUT_TRANSFORMS = ("identity", "sigmoid")
PROTOCOLS = ("v2", "friendly")
EXIT_OK = 0
EXIT_PREDICTIONS_DIFFER = 3
SHOWN_BAD_ROWS = 20  # printed on stderr; all of them go to the report's bad_rows.txt
SHOWN_DIFFERENCES = 10
_HEADER_LENGTH = "Inference-Header-Content-Length"


# =========================================================================== feature mapping
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


# =========================================================================== encoders
_ROW_PREFIX = re.compile(r"^row \d+:\s*")
_ENCODE_ERRORS = (ValueError, KeyError, TypeError, ArithmeticError, IndexError, RecserveError)


def _reason(error: BaseException) -> str:
    text = error.message if isinstance(error, RecserveError) else str(error)
    if isinstance(error, KeyError):
        text = f"missing column {error.args[0]!r}" if error.args else "missing column"
    return _ROW_PREFIX.sub("", text) or type(error).__name__


def _import_function(spec: str, source: str) -> Callable[[list[dict[str, Any]]], Batch]:
    """``module:function``; modules of the current directory are importable (as for
    ``recserve serve --preprocessor``)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module_name, _, attribute = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"{source}: preprocessor: cannot import {spec!r}: {error}") from None
    if not callable(function):
        raise ConfigError(f"{source}: preprocessor: {spec!r} is not callable")
    return function


class PreprocessorEncoder:
    """Rows -> Batch with a preprocessor function. A chunk that fails is re-encoded row by row
    to find its bad rows (and their reasons); then the good rows are encoded together."""

    def __init__(self, function: Callable[[list[dict[str, Any]]], Batch]) -> None:
        self._function = function

    def _call(self, rows: list[dict[str, Any]]) -> Batch:
        batch = self._function(rows)
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
        try:
            return self._call(rows), []
        except _ENCODE_ERRORS:
            pass
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


def _int_id(value: Any, column: str) -> int:
    if isinstance(value, bool):
        raise _NotAnIntegerIDError(f"column {column!r}: {value!r} is not an integer ID")
    if isinstance(value, (int, np.integer)) or (isinstance(value, float) and value.is_integer()):
        number = int(value)
    else:
        try:
            number = int(str(value).strip())
        except ValueError:
            raise _NotAnIntegerIDError(
                f"column {column!r}: {value!r} is not an integer ID"
            ) from None
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
            try:
                number = float(value if isinstance(value, (int, float)) else str(value).strip())
            except ValueError:
                raise ValueError(f"column {column!r}: {value!r} is not a number") from None
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
                row_ids = {
                    n: self._ids(n, row[self.mapping.id_features[n].column]) for n in self.id_order
                }
                row_dense = {n: self._floats(n, row) for n in self.non_id_order}
            except (ValueError, KeyError) as error:
                bad.append((index, _reason(error)))
                continue
            for name, values in row_ids.items():
                ids[name].append(values)
            for name, values in row_dense.items():
                dense[name].append(values)
        n = len(rows) - len(bad)
        if n == 0:
            return None, bad
        id_features = []
        for name in self.id_order:
            per_row = ids[name]
            values = np.fromiter(
                (v for row in per_row for v in row), dtype=np.uint64, count=sum(map(len, per_row))
            )
            if self.single[name]:
                id_features.append(IDTypeFeatureWithSingleID(name, values))
            else:
                lengths = np.fromiter(map(len, per_row), dtype=np.int64, count=n)
                id_features.append(IDTypeFeature(name, values, lengths))
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
    for name, entry in mapping.non_id_features.items():
        spec = model_dense.get(name)
        if spec is not None and len(entry.columns) != math.prod(spec.sample_shape):
            problems.append(
                f"non_id_features.{name}.columns: the model takes {math.prod(spec.sample_shape)} "
                f"values (sample shape {list(spec.sample_shape)}), got {len(entry.columns)} "
                "columns"
            )
    if problems:
        raise ConfigError(f"{source}: " + f"; {source}: ".join(problems))


# =========================================================================== scorers
@dataclass
class Scores:
    """One chunk's scores: ``predictions`` float32 [n] (after the output transform) and
    ``raw`` (the model output before it, when known)."""

    predictions: np.ndarray
    raw: np.ndarray | None = None
    model_version: str | None = None


class InProcessScorer:
    """The checkpoint's TorchScript model and embeddings in this process, via InferCtx
    (the one lazy import of ``serving`` in ``clients``; see the module docstring)."""

    kind = "in-process"

    def __init__(self, checkpoint: str | os.PathLike[str], output_transform: str) -> None:
        import torch

        from serving.infer_ctx import InferCtx

        self._torch = torch
        self.output_transform = output_transform
        self._ctx = InferCtx(checkpoint=checkpoint)  # identity: the raw output is kept too
        model = self._ctx.model
        self.signature: FeatureSignature = model.signature
        self.version: str = model.version
        self._shards = list(getattr(model.tier, "shards", ()))
        self._start = self._counters()

    def _counters(self) -> tuple[int, int] | None:
        if not self._shards:
            return None
        stats = [shard.stats() for shard in self._shards]
        return sum(s.eval_ids_looked_up for s in stats), sum(s.misses for s in stats)

    def unknown_ids(self) -> dict[str, Any] | None:
        """IDs looked up and how many the checkpoint did not hold (default vectors)."""
        now = self._counters()
        if now is None or self._start is None:
            return None
        ids, misses = now[0] - self._start[0], now[1] - self._start[1]
        return {"ids": ids, "unknown": misses, "ratio": misses / ids if ids else None}

    def score(self, batch: Batch, rows: Sequence[Mapping[str, Any]]) -> Scores:
        self.signature.check(batch)
        raw = np.asarray(self._ctx.forward(batch), dtype=np.float32).reshape(batch.batch_size, 1)
        if self.output_transform == "sigmoid":
            # As serving.model.LoadedModel.forward does it: torch.sigmoid on float32 [n, 1].
            with self._torch.inference_mode():
                predictions = self._torch.sigmoid(self._torch.from_numpy(raw)).numpy()
        else:
            predictions = raw
        return Scores(predictions.reshape(-1).copy(), raw.reshape(-1).copy(), self.version)

    def close(self) -> None:
        self._ctx.close()


def _normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in ("http", "https"):
        raise InvalidArgumentError(f"--url must be http(s)://HOST:PORT, got {url!r}")
    return url


def signature_from_metadata(metadata: Mapping[str, Any]) -> FeatureSignature:
    """The feature signature a server reports as KServe v2 model metadata inputs."""
    try:
        inputs = list(metadata["inputs"])
        names = {entry["name"] for entry in inputs}
        ids, dense = [], []
        for entry in inputs:
            name, datatype, shape = entry["name"], entry["datatype"], list(entry["shape"])
            if name.endswith(".lengths") and name[: -len(".lengths")] in names:
                continue
            if datatype in ("INT64", "UINT64") and len(shape) == 1:
                ids.append(IdFeatureSpec(name, f"{name}.lengths" not in names))
            else:
                dense.append(NonIdFeatureSpec(name, "float32", tuple(int(d) for d in shape[1:])))
    except (KeyError, TypeError, ValueError) as error:
        raise InvalidArgumentError(f"the server's model metadata is malformed: {error!r}") from None
    return FeatureSignature(tuple(ids), tuple(dense))


class ServerScorer:
    """A running ``recserve serve`` over HTTP.

    ``protocol="v2"``: the batch encoded here is sent as KServe v2 binary tensors to
    ``/v2/models/{model}/infer`` and the float32 predictions come back as binary (exact).
    ``protocol="friendly"``: the raw rows (label column dropped) go to
    ``/v1/models/{model}:predict`` and the server's own ``--preprocessor`` encodes them, so the
    parity check covers the server's preprocessing as well.
    A batch over the server's ``--max-request-batch-size`` (a 400 whose message is "batch size
    N exceeds this server's max batch size M", as ``serving`` words it) is sent again in chunks
    of M rows, and M is kept for the batches that follow; a 413 (a body over the server's byte
    limit) is answered by halving the batch, down to one row. 503 and connection errors are
    retried a few times; a timeout is not (DeadlineExceededError).
    """

    kind = "server"

    def __init__(
        self,
        url: str,
        model: str,
        *,
        protocol: str = "v2",
        timeout: float = 60.0,
        label_column: str | None = None,
        retries: int = 3,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise InvalidArgumentError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        self.url = _normalize_url(url)
        self.model = model
        self.protocol = protocol
        self.timeout = timeout
        self.label_column = label_column
        self.retries = retries
        #: The server's max request batch size, once an over-size batch taught it.
        self.max_batch_size: int | None = None
        quoted = urllib.parse.quote(model, safe="")
        metadata = orjson.loads(self._call("GET", f"/v2/models/{quoted}")[0])
        self.signature = signature_from_metadata(metadata)
        versions = metadata.get("versions") or []
        self.version: str | None = str(versions[0]) if versions else None
        self._infer_path = f"/v2/models/{quoted}/infer"
        self._predict_path = f"/v1/models/{quoted}:predict"

    # ------------------------------------------------------------------ transport
    def _call(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[bytes, Mapping[str, str]]:
        request = urllib.request.Request(
            self.url + path, data=body, method=method, headers=dict(headers or {})
        )
        delay = 0.2
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return response.read(), response.headers
            except urllib.error.HTTPError as error:
                payload = error.read()
                try:
                    message = orjson.loads(payload).get("error") or payload.decode()
                except (orjson.JSONDecodeError, AttributeError, UnicodeDecodeError):
                    message = payload[:200].decode("utf-8", "replace")
                failure = error_for_http_status(error.code, f"server {self.url}{path}: {message}")
                limit = _batch_limit(message) if error.code == 400 else None
                if limit is not None:
                    raise _BatchTooLargeError(failure.message, limit) from None
                if error.code != 503 or attempt == self.retries:
                    raise failure from None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
                reason = getattr(error, "reason", error)
                if isinstance(reason, TimeoutError):
                    # Not retried (as RecserveClient): the server may still be working on it.
                    raise DeadlineExceededError(
                        f"server {self.url}{path} did not answer within {self.timeout} s"
                    ) from None
                if attempt == self.retries:
                    raise UnavailableError(f"cannot reach {self.url}: {reason}") from None
            time.sleep(delay)
            delay *= 2
        raise UnavailableError(f"cannot reach {self.url}")  # not reached

    # ------------------------------------------------------------------ scoring
    def score(self, batch: Batch, rows: Sequence[Mapping[str, Any]]) -> Scores:
        size = batch.batch_size
        if self.max_batch_size is not None and size > self.max_batch_size:
            return self._score_in_chunks(batch, rows, self.max_batch_size)
        try:
            if self.protocol == "friendly":
                return self._friendly(rows)
            return self._v2(batch)
        except _BatchTooLargeError as error:
            # Chunks strictly smaller than this batch: the recursion ends (each level's
            # chunks are smaller than the last, down to the server's limit or one row).
            if 1 <= error.limit < size:
                self.max_batch_size = error.limit
                return self._score_in_chunks(batch, rows, error.limit)
            if size < 2:
                raise
        except CapacityError:
            if size < 2:
                raise
        return self._score_in_chunks(batch, rows, (size + 1) // 2)

    def _score_in_chunks(
        self, batch: Batch, rows: Sequence[Mapping[str, Any]], chunk: int
    ) -> Scores:
        size = batch.batch_size
        parts = [
            self.score(
                _slice_batch(batch, start, min(start + chunk, size)), rows[start : start + chunk]
            )
            for start in range(0, size, chunk)
        ]
        return Scores(
            np.concatenate([part.predictions for part in parts]),
            None,
            parts[-1].model_version,
        )

    def _v2(self, batch: Batch) -> Scores:
        inputs, blobs = [], []

        def add(name: str, datatype: str, array: np.ndarray) -> None:
            payload = array.tobytes()
            inputs.append(
                {
                    "name": name,
                    "datatype": datatype,
                    "shape": list(array.shape),
                    "parameters": {"binary_data_size": len(payload)},
                }
            )
            blobs.append(payload)

        for feature in batch.id_type_features:
            add(feature.name, "UINT64", np.ascontiguousarray(feature.values, dtype="<u8"))
            if not isinstance(feature, IDTypeFeatureWithSingleID):
                lengths = np.ascontiguousarray(feature.lengths, dtype="<i8")
                add(feature.name + ".lengths", "INT64", lengths)
        for feature in batch.non_id_type_features:
            add(feature.name, "FP32", np.ascontiguousarray(feature.data, dtype="<f4"))
        header = orjson.dumps(
            {
                "inputs": inputs,
                "outputs": [{"name": "prediction", "parameters": {"binary_data": True}}],
            }
        )
        body, headers = self._call(
            "POST",
            self._infer_path,
            b"".join([header, *blobs]),
            {"Content-Type": "application/octet-stream", _HEADER_LENGTH: str(len(header))},
        )
        json_size = headers.get(_HEADER_LENGTH)
        document = orjson.loads(body[: int(json_size)] if json_size else body)
        output = next((o for o in document["outputs"] if o["name"] == "prediction"), None)
        if output is None:
            raise InvalidArgumentError(f"server {self.url} answered without a 'prediction'")
        size = (output.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            start = int(json_size)
            predictions = np.frombuffer(body[start : start + int(size)], dtype="<f4")
        else:
            predictions = np.asarray(output["data"], dtype=np.float32)
        return self._checked(predictions, batch.batch_size, document.get("model_version"))

    def _friendly(self, rows: Sequence[Mapping[str, Any]]) -> Scores:
        instances = [{k: v for k, v in row.items() if k != self.label_column} for row in rows]
        body, _ = self._call(
            "POST",
            self._predict_path,
            orjson.dumps({"instances": instances}),
            {"Content-Type": "application/json"},
        )
        document = orjson.loads(body)
        predictions = np.asarray(document["predictions"], dtype=np.float32)
        return self._checked(predictions, len(rows), document.get("model_version"))

    def _checked(self, predictions: np.ndarray, n: int, version: str | None) -> Scores:
        predictions = predictions.reshape(-1).astype(np.float32, copy=True)
        if predictions.shape[0] != n:
            raise InvalidArgumentError(
                f"server {self.url} returned {predictions.shape[0]} predictions for {n} rows"
            )
        if version:
            self.version = str(version)
        return Scores(predictions, None, version)

    def unknown_ids(self) -> None:
        return None

    def close(self) -> None:
        pass


class _BatchTooLargeError(InvalidArgumentError):
    """The server's 400 for a batch over its ``--max-request-batch-size`` (``limit``)."""

    def __init__(self, message: str, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


#: How ``serving`` (tensors.tensors_to_batch, service.predict_instances) words that 400.
_BATCH_LIMIT = re.compile(r"batch size (\d+) exceeds this server's max batch size (\d+)")


def _batch_limit(message: object) -> int | None:
    """M of the server's "batch size N exceeds this server's max batch size M", or None."""
    match = _BATCH_LIMIT.match(message) if isinstance(message, str) else None
    return int(match.group(2)) if match else None


def _slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    id_features = []
    for feature in batch.id_type_features:
        if isinstance(feature, IDTypeFeatureWithSingleID):
            id_features.append(IDTypeFeatureWithSingleID(feature.name, feature.values[start:stop]))
        else:
            offsets = feature.offsets
            values = feature.values[offsets[start] : offsets[stop]]
            id_features.append(IDTypeFeature(feature.name, values, feature.lengths[start:stop]))
    non_ids = [NonIDTypeFeature(f.data[start:stop], f.name) for f in batch.non_id_type_features]
    return Batch(id_features, non_ids, requires_grad=False)


# =========================================================================== output
class PredictionWriter:
    """Predictions file, CSV or Parquet by suffix, written to a temporary file and renamed
    into place by :meth:`commit` (never a partial file under the real name)."""

    def __init__(self, path: Path, columns: Sequence[str], *, overwrite: bool) -> None:
        name = path.name.lower()
        if name.endswith(".csv"):
            self.format = "csv"
        elif name.endswith((".parquet", ".pq")):
            self.format = "parquet"
        else:
            raise InvalidArgumentError(f"--out {path}: expected a .csv or .parquet file name")
        self.columns = list(columns)
        self._stack = contextlib.ExitStack()
        self._temporary = self._stack.enter_context(
            eval_report.atomic_file(path, overwrite=overwrite)
        )
        self._handle: TextIO | None = None
        self._csv = None
        self._parquet = None
        if self.format == "csv":
            # Closed by commit()/abort(): the file lives as long as the writer.
            self._handle = open(self._temporary, "w", encoding="utf-8", newline="")  # noqa: SIM115
            self._csv = csv.writer(self._handle)
            self._csv.writerow(self.columns)
        else:
            try:
                import pyarrow as pa
                import pyarrow.parquet as pq
            except ImportError:
                self._stack.close()
                raise InvalidArgumentError(
                    "writing Parquet needs pyarrow (pip install 'recserve[eval]')"
                ) from None
            self._pa = pa
            fields = [
                pa.field(c, pa.string() if c == "source" else pa.int64())
                if c in ("source", "position")
                else pa.field(c, pa.float32() if c != "label" else pa.float64())
                for c in self.columns
            ]
            self._schema = pa.schema(fields)
            self._parquet = pq.ParquetWriter(str(self._temporary), self._schema)

    def write(self, data: Mapping[str, Sequence[Any] | np.ndarray]) -> None:
        if self._csv is not None:
            text = [
                np.asarray(data[c]).astype(str) if c not in ("source", "position") else data[c]
                for c in self.columns
            ]
            self._csv.writerows(zip(*text))
        else:
            arrays = [
                self._pa.array(data[c], type=f.type) for c, f in zip(self.columns, self._schema)
            ]
            self._parquet.write_table(self._pa.Table.from_arrays(arrays, schema=self._schema))

    def _close_files(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._parquet is not None:
            self._parquet.close()
            self._parquet = None

    def commit(self) -> None:
        self._close_files()
        self._stack.close()

    def abort(self) -> None:
        self._close_files()
        self._stack.__exit__(RuntimeError, RuntimeError("aborted"), None)


class Progress:
    """``rows, rows/s`` on stderr: rewritten in place on a terminal, a line every few seconds
    otherwise."""

    def __init__(self, stream: TextIO | None = None, *, enabled: bool = True) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = 0.5 if self.tty else 5.0
        self.started = time.perf_counter()
        self.last = self.started

    def line(self, rows: int, skipped: int) -> str:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return f"eval: {rows:,} rows, {skipped:,} skipped, {rows / elapsed:,.0f} rows/s"

    def update(self, rows: int, skipped: int, *, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not final and now - self.last < self.interval:
            return
        self.last = now
        if self.tty:
            end = "\n" if final else ""
            self.stream.write("\r" + self.line(rows, skipped) + end)
        else:
            self.stream.write(self.line(rows, skipped) + "\n")
        self.stream.flush()


# =========================================================================== the command
@dataclass(frozen=True)
class EvalOptions:
    """Everything ``recserve eval`` takes (see its --help)."""

    data: tuple[Path, ...]
    out: Path
    checkpoint: Path | None = None
    url: str | None = None
    compare: bool = False
    mapping: Path | None = None
    label: str | None = None
    no_label: bool = False
    report: Path | None = None
    batch_size: int = 4096
    bad_rows: str = "fail"
    model: str = "model"
    output_transform: str = "identity"
    protocol: str = "v2"
    tolerance: float = 1e-6
    overwrite: bool = False
    timeout: float = 60.0
    calibration_bins: int = 10
    progress: bool = True

    def __post_init__(self) -> None:
        """Paths as Python callers give them: ``str`` or ``os.PathLike``, and ``data`` as one
        path or several."""
        data = self.data
        if isinstance(data, (str, os.PathLike)):
            data = (data,)
        object.__setattr__(self, "data", tuple(Path(path) for path in data))
        for name in ("out", "checkpoint", "mapping", "report"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))


@dataclass
class EvalResult:
    """What :func:`run_eval` did; ``exit_code`` is 0, or 3 when ``--compare`` found
    predictions that differ."""

    rows: int
    skipped: int
    report: dict[str, Any]
    exit_code: int = EXIT_OK
    bad_rows: list[str] = field(default_factory=list)


def _check_options(o: EvalOptions) -> None:
    if o.compare and (o.checkpoint is None or o.url is None):
        raise InvalidArgumentError("--compare needs both --checkpoint and --url")
    if not o.compare and (o.checkpoint is None) == (o.url is None):
        raise InvalidArgumentError(
            "give --checkpoint DIR (in-process) or --url URL (a server), or both with --compare"
        )
    if o.output_transform not in OUTPUT_TRANSFORMS:
        raise InvalidArgumentError(
            f"--output-transform must be one of {OUTPUT_TRANSFORMS}, got {o.output_transform!r}"
        )
    if o.bad_rows not in ("skip", "fail"):
        raise InvalidArgumentError(f"--bad-rows must be skip or fail, got {o.bad_rows!r}")
    if o.batch_size <= 0:
        raise InvalidArgumentError(f"--batch-size must be > 0, got {o.batch_size}")
    if o.calibration_bins <= 0:
        raise InvalidArgumentError(f"--calibration-bins must be > 0, got {o.calibration_bins}")
    if not (0 < o.timeout <= MAX_TIMEOUT_SECONDS):  # NaN too
        raise InvalidArgumentError(
            f"--timeout must be a number of seconds in (0, {MAX_TIMEOUT_SECONDS:.0f}], "
            f"got {o.timeout}"
        )
    if not o.data:
        raise InvalidArgumentError("--data needs at least one file")
    for path in o.data:  # before any file is scored or written
        check_data_file(path)
    eval_report.refuse_existing(o.out, overwrite=o.overwrite)
    if o.report is not None:
        eval_report.refuse_existing(o.report, overwrite=o.overwrite)
        if o.report.resolve() == o.out.resolve():
            raise InvalidArgumentError("--report and --out must differ")


def _label_of(o: EvalOptions, mapping: FeatureMapping) -> LabelMapping | None:
    if o.no_label:
        return None
    if o.label is not None:
        base = mapping.label
        if base is not None:
            return LabelMapping(o.label, base.positive, base.negative)
        return LabelMapping(o.label)
    return mapping.label


class _Parity:
    """In-process vs server predictions, chunk by chunk."""

    def __init__(self, tolerance: float) -> None:
        self.tolerance = tolerance
        self.rows = 0
        self.differing = 0
        self.max_diff = 0.0
        self.examples: list[dict[str, Any]] = []
        # Rows where one side is the sigmoid of the other: an --output-transform mismatch.
        self.server_is_sigmoid = 0
        self.local_is_sigmoid = 0

    def add(self, where: Sequence[str], local: np.ndarray, server: np.ndarray) -> np.ndarray:
        local64, server64 = local.astype(np.float64), server.astype(np.float64)
        diff = np.abs(local64 - server64)
        bad = ~(diff <= self.tolerance)  # NaN differs
        self.rows += len(diff)
        self.differing += int(bad.sum())
        with np.errstate(over="ignore"):
            sigmoid_local = 1.0 / (1.0 + np.exp(-local64))
            sigmoid_server = 1.0 / (1.0 + np.exp(-server64))
        self.server_is_sigmoid += int((np.abs(sigmoid_local - server64) <= self.tolerance).sum())
        self.local_is_sigmoid += int((np.abs(sigmoid_server - local64) <= self.tolerance).sum())
        if diff.size:
            finite = diff[np.isfinite(diff)]
            worst = float(finite.max()) if finite.size else 0.0
            if finite.size < diff.size:
                worst = math.inf
            self.max_diff = max(self.max_diff, worst)
        for i in np.flatnonzero(bad)[: max(0, SHOWN_DIFFERENCES - len(self.examples))]:
            self.examples.append(
                {
                    "where": where[i],
                    "in_process": float(local[i]),
                    "server": float(server[i]),
                    "abs_diff": float(diff[i]),
                }
            )
        return diff

    def summary(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "tolerance": self.tolerance,
            "differing_rows": self.differing,
            "max_abs_diff": self.max_diff,
            "identical": self.differing == 0,
            "first_differences": self.examples,
        }

    def text(self) -> str:
        if self.differing == 0:
            return (
                f"parity OK: {self.rows} rows, in-process and server predictions agree within "
                f"{self.tolerance:g} (max abs diff {self.max_diff:.3g})"
            )
        lines = [
            f"parity FAILED: {self.differing} of {self.rows} rows differ by more than "
            f"{self.tolerance:g} (max abs diff {self.max_diff:.6g}); first rows:"
        ]
        for e in self.examples:
            lines.append(
                f"  {e['where']}: in-process {e['in_process']:.9g}  server {e['server']:.9g}  "
                f"diff {e['abs_diff']:.3g}"
            )
        if self.differing == self.rows == self.server_is_sigmoid:
            lines.append(
                "  every server prediction is the sigmoid of the in-process one: the server "
                "runs --output-transform sigmoid; pass it to recserve eval too"
            )
        elif self.differing == self.rows == self.local_is_sigmoid:
            lines.append(
                "  every in-process prediction is the sigmoid of the server's: the server "
                "answers logits; drop --output-transform sigmoid here"
            )
        return "\n".join(lines)


def run_eval(o: EvalOptions, *, out: TextIO | None = None) -> EvalResult:
    """Run ``recserve eval``; messages on ``out`` (stdout), progress and bad rows on stderr."""
    out = out or sys.stdout
    _check_options(o)
    local = server = None
    try:
        if o.checkpoint is not None:
            local = InProcessScorer(o.checkpoint, o.output_transform)
        if o.url is not None:
            server = ServerScorer(o.url, o.model, protocol=o.protocol, timeout=o.timeout)
        signature = (local or server).signature
        if o.mapping is not None:
            mapping = load_mapping(o.mapping)
            source = os.fspath(o.mapping)
        else:
            mapping = default_mapping(signature)
            source = "the default mapping (no --mapping)"
        label = _label_of(o, mapping)
        if server is not None:
            server.label_column = label.column if label else None
        if mapping.preprocessor is not None:
            encoder = PreprocessorEncoder(_import_function(mapping.preprocessor, source))
        else:
            encoder = GenericEncoder(mapping, signature, source)
        return _evaluate(o, encoder, label, local, server, out)
    finally:
        for scorer in (local, server):
            if scorer is not None:
                scorer.close()


def _evaluate(
    o: EvalOptions,
    encoder: PreprocessorEncoder | GenericEncoder,
    label: LabelMapping | None,
    local: InProcessScorer | None,
    server: ServerScorer | None,
    out: TextIO,
) -> EvalResult:
    columns = ["source", "position"]
    if label is not None:
        columns.append("label")
    columns.append("prediction")
    if o.compare:
        columns += ["server_prediction", "abs_diff"]
    writer = PredictionWriter(o.out, columns, overwrite=o.overwrite)
    progress = Progress(enabled=o.progress)
    parity = _Parity(o.tolerance) if o.compare else None
    labels: list[np.ndarray] = []
    predictions: list[np.ndarray] = []
    raws: list[np.ndarray] = []
    bad_rows: list[str] = []
    rows = 0
    started = time.perf_counter()
    try:
        for chunk in iter_chunks(o.data, o.batch_size):
            good, positions, good_labels, bad = _prepare(chunk, label)
            batch, encode_bad = encoder.encode(good)
            if encode_bad:
                for index, reason in encode_bad:
                    where = where_of(chunk.source, chunk.kind, positions[index])
                    bad.append((positions[index], f"{where}: {reason}"))
                failed = {index for index, _ in encode_bad}
                keep = [i for i in range(len(good)) if i not in failed]
                if not keep and len(good) > 1 and rows == 0:
                    fit = (
                        "does the mapping fit the data?"
                        if o.mapping is not None
                        else "do the columns follow the default layout? see recserve eval --help"
                    )
                    raise InvalidArgumentError(
                        f"none of the first {len(good)} rows could be encoded ({fit}), "
                        f"e.g. {min(bad)[1]}"
                    )
                good = [good[i] for i in keep]
                positions = [positions[i] for i in keep]
                if label is not None:
                    good_labels = [good_labels[i] for i in keep]
            if bad:
                texts = [text for _, text in sorted(bad)]
                if o.bad_rows == "fail":
                    shown = "\n  ".join(texts[:SHOWN_BAD_ROWS])
                    more = len(texts) - SHOWN_BAD_ROWS
                    tail = f"\n  ... and {more} more" if more > 0 else ""
                    raise InvalidArgumentError(
                        f"bad rows (pass --bad-rows skip to skip them):\n  {shown}{tail}"
                    )
                for text in texts:
                    if len(bad_rows) < SHOWN_BAD_ROWS:
                        print(f"skipped {text}", file=sys.stderr)
                    bad_rows.append(text)
            if batch is None or not good:
                progress.update(rows, len(bad_rows))
                continue
            data: dict[str, Any] = {"source": [chunk.source] * len(good), "position": positions}
            if label is not None:
                data["label"] = np.asarray(good_labels, dtype=np.float64)
                labels.append(data["label"])
            primary = (local or server).score(batch, good)
            data["prediction"] = primary.predictions
            predictions.append(primary.predictions)
            raws.append(primary.raw if primary.raw is not None else primary.predictions)
            if parity is not None:
                remote = server.score(batch, good)
                data["server_prediction"] = remote.predictions
                where = [where_of(chunk.source, chunk.kind, p) for p in positions]
                data["abs_diff"] = parity.add(where, primary.predictions, remote.predictions)
            writer.write(data)
            rows += len(good)
            progress.update(rows, len(bad_rows))
        progress.update(rows, len(bad_rows), final=True)
        if rows == 0:
            raise InvalidArgumentError(
                f"no rows scored ({len(bad_rows)} bad rows) in {', '.join(map(str, o.data))}"
            )
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    seconds = time.perf_counter() - started
    if len(bad_rows) > SHOWN_BAD_ROWS:
        print(f"skipped {len(bad_rows) - SHOWN_BAD_ROWS} more bad rows", file=sys.stderr)

    all_labels = np.concatenate(labels) if label is not None else None
    all_predictions = np.concatenate(predictions)
    ranking = np.concatenate(raws)
    metric_block = eval_report.metrics(
        all_labels,
        all_predictions,
        ranking if local is not None else None,
        bins=o.calibration_bins,
    )
    report: dict[str, Any] = {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": _describe_model(o, local, server),
        "data": [os.fspath(p) for p in o.data],
        "output_transform": o.output_transform,
        "counts": {
            "rows": rows,
            "positives": _count(all_labels, positive=True),
            "negatives": _count(all_labels, positive=False),
            "skipped_rows": len(bad_rows),
        },
        **metric_block,
        "unknown_ids": local.unknown_ids() if local is not None else None,
        "seconds": seconds,
        "bad_rows": bad_rows[:100],
        "compare": parity.summary() if parity is not None else None,
    }
    exit_code = EXIT_OK
    print(
        f"scored {rows} rows in {seconds:.1f} s ({rows / max(seconds, 1e-9):,.0f} rows/s), "
        f"{len(bad_rows)} skipped; predictions: {o.out}",
        file=out,
    )
    if metric_block["auc"] is not None:
        line = f"AUC {metric_block['auc']:.6f}"
        if metric_block["log_loss"] is not None:
            line += f"  log loss {metric_block['log_loss']:.6f}"
            line += f"  ECE {metric_block['calibration']['expected_calibration_error']:.6f}"
        print(line, file=out)
    if parity is not None:
        print(parity.text(), file=out)
        if local.version != server.version:
            print(
                f"note: the checkpoint is version {local.version}, the server answered with "
                f"version {server.version}",
                file=out,
            )
        if parity.differing:
            exit_code = EXIT_PREDICTIONS_DIFFER
    if o.report is not None:
        eval_report.write_report(
            o.report,
            report,
            labels=all_labels,
            predictions=all_predictions,
            ranking_scores=ranking,
            all_bad_rows=bad_rows,
            overwrite=o.overwrite,
        )
        print(f"report: {o.report}", file=out)
    return EvalResult(rows, len(bad_rows), report, exit_code, bad_rows)


def _prepare(
    chunk: RowChunk, label: LabelMapping | None
) -> tuple[list[dict[str, Any]], list[int], list[float], list[tuple[int, str]]]:
    """Rows with a readable label, their positions and labels, and (position, text) of the
    chunk's bad rows so far."""
    bad = [(b.position, str(b)) for b in chunk.bad]
    if label is not None and chunk.rows and label.column not in chunk.columns:
        raise InvalidArgumentError(
            f"{chunk.source}: no label column {label.column!r} (columns: "
            f"{', '.join(chunk.columns)}); pass --label COL, or --no-label to score without labels"
        )
    good, positions, labels = [], [], []
    for index, row in enumerate(chunk.rows):
        if label is not None:
            try:
                labels.append(label.parse(row[label.column]))
            except ValueError as error:
                bad.append((chunk.positions[index], f"{chunk.where(index)}: {error}"))
                continue
        good.append(row)
        positions.append(chunk.positions[index])
    return good, positions, labels, bad


def _count(labels: np.ndarray | None, *, positive: bool) -> int | None:
    if labels is None:
        return None
    positives = int((labels > 0.5).sum())
    return positives if positive else int(labels.size) - positives


def _describe_model(
    o: EvalOptions, local: InProcessScorer | None, server: ServerScorer | None
) -> dict[str, Any]:
    return {
        "checkpoint": os.fspath(o.checkpoint) if o.checkpoint is not None else None,
        "checkpoint_version": local.version if local is not None else None,
        "url": server.url if server is not None else None,
        "model_name": o.model if server is not None else None,
        "server_version": server.version if server is not None else None,
        "protocol": o.protocol if server is not None else None,
    }
