"""``recserve serve --workers 2``: two server processes share the ports and stop together."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from clients import RecserveClient
from embedding_store.errors import UnavailableError
from examples.adult_income import features
from tests.integration.conftest import write_infer_global_config


def wait_until(condition, message: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.2)


def test_two_server_processes_answer_on_shared_ports_and_drain(adult_checkpoint, tmp_path):
    log = tmp_path / "serve.log"
    token_file = tmp_path / "admin-token"
    token_file.write_text("s3cr3t-admin-token\n")
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
                "--admin-token-file",
                str(token_file),
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
        # The admin token reaches the processes in their environment, never in a command
        # line that any local user can read.
        children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
        assert len(children) == 2
        # The supervisor only starts, signals and waits: it never loads torch (~280 MB).
        assert b"libtorch" not in Path(f"/proc/{parent.pid}/maps").read_bytes()
        for child in children:
            assert b"s3cr3t" not in Path(f"/proc/{child}/cmdline").read_bytes()
            assert b"RECSERVE_ADMIN_TOKEN=s3cr3t-admin-token\0" in (
                Path(f"/proc/{child}/environ").read_bytes()
            )
        batch = next(features.read_batches(features.TEST_PATH, 16, requires_grad=False))
        answers = []
        for url in (f"http://127.0.0.1:{http_port}", f"grpc://127.0.0.1:{grpc_port}"):
            with RecserveClient(url) as client:
                for _ in range(10):  # new connections land on either process
                    answers.append(client.predict(batch).predictions)
        for answer in answers[1:]:
            np.testing.assert_allclose(answer, answers[0], rtol=0, atol=1e-6)
        # A scrape reaches one process, whichever the kernel picks: each answers with every
        # process's counts, so no scrape misses the other's 10 answers or goes backwards.
        for _ in range(6):
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics") as scrape:
                text = scrape.read().decode()
            for protocol in ("http", "grpc"):
                ok = re.search(
                    rf'recserve_requests_total\{{[^}}]*outcome="ok"[^}}]*protocol="{protocol}"'
                    r"[^}]*\} ([0-9.e+]+)",
                    text,
                ) or re.search(
                    rf'recserve_requests_total\{{[^}}]*protocol="{protocol}"[^}}]*outcome="ok"'
                    r"[^}]*\} ([0-9.e+]+)",
                    text,
                )
                assert ok is not None and float(ok.group(1)) == 10.0, text
            assert re.search(r"^recserve_ready 1\.0$", text, re.M), text
            assert re.search(r"^recserve_pending_requests 0\.0$", text, re.M), text
            assert re.search(r"^recserve_batch_size_count 20\.0$", text, re.M), text
        metrics_directory = re.search(
            rb"PROMETHEUS_MULTIPROC_DIR=([^\0]+)\0",
            Path(f"/proc/{children[0]}/environ").read_bytes(),
        ).group(1)
        assert Path(metrics_directory.decode()).is_dir()
        # A reload would reach one process of the two: refused, saying what to do instead.
        reload = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/admin/reload", data=b"{}", method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(reload, timeout=30)
        assert refused.value.code == 409
        assert "--watch-seconds" in json.loads(refused.value.read())["error"]
        # A second multi-process server on either port would share its traffic (the
        # processes bind with SO_REUSEPORT): it must not start.
        for taken, ports in (("HTTP", (http_port, grpc_port)), ("gRPC", ("0", grpc_port))):
            second = subprocess.run(
                [
                    sys.executable, "-m", "embedding_store.cli", "serve",
                    "--checkpoint", str(adult_checkpoint), "--workers", "2",
                    "--http-port", ports[0], "--grpc-port", ports[1],
                ],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert second.returncode == 1, second.stderr
            port = http_port if taken == "HTTP" else grpc_port
            assert f"cannot listen for {taken} on 127.0.0.1:{port}" in second.stderr
            assert "Traceback" not in second.stderr
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=60) == 0
        assert not Path(metrics_directory.decode()).exists()  # this run's, removed with it
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)  # the group this test started
            parent.wait()


def test_serving_with_the_worker_core_in_process_over_remote_shards(
    adult_checkpoint, adult_checkpoint_b, tmp_path
):
    """--embedding-ps: infer-mode shards load the checkpoint's embeddings read-only; the
    server runs the worker core itself; answers equal the embedded server's."""
    from embedding_store.checkpoint_manifest import read_manifest as read_embedding_manifest
    from embedding_store.launcher import LocalCluster
    from embedding_store.ps_client import RemoteParameterServer
    from serving.infer_ctx import InferCtx

    global_config = write_infer_global_config(tmp_path, adult_checkpoint)
    embedding_config = Path(features.__file__).parent / "embedding_config.yml"
    batch = next(features.read_batches(features.TEST_PATH, 32, requires_grad=False))
    with InferCtx(checkpoint=adult_checkpoint) as offline:
        expected = offline.forward(batch)
    with LocalCluster(
        embedding_config, global_config, num_shards=2, num_workers=0, log_dir=tmp_path / "logs"
    ) as shards:
        log = tmp_path / "serve.log"
        with open(log, "wb") as out:
            server = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "embedding_store.cli",
                    "serve",
                    "--checkpoint",
                    str(adult_checkpoint),
                    "--embedding-ps",
                    ",".join(shards.ps_addresses),
                    "--lookup-timeout",
                    "2",
                    "--http-port",
                    "0",
                    "--grpc-port",
                    "0",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        try:
            deadline = time.monotonic() + 120
            ports = None
            while ports is None:
                assert server.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the server did not start"
                ports = re.search(r"HTTP listening on \S+:(\d+)", log.read_text())
                time.sleep(0.2)
            with RecserveClient(f"http://127.0.0.1:{ports.group(1)}") as client:
                answer = client.predict(batch)
                np.testing.assert_allclose(answer.predictions, expected, rtol=0, atol=1e-6)
                # A dead shard shows in the tier metric, not in readiness (every server
                # shares the tier); requests that need it fail naming it. The restarted shard
                # (it reloads its checkpoint) serves again.
                metrics = f"http://127.0.0.1:{ports.group(1)}/metrics"

                def gauge(name: str) -> float:
                    with urllib.request.urlopen(metrics, timeout=5) as response:
                        text = response.read().decode()
                    value = re.search(rf"^{name} (\S+)$", text, re.M)
                    assert value is not None, text
                    return float(value.group(1))

                def tier_serving() -> float:
                    return gauge("recserve_embedding_tier_serving")

                def version_mismatch() -> float:
                    return gauge("recserve_embedding_tier_version_mismatch")

                assert tier_serving() == 1.0
                assert version_mismatch() == 0.0
                # Shards that load another checkpoint's embeddings (a rollout half done)
                # show in a metric and the log, naming both versions.
                other = read_embedding_manifest(adult_checkpoint_b / "embeddings").version
                own = read_embedding_manifest(adult_checkpoint / "embeddings").version
                assert other != own
                for index, address in enumerate(shards.ps_addresses):
                    with RemoteParameterServer(address, replica_index=index) as ps:
                        ps.load(str(adult_checkpoint_b / "embeddings"))
                        assert ps.status().checkpoint_version == other
                wait_until(lambda: version_mismatch() == 2.0, "the mismatch metric")
                wait_until(
                    lambda: (
                        f"(shard 0: {other}, shard 1: {other}) than model" in log.read_text()
                        and f"(embeddings {own}, from" in log.read_text()
                    ),
                    "the mismatch in the log",
                )
                for index, address in enumerate(shards.ps_addresses):
                    with RemoteParameterServer(address, replica_index=index) as ps:
                        ps.load(str(adult_checkpoint / "embeddings"))
                wait_until(lambda: version_mismatch() == 0.0, "the mismatch metric back to 0")
                shards.kill_shard(1)
                wait_until(lambda: tier_serving() == 0.0, "the metric still says serving")
                assert client.ready()
                with pytest.raises(UnavailableError, match="shard 1"):
                    client.predict(batch)
                shards.restart_shard(1)
                wait_until(lambda: tier_serving() == 1.0, "the tier did not serve again")
                assert client.ready()
                answer = client.predict(batch)
                np.testing.assert_allclose(answer.predictions, expected, rtol=0, atol=1e-6)
                # A stalled shard (alive, silent) holds a request for the lookup timeout; the
                # event loop meanwhile answers health probes at once.
                stalled = shards.shards[1].process.pid
                os.kill(stalled, signal.SIGSTOP)
                try:
                    failures: list[BaseException] = []

                    def predict_on_the_stalled_shard() -> None:
                        try:
                            client.predict(batch)
                        except Exception as error:  # expected: the lookup times out
                            failures.append(error)

                    waiting = threading.Thread(target=predict_on_the_stalled_shard)
                    waiting.start()
                    time.sleep(0.3)  # the request is in the server, its lookup waiting
                    started = time.monotonic()
                    live = f"http://127.0.0.1:{ports.group(1)}/v2/health/live"
                    with urllib.request.urlopen(live, timeout=5) as response:
                        assert response.status == 200
                    assert time.monotonic() - started < 1.0
                    assert waiting.is_alive()  # the prediction is still waiting
                    waiting.join(timeout=30)
                    assert len(failures) == 1 and "shard 1" in str(failures[0]), failures
                finally:
                    os.kill(stalled, signal.SIGCONT)
                answer = client.predict(batch)
                np.testing.assert_allclose(answer.predictions, expected, rtol=0, atol=1e-6)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def test_a_stop_during_start_up_ends_it_at_once(adult_checkpoint, tmp_path):
    """SIGTERM while the server waits (up to --startup-timeout) for its embedding worker
    stops it within seconds, exit 0, never serving: Kubernetes kills a pod 30 s after
    SIGTERM, sooner than the default 60 s start-up wait ends."""
    import socket

    with socket.socket() as probe:  # a port nothing listens on: the worker never comes up
        probe.bind(("127.0.0.1", 0))
        absent_worker = f"127.0.0.1:{probe.getsockname()[1]}"
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [
                sys.executable, "-m", "embedding_store.cli", "serve",
                "--checkpoint", str(adult_checkpoint), "--http-port", "0", "--grpc-port", "0",
                "--embedding-workers", absent_worker, "--startup-timeout", "120",
            ],
            stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )  # fmt: skip
    try:
        wait_until(lambda: "waiting up to 120 s" in log.read_text(), "never waited for the tier")
        started = time.monotonic()
        for signum in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT):  # impatient: 3 at once
            server.send_signal(signum)
        assert server.wait(timeout=30) == 0, log.read_text()
        assert time.monotonic() - started < 10
        text = log.read_text()
        # Python runs pending signal handlers by signal number: SIGINT's may come first.
        assert re.search(r"SIG(TERM|INT) during start-up: stopping", text), text
        assert "listening" not in text and "Traceback" not in text
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_server_processes_stop_when_their_supervisor_is_killed(adult_checkpoint, tmp_path):
    """kill -9 of the supervisor (the OOM killer, a supervisor without cgroups): its
    processes must not serve on, orphaned, holding the ports against its restart."""
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        parent = subprocess.Popen(
            [
                sys.executable, "-m", "embedding_store.cli", "serve",
                "--checkpoint", str(adult_checkpoint), "--workers", "2",
                "--http-port", "0", "--grpc-port", "0",
            ],
            stdout=out, stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,  # its own group: teardown can end the children too
        )  # fmt: skip
    try:
        wait_until(
            lambda: len(re.findall(r"HTTP listening on", log.read_text())) == 2,
            "two server processes did not start",
            timeout=120,
        )
        children = [
            int(pid)
            for pid in Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
        ]
        parent.kill()
        parent.wait()

        def gone(pid: int) -> bool:
            try:  # reparented to init or a subreaper, which reaps it
                return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
            except FileNotFoundError:
                return True

        wait_until(lambda: all(gone(pid) for pid in children), "orphaned server processes", 20)
        assert log.read_text().count("the --workers supervisor (pid") == 2, log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)  # the group this test started
