"""TLS test files made with trustme: a CA, a server certificate for 127.0.0.1 and a client
certificate it signed, plus a second CA and key that belong to none of them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass(frozen=True)
class TlsFiles:
    """Paths of PEM files in one directory."""

    ca: Path  # signed the server's and the client's certificates
    cert: Path  # the server's, for 127.0.0.1 and localhost
    key: Path
    client_cert: Path  # signed by ``ca``
    client_key: Path
    other_ca: Path  # trusts none of the certificates above
    other_key: Path  # matches none of the certificates above
    other_client_cert: Path  # signed by ``other_ca``
    other_client_key: Path


def write_tls_files(directory: Path) -> TlsFiles:
    """Write a fresh set of TLS files under ``directory`` (created)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, other_ca = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@recserve.test")
    other = other_ca.issue_cert("client@elsewhere.test")
    files = TlsFiles(*(directory / name for name in (
        "ca.pem", "cert.pem", "key.pem", "client-cert.pem", "client-key.pem",
        "other-ca.pem", "other-key.pem", "other-client-cert.pem", "other-client-key.pem",
    )))  # fmt: skip
    ca.cert_pem.write_to_path(files.ca)
    server.cert_chain_pems[0].write_to_path(files.cert)
    server.private_key_pem.write_to_path(files.key)
    client.cert_chain_pems[0].write_to_path(files.client_cert)
    client.private_key_pem.write_to_path(files.client_key)
    other_ca.cert_pem.write_to_path(files.other_ca)
    other.private_key_pem.write_to_path(files.other_key)
    other.cert_chain_pems[0].write_to_path(files.other_client_cert)
    other.private_key_pem.write_to_path(files.other_client_key)
    return files


def kubelet_files(directory: Path, files: dict[str, bytes]) -> dict[str, Path]:
    """Lay ``files`` (name -> PEM bytes) out as the kubelet mounts a Secret: each name a
    symlink into ``..data``, itself a symlink to a timestamped directory. Returns the paths a
    server is given (``directory/NAME``). Renew them with :func:`kubelet_swap`."""
    directory.mkdir(parents=True, exist_ok=True)
    kubelet_swap(directory, files)
    for name in files:
        (directory / name).symlink_to(Path("..data") / name)
    return {name: directory / name for name in files}


def kubelet_swap(directory: Path, files: dict[str, bytes]) -> None:
    """Renew a Secret mount made by :func:`kubelet_files` as the kubelet does: write a new
    timestamped directory, point a fresh symlink at it and rename that over ``..data`` (one
    atomic step: a reader sees all old files or all new ones)."""
    versions = sorted(directory.glob("..v*"))
    version = directory / f"..v{len(versions) + 1:04d}"
    version.mkdir()
    for name, data in files.items():
        (version / name).write_bytes(data)
    staged = directory / "..data_tmp"
    staged.symlink_to(version.name)
    staged.replace(directory / "..data")
