"""TLS options, checked before anything binds or connects: ``recserve serve --tls-*``, the
clients' ``tls_ca`` / ``tls_cert`` / ``tls_key`` and ``recserve predict|eval --tls-*``.
Every error names the option and the file."""

from __future__ import annotations

import argparse
import contextlib
import socket
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from clients._grpc import _failure as _grpc_failure
from clients._tls import CLIENT_CERTIFICATE_HINT, client_tls, tls_hint
from clients.client import RecserveClient, parse_url
from clients.eval import EvalOptions, run_eval
from clients.eval_scorers import ServerScorer
from clients.retry import RetryableError
from embedding_store.cli import main
from embedding_store.errors import InvalidArgumentError, UnavailableError
from embedding_store.tls import PemFile, check_key_pair, read_certificates
from serving import commands, processes
from serving.options import ServeOptions
from serving.processes import options_to_argv
from serving.tls import server_tls
from tests.tls_files import TlsFiles, write_tls_files
from tests.unit.test_rpc_errors import FailedCall


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> TlsFiles:
    return write_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def not_pem(tmp_path) -> Path:
    path = tmp_path / "not.pem"
    path.write_text("hello\n")
    return path


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())
    return parser.parse_args(["serve", "--checkpoint", "ckpt", *argv])


# --------------------------------------------------------------------------- server
def test_the_server_files_are_read_and_matched(tls):
    checked = server_tls(tls.cert, tls.key, tls.ca)
    assert checked is not None and checked.mutual
    assert checked.uvicorn_options() == {
        "ssl_certfile": str(tls.cert),
        "ssl_keyfile": str(tls.key),
        "ssl_ca_certs": str(tls.ca),
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
    }
    assert "BEGIN" not in repr(checked)  # the key's contents stay out of reprs and logs
    plain = server_tls(tls.cert, tls.key, None)
    assert plain is not None and not plain.mutual
    assert plain.uvicorn_options()["ssl_cert_reqs"] == ssl.CERT_NONE
    assert server_tls(None, None, None) is None


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            ("--tls-cert", "c.pem"),
            "--tls-cert given without --tls-key: give both (a certificate and its private key)",
        ),
        (
            ("--tls-key", "k.pem"),
            "--tls-key given without --tls-cert: give both (a certificate and its private key)",
        ),
        (
            ("--tls-client-ca", "ca.pem"),
            "--tls-client-ca needs --tls-cert and --tls-key: client certificates are checked "
            "only on TLS connections",
        ),
    ],
)
def test_the_server_flags_come_together(given, message):
    assert commands.check_arguments(_parse(*given)) == message


def test_a_missing_file_is_named_with_its_flag(tls, tmp_path):
    missing = tmp_path / "missing.pem"
    with pytest.raises(InvalidArgumentError) as error:
        server_tls(missing, tls.key, None)
    assert error.value.message == f"--tls-cert {missing}: cannot read it: No such file or directory"
    with pytest.raises(InvalidArgumentError) as error:
        server_tls(tls.cert, tls.key, tmp_path)
    assert error.value.message == f"--tls-client-ca {tmp_path}: cannot read it: Is a directory"


def test_files_that_are_not_pem_are_refused(tls, not_pem):
    with pytest.raises(InvalidArgumentError) as error:
        server_tls(not_pem, tls.key, None)
    assert error.value.message == (
        f"--tls-cert {not_pem}: not a PEM certificate file (no '-----BEGIN CERTIFICATE-----' line)"
    )
    with pytest.raises(InvalidArgumentError) as error:
        server_tls(tls.cert, not_pem, None)
    assert error.value.message == (
        f"--tls-key {not_pem}: not a PEM private key (no '-----BEGIN ... PRIVATE KEY-----' line)"
    )
    with pytest.raises(InvalidArgumentError) as error:
        server_tls(tls.cert, tls.key, not_pem)
    assert error.value.message.startswith(f"--tls-client-ca {not_pem}: not a PEM certificate")


def test_a_certificate_block_that_does_not_parse_is_refused(tls, tmp_path):
    garbled = tmp_path / "garbled.pem"
    garbled.write_text("-----BEGIN CERTIFICATE-----\nabc\n-----END CERTIFICATE-----\n")
    with pytest.raises(InvalidArgumentError, match=rf"^--tls-cert {garbled}: not a valid PEM"):
        server_tls(garbled, tls.key, None)


def test_a_key_that_does_not_match_the_certificate_is_refused(tls):
    with pytest.raises(InvalidArgumentError) as error:
        server_tls(tls.cert, tls.other_key, None)
    assert error.value.message == (
        f"--tls-key {tls.other_key}: this private key does not match the certificate in "
        f"--tls-cert {tls.cert}"
    )


def test_an_encrypted_key_is_refused_rather_than_prompting(tls, tmp_path):
    encrypted = tmp_path / "encrypted.pem"
    encrypted.write_text("-----BEGIN ENCRYPTED PRIVATE KEY-----\nabc\n-----END ENCRYPTED ...\n")
    with pytest.raises(InvalidArgumentError, match=rf"^--tls-key {encrypted}: the private key is"):
        server_tls(tls.cert, encrypted, None)


def test_recserve_serve_reports_a_bad_key_without_a_traceback(tls, capsys):
    code = main(
        ["serve", "--checkpoint", "nowhere", "--tls-cert", str(tls.cert),
         "--tls-key", str(tls.other_key)]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    assert err == (
        f"recserve serve: error: --tls-key {tls.other_key}: this private key does not match "
        f"the certificate in --tls-cert {tls.cert}\n"
    )


def test_worker_processes_get_the_tls_files(tls):
    options = ServeOptions(
        checkpoint=Path("ckpt"),
        tls_cert=tls.cert,
        tls_key=tls.key,
        tls_client_ca=tls.ca,
        tls_reload_seconds=0.5,
    )
    argv = options_to_argv(options)
    assert f"--tls-cert={tls.cert}" in argv
    assert f"--tls-key={tls.key}" in argv
    assert f"--tls-client-ca={tls.ca}" in argv
    assert "--tls-reload-seconds=0.5" in argv  # each process reloads its own files
    parsed = _parse(*argv[1:])
    assert (parsed.tls_cert, parsed.tls_key, parsed.tls_client_ca) == (tls.cert, tls.key, tls.ca)
    assert parsed.tls_reload_seconds == 0.5
    plain = options_to_argv(ServeOptions(checkpoint=Path("c")))
    assert [arg for arg in plain if "tls" in arg] == ["--tls-reload-seconds=10.0"]


# --------------------------------------------------------------------------- clients
def test_grpcs_is_grpc_over_tls():
    endpoint = parse_url("grpcs://127.0.0.1:8001")
    assert (endpoint.protocol, endpoint.base, endpoint.url, endpoint.tls) == (
        "grpc",
        "127.0.0.1:8001",
        "grpcs://127.0.0.1:8001",
        True,
    )
    assert parse_url("https://127.0.0.1:8000").tls
    assert not parse_url("grpc://127.0.0.1:8001").tls
    assert not parse_url("127.0.0.1:8000").tls


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("grpcs://127.0.0.1", "gRPC server URL 'grpcs://127.0.0.1' needs a port"),
        (
            "grpcs://127.0.0.1:8001/v2",
            "gRPC server URL 'grpcs://127.0.0.1:8001/v2' cannot have a path",
        ),
        (
            "grpcx://127.0.0.1:8001",
            "server URL 'grpcx://127.0.0.1:8001': scheme must be http, https, grpc or grpcs, "
            "got 'grpcx'",
        ),
    ],
)
def test_a_grpcs_url_is_checked_as_a_grpc_one(url, message):
    with pytest.raises(InvalidArgumentError) as error:
        parse_url(url)
    assert error.value.message == message


def test_client_options_are_checked_when_the_client_is_made(tls, tmp_path):
    with RecserveClient("https://127.0.0.1:1", tls_ca=tls.ca) as client:
        assert client.url == "https://127.0.0.1:1"
    with RecserveClient(
        "grpcs://127.0.0.1:1", tls_cert=tls.client_cert, tls_key=tls.client_key
    ) as client:
        assert client.protocol == "grpc"
    with pytest.raises(InvalidArgumentError) as error:
        RecserveClient("http://127.0.0.1:1", tls_ca=tls.ca)
    assert error.value.message == (
        "tls_ca given for the plaintext URL http://127.0.0.1:1: use https:// or grpcs:// for TLS"
    )
    with pytest.raises(InvalidArgumentError) as error:
        RecserveClient("grpc://127.0.0.1:1", tls_cert=tls.client_cert, tls_key=tls.client_key)
    assert error.value.message.startswith("tls_cert, tls_key given for the plaintext URL grpc://")
    with pytest.raises(InvalidArgumentError) as error:
        RecserveClient("https://127.0.0.1:1", tls_cert=tls.client_cert)
    assert error.value.message == (
        "tls_cert given without tls_key: give both (a certificate and its private key)"
    )
    missing = tmp_path / "ca.pem"
    with pytest.raises(InvalidArgumentError) as error:
        RecserveClient("https://127.0.0.1:1", tls_ca=missing)
    assert error.value.message == f"tls_ca {missing}: cannot read it: No such file or directory"
    with pytest.raises(InvalidArgumentError) as error:
        RecserveClient(
            "https://127.0.0.1:1", tls_cert=tls.client_cert, tls_key=tls.other_client_key
        )
    assert error.value.message == (
        f"tls_key {tls.other_client_key}: this private key does not match the certificate "
        f"in tls_cert {tls.client_cert}"
    )
    with pytest.raises(InvalidArgumentError) as error:
        RecserveClient("https://127.0.0.1:1", tls_ca=123)  # type: ignore[arg-type]
    assert error.value.message == "tls_ca must be the path of a PEM file, got 123"


def test_the_cli_names_its_flags(tls, not_pem, capsys, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"user": 1}\n')
    code = main(
        ["predict", "--url", "https://127.0.0.1:1", "--input", str(rows), "--tls-ca", str(not_pem)]
    )
    assert code == 1
    assert capsys.readouterr().err == (
        f"recserve predict: error: --tls-ca {not_pem}: not a PEM certificate file "
        "(no '-----BEGIN CERTIFICATE-----' line)\n"
    )
    code = main(
        ["predict", "--url", "http://127.0.0.1:1", "--input", str(rows), "--tls-ca", str(tls.ca)]
    )
    assert code == 1
    assert capsys.readouterr().err == (
        "recserve predict: error: --tls-ca given for the plaintext URL http://127.0.0.1:1: use "
        "https:// or grpcs:// for TLS\n"
    )
    assert client_tls(True, "https://x", tls.ca, names=("--tls-ca", "--tls-cert", "--tls-key"))


def test_eval_takes_tls_flags_for_a_server_only(tls, tmp_path):
    options = EvalOptions(
        data=(tmp_path / "rows.csv",),
        out=tmp_path / "out.csv",
        checkpoint=tmp_path,
        tls_ca=str(tls.ca),  # type: ignore[arg-type]
    )
    assert options.tls_ca == tls.ca
    with pytest.raises(InvalidArgumentError) as error:
        run_eval(options)
    assert error.value.message == "--tls-ca given without --url: they are for a server"


@pytest.mark.parametrize(
    ("message", "secure", "says"),
    [
        ("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed", False, "pass tls_ca"),
        ("EOF occurred in violation of protocol (_ssl.c:2427)", False, "client certificate"),
        ("[SSL: TLSV1_ALERT_UNKNOWN_CA] tlsv1 alert unknown ca", False, "client certificate"),
        ("failed to connect to all addresses; Socket closed", True, "client certificate"),
        ("failed to connect to all addresses; Socket closed", False, None),
        ("[SSL: WRONG_VERSION_NUMBER] wrong version number", False, "speaking plaintext"),
        ("Connection refused", False, None),
    ],
)
def test_handshake_failures_say_what_to_do(message, secure, says):
    hint = tls_hint(message, secure=secure)
    assert (says in hint) if says else hint == ""


class _ClosingServer:
    """A server on 127.0.0.1 (TLS with ``tls``, plaintext without) that completes each
    handshake, reads the request head and closes the connection without an answer: what a
    TLS 1.3 client sees when a server that wants a client certificate drops it before the
    client has read the server's alert."""

    def __init__(self, tls: TlsFiles | None, connections: int = 2) -> None:
        self.context: ssl.SSLContext | None = None
        if tls is not None:
            self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.context.load_cert_chain(tls.cert, tls.key)
        self.connections = connections
        self.accepted = 0  # connections accepted so far
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(10)
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        for _ in range(self.connections):  # one connection per client of the test; bounded
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            with contextlib.suppress(OSError), raw:
                c = raw if self.context is None else self.context.wrap_socket(raw, server_side=True)
                with c:
                    c.settimeout(10)
                    received = b""
                    while b"\r\n\r\n" not in received and len(received) < 65536:
                        chunk = c.recv(4096)
                        if not chunk:
                            break
                        received += chunk

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes a pending accept()
        self.listener.close()
        self.thread.join(timeout=10)


def test_a_dropped_https_connection_hints_at_a_client_certificate_only_without_one(tls):
    server = _ClosingServer(tls)
    url = f"https://127.0.0.1:{server.port}"
    with_certificate = {"tls_cert": tls.client_cert, "tls_key": tls.client_key}
    messages = []
    try:
        for certificate in ({}, with_certificate):
            client = RecserveClient(url, tls_ca=tls.ca, retries=0, timeout=10, **certificate)
            with client, pytest.raises(UnavailableError) as error:
                client.metadata()
            messages.append(error.value.message)
    finally:
        server.close()
    assert messages[0].endswith(CLIENT_CERTIFICATE_HINT), messages[0]
    assert "Remote end closed connection without response" in messages[1], messages[1]
    assert "client certificate" not in messages[1]


def test_a_dropped_plain_http_connection_does_not_hint_at_tls():
    """The client-certificate hint is for https:// only: over plaintext a dropped
    connection has nothing to do with certificates."""
    server = _ClosingServer(None, connections=1)
    try:
        client = RecserveClient(f"http://127.0.0.1:{server.port}", retries=0, timeout=10)
        with client, pytest.raises(UnavailableError) as error:
            client.metadata()
    finally:
        server.close()
    assert "Remote end closed connection without response" in error.value.message
    assert "certificate" not in error.value.message


# --------------------------------------------------------------------------- PEM checks
def _encrypted_key(tls: TlsFiles, path: Path, private_format: str) -> Path:
    """``tls.key`` encrypted with a passphrase, in PKCS#8 or in the traditional OpenSSL
    format (``Proc-Type: 4,ENCRYPTED`` under a ``BEGIN EC PRIVATE KEY`` line)."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(tls.key.read_bytes(), None)
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            getattr(serialization.PrivateFormat, private_format),
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    return path


def test_a_traditional_encrypted_key_is_refused_as_encrypted(tls, tmp_path):
    """An encrypted key in OpenSSL's old format says so only in a Proc-Type header."""
    encrypted = _encrypted_key(tls, tmp_path / "traditional.pem", "TraditionalOpenSSL")
    assert b"-----BEGIN EC PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED" in encrypted.read_bytes()
    with pytest.raises(InvalidArgumentError) as error:
        server_tls(tls.cert, encrypted, None)
    assert error.value.message == (
        f"--tls-key {encrypted}: the private key is encrypted; give it unencrypted (e.g. "
        "`openssl pkey -in KEY -out KEY.pem`), readable only by this user or mounted from a "
        "Secret"
    )


def test_matching_an_encrypted_key_fails_rather_than_asking_for_a_passphrase(tls, tmp_path):
    """check_key_pair on its own never prompts on a terminal (nor fails reading one): an
    encrypted key it is given is not a valid key."""
    encrypted = _encrypted_key(tls, tmp_path / "pkcs8.pem", "PKCS8")
    cert = read_certificates("--tls-cert", tls.cert)
    key = PemFile("--tls-key", encrypted, encrypted.read_bytes())
    with pytest.raises(InvalidArgumentError) as error:
        check_key_pair(cert, key)
    assert error.value.message.startswith(f"--tls-key {encrypted}: not a valid private key (")


def test_files_removed_after_they_were_read_are_named(tls, tmp_path):
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert = PemFile("--tls-cert", cert_path, tls.cert.read_bytes())
    key = PemFile("--tls-key", key_path, tls.key.read_bytes())
    with pytest.raises(InvalidArgumentError) as error:
        check_key_pair(cert, key)
    assert error.value.message == (
        f"--tls-cert {cert_path} / --tls-key {key_path}: cannot read them: "
        "No such file or directory"
    )


def test_an_empty_path_is_refused_by_name():
    """An empty string names no file (Path("") would be the current directory)."""
    with pytest.raises(InvalidArgumentError) as error:
        RecserveClient("https://127.0.0.1:1", tls_ca="")
    assert error.value.message == "tls_ca must be the path of a PEM file, got ''"
    with pytest.raises(InvalidArgumentError) as error:
        RecserveClient("http://127.0.0.1:1", tls_ca="")
    assert error.value.message.startswith("tls_ca given for the plaintext URL http://")


# --------------------------------------------------------------------------- start-up line
def test_the_start_up_line_says_whether_client_certificates_are_required(tls):
    mutual, plain = server_tls(tls.cert, tls.key, tls.ca), server_tls(tls.cert, tls.key, None)
    assert mutual is not None and plain is not None
    assert mutual.describe() == "TLS on (https://, grpcs://; client certificates required)"
    assert plain.describe() == "TLS on (https://, grpcs://; no client certificates)"


def test_a_supervisor_checks_the_tls_files_before_it_starts_workers(tls, monkeypatch, capsys):
    """recserve serve --workers N: a key that does not match stops the supervisor before it
    reserves ports or starts a process."""
    started: list[ServeOptions] = []

    def serve_processes(options: ServeOptions) -> int:
        started.append(options)
        return 0

    monkeypatch.setattr(processes, "serve_processes", serve_processes)
    code = main(
        ["serve", "--checkpoint", "nowhere", "--workers", "2", "--tls-cert", str(tls.cert),
         "--tls-key", str(tls.other_key)]
    )  # fmt: skip
    assert (code, started) == (1, [])
    assert capsys.readouterr().err == (
        f"recserve serve: error: --tls-key {tls.other_key}: this private key does not match "
        f"the certificate in --tls-cert {tls.cert}\n"
    )


# --------------------------------------------------------------------------- eval
@pytest.mark.parametrize(
    ("given", "flags"),
    [
        ({"tls_key": "k.pem"}, "--tls-key"),
        ({"tls_cert": "c.pem", "tls_key": "k.pem"}, "--tls-cert, --tls-key"),
    ],
)
def test_eval_names_every_tls_flag_given_without_url(tmp_path, given, flags):
    options = EvalOptions(
        data=(tmp_path / "rows.csv",), out=tmp_path / "out.csv", checkpoint=tmp_path, **given
    )
    assert {name: getattr(options, name) for name in given} == {
        name: Path(value) for name, value in given.items()
    }
    with pytest.raises(InvalidArgumentError) as error:
        run_eval(options)
    assert error.value.message == f"{flags} given without --url: they are for a server"


@pytest.mark.parametrize("flag", ["--tls-ca", "--tls-key"])
def test_eval_checks_the_tls_files_before_it_loads_the_checkpoint(flag, tls, tmp_path, monkeypatch):
    """eval --compare loaded the checkpoint before it read the server's TLS files: a
    mistyped --tls-* path was found only after the model load."""
    from clients import eval as eval_module

    def no_load(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the checkpoint loaded before the TLS files were checked")

    monkeypatch.setattr(eval_module, "InProcessScorer", no_load)
    data = tmp_path / "rows.csv"
    data.write_text("user\n1\n")
    missing = tmp_path / "missing.pem"
    files = {"tls_ca": missing}
    if flag == "--tls-key":
        files = {"tls_cert": tls.cert, "tls_key": missing}
    options = EvalOptions(
        data=(data,),
        out=tmp_path / "out.csv",
        checkpoint=tmp_path / "checkpoint",
        url="https://127.0.0.1:1",
        compare=True,
        **files,
    )
    with pytest.raises(InvalidArgumentError) as error:
        run_eval(options)
    assert error.value.message == f"{flag} {missing}: cannot read it: No such file or directory"
    assert not (tmp_path / "out.csv").exists()


def test_eval_refuses_tls_flags_for_a_plaintext_server(tls):
    """Checked when the scorer is made, before any request."""
    with pytest.raises(InvalidArgumentError) as error:
        ServerScorer("http://127.0.0.1:1", "model", tls_ca=tls.ca)
    assert error.value.message == (
        "--tls-ca given for the plaintext URL http://127.0.0.1:1: use https:// or grpcs:// for TLS"
    )


# --------------------------------------------------------------------------- hints
_TRUST_HINT = (
    " (the server's certificate is not signed by a CA this client trusts: pass tls_ca / "
    "--tls-ca, the CA's PEM file)"
)
_PLAINTEXT_HINT = " (is the server speaking plaintext? use http:// or grpc://)"


@pytest.mark.parametrize(
    ("message", "hint"),
    [
        # OpenSSL (ssl, urllib3) and BoringSSL (gRPC) spell the same failures differently.
        ("certificate verify failed: unable to get local issuer certificate", _TRUST_HINT),
        ("SSL_ERROR_SSL: CERTIFICATE_VERIFY_FAILED", _TRUST_HINT),
        ("tlsv13 alert certificate required (_ssl.c:2580)", CLIENT_CERTIFICATE_HINT),
        ("SSL routines:OPENSSL_internal:TLSV1_CERTIFICATE_REQUIRED", CLIENT_CERTIFICATE_HINT),
        ("sslv3 alert bad certificate (_ssl.c:2580)", CLIENT_CERTIFICATE_HINT),
        ("SSL routines:OPENSSL_internal:SSLV3_ALERT_BAD_CERTIFICATE", CLIENT_CERTIFICATE_HINT),
        ("SSL routines:OPENSSL_internal:TLSV1_ALERT_UNKNOWN_CA", CLIENT_CERTIFICATE_HINT),
        ("unexpected eof while reading (_ssl.c:2580)", CLIENT_CERTIFICATE_HINT),
        ("[SSL] record layer failure (_ssl.c:1000)", _PLAINTEXT_HINT),
        ("SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER", _PLAINTEXT_HINT),
        ("certificate has expired", ""),
    ],
)  # fmt: skip
def test_each_handshake_failure_gets_its_hint(message, hint):
    assert tls_hint(message) == hint


def test_grpcs_to_a_plaintext_grpc_server_hints_at_the_scheme(tls):
    """gRPC (BoringSSL) reports a plaintext answer as WRONG_VERSION_NUMBER only."""
    import grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        client = RecserveClient(f"grpcs://127.0.0.1:{port}", tls_ca=tls.ca, retries=0, timeout=10)
        with client, pytest.raises(UnavailableError) as error:
            client.metadata()
    finally:
        server.stop(grace=None)
    assert "WRONG_VERSION_NUMBER" in error.value.message
    assert error.value.message.endswith(_PLAINTEXT_HINT)


def test_a_failed_handshake_is_not_retried(tls):
    """A server certificate this client does not trust fails the same way on every try: one
    connection, however many retries are allowed."""
    server = _ClosingServer(tls, connections=3)
    try:
        client = RecserveClient(
            f"https://127.0.0.1:{server.port}", tls_ca=tls.other_ca, retries=2, backoff=0.01
        )
        with client, pytest.raises(UnavailableError) as error:
            client.metadata()
    finally:
        server.close()
    assert error.value.message.endswith(_TRUST_HINT)
    assert server.accepted == 1


@pytest.mark.parametrize(
    ("details", "retried"),
    [
        ("failed to connect to all addresses; last error: Connection refused", True),
        ("Socket closed", True),  # also a server restarting: retried
        ("OPENSSL_internal:CERTIFICATE_VERIFY_FAILED", False),
        ("OPENSSL_internal:WRONG_VERSION_NUMBER", False),
        ("OPENSSL_internal:TLSV1_ALERT_UNKNOWN_CA", False),
        ("ssl alert certificate required", False),
    ],
)
def test_grpc_retries_unavailable_but_not_a_refused_handshake(details, retried):
    """A refused TLS handshake fails the same way on every try: the gRPC client raises it at
    once, as the HTTP client does, instead of after its retries' back-off."""
    failure = _grpc_failure(
        "grpcs://127.0.0.1:1", FailedCall(grpc.StatusCode.UNAVAILABLE, details), secure=True
    )
    assert isinstance(failure, RetryableError) is retried
    error = failure.error if isinstance(failure, RetryableError) else failure
    assert isinstance(error, UnavailableError)
    assert details in error.message
