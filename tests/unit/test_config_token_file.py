"""RECSERVE_TIER_TOKEN_FILE: a file that is not UTF-8 text is a clear error naming the file."""

from __future__ import annotations

import pytest

from embedding_store.errors import InvalidArgumentError
from embedding_store.grpc_common import TOKEN_FILE_VARIABLE, TOKEN_VARIABLE, tier_token


def test_a_token_file_that_is_not_utf8_names_the_file(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(TOKEN_VARIABLE, raising=False)
    secret = tmp_path / "token.bin"
    secret.write_bytes(b"\xff\xfe\x00binary")  # used to raise UnicodeDecodeError
    monkeypatch.setenv(TOKEN_FILE_VARIABLE, str(secret))
    with pytest.raises(InvalidArgumentError) as caught:
        tier_token()
    assert caught.value.message == f"RECSERVE_TIER_TOKEN_FILE={secret}: not valid UTF-8 text"
    secret.write_text("s3cret\n", encoding="utf-8")
    assert tier_token() == "s3cret"


def test_token_and_pem_files_are_read_bounded(tmp_path, monkeypatch) -> None:
    """A token or PEM file path that names a huge file (or /dev/zero, which never ends) is
    refused after one bounded read, naming the file; it used to be read whole. Each file here
    is one byte over its bound and otherwise acceptable (printable ASCII; a PEM header)."""
    import argparse

    from embedding_store.small_files import MAX_PEM_FILE_BYTES, MAX_TOKEN_FILE_BYTES
    from embedding_store.tls import read_certificates, read_private_key
    from serving import commands

    monkeypatch.delenv(TOKEN_VARIABLE, raising=False)
    token = tmp_path / "token"
    token.write_bytes(b"a" * (MAX_TOKEN_FILE_BYTES + 1))
    monkeypatch.setenv(TOKEN_FILE_VARIABLE, str(token))
    with pytest.raises(InvalidArgumentError) as caught:
        tier_token()
    assert caught.value.message == (
        f"RECSERVE_TIER_TOKEN_FILE={token}: larger than 1 MiB, expected a token; is it the "
        "right file?"
    )
    args = argparse.Namespace(admin_token=None, admin_token_file=token)
    with pytest.raises(InvalidArgumentError) as caught:
        commands._admin_token(args)
    assert caught.value.message == (
        f"--admin-token-file {token}: larger than 1 MiB, expected a token; is it the right file?"
    )
    token.write_bytes(b"a" * MAX_TOKEN_FILE_BYTES)  # at the bound: read whole
    assert tier_token() == "a" * MAX_TOKEN_FILE_BYTES

    pem = tmp_path / "big.pem"
    header = b"-----BEGIN CERTIFICATE-----\n-----BEGIN PRIVATE KEY-----\n"
    pem.write_bytes(header + b"A" * (MAX_PEM_FILE_BYTES + 1 - len(header)))
    for read, option in ((read_certificates, "--tls-cert"), (read_private_key, "--tls-key")):
        with pytest.raises(InvalidArgumentError) as caught:
            read(option, pem)
        assert caught.value.message == (
            f"{option} {pem}: larger than 4 MiB, expected a PEM file; is it the right file?"
        )
