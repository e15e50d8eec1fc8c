"""The networked embedding tier under failures: shards and workers are real ``recserve``
subprocesses on 127.0.0.1, checkpoints are on disk, every process is stopped by its PID.

* ``embedding-tier load`` into training shards no trainer configured keeps the checkpoint's
  optimizer and every row's optimizer state (the documented re-shard procedure).
* A load or dump whose ``--timeout`` passed changes nothing afterwards; the error says so.
* A worker killed in the middle of a re-sharding load leaves the shard its previous rows.
* The worker's readiness follows its shards, and its status says which shards serve.

Checkpoint reads are held with a FIFO (``blocking_checkpoint``) and a shard's dump by
SIGSTOP, so every step happens in a known order.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedding_store import checkpoint_load, checkpoint_manifest
from embedding_store.batch import Batch, IDTypeFeatureWithSingleID
from embedding_store.config import load_embedding_config
from embedding_store.errors import RecserveError, UnavailableError
from embedding_store.launcher import LocalCluster, ManagedProcess, recserve_command
from embedding_store.optimizers import Adagrad, Adam
from embedding_store.ps_client import RemoteParameterServer
from embedding_store.tier import InProcessEmbeddingTier
from embedding_store.worker_client import RemoteEmbeddingWorker
from tests.integration.blocking_checkpoint import feed, replace_with_fifo
from tests.unit.test_tier_failures import assert_same_rows, rows_by_dim

EMBEDDING_CONFIG = {"slots_config": {"user": {"dim": 8}, "items": {"dim": 4}}}
CAPACITY = 100_000
ADAGRAD = Adagrad(lr=0.05, initial_accumulator_value=0.1)
ADAM = Adam(lr=0.01)
WORKER_SERVICE = "recserve.embedding.v1.EmbeddingWorker"
SHARDS_SERVICE = "recserve.shards"
WAIT = 30.0  # upper bound of every wait below; they end long before
CLI = [sys.executable, "-m", "embedding_store.cli", "embedding-tier"]


@pytest.fixture(scope="module")
def config_files(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(embedding config, Train global config, Infer global config without a checkpoint)."""
    root = tmp_path_factory.mktemp("configs")
    embedding = root / "embedding_config.yml"
    embedding.write_text(yaml.safe_dump(EMBEDDING_CONFIG))
    train = root / "train.yml"
    train.write_text(yaml.safe_dump({"embedding_parameter_server_config": {"capacity": CAPACITY}}))
    infer = root / "infer.yml"
    infer.write_text(
        yaml.safe_dump(
            {
                "common_config": {"job_type": "Infer"},
                "embedding_parameter_server_config": {"capacity": CAPACITY},
            }
        )
    )
    return embedding, train, infer


def batch_of(seed: int, size: int = 64) -> Batch:
    rng = np.random.default_rng(seed)
    return Batch(
        [
            IDTypeFeatureWithSingleID("user", rng.integers(0, 3000, size).astype(np.uint64)),
            IDTypeFeatureWithSingleID("items", rng.integers(0, 3000, size).astype(np.uint64)),
        ],
        requires_grad=False,
    )


def train(tier, seeds: range) -> None:
    """Train lookups and random gradients (applied before this returns)."""
    for seed in seeds:
        result = tier.lookup(batch_of(seed), train=True)
        generator = torch.Generator().manual_seed(seed)
        grads = {s.name: torch.randn(s.embeddings.shape, generator=generator) for s in result.slots}
        tier.backward(result.ref, grads)
    tier.flush()


def trained_checkpoint(directory: Path, config_path: Path, num_shards: int, optimizer) -> None:
    config = load_embedding_config(config_path)
    with InProcessEmbeddingTier(
        config, capacity=CAPACITY, num_shards=num_shards, optimizer=optimizer
    ) as tier:
        train(tier, range(100, 106))
        tier.dump(directory)


def exact_rows(address: str) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every row of the shard at ``address`` per dim, by ID: (ids, weight bits, state bits)."""
    with RemoteParameterServer(address, timeout=10) as shard:
        return rows_by_dim(list(shard.export_rows()))


def checkpoint_rows(directory: Path) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every row of a checkpoint per dim, by ID, with its saved state (as exact_rows)."""
    manifest = checkpoint_manifest.read_manifest(directory)
    blocks = checkpoint_load.read_rows_for_replica(
        manifest, 0, 1, keep_state_of=checkpoint_load.optimizer_of(manifest)
    )
    return rows_by_dim(blocks)


def wait_until(condition, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def worker_idle(worker: RemoteEmbeddingWorker) -> bool:
    try:
        return worker.status().task == ""
    except RecserveError:  # a shard still held (SIGSTOP) makes Status time out
        return False


def shard_task(address: str) -> str:
    with RemoteParameterServer(address, timeout=5) as shard:
        return shard.status().task


def worker_health(address: str) -> tuple[int, int, int]:
    """The worker's readiness (``""``, its service name) and its shards' status."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return tuple(  # type: ignore[return-value]
            stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
            for name in ("", WORKER_SERVICE, SHARDS_SERVICE)
        )


def restore(path: Path, payload: bytes) -> None:
    """Put the file back in place of its FIFO (in one rename: a reader sees one or the other)."""
    temporary = path.with_name(path.name + ".restored")
    temporary.write_bytes(payload)
    os.replace(temporary, path)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------- optimizer state
def test_loading_into_unconfigured_training_shards_keeps_the_optimizer_and_state(
    config_files, tmp_path
):
    embedding, train_config, _ = config_files
    # Adam keeps 2 x dim + 1 values per row; the checkpoint has 3 shards, the tier 2: the
    # documented re-shard procedure of a training tier (dump, change N, load).
    trained_checkpoint(tmp_path / "adam3", embedding, 3, ADAM)
    with LocalCluster(embedding, train_config, num_shards=2, log_dir=tmp_path / "logs") as tier:
        worker = tier.worker_addresses[0]
        common = ("--worker", worker, "--embedding-config", str(embedding))
        load = run_cli("load", *common, str(tmp_path / "adam3"))
        assert load.returncode == 0, load.stderr
        dump = run_cli("dump", *common, str(tmp_path / "again"))
        assert dump.returncode == 0, dump.stderr
        manifest = checkpoint_load.verify(tmp_path / "again")
        assert manifest.num_shards == 2
        assert manifest.optimizer == ADAM.to_dict()
        assert {(e.dim, e.state_width) for e in manifest.files} == {(4, 9), (8, 17)}
        assert_same_rows(checkpoint_rows(tmp_path / "again"), checkpoint_rows(tmp_path / "adam3"))
        with RemoteEmbeddingWorker(worker, None) as client:
            assert client.status().shard_serving == (True, True)  # configured by the load


# --------------------------------------------------------------------------- deadlines
def test_a_load_or_dump_past_its_deadline_changes_nothing_afterwards(config_files, tmp_path):
    embedding, train_config, _ = config_files
    trained_checkpoint(tmp_path / "other", embedding, 2, ADAGRAD)
    held_file = tmp_path / "other" / "shard_00001" / "dim_8.safetensors"
    payload = replace_with_fifo(held_file)
    with LocalCluster(
        embedding, train_config, num_shards=2, log_dir=tmp_path / "logs", optimizer=ADAGRAD
    ) as tier:
        worker = tier.worker_addresses[0]
        config = load_embedding_config(embedding)
        with RemoteEmbeddingWorker(worker, config, timeout=10) as client:
            train(client, range(6))
            before = [exact_rows(address) for address in tier.ps_addresses]

            # The load holds in the worker's verification pass (the FIFO) past the deadline
            # (1 s: only waited for to pass; the held read never ends by itself).
            load = run_cli("load", "--worker", worker, "--timeout", "1", str(tmp_path / "other"))
            assert load.returncode == 1
            feed(held_file, payload)  # the verification ends; the caller is long gone
            restore(held_file, payload)  # nothing holds a later read
            wait_until(lambda: worker_idle(client), "the worker ended the load")
            for address, rows in zip(tier.ps_addresses, before, strict=True):
                assert_same_rows(exact_rows(address), rows)
            assert (
                f"did not finish the load of {tmp_path / 'other'} within the deadline (1 s); it "
                "may still complete on the worker: check `recserve embedding-tier status "
                f"--worker {worker}`"
            ) in load.stderr

            # The dump holds in shard 1 (stopped) past the deadline.
            root = tmp_path / "dumps"
            root.mkdir()
            shard = tier.shards[1].process
            os.kill(shard.pid, signal.SIGSTOP)
            try:
                dump = run_cli("dump", "--worker", worker, "--timeout", "1", str(root / "d6"))
            finally:
                os.kill(shard.pid, signal.SIGCONT)
            assert dump.returncode == 1
            wait_until(lambda: worker_idle(client), "the worker ended the dump")
            assert list(root.iterdir()) == []  # not published, no staging directory left
            assert f"did not finish the dump to {root / 'd6'} within the deadline" in dump.stderr

            # Both tasks ended cleanly: the next ones run.
            manifest = client.load(tmp_path / "other")
            assert sum(client.status().rows_per_shard) == manifest.total_rows
            assert client.dump(root / "d6").total_rows == manifest.total_rows


# --------------------------------------------------------------------------- killed worker
def wait_for_fifo_reader(path: Path) -> int:
    """Open the FIFO for writing once a reader has opened it; returns the descriptor."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as error:
            if error.errno != errno.ENXIO:
                raise
            assert time.monotonic() < deadline, f"nobody opened {path} for reading"
            time.sleep(0.02)


def test_a_worker_killed_mid_reshard_load_leaves_the_shard_its_rows(config_files, tmp_path):
    embedding, train_config, _ = config_files
    trained_checkpoint(tmp_path / "two", embedding, 2, ADAGRAD)
    held_file = tmp_path / "two" / "shard_00001" / "dim_8.safetensors"  # read last
    payload = replace_with_fifo(held_file)
    with LocalCluster(
        embedding,
        train_config,
        num_shards=1,
        num_workers=0,
        log_dir=tmp_path / "logs",
        optimizer=ADAGRAD,
    ) as tier:
        (address,) = tier.ps_addresses
        worker = ManagedProcess(
            "worker",
            recserve_command(
                "embedding-worker", "--embedding-config", str(embedding), "--ps", address
            ),
            tmp_path / "worker.log",
        )
        worker.start(dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            config = load_embedding_config(embedding)
            with RemoteEmbeddingWorker(worker.wait_for_address(WAIT), config) as client:
                client.wait_for_serving(WAIT)
                train(client, range(4))
                before = exact_rows(address)
                failure: list[BaseException] = []

                def load() -> None:
                    try:
                        client.load(tmp_path / "two")
                    except RecserveError as error:
                        failure.append(error)

                loading = threading.Thread(target=load)
                loading.start()
                feed(held_file, payload)  # the worker's verification pass reads it
                # Then the shard's Load (issued once the worker read every file) reads them
                # all and waits for the last one.
                wait_until(lambda: shard_task(address) == "loading", "the shard loads")
                fd = wait_for_fifo_reader(held_file)
                try:
                    worker.stop(kill=True)  # kill -9 while the shard is still reading
                    loading.join(WAIT)
                    assert failure, "the load did not fail with its worker killed"
                    time.sleep(1.0)  # the shard sees the dropped connection (loopback: ~ms)
                    view = memoryview(payload)
                    os.set_blocking(fd, True)
                    while view:
                        view = view[os.write(fd, view) :]
                finally:
                    os.close(fd)
        finally:
            worker.stop(kill=True)
        wait_until(lambda: shard_task(address) == "", "the shard ended the load")
        assert_same_rows(exact_rows(address), before)


# --------------------------------------------------------------------------- readiness
def test_worker_readiness_follows_its_shards_and_status_says_which_serve(config_files, tmp_path):
    embedding, _, infer_config = config_files
    trained_checkpoint(tmp_path / "ckpt", embedding, 2, ADAGRAD)
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    # Inference shards without a checkpoint: reachable (the worker is SERVING), not serving
    # (recserve.shards NOT_SERVING, as a server's recserve_embedding_tier_serving 0: their
    # lookups fail).
    with LocalCluster(embedding, infer_config, num_shards=2, log_dir=tmp_path / "logs") as tier:
        worker = tier.worker_addresses[0]
        with RemoteEmbeddingWorker(worker, load_embedding_config(embedding)) as client:
            assert client.status().shard_serving == (False, False)
            assert worker_health(worker) == (serving, serving, not_serving)
            status = run_cli("status", "--worker", worker)
            assert status.returncode == 0, status.stderr
            assert status.stdout.splitlines()[:2] == [
                f"shard 0: 0 rows of {CAPACITY}, idle, checkpoint none, NOT SERVING",
                f"shard 1: 0 rows of {CAPACITY}, idle, checkpoint none, NOT SERVING",
            ]
            version = client.load(tmp_path / "ckpt").version
            assert client.status().shard_serving == (True, True)
            assert client.status().shard_checkpoint_versions == (version, version)
            loaded_rows = client.status().rows_per_shard
            lines = run_cli("status", "--worker", worker).stdout.splitlines()
            assert [line.rsplit(", ", 1)[1] for line in lines[:2]] == [f"checkpoint {version}"] * 2
            wait_until(
                lambda: worker_health(worker) == (serving, serving, serving),
                "the worker's next check found every shard serving",
            )

            # A dead shard shows on recserve.shards; the worker stays ready (every worker
            # shares the shards: lookups for the others still work).
            tier.kill_shard(1)
            wait_until(
                lambda: worker_health(worker) == (serving, serving, not_serving),
                "the worker noticed its dead shard",
            )
            # `status` still shows every shard that answers, names the one that does not,
            # and exits 1; the client's plain status() raises, naming it.
            status = run_cli("status", "--worker", worker)
            assert status.returncode == 1, status.stderr
            lines = status.stdout.splitlines()
            assert lines[0] == (
                f"shard 0: {loaded_rows[0]} rows of {CAPACITY}, idle, checkpoint {version}"
            )
            assert lines[1].startswith("shard 1: NO ANSWER: ") and tier.ps_addresses[1] in lines[1]
            assert lines[2] == "worker: idle"
            with pytest.raises(UnavailableError, match=r"1 shard\(s\) did not answer: shard 1: "):
                client.status()
            assert client.status(partial=True).shard_errors[0] == ""
            tier.restart_shard(1)  # back, but without its rows until a load
            wait_until(lambda: not any(client.status(partial=True).shard_errors), "shard 1 answers")
            assert client.status().shard_serving == (True, False)
            assert worker_health(worker) == (serving, serving, not_serving)
            client.load(tmp_path / "ckpt")
            wait_until(
                lambda: worker_health(worker) == (serving, serving, serving),
                "the worker finds every shard serving again",
            )


def test_training_rides_out_a_shard_restarted_from_its_checkpoint(config_files, tmp_path, caplog):
    """A shard killed mid-run and started again with ``--load-checkpoint``: the worker's
    gradient push (sent again while it cannot reach the shard, then while the shard loads)
    waits for it, and so do training's lookups; the run goes on with no update lost. Each
    used to fail at the first refused call."""
    from embedding_store.config import GlobalConfig
    from training.ctx import make_embedding_tier

    embedding, train_config, _ = config_files
    config = load_embedding_config(embedding)
    root = str(Path(__file__).resolve().parents[2])  # the worker's pushes: this tree's code
    with (
        LocalCluster(
            embedding, train_config, log_dir=tmp_path / "logs", extra_env={"PYTHONPATH": root}
        ) as tier,
        make_embedding_tier(config, GlobalConfig(), tier.worker_addresses) as client,
    ):
        client.configure(optimizer=ADAGRAD)
        train(client, range(3))
        client.dump(tmp_path / "ckpt")
        looked_up = client.lookup(batch_of(3), train=True)
        port = tier.ps_addresses[1].rsplit(":", 1)[1]
        tier.kill_shard(1)

        def start_again() -> None:
            time.sleep(0.5)  # the push below finds it down first
            shard = tier._shard_process(1, int(port))
            shard.args += ["--load-checkpoint", str(tmp_path / "ckpt")]
            shard.start(tier.env)
            tier.shards[1] = shard

        restart = threading.Thread(target=start_again)
        restart.start()
        try:
            grads = {s.name: torch.ones(s.embeddings.shape) for s in looked_up.slots}
            client.backward(looked_up.ref, grads)
            client.flush()  # raised "1 gradient batch(es) could not be applied"
            tier.kill_shard(1)
            start_again()  # the lookups below find it starting, then loading
            train(client, range(4, 8))
        finally:
            restart.join()
        assert client.status().shard_serving == (True, True)
        worker_log = tier.workers[0].log_path.read_text()
    shard = f"parameter server 127.0.0.1:{port} (shard 1)"
    assert "gradient push failed" not in worker_log and f"{shard} failed (" in worker_log
    retried = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
    assert retried and f"{shard} is unavailable" in retried[0], retried
