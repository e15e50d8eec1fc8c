"""``recserve predict``: score a JSON-lines or CSV file of rows against a running server.

::

    recserve predict --url http://127.0.0.1:8000 --model adult --input rows.jsonl
    recserve predict --url http://127.0.0.1:8000 --model adult --input rows.csv --output out.jsonl

Rows go to the friendly route (``POST /v1/models/{name}:predict``, HTTP only) in batches of
``--batch-size`` (a batch over the server's ``--max-request-batch-size`` is sent again in
pieces of that size, and later batches in pieces from the start); the server's
``--preprocessor`` turns them into a batch, or, without one, they are keyed by feature name
(an ID, a list of IDs, a number or a list of numbers each).
JSON lines: one object per line (blank lines skipped). CSV: a header row, then one row per
line; values that look like numbers are sent as numbers, everything else as (stripped)
strings. Both UTF-8, with or without a byte order mark. Prints one JSON line per input row,
in order: ``{"prediction": p, "model_version": v}``.

The whole file is checked before anything is sent: bad lines are reported with their line
numbers (exit code 1). Server errors name the input lines of the batch that failed.
"""

from __future__ import annotations

import argparse
import codecs
import csv
import gzip
import io
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, cast

import orjson

from clients._tls import CLI_NAMES, add_tls_arguments, client_tls
from clients.codec import rows_not_feature_keyed
from embedding_store.cli_types import (
    non_empty_path,
    non_negative_int,
    positive_float,
    positive_int,
)
from embedding_store.errors import InvalidArgumentError, RecserveError

FORMATS = ("jsonl", "csv")
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv"}
_MAX_REPORTED = 20
# ASCII digits ([0-9], not \d): \d matches other scripts' digits ("\u0661\u0662"), which int()
# and float() then read as ASCII ones; such a field stays text, as recserve eval refuses it.
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:[eE][+-]?[0-9]+)?")
_INSTANCE = re.compile(r"instances\[(\d+)\]")
_ROW = re.compile(r"\brow (\d+)\b")
CSV_LAYOUT_HINT = (
    " (a CSV column is one feature, one value per row: a number, else a string. Without a "
    "--preprocessor, a feature that takes a list of IDs or of numbers needs JSON lines, e.g. "
    '{"FEATURE": [10, 11]}, and a label column is an unknown feature; recserve eval --data '
    "reads CSVs with labels, IDs separated by spaces and columns NAME_0 .. NAME_(k-1))"
)

#: (line number, row or None, error message or None)
Line = tuple[int, "dict[str, Any] | None", "str | None"]


# --------------------------------------------------------------------------- reading rows
def detect_format(path: Path, explicit: str | None) -> str:
    if explicit:
        return explicit
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    fmt = _EXTENSIONS.get(suffixes[-1]) if suffixes else None
    if fmt is None:
        raise InvalidArgumentError(
            f"{path}: cannot tell the format from the file name; pass --format jsonl or csv"
        )
    return fmt


def _open(path: Path) -> IO[bytes]:
    try:
        if path.suffix.lower() == ".gz":
            # cast: a GzipFile is a binary file, but typeshed does not declare it an IO[bytes].
            return cast(IO[bytes], gzip.open(path, "rb"))
        return open(path, "rb")
    except OSError as error:
        raise InvalidArgumentError(f"cannot read --input {path}: {error.strerror}") from None


def parse_value(text: str) -> Any:
    """A CSV field: an int or float when it looks like one, else the stripped string."""
    value = text.strip()
    if _INT.fullmatch(value):
        return int(value)
    if _FLOAT.fullmatch(value):
        return float(value)
    return value


def _jsonl_lines(stream: IO[bytes]) -> Iterator[Line]:
    for number, line in enumerate(stream, 1):
        if number == 1 and line.startswith(codecs.BOM_UTF8):
            line = line[len(codecs.BOM_UTF8) :]  # as Excel and Notepad save UTF-8
        if not line.strip():
            continue
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError as error:
            yield number, None, f"not valid JSON ({error})"
            continue
        if not isinstance(value, dict):
            yield number, None, f"expected a JSON object, got {type(value).__name__}"
            continue
        yield number, value, None


def _csv_lines(stream: IO[bytes]) -> Iterator[Line]:
    # utf-8-sig: a UTF-8 byte order mark (Excel's "CSV UTF-8") is no part of the first name.
    text = io.TextIOWrapper(stream, encoding="utf-8-sig", newline="")
    reader = csv.reader(text)
    try:
        header = [name.strip() for name in next(reader)]
    except StopIteration:
        return
    except (csv.Error, UnicodeDecodeError) as error:
        yield 1, None, f"unreadable CSV header ({error})"
        return
    if not all(header) or len(set(header)) != len(header):
        yield 1, None, "the header needs non-empty, distinct column names"
        return
    start = reader.line_num + 1
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except (csv.Error, UnicodeDecodeError) as error:
            yield start, None, f"unreadable CSV ({error})"
            return
        number, start = start, reader.line_num + 1
        if not fields or (len(fields) == 1 and not fields[0].strip()):
            continue
        if len(fields) != len(header):
            yield number, None, f"has {len(fields)} fields, the header has {len(header)}"
            continue
        yield number, {name: parse_value(field) for name, field in zip(header, fields)}, None


def iter_lines(path: Path, fmt: str) -> Iterator[Line]:
    """Every row of the file with its line number, or the problem with that line."""
    with _open(path) as stream:
        try:
            if fmt == "jsonl":
                yield from _jsonl_lines(stream)
            else:
                yield from _csv_lines(stream)
        except (OSError, EOFError) as error:
            raise InvalidArgumentError(f"cannot read --input {path}: {error}") from None


def check_file(path: Path, fmt: str) -> int:
    """Count the rows; InvalidArgumentError listing the bad lines if there are any."""
    rows = 0
    bad: list[str] = []
    for number, row, problem in iter_lines(path, fmt):
        if problem is not None:
            bad.append(f"line {number}: {problem}")
        elif row is not None:
            rows += 1
    if bad:
        shown = "\n  ".join(bad[:_MAX_REPORTED])
        more = f"\n  ... and {len(bad) - _MAX_REPORTED} more" if len(bad) > _MAX_REPORTED else ""
        noun = "line" if len(bad) == 1 else "lines"
        raise InvalidArgumentError(f"{path}: {len(bad)} bad {noun}:\n  {shown}{more}")
    if rows == 0:
        raise InvalidArgumentError(f"{path}: no rows")
    return rows


def iter_batches(
    path: Path, fmt: str, batch_size: int
) -> Iterator[tuple[list[int], list[dict[str, Any]]]]:
    numbers: list[int] = []
    rows: list[dict[str, Any]] = []
    for number, row, _problem in iter_lines(path, fmt):
        if row is None:
            continue
        numbers.append(number)
        rows.append(row)
        if len(rows) == batch_size:
            yield numbers, rows
            numbers, rows = [], []
    if rows:
        yield numbers, rows


def locate(error: RecserveError, path: Path, numbers: list[int]) -> RecserveError:
    """``error`` of a batch, its row indexes (``instances[i]``, ``row i``) annotated with the
    input line numbers."""

    def annotate(match: re.Match[str]) -> str:
        index = int(match.group(1))
        if 0 <= index < len(numbers):
            return f"{match.group(0)} (line {numbers[index]})"
        return match.group(0)

    message = _ROW.sub(annotate, _INSTANCE.sub(annotate, error.message))
    lines = f"line {numbers[0]}" if len(numbers) == 1 else f"lines {numbers[0]}-{numbers[-1]}"
    return type(error)(f"{path}: rows on {lines}: {message}")


# --------------------------------------------------------------------------- the command


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "predict",
        help="score a JSON-lines or CSV file of rows against a running server (HTTP)",
        description="Send rows from a JSON-lines or CSV file to a recserve server's friendly "
        "route in batches and print one JSON line per row: "
        '{"prediction": p, "model_version": v}.',
    )
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="server URL (default %(default)s)"
    )
    parser.add_argument("--model", default="model", help="model name (default %(default)s)")
    parser.add_argument(
        "--input", required=True, type=non_empty_path, help="rows: .jsonl or .csv (optionally .gz)"
    )
    parser.add_argument("--format", choices=FORMATS, default=None, help="override the extension")
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=256,
        help="rows per request (default 256; a batch over the server's "
        "--max-request-batch-size goes in requests of that size)",
    )
    parser.add_argument("--output", type=non_empty_path, default=None, help="write JSON lines here")
    parser.add_argument(
        "--timeout", type=positive_float, default=30.0, help="seconds per request (default 30)"
    )
    parser.add_argument(
        "--retries", type=non_negative_int, default=3, help="retries on 503 / refused (default 3)"
    )
    add_tls_arguments(parser)
    parser.set_defaults(handler=_predict)


def _predict(args: argparse.Namespace) -> int:
    from clients.client import parse_url, rows_need_http
    from clients.eval_report import atomic_file

    endpoint = parse_url(args.url, tls_names=CLI_NAMES)
    if endpoint.protocol != "http":
        raise rows_need_http(endpoint.url)
    # Checked here to name the flags; the client checks the same files again.
    client_tls(
        endpoint.tls, endpoint.url, args.tls_ca, args.tls_cert, args.tls_key, names=CLI_NAMES
    )
    if args.output is not None and args.output.resolve() == args.input.resolve():
        # --output is always replaced: it would replace the rows it is computed from.
        raise InvalidArgumentError(f"--output {args.output} is the --input file")
    fmt = detect_format(args.input, args.format)
    check_file(args.input, fmt)
    if not args.output:
        _score_rows(args, fmt, _to_stdout)
        return 0
    # Written next to --output and renamed on success: a failed run leaves the previous
    # output as it was, never a partial one.
    try:
        with atomic_file(args.output, overwrite=True) as temporary, open(temporary, "wb") as out:
            _score_rows(args, fmt, out.write)
    except OSError as error:
        raise InvalidArgumentError(f"cannot write --output {args.output}: {error}") from None
    return 0


def _to_stdout(chunk: bytes) -> None:
    sys.stdout.buffer.write(chunk)
    sys.stdout.buffer.flush()


def _score_rows(args: argparse.Namespace, fmt: str, write: Callable[[bytes], Any]) -> None:
    """Predict every row of ``args.input`` in batches; ``write`` gets one JSON line per row."""
    from clients.client import RecserveClient

    with RecserveClient(
        args.url,
        model_name=args.model,
        timeout=args.timeout,
        retries=args.retries,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    ) as client:
        limit: int | None = None  # the server's max batch size, once a refusal taught it
        for numbers, rows in iter_batches(args.input, fmt, args.batch_size):
            pending = _pieces(numbers, rows, limit)
            while pending:
                part_numbers, part = pending.pop(0)
                try:
                    result = client.predict(part)
                except InvalidArgumentError as error:
                    # A batch over the server's --max-request-batch-size: sent again in pieces
                    # of its size (as recserve eval does); it used to end the run.
                    taught = server_batch_limit(error.message)
                    if taught is not None and 1 <= taught < len(part):
                        limit = taught
                        pending[:0] = _pieces(part_numbers, part, limit)
                        continue
                    raise _located(error, args.input, part_numbers, fmt) from None
                except RecserveError as error:
                    raise _located(error, args.input, part_numbers, fmt) from None
                if len(result) != len(part):
                    raise RecserveError(
                        f"server {client.url} answered {len(result)} predictions for "
                        f"{len(part)} rows"
                    )
                write(
                    b"".join(
                        orjson.dumps(
                            {
                                "prediction": _scalar(prediction),
                                "model_version": result.model_version,
                            }
                        )
                        + b"\n"
                        for prediction in result.predictions
                    )
                )


#: How a server words the refusal of a batch over its --max-request-batch-size.
_BATCH_LIMIT = re.compile(r"batch size \d+ exceeds this server's max batch size (\d+)")


def server_batch_limit(message: str) -> int | None:
    """M of a server's "batch size N exceeds this server's max batch size M", or None."""
    match = _BATCH_LIMIT.search(message)
    return int(match.group(1)) if match else None


def _pieces(
    numbers: list[int], rows: list[dict[str, Any]], size: int | None
) -> list[tuple[list[int], list[dict[str, Any]]]]:
    """(line numbers, rows) in consecutive pieces of at most ``size`` rows (None: one)."""
    if size is None or len(rows) <= size:
        return [(numbers, rows)]
    return [(numbers[i : i + size], rows[i : i + size]) for i in range(0, len(rows), size)]


def _located(error: RecserveError, path: Path, numbers: list[int], fmt: str) -> RecserveError:
    """``error`` of the rows on lines ``numbers`` of ``path`` (:func:`locate`), with the CSV
    layout hint when the rows were not keyed by feature name."""
    located = locate(error, path, numbers)
    if fmt == "csv" and rows_not_feature_keyed(error.message):
        located = type(error)(located.message + CSV_LAYOUT_HINT)
    return located


def _scalar(prediction: Any) -> Any:
    values = prediction.tolist()
    return values[0] if isinstance(values, list) and len(values) == 1 else values
