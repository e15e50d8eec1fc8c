"""``recserve eval`` and ``recserve checkpoint ...`` run as a user runs them (subprocesses).

The session's Adult checkpoint (one epoch; tests/conftest.py) is used, never changed. Checked:

* eval of the test split reproduces the AUC the training run reported, exactly;
* ``eval --compare`` passes against a real ``recserve serve`` of the same checkpoint (KServe v2
  and friendly routes), and fails with exit 3 and a difference report against a server of a
  perturbed copy;
* checkpoint verify/inspect/reshard/diff/export-dense on good, truncated, corrupted and
  incomplete checkpoints, and their refusal to overwrite;
* bad CSV rows: reported as file:line, skipped with ``--bad-rows skip``, fatal otherwise.

Servers run in their own sessions and are killed by process group on teardown.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

ROOT = Path(__file__).resolve().parents[2]
MAPPING = ROOT / "examples" / "adult_income" / "feature_mapping.yml"
TEST_DATA = ROOT / "examples" / "adult_income" / "data" / "test.csv.gz"
TEST_ROWS = 16281
TIMEOUT = 180


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RECSERVE_EMBEDDING_WORKERS", None)
    return env


def recserve(*args: object, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "embedding_store.cli", *map(str, args)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def recserve_all(*commands: Sequence[object]) -> list[subprocess.CompletedProcess]:
    """``recserve(*command)`` for each command, two at a time (each process spends most of its
    ~1.5 s importing torch, on one core); results in the order given."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda command: recserve(*command), commands))


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def trained(adult_checkpoint, adult_checkpoint_metrics) -> tuple[Path, dict]:
    """(checkpoint, what its training reported): the session's Adult checkpoint (one epoch,
    seed 0, tests/conftest.py), shared with the integration tests; read only here."""
    return adult_checkpoint, adult_checkpoint_metrics


def perturbed_copy(source: Path, target: Path, delta: float = 0.05) -> Path:
    """A valid checkpoint whose embedding rows (every other one) moved by ``delta``."""
    shutil.copytree(source, target)
    manifest_path = target / "embeddings" / "embedding_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["files"]:
        path = target / "embeddings" / entry["path"]
        tensors = safetensors.numpy.load(path.read_bytes())
        tensors["weights"] = tensors["weights"].copy()
        tensors["weights"][::2] += np.float32(delta)
        payload = safetensors.numpy.save(tensors)
        path.write_bytes(payload)
        entry.update(bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return target


class Server:
    """``recserve serve`` in its own session; ``url`` once it printed its HTTP address."""

    def __init__(self, checkpoint: Path, log: Path) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "embedding_store.cli", "serve", "--checkpoint",
                 str(checkpoint), "--http-port", "0", "--grpc-port", "0", "--output-transform",
                 "sigmoid", "--grace-seconds", "1", "--preprocessor",
                 "examples.adult_income.preprocess:instances_to_batch"],
                cwd=ROOT,
                env=_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.url: str | None = None

    def wait_url(self, timeout: float = 90.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_text(errors="replace")
            match = re.search(r"HTTP listening on ([\d.]+):(\d+)", text)
            if match:
                self.url = f"http://{match.group(1)}:{match.group(2)}"
                return self.url
            assert self.process.poll() is None, f"server exited:\n{text}"
            time.sleep(0.1)
        raise AssertionError(f"server did not start:\n{self.log.read_text(errors='replace')}")

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def no_temporaries(directory: Path) -> None:
    leftovers = [p.name for p in directory.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert not leftovers, leftovers


# --------------------------------------------------------------------------- eval
def test_eval_reproduces_training_auc_and_writes_a_report(trained, tmp_path):
    checkpoint, metrics = trained
    out, report = tmp_path / "predictions.csv", tmp_path / "report"
    result = recserve(
        "eval", "--checkpoint", checkpoint, "--data", TEST_DATA, "--mapping", MAPPING,
        "--output-transform", "sigmoid", "--out", out, "--report", report,
    )  # fmt: skip
    ok(result)
    assert "eval: 16,281 rows" in result.stderr  # the progress line
    data = json.loads((report / "report.json").read_text())
    # Batches of 256+ rows run on oneDNN kernels (serving.onednn_linear), which round
    # differently from the model training evaluated (~1e-7 per prediction): the AUC agrees to
    # ~1e-8, where another checkpoint would be off by 1e-3 or more.
    assert data["auc"] == pytest.approx(metrics["test_auc"], abs=1e-6)
    assert data["counts"]["rows"] == TEST_ROWS and data["counts"]["skipped_rows"] == 0
    assert data["counts"]["positives"] + data["counts"]["negatives"] == TEST_ROWS
    assert 0.0 < data["log_loss"] < 0.7
    assert 0.0 <= data["calibration"]["expected_calibration_error"] < 0.1
    assert sum(b["count"] for b in data["calibration"]["bins"]) == TEST_ROWS
    assert 0.0 <= data["unknown_ids"]["ratio"] < 0.01
    for name in ("roc.png", "calibration.png", "summary.md"):
        assert (report / name).stat().st_size > 0, name
    assert "| AUC |" in (report / "summary.md").read_text()
    with open(out, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == TEST_ROWS
    assert rows[0]["source"] == str(TEST_DATA) and rows[0]["position"] == "2"
    assert all(0.0 <= float(r["prediction"]) <= 1.0 for r in rows[:100])
    no_temporaries(tmp_path)

    # Outputs are never overwritten unless asked.
    again = recserve(
        "eval", "--checkpoint", checkpoint, "--data", TEST_DATA, "--mapping", MAPPING,
        "--out", out,
    )  # fmt: skip
    assert again.returncode == 1 and "already exists" in again.stderr


def test_compare_passes_against_the_same_checkpoint_and_fails_against_a_perturbed_one(
    trained, tmp_path
):
    checkpoint, _ = trained
    perturbed = perturbed_copy(checkpoint, tmp_path / "perturbed")
    good, bad = Server(checkpoint, tmp_path / "good.log"), Server(perturbed, tmp_path / "bad.log")
    try:
        good_url, bad_url = good.wait_url(), bad.wait_url()
        common = ["--checkpoint", checkpoint, "--data", TEST_DATA, "--mapping", MAPPING,
                  "--output-transform", "sigmoid", "--quiet"]  # fmt: skip
        # Without the server's --output-transform the comparison fails, and says why.
        plain = [a for a in common if a not in ("--output-transform", "sigmoid")]
        rows_30 = tmp_path / "rows30.csv"
        with gzip.open(TEST_DATA, "rt", newline="") as handle:
            rows_30.write_text("".join(next(handle) for _ in range(31)))  # header + 30 rows
        same, logits, result = recserve_all(
            # KServe v2 binary tensors (rows encoded by the client): identical predictions.
            ["eval", "--compare", "--url", good_url, *common, "--out", tmp_path / "same.csv"],
            ["eval", "--compare", "--url", good_url, *plain, "--data", rows_30,
             "--out", tmp_path / "logits.csv"],
            # Friendly route (raw rows, encoded by the server's preprocessor), perturbed model.
            ["eval", "--compare", "--url", bad_url, "--protocol", "friendly", *common,
             "--out", tmp_path / "differ.parquet", "--report", tmp_path / "differ-report"],
        )  # fmt: skip
        assert "parity OK: 16281 rows" in ok(same), same.stdout
        assert logits.returncode == 3, logits.stdout + logits.stderr
        assert "the server runs --output-transform sigmoid; pass it" in logits.stdout

        assert result.returncode == 3, result.stdout + result.stderr
        assert "parity FAILED" in result.stdout
        assert re.search(r"test\.csv\.gz:\d+: in-process [\d.e-]+ +server [\d.e-]+", result.stdout)
        assert "note: the checkpoint is version" not in result.stdout  # same version string
        compare = json.loads((tmp_path / "differ-report" / "report.json").read_text())["compare"]
        assert not compare["identical"] and compare["differing_rows"] > 0
        assert compare["max_abs_diff"] > 1e-6 and compare["first_differences"]
        assert (tmp_path / "differ.parquet").stat().st_size > 0  # written for inspection
    finally:
        good.stop()
        bad.stop()


def _bad_rows_csv(path: Path) -> tuple[int, list[int]]:
    """The first 30 test rows plus three broken ones; returns (good rows, bad line numbers)."""
    with gzip.open(TEST_DATA, "rt", newline="") as handle:
        lines = [next(handle) for _ in range(31)]  # header + 30 rows
    header = lines[0].strip().split(",")
    age = header.index("age")
    broken_age = lines[5].strip().split(",")
    broken_age[age] = "forty"
    lines[5] = ",".join(broken_age) + "\n"  # line 6: not a number
    lines[10] = lines[10].strip() + ",extra\n"  # line 11: one field too many
    lines[20] = lines[20].strip().rsplit(",", 1)[0] + ",maybe\n"  # line 21: unknown label
    path.write_text("".join(lines))
    return 27, [6, 11, 21]


def test_bad_rows_are_reported_by_line_and_skipped_or_fatal(trained, tmp_path):
    checkpoint, _ = trained
    data = tmp_path / "bad.csv"
    good_rows, bad_lines = _bad_rows_csv(data)
    common = ["eval", "--checkpoint", checkpoint, "--data", data, "--mapping", MAPPING, "--quiet"]

    result, failed = recserve_all(
        [*common, "--out", tmp_path / "skip.csv", "--report", tmp_path / "report",
         "--bad-rows", "skip"],
        [*common, "--out", tmp_path / "fail.csv"],  # --bad-rows fail: the default
    )  # fmt: skip
    ok(result)
    for line in bad_lines:
        assert f"{data}:{line}: " in result.stderr, result.stderr
    assert "'forty' is not a number" in result.stderr or "forty" in result.stderr
    assert "has 16 fields, the header has 15" in result.stderr
    assert "'maybe'" in result.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["counts"]["rows"] == good_rows and report["counts"]["skipped_rows"] == 3
    assert (tmp_path / "report" / "bad_rows.txt").read_text().count("\n") == 3
    with open(tmp_path / "skip.csv", newline="") as handle:
        assert len(list(csv.DictReader(handle))) == good_rows

    result = failed
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{data}:6: " in result.stderr and "--bad-rows skip" in result.stderr
    assert not (tmp_path / "fail.csv").exists()
    no_temporaries(tmp_path)


# --------------------------------------------------------------------------- checkpoint tools
def test_checkpoint_tools_on_good_and_damaged_checkpoints(trained, tmp_path):
    checkpoint, metrics = trained

    # Damaged copies: each fails verification with a message that names the problem.
    damaged = {}
    for kind in ("truncated", "flipped", "incomplete"):
        damaged[kind] = tmp_path / kind
        shutil.copytree(checkpoint, damaged[kind])
    table = next((damaged["truncated"] / "embeddings" / "shard_00000").glob("*.safetensors"))
    table.write_bytes(table.read_bytes()[: table.stat().st_size // 2])
    dense = damaged["flipped"] / "dense.pt"
    payload = bytearray(dense.read_bytes())
    payload[len(payload) // 2] ^= 0xFF
    dense.write_bytes(bytes(payload))
    (damaged["incomplete"] / "DONE").unlink()
    perturbed = perturbed_copy(checkpoint, tmp_path / "perturbed")
    three, exported = tmp_path / "three", tmp_path / "model.pt"
    # The commands that read only the checkpoint and the copies above, two at a time; what
    # each one checks follows in order.
    inspected, inspected_code, verified, from_damaged, resharded, perturbed_diff, export = (
        recserve_all(
            ["checkpoint", "inspect", checkpoint, "--json"],
            ["checkpoint", "inspect", checkpoint, "--json", "--load-code"],
            ["checkpoint", "verify", checkpoint, *damaged.values()],
            # Nothing is written from a damaged source, and nothing partial is left behind.
            ["checkpoint", "reshard", damaged["truncated"], "--shards", "2",
             "--out", tmp_path / "from-damaged"],
            # Reshard 1 -> 3 (verified, same version).
            ["checkpoint", "reshard", checkpoint, "--shards", "3", "--out", three],
            ["checkpoint", "diff", checkpoint, perturbed, "--json", "--exit-code"],
            # export-dense: a loadable TorchScript file.
            ["checkpoint", "export-dense", checkpoint, "--out", exported],
        )
    )  # fmt: skip

    info = json.loads(ok(inspected))
    assert info["forward_signature"] is None and not info["code_loaded"]  # not without asking
    info = json.loads(ok(inspected_code))
    assert info["version"] == metrics["checkpoint_version"] and info["step"] > 0
    assert info["forward_signature"].startswith("forward(")
    assert "Tensor[] embedding_tensors" in info["forward_signature"]
    assert info["feature_signature"]["non_id_features"][0]["sample_shape"] == [6]
    assert info["dense_parameter_count"] > 0
    emb = info["embeddings"]
    assert emb["num_shards"] == 1 and emb["rows_per_shard"] == [emb["rows"]]
    assert {s["name"]: s["dim"] for s in emb["slots"]}["capital_gain_value"] == 8
    assert sum(emb["rows_per_id_space"].values()) == emb["rows"]
    assert info["size_bytes"] > 0 and not info["problems"]

    result = verified
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"OK: checkpoint {checkpoint}" in result.stdout
    expected = {
        "truncated": "truncated or replaced",
        "flipped": "dense.pt is corrupt: SHA-256 mismatch",
        "incomplete": "no DONE marker",
    }
    for kind, message in expected.items():
        assert f"FAILED: checkpoint {damaged[kind]}: 1 problem(s):\n  - " in result.stderr, kind
        assert message in result.stderr, (kind, result.stderr)
    result = from_damaged
    assert result.returncode == 1 and "failed verification" in result.stderr
    assert not (tmp_path / "from-damaged").exists()

    # The 3-shard copy against the original: no row added, removed or changed.
    ok(resharded)
    before = sorted(str(p.relative_to(three)) for p in three.rglob("*"))
    truncated_jit = damaged["incomplete"]  # verified above: now another damage
    (truncated_jit / "DONE").write_bytes(b"")
    jit = truncated_jit / "jit_dense.pt"
    jit.write_bytes(jit.read_bytes()[:-10])
    ok(export)
    three_diff, overwrite_three, overwrite_export, bad_export = recserve_all(
        ["checkpoint", "diff", checkpoint, three, "--json"],
        # Refusal to overwrite leaves the existing checkpoint as it was.
        ["checkpoint", "reshard", checkpoint, "--shards", "2", "--out", three],
        # export-dense never writes over a file unless asked.
        ["checkpoint", "export-dense", checkpoint, "--out", exported],
        ["checkpoint", "export-dense", truncated_jit, "--out", tmp_path / "bad.pt"],
    )
    result = json.loads(ok(three_diff))
    assert result["identical"] and result["embeddings"]["shards"] == [1, 3]
    for space in result["embeddings"]["id_spaces"]:
        assert (space["added"], space["removed"], space["changed"]) == (0, 0, 0), space
    assert result["dense"]["max_abs_diff"] == 0.0
    assert result["dense"]["versions"] == [info["version"], info["version"]]

    result = overwrite_three
    assert result.returncode == 1 and "already exists" in result.stderr
    assert sorted(str(p.relative_to(three)) for p in three.rglob("*")) == before
    no_temporaries(tmp_path)

    # diff sees perturbed embedding rows (and --exit-code says so).
    result = perturbed_diff
    assert result.returncode == 1
    spaces = json.loads(result.stdout)["embeddings"]["id_spaces"]
    assert sum(s["changed"] for s in spaces) > 0
    assert max(s["max_abs_diff"] for s in spaces) == pytest.approx(0.05, abs=1e-3)

    # The exported file loads, and was not written over.
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is the promise
        model = torch.jit.load(str(exported))
    output = model([torch.zeros(2, 6)], [torch.zeros(2, 8) for _ in range(15)])
    assert tuple(output.shape) == (2, 1)
    result = overwrite_export
    assert result.returncode == 1 and "already exists" in result.stderr
    result = bad_export
    assert result.returncode == 1 and "truncated" in result.stderr
    assert not (tmp_path / "bad.pt").exists()
