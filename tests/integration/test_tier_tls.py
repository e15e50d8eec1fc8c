"""The embedding tier under mutual TLS (RECSERVE_TIER_TLS_CERT / _KEY / _CA): 2 parameter
servers and 1 embedding worker as real subprocesses on 127.0.0.1, every one with one
certificate for 127.0.0.1 signed by the tier's CA. Lookups equal the in-process tier bit for
bit; a plaintext client and a client whose certificate another CA signed are refused at
once, with a message that says what to check."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from clients import RecserveClient
from embedding_store.batch import Batch, Label
from embedding_store.config import EmbeddingConfig, GlobalConfig, SlotConfig, load_embedding_config
from embedding_store.errors import DeadlineExceededError, UnavailableError
from embedding_store.grpc_common import (
    TLS_RELOAD_VARIABLE,
    TLS_VARIABLES,
    reset_tier_tls_cache,
)
from embedding_store.initializer import InitializationConfig
from embedding_store.launcher import LocalCluster
from embedding_store.optimizers import SGD
from embedding_store.ps_client import RemoteParameterServer
from embedding_store.ps_metrics import ParameterServerMetrics
from embedding_store.ps_process import ParameterServerOptions, ParameterServerProcess
from embedding_store.worker_client import RemoteEmbeddingWorker
from examples.adult_income import features
from serving.infer_ctx import InferCtx
from tests.integration.conftest import _subprocess_env, write_infer_global_config
from tests.integration.test_deploy import load_healthcheck_module
from tests.integration.test_embedding_tier import (
    OPTIMIZER,
    assert_same_lookup,
    batch_of,
    local_tier,
    train_both,
    two_shards_one_worker,
    write_tier_configs,
)
from tests.tls_files import TlsFiles, kubelet_files, kubelet_swap, write_tls_files
from training.ctx import TrainCtx
from training.data import DataCtx, StreamingDataset

CERT, KEY, CA = TLS_VARIABLES


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> TlsFiles:
    # Its "server" certificate (127.0.0.1, localhost; client and server usage) serves every
    # tier process, as server and as client.
    return write_tls_files(tmp_path_factory.mktemp("tier-tls"))


@pytest.fixture(scope="module")
def config_files(tmp_path_factory):
    return write_tier_configs(tmp_path_factory.mktemp("configs"))


def use_files(monkeypatch: pytest.MonkeyPatch, cert, key, ca) -> None:
    for name, value in zip(TLS_VARIABLES, (cert, key, ca)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))
    reset_tier_tls_cache()


@pytest.fixture(scope="module")
def cluster(config_files, tls, tmp_path_factory):
    # The launcher's own health checks and worker waits are tier clients too: the test
    # process needs the variables as much as the subprocesses (which inherit them).
    with pytest.MonkeyPatch.context() as patch:
        use_files(patch, tls.cert, tls.key, tls.ca)
        with two_shards_one_worker(config_files, tmp_path_factory.mktemp("logs")) as running:
            yield running
    reset_tier_tls_cache()


@pytest.fixture
def config(config_files):
    return load_embedding_config(config_files[0])


def test_lookups_under_mutual_tls_equal_the_in_process_tier(
    cluster, config, config_files, tls, monkeypatch
):
    use_files(monkeypatch, tls.cert, tls.key, tls.ca)
    local = local_tier(config_files)
    with RemoteEmbeddingWorker(cluster.worker_addresses[0], config, timeout=10) as remote:
        remote.configure(optimizer=OPTIMIZER)
        remote.clear()
        train_both(remote, local, steps=2)
        for seed in range(3):
            assert_same_lookup(
                remote.lookup(batch_of(seed), train=False),
                local.lookup(batch_of(seed), train=False),
            )
        assert all(rows > 0 for rows in remote.status().rows_per_shard)
    # The shards themselves, as the admin CLI and trainers reach them.
    with RemoteParameterServer(cluster.ps_addresses[0], replica_index=0, timeout=5) as shard:
        assert shard.health() == "SERVING"


class _PooledModel(torch.nn.Module):
    """Logit of the tier's three slots: user [batch, 8], items [batch, 8] and the raw history
    sequence [batch, 3, 4], flattened."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8 + 8 + 3 * 4, 1)

    def forward(self, non_ids: list[torch.Tensor], embeddings: list[torch.Tensor]):
        return self.linear(torch.cat([e.flatten(1) for e in embeddings], dim=1))


def _labelled(seed: int) -> Batch:
    unlabelled = batch_of(seed, batch_size=16)
    target = (np.random.default_rng(seed).random((16, 1)) < 0.5).astype(np.float32)
    return Batch(unlabelled.id_type_features, [], [Label(target)], requires_grad=True)


def _train(ctx_factory, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = _PooledModel()
    with ctx_factory(model) as ctx:
        losses = []
        for step in range(steps):
            output, labels = ctx.forward(_labelled(step))
            loss = torch.nn.functional.binary_cross_entropy_with_logits(output, labels[0])
            ctx.backward(loss)
            losses.append(float(loss.detach()))
        ctx.wait_for_embedding_updates()
        # The rows as training left them, read back through the same tier.
        final = ctx.embedding_tier.lookup(batch_of(0, batch_size=16), train=False)
    return losses, {slot.name: slot.embeddings for slot in final.slots}


def test_train_ctx_over_the_remote_tier_under_mutual_tls_equals_the_embedded_tier(
    cluster, config_files, tls, monkeypatch
):
    use_files(monkeypatch, tls.cert, tls.key, tls.ca)
    embedding_config, global_config = config_files
    with RemoteEmbeddingWorker(
        cluster.worker_addresses[0], load_embedding_config(embedding_config), timeout=10
    ) as worker:
        worker.clear()  # other tests of this module train on the same tier

    def over(tier_options):
        return lambda model: TrainCtx(
            OPTIMIZER,
            torch.optim.SGD(model.parameters(), lr=0.1),
            model,
            embedding_staleness=1,  # each step sees the rows the step before it left
            embedding_config=embedding_config,
            global_config=global_config,
            **tier_options,
        )

    remote_losses, remote_rows = _train(
        over({"embedding_workers": [cluster.worker_addresses[0]]}), steps=3
    )
    local_losses, local_rows = _train(over({"embedding_tier": local_tier(config_files)}), steps=3)
    assert remote_losses == local_losses
    assert remote_losses[0] != remote_losses[2]  # it trained
    assert remote_rows.keys() == local_rows.keys() == {"user", "items", "history"}
    for name, rows in remote_rows.items():
        assert torch.equal(rows, local_rows[name]), name


def _refused(client_factory, expected: str) -> None:
    started = time.monotonic()
    with pytest.raises(UnavailableError) as refused, client_factory() as client:
        client.status()
    assert time.monotonic() - started < 10  # refused, not waited out
    assert expected in refused.value.message, refused.value.message


def test_a_plaintext_client_is_refused_with_a_hint(cluster, config, monkeypatch):
    use_files(monkeypatch, None, None, None)
    worker = cluster.worker_addresses[0]
    _refused(
        lambda: RemoteEmbeddingWorker(worker, config, timeout=3),
        "(if the embedding tier uses TLS, set RECSERVE_TIER_TLS_CERT, _KEY and _CA here too)",
    )
    shard = cluster.ps_addresses[1]
    _refused(
        lambda: RemoteParameterServer(shard, replica_index=1, timeout=3),
        f"parameter server {shard} (shard 1) is unavailable",
    )


def test_a_certificate_of_another_ca_is_refused(cluster, config, tls, monkeypatch):
    worker = cluster.worker_addresses[0]
    # Our certificate signed by a CA the tier does not trust: the worker ends the handshake.
    use_files(monkeypatch, tls.other_client_cert, tls.other_client_key, tls.ca)
    _refused(
        lambda: RemoteEmbeddingWorker(worker, config, timeout=3),
        f"is this process's {CERT} signed by the CA the peer trusts?",
    )
    # Trusting another CA: the worker's certificate is not accepted either.
    use_files(monkeypatch, tls.cert, tls.key, tls.other_ca)
    _refused(
        lambda: RemoteEmbeddingWorker(worker, config, timeout=3),
        f"(TLS: the peer's certificate is not signed by the CA in {CA}",
    )


def test_data_loaders_stream_to_a_trainer_under_mutual_tls(tls, monkeypatch):
    use_files(monkeypatch, tls.cert, tls.key, tls.ca)
    dataset = StreamingDataset(2, host="127.0.0.1", port=0, num_loaders=1).start()
    address = f"127.0.0.1:{dataset.port}"
    received: list = []
    consumer = threading.Thread(target=lambda: received.extend(dataset), daemon=True)
    consumer.start()
    with DataCtx([address], replica_index=0, replica_size=1, timeout=10) as ctx:
        for step in range(3):
            ctx.send_data(batch_of(step, batch_size=2))
    consumer.join(timeout=30)
    assert len(received) == 3
    # A plaintext loader never reaches it: it fails at its timeout, saying what to check.
    other = StreamingDataset(2, host="127.0.0.1", port=0, num_loaders=1).start()
    use_files(monkeypatch, None, None, None)
    started = time.monotonic()
    try:
        loader = DataCtx([f"127.0.0.1:{other.port}"], replica_index=0, replica_size=1, timeout=2)
        with (
            pytest.raises(DeadlineExceededError, match=r"same RECSERVE_TIER_TLS_\* settings"),
            loader,
        ):
            loader.send_data(batch_of(0, batch_size=2))
        assert time.monotonic() - started < 10
    finally:
        dataset.close()
        other.close()


def test_the_container_health_check_speaks_the_tiers_tls(cluster, config, tls, monkeypatch):
    """deploy/scripts/healthcheck.py (the images' HEALTHCHECK, Procfile ordering) checks a
    shard over the tier's mutual TLS when the container has the RECSERVE_TIER_TLS_*
    variables; without them the shard refuses its plaintext call."""
    health = load_healthcheck_module()
    target = f"grpc://{cluster.ps_addresses[0]}"
    use_files(monkeypatch, tls.cert, tls.key, tls.ca)
    # The liveness service answers SERVING whatever the shard's state (the Kubernetes
    # liveness probes of deploy/k8s-overlays/components/tier-tls ask for it).
    assert health.main(["--service=recserve.liveness", target]) == 0
    unknown = health.check(target, timeout=5, service="no.such.service")
    assert unknown is not None and unknown.startswith("NOT_FOUND")
    with RemoteEmbeddingWorker(cluster.worker_addresses[0], config, timeout=10) as remote:
        remote.configure(optimizer=OPTIMIZER)  # a training shard serves once configured
    assert health.check(target, timeout=5) is None
    assert health.main([target, *(f"grpc://{a}" for a in cluster.worker_addresses)]) == 0
    use_files(monkeypatch, None, None, None)
    assert health.check(target, timeout=5) is not None
    use_files(monkeypatch, tls.cert, None, tls.ca)
    assert health.check(target, timeout=5) == (
        "the tier's mutual TLS needs all of RECSERVE_TIER_TLS_CERT, RECSERVE_TIER_TLS_KEY, "
        "RECSERVE_TIER_TLS_CA"
    )


def test_serve_and_the_admin_cli_reach_an_infer_tier_under_mutual_tls(
    adult_checkpoint, serve_process, tls, monkeypatch, tmp_path
):
    """`recserve serve --embedding-workers` and `recserve embedding-tier status` are tier
    clients too: with the variables set they speak mutual TLS to a tier that loaded the
    checkpoint's embeddings, and the predictions equal the embedded (offline) model's."""
    global_config = write_infer_global_config(tmp_path, adult_checkpoint)
    embedding_config = Path(features.__file__).parent / "embedding_config.yml"
    batch = next(features.read_batches(features.TEST_PATH, 16, requires_grad=False))
    with InferCtx(checkpoint=adult_checkpoint) as offline:
        expected = offline.forward(batch)
    use_files(monkeypatch, tls.cert, tls.key, tls.ca)  # inherited by every subprocess below
    with LocalCluster(
        embedding_config, global_config, num_shards=2, num_workers=1, log_dir=tmp_path / "logs"
    ) as tier:
        worker = tier.worker_addresses[0]
        plaintext = {k: v for k, v in _subprocess_env().items() if k not in TLS_VARIABLES}

        def tier_status(timeout: str, env: dict[str, str]) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, "-m", "embedding_store.cli", "embedding-tier", "status",
                 "--worker", worker, "--timeout", timeout],
                capture_output=True, text=True, timeout=60, env=env,
            )  # fmt: skip

        # The two `status` runs go on while the server starts (each process spends its
        # seconds mostly importing, on one core).
        with ThreadPoolExecutor(2) as pool:
            status_call = pool.submit(tier_status, "10", _subprocess_env())
            refused_call = pool.submit(tier_status, "5", plaintext)
            server = serve_process(adult_checkpoint, "--embedding-workers", worker)
            with RecserveClient(f"http://{server.http_url}") as client:
                np.testing.assert_allclose(
                    client.predict(batch).predictions, expected, rtol=0, atol=1e-6
                )
            status, refused = status_call.result(), refused_call.result()
        assert status.returncode == 0, status.stderr
        assert refused.returncode != 0
        assert "RECSERVE_TIER_TLS" in refused.stderr and "Traceback" not in refused.stderr
    reset_tier_tls_cache()


# --------------------------------------------------------------------------- renewals
def _secret(files: TlsFiles, key: Path | None = None) -> dict[str, bytes]:
    """What cert-manager writes for a CA issuer: tls.crt, tls.key, ca.crt."""
    return {
        "tls.crt": files.cert.read_bytes(),
        "tls.key": (key or files.key).read_bytes(),
        "ca.crt": files.ca.read_bytes(),
    }


def _health(address: str, files: TlsFiles) -> str:
    """The shard's health over a channel of its own that trusts only ``files.ca`` and
    presents ``files``' client certificate ("refused" when the handshake fails)."""
    credentials = grpc.ssl_channel_credentials(
        files.ca.read_bytes(), files.client_key.read_bytes(), files.client_cert.read_bytes()
    )
    with grpc.secure_channel(address, credentials) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
        except grpc.RpcError:
            return "refused"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


def test_a_shard_and_its_clients_take_renewed_files(tmp_path, monkeypatch, caplog):
    """A parameter server under mutual TLS from a Secret mount renewed from A (CA 1) to B
    (CA 2) as the kubelet does: new handshakes get B, new tier channels use B, an open
    channel keeps going; a broken renewal then leaves B in use, with one warning."""
    a = write_tls_files(tmp_path / "a")
    b = write_tls_files(tmp_path / "b")
    secret = tmp_path / "secret"
    paths = kubelet_files(secret, _secret(a))
    monkeypatch.setenv(TLS_RELOAD_VARIABLE, "0.1")
    use_files(monkeypatch, paths["tls.crt"], paths["tls.key"], paths["ca.crt"])
    process = ParameterServerProcess(
        EmbeddingConfig(slots_config={"a": SlotConfig(dim=4)}),
        GlobalConfig(),
        ParameterServerOptions(host="127.0.0.1", port=0),
    )
    process.start()
    try:
        opened = RemoteParameterServer(process.address, timeout=5)  # a channel on A
        opened.configure(SGD(lr=0.1), InitializationConfig(seed=1))
        rows = opened.lookup(np.arange(3, dtype=np.uint64), 4, train=True)  # inserts them
        assert _health(process.address, a) == "SERVING"

        kubelet_swap(secret, _secret(b))
        deadline = time.monotonic() + 10
        while _health(process.address, b) != "SERVING":
            assert time.monotonic() < deadline, "the shard did not take B"
            time.sleep(0.05)
        assert _health(process.address, a) == "refused"  # A's CA and client certificate
        with RemoteParameterServer(process.address, timeout=5) as renewed:  # a new channel: B
            np.testing.assert_array_equal(
                renewed.lookup(np.arange(3, dtype=np.uint64), 4, train=False), rows
            )
        assert opened.status().rows == 3  # the open channel still works
        opened.close()

        kubelet_swap(secret, _secret(a, key=b.key))  # A's certificate, B's key
        warning = (
            "the changed TLS files were not loaded, the previous certificate stays in use: "
            f"{KEY} {paths['tls.key']}: this private key does not match the certificate in "
            f"{CERT} {paths['tls.crt']} (tried again when the files change)"
        )
        deadline = time.monotonic() + 10
        with caplog.at_level(logging.WARNING, logger="embedding_store.tls_reload"):
            while warning not in caplog.text:
                with RemoteParameterServer(process.address, timeout=5) as client:
                    assert client.health() == "SERVING"  # B on both sides, all along
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.05)
            time.sleep(0.3)  # a few checks later: B still, and no second warning
            assert _health(process.address, b) == "SERVING"
        assert caplog.text.count(warning) == 1
        metrics = generate_latest(ParameterServerMetrics(0, 1).registry).decode()
        assert 'recserve_ps_tls_reloads_total{outcome="ok"} 1.0' in metrics
        assert 'recserve_ps_tls_reloads_total{outcome="failed"} 1.0' in metrics
    finally:
        process.stop(grace=0)
        reset_tier_tls_cache()


def _shard(port: int = 0) -> ParameterServerProcess:
    process = ParameterServerProcess(
        EmbeddingConfig(slots_config={"a": SlotConfig(dim=4)}),
        GlobalConfig(),
        ParameterServerOptions(host="127.0.0.1", port=port),
    )
    process.start()
    return process


def test_long_lived_clients_follow_a_renewal_across_a_shard_restart(tmp_path, monkeypatch):
    """Clients made under A (CA 1) and kept, as a worker keeps its shards': the Secret is
    renewed to B (CA 2) and the shard restarts with B, refusing A. The next call of each
    succeeds on a rebuilt channel presenting B: a client that looks at the files before its
    calls rebuilds first (even for an update, never sent twice); one whose look is not due
    finds B when its read fails UNAVAILABLE, and sends that read again on B."""
    a = write_tls_files(tmp_path / "a")
    b = write_tls_files(tmp_path / "b")
    server_secret, client_secret = tmp_path / "server", tmp_path / "client"
    server_paths = kubelet_files(server_secret, _secret(a))
    client_paths = kubelet_files(client_secret, _secret(a))

    def files_of(paths: dict[str, Path], reload_seconds: str) -> None:
        monkeypatch.setenv(TLS_RELOAD_VARIABLE, reload_seconds)
        use_files(monkeypatch, paths["tls.crt"], paths["tls.key"], paths["ca.crt"])

    files_of(server_paths, "0.05")
    first = _shard()
    second = None
    files_of(client_paths, "3600")  # looks at its files only when a call fails
    reader = RemoteParameterServer(first.address, timeout=5)
    files_of(client_paths, "0.05")  # looks before its calls (every 0.05 s)
    writer = RemoteParameterServer(first.address, timeout=5)
    try:
        writer.configure(SGD(lr=1.0), InitializationConfig(seed=1))
        ids = np.arange(3, dtype=np.uint64)
        writer.lookup(ids, 4, train=True)
        assert reader.status().rows == 3
        first.stop(grace=0)

        kubelet_swap(server_secret, _secret(b))
        kubelet_swap(client_secret, _secret(b))
        files_of(server_paths, "0.05")
        second = _shard(first.port)  # B from the start, on the same address
        assert _health(second.address, a) == "refused"
        time.sleep(0.1)  # the writer's next look is due

        started = time.monotonic()
        assert reader.status().rows == 0  # the restarted shard: one call, retried on B
        writer.configure(SGD(lr=1.0), InitializationConfig(seed=1))
        rows = writer.lookup(ids, 4, train=True)
        assert writer.update(ids, np.ones((3, 4), np.float32)) == 3
        np.testing.assert_array_equal(reader.lookup(ids, 4, train=False), rows - 1.0)
        assert time.monotonic() - started < 5  # no reconnect back-off waited out
        assert reader._channel.generation == writer._channel.generation == 1
    finally:
        reader.close()
        writer.close()
        first.stop(grace=0)
        if second is not None:
            second.stop(grace=0)
        reset_tier_tls_cache()


def test_a_renewal_keeps_calls_in_flight_and_closes_the_old_channel_after(tmp_path, monkeypatch):
    """A shard reloading B -> C in place: a client's export stream open on B goes on to its
    end while the client's next call rebuilds the channel with C; the B channel is closed
    once the stream ended."""
    b = write_tls_files(tmp_path / "b")
    c = write_tls_files(tmp_path / "c")
    secret = tmp_path / "secret"
    paths = kubelet_files(secret, _secret(b))
    monkeypatch.setenv(TLS_RELOAD_VARIABLE, "0.05")
    use_files(monkeypatch, paths["tls.crt"], paths["tls.key"], paths["ca.crt"])
    process = _shard()
    try:
        with RemoteParameterServer(process.address, timeout=5) as client:
            client.configure(SGD(lr=1.0), InitializationConfig(seed=1))
            rows = client.lookup(np.arange(3, dtype=np.uint64), 4, train=True)
            old = client._channel._link.channel
            stream = client.export_rows(max_rows_per_chunk=1)
            blocks = [next(stream)]  # in flight on B

            kubelet_swap(secret, _secret(c))
            deadline = time.monotonic() + 10
            while _health(process.address, c) != "SERVING":
                assert time.monotonic() < deadline, "the shard did not take C"
                time.sleep(0.05)
            assert client.status().rows == 3  # a rebuilt channel, presenting C
            assert client._channel.generation == 1
            blocks += list(stream)  # the B channel stayed open for it
            got = np.concatenate([block.weights for block in blocks])
            np.testing.assert_array_equal(
                got[np.argsort(np.concatenate([block.ids for block in blocks]))], rows
            )
            deadline = time.monotonic() + 5
            while True:  # closed by a thread of its own once the stream ended
                try:
                    old.unary_unary("/recserve.Nothing/Nothing")(b"", timeout=0.01)
                except ValueError:  # "Cannot invoke RPC on closed channel!"
                    break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, "the replaced channel was not closed"
                time.sleep(0.02)
            assert client._channel._retired == []
    finally:
        process.stop(grace=0)
        reset_tier_tls_cache()
