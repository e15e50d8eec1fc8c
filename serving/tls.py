"""``recserve serve --tls-cert/--tls-key [--tls-client-ca]``: the files, checked before the
server binds anything, and what uvicorn (HTTPS) and gRPC (SSL credentials) make of them.

Renewed files are taken without a restart (:class:`ReloadingServerTls`): every new handshake
on either port asks :class:`embedding_store.tls_reload.ReloadingTls` for the current files,
which looks at them at most every ``--tls-reload-seconds``. HTTPS: uvicorn's SSL context
stays the listener's; its SNI callback (called on every ClientHello, with or without SNI)
moves the connection to a context made from the renewed files. It never loads new files
into the listener's own context: a failed ``load_cert_chain`` can leave a context half
changed. gRPC: dynamic SSL credentials whose fetcher answers the renewed files.

Light to import (no torch, grpc only when its credentials are built): the supervisor of a
``--workers`` server checks the files too, before it reserves the ports.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedding_store.errors import InvalidArgumentError
from embedding_store.tls import (
    PemFile,
    check_key_pair,
    pair_problem,
    read_certificates,
    read_private_key,
)
from embedding_store.tls_reload import (
    DEFAULT_RELOAD_SECONDS,
    ReloadingTls,
    dynamic_server_credentials,
)

if TYPE_CHECKING:
    import grpc


def tls_flags_problem(cert: object, key: object, client_ca: object) -> str | None:
    """Why these ``--tls-*`` values cannot go together, or None."""
    problem = pair_problem("--tls-cert", cert, "--tls-key", key)
    if problem:
        return problem
    if client_ca is not None and cert is None:
        return (
            "--tls-client-ca needs --tls-cert and --tls-key: client certificates are "
            "checked only on TLS connections"
        )
    return None


@dataclass(frozen=True)
class ServerTls:
    """The server's certificate chain and key, and the CA its clients' certificates must be
    signed by (None: no client certificates asked for)."""

    cert: PemFile
    key: PemFile
    client_ca: PemFile | None

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def uvicorn_options(self) -> dict[str, Any]:
        """``uvicorn.Config`` keywords: HTTPS, with client certificates required for mTLS."""
        return {
            "ssl_certfile": str(self.cert.path),
            "ssl_keyfile": str(self.key.path),
            "ssl_ca_certs": str(self.client_ca.path) if self.client_ca else None,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if self.client_ca else ssl.CERT_NONE,
        }

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """gRPC SSL credentials from the same files (read once, at the check)."""
        import grpc

        return grpc.ssl_server_credentials(
            [(self.key.data, self.cert.data)],
            root_certificates=self.client_ca.data if self.client_ca else None,
            require_client_auth=self.mutual,
        )

    def certificate_configuration(self) -> grpc.ServerCertificateConfiguration:
        """What gRPC's dynamic credentials take: the same key, chain and client CA."""
        import grpc

        return grpc.ssl_server_certificate_configuration(
            [(self.key.data, self.cert.data)],
            root_certificates=self.client_ca.data if self.client_ca else None,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """An HTTPS server context from the files, for the listener's SNI callback to move a
        new connection to: only its certificate, key and CA store are used
        (SSL_set_SSL_CTX keeps the connection's protocol, ciphers and verify mode, uvicorn's:
        the same verify mode, as ``--tls-client-ca`` cannot come or go without a restart)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        # A password callback: an encrypted key must fail here, never prompt on a terminal.
        context.load_cert_chain(self.cert.path, self.key.path, password=lambda: b"")
        context.verify_mode = ssl.CERT_REQUIRED if self.client_ca else ssl.CERT_NONE
        if self.client_ca:
            context.load_verify_locations(self.client_ca.path)
        return context

    def describe(self) -> str:
        """For the start-up line: what a client must speak."""
        clients = "client certificates required" if self.mutual else "no client certificates"
        return f"TLS on (https://, grpcs://; {clients})"


def server_tls(cert: Path | None, key: Path | None, client_ca: Path | None) -> ServerTls | None:
    """The checked TLS files, or None (plaintext). InvalidArgumentError naming the flag and
    the file for a pair given half, a file that cannot be read, is not PEM, or a key that
    does not match the certificate."""
    problem = tls_flags_problem(cert, key, client_ca)
    if problem:
        raise InvalidArgumentError(problem)
    if cert is None or key is None:
        return None
    cert_pem = read_certificates("--tls-cert", cert)
    key_pem = read_private_key("--tls-key", key)
    check_key_pair(cert_pem, key_pem)
    ca_pem = read_certificates("--tls-client-ca", client_ca) if client_ca is not None else None
    return ServerTls(cert_pem, key_pem, ca_pem)


class ReloadingServerTls:
    """The server's TLS files, reloaded when they change (at most every ``interval``
    seconds, on a new handshake): both front ends of one process share it, so a renewal
    is read, logged and counted once per process. Connections already open keep theirs."""

    def __init__(
        self,
        cert: Path,
        key: Path,
        client_ca: Path | None,
        *,
        interval: float = DEFAULT_RELOAD_SECONDS,
    ) -> None:
        self.mutual = client_ca is not None

        def load() -> tuple[ServerTls, ssl.SSLContext]:
            tls = server_tls(cert, key, client_ca)
            if tls is None:  # cannot happen: cert and key are given
                raise InvalidArgumentError("--tls-cert and --tls-key are needed")
            try:
                # Made here, within the reload's before/after stat, so that it holds the
                # files just checked; OpenSSL checks the key against the certificate again.
                return tls, tls.ssl_context()
            except (ssl.SSLError, OSError) as error:
                raise InvalidArgumentError(f"{tls.cert} / {tls.key}: {error}") from None

        names = "--tls-cert/--tls-key" + ("/--tls-client-ca" if self.mutual else "")
        paths = [cert, key, *([client_ca] if client_ca is not None else [])]
        self.files = ReloadingTls(paths, load, interval=interval, what=names)

    @property
    def tls(self) -> ServerTls:
        """The files in use now."""
        return self.files.current[1][0]

    def attach(self, context: ssl.SSLContext) -> None:
        """Make the HTTPS listener's ``context`` (uvicorn's) hand new connections the
        current files."""
        context.sni_callback = self._sni_callback

    def _sni_callback(
        self, connection: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _: object
    ) -> None:
        # Called by OpenSSL for every ClientHello on the listener's context; returning None
        # goes on with the handshake. Generation 0 is what the listener's context holds.
        generation, (_tls, context) = self.files.check()
        if generation:
            connection.context = context

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """gRPC SSL credentials that follow the files (the fetcher runs on new handshakes)."""
        return dynamic_server_credentials(
            self.files,
            lambda loaded: loaded[0].certificate_configuration(),
            require_client_auth=self.mutual,
        )


def reloading_server_tls(
    cert: Path | None,
    key: Path | None,
    client_ca: Path | None,
    *,
    interval: float = DEFAULT_RELOAD_SECONDS,
) -> ReloadingServerTls | None:
    """:class:`ReloadingServerTls` for these flags, or None (plaintext); InvalidArgumentError
    as :func:`server_tls` for bad ones."""
    problem = tls_flags_problem(cert, key, client_ca)
    if problem:
        raise InvalidArgumentError(problem)
    if cert is None or key is None:
        return None
    return ReloadingServerTls(cert, key, client_ca, interval=interval)
