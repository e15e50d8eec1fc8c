"""Streaming row readers for ``recserve eval``: CSV (plain or gzip) and Parquet, chunk by chunk.

A file is never held in memory: :func:`iter_chunks` yields :class:`RowChunk` objects of at most
``chunk_rows`` rows, each row a ``{column: value}`` dict (strings for CSV, Python values for
Parquet) with its position in the file, so that a bad row can be reported as ``file:line``.
Rows that cannot even be read (a CSV record with the wrong number of fields, a malformed
record) come back as :class:`BadRow` entries of the chunk instead of rows.

Formats, by file name: ``.csv``, ``.csv.gz``, ``.tsv``, ``.tsv.gz`` (UTF-8, with or without a
byte order mark; header row required) and ``.parquet`` / ``.pq`` (read with
``pyarrow.parquet.ParquetFile.iter_batches``; pyarrow is the ``recserve[eval]`` extra and
imported only for Parquet).
"""

from __future__ import annotations

import csv
import gzip
import io
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedding_store.errors import InvalidArgumentError

__all__ = ["BadRow", "RowChunk", "check_data_file", "file_format", "iter_chunks"]

CSV_SUFFIXES = (".csv", ".csv.gz", ".tsv", ".tsv.gz")
PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass(frozen=True)
class BadRow:
    """A row that was not scored: ``where`` is ``file:line`` (CSV) or ``file:row N`` (Parquet)."""

    where: str
    reason: str
    position: int = 0

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


@dataclass
class RowChunk:
    """Up to ``chunk_rows`` consecutive rows of one file.

    ``rows[i]`` sits at ``positions[i]`` (1-based line number for CSV, the line where the
    record ends; 1-based row number for Parquet). ``bad`` lists the records of this stretch of
    the file that could not be read as rows.
    """

    source: str
    columns: tuple[str, ...]
    rows: list[dict[str, Any]]
    positions: list[int]
    kind: str  # "csv" or "parquet"
    bad: list[BadRow] = field(default_factory=list)

    def where(self, index: int) -> str:
        """``file:line`` (CSV) or ``file:row N`` (Parquet) of ``rows[index]``."""
        return where_of(self.source, self.kind, self.positions[index])


def where_of(source: str, kind: str, position: int) -> str:
    return f"{source}:{position}" if kind == "csv" else f"{source}:row {position}"


def file_format(path: str | os.PathLike[str]) -> str:
    """``"csv"`` or ``"parquet"`` from the file name; InvalidArgumentError otherwise."""
    name = os.fspath(path).lower()
    if name.endswith(CSV_SUFFIXES):
        return "csv"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    raise InvalidArgumentError(
        f"{path}: unknown data format; expected a file ending in "
        f"{', '.join(CSV_SUFFIXES + PARQUET_SUFFIXES)}"
    )


def check_data_file(path: str | os.PathLike[str]) -> None:
    """InvalidArgumentError unless ``path`` is an existing file (a directory is named so)."""
    if Path(path).is_dir():
        raise InvalidArgumentError(
            f"{path}: is a directory, expected a data file "
            f"({', '.join(CSV_SUFFIXES + PARQUET_SUFFIXES)})"
        )
    if not Path(path).is_file():
        raise InvalidArgumentError(f"{path}: no such data file")


def iter_chunks(paths: Sequence[str | os.PathLike[str]], chunk_rows: int) -> Iterator[RowChunk]:
    """Every file in order, ``chunk_rows`` rows at a time (a chunk never spans two files)."""
    if chunk_rows <= 0:
        raise InvalidArgumentError(f"chunk size must be > 0, got {chunk_rows}")
    for path in paths:
        check_data_file(path)
        if file_format(path) == "csv":
            yield from _csv_chunks(path, chunk_rows)
        else:
            yield from _parquet_chunks(path, chunk_rows)


# --------------------------------------------------------------------------- CSV
def _open_text(path: str | os.PathLike[str]) -> io.TextIOBase:
    # utf-8-sig: a UTF-8 byte order mark (Excel's "CSV UTF-8") is no part of the first column
    # name (which would then be "missing"); files without one read as plain UTF-8.
    if os.fspath(path).lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")


def _csv_chunks(path: str | os.PathLike[str], chunk_rows: int) -> Iterator[RowChunk]:
    source = os.fspath(path)
    delimiter = "\t" if source.lower().endswith((".tsv", ".tsv.gz")) else ","
    # Large fields (long ID lists) are legitimate; the default limit is 128 KiB.
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    try:
        with _open_text(path) as handle:
            reader = csv.reader(handle, delimiter=delimiter)
            try:
                header = tuple(h.strip() for h in next(reader))
            except StopIteration:
                return  # an empty file has no rows
            except csv.Error as error:
                raise InvalidArgumentError(f"{source}:1: unreadable header: {error}") from None
            if len(set(header)) != len(header) or not all(header):
                raise InvalidArgumentError(
                    f"{source}:1: the header must name every column once, got {list(header)}"
                )
            width = len(header)

            def fresh() -> RowChunk:
                return RowChunk(source, header, [], [], "csv")

            chunk = fresh()
            while True:
                try:
                    record = next(reader)
                except StopIteration:
                    break
                except csv.Error as error:
                    chunk.bad.append(
                        BadRow(f"{source}:{reader.line_num}", f"bad CSV: {error}", reader.line_num)
                    )
                    continue
                if not record or (len(record) == 1 and not record[0].strip()):
                    continue  # blank line
                if len(record) != width:
                    chunk.bad.append(
                        BadRow(
                            f"{source}:{reader.line_num}",
                            f"has {len(record)} fields, the header has {width}",
                            reader.line_num,
                        )
                    )
                    continue
                chunk.rows.append(dict(zip(header, record)))
                chunk.positions.append(reader.line_num)
                if len(chunk.rows) == chunk_rows:
                    yield chunk
                    chunk = fresh()
            if chunk.rows or chunk.bad:
                yield chunk
    except UnicodeDecodeError as error:
        raise InvalidArgumentError(f"{source}: not UTF-8 text: {error.reason}") from None
    except (OSError, EOFError) as error:  # gzip raises these for truncated/corrupt files
        raise InvalidArgumentError(f"{source}: cannot read: {error}") from None


# --------------------------------------------------------------------------- Parquet
def _parquet_chunks(path: str | os.PathLike[str], chunk_rows: int) -> Iterator[RowChunk]:
    source = os.fspath(path)
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InvalidArgumentError(
            f"{source}: reading Parquet needs pyarrow (pip install 'recserve[eval]')"
        ) from None
    try:
        parquet = pq.ParquetFile(source)
    except Exception as error:  # pyarrow raises ArrowInvalid / OSError for non-Parquet bytes
        raise InvalidArgumentError(f"{source}: not a readable Parquet file: {error}") from None
    columns = tuple(parquet.schema_arrow.names)
    start = 1
    try:
        for batch in parquet.iter_batches(batch_size=chunk_rows):
            rows = batch.to_pylist()
            yield RowChunk(source, columns, rows, list(range(start, start + len(rows))), "parquet")
            start += len(rows)
    except (OSError, ValueError) as error:  # pyarrow.ArrowInvalid is a ValueError
        raise InvalidArgumentError(f"{source}: cannot read: {error}") from None
