"""The clients' TLS options (``tls_ca``, ``tls_cert``, ``tls_key``), checked up front.

Files are read once, when the client is made: a wrong path or a key that does not match its
certificate fails there, naming the option and the file, not at the first call.
"""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from embedding_store.cli_types import non_empty_path
from embedding_store.errors import InvalidArgumentError
from embedding_store.tls import (
    PemFile,
    check_key_pair,
    pair_problem,
    read_certificates,
    read_private_key,
)

if TYPE_CHECKING:
    import grpc

#: How the library names the options; the CLIs pass their flags (``--tls-ca`` ...).
LIBRARY_NAMES = ("tls_ca", "tls_cert", "tls_key")


@dataclass(frozen=True)
class ClientTls:
    """The CA to trust (None: the system's trust store) and the client certificate for
    mutual TLS (None: none presented)."""

    ca: PemFile | None = None
    cert: PemFile | None = None
    key: PemFile | None = None

    def urllib3_options(self) -> dict[str, Any]:
        """``urllib3.PoolManager`` keywords (it verifies the server by default)."""
        options: dict[str, Any] = {}
        if self.ca is not None:
            options["ca_certs"] = str(self.ca.path)
        if self.cert is not None and self.key is not None:
            options["cert_file"] = str(self.cert.path)
            options["key_file"] = str(self.key.path)
        return options

    def ssl_context(self) -> ssl.SSLContext:
        """A client context for the standard library (``urllib.request``)."""
        context = ssl.create_default_context(cafile=str(self.ca.path) if self.ca else None)
        if self.cert is not None and self.key is not None:
            context.load_cert_chain(self.cert.path, self.key.path)
        return context

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        """``grpc.ssl_channel_credentials`` from the same files (root certificates None:
        gRPC's own trust store)."""
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.data if self.ca else None,
            private_key=self.key.data if self.key else None,
            certificate_chain=self.cert.data if self.cert else None,
        )


def client_tls(
    scheme_is_tls: bool,
    url: str,
    ca: object = None,
    cert: object = None,
    key: object = None,
    *,
    names: tuple[str, str, str] = LIBRARY_NAMES,
) -> ClientTls | None:
    """The checked TLS settings of a client of ``url`` (None for a plaintext URL without
    TLS options). InvalidArgumentError naming the option (``names``) and the file."""
    ca_name, cert_name, key_name = names
    given = [name for name, value in zip(names, (ca, cert, key)) if value is not None]
    if not scheme_is_tls:
        if given:
            raise InvalidArgumentError(
                f"{', '.join(given)} given for the plaintext URL {url}: use https:// or "
                "grpcs:// for TLS"
            )
        return None
    problem = pair_problem(cert_name, cert, key_name, key)
    if problem:
        raise InvalidArgumentError(problem)
    ca_pem = read_certificates(ca_name, ca) if ca is not None else None
    cert_pem = read_certificates(cert_name, cert) if cert is not None else None
    key_pem = read_private_key(key_name, key) if key is not None else None
    if cert_pem is not None and key_pem is not None:
        check_key_pair(cert_pem, key_pem)
    return ClientTls(ca_pem, cert_pem, key_pem)


#: What a client reads when a server that wants client certificates refused its handshake
#: (a TLS 1.3 client learns it only from the alert, or the connection closing, after it).
_NO_CLIENT_CERTIFICATE = (
    "certificate required",
    "certificate_required",
    "eof occurred in violation of protocol",
    "unexpected eof",
    "unknown ca",
    "unknown_ca",
    "bad certificate",
    "bad_certificate",
)


#: What a TLS client reads when the server answered its handshake in plaintext.
_PLAINTEXT_SERVER = ("wrong version number", "wrong_version_number", "record layer failure")


CLIENT_CERTIFICATE_HINT = (
    " (the server ended the TLS handshake: it may require a client certificate signed "
    "by a CA it trusts: pass tls_cert and tls_key / --tls-cert and --tls-key)"
)


def tls_hint(message: str, *, secure: bool = False) -> str:
    """What to do about a TLS failure whose message is ``message`` ("" when not TLS).
    ``secure``: the connection speaks TLS (gRPC reports a handshake the server ended only
    as "Socket closed")."""
    if "CERTIFICATE_VERIFY_FAILED" in message or "certificate verify failed" in message:
        return (
            " (the server's certificate is not signed by a CA this client trusts: pass "
            "tls_ca / --tls-ca, the CA's PEM file)"
        )
    lowered = message.lower()
    if any(sign in lowered for sign in _NO_CLIENT_CERTIFICATE) or (
        secure and "socket closed" in lowered
    ):
        return CLIENT_CERTIFICATE_HINT
    # OpenSSL says "wrong version number" (or "record layer failure" from 3.2), gRPC's
    # BoringSSL only WRONG_VERSION_NUMBER.
    if any(sign in lowered for sign in _PLAINTEXT_SERVER):
        return " (is the server speaking plaintext? use http:// or grpc://)"
    return ""


#: Signs that the peer refused the handshake itself: a retry would fail the same way. (An
#: unexpected EOF or a closed socket may also be a server restarting: those stay retryable.)
_HANDSHAKE_REFUSED = (
    "certificate_verify_failed",
    "certificate verify failed",
    "certificate required",
    "certificate_required",
    "unknown ca",
    "unknown_ca",
    "bad certificate",
    "bad_certificate",
    *_PLAINTEXT_SERVER,
)


def handshake_refused(message: str) -> bool:
    """Whether ``message`` says the TLS handshake was refused for good (an untrusted
    certificate, a client certificate refused or missing, a plaintext peer)."""
    lowered = message.lower()
    return any(sign in lowered for sign in _HANDSHAKE_REFUSED)


#: The flags of ``recserve predict`` and ``recserve eval``.
CLI_NAMES = ("--tls-ca", "--tls-cert", "--tls-key")


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls-ca``, ``--tls-cert`` and ``--tls-key`` (for an https:// or grpcs:// --url)."""
    parser.add_argument(
        "--tls-ca",
        type=non_empty_path,
        default=None,
        metavar="PEM",
        help="CA certificate(s) to trust for an https:// --url (default: the system's)",
    )
    parser.add_argument(
        "--tls-cert",
        type=non_empty_path,
        default=None,
        metavar="PEM",
        help="client certificate, for a server that requires one (mutual TLS; with --tls-key)",
    )
    parser.add_argument(
        "--tls-key",
        type=non_empty_path,
        default=None,
        metavar="PEM",
        help="unencrypted private key of --tls-cert",
    )
