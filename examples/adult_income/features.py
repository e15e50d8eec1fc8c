"""UCI Adult rows -> recserve :class:`~embedding_store.batch.Batch` objects.

Every sample becomes

* one :class:`IDTypeFeatureWithSingleID` per slot in :data:`SLOT_NAMES`: the 8 categorical
  columns, 4 bucketized numerics (:data:`BUCKET_BOUNDARIES`) and 3 numerics whose exact value
  is an ID (:data:`VALUE_SLOTS`). An ID is :func:`stable_id` of a string (the raw value, a
  bucket number, or :func:`canonical_number` of a number), so there is no vocabulary file and
  values never seen in training still get an ID at serving time (``?`` is just another
  value);
* one :class:`NonIDTypeFeature` ``"numeric"``, float32 [batch, 6]: the numeric columns
  (``log1p`` of fnlwgt, capital-gain and capital-loss) standardized with the train-split
  constants :data:`NUMERIC_MEAN` / :data:`NUMERIC_STD`;
* with labels, one :class:`Label` ``"income"``, float32 [batch, 1]: 1.0 for ``>50K`` (a
  trailing dot, as in ``>50K.``, is accepted), 0.0 for ``<=50K``.

Files are read in chunks of rows; each chunk is encoded column by column with numpy, and
every distinct value of a chunk is hashed once.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import hashlib
import io
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embedding_store.batch import Batch, IDTypeFeatureWithSingleID, Label, NonIDTypeFeature

__all__ = [
    "BUCKET_BOUNDARIES",
    "CATEGORICAL_COLUMNS",
    "CONFIG_PATH",
    "DATA_DIR",
    "EMBEDDING_DIM",
    "LABEL_COLUMN",
    "LABEL_NAME",
    "NON_ID_FEATURE_NAME",
    "NUMERIC_COLUMNS",
    "NUMERIC_MEAN",
    "NUMERIC_STD",
    "NUM_NON_ID_FEATURES",
    "SLOT_NAMES",
    "TEST_PATH",
    "TRAIN_PATH",
    "VALUE_SLOTS",
    "EncodedRows",
    "RowError",
    "canonical_number",
    "embedding_config_mapping",
    "encode_columns",
    "iter_batches",
    "iter_encoded_chunks",
    "parse_label",
    "read_batches",
    "read_encoded",
    "rows_to_batch",
    "stable_id",
    "write_embedding_config",
]

HERE = Path(__file__).resolve().parent
DATA_DIR = HERE / "data"
TRAIN_PATH = DATA_DIR / "train.csv.gz"
TEST_PATH = DATA_DIR / "test.csv.gz"
CONFIG_PATH = HERE / "embedding_config.yml"

CATEGORICAL_COLUMNS: tuple[str, ...] = (
    "workclass",
    "education",
    "marital-status",
    "occupation",
    "relationship",
    "race",
    "gender",
    "native-country",
)
NUMERIC_COLUMNS: tuple[str, ...] = (
    "age",
    "fnlwgt",
    "educational-num",
    "capital-gain",
    "capital-loss",
    "hours-per-week",
)
LOG1P_COLUMNS: tuple[str, ...] = ("fnlwgt", "capital-gain", "capital-loss")
LABEL_COLUMN = "income"
LABEL_NAME = "income"
NON_ID_FEATURE_NAME = "numeric"
NUM_NON_ID_FEATURES = len(NUMERIC_COLUMNS)

# Mean and (population) standard deviation of each numeric column after log1p of fnlwgt,
# capital-gain and capital-loss, computed once over the 32,561 rows of the train split.
NUMERIC_MEAN: tuple[float, ...] = (
    38.58164675532078,  # age
    11.98377801355331,  # log1p(fnlwgt)
    10.0806793403151,  # educational-num
    0.7346209104536965,  # log1p(capital-gain)
    0.35030508122367104,  # log1p(capital-loss)
    40.437455852092995,  # hours-per-week
)
NUMERIC_STD: tuple[float, ...] = (
    13.640223092304081,
    0.6307283664624641,
    2.5726808256012395,
    2.4547000452880123,
    1.5845566400724875,
    12.347239075706955,
)

# Bucketized numerics: slot -> (column, sorted boundaries). A value v falls in bucket
# ``searchsorted(boundaries, v, side="right")`` (0 .. len(boundaries)), whose ID is
# ``stable_id(str(bucket))``.
BUCKET_BOUNDARIES: dict[str, tuple[str, tuple[float, ...]]] = {
    "age_bucket": ("age", (20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70)),
    "hours_bucket": ("hours-per-week", (20, 30, 35, 40, 41, 45, 50, 55, 60, 70)),
    "capital_gain_bucket": (
        "capital-gain",
        (1, 2000, 3000, 4000, 5000, 6000, 7000, 7500, 10000, 15000, 20000, 50000),
    ),
    "capital_loss_bucket": ("capital-loss", (1, 1500, 1700, 1800, 1900, 2000, 2200, 2500)),
}
# Numeric columns whose exact value is also an ID: slot -> column. The ID is
# ``stable_id`` of the value written canonically (``"2174"`` for 2174 and 2174.0, ``repr`` of
# the float otherwise). Exact capital-gain/loss amounts are very informative (a few amounts
# occur almost only above 50K), and hashing them needs no vocabulary.
VALUE_SLOTS: dict[str, str] = {
    "education_num": "educational-num",
    "capital_gain_value": "capital-gain",
    "capital_loss_value": "capital-loss",
}

SLOT_NAMES: tuple[str, ...] = (
    *CATEGORICAL_COLUMNS,
    *BUCKET_BOUNDARIES,
    *VALUE_SLOTS,
)

# Embedding width of every slot. One width for all slots puts them in one dim group, which
# the embedding worker looks up and pools with a single fused call.
EMBEDDING_DIM: dict[str, int] = dict.fromkeys(SLOT_NAMES, 8)

_REQUIRED_COLUMNS = (*NUMERIC_COLUMNS, *CATEGORICAL_COLUMNS)


# --------------------------------------------------------------------------------------------
# hashing


def stable_id(value: str) -> int:
    """The 64-bit ID of a feature value: BLAKE2b (8-byte digest) of its UTF-8, little-endian.

    Stable across processes, machines and Python versions (unlike ``hash``).
    """
    digest = hashlib.blake2b(value.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _hash_strings(values: Sequence[str]) -> np.ndarray:
    """uint64 [n]: :func:`stable_id` of each string, hashing every distinct string once."""
    cache = {v: stable_id(v) for v in dict.fromkeys(values)}
    return np.fromiter(map(cache.__getitem__, values), dtype=np.uint64, count=len(values))


def canonical_number(value: float) -> str:
    """How a numeric value is written before hashing: ``"40"`` for 40.0, else ``repr``."""
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)


def _hash_numbers(values: np.ndarray) -> np.ndarray:
    """uint64 [n]: :func:`stable_id` of :func:`canonical_number` of each value (float64 [n]),
    hashing every distinct value once."""
    unique, inverse = np.unique(values, return_inverse=True)
    hashed = np.array([stable_id(canonical_number(v)) for v in unique.tolist()], dtype=np.uint64)
    return hashed[inverse.reshape(-1)]


_BUCKET_IDS: dict[str, np.ndarray] = {
    slot: np.array([stable_id(str(b)) for b in range(len(bounds) + 1)], dtype=np.uint64)
    for slot, (_, bounds) in BUCKET_BOUNDARIES.items()
}
_BOUNDS: dict[str, np.ndarray] = {
    slot: np.asarray(bounds, dtype=np.float64) for slot, (_, bounds) in BUCKET_BOUNDARIES.items()
}


# --------------------------------------------------------------------------------------------
# embedding config


def embedding_config_mapping() -> dict[str, Any]:
    """The content of ``embedding_config.yml``: one summed single-ID slot per :data:`SLOT_NAMES`."""
    return {
        "feature_index_prefix_bit": 8,
        "slots_config": {
            name: {"dim": EMBEDDING_DIM[name], "embedding_summation": True, "sqrt_scaling": False}
            for name in SLOT_NAMES
        },
        "feature_groups": {},
    }


def write_embedding_config(path: str | os.PathLike[str] = CONFIG_PATH) -> None:
    """Write :func:`embedding_config_mapping` as YAML (with a header comment) to ``path``."""
    from embedding_store.config.strict import dump_yaml

    header = (
        "# embedding_config.yml of the UCI Adult example. Generated by\n"
        "#   python -m examples.adult_income.features\n"
        "# from examples/adult_income/features.py; edit that file, not this one.\n"
    )
    body = dump_yaml(embedding_config_mapping(), sort_keys=False, default_flow_style=False)
    Path(path).write_text(header + body, encoding="utf-8")


# --------------------------------------------------------------------------------------------
# encoding


def _frozen(arr: np.ndarray) -> np.ndarray:
    """``arr``, marked read-only so that a :class:`Batch` shares it instead of copying."""
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True)
class EncodedRows:
    """Encoded samples, column-wise: what a :class:`Batch` is built from.

    ``ids`` maps every slot of :data:`SLOT_NAMES` to uint64 [n]; ``numeric`` is float32
    [n, NUM_NON_ID_FEATURES]; ``labels`` float32 [n, 1] or None.
    """

    ids: dict[str, np.ndarray]
    numeric: np.ndarray
    labels: np.ndarray | None

    def __len__(self) -> int:
        return int(self.numeric.shape[0])

    def take(self, index: np.ndarray | slice) -> EncodedRows:
        """The rows selected by ``index`` (an integer array or a slice)."""
        return EncodedRows(
            ids={name: _frozen(ids[index]) for name, ids in self.ids.items()},
            numeric=_frozen(self.numeric[index]),
            labels=None if self.labels is None else _frozen(self.labels[index]),
        )

    @staticmethod
    def concat(parts: Sequence[EncodedRows]) -> EncodedRows:
        """All rows of ``parts``, in order (at least one part)."""
        if not parts:
            raise ValueError("EncodedRows.concat needs at least one part")
        has_labels = parts[0].labels is not None
        if any((p.labels is not None) != has_labels for p in parts):
            raise ValueError("cannot concatenate rows with and without labels")
        return EncodedRows(
            ids={
                name: _frozen(np.concatenate([p.ids[name] for p in parts])) for name in SLOT_NAMES
            },
            numeric=_frozen(np.concatenate([p.numeric for p in parts])),
            labels=_frozen(np.concatenate([p.labels for p in parts])) if has_labels else None,
        )

    def to_batch(self, *, requires_grad: bool = True, batch_id: int | None = None) -> Batch:
        """A :class:`Batch` of these rows (``requires_grad=True`` needs labels)."""
        id_features = [IDTypeFeatureWithSingleID(name, self.ids[name]) for name in SLOT_NAMES]
        labels = [] if self.labels is None else [Label(self.labels, LABEL_NAME)]
        return Batch(
            id_features,
            [NonIDTypeFeature(self.numeric, NON_ID_FEATURE_NAME)],
            labels,
            requires_grad=requires_grad,
            batch_id=batch_id,
        )


def parse_label(value: str) -> float:
    """1.0 for ``>50K``, 0.0 for ``<=50K``; surrounding spaces and a trailing dot are ignored."""
    text = str(value).strip().removesuffix(".")
    if text == ">50K":
        return 1.0
    if text == "<=50K":
        return 0.0
    raise ValueError(
        f"income label must be '>50K' or '<=50K' (optionally with a dot), got {value!r}"
    )


class RowError(ValueError):
    """A value of one row is refused: ``row`` is its index in the encoded rows (0-based),
    ``reason`` what is wrong; the message is ``row {row}: {reason}``. A file reader turns the
    index into the file's line."""

    def __init__(self, row: int, reason: str) -> None:
        super().__init__(f"row {row}: {reason}")
        self.row = row
        self.reason = reason


def _labels(values: Sequence[str]) -> np.ndarray:
    cache = {}
    for i, value in enumerate(values):
        if value not in cache:
            try:
                cache[value] = parse_label(value)
            except ValueError as error:
                raise RowError(i, str(error)) from None
    out = np.fromiter(map(cache.__getitem__, values), dtype=np.float32, count=len(values))
    return out.reshape(-1, 1)


def _floats(column: str, values: Sequence[Any]) -> np.ndarray:
    texts = [str(v) for v in values]
    for i, (value, text) in enumerate(zip(values, texts)):
        # float() would read True as 1 and "1_000" as 1000: neither is a number in a row.
        if isinstance(value, bool) or "_" in text:
            raise RowError(i, f"column {column!r} must be a number, got {value!r}")
    with contextlib.suppress(ValueError):  # every text a number: the whole column at once
        return np.asarray(texts).astype(np.float64)
    for i, (value, text) in enumerate(zip(values, texts)):  # the error path: which row
        try:
            float(text)
        except ValueError:
            raise RowError(i, f"column {column!r}: not a number, got {value!r}") from None
    raise ValueError(f"column {column!r}: not a number")  # numpy refused what float() took


def _strings(column: str, values: Sequence[Any]) -> list[str]:
    """The stripped values of categorical ``column``; each must be a string (a JSON null,
    number or list would otherwise be hashed as its ``str()``, silently another category)."""
    if not all(type(v) is str for v in values):
        i, value = next((i, v) for i, v in enumerate(values) if type(v) is not str)
        raise RowError(i, f"column {column!r} must be a string, got {value!r}")
    return [v.strip() for v in values]


def encode_columns(
    columns: Mapping[str, Sequence[Any]], *, with_labels: bool = True
) -> EncodedRows:
    """Encode one chunk given column-wise: column name -> values (strings, or numbers for the
    numeric columns). Needs every column of :data:`CATEGORICAL_COLUMNS` and
    :data:`NUMERIC_COLUMNS`, and ``income`` when ``with_labels``; other columns are ignored.
    """
    needed = (*_REQUIRED_COLUMNS, LABEL_COLUMN) if with_labels else _REQUIRED_COLUMNS
    missing = [c for c in needed if c not in columns]
    if missing:
        raise ValueError(f"missing column(s) {', '.join(missing)}")
    n = len(columns[NUMERIC_COLUMNS[0]])
    for c in needed:
        if len(columns[c]) != n:
            raise ValueError(f"column {c!r} has {len(columns[c])} values, expected {n}")
    if n == 0:
        raise ValueError("no rows to encode")

    raw = {c: _floats(c, columns[c]) for c in NUMERIC_COLUMNS}
    with np.errstate(invalid="ignore", divide="ignore"):
        numeric = np.stack(
            [np.log1p(raw[c]) if c in LOG1P_COLUMNS else raw[c] for c in NUMERIC_COLUMNS], axis=1
        )
    bad = ~np.isfinite(numeric)
    if bad.any():
        i, j = (int(k) for k in np.argwhere(bad)[0])
        column = NUMERIC_COLUMNS[j]
        need = " >= 0" if column in LOG1P_COLUMNS else ""
        got = float(raw[column][i])
        raise RowError(i, f"column {column!r} must be a finite number{need}, got {got!r}")
    with np.errstate(over="ignore"):
        numeric = ((numeric - np.asarray(NUMERIC_MEAN)) / np.asarray(NUMERIC_STD)).astype(
            np.float32
        )
    bad = ~np.isfinite(numeric)
    if bad.any():  # finite in float64, beyond float32 once standardized (e.g. age 1e39)
        i, j = (int(k) for k in np.argwhere(bad)[0])
        column = NUMERIC_COLUMNS[j]
        got = float(raw[column][i])
        raise RowError(i, f"column {column!r} is out of range, got {got!r}")

    ids: dict[str, np.ndarray] = {
        c: _hash_strings(_strings(c, columns[c])) for c in CATEGORICAL_COLUMNS
    }
    for slot, (column, _) in BUCKET_BOUNDARIES.items():
        bucket = np.searchsorted(_BOUNDS[slot], raw[column], side="right")
        ids[slot] = _BUCKET_IDS[slot][bucket]
    for slot, column in VALUE_SLOTS.items():
        ids[slot] = _hash_numbers(raw[column])

    labels = _labels(columns[LABEL_COLUMN]) if with_labels else None
    return EncodedRows(
        ids={name: _frozen(ids[name]) for name in SLOT_NAMES},
        numeric=_frozen(numeric),
        labels=None if labels is None else _frozen(labels),
    )


def rows_to_batch(
    rows: Sequence[Mapping[str, Any]],
    *,
    with_labels: bool = True,
    requires_grad: bool | None = None,
) -> Batch:
    """A :class:`Batch` from row dicts (column name -> value, e.g. parsed JSON).

    With ``with_labels`` every row needs ``income`` and the batch gets the ``income`` label.
    ``requires_grad`` defaults to ``with_labels`` (a training batch needs labels).
    """
    if not rows:
        raise ValueError("rows_to_batch needs at least one row")
    needed = (*_REQUIRED_COLUMNS, LABEL_COLUMN) if with_labels else _REQUIRED_COLUMNS
    columns: dict[str, list[Any]] = {}
    for c in needed:
        try:
            columns[c] = [row[c] for row in rows]
        except KeyError:
            i = next(i for i, row in enumerate(rows) if c not in row)
            raise ValueError(f"row {i} has no column {c!r}") from None
    encoded = encode_columns(columns, with_labels=with_labels)
    return encoded.to_batch(requires_grad=with_labels if requires_grad is None else requires_grad)


# --------------------------------------------------------------------------------------------
# files


def _open_text(path: str | os.PathLike[str]) -> io.TextIOBase:
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    # utf-8-sig: a byte order mark (Excel's "CSV UTF-8") is no part of the first column's
    # name ("header lacks column(s) age" otherwise), as recserve eval reads it too
    return open(path, encoding="utf-8-sig", newline="")


def iter_encoded_chunks(
    path: str | os.PathLike[str], *, chunk_rows: int = 8192, with_labels: bool = True
) -> Iterator[EncodedRows]:
    """Encode a CSV (``.gz`` or plain, with a header row) ``chunk_rows`` rows at a time."""
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be > 0, got {chunk_rows}")
    with _open_text(path) as f:
        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            return
        index = {name: i for i, name in enumerate(header)}
        needed = (*_REQUIRED_COLUMNS, LABEL_COLUMN) if with_labels else _REQUIRED_COLUMNS
        missing = [c for c in needed if c not in index]
        if missing:
            raise ValueError(f"{path}: header lacks column(s) {', '.join(missing)}")
        chunk: list[list[str]] = []
        lines: list[int] = []  # the file line each row of the chunk ends on (1-based)

        def encode(rows: list[list[str]]) -> EncodedRows:
            cols = list(zip(*rows))
            try:
                return encode_columns({c: cols[index[c]] for c in needed}, with_labels=with_labels)
            except RowError as error:  # its row index is the chunk's: name the file's line
                raise ValueError(f"{path}: line {lines[error.row]}: {error.reason}") from None

        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue  # blank line
            if len(row) != len(header):
                # Checked as each row is read: the reader's line is this row's.
                raise ValueError(
                    f"{path}: line {reader.line_num}: a row has {len(row)} fields, "
                    f"expected {len(header)}"
                )
            chunk.append(row)
            lines.append(reader.line_num)
            if len(chunk) == chunk_rows:
                yield encode(chunk)
                chunk, lines = [], []
        if chunk:
            yield encode(chunk)


def read_encoded(path: str | os.PathLike[str], *, with_labels: bool = True) -> EncodedRows:
    """Every row of a CSV file, encoded."""
    parts = list(iter_encoded_chunks(path, with_labels=with_labels))
    if not parts:
        raise ValueError(f"{path}: no rows")
    return EncodedRows.concat(parts)


def iter_batches(
    encoded: EncodedRows,
    batch_size: int,
    *,
    shuffle_seed: int | None = None,
    requires_grad: bool = True,
) -> Iterator[Batch]:
    """Split ``encoded`` into batches of ``batch_size`` rows (the last one may be smaller),
    in file order or, with ``shuffle_seed``, in a permutation drawn from that seed."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    n = len(encoded)
    order = None if shuffle_seed is None else np.random.default_rng(shuffle_seed).permutation(n)
    for start in range(0, n, batch_size):
        index = (
            slice(start, start + batch_size) if order is None else order[start : start + batch_size]
        )
        yield encoded.take(index).to_batch(requires_grad=requires_grad)


def read_batches(
    path: str | os.PathLike[str],
    batch_size: int,
    *,
    shuffle_seed: int | None = None,
    requires_grad: bool = True,
) -> Iterator[Batch]:
    """Batches of ``batch_size`` rows (the last may be smaller) from a labelled Adult CSV.

    Without ``shuffle_seed`` the file is streamed in chunks, in file order. With it, the whole
    file is encoded (in chunks) and the rows are permuted with ``shuffle_seed``.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if shuffle_seed is not None:
        yield from iter_batches(
            read_encoded(path), batch_size, shuffle_seed=shuffle_seed, requires_grad=requires_grad
        )
        return
    pending: list[EncodedRows] = []
    held = 0
    chunk_rows = max(batch_size, 8192)
    for chunk in iter_encoded_chunks(path, chunk_rows=chunk_rows):
        pending.append(chunk)
        held += len(chunk)
        if held < batch_size:
            continue
        rows = EncodedRows.concat(pending)
        full = held - held % batch_size
        yield from iter_batches(rows.take(slice(0, full)), batch_size, requires_grad=requires_grad)
        pending = [rows.take(slice(full, held))] if full < held else []
        held -= full
    if held:
        yield EncodedRows.concat(pending).to_batch(requires_grad=requires_grad)


if __name__ == "__main__":
    write_embedding_config()
    print(f"wrote {CONFIG_PATH}")
