"""PEM files for TLS, read and checked up front.

A certificate, key or CA file that is missing, not PEM, encrypted or not matching its
certificate fails here, with a message naming the option (``--tls-cert``, ``tls_ca``) and the
file, rather than at the first handshake (where the peer sees only a reset connection).
Shared by ``recserve serve`` (serving/tls.py) and the clients (clients/_tls.py).
"""

from __future__ import annotations

import os
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from embedding_store.errors import InvalidArgumentError
from embedding_store.small_files import MAX_PEM_FILE_BYTES, read_small_file

_CERTIFICATE_BEGIN = b"-----BEGIN CERTIFICATE-----"
_KEY_BEGIN = re.compile(rb"-----BEGIN ((?:[A-Z0-9]+ )*)PRIVATE KEY-----")


@dataclass(frozen=True)
class PemFile:
    """A PEM file as read: ``option`` is how the user named it (``--tls-cert``, ``tls_ca``)."""

    option: str
    path: Path
    data: bytes = field(repr=False)  # what a PEM key holds stays out of logs and reprs

    def __str__(self) -> str:
        return f"{self.option} {self.path}"


def pair_problem(cert_option: str, cert: object, key_option: str, key: object) -> str | None:
    """Why a certificate and its key, one given without the other, cannot be used; or None."""
    if (cert is None) == (key is None):
        return None
    given, missing = (cert_option, key_option) if key is None else (key_option, cert_option)
    return f"{given} given without {missing}: give both (a certificate and its private key)"


def _path_of(option: str, path: object) -> Path:
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)) or not str(path):
        raise InvalidArgumentError(f"{option} must be the path of a PEM file, got {path!r}")
    return Path(path)


def _read(option: str, path: object) -> PemFile:
    where = _path_of(option, path)
    try:
        data = read_small_file(where, f"{option} {where}", "a PEM file", MAX_PEM_FILE_BYTES)
    except OSError as error:
        raise InvalidArgumentError(
            f"{option} {where}: cannot read it: {error.strerror or error}"
        ) from None
    return PemFile(option, where, data)


def read_certificates(option: str, path: object) -> PemFile:
    """A PEM file of one or more certificates (a chain or a CA bundle), parsed by OpenSSL."""
    pem = _read(option, path)
    if _CERTIFICATE_BEGIN not in pem.data:
        raise InvalidArgumentError(
            f"{pem}: not a PEM certificate file (no '-----BEGIN CERTIFICATE-----' line)"
        )
    try:
        # Loading them as trust anchors parses every certificate of the file.
        ssl.create_default_context(cadata=pem.data.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as error:
        raise InvalidArgumentError(
            f"{pem}: not a valid PEM certificate file ({_reason(error)})"
        ) from None
    return pem


def read_private_key(option: str, path: object) -> PemFile:
    """A PEM private key, unencrypted (the servers and clients have no passphrase to give)."""
    pem = _read(option, path)
    match = _KEY_BEGIN.search(pem.data)
    if match is None:
        raise InvalidArgumentError(
            f"{pem}: not a PEM private key (no '-----BEGIN ... PRIVATE KEY-----' line)"
        )
    if b"ENCRYPTED" in match[1] or b"Proc-Type: 4,ENCRYPTED" in pem.data:
        raise InvalidArgumentError(
            f"{pem}: the private key is encrypted; give it unencrypted (e.g. `openssl pkey "
            "-in KEY -out KEY.pem`), readable only by this user or mounted from a Secret"
        )
    return pem


def check_key_pair(cert: PemFile, key: PemFile) -> None:
    """InvalidArgumentError unless ``key`` is a valid key for the first certificate of
    ``cert`` (what a TLS handshake would present)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        # A password callback: an encrypted key must fail here, never prompt on a terminal.
        context.load_cert_chain(cert.path, key.path, password=lambda: b"")
    except ssl.SSLError as error:
        if "KEY_VALUES_MISMATCH" in str(error) or "key values mismatch" in str(error):
            raise InvalidArgumentError(
                f"{key}: this private key does not match the certificate in {cert}"
            ) from None
        raise InvalidArgumentError(f"{key}: not a valid private key ({_reason(error)})") from None
    except OSError as error:  # replaced or removed since it was read
        raise InvalidArgumentError(
            f"{cert} / {key}: cannot read them: {error.strerror or error}"
        ) from None


def _reason(error: BaseException) -> str:
    """OpenSSL's reason (``KEY_VALUES_MISMATCH``), else the message."""
    reason = getattr(error, "reason", None)
    return str(reason) if reason else str(error)
