"""Metrics, report and atomic writers of ``recserve eval`` (clients/eval_report.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from clients import eval_report
from embedding_store.errors import AlreadyExistsError, InvalidArgumentError
from examples.adult_income.metrics import roc_auc as adult_roc_auc


def brute_force_auc(labels, scores) -> float:
    pos = [s for s, y in zip(scores, labels) if y > 0.5]
    neg = [s for s, y in zip(scores, labels) if y <= 0.5]
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_is_exact_with_ties_and_matches_the_training_side(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, 300).astype(np.float32)
    tied = rng.integers(0, 7, 300).astype(np.float32)  # many ties
    assert eval_report.roc_auc(labels, tied) == pytest.approx(brute_force_auc(labels, tied))
    scores = rng.normal(size=300).astype(np.float32)
    assert eval_report.roc_auc(labels, scores) == adult_roc_auc(labels, scores)  # bit-identical


def test_auc_needs_both_classes_and_no_nan():
    with pytest.raises(ValueError, match="both positive and negative"):
        eval_report.roc_auc(np.ones(3), np.arange(3.0))
    with pytest.raises(ValueError, match="NaN"):
        eval_report.roc_auc(np.array([0, 1]), np.array([0.1, np.nan]))


def test_a_label_of_exactly_one_half_is_negative():
    labels = np.array([0.5, 1.0, 0.0])
    scores = np.array([0.9, 0.5, 0.1])  # the positive beats 0.1, not the 0.5-label's 0.9
    assert eval_report.roc_auc(labels, scores) == 0.5
    assert adult_roc_auc(labels, scores) == 0.5


def test_roc_curve_area_is_the_auc():
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 2, 500)
    scores = rng.integers(0, 20, 500).astype(np.float64) + labels
    fpr, tpr = eval_report.roc_curve(labels, scores)
    assert (fpr[0], tpr[0]) == (0.0, 0.0) and (fpr[-1], tpr[-1]) == (1.0, 1.0)
    assert np.all(np.diff(fpr) >= 0) and np.all(np.diff(tpr) >= 0)
    area = float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))
    assert area == pytest.approx(eval_report.roc_auc(labels, scores))


def test_log_loss_and_calibration():
    labels = np.array([1.0, 0.0, 1.0, 0.0])
    probabilities = np.array([0.9, 0.2, 0.6, 0.0])
    expected = -(math.log(0.9) + math.log(0.8) + math.log(0.6) + math.log(1 - 1e-15)) / 4
    assert eval_report.log_loss(labels, probabilities) == pytest.approx(expected)

    calibration = eval_report.calibration(labels, probabilities, bins=4)
    counts = [b["count"] for b in calibration["bins"]]
    assert counts == [2, 0, 1, 1]  # 0.0 and 0.2 | - | 0.6 | 0.9
    first = calibration["bins"][0]
    assert first["mean_prediction"] == pytest.approx(0.1) and first["positive_rate"] == 0.0
    # ECE = 2/4 * |0.1 - 0| + 1/4 * |0.6 - 1| + 1/4 * |0.9 - 1|
    assert calibration["expected_calibration_error"] == pytest.approx(0.05 + 0.1 + 0.025)

    rng = np.random.default_rng(0)
    p = rng.uniform(size=200_000)
    y = (rng.uniform(size=p.size) < p).astype(np.float64)  # calibrated by construction
    assert eval_report.calibration(y, p)["expected_calibration_error"] < 0.01


def test_metrics_leave_out_what_does_not_apply():
    labels = np.array([0.0, 1.0, 1.0])
    logits = np.array([-2.0, 3.0, 0.5], dtype=np.float32)
    m = eval_report.metrics(labels, logits)
    assert (
        m["auc"] == 1.0 and m["log_loss"] is None and "--output-transform" in m["probability_note"]
    )
    m = eval_report.metrics(None, np.array([0.5]))
    assert m["auc"] is None and m["auc_note"] == "no labels"
    m = eval_report.metrics(np.ones(2), np.array([0.2, 0.3]))
    assert m["auc"] is None and "both positive and negative" in m["auc_note"]
    assert m["log_loss"] is not None


def test_atomic_file_refuses_existing_and_leaves_nothing_on_error(tmp_path):
    target = tmp_path / "out.csv"
    with eval_report.atomic_file(target, overwrite=False) as temporary:
        temporary.write_text("one")
    assert target.read_text() == "one"
    with (
        pytest.raises(AlreadyExistsError, match="--overwrite"),
        eval_report.atomic_file(target, overwrite=False),
    ):
        pass
    with pytest.raises(RuntimeError), eval_report.atomic_file(target, overwrite=True) as temporary:
        temporary.write_text("partial")
        raise RuntimeError("boom")
    assert target.read_text() == "one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]


def test_report_directory(tmp_path):
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, 1000).astype(np.float64)
    predictions = np.clip(labels * 0.3 + rng.uniform(size=1000) * 0.7, 0, 1).astype(np.float32)
    report = {
        "created_at": "now",
        "model": {"checkpoint": "ck", "checkpoint_version": "v1"},
        "data": ["a.csv"],
        "counts": {"rows": 1000, "positives": int(labels.sum()), "skipped_rows": 1},
        **eval_report.metrics(labels, predictions),
        "unknown_ids": {"ids": 10, "unknown": 1, "ratio": 0.1},
        "bad_rows": ["a.csv:7: bad"],
        "compare": None,
    }
    target = tmp_path / "report"
    eval_report.write_report(
        target,
        report,
        labels=labels,
        predictions=predictions,
        ranking_scores=predictions,
        all_bad_rows=["a.csv:7: bad"],
        overwrite=False,
    )
    names = sorted(p.name for p in target.iterdir())
    assert names == ["bad_rows.txt", "calibration.png", "report.json", "roc.png", "summary.md"]
    data = json.loads((target / "report.json").read_text())
    assert data["auc"] == pytest.approx(eval_report.roc_auc(labels, predictions))
    assert "checkpoint ck (version v1)" in (target / "summary.md").read_text()
    with pytest.raises(AlreadyExistsError):
        eval_report.write_report(
            target,
            report,
            labels=labels,
            predictions=predictions,
            ranking_scores=predictions,
            all_bad_rows=[],
            overwrite=False,
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]


# --------------------------------------------------------------------------- exact values on
# small inputs, computed by hand (mutation testing found these behaviours unchecked)
def test_auc_needs_a_positive_label_too():
    """All-negative labels are refused like all-positive ones (not a 0/0 NaN)."""
    with pytest.raises(ValueError, match="both positive and negative"):
        eval_report.roc_auc(np.zeros(3), np.arange(3.0))


def test_auc_refuses_labels_and_scores_of_different_lengths():
    with pytest.raises(ValueError, match=r"labels \(3\) and scores \(4\) differ in length"):
        eval_report.roc_auc(np.array([0.0, 1.0, 1.0]), np.arange(4.0))


@pytest.mark.parametrize(
    ("function", "labels", "values", "message"),
    [
        # One probability was broadcast over all three labels: a log loss of 3 rows.
        (eval_report.log_loss, [0.0, 1.0, 1.0], [0.9], r"labels \(3\) and probabilities \(1\)"),
        (eval_report.log_loss, [1.0], [0.2, 0.9], r"labels \(1\) and probabilities \(2\)"),
        (
            eval_report.log_loss,
            [0.0, 1.0],
            [0.2, 0.9, 0.5],
            r"labels \(2\) and probabilities \(3\)",
        ),
        (eval_report.calibration, [1.0], [0.2, 0.9], r"labels \(1\) and probabilities \(2\)"),
        # The first two labels were paired with sorted scores, the third never looked at.
        (eval_report.roc_curve, [0.0, 1.0, 1.0], [0.2, 0.9], r"labels \(3\) and scores \(2\)"),
    ],
)
def test_metric_functions_refuse_labels_and_values_of_different_lengths(
    function, labels, values, message
):
    with pytest.raises(ValueError, match=message + " differ in length"):
        function(np.array(labels), np.array(values))


def test_metrics_refuse_labels_predictions_or_ranking_scores_of_different_lengths():
    """Not an AUC note and a log loss over broadcast rows: the caller's arrays disagree."""
    labels, predictions = np.array([0.0, 1.0, 1.0]), np.array([0.2, 0.7, 0.9])
    with pytest.raises(ValueError, match=r"labels \(3\) and predictions \(1\) differ"):
        eval_report.metrics(labels, predictions[:1])
    with pytest.raises(ValueError, match=r"ranking scores \(2\) and predictions \(3\) differ"):
        eval_report.metrics(labels, predictions, np.array([0.1, 0.2]))
    # Labels [n, 1] against predictions [n] are the same rows.
    m = eval_report.metrics(labels.reshape(-1, 1), predictions)
    assert m["auc"] == 1.0
    assert m["log_loss"] == pytest.approx(-(np.log(0.8) + np.log(0.7) + np.log(0.9)) / 3)


def test_roc_curve_exact_points_with_one_positive_or_one_negative():
    # Descending scores 0.9 (pos), 0.8 (neg), 0.8 (neg), 0.1 (neg): the tied 0.8s are one
    # point; with one positive every TPR is 0 or 1, with three negatives FPRs are thirds.
    labels = np.array([0.0, 1.0, 0.0, 0.0])
    scores = np.array([0.8, 0.9, 0.8, 0.1])
    fpr, tpr = eval_report.roc_curve(labels, scores)
    np.testing.assert_allclose(fpr, [0.0, 0.0, 2 / 3, 1.0])
    np.testing.assert_allclose(tpr, [0.0, 1.0, 1.0, 1.0])
    # One negative, two positives: FPRs are 0 or 1, TPRs halves.
    fpr, tpr = eval_report.roc_curve(np.array([1.0, 0.0, 1.0]), np.array([0.9, 0.5, 0.2]))
    np.testing.assert_allclose(fpr, [0.0, 0.0, 1.0, 1.0])
    np.testing.assert_allclose(tpr, [0.0, 0.5, 0.5, 1.0])


def test_log_loss_clips_certain_wrong_predictions_to_a_finite_loss():
    """A prediction of exactly 1 for a negative (or 0 for a positive) costs -log(1e-15), not
    inf: probabilities are clipped to [1e-15, 1 - 1e-15]."""
    assert eval_report.log_loss(np.array([1.0]), np.array([0.0])) == pytest.approx(-math.log(1e-15))
    # 1 - 1e-15 is not exact in binary: the clipped value's own complement is what counts.
    assert eval_report.log_loss(np.array([0.0]), np.array([1.0])) == pytest.approx(
        -math.log1p(-(1 - 1e-15))
    )
    assert math.isfinite(eval_report.log_loss(np.array([0.0]), np.array([1.0])))


def test_calibration_bins_bounds_and_a_prediction_of_exactly_one():
    """Bins are [b/n, (b+1)/n); a prediction of exactly 1.0 belongs to the last bin."""
    labels = np.array([1.0, 0.0, 1.0])
    probabilities = np.array([1.0, 0.25, 0.75])
    calibration = eval_report.calibration(labels, probabilities, bins=4)
    assert calibration["num_bins"] == 4
    bounds = [(b["lower"], b["upper"]) for b in calibration["bins"]]
    assert bounds == [(0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.0)]
    assert [b["count"] for b in calibration["bins"]] == [0, 1, 0, 2]
    last = calibration["bins"][3]
    assert last["mean_prediction"] == pytest.approx(0.875) and last["positive_rate"] == 1.0
    empty = calibration["bins"][0]
    assert empty["mean_prediction"] is None and empty["positive_rate"] is None
    # ECE = 1/3 * |0.25 - 0| + 2/3 * |0.875 - 1|
    assert calibration["expected_calibration_error"] == pytest.approx(0.25 / 3 + 0.25 / 3)


def test_metrics_take_predictions_of_exactly_zero_and_one_as_probabilities():
    labels = np.array([0.0, 1.0])
    m = eval_report.metrics(labels, np.array([0.0, 1.0]))
    assert m["probability_note"] is None
    assert m["log_loss"] == pytest.approx(-math.log1p(-1e-15))
    assert m["calibration"]["expected_calibration_error"] == 0.0


def test_metrics_rank_the_raw_scores_when_given_and_count_nan_predictions():
    labels = np.array([0.0, 1.0, 1.0])
    predictions = np.array([0.5, 0.5, 0.2])  # ranks: pos 0.5 ties, pos 0.2 loses: AUC 1/4
    raw = np.array([-1.0, 2.0, 0.0])  # ranks both positives above the negative: AUC 1
    m = eval_report.metrics(labels, predictions, raw)
    assert m["auc"] == 1.0 and m["auc_note"] == "rank-based (exact), on the raw model output"
    m = eval_report.metrics(labels, predictions)
    assert m["auc"] == 0.25 and m["auc_note"] == "rank-based (exact), on the predictions"
    assert m["predictions"] == {"mean": pytest.approx(0.4), "min": 0.2, "max": 0.5, "nan": 0}

    m = eval_report.metrics(None, np.array([0.1, np.nan, np.nan]))
    assert m["predictions"]["nan"] == 2
    m = eval_report.metrics(labels, np.array([0.1, np.nan, 0.3]))
    assert m["auc"] is None and m["auc_note"] == "scores contain NaN"
    assert m["log_loss"] is None and m["probability_note"] is not None


def test_report_overwrite_replaces_the_directory_and_leaves_no_old_copy(tmp_path):
    labels = np.array([0.0, 1.0, 0.0, 1.0])
    predictions = np.array([0.1, 0.8, 0.3, 0.6])
    report = {
        "created_at": "now",
        "model": {"url": "http://h:1", "model_name": "m", "server_version": "7", "protocol": "v2"},
        "data": ["a.csv"],
        "counts": {"rows": 4, "positives": 2, "skipped_rows": 0},
        **eval_report.metrics(labels, predictions),
        "bad_rows": [],
        "compare": None,
    }
    target = tmp_path / "report"
    for _ in range(2):
        eval_report.write_report(
            target,
            report,
            labels=labels,
            predictions=predictions,
            ranking_scores=predictions,
            all_bad_rows=[],
            overwrite=True,
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]
    names = sorted(p.name for p in target.iterdir())
    assert names == ["calibration.png", "report.json", "roc.png", "summary.md"]
    data = json.loads((target / "report.json").read_text())
    assert data["files"] == ["report.json", "roc.png", "calibration.png", "summary.md"]
    assert data["auc"] == 1.0


def test_summary_lists_the_first_twenty_bad_rows_and_the_parity_verdict():
    bad_rows = [f"a.csv:{line}: bad" for line in range(2, 32)]
    report = {
        "created_at": "now",
        "model": {"url": "http://h:1", "model_name": "m", "server_version": "7", "protocol": "v2"},
        "data": ["a.csv", "b.csv"],
        "counts": {"rows": 4, "positives": None, "skipped_rows": 30},
        **eval_report.metrics(None, np.array([0.5])),
        "unknown_ids": {"ids": 8, "unknown": 2, "ratio": 0.25},
        "bad_rows": bad_rows,
        "compare": {
            "identical": False,
            "differing_rows": 1,
            "rows": 4,
            "tolerance": 1e-6,
            "max_abs_diff": 0.5,
        },
    }
    text = eval_report.summary_markdown(report)
    listed = [line for line in text.splitlines() if line.startswith("- a.csv:")]
    assert listed == [f"- {row}" for row in bad_rows[:20]]
    assert "- model: server http://h:1 model m (version 7, v2 protocol)" in text
    assert "- data: a.csv, b.csv" in text
    assert "| positives | n/a |" in text and "| AUC | n/a |" in text
    assert "| unknown-ID ratio | 0.250000 |" in text
    assert "- DIFFERENT: 1 of 4 rows differ by more than 1e-06 (max abs diff 0.5)" in text
    assert "- no labels" in text


@pytest.mark.parametrize("bins", [0, -1])
def test_calibration_needs_at_least_one_bin(bins):
    with pytest.raises(
        InvalidArgumentError, match=f"calibration needs at least one bin, got {bins}"
    ):
        eval_report.calibration(np.array([0.0, 1.0]), np.array([0.2, 0.9]), bins=bins)


def test_atomic_outputs_leave_nothing_behind_when_they_fail(tmp_path):
    target = tmp_path / "out.csv"
    with (
        pytest.raises(FileNotFoundError, match="was not written"),
        eval_report.atomic_file(target, overwrite=False),
    ):
        pass  # the caller wrote nothing
    assert list(tmp_path.iterdir()) == []

    report = tmp_path / "report"
    report.mkdir()
    (report / "old.txt").write_text("old")
    with (
        pytest.raises(RuntimeError, match="boom"),
        eval_report.atomic_directory(report, overwrite=True) as staging,
    ):
        (staging / "new.txt").write_text("new")
        raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]
    assert [p.name for p in report.iterdir()] == ["old.txt"]


def test_summary_numbers_and_sections():
    assert [eval_report._fmt(v) for v in (None, 0.5, math.inf, math.nan, 3)] == [
        "n/a",
        "0.500000",
        "inf",
        "nan",
        "3",
    ]
    # log loss -ln(0.75); each prediction 0.25 from its label: calibration error 0.25. No
    # bad rows, comparison or unknown IDs: no section of theirs.
    assert eval_report.summary_markdown(_tiny_report_fields()) == (
        "# recserve eval report\n\n"
        "- created: now\n- model: checkpoint ck (version v1)\n- data: a.csv\n\n"
        "| metric | value |\n| --- | --- |\n"
        "| rows scored | 2 |\n| positives | 1 |\n| skipped rows | 0 |\n"
        "| AUC | 1.000000 |\n| log loss | 0.287682 |\n"
        "| expected calibration error | 0.250000 |\n\n"
        "- rank-based (exact), on the predictions\n\n"
        "![ROC](roc.png)\n\n![calibration](calibration.png)\n"
    )


def test_a_directory_where_an_output_file_goes_is_refused_before_anything_is_written(tmp_path):
    # With --overwrite the rename at the end used to fail on it, after the whole scoring
    # run, with a message naming the temporary file instead of the output.
    target = tmp_path / "out.csv"
    target.mkdir()
    entered = []
    with (
        pytest.raises(InvalidArgumentError) as caught,
        eval_report.atomic_file(target, overwrite=True),
    ):
        entered.append(True)
    assert caught.value.message == f"output {target} is a directory; expected a file name"
    assert entered == [] and [p.name for p in tmp_path.iterdir()] == ["out.csv"]


TINY_LABELS, TINY_PREDICTIONS = np.array([0.0, 1.0]), np.array([0.25, 0.75])


def _tiny_report_fields() -> dict:
    """The report of a checkpoint's two predictions TINY_PREDICTIONS of TINY_LABELS."""
    return {
        "created_at": "now",
        "model": {"checkpoint": "ck", "checkpoint_version": "v1"},
        "data": ["a.csv"],
        "counts": {"rows": 2, "positives": 1, "skipped_rows": 0},
        **eval_report.metrics(TINY_LABELS, TINY_PREDICTIONS),
        "bad_rows": [],
        "compare": None,
    }


def _tiny_report(target: Path, *, overwrite: bool) -> None:
    labels, predictions = TINY_LABELS, TINY_PREDICTIONS
    eval_report.write_report(
        target,
        _tiny_report_fields(),
        labels=labels,
        predictions=predictions,
        ranking_scores=predictions,
        all_bad_rows=[],
        overwrite=overwrite,
    )


def test_overwrite_replaces_an_earlier_report_but_no_other_directory(tmp_path):
    """--report results --overwrite used to delete results/ whatever it held (other runs'
    files, say) and put the report in its place."""
    results = tmp_path / "results"
    (results / "runs").mkdir(parents=True)
    (results / "runs" / "notes.txt").write_text("mine")
    with pytest.raises(AlreadyExistsError) as refused:
        _tiny_report(results, overwrite=True)
    assert refused.value.message == (
        f"report directory {results} exists and is not an eval report (no report.json): "
        "refusing to replace it (that would delete what it holds); choose another directory: "
        "the report is written as a directory of its own"
    )
    assert (results / "runs" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]  # no staging left
    # An earlier report, and an empty directory, are replaced.
    report = tmp_path / "report"
    _tiny_report(report, overwrite=False)
    (report / "summary.md").write_text("stale")
    _tiny_report(report, overwrite=True)
    assert (report / "summary.md").read_text().startswith("# recserve eval report")
    empty = tmp_path / "empty"
    empty.mkdir()
    _tiny_report(empty, overwrite=True)
    assert (empty / "report.json").is_file()


def test_a_report_directory_over_an_existing_file_leaves_no_old_copy(tmp_path):
    target = tmp_path / "report"
    target.write_text("an old file")
    with eval_report.atomic_directory(target, overwrite=True) as staging:
        (staging / "report.json").write_text("{}")
    assert [p.name for p in tmp_path.iterdir()] == ["report"]  # no .report.old-* file left
    assert [p.name for p in target.iterdir()] == ["report.json"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_report_in_the_current_directory_or_one_holding_it_is_refused(
    tmp_path, monkeypatch, overwrite
):
    # `recserve eval --report .` in an empty directory raised a bare ValueError from
    # Path.with_name (and without --overwrite advised passing it).
    here = tmp_path / "empty"
    here.mkdir()
    monkeypatch.chdir(here)
    for given, example in ((".", "report"), ("..", "../report"), (str(tmp_path), None)):
        example = example or f"{tmp_path}/report"
        with pytest.raises(InvalidArgumentError) as caught:
            eval_report.check_report_target(given, overwrite=overwrite)
        assert str(caught.value) == (
            f"report directory {given} is the current directory or holds it: the report is "
            "written as a directory of its own, which would replace it; name a new one "
            f"(e.g. --report {example})"
        )
    assert list(here.iterdir()) == [] and [p.name for p in tmp_path.iterdir()] == ["empty"]
    eval_report.check_report_target("report", overwrite=overwrite)  # a new one next to it


def test_atomic_outputs_stage_next_to_a_dotted_target_and_refuse_the_root(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    # "../out.csv" staged as "../.out.csv.tmp-*": next to it, not in the current directory.
    with eval_report.atomic_file("../out.csv", overwrite=False) as temporary:
        assert temporary.parent == tmp_path
        temporary.write_text("x")
    with (
        pytest.raises(InvalidArgumentError) as caught,
        eval_report.atomic_directory("/", overwrite=True),
    ):
        pass
    assert str(caught.value) == "output / is the root directory; expected a name"
    assert (tmp_path / "out.csv").read_text() == "x" and list((tmp_path / "a").iterdir()) == []
