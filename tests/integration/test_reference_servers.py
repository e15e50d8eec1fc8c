"""benchmarks/ceiling_server.py as peers.py runs it: uvicorn on loopback, the no-work ceiling
and the model-only server of a trained Adult checkpoint."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from load_tests import traffic

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO_ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import ceiling_server  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _start(checkpoint: Path | None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop(ceiling_server.CHECKPOINT_ENV, None)
    if checkpoint is not None:
        env[ceiling_server.CHECKPOINT_ENV] = str(checkpoint)
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "ceiling_server:app", "--app-dir", str(BENCHMARKS),
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited: {process.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v2/live", timeout=2):
                return process, url
        except OSError:
            time.sleep(0.2)
    process.kill()  # the server this helper started, by its own handle
    process.wait(timeout=30)
    raise AssertionError("the server did not answer within 90 s")


@pytest.fixture
def reference_server() -> Iterator:
    started: list[subprocess.Popen] = []

    def start(checkpoint: Path | None) -> str:
        process, url = _start(checkpoint)
        started.append(process)
        return url

    yield start
    for process in started:
        process.kill()  # only the servers this test started, by their own handle
        process.wait(timeout=30)


def _request(rows: int) -> bytes:
    """A KServe v2 JSON body of ``rows`` rows (the model-only server reads only its shape)."""
    return traffic.encode_kserve_json({"workclass": np.arange(rows, dtype=np.int64)})


def test_model_only_pays_one_model_call_per_merged_batch_of_rows(adult_checkpoint):
    server = ceiling_server.ModelOnly(str(adult_checkpoint), merged_rows=8)
    outputs: list[np.ndarray] = []
    forward = server.model.forward

    def recording_forward(batch, lookup):
        outputs.append(forward(batch, lookup))
        return outputs[-1]

    server.model.forward = recording_forward
    server.run(5)
    assert (outputs, server.pending_rows) == ([], 5)
    server.run(5)  # 10 rows: one call of 8, 2 rows left
    assert (len(outputs), server.pending_rows) == (1, 2)
    server.run(14)  # 16 rows: two calls, none left
    assert (len(outputs), server.pending_rows, server.calls) == (3, 0, 3)
    assert all(output.shape == (8, 1) for output in outputs)
    assert all(((output > 0) & (output < 1)).all() for output in outputs)  # sigmoid
    np.testing.assert_array_equal(outputs[0], outputs[2])  # the same rows every call


def test_model_only_server_answers_and_refuses_a_body_without_a_batch_size(
    adult_checkpoint, reference_server
):
    url = reference_server(adult_checkpoint)
    status, answer = _post(f"{url}/v2/models/model/infer", _request(64))
    assert status == 200
    assert answer["outputs"][0]["name"] == "prediction"
    status, answer = _post(f"{url}/v2/models/model/infer", b"{}")
    assert status == 400
    assert 'no "shape":[rows (1..4096)' in answer["error"]


def test_no_work_ceiling_answers_any_body(reference_server):
    url = reference_server(None)
    fixed = json.loads(ceiling_server.RESPONSE)
    assert _post(f"{url}/v2/models/model/infer", b"{}") == (200, fixed)
    assert _post(f"{url}/v2/models/model/infer", _request(64)) == (200, fixed)


def test_model_only_server_refuses_to_start_on_a_missing_checkpoint(tmp_path):
    with pytest.raises(AssertionError, match=r"checkpoint \S+absent does not exist"):
        _start(tmp_path / "absent")
