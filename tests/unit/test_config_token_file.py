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
