"""benchmarks/peers.py cells: ``--batches`` and ``--mix`` arguments, samples/s of a mixed-batch
locust run, and how the report names and pairs mixed cells."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import peers  # noqa: E402
import peers_crosscheck  # noqa: E402
import peers_measure  # noqa: E402
import peers_report  # noqa: E402


def test_batches_and_mix_arguments():
    args = peers.parse_args([])
    assert args.batches == [1, 64] and args.mix == []
    args = peers.parse_args(["--batches", "64, 1,64", "--mix", "1:6,8:3,64:1", "--mix", "8"])
    assert args.batches == [64, 1]
    assert args.mix == ["1:6,8:3,64:1", "8:1"]
    args = peers.parse_args(["--batches", "", "--mix", " 1:0.5 , 64:2.0"])
    assert args.batches == [] and args.mix == ["1:0.5,64:2"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--batches", "0"],
        ["--batches", "1,x"],
        ["--mix", "1:0"],
        ["--mix", "0:1"],
        ["--mix", "a:1"],
        ["--batches", ""],  # and no --mix: nothing to measure
    ],
)
def test_bad_cells_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        peers.parse_args(argv)
    err = capsys.readouterr().err
    assert "bad batch" in err or "nothing to measure" in err


def _row(name: str, rps: float) -> dict:
    return {"name": name, "rps": rps, "requests": 0, "failures": 0}


def test_samples_per_second_adds_each_sizes_own_rate():
    rows = [
        _row("v2-json b1", 600.0),
        _row("v2-json b8", 300.0),
        _row("v2-json b64", 100.5),
        _row("Aggregated", 1000.5),
    ]
    assert peers_measure.samples_per_second(rows) == 600 + 8 * 300 + 64 * 100.5
    assert (
        peers_measure.samples_per_second([_row("v2-binary b64", 10.0), _row("Aggregated", 10.0)])
        == 640
    )
    assert peers_measure.samples_per_second([_row("Aggregated", 10.0)]) == 0


def _measurement(
    server: str, batch: str, rps: float, p99: float, round_number: int = 1
) -> peers_measure.Measurement:
    m = peers_measure.Measurement("adult", server, batch, "json", 32, 20.0, round_number)
    m.rps, m.p99_ms, m.p50_ms, m.samples_per_s = rps, p99, p99 / 2, rps * 2
    return m


def test_report_names_and_pairs_mixed_cells(tmp_path):
    measurements = [
        _measurement("recserve:one", "64", 1500.0, 30.0),
        _measurement("torchserve", "64", 1000.0, 40.0),
        _measurement("recserve:one", "1:6,8:3,64:1", 5000.0, 12.0),
        _measurement("torchserve", "1:6,8:3,64:1", 2000.0, 24.0),
    ]
    summary = peers_report.report(tmp_path, measurements, {"one": ""}, {})
    lines = summary.splitlines()
    assert (
        "| adult | 64 | json | one: `(defaults)` | 1500 | 1000 | 1.5 | 1.5 | 30.0 | 40.0 | 0.75 "
        "| not met |" in lines
    )
    assert (
        "| adult | mix 1:6,8:3,64:1 | json | one: `(defaults)` | 5000 | 2000 | 2.5 | 2.5 | 12.0 "
        "| 24.0 | 0.5 | met |" in lines
    )
    document = json.loads((tmp_path / "peers.json").read_text())
    assert document["goal_met_everywhere"] is False
    assert [m["samples_per_s"] for m in document["measurements"]] == [3000, 2000, 10000, 4000]
    csv_lines = (tmp_path / "peers.csv").read_text().splitlines()
    assert csv_lines[0].split(",")[:4] == ["model", "server", "batch", "encoding"]
    assert csv_lines[0].split(",")[-2:] == ["samples_per_s", "error"]
    assert '"1:6,8:3,64:1"' in csv_lines[3]


def test_a_report_that_cannot_be_rendered_leaves_the_earlier_one_whole(tmp_path):
    """peers.csv was written before the tables were rendered: a rendering that failed left
    this run's CSV beside an earlier run's peers.md and peers.json."""
    good = [_measurement("recserve:one", "64", 1500.0, 30.0)]
    peers_report.report(tmp_path, good, {"one": ""}, {})
    before = {
        name: (tmp_path / name).read_text() for name in ("peers.csv", "peers.json", "peers.md")
    }
    broken = _measurement("recserve:one", "64", 1500.0, 30.0)
    broken.samples_per_s = None  # type: ignore[assignment]  # the tables format it with :.0f
    with pytest.raises(TypeError) as failed:
        peers_report.report(tmp_path, [broken], {"one": ""}, {})
    assert str(failed.value) == "unsupported format string passed to NoneType.__format__"
    assert {name: (tmp_path / name).read_text() for name in before} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(before)  # no temporaries


def test_rounds_report_medians_and_each_rounds_ratio(tmp_path):
    measurements = [
        _measurement("recserve:one", "64", 1500.0, 30.0, 1),
        _measurement("torchserve", "64", 1000.0, 40.0, 1),
        _measurement("torchserve", "64", 600.0, 50.0, 2),  # round 2 runs in reverse order
        _measurement("recserve:one", "64", 1800.0, 20.0, 2),
        _measurement("recserve:one", "64", 2100.0, 25.0, 3),
        _measurement("torchserve", "64", 1000.0, 60.0, 3),
    ]
    measurements[1].failures = 2
    summary = peers_report.report(tmp_path, measurements, {"one": ""}, {})
    lines = summary.splitlines()
    # Medians: recserve 1800 req/s, p99 25; TorchServe 1000 req/s, p99 50. Rounds: 1500/1000,
    # 1800/600, 2100/1000.
    assert (
        "| adult | 64 | json | one: `(defaults)` | 1800 | 1000 | 1.8 | 1.5 / 3.0 / 2.1 | 25.0 "
        "| 50.0 | 0.5 | not met (failed requests or no stats) |" in lines
    )
    detail = [line for line in lines if line.startswith("| adult | 64 | json | torchserve |")]
    assert [line.split(" | ")[4:6] for line in detail] == [
        ["1", "1000"],
        ["2", "600"],
        ["3", "1000"],
    ]
    combined = peers_measure.combine_rounds([m for m in measurements if m.server == "torchserve"])
    assert (combined.rps, combined.p99_ms, combined.failures) == (1000.0, 50.0, 2)
    assert combined.round == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rounds", "11"], "1..10 rounds"),
        (["--rounds", "0"], "1..10 rounds"),
        (["--warmup-seconds", "-1"], "--warmup-seconds must be within 0..120, got -1"),
        (["--warmup-seconds", "500"], "--warmup-seconds must be within 0..120, got 500"),
        (["--ceiling-workers", "9"], "--ceiling-workers must be within 0..8, got 9"),
        (["--model-only-workers", "-1"], "--model-only-workers must be within 0..8, got -1"),
    ],
)
def test_rounds_and_warmup_are_bounded(flags, message, capsys):
    with pytest.raises(SystemExit):
        peers.parse_args(["--out", "x", "--batches", "1", *flags])
    assert message in capsys.readouterr().err


def test_defaults_warm_up_and_measure_once():
    args = peers.parse_args(["--out", "x", "--batches", "1"])
    assert (args.rounds, args.warmup_seconds) == (1, 10.0)
    assert (args.ceiling_workers, args.model_only_workers) == (2, 0)


def test_reference_servers_are_compared_with_torchserve_and_the_best_recserve(tmp_path):
    measurements = [
        _measurement("recserve:one", "64", 1500.0, 30.0),
        _measurement("recserve:workers2", "64", 1800.0, 35.0),
        _measurement("ceiling", "64", 9000.0, 10.0),
        _measurement("model-only", "64", 2400.0, 30.0),
        _measurement("torchserve", "64", 1000.0, 50.0),
        _measurement("recserve:one", "1", 6000.0, 10.0),
        _measurement("model-only", "1", 3000.0, 12.0),
        _measurement("torchserve", "1", 2000.0, 30.0),
    ]
    lines = peers_report.report(
        tmp_path, measurements, {"one": "", "workers2": ""}, {}
    ).splitlines()
    header = lines.index(
        "| model | batch | encoding | no-work ceiling req/s | no-work ceiling / TorchServe | "
        "best recserve / no-work ceiling | model-only req/s | model-only / TorchServe | "
        "best recserve / model-only |"
    )
    assert lines[header + 2 : header + 4] == [
        "| adult | 64 | json | 9000 | 9.0 | 0.2 | 2400 | 2.4 | 0.75 |",
        "| adult | 1 | json | - | - | - | 3000 | 1.5 | 2.0 |",
    ]


def test_no_reference_table_without_reference_servers(tmp_path):
    measurements = [
        _measurement("recserve:one", "64", 1500.0, 30.0),
        _measurement("torchserve", "64", 1000.0, 50.0),
    ]
    summary = peers_report.report(tmp_path, measurements, {"one": ""}, {})
    assert "no-work ceiling" not in summary and "model-only" not in summary


def test_a_comparison_without_torchserve_installed_is_refused_up_front(tmp_path, capsys):
    """It used to run every cell and print nan ratios (exit 0)."""
    code = peers.main(
        ["--out", str(tmp_path / "out"), "--batches", "1", "--ts-venv", str(tmp_path)]
    )
    assert code == 2
    assert f"--ts-venv {tmp_path} has no bin/torchserve" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_the_goal_is_met_on_its_bounds_and_only_against_torchserve(tmp_path):
    """Goal: recserve at least 2x TorchServe's req/s with a p99 no higher; exactly 2.0 and
    1.0 meet it. Without any TorchServe measurement the goal is not met anywhere."""
    on_bounds = [
        _measurement("recserve:one", "64", 2000.0, 30.0),
        _measurement("torchserve", "64", 1000.0, 30.0),
    ]
    lines = peers_report.report(tmp_path, on_bounds, {"one": ""}, {}).splitlines()
    assert (
        "| adult | 64 | json | one: `(defaults)` | 2000 | 1000 | 2.0 | 2.0 | 30.0 | 30.0 | 1.0 "
        "| met |" in lines
    )
    assert json.loads((tmp_path / "peers.json").read_text())["goal_met_everywhere"] is True
    alone = [_measurement("recserve:one", "64", 2000.0, 30.0)]
    lines = peers_report.report(tmp_path, alone, {"one": "--workers 2"}, {}).splitlines()
    assert (
        "| adult | 64 | json | one: `--workers 2` | 2000 | nan | None | - | 30.0 | - | None "
        "| not met |" in lines
    )
    assert json.loads((tmp_path / "peers.json").read_text())["goal_met_everywhere"] is False


def test_ratios_need_two_measured_numbers():
    assert peers_report.ratio(3.0, 2.0) == 1.5
    assert peers_report.ratio(1.0, 3.0) == 0.33
    for a, b in ((0.0, 5.0), (None, 5.0), (5.0, 0.0), (5.0, None)):
        assert peers_report.ratio(a, b) is None, (a, b)


def test_a_cell_is_a_batch_size_or_a_mix():
    assert peers_measure.batch_label("64") == "64"
    assert peers_measure.batch_label("8:1") == "mix 8:1"  # what --mix 8 becomes
    assert peers_measure.batch_label("1:6,8:3") == "mix 1:6,8:3"


def test_combined_rounds_keep_the_first_error_and_add_requests():
    rounds = [_measurement("torchserve", "64", rps, 10.0, k) for k, rps in ((1, 5.0), (2, 7.0))]
    rounds += [_measurement("torchserve", "64", 9.0, 10.0, 3)]
    rounds[0].requests, rounds[1].requests, rounds[2].requests = 10, 20, 30
    rounds[1].error, rounds[2].error = "no locust stats: first", "no locust stats: second"
    combined = peers_measure.combine_rounds(rounds)
    # Only round 1 measured: the medians are its own.
    assert (combined.requests, combined.rps, combined.error) == (60, 5.0, "no locust stats: first")


def test_a_round_without_locust_stats_is_no_zero_in_the_medians():
    """measure() returns 0 req/s and no p99 for a round whose locust wrote no stats: counted,
    rounds of 1500 and 1700 req/s with one such round gave a median of 1500, and with two
    rounds, one failed, a median of 750."""
    measured = [
        _measurement("recserve:one", "64", rps, 20.0, k) for k, rps in ((1, 1500.0), (3, 1700.0))
    ]
    empty = peers_measure.Measurement("adult", "recserve:one", "64", "json", 32, 20.0, 2)
    empty.error = "no locust stats: FileNotFoundError()"
    combined = peers_measure.combine_rounds([measured[0], empty, measured[1]])
    assert (combined.rps, combined.p99_ms, combined.samples_per_s) == (1600.0, 20.0, 3200.0)
    assert combined.error == "no locust stats: FileNotFoundError()"
    assert peers_measure.combine_rounds([measured[0], empty]).rps == 1500.0
    alone = peers_measure.combine_rounds([empty])
    assert (alone.rps, alone.p99_ms, alone.error) == (0.0, None, empty.error)


@pytest.mark.parametrize(
    "flags",
    [["--users", "0"], ["--users", "513"], ["--seconds", "0"], ["--seconds", "600.5"]],
)
def test_runs_are_bounded(flags, capsys):
    with pytest.raises(SystemExit) as exited:
        peers.parse_args(["--batches", "1", *flags])
    assert exited.value.code == 2
    assert "bounded runs only: 1..512 users, at most 600 s per run" in capsys.readouterr().err


def test_bounds_themselves_are_accepted():
    args = peers.parse_args(
        ["--users", "512", "--seconds", "600", "--rounds", "10", "--warmup-seconds", "0"]
    )
    assert (args.users, args.seconds, args.rounds, args.warmup_seconds) == (512, 600.0, 10, 0.0)
    args = peers.parse_args(["--users", "1", "--rounds", "1", "--warmup-seconds", "120"])
    assert (args.users, args.rounds, args.warmup_seconds) == (1, 1, 120.0)


def test_a_variant_with_more_than_one_process_is_recognized_in_either_spelling():
    """Its /metrics would be one process's of N: such variants report no batching figures."""
    assert peers.multi_process("--workers 2")
    assert peers.multi_process("--max-batch-size 64 --workers=3")
    assert not peers.multi_process("--workers 1")
    assert not peers.multi_process("--workers=1")
    assert not peers.multi_process("")
    assert not peers.multi_process("--workers")  # no value: the server refuses it, no crash here
    # The last --workers given is the one the server reads.
    assert not peers.multi_process("--workers 2 --workers=1")
    assert peers.multi_process("--workers=1 --workers 3")


def test_odd_rounds_measure_in_order_and_even_rounds_in_reverse():
    runs = ["recserve:one", "ceiling", "torchserve"]
    assert [peers_measure.round_order(runs, k) for k in (1, 2, 3)] == [
        ["recserve:one", "ceiling", "torchserve"],
        ["torchserve", "ceiling", "recserve:one"],
        ["recserve:one", "ceiling", "torchserve"],
    ]
    assert runs == ["recserve:one", "ceiling", "torchserve"]  # the cell's own list unchanged


def _binary_answer(outputs: list[tuple[dict, bytes]]) -> tuple[bytes, str]:
    header = json.dumps({"model_name": "m", "outputs": [o for o, _ in outputs]}).encode()
    return header + b"".join(data for _, data in outputs), str(len(header))


def test_answers_are_decoded_from_json_or_the_binary_extension():
    import numpy as np

    document, values = peers_crosscheck.decode_answer(
        json.dumps({"outputs": [{"name": "other", "data": [9]},
                                {"name": "prediction", "data": [0.25, 0.5]}]}).encode(),
        None,
    )  # fmt: skip
    assert values.tolist() == [0.25, 0.5] and values.dtype == np.float64
    assert document["outputs"][0]["name"] == "other"
    prediction = np.array([[0.75], [-1.5]], "<f4").tobytes()
    scores = np.array([1.0, 2.0, 3.0], "<f4").tobytes()
    binary = {"datatype": "FP32", "parameters": {"binary_data_size": 8}}
    body, length = _binary_answer(
        [
            ({"name": "scores", "datatype": "FP32", "shape": [3],
              "parameters": {"binary_data_size": 12}}, scores),
            ({"name": "prediction", "shape": [2, 1], **binary}, prediction),
        ]
    )  # fmt: skip
    assert peers_crosscheck.decode_answer(body, length)[1].tolist() == [0.75, -1.5]
    # A JSON output inside a binary answer takes no bytes.
    body, length = _binary_answer(
        [({"name": "prediction", "shape": [1], "datatype": "FP32", "data": [0.5]}, b"")]
    )
    assert peers_crosscheck.decode_answer(body, length)[1].tolist() == [0.5]


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        # Sizes that disagree with the shape, or a datatype other than FP32.
        ([({"name": "prediction", "datatype": "FP32", "shape": [3],
            "parameters": {"binary_data_size": 8}}, b"\0" * 8)], "output 'prediction': 8 bytes"),
        ([({"name": "prediction", "datatype": "FP64", "shape": [1],
            "parameters": {"binary_data_size": 4}}, b"\0" * 4)], "output 'prediction': 4 bytes"),
    ],
)  # fmt: skip
def test_a_malformed_binary_answer_is_refused(outputs, message):
    body, length = _binary_answer(outputs)
    with pytest.raises(ValueError, match=message):
        peers_crosscheck.decode_answer(body, length)


@pytest.mark.parametrize(("name", "extra"), [("prediction", 4), ("other", 0)])
def test_unclaimed_bytes_or_no_prediction_are_refused(name, extra):
    """4 bytes past the last output, or no ``prediction`` output: both refused, naming the
    answer's length and the bytes its header claims."""
    output = {"name": name, "datatype": "FP32", "shape": [1],
              "parameters": {"binary_data_size": 4}}  # fmt: skip
    body, length = _binary_answer([(output, b"\0" * (4 + extra))])
    claimed = int(length) + 4
    with pytest.raises(ValueError, match=f"binary answer of {claimed + extra} bytes: {claimed} "):
        peers_crosscheck.decode_answer(body, length)


def test_a_batch_size_that_is_not_a_number_is_refused_even_with_a_mix(capsys):
    with pytest.raises(SystemExit) as exited:
        peers.parse_args(["--batches", "1,x", "--mix", "8"])
    assert exited.value.code == 2
    assert "bad batch sizes '1,x': use a comma list of integers >= 1" in capsys.readouterr().err


def test_the_reference_table_has_columns_only_for_measured_references(tmp_path):
    measurements = [
        _measurement("recserve:one", "64", 1500.0, 30.0),
        _measurement("ceiling", "64", 6000.0, 10.0),
        _measurement("torchserve", "64", 1000.0, 50.0),
    ]
    lines = peers_report.report(tmp_path, measurements, {"one": ""}, {}).splitlines()
    header = lines.index(
        "| model | batch | encoding | no-work ceiling req/s | no-work ceiling / TorchServe | "
        "best recserve / no-work ceiling |"
    )
    assert lines[header + 1 : header + 3] == [
        "|---|---:|---|---:|---:|---:|",
        "| adult | 64 | json | 6000 | 6.0 | 0.25 |",
    ]


def test_a_cell_without_torchserve_does_not_decide_the_goal(tmp_path):
    """TorchServe may fail to serve one model: the goal is judged on the cells it answered."""
    measurements = [
        _measurement("recserve:one", "64", 2500.0, 30.0),
        _measurement("torchserve", "64", 1000.0, 40.0),
        _measurement("recserve:one", "1", 900.0, 5.0),  # no TorchServe run in this cell
    ]
    peers_report.report(tmp_path, measurements, {"one": ""}, {})
    assert json.loads((tmp_path / "peers.json").read_text())["goal_met_everywhere"] is True


def test_the_goal_is_judged_on_unrounded_ratios_of_runs_without_failures(tmp_path):
    """1999 req/s against 1000 shows as 2.0 and was "met", as was a p99 of 30.1 ms against
    30.0 (1.0 rounded); and a recserve failing 500 requests fast counted as twice as fast."""

    def goal(recserve: tuple[float, float], torchserve: tuple[float, float], **changes) -> str:
        ours = _measurement("recserve:one", "64", *recserve)
        peer = _measurement("torchserve", "64", *torchserve)
        for name, value in changes.items():
            side, _, field = name.partition("_")
            setattr(ours if side == "ours" else peer, field, value)
        lines = peers_report.report(tmp_path, [ours, peer], {"one": ""}, {}).splitlines()
        row = next(line for line in lines if line.startswith("| adult | 64 | json | one:"))
        met = json.loads((tmp_path / "peers.json").read_text())["goal_met_everywhere"]
        assert met == (row.rsplit(" | ", 1)[1] == "met |"), row
        return row

    assert goal((1999.0, 30.0), (1000.0, 30.0)).endswith(
        "| 2.0 | 2.0 | 30.0 | 30.0 | 1.0 | not met |"
    )
    assert goal((2000.0, 30.1), (1000.0, 30.0)).endswith(
        "| 2.0 | 2.0 | 30.1 | 30.0 | 1.0 | not met |"
    )
    assert goal((2000.0, 30.0), (1000.0, 30.0)).endswith("| 1.0 | met |")
    for changes in ({"ours_failures": 500}, {"peer_failures": 1}):
        assert goal((5000.0, 10.0), (1000.0, 30.0), **changes).endswith(
            "| 0.33 | not met (failed requests or no stats) |"
        ), changes
    # A TorchServe run without locust stats (its numbers unmeasured): nothing to compare.
    assert goal((5000.0, 10.0), (1000.0, 30.0), peer_error="no locust stats").endswith(
        "| None | not met (failed requests or no stats) |"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--models", "adult,synthtic"],
         "--models: unknown model(s) synthtic: use a comma list of adult, synthetic"),
        (["--models", " , "], "--models: unknown model(s) (none given)"),
        (["--ts-workers", "0"], "--ts-workers must be within 1..64, got 0"),
        (["--ts-batch-size", "0"], "--ts-batch-size must be within 1..4096, got 0"),
        (["--ts-max-batch-delay-ms", "-1"], "--ts-max-batch-delay-ms must be within 0..10000"),
    ],
)  # fmt: skip
def test_models_and_torchserve_settings_are_checked_before_anything_starts(flags, message, capsys):
    """A misspelt second model was found after the first one's checkpoint was trained (up to
    10 minutes); TorchServe settings it refuses only after its JVM started."""
    with pytest.raises(SystemExit):
        peers.parse_args(["--out", "x", "--batches", "1", *flags])
    assert message in capsys.readouterr().err
    args = peers.parse_args(["--models", " synthetic, adult,synthetic", "--ts-max-batch-delay-ms",
                             "0"])  # fmt: skip
    assert (args.models, args.ts_max_batch_delay_ms) == (["synthetic", "adult"], 0)
    assert peers.parse_args([]).models == ["adult", "synthetic"]


def test_an_interrupted_ceiling_server_start_stops_it(tmp_path, monkeypatch):
    """peers.py turns SIGTERM into SystemExit: raised while the ceiling (or model-only)
    server was still loading, it left uvicorn running, since peers.py held no handle yet."""
    import subprocess

    import peers_servers

    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen(command: list[str], **kwargs) -> subprocess.Popen:  # uvicorn, loading
        started.append(real_popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs))
        return started[-1]

    def live(url: str, body: bytes | None, timeout: float) -> None:
        raise SystemExit("stopped by signal 15")

    monkeypatch.setattr(peers_servers.subprocess, "Popen", popen)
    monkeypatch.setattr(peers_servers, "http_json", live)
    server = peers_servers.CeilingServer(1, tmp_path / "ceiling.log")
    try:
        with pytest.raises(SystemExit):
            server.start(timeout=30)
        assert started[0].poll() == -15  # SIGTERM, by its PID
    finally:
        if started and started[0].poll() is None:
            started[0].kill()
            started[0].wait(timeout=10)


_STATS_CSV = (
    "Type,Name,Request Count,Failure Count,Median Response Time,Average Response Time,"
    "Min Response Time,Max Response Time,Average Content Size,Requests/s,Failures/s,50%,66%,"
    "75%,80%,90%,95%,98%,99%,99.9%,99.99%,100%\n"
    ",Aggregated,900,0,5,6.0,1,90,100,300.0,0.0,5,6,7,8,9,10,12,14,20,30,90\n"
)
#: A stand-in for ``python -m locust``: writes the per-second stats CSV, then, as told by
#: its argument, crashes (exit 3) or writes its final stats and exits 0, 1 or 2 (with
#: ``failures`` failed requests), or hangs.
_FAKE_LOCUST = """
import json, os, sys, time
prefix, how = sys.argv[1], sys.argv[2]
open(prefix + "_stats.csv", "w").write(sys.argv[3])
print("locust log line")
if how == "crash":
    sys.exit(3)
code, failures = (int(x) for x in how.split(":")) if how != "hang" else (0, 0)
total = {"name": "Aggregated", "requests": 1000, "failures": failures, "rps": 333.0,
         "p50_ms": 5.0, "p99_ms": 15.0}
row = {**total, "name": "v2-json b64"}
document = {"written_unix": time.time(), "exit_code": code, "stats": [row, total],
            "exceptions": []}
open(os.environ["RECSERVE_LT_FINAL_STATS"], "w").write(json.dumps(document))
if how == "hang":
    time.sleep(60)
sys.exit(code)
"""


def test_a_locust_that_crashed_or_hung_is_a_round_with_an_error(tmp_path, monkeypatch):
    """A locust that crashed mid-run (no final stats) got numbers from its per-second CSV
    (which misses the end of the run) with no error, and one still running past its end was
    stopped silently; its exit code was never read."""
    import argparse
    import os

    monkeypatch.setattr(peers_measure, "LOCUST_OVERRUN_S", 0.5)
    how = ["crash"]
    monkeypatch.setattr(
        peers_measure.LocustRun,
        "command",
        lambda run: [sys.executable, "-c", _FAKE_LOCUST, str(run.csv_prefix), how[0], _STATS_CSV],
    )
    (tmp_path / "locust").mkdir()
    args = argparse.Namespace(seconds=0.2, users=2)

    def measure(kind: str) -> peers_measure.Measurement:
        how[0] = kind
        return peers_measure.measure(
            label="torchserve", model="adult", batch="64", encoding="json", host="http://x",
            user_class="TorchServeJsonUser", server_pid=os.getpid(), env={}, args=args,
            out=tmp_path,
        )  # fmt: skip

    log = tmp_path / "locust" / "adult-torchserve-json-b64-r1.log"
    crashed = measure("crash")
    assert crashed.error == (
        f"locust exited with code 3 and wrote no final stats "
        f"(adult-torchserve-json-b64-r1_final.json); {log}:\nlocust log line"
    )
    assert (crashed.rps, crashed.requests, crashed.p99_ms) == (0.0, 0, None)
    unexplained = measure("2:0")
    assert unexplained.error == f"locust exited with code 2; {log}:\nlocust log line"
    assert unexplained.rps == 0.0
    hung = measure("hang")
    assert hung.error == (
        "locust was still running 0.5 s after the end of its 0.2 s load and was stopped "
        "(exit code -15)"
    )
    assert hung.rps == 0.0
    failed = measure("1:7")  # locust's exit 1 for failed requests: the numbers stand
    assert (failed.error, failed.rps, failed.failures, failed.p99_ms) == ("", 333.0, 7, 15.0)
    assert (failed.samples_per_s, failed.requests) == (333.0 * 64, 1000)


def test_only_the_ceiling_servers_answers_go_unchecked(tmp_path, monkeypatch):
    """The load-test users now count a 200 whose answer lacks a prediction per row as a
    failure; the no-work ceiling answers one fixed prediction to every request, by design, so
    peers.py measures it with the answers' check off (and every real server with it on)."""
    import argparse
    import os

    class StartedError(Exception):
        pass

    seen = []

    def start(run):
        seen.append(run.env["RECSERVE_LT_CHECK_ANSWERS"])
        raise StartedError

    monkeypatch.setattr(peers_measure.LocustRun, "start", start)
    for check in (True, False):
        with pytest.raises(StartedError):
            peers_measure.measure(
                label="ceiling", model="adult", batch="64", encoding="json", host="http://x",
                user_class="KServeJsonUser", server_pid=os.getpid(), env={},
                args=argparse.Namespace(seconds=1.0, users=2), out=tmp_path, check_answers=check,
            )  # fmt: skip
    assert seen == ["1", "0"]
