"""What ``recserve eval`` writes as it goes: the predictions file (:class:`PredictionWriter`,
CSV or Parquet, renamed into place only when complete) and the progress line on stderr
(:class:`Progress`)."""

from __future__ import annotations

import contextlib
import csv
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from clients import eval_report
from embedding_store.errors import InvalidArgumentError

__all__ = ["PredictionWriter", "Progress"]


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
        self._handle: TextIO | None = None
        self._csv: Any = None  # csv.writer once open
        self._parquet: Any = None  # pyarrow.parquet.ParquetWriter once open
        try:
            self._open(path, overwrite=overwrite)
        except BaseException as error:
            self._close_files()
            # As an error, so the temporary file goes (a plain close would "commit" it).
            self._stack.__exit__(type(error), error, error.__traceback__)
            if not isinstance(error, OSError):
                raise
            # Named by --out and the path given: the OSError names the hidden temporary file
            # (".x.csv.tmp-<hex>"), which the user never gave and which is gone by now.
            reason = os.strerror(error.errno) if error.errno else str(error)
            raise InvalidArgumentError(f"--out {path}: cannot write there: {reason}") from error

    def _open(self, path: Path, *, overwrite: bool) -> None:
        self._temporary = self._stack.enter_context(
            eval_report.atomic_file(path, overwrite=overwrite)
        )
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
            # Not csv, so parquet: open until commit()/abort(), and nothing writes after them.
            assert self._parquet is not None
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
