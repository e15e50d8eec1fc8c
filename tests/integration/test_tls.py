"""``recserve serve --tls-cert/--tls-key [--tls-client-ca]`` end to end, on loopback: HTTPS
and gRPC over TLS through the clients and ``recserve predict`` / ``eval``, mutual TLS, and
what a client that speaks plaintext, or does not trust the CA, gets. A tiny checkpoint
(tests/unit/test_eval_tiny_checkpoint.py) keeps the servers quick to start."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from clients import AsyncRecserveClient, RecserveClient
from clients.eval import EvalOptions, run_eval
from embedding_store.batch import Batch, IDTypeFeature, IDTypeFeatureWithSingleID, NonIDTypeFeature
from embedding_store.cli import main
from embedding_store.errors import RecserveError, UnavailableError
from serving.infer_ctx import InferCtx
from tests.integration.conftest import REPO_ROOT, ServeProcess, _subprocess_env
from tests.integration.test_deploy import load_healthcheck_module
from tests.tls_files import TlsFiles, kubelet_files, kubelet_swap, write_tls_files
from tests.unit.test_eval_tiny_checkpoint import make_checkpoint, write_rows

N_ROWS = 5
ATOL = 1e-6
CALL_TIMEOUT = 10.0
TRUSTS_NOT = "not signed by a CA this client trusts"
NO_CLIENT_CERTIFICATE = "may require a client certificate"


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> TlsFiles:
    return write_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny-tls") / "checkpoint")


def rows() -> list[dict]:
    """Friendly rows keyed by feature name (the server has no preprocessor)."""
    return [{"user": i, "tags": [100 + i], "dense": [0.5 * i, -0.25]} for i in range(N_ROWS)]


def batch() -> Batch:
    return Batch(
        [
            IDTypeFeatureWithSingleID.from_ids("user", np.arange(N_ROWS, dtype=np.uint64)),
            IDTypeFeature.from_lists("tags", [[100 + i] for i in range(N_ROWS)]),
        ],
        [
            NonIDTypeFeature(
                np.array([[0.5 * i, -0.25] for i in range(N_ROWS)], dtype=np.float32), "dense"
            )
        ],
        requires_grad=False,
    )


@pytest.fixture(scope="module")
def expected(checkpoint) -> np.ndarray:
    """What the checkpoint itself answers (in this process, no server)."""
    with InferCtx(checkpoint=checkpoint) as ctx:
        return np.asarray(ctx.forward(batch()))


def _stopped(server: ServeProcess) -> None:
    server.terminate()
    try:
        server.process.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()


@pytest.fixture(scope="module")
def tls_server(checkpoint, tls, serve_process) -> Iterator[ServeProcess]:
    server = serve_process(checkpoint, "--tls-cert", str(tls.cert), "--tls-key", str(tls.key))
    try:
        yield server
    finally:
        _stopped(server)


@pytest.fixture(scope="module")
def mtls_server(checkpoint, tls, serve_process) -> Iterator[ServeProcess]:
    server = serve_process(
        checkpoint,
        "--tls-cert", str(tls.cert),
        "--tls-key", str(tls.key),
        "--tls-client-ca", str(tls.ca),
    )  # fmt: skip
    try:
        yield server
    finally:
        _stopped(server)


def _urls(server: ServeProcess) -> dict[str, str]:
    return {"https": f"https://{server.http_url}", "grpcs": f"grpcs://{server.grpc_url}"}


def test_the_start_up_line_says_tls(tls_server, mtls_server):
    assert "; TLS on (https://, grpcs://; no client certificates)" in tls_server.log()
    assert "; TLS on (https://, grpcs://; client certificates required)" in mtls_server.log()


def test_https_and_grpcs_answer_the_checkpoints_predictions(tls_server, tls, expected):
    for scheme, url in _urls(tls_server).items():
        with RecserveClient(url, tls_ca=tls.ca, timeout=CALL_TIMEOUT) as client:
            assert client.wait_until_ready(30), scheme
            np.testing.assert_allclose(client.predict(batch()).predictions, expected, atol=ATOL)
            if scheme == "https":  # the friendly route (ASGI), besides the fast infer path
                result = client.predict(rows())
                np.testing.assert_allclose(result.predictions, expected, atol=ATOL)

        async def predict_async(url: str = url) -> np.ndarray:
            async with AsyncRecserveClient(url, tls_ca=tls.ca, timeout=CALL_TIMEOUT) as client:
                return (await client.predict(batch())).predictions

        np.testing.assert_allclose(asyncio.run(predict_async()), expected, atol=ATOL)


def test_plaintext_to_the_tls_ports_fails(tls_server):
    for url in (f"http://{tls_server.http_url}", f"grpc://{tls_server.grpc_url}"):
        client = RecserveClient(url, retries=0, timeout=CALL_TIMEOUT)
        with client, pytest.raises(UnavailableError):
            client.predict(batch())


def test_a_client_that_does_not_trust_the_ca_fails_clearly(tls_server, tls):
    for url in _urls(tls_server).values():
        for options in ({"tls_ca": tls.other_ca}, {}):  # another CA; the system's store
            client = RecserveClient(url, retries=0, timeout=CALL_TIMEOUT, **options)
            with client, pytest.raises(UnavailableError, match=TRUSTS_NOT):
                client.predict(batch())


def test_mutual_tls_wants_a_certificate_signed_by_the_client_ca(mtls_server, tls, expected):
    for url in _urls(mtls_server).values():
        client = RecserveClient(url, tls_ca=tls.ca, retries=0, timeout=CALL_TIMEOUT)
        with client, pytest.raises(RecserveError, match=NO_CLIENT_CERTIFICATE):
            client.predict(batch())
        client = RecserveClient(
            url,
            tls_ca=tls.ca,
            tls_cert=tls.other_client_cert,
            tls_key=tls.other_client_key,
            retries=0,
            timeout=CALL_TIMEOUT,
        )
        with client, pytest.raises(RecserveError):
            client.predict(batch())
        with RecserveClient(
            url,
            tls_ca=tls.ca,
            tls_cert=tls.client_cert,
            tls_key=tls.client_key,
            timeout=CALL_TIMEOUT,
        ) as client:
            np.testing.assert_allclose(client.predict(batch()).predictions, expected, atol=ATOL)


def test_recserve_predict_over_https(tls_server, tls, expected, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows()))
    command = [
        sys.executable, "-m", "embedding_store.cli", "predict",
        "--url", f"https://{tls_server.http_url}", "--input", str(data), "--tls-ca", str(tls.ca),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO_ROOT, env=_subprocess_env(), capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()
    predictions = [json.loads(line)["prediction"] for line in done.stdout.splitlines()]
    np.testing.assert_allclose(np.asarray(predictions).reshape(-1), expected.reshape(-1), atol=ATOL)


def test_recserve_eval_compares_over_https(tls_server, tls, checkpoint, tmp_path):
    data = tmp_path / "rows.csv"
    write_rows(data, n=12)
    options = EvalOptions(
        data=(data,),
        out=tmp_path / "predictions.csv",
        checkpoint=checkpoint,
        url=f"https://{tls_server.http_url}",
        compare=True,
        label="clicked",
        progress=False,
        tls_ca=tls.ca,
    )
    result = run_eval(options)
    assert (result.rows, result.exit_code) == (12, 0)


def test_two_worker_processes_answer_over_mutual_tls(checkpoint, tls, serve_process, expected):
    """The supervisor hands every --tls-* file to its worker processes: each one answers over
    HTTPS, and each one refuses a client without a certificate (--tls-client-ca)."""
    server = serve_process(
        checkpoint,
        "--workers", "2",
        "--tls-cert", str(tls.cert),
        "--tls-key", str(tls.key),
        "--tls-client-ca", str(tls.ca),
    )  # fmt: skip
    url = f"https://{server.http_url}"
    try:
        with RecserveClient(
            url, tls_ca=tls.ca, tls_cert=tls.client_cert, tls_key=tls.client_key
        ) as client:
            assert client.wait_until_ready(60)
            for _ in range(4):
                np.testing.assert_allclose(client.predict(batch()).predictions, expected, atol=ATOL)
        for _ in range(4):  # new connections: the kernel spreads them over the processes
            client = RecserveClient(url, tls_ca=tls.ca, retries=0, timeout=CALL_TIMEOUT)
            with client, pytest.raises(RecserveError, match=NO_CLIENT_CERTIFICATE):
                client.predict(batch())
    finally:
        _stopped(server)
    assert server.process.returncode == 0, server.log()[-3000:]


def test_a_key_that_does_not_match_stops_serve_before_it_starts(checkpoint, tls):
    command = [
        sys.executable, "-m", "embedding_store.cli", "serve", "--checkpoint", str(checkpoint),
        "--http-port", "0", "--grpc-port", "0",
        "--tls-cert", str(tls.cert), "--tls-key", str(tls.other_key),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO_ROOT, env=_subprocess_env(), capture_output=True, timeout=120
    )
    stderr = done.stderr.decode()
    assert done.returncode == 1
    assert stderr == (
        f"recserve serve: error: --tls-key {tls.other_key}: this private key does not match "
        f"the certificate in --tls-cert {tls.cert}\n"
    )


def test_the_container_health_check_probes_tls_servers(tls_server, mtls_server):
    """deploy/scripts/healthcheck.py (the images' HEALTHCHECK) derives its target from the
    serve command line: https for --tls-cert (not verified: the certificate names the
    service, not 127.0.0.1), a TCP connect under mutual TLS (no client certificate)."""
    health = load_healthcheck_module()
    https_port = tls_server.http_url.rsplit(":", 1)[1]
    target = health.targets_from_argv(
        ["recserve", "serve", f"--http-port={https_port}", "--tls-cert=c", "--tls-key=k"]
    )
    assert target == [f"https://127.0.0.1:{https_port}/v2/health/ready"]
    assert health.main(target) == 0
    # Plain http to the TLS port is what the check did before it read the TLS flags.
    assert health.main([f"http://127.0.0.1:{https_port}/v2/health/ready"]) == 1
    mtls_port = mtls_server.http_url.rsplit(":", 1)[1]
    target = health.targets_from_argv(
        ["recserve", "serve", f"--http-port={mtls_port}", "--tls-cert=c", "--tls-key=k",
         "--tls-client-ca=ca"]
    )  # fmt: skip
    assert target == [f"tcp://127.0.0.1:{mtls_port}"]
    assert health.main(target) == 0
    assert health.main([f"https://127.0.0.1:{mtls_port}/v2/health/ready"]) == 1


def test_the_async_grpcs_client_hints_at_a_missing_client_certificate(mtls_server, tls):
    async def predict_without_certificate() -> None:
        async with AsyncRecserveClient(
            f"grpcs://{mtls_server.grpc_url}", tls_ca=tls.ca, retries=0, timeout=CALL_TIMEOUT
        ) as client:
            await client.predict(batch())

    with pytest.raises(RecserveError, match=NO_CLIENT_CERTIFICATE):
        asyncio.run(predict_without_certificate())


def test_recserve_predict_and_eval_present_a_client_certificate(
    mtls_server, tls, expected, tmp_path
):
    """The --tls-* flags of both commands reach the connection: the server requires a client
    certificate signed by its --tls-client-ca."""
    certificate = ["--tls-ca", str(tls.ca), "--tls-cert", str(tls.client_cert),
                   "--tls-key", str(tls.client_key)]  # fmt: skip
    url = f"https://{mtls_server.http_url}"
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows()))
    output = tmp_path / "predictions.jsonl"
    command = ["predict", "--url", url, "--input", str(data), "--output", str(output)]
    assert main([*command, *certificate]) == 0
    predictions = [json.loads(line)["prediction"] for line in output.read_text().splitlines()]
    np.testing.assert_allclose(np.asarray(predictions).reshape(-1), expected.reshape(-1), atol=ATOL)

    csv = tmp_path / "rows.csv"
    write_rows(csv, n=12)
    out = tmp_path / "eval.csv"
    command = ["eval", "--url", url, "--data", str(csv), "--out", str(out), "--label", "clicked"]
    assert main([*command, "--quiet", *certificate]) == 0
    assert len(out.read_text().splitlines()) == 1 + 12  # a header and one line per row


def test_recserve_eval_says_when_it_does_not_trust_the_server(tls_server, tls, tmp_path):
    """A handshake failure is not retried, and says what to pass."""
    data = tmp_path / "rows.csv"
    write_rows(data, n=4)
    options = EvalOptions(
        data=(data,),
        out=tmp_path / "predictions.csv",
        url=f"https://{tls_server.http_url}",
        label="clicked",
        progress=False,
        tls_ca=tls.other_ca,
    )
    with pytest.raises(UnavailableError) as error:
        run_eval(options)
    assert error.value.message.startswith(f"TLS with server https://{tls_server.http_url} failed")
    assert TRUSTS_NOT in error.value.message


# --------------------------------------------------------------------------- renewals
RENEWAL_WAIT = 20.0  # seconds a renewal may take to be served (0.2 s checks; a loaded CI)


def _secret(files: TlsFiles, key: Path | None = None) -> dict[str, bytes]:
    """A cert-manager Secret's files: the server's certificate and key, and the clients' CA."""
    return {
        "tls.crt": files.cert.read_bytes(),
        "tls.key": (key or files.key).read_bytes(),
        "ca.crt": files.ca.read_bytes(),
    }


def _client(url: str, files: TlsFiles) -> RecserveClient:
    """A client that trusts only ``files.ca`` and presents its client certificate."""
    return RecserveClient(
        url,
        tls_ca=files.ca,
        tls_cert=files.client_cert,
        tls_key=files.client_key,
        retries=0,
        timeout=CALL_TIMEOUT,
    )


def _predicts_on_a_new_connection(url: str, files: TlsFiles, expected: np.ndarray) -> bool:
    try:
        with _client(url, files) as client:
            np.testing.assert_allclose(client.predict(batch()).predictions, expected, atol=ATOL)
    except RecserveError:
        return False
    return True


def _metrics(server: ServeProcess, files: TlsFiles) -> str:
    import ssl
    import urllib.request

    context = ssl.create_default_context(cafile=str(files.ca))
    context.load_cert_chain(files.client_cert, files.client_key)
    url = f"https://{server.http_url}/metrics"
    with urllib.request.urlopen(url, context=context, timeout=CALL_TIMEOUT) as answer:
        return answer.read().decode()


def test_a_renewed_certificate_is_served_without_a_restart(
    checkpoint, serve_process, expected, tmp_path
):
    """Serve A (CA 1, mutual TLS), renew the Secret to B (CA 2) as the kubelet does: new
    connections on both ports get B and its client CA, open ones keep going; a broken renewal
    (a key that does not match) then leaves B served, with one warning and a failed count."""
    a = write_tls_files(tmp_path / "a")
    b = write_tls_files(tmp_path / "b")
    paths = kubelet_files(tmp_path / "secret", _secret(a))
    server = serve_process(
        checkpoint,
        "--tls-cert", str(paths["tls.crt"]),
        "--tls-key", str(paths["tls.key"]),
        "--tls-client-ca", str(paths["ca.crt"]),
        "--tls-reload-seconds", "0.2",
    )  # fmt: skip
    urls = _urls(server)
    try:
        opened = {scheme: _client(url, a) for scheme, url in urls.items()}
        for scheme, client in opened.items():  # connections open before the renewal
            assert client.wait_until_ready(30), scheme
            np.testing.assert_allclose(client.predict(batch()).predictions, expected, atol=ATOL)

        def on_open_connections() -> None:
            # Used all along (never idle for uvicorn's 5 s keep-alive): still A's sessions.
            for client in opened.values():
                result = client.predict(batch()).predictions
                np.testing.assert_allclose(result, expected, atol=ATOL)

        kubelet_swap(tmp_path / "secret", _secret(b))
        for scheme, url in urls.items():
            deadline = time.monotonic() + RENEWAL_WAIT
            while not _predicts_on_a_new_connection(url, b, expected):
                assert time.monotonic() < deadline, f"{scheme}: B not served\n{server.log()}"
                on_open_connections()
                time.sleep(0.1)
            assert not _predicts_on_a_new_connection(url, a, expected), scheme  # A is gone
        on_open_connections()
        for client in opened.values():
            client.close()

        kubelet_swap(tmp_path / "secret", _secret(a, key=b.key))  # A's certificate, B's key
        warning = (
            "the changed TLS files were not loaded, the previous certificate stays in use: "
            f"--tls-key {paths['tls.key']}: this private key does not match the certificate "
            f"in --tls-cert {paths['tls.crt']} (tried again when the files change)"
        )
        deadline = time.monotonic() + RENEWAL_WAIT
        while warning not in server.log():  # each new connection may be the one that looks
            for scheme, url in urls.items():
                assert _predicts_on_a_new_connection(url, b, expected), scheme
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        for _ in range(3):  # well after the broken renewal was seen: B still
            for scheme, url in urls.items():
                assert _predicts_on_a_new_connection(url, b, expected), scheme
            time.sleep(0.25)
        assert server.log().count(warning) == 1  # once per change, not per handshake
        metrics = _metrics(server, b)
        assert 'recserve_tls_reloads_total{outcome="ok"} 1.0' in metrics
        assert 'recserve_tls_reloads_total{outcome="failed"} 1.0' in metrics
    finally:
        _stopped(server)
