"""benchmarks/dense_model.py: refuses runs that would measure nothing or run unbounded, and
a real (tiny) run times all three models on every workload."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import dense_model  # noqa: E402

from serving import onednn_linear  # noqa: E402


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rounds", "0"], "argument --rounds: expected an integer > 0, got 0"),
        (["--calls", "-1"], "argument --calls: expected an integer > 0, got -1"),
        (["--sizes", "1,x"], "argument --sizes: expected a comma list of integers, got '1,x'"),
        (["--sizes", "64,0"], "argument --sizes: sizes must be in 1..1024, got 0"),
        (["--sizes", "1025"], "argument --sizes: sizes must be in 1..1024, got 1025"),
        (["--max-merged-rows", "2000"], "--max-merged-rows: at most 1024, got 2000"),
        (["--rounds", "101"], "bounded runs only: at most 100 --rounds, 10000 --calls and "
         "10000 --merged-batches"),
        (["--checkpoint", "/nonexistent/ckpt"], "--checkpoint /nonexistent/ckpt: no such "
         "directory"),
    ],
)  # fmt: skip
def test_refuses_runs_that_measure_nothing(argv, message, capsys):
    with pytest.raises(SystemExit) as caught:
        dense_model.parse_args(argv)
    assert caught.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")


def test_defaults():
    args = dense_model.parse_args([])
    assert args.sizes == [1, 32, 64, 150, 256, 1024]
    assert (args.rounds, args.calls, args.max_merged_rows, args.merged_batches) == (5, 40, 300, 64)


def test_a_tiny_run_times_every_model_on_every_workload(tmp_path, capsys):
    from load_tests.synthetic_model import build_synthetic_checkpoint

    checkpoint = build_synthetic_checkpoint(
        tmp_path / "synthetic", vocab=50, num_slots=3, dim=4, batch_size=32, extra_steps=1
    )
    report = dense_model.main(
        ["--checkpoint", str(checkpoint), "--rounds", "2", "--calls", "1", "--sizes", "1,40",
         "--max-merged-rows", "40", "--merged-batches", "3"]
    )  # fmt: skip
    expected_merged = [int(r) for r in np.random.default_rng(0).integers(1, 41, 3)]
    assert report["merged_sizes"] == expected_merged
    assert set(report["results"]) == {"merged", "1", "40"}
    for cell in report["results"].values():
        assert set(cell["us_per_64_rows"]) == {"loaded", "fixed256", "auto"}
        assert all(us > 0 for us in cell["us_per_64_rows"].values())
        assert set(cell["speedup_over_loaded"]) == {"fixed256", "auto"}
        assert all(ratio > 0 for ratio in cell["speedup_over_loaded"].values())
    assert report["thresholds"]["loaded"] is None  # --onednn-min-rows 0: off
    if onednn_linear.onednn_available():
        assert report["thresholds"]["fixed256"] == 256
        assert report["thresholds"]["auto"] in (*onednn_linear.AUTO_PROBE_ROWS, 256)
    assert report["rounds"] == 2 and report["calls"] == 1
    assert '"results"' in capsys.readouterr().out.strip().splitlines()[-1]
