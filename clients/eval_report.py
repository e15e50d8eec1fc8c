"""Metrics, plots and the report directory of ``recserve eval``; atomic output helpers.

Metrics are numpy only and exact: ROC AUC is the rank-based Mann-Whitney U statistic with
midranks for ties (the same computation as ``examples/adult_income/metrics.py``, so an eval of a
checkpoint reproduces the AUC its training run printed); log loss and calibration (expected
calibration error over equal-width bins, plus the reliability bins) need probabilities in
[0, 1] and are left out, with the reason, otherwise.

A report directory holds ``report.json``, ``roc.png``, ``calibration.png`` (matplotlib, Agg
backend, imported only here), ``summary.md`` and, when rows were skipped, ``bad_rows.txt``. It is
written under a temporary name next to the target and renamed into place; so is every file
:func:`atomic_file` writes.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from embedding_store.errors import AlreadyExistsError, InvalidArgumentError

__all__ = [
    "atomic_directory",
    "atomic_file",
    "calibration",
    "check_report_target",
    "log_loss",
    "metrics",
    "roc_auc",
    "roc_curve",
    "staged_report",
    "write_report",
]

LOG_LOSS_EPS = 1e-15


# --------------------------------------------------------------------------- metrics
def _binary(labels: np.ndarray) -> np.ndarray:
    return np.asarray(labels, dtype=np.float64).reshape(-1) > 0.5


def _paired(
    labels: np.ndarray, values: np.ndarray, what: str, first: str = "labels"
) -> tuple[np.ndarray, np.ndarray]:
    """``labels`` and ``values`` flattened to float64 [n] each; ValueError naming both
    (``first`` and ``what``) and their lengths when these differ: numpy would broadcast one
    label or prediction over all the others, or fail naming neither."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if y.shape != v.shape:
        raise ValueError(f"{first} ({y.size}) and {what} ({v.size}) differ in length")
    return y, v


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """P(random positive scores above random negative), ties 1/2. Labels > 0.5 are positive.

    Raises ValueError unless both classes are present, or for NaN scores.
    """
    raw, s = _paired(labels, scores, "scores")
    y = raw > 0.5
    if np.isnan(s).any():
        raise ValueError("scores contain NaN")
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs both positive and negative labels")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    ends = np.r_[starts[1:], s.size]  # exclusive
    midrank = (starts + ends + 1) / 2.0  # 1-based mean rank of each run of ties
    ranks = np.empty(s.size, dtype=np.float64)
    ranks[order] = np.repeat(midrank, ends - starts)
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def roc_curve(labels: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(false positive rates, true positive rates) at every distinct score, from (0, 0).

    Raises ValueError when labels and scores differ in length."""
    raw, s = _paired(labels, scores, "scores")
    y = raw > 0.5
    order = np.argsort(-s, kind="mergesort")
    s, y = s[order], y[order]
    last_of_run = np.r_[np.flatnonzero(s[1:] != s[:-1]), s.size - 1]
    tps = np.cumsum(y)[last_of_run]
    fps = (last_of_run + 1) - tps
    n_pos, n_neg = max(int(y.sum()), 1), max(int((~y).sum()), 1)
    return np.r_[0.0, fps / n_neg], np.r_[0.0, tps / n_pos]


def log_loss(labels: np.ndarray, probabilities: np.ndarray) -> float:
    """Mean binary cross-entropy; probabilities clipped to [1e-15, 1 - 1e-15].

    Raises ValueError when labels and probabilities differ in length."""
    y, p = _paired(labels, probabilities, "probabilities")
    p = np.clip(p, LOG_LOSS_EPS, 1 - 1e-15)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


def calibration(labels: np.ndarray, probabilities: np.ndarray, bins: int = 10) -> dict[str, Any]:
    """Expected calibration error and reliability bins (``bins`` equal-width bins of [0, 1]).

    Each bin: bounds, count, mean predicted probability, observed positive rate (labels > 0.5;
    soft labels are averaged as they are). ECE = sum over bins of count/n * |mean - rate|.
    Raises ValueError when labels and probabilities differ in length.
    """
    if bins < 1:
        raise InvalidArgumentError(f"calibration needs at least one bin, got {bins}")
    y, p = _paired(labels, probabilities, "probabilities")
    index = np.clip((p * bins).astype(np.int64), 0, bins - 1)
    counts = np.bincount(index, minlength=bins)
    sum_p = np.bincount(index, weights=p, minlength=bins)
    sum_y = np.bincount(index, weights=y, minlength=bins)
    table = []
    ece = 0.0
    for b in range(bins):
        count = int(counts[b])
        mean_p: float | None = None
        rate: float | None = None
        if count:
            mean_p = float(sum_p[b] / count)
            rate = float(sum_y[b] / count)
            ece += count / max(y.size, 1) * abs(mean_p - rate)
        table.append(
            {
                "lower": b / bins,
                "upper": (b + 1) / bins,
                "count": count,
                "mean_prediction": mean_p,
                "positive_rate": rate,
            }
        )
    return {"expected_calibration_error": float(ece), "num_bins": bins, "bins": table}


def metrics(
    labels: np.ndarray | None,
    predictions: np.ndarray,
    ranking_scores: np.ndarray | None = None,
    *,
    bins: int = 10,
    logits_hint: str = "pass --output-transform sigmoid",
) -> dict[str, Any]:
    """The metrics block of ``report.json``.

    ``ranking_scores``: what AUC ranks (the raw model output when known: AUC is invariant
    to the monotone output transform, but float32 sigmoid can tie distinct logits), else the
    predictions. ``logits_hint``: what makes the predictions probabilities, for the note
    when they are not.

    Raises ValueError when the labels, the predictions or the ranking scores differ in
    length (a caller's bug, not a note for the report).
    """
    predictions = np.asarray(predictions, dtype=np.float64).reshape(-1)
    if labels is not None:
        _paired(labels, predictions, "predictions")
    if ranking_scores is not None:
        _paired(ranking_scores, predictions, "predictions", first="ranking scores")
    out: dict[str, Any] = {
        "predictions": {
            "mean": float(predictions.mean()) if predictions.size else None,
            "min": float(predictions.min()) if predictions.size else None,
            "max": float(predictions.max()) if predictions.size else None,
            "nan": int(np.isnan(predictions).sum()),
        },
        "auc": None,
        "auc_note": None,
        "log_loss": None,
        "calibration": None,
        "probability_note": None,
    }
    if labels is None:
        out["auc_note"] = "no labels"
        return out
    scores = predictions if ranking_scores is None else ranking_scores
    try:
        out["auc"] = roc_auc(labels, scores)
        out["auc_note"] = (
            "rank-based (exact), on the raw model output"
            if ranking_scores is not None
            else "rank-based (exact), on the predictions"
        )
    except ValueError as error:
        out["auc_note"] = str(error)
    finite = np.isfinite(predictions).all()
    if predictions.size and finite and predictions.min() >= 0.0 and predictions.max() <= 1.0:
        out["log_loss"] = log_loss(labels, predictions)
        out["calibration"] = calibration(labels, predictions, bins)
    else:
        out["probability_note"] = (
            f"predictions are not probabilities in [0, 1] (logits? {logits_hint}): log loss "
            "and calibration left out"
        )
    return out


# --------------------------------------------------------------------------- atomic output
@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], *, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it is renamed to ``path``.

    An existing ``path`` is refused (AlreadyExistsError) unless ``overwrite``, and a directory
    always (InvalidArgumentError, before anything is written: the rename at the end would fail
    on it, after the work). On any error the temporary file is removed and ``path`` is
    untouched.
    """
    target = Path(path)
    refuse_existing(target, overwrite=overwrite)
    if target.is_dir():
        raise InvalidArgumentError(f"output {target} is a directory; expected a file name")
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = _sibling(target, "tmp")
    try:
        yield temporary
        if not temporary.exists():
            raise FileNotFoundError(f"{temporary} was not written")
        os.replace(temporary, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str], *, overwrite: bool) -> Iterator[Path]:
    """Like :func:`atomic_file` for a directory: fill the yielded staging directory."""
    target = Path(path)
    refuse_existing(target, overwrite=overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _sibling(target, "tmp")
    staging.mkdir()
    try:
        yield staging
        if target.exists():
            retired = _sibling(target, "old")
            os.replace(target, retired)
            os.replace(staging, target)
            if retired.is_dir():
                shutil.rmtree(retired, ignore_errors=True)
            else:  # a file replaced by the directory (rmtree leaves files alone)
                retired.unlink()
        else:
            os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _sibling(target: Path, kind: str) -> Path:
    """A fresh hidden path next to ``target`` (same directory, so the rename is atomic).

    Named from the absolute path, lexically: ``Path(".").with_name`` raises ValueError and
    ``Path("..").with_name("x")`` is ``x`` in the current directory, not next to ``..``.
    """
    absolute = Path(os.path.abspath(target))
    if not absolute.name:  # "/" and the like
        raise InvalidArgumentError(f"output {target} is the root directory; expected a name")
    return absolute.with_name(f".{absolute.name}.{kind}-{uuid.uuid4().hex}")


def refuse_existing(path: Path, *, overwrite: bool, what: str = "output") -> None:
    """AlreadyExistsError for an existing ``path`` unless ``overwrite``."""
    if path.exists() and not overwrite:
        raise AlreadyExistsError(f"{what} {path} already exists; pass --overwrite to replace it")


#: The file every report directory holds: what tells an earlier report from other directories.
REPORT_FILE = "report.json"


def check_report_target(path: str | os.PathLike[str], *, overwrite: bool) -> None:
    """AlreadyExistsError unless a report directory may be written to ``path``: it does not
    exist, or (with ``overwrite``) it is a file, an empty directory or an earlier report (a
    directory holding :data:`REPORT_FILE`). Replacing deletes the old directory, so no other
    directory is ever replaced (``--report results --overwrite`` used to delete all of
    ``results/``, whatever it held, and put the report in its place)."""
    target = Path(path)
    # Before refuse_existing: "pass --overwrite" is no advice for these. The report replaces
    # its directory whole, and the current directory (`--report .`) or one holding it cannot
    # be replaced from inside (and `.` has no name to stage a sibling by).
    here = Path(os.getcwd())
    absolute = Path(os.path.abspath(target))
    if absolute == here or absolute in here.parents:
        raise InvalidArgumentError(
            f"report directory {target} is the current directory or holds it: the report is "
            f"written as a directory of its own, which would replace it; name a new one "
            f"(e.g. --report {target / 'report'})"
        )
    refuse_existing(target, overwrite=overwrite)
    if target.is_dir() and any(target.iterdir()) and not (target / REPORT_FILE).is_file():
        raise AlreadyExistsError(
            f"report directory {target} exists and is not an eval report (no {REPORT_FILE}): "
            "refusing to replace it (that would delete what it holds); choose another "
            "directory: the report is written as a directory of its own"
        )


def check_report_writable(path: str | os.PathLike[str]) -> None:
    """InvalidArgumentError naming ``--report`` and ``path`` unless the report's staging
    directory can be made next to ``path`` (in its nearest existing ancestor, where the missing
    parents would be made): asked before the scoring run, which otherwise ended in an error
    naming the hidden staging directory (``--report /proc/r``). Leaves nothing behind."""
    target = Path(path)
    absolute = Path(os.path.abspath(target))
    ancestor = absolute.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    try:
        if not ancestor.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(ancestor))
        probe = ancestor / f".{absolute.name}.probe-{uuid.uuid4().hex}"
        probe.mkdir()
        probe.rmdir()
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise InvalidArgumentError(f"--report {target}: cannot write there: {reason}") from None


# --------------------------------------------------------------------------- report
def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display); InvalidArgumentError
    when matplotlib is not installed (an optional extra). ``recserve eval --report`` asks
    before it scores anything, so a missing extra costs no scoring run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgumentError(
            "the eval report's plots need matplotlib (pip install 'recserve[eval]')"
        ) from None
    return plt


def _plots(
    directory: Path,
    report: dict[str, Any],
    labels: np.ndarray | None,
    ranking: np.ndarray,
    predictions: np.ndarray,
) -> list[str]:
    plt = pyplot()
    written = []
    auc = report["auc"]
    figure, axes = plt.subplots(figsize=(5, 5))
    if auc is not None:
        # metrics() computes an AUC only from labels, and the report comes with them.
        assert labels is not None
        fpr, tpr = roc_curve(labels, ranking)
        axes.plot(fpr, tpr, label=f"model (AUC {auc:.4f})")
    else:
        axes.text(0.5, 0.5, report["auc_note"] or "no AUC", ha="center")
    axes.plot([0, 1], [0, 1], linestyle="--", color="grey", label="chance")
    axes.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC")
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(directory / "roc.png", dpi=100)
    plt.close(figure)
    written.append("roc.png")

    cal = report["calibration"]
    figure, (top, bottom) = plt.subplots(
        2, 1, figsize=(5, 6), gridspec_kw={"height_ratios": [3, 1]}, sharex=True
    )
    top.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfectly calibrated")
    if cal is not None:
        used = [b for b in cal["bins"] if b["count"]]
        top.plot(
            [b["mean_prediction"] for b in used],
            [b["positive_rate"] for b in used],
            marker="o",
            label=f"model (ECE {cal['expected_calibration_error']:.4f})",
        )
        bottom.hist(
            np.asarray(predictions, dtype=np.float64), bins=cal["num_bins"], range=(0.0, 1.0)
        )
    else:
        top.text(0.5, 0.5, "predictions are not probabilities", ha="center")
    top.set(ylabel="observed positive rate", title="Reliability")
    top.legend(loc="upper left")
    bottom.set(xlabel="predicted probability", ylabel="rows")
    figure.tight_layout()
    figure.savefig(directory / "calibration.png", dpi=100)
    plt.close(figure)
    written.append("calibration.png")
    return written


def _fmt(value: Any, digits: int = 6) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else str(value)
    return str(value)


def _model_text(model: dict[str, Any]) -> str:
    parts = []
    if model.get("checkpoint"):
        parts.append(f"checkpoint {model['checkpoint']} (version {model['checkpoint_version']})")
    if model.get("url"):
        parts.append(
            f"server {model['url']} model {model['model_name']} (version "
            f"{model['server_version']}, {model['protocol']} protocol)"
        )
    return "; ".join(parts)


def summary_markdown(report: dict[str, Any]) -> str:
    m, c = report, report["counts"]
    lines = [
        "# recserve eval report",
        "",
        f"- created: {report['created_at']}",
        f"- model: {_model_text(report['model'])}",
        f"- data: {', '.join(report['data'])}",
        "",
        "| metric | value |",
        "| --- | --- |",
        f"| rows scored | {c['rows']} |",
        f"| positives | {_fmt(c['positives'])} |",
        f"| skipped rows | {c['skipped_rows']} |",
        f"| AUC | {_fmt(m['auc'])} |",
        f"| log loss | {_fmt(m['log_loss'])} |",
        "| expected calibration error | "
        + (_fmt(m["calibration"]["expected_calibration_error"]) if m["calibration"] else "n/a")
        + " |",
    ]
    unknown = report.get("unknown_ids")
    if unknown:
        lines.append(f"| unknown-ID ratio | {_fmt(unknown['ratio'])} |")
    lines.append("")
    for note in (m.get("auc_note"), m.get("probability_note")):
        if note:
            lines.append(f"- {note}")
    compare = report.get("compare")
    if compare:
        verdict = "identical" if compare["identical"] else "DIFFERENT"
        lines += [
            "",
            "## parity (in-process vs server)",
            "",
            f"- {verdict}: {compare['differing_rows']} of {compare['rows']} rows differ by more "
            f"than {compare['tolerance']} (max abs diff {compare['max_abs_diff']})",
        ]
    if report["bad_rows"]:
        lines += ["", "## skipped rows (first ones)", ""]
        lines += [f"- {row}" for row in report["bad_rows"][:20]]
    lines += ["", "![ROC](roc.png)", "", "![calibration](calibration.png)", ""]
    return "\n".join(lines)


@contextlib.contextmanager
def staged_report(
    path: str | os.PathLike[str],
    report: dict[str, Any],
    *,
    labels: np.ndarray | None,
    predictions: np.ndarray,
    ranking_scores: np.ndarray,
    all_bad_rows: list[str],
    overwrite: bool,
) -> Iterator[Path]:
    """Render the report directory into a staging directory, yield its final path, then move
    it into place (an error inside the block leaves no report). ``recserve eval`` commits its
    predictions inside the block: a report that cannot be rendered leaves neither behind."""
    target = Path(path)
    check_report_target(target, overwrite=overwrite)
    with atomic_directory(target, overwrite=overwrite) as staging:
        files = _plots(staging, report, labels, ranking_scores, predictions)
        (staging / "summary.md").write_text(summary_markdown(report), encoding="utf-8")
        files.append("summary.md")
        if all_bad_rows:
            (staging / "bad_rows.txt").write_text("\n".join(all_bad_rows) + "\n", "utf-8")
            files.append("bad_rows.txt")
        report = {**report, "files": ["report.json", *files]}
        (staging / "report.json").write_bytes(
            orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
        )
        yield target


def write_report(
    path: str | os.PathLike[str],
    report: dict[str, Any],
    *,
    labels: np.ndarray | None,
    predictions: np.ndarray,
    ranking_scores: np.ndarray,
    all_bad_rows: list[str],
    overwrite: bool,
) -> Path:
    """Write the report directory atomically; returns its path."""
    with staged_report(
        path,
        report,
        labels=labels,
        predictions=predictions,
        ranking_scores=ranking_scores,
        all_bad_rows=all_bad_rows,
        overwrite=overwrite,
    ) as target:
        return target
