"""Wire conversions of the ``ParameterServer`` service: packed IDs and rows, row chunks.

Requests are decoded into writable arrays, checked against the field sizes, and errors name
the request field at fault (``"LookupRequest.dim must be > 0, got 0"``). The row-chunk
conversions are shared by the servicer (:mod:`embedding_store.ps_service`) and its client
(:mod:`embedding_store.ps_client`); optimizer settings travel via
:mod:`embedding_store.optimizer_wire`.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from embedding_store.errors import (
    CapacityError,
    InvalidArgumentError,
)
from embedding_store.grpc_common import (
    MAX_MESSAGE_BYTES,
    MESSAGE_SLACK_BYTES,
    pack_f32,
    pack_u64,
    unpack_f32,
    unpack_u64,
)
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.shard import RowBlock

#: Rows per ExportRows chunk when the request says 0.
DEFAULT_ROWS_PER_CHUNK = 65_536


def positive_dim(value: int, field: str) -> int:
    if value < 1:
        raise InvalidArgumentError(f"{field} must be > 0, got {value}")
    return int(value)


def _writable(array: np.ndarray) -> np.ndarray:
    """A writable copy of an array decoded from message bytes (those are read-only views)."""
    return array if array.flags.writeable else array.copy()


def decode_ids(payload: bytes, field: str) -> np.ndarray:
    """Packed uint64 IDs -> a writable uint64 [n] array; errors name ``field``."""
    return _writable(unpack_u64(payload, field))


def encode_missing(missing: np.ndarray | None) -> bytes:
    """``LookupResponse.missing``: bool [n] (True where an ID was answered with zeros) ->
    ``ceil(n / 8)`` bytes, position i at bit ``7 - i % 8`` of byte ``i // 8``
    (``numpy.packbits``); None (no ID missed) -> empty."""
    return b"" if missing is None else np.packbits(missing).tobytes()


def decode_missing(payload: bytes, n: int, misses: int, field: str) -> np.ndarray | None:
    """:func:`encode_missing` reversed: bool [n], or None when ``payload`` is empty (no ID
    missed, or a shard that predates the field). InvalidArgumentError naming ``field``
    unless it holds ``ceil(n / 8)`` bytes with exactly ``misses`` positions set (and none
    past ``n``)."""
    if not payload:
        return None
    if len(payload) != (n + 7) // 8:
        raise InvalidArgumentError(
            f"{field}: got {len(payload)} bytes, expected {(n + 7) // 8} for {n} IDs"
        )
    bits = np.unpackbits(np.frombuffer(payload, dtype=np.uint8))
    missing = bits[:n].view(np.bool_)
    found = int(np.count_nonzero(missing))
    if found != misses or np.count_nonzero(bits[n:]):
        raise InvalidArgumentError(
            f"{field} marks {found} of {n} IDs (and {int(np.count_nonzero(bits[n:]))} "
            f"positions past them), but misses says {misses}"
        )
    return missing


def decode_rows(payload: bytes, n: int, width: int, field: str) -> np.ndarray:
    """Packed float32 [n, width] -> a writable array; errors name ``field``."""
    return _writable(unpack_f32(payload, (n, width), field))


def require_finite_rows(rows: np.ndarray, ids: np.ndarray, field: str) -> None:
    """InvalidArgumentError unless every value of ``rows`` (float32 [n, width], the rows of
    ``ids``) is finite, naming ``field``, the first bad row and its ID. One NaN or Inf in a
    gradient makes its row NaN for good (workers skip such rows; a peer must not send them)."""
    if np.isfinite(rows).all():
        return
    bad = np.flatnonzero(~np.isfinite(rows).all(axis=1))
    first = int(bad[0])
    raise InvalidArgumentError(
        f"{field}: {len(bad)} row(s) hold NaN or Inf, the first row {first} (ID "
        f"{int(ids[first])}); non-finite values would make the rows NaN for good"
    )


def check_message_size(n: int, width: int, what: str) -> None:
    """Refuse answers that would not fit in one gRPC message (before computing them)."""
    size = 4 * n * width
    if size > MAX_MESSAGE_BYTES - MESSAGE_SLACK_BYTES:
        raise CapacityError(
            f"{what}: {n} rows x dim {width} is {size} bytes of float32, more than one message "
            f"may carry ({MAX_MESSAGE_BYTES} bytes); split the request"
        )


def rows_per_chunk(dim: int, state_width: int, requested: int) -> int:
    """Rows per RowChunk: the requested number (0: default), capped to fit one message."""
    per_row = 8 + 4 * dim + 4 * state_width
    fit = max(1, (MAX_MESSAGE_BYTES - MESSAGE_SLACK_BYTES) // per_row)
    return min(requested or DEFAULT_ROWS_PER_CHUNK, fit)


def row_chunks(block: RowBlock, max_rows: int) -> Iterator[pb.RowChunk]:
    """Split one dim's rows into RowChunks of at most ``max_rows`` rows (requested; capped)."""
    dim = block.dim
    width = 0 if block.state is None else int(block.state.shape[1])
    step = rows_per_chunk(dim, width, max_rows)
    for start in range(0, len(block), step):
        stop = start + step
        yield pb.RowChunk(
            dim=dim,
            ids=pack_u64(block.ids[start:stop]),
            weights=pack_f32(block.weights[start:stop]),
            state=b"" if block.state is None else pack_f32(block.state[start:stop]),
            state_width=width,
            has_state=block.state is not None,
        )


def row_block_from_chunk(chunk: pb.RowChunk, field: str = "RowChunk") -> RowBlock:
    """Decode and check one RowChunk; errors name ``field`` (e.g. ``"RowChunk[3]"``)."""
    dim = positive_dim(chunk.dim, f"{field}.dim")
    ids = decode_ids(chunk.ids, f"{field}.ids")
    n = ids.shape[0]
    weights = decode_rows(chunk.weights, n, dim, f"{field}.weights")
    if chunk.has_state:
        state = decode_rows(chunk.state, n, chunk.state_width, f"{field}.state")
    else:
        if chunk.state or chunk.state_width:
            raise InvalidArgumentError(
                f"{field}.state must be empty and {field}.state_width 0 when has_state is false, "
                f"got {len(chunk.state)} bytes and state_width {chunk.state_width}"
            )
        state = None
    return RowBlock(ids=ids, weights=weights, state=state)
