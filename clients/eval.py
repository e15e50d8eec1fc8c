"""``recserve eval``: score a data set with a checkpoint or a running server, write predictions
and an evaluation report, and (``--compare``) check that both paths agree before a rollout.

Pipeline, one chunk of ``--batch-size`` rows at a time (files never sit in memory whole):

1. :mod:`clients.eval_readers` reads CSV / Parquet rows with their line (row) numbers;
2. the label is parsed and the row encoded into a :class:`~embedding_store.batch.Batch` by the
   feature mapping (:class:`~clients.eval_mapping.FeatureMapping`: a preprocessor function, or a
   generic column -> feature description; encoded by :mod:`clients.eval_encoders`); a row that
   fails either is a *bad row* (``file:line: reason``, the reason naming the column or
   feature), skipped (``--bad-rows skip``) or fatal (``--bad-rows fail``, the default). Every
   error about bad rows has one layout (:func:`bad_rows_message`): the file, what to do,
   then the rows; a first chunk of which no row encodes is fatal either way;
3. the batch is scored in-process (:class:`~clients.eval_scorers.InProcessScorer`) and/or by a
   server (:class:`~clients.eval_scorers.ServerScorer`, KServe v2 REST with binary tensors, or
   the friendly JSON route); with ``--compare``, :mod:`clients.eval_parity` checks that both
   agree;
4. predictions go to a temporary file renamed into place at the end
   (:mod:`clients.eval_output`); labels and scores are kept (a few bytes per row) for the exact
   metrics of :mod:`clients.eval_report`;
5. with ``--report``, the report is rendered into a staging directory, then the predictions
   and the report are moved into place: a run that fails leaves neither behind.

This module holds the options, the result and the orchestration; the in-process path loads
``serving`` lazily (see :mod:`clients.eval_scorers` for the import rule).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from clients import eval_report
from clients._tls import CLI_NAMES
from clients.eval_encoders import GenericEncoder, PreprocessorEncoder, import_function
from clients.eval_mapping import FeatureMapping, LabelMapping, default_mapping, load_mapping
from clients.eval_output import PredictionWriter, Progress
from clients.eval_parity import Parity
from clients.eval_readers import RowChunk, check_data_file, iter_chunks, where_of
from clients.eval_scorers import InProcessScorer, ServerScorer, check_server_options
from embedding_store.cli_types import MAX_FLOAT_VALUE as MAX_TIMEOUT_SECONDS
from embedding_store.errors import InvalidArgumentError

__all__ = ["EvalOptions", "EvalResult", "run_eval"]

OUTPUT_TRANSFORMS = ("identity", "sigmoid")
EXIT_OK = 0
EXIT_PREDICTIONS_DIFFER = 3
DEFAULT_TOLERANCE = 1e-6  # --compare: the largest abs difference that is no difference
SHOWN_BAD_ROWS = 20  # printed on stderr; all of them go to the report's bad_rows.txt


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
    tolerance: float = DEFAULT_TOLERANCE
    overwrite: bool = False
    timeout: float = 60.0
    calibration_bins: int = 10
    progress: bool = True
    # TLS for an https:// --url: the CA to trust, the client certificate for mutual TLS.
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    def __post_init__(self) -> None:
        """Paths as Python callers give them: ``str`` or ``os.PathLike``, and ``data`` as one
        path or several."""
        data = self.data
        paths = (data,) if isinstance(data, (str, os.PathLike)) else data
        object.__setattr__(self, "data", tuple(Path(path) for path in paths))
        for name in ("out", "checkpoint", "mapping", "report", "tls_ca", "tls_cert", "tls_key"):
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
    tls = [flag for flag, value in zip(CLI_NAMES, (o.tls_ca, o.tls_cert, o.tls_key)) if value]
    if tls and o.url is None:
        raise InvalidArgumentError(f"{', '.join(tls)} given without --url: they are for a server")
    if o.url is not None:
        # The URL and the TLS files before anything expensive: a wrong --tls-* path used to
        # be found only once the --compare checkpoint had loaded.
        check_server_options(o.url, o.tls_ca, o.tls_cert, o.tls_key)
    if o.output_transform not in OUTPUT_TRANSFORMS:
        raise InvalidArgumentError(
            f"--output-transform must be one of {OUTPUT_TRANSFORMS}, got {o.output_transform!r}"
        )
    if o.output_transform != "identity" and o.checkpoint is None:
        # The server's answers are used as they come: the flag used to be taken and ignored,
        # and the report then still said "logits? pass --output-transform sigmoid".
        raise InvalidArgumentError(
            f"--output-transform {o.output_transform} applies to in-process scoring "
            "(--checkpoint); a server's predictions come transformed by its own "
            "`recserve serve --output-transform`"
        )
    if o.tolerance != DEFAULT_TOLERANCE and not o.compare:
        # Refused, not ignored: a parity gate (exit 3 when predictions differ) written without
        # --compare passed every time, comparing nothing.
        raise InvalidArgumentError(
            f"--tolerance {o.tolerance:g} is for --compare (the parity check of --checkpoint "
            "against --url); without --compare nothing is compared"
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
    inputs = {path.resolve() for path in o.data}
    for flag, output in (("--out", o.out), ("--report", o.report)):
        # With --overwrite the output would replace the data it is computed from.
        if output is not None and output.resolve() in inputs:
            raise InvalidArgumentError(f"{flag} {output} is one of the --data files")
        # ... or the model: --report DIR/embeddings --overwrite replaced the checkpoint's
        # embeddings with the report (the checkpoint then no longer loaded).
        if (
            output is not None
            and o.checkpoint is not None
            and _checkpoint_part(o.checkpoint, output)
        ):
            raise InvalidArgumentError(
                f"{flag} {output} is the --checkpoint {o.checkpoint} or a part of it: writing "
                "it would damage the checkpoint"
            )
    eval_report.refuse_existing(o.out, overwrite=o.overwrite)
    if o.report is not None:
        eval_report.check_report_target(o.report, overwrite=o.overwrite)
        if o.report.resolve() == o.out.resolve():
            raise InvalidArgumentError("--report and --out must differ")
        eval_report.check_report_writable(o.report)
        eval_report.pyplot()  # a missing matplotlib fails now, not after the scoring run


def _checkpoint_part(checkpoint: Path, output: Path) -> bool:
    """Whether ``output`` is the model checkpoint ``checkpoint`` or one of its files or
    directories (a new file next to them is not)."""
    # Here, not at the top: model_checkpoint imports torch (scoring in-process loads it anyway).
    from embedding_store import model_checkpoint as mc

    model, resolved = checkpoint.resolve(), output.resolve()
    if resolved == model:
        return True
    if model not in resolved.parents:
        return False
    parts = {mc.MANIFEST_NAME, mc.DONE_MARKER, mc.EMBEDDINGS_DIR, mc.DENSE_FILE, mc.JIT_FILE}
    parts |= {mc.OPTIMIZER_FILE, mc.SCALER_FILE, mc.RNG_FILE}
    return resolved.relative_to(model).parts[0] in parts


def _label_of(o: EvalOptions, mapping: FeatureMapping) -> LabelMapping | None:
    if o.no_label:
        return None
    if o.label is not None:
        base = mapping.label
        if base is not None:
            return LabelMapping(o.label, base.positive, base.negative)
        return LabelMapping(o.label)
    return mapping.label


def run_eval(o: EvalOptions, *, out: TextIO | None = None) -> EvalResult:
    """Run ``recserve eval``; messages on ``out`` (stdout), progress and bad rows on stderr."""
    out = out or sys.stdout
    _check_options(o)
    # The mapping file and its preprocessor before the model loads or the server is asked:
    # a typo in either must not cost a model load to find.
    explicit = load_mapping(o.mapping) if o.mapping is not None else None
    source = os.fspath(o.mapping) if o.mapping is not None else "the default mapping (no --mapping)"
    preprocess = None
    if explicit is not None and explicit.preprocessor is not None:
        preprocess = import_function(explicit.preprocessor, source)
    local = server = None
    try:
        if o.checkpoint is not None:
            local = InProcessScorer(o.checkpoint, o.output_transform)
        if o.url is not None:
            server = ServerScorer(
                o.url,
                o.model,
                protocol=o.protocol,
                timeout=o.timeout,
                tls_ca=o.tls_ca,
                tls_cert=o.tls_cert,
                tls_key=o.tls_key,
            )
        scorer = local or server
        assert scorer is not None  # _check_options: --checkpoint, --url or both
        signature = scorer.signature
        mapping = explicit if explicit is not None else default_mapping(signature)
        label = _label_of(o, mapping)
        if server is not None:
            server.label_column = label.column if label else None
        encoder: PreprocessorEncoder | GenericEncoder
        if preprocess is not None:
            encoder = PreprocessorEncoder(preprocess)
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
    parity = Parity(o.tolerance) if o.compare else None
    labels: list[np.ndarray] = []
    predictions: list[np.ndarray] = []
    raws: list[np.ndarray] = []
    bad_rows: list[str] = []
    rows = 0
    scorer = local or server
    assert scorer is not None  # _check_options: --checkpoint, --url or both
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
                    # Every row of the first chunk is bad: the mapping (or the layout) does
                    # not fit the data, and skipping would skip every row.
                    fit = (
                        f"check that the mapping {os.fspath(o.mapping)} fits the data"
                        if o.mapping is not None
                        else "check that the columns follow the default layout (recserve "
                        "eval --help; recserve checkpoint inspect lists the model's features)"
                    )
                    raise InvalidArgumentError(
                        bad_rows_message(
                            chunk.source,
                            f"none of its first {len(bad)} rows could be read and encoded, so "
                            f"--bad-rows skip would skip them all; {fit}",
                            [text for _, text in sorted(bad)],
                        )
                    )
                good = [good[i] for i in keep]
                positions = [positions[i] for i in keep]
                if label is not None:
                    good_labels = [good_labels[i] for i in keep]
            if bad:
                texts = [text for _, text in sorted(bad)]
                if o.bad_rows == "fail":
                    raise InvalidArgumentError(
                        bad_rows_message(
                            chunk.source,
                            "fix them, or pass --bad-rows skip to score the other rows",
                            texts,
                        )
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
            primary = scorer.score(batch, good)
            data["prediction"] = primary.predictions
            predictions.append(primary.predictions)
            raws.append(primary.raw if primary.raw is not None else primary.predictions)
            if parity is not None:
                assert server is not None  # --compare: _check_options wants --url
                remote = server.score(batch, good)
                data["server_prediction"] = remote.predictions
                wheres = [where_of(chunk.source, chunk.kind, p) for p in positions]
                data["abs_diff"] = parity.add(wheres, primary.predictions, remote.predictions)
            writer.write(data)
            rows += len(good)
            progress.update(rows, len(bad_rows))
        progress.update(rows, len(bad_rows), final=True)
        if rows == 0:
            files = ", ".join(map(str, o.data))
            raise InvalidArgumentError(
                f"no rows scored in {files}: all {len(bad_rows)} rows are bad rows (the "
                f"first: {bad_rows[0]}); fix them: the skipped rows above say what is wrong "
                "with each"
                if bad_rows
                else f"no rows scored in {files}: no data rows (a header alone?)"
            )
        seconds = time.perf_counter() - started
        all_labels = np.concatenate(labels) if label is not None else None
        all_predictions = np.concatenate(predictions)
        ranking = np.concatenate(raws)
        metric_block = eval_report.metrics(
            all_labels,
            all_predictions,
            ranking if local is not None else None,
            bins=o.calibration_bins,
            logits_hint=(
                "pass --output-transform sigmoid"
                if local is not None
                else "start the server with `recserve serve --output-transform sigmoid`"
            ),
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
        # All or nothing: the report is rendered (into a staging directory) before the
        # predictions are committed, then moved into place; a report that fails leaves no
        # --out behind (it used to, and a rerun then needed --overwrite).
        staged = (
            eval_report.staged_report(
                o.report,
                report,
                labels=all_labels,
                predictions=all_predictions,
                ranking_scores=ranking,
                all_bad_rows=bad_rows,
                overwrite=o.overwrite,
            )
            if o.report is not None
            else contextlib.nullcontext()
        )
        with staged:
            writer.commit()
    except BaseException:
        writer.abort()
        raise
    if len(bad_rows) > SHOWN_BAD_ROWS:
        print(f"skipped {len(bad_rows) - SHOWN_BAD_ROWS} more bad rows", file=sys.stderr)
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
        # --compare: _check_options wants both --checkpoint and --url.
        assert local is not None and server is not None
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
        print(f"report: {o.report}", file=out)
    return EvalResult(rows, len(bad_rows), report, exit_code, bad_rows)


def bad_rows_message(source: str, problem: str, texts: list[str]) -> str:
    """The one layout of ``recserve eval``'s errors for bad rows: ``bad rows in FILE:
    PROBLEM (what to do):``, then up to :data:`SHOWN_BAD_ROWS` of ``texts`` (each
    ``FILE:LINE: reason``, naming the column or feature at fault; in line order), one per
    line, and how many more."""
    shown = "\n  ".join(texts[:SHOWN_BAD_ROWS])
    more = len(texts) - SHOWN_BAD_ROWS
    tail = f"\n  ... and {more} more" if more > 0 else ""
    return f"bad rows in {source}: {problem}:\n  {shown}{tail}"


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
        "url": server.shown if server is not None else None,  # a report shows no password
        "model_name": o.model if server is not None else None,
        "server_version": server.version if server is not None else None,
        "protocol": o.protocol if server is not None else None,
    }
