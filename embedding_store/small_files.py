"""Reading files that are small by nature (tokens, PEM certificates and keys), bounded.

A mistyped path can name a checkpoint's gigabytes, a log that grows, or ``/dev/zero``, which
never ends: an unbounded read fills the memory (or never returns) before any check of what
the file holds can say it is the wrong file.
"""

from __future__ import annotations

import os

from embedding_store.errors import InvalidArgumentError

#: The largest token file read: a token is tens of bytes; 1 MiB is far beyond any.
MAX_TOKEN_FILE_BYTES = 2**20
#: The largest PEM file read: a certificate or key is a few KiB, a CA bundle of every public
#: root ~200-300 KiB.
MAX_PEM_FILE_BYTES = 4 * 2**20


def read_small_file(path: str | os.PathLike[str], where: str, what: str, limit: int) -> bytes:
    """The bytes of file ``path``, at most ``limit`` of them (one read of ``limit + 1``).

    InvalidArgumentError, naming the file as ``where`` (the option or variable and the path)
    and what it should hold (``what``), when it holds more. OSError as ``open`` raises it (the
    callers name the file with the system's reason)."""
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise InvalidArgumentError(
            f"{where}: larger than {_size(limit)}, expected {what}; is it the right file?"
        )
    return data


def _size(limit: int) -> str:
    return f"{limit // 2**20} MiB" if limit % 2**20 == 0 else f"{limit} bytes"
