"""The embedding tier's mutual TLS from RECSERVE_TIER_TLS_CERT / _KEY / _CA: all three or none,
every file checked up front (at a server's start, when a tier client is made), each error
naming the variable and the file; files read once per process."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives import serialization

from embedding_store.config import EmbeddingConfig, GlobalConfig, SlotConfig
from embedding_store.errors import ConfigError, UnavailableError
from embedding_store.grpc_common import (
    TLS_VARIABLES,
    bind_tier_port,
    error_from_rpc,
    reset_tier_tls_cache,
    tier_channel,
    tier_tls,
    tls_hint,
)
from embedding_store.ps_process import ParameterServerOptions, ParameterServerProcess
from tests.tls_files import TlsFiles, write_tls_files

CERT, KEY, CA = TLS_VARIABLES


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> TlsFiles:
    return write_tls_files(tmp_path_factory.mktemp("tier-tls"))


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in TLS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    reset_tier_tls_cache()
    yield
    reset_tier_tls_cache()


def set_files(monkeypatch, cert: object, key: object, ca: object) -> None:
    for name, value in zip(TLS_VARIABLES, (cert, key, ca)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))


class FakeServer:
    def __init__(self) -> None:
        self.bound: list[tuple[str, str, object]] = []

    def add_insecure_port(self, address: str) -> int:
        self.bound.append(("insecure", address, None))
        return 7000

    def add_secure_port(self, address: str, credentials: object) -> int:
        self.bound.append(("secure", address, credentials))
        return 7001


def test_no_variable_is_plaintext(monkeypatch):
    monkeypatch.setenv(CERT, "  ")  # empty counts as unset
    assert tier_tls() is None
    server = FakeServer()
    assert bind_tier_port(server, "127.0.0.1:0") == 7000  # type: ignore[arg-type]
    assert server.bound == [("insecure", "127.0.0.1:0", None)]
    tier_channel("127.0.0.1:1").close()


def test_all_three_give_mutual_tls(monkeypatch, tls):
    set_files(monkeypatch, tls.cert, tls.key, tls.ca)
    files = tier_tls()
    assert files is not None
    assert (files.cert.path, files.key.path, files.ca.path) == (tls.cert, tls.key, tls.ca)
    assert "PRIVATE KEY" not in repr(files)
    server = FakeServer()
    assert bind_tier_port(server, "127.0.0.1:0") == 7001  # type: ignore[arg-type]
    assert [b[:2] for b in server.bound] == [("secure", "127.0.0.1:0")]
    tier_channel("127.0.0.1:1").close()


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            (True, False, False),
            f"{CERT} set without {KEY} and {CA}: the embedding tier's mutual TLS needs all "
            f"three of {CERT}, {KEY}, {CA} (or none, for plaintext)",
        ),
        (
            (True, True, False),
            f"{CERT} and {KEY} set without {CA}: the embedding tier's mutual TLS needs all "
            f"three of {CERT}, {KEY}, {CA} (or none, for plaintext)",
        ),
        (
            (False, False, True),
            f"{CA} set without {CERT} and {KEY}: the embedding tier's mutual TLS needs all "
            f"three of {CERT}, {KEY}, {CA} (or none, for plaintext)",
        ),
    ],
)
def test_some_but_not_all_is_an_error(monkeypatch, tls, given, message):
    files = (tls.cert, tls.key, tls.ca)
    set_files(monkeypatch, *(f if g else None for f, g in zip(files, given)))
    with pytest.raises(ConfigError) as raised:
        tier_tls()
    assert raised.value.message == message
    with pytest.raises(ConfigError):
        tier_channel("127.0.0.1:1")  # a client fails when it is made, not at its first call


def test_a_missing_file_is_named(monkeypatch, tls, tmp_path):
    missing = tmp_path / "ca.pem"
    set_files(monkeypatch, tls.cert, tls.key, missing)
    with pytest.raises(ConfigError) as raised:
        tier_tls()
    assert raised.value.message == f"{CA} {missing}: cannot read it: No such file or directory"


def test_a_key_of_another_certificate_is_named(monkeypatch, tls):
    set_files(monkeypatch, tls.cert, tls.other_key, tls.ca)
    with pytest.raises(ConfigError) as raised:
        tier_tls()
    assert raised.value.message == (
        f"{KEY} {tls.other_key}: this private key does not match the certificate in "
        f"{CERT} {tls.cert}"
    )


def test_not_pem_and_encrypted_keys_are_named(monkeypatch, tls, tmp_path):
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    set_files(monkeypatch, not_pem, tls.key, tls.ca)
    with pytest.raises(ConfigError) as raised:
        tier_tls()
    assert raised.value.message == (
        f"{CERT} {not_pem}: not a PEM certificate file (no '-----BEGIN CERTIFICATE-----' line)"
    )
    set_files(monkeypatch, tls.cert, not_pem, tls.ca)
    with pytest.raises(ConfigError, match=rf"^{KEY} {not_pem}: not a PEM private key"):
        tier_tls()
    key = serialization.load_pem_private_key(tls.key.read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.pem"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    set_files(monkeypatch, tls.cert, encrypted, tls.ca)
    with pytest.raises(ConfigError, match=rf"^{KEY} {encrypted}: the private key is encrypted"):
        tier_tls()


def test_files_are_read_once_per_process(monkeypatch, tls, tmp_path):
    copies = {}
    for name, source in (("cert", tls.cert), ("key", tls.key), ("ca", tls.ca)):
        copies[name] = tmp_path / f"{name}.pem"
        copies[name].write_bytes(source.read_bytes())
    set_files(monkeypatch, copies["cert"], copies["key"], copies["ca"])
    first = tier_tls()
    for path in copies.values():
        path.unlink()
    assert tier_tls() is first  # no file read again: channels and servers pay nothing
    reset_tier_tls_cache()
    with pytest.raises(ConfigError, match=f"^{CERT} .*cannot read it"):
        tier_tls()


def test_a_server_checks_them_before_it_binds(monkeypatch, tls):
    set_files(monkeypatch, tls.cert, tls.other_key, tls.ca)
    process = ParameterServerProcess(
        EmbeddingConfig(slots_config={"a": SlotConfig(dim=4)}),
        GlobalConfig(),
        ParameterServerOptions(port=0),
    )
    with pytest.raises(ConfigError, match=f"^{KEY} "):
        process.start()
    assert process.port is None and process.server is None


def test_handshake_failures_get_a_hint(monkeypatch, tls):
    verify = "Tls handshake failed: CERTIFICATE_VERIFY_FAILED: unable to get local issuer"
    assert f"signed by the CA in {CA}" in tls_hint(verify)
    assert "answered in plaintext" in tls_hint("SSL_ERROR_SSL: WRONG_VERSION_NUMBER")
    closed = (
        "failed to connect to all addresses; last error: UNAVAILABLE: 127.0.0.1:1: Socket closed"
    )
    assert "if the embedding tier uses TLS" in tls_hint(closed)  # this process: plaintext
    set_files(monkeypatch, tls.cert, tls.key, tls.ca)
    assert f"is this process's {CERT} signed by the CA the peer trusts" in tls_hint(closed)
    assert tls_hint("Connection refused") == ""

    class Failed:
        def code(self):
            import grpc

            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return verify

    error = error_from_rpc(Failed(), "parameter server 127.0.0.1:1 (shard 1 of 2)")  # type: ignore[arg-type]
    assert isinstance(error, UnavailableError)
    assert error.message.startswith("parameter server 127.0.0.1:1 (shard 1 of 2) is unavailable")
    assert error.message.endswith("or does not name the address dialled)")
