"""``recserve serve --tls-cert/--tls-key [--tls-client-ca]``: the files, checked before the
server binds anything, and what uvicorn (HTTPS) and gRPC (SSL credentials) make of them.

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
