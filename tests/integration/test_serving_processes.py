"""``recserve serve --workers 2``: two server processes share the ports and stop together."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np

from clients import RecserveClient
from examples.adult_income import features


def test_two_server_processes_answer_on_shared_ports_and_drain(adult_checkpoint, tmp_path):
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        parent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "embedding_store.cli",
                "serve",
                "--checkpoint",
                str(adult_checkpoint),
                "--http-port",
                "0",
                "--grpc-port",
                "0",
                "--workers",
                "2",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,  # its own group: teardown can end the children too
        )
    try:
        deadline = time.monotonic() + 120
        lines: list[str] = []
        while len(lines) < 2:
            assert parent.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "two server processes did not start"
            lines = re.findall(
                r"HTTP listening on \S+:(\d+), gRPC listening on \S+:(\d+)", log.read_text()
            )
            time.sleep(0.2)
        assert lines[0] == lines[1]  # the same ports, shared
        http_port, grpc_port = lines[0]
        batch = next(features.read_batches(features.TEST_PATH, 16, requires_grad=False))
        answers = []
        for url in (f"http://127.0.0.1:{http_port}", f"grpc://127.0.0.1:{grpc_port}"):
            with RecserveClient(url) as client:
                for _ in range(10):  # new connections land on either process
                    answers.append(client.predict(batch).predictions)
        for answer in answers[1:]:
            np.testing.assert_allclose(answer, answers[0], rtol=0, atol=1e-6)
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=60) == 0
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)  # the group this test started
            parent.wait()
