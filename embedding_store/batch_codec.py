"""Compact, versioned binary codec for :class:`~embedding_store.batch.Batch` (no pickle).

Layout, all integers little-endian::

    header   magic b"RSB\\x01" (4 bytes; the 4th byte is part of the magic, not the version)
             u16 format version (1)
             u16 flags: bit0 requires_grad, bit1 has meta, bit2 has batch_id; others must be 0
             u32 batch_size
             u32 number of ID-type features, u32 non-ID features, u32 labels
             [u64 batch_id]                                    if flags bit2
    features ID-type features, then non-ID features, then labels, each:
             u8 kind tag (1 jagged ID, 2 single ID, 3 non-ID, 4 label)
             u16 name length + name (UTF-8)
             payload:
               jagged     u64 total_ids, u32 lengths [batch_size], u64 values [total_ids]
               single ID  u64 values [batch_size]
               non-ID and label
                          u8 dtype code, u8 ndim, u64 dims [ndim], raw C-order data
    meta     u32 length + bytes                                if flags bit1
    trailer  u32 CRC32 (zlib.crc32) of every byte before it

Jagged lengths are stored as uint32, not int64: a whole encoded batch is capped at
:data:`MAX_BATCH_BYTES` (2 GiB), so no sample can hold more than 2**28 IDs and uint32 is always
wide enough; it halves the per-sample overhead of jagged features.

Decoding never trusts a length: every size is checked against the bytes that remain before
anything is sliced or allocated, so a header claiming 2**60 IDs fails at once. Every
malformation raises :class:`~embedding_store.errors.DecodeError`; bytes that decode cleanly
but describe an invalid batch raise :class:`~embedding_store.errors.BatchValidationError` from
the ordinary :class:`~embedding_store.batch.Batch` constructor. Arrays of a decoded batch are
read-only; they share the input buffer (zero copy) when it is an immutable ``bytes`` object and
the data happens to be aligned, and are copied otherwise.
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import Any

import numpy as np

from embedding_store.batch import (
    Batch,
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    Label,
    NonIDTypeFeature,
)
from embedding_store.errors import BatchValidationError, DecodeError

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_BATCH_BYTES",
    "MAX_NDIM",
    "decode_batch",
    "encode_batch",
]

MAGIC = b"RSB\x01"
FORMAT_VERSION = 1
MAX_BATCH_BYTES = 2 * 1024**3
"""Largest encoded batch accepted by :func:`encode_batch` and :func:`decode_batch` (2 GiB)."""
MAX_NDIM = 32
"""Most dimensions a non-ID feature or label may have (numpy 1.x's limit)."""

FLAG_REQUIRES_GRAD = 1 << 0
FLAG_HAS_META = 1 << 1
FLAG_HAS_BATCH_ID = 1 << 2
_KNOWN_FLAGS = FLAG_REQUIRES_GRAD | FLAG_HAS_META | FLAG_HAS_BATCH_ID

KIND_ID = 1
KIND_SINGLE_ID = 2
KIND_NON_ID = 3
KIND_LABEL = 4
_KIND_NAMES = {
    KIND_ID: "jagged ID-type feature",
    KIND_SINGLE_ID: "single-ID feature",
    KIND_NON_ID: "non-ID feature",
    KIND_LABEL: "label",
}

# Stable on-disk codes; never renumber, only append.
_DTYPE_CODES: dict[np.dtype[Any], int] = {
    np.dtype(np.bool_): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.uint8): 6,
    np.dtype(np.uint16): 7,
    np.dtype(np.uint32): 8,
    np.dtype(np.uint64): 9,
    np.dtype(np.float16): 10,
    np.dtype(np.float32): 11,
    np.dtype(np.float64): 12,
}
_CODE_DTYPES: dict[int, np.dtype[Any]] = {
    code: dtype.newbyteorder("<") for dtype, code in _DTYPE_CODES.items()
}

_HEADER = struct.Struct("<4sHHIIII")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_U32_MAX = 2**32 - 1
_LE_U32 = np.dtype("<u4")
_LE_U64 = np.dtype("<u8")
# Smallest possible encoded feature: kind tag + name length (+ at least one name byte).
_MIN_FEATURE_BYTES = 1 + 2 + 1


# --------------------------------------------------------------------------------------------
# encoding


def _raw(arr: np.ndarray) -> memoryview:
    """The bytes of ``arr`` in C order and little-endian, without copying where possible."""
    le = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    # numpy's stubs give ndarray __buffer__ only for Python >= 3.12 (mypy checks 3.11).
    return memoryview(le.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _name_bytes(kind: int, name: str) -> bytes:
    encoded = name.encode("utf-8")
    return _U8.pack(kind) + _U16.pack(len(encoded)) + encoded


def encode_batch(batch: Batch, *, max_bytes: int = MAX_BATCH_BYTES) -> bytes:
    """Encode ``batch`` into the format described in the module docstring.

    Raises:
        BatchValidationError: the batch cannot be represented (encoded size over ``max_bytes``,
            batch size or a sample length beyond uint32, more than MAX_NDIM dimensions).
    """
    if not isinstance(batch, Batch):
        raise BatchValidationError(f"encode_batch takes a Batch, got {type(batch).__name__}")
    size = batch.batch_size
    if size > _U32_MAX:
        raise BatchValidationError(f"batch size {size} does not fit the format's u32 field")
    flags = 0
    if batch.requires_grad:
        flags |= FLAG_REQUIRES_GRAD
    if batch.meta is not None:
        flags |= FLAG_HAS_META
    if batch.batch_id is not None:
        flags |= FLAG_HAS_BATCH_ID
    parts: list[bytes | memoryview] = [
        _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            flags,
            size,
            len(batch.id_type_features),
            len(batch.non_id_type_features),
            len(batch.labels),
        )
    ]
    if batch.batch_id is not None:
        parts.append(_U64.pack(batch.batch_id))

    for feature in batch.id_type_features:
        if isinstance(feature, IDTypeFeatureWithSingleID):
            parts.append(_name_bytes(KIND_SINGLE_ID, feature.name))
            parts.append(_raw(feature.values))
        else:
            lengths = feature.lengths
            if lengths.size and int(lengths.max()) > _U32_MAX:
                raise BatchValidationError(
                    f"feature {feature.name!r}: a sample with {int(lengths.max())} IDs does not "
                    "fit the format's u32 length field"
                )
            parts.append(_name_bytes(KIND_ID, feature.name))
            parts.append(_U64.pack(feature.num_ids))
            parts.append(_raw(lengths.astype(_LE_U32)))
            parts.append(_raw(feature.values))

    for kind, group in ((KIND_NON_ID, batch.non_id_type_features), (KIND_LABEL, batch.labels)):
        for dense in group:
            data = dense.data
            assert dense.name is not None  # Batch names every dense array
            if data.ndim > MAX_NDIM:
                raise BatchValidationError(
                    f"{_KIND_NAMES[kind]} {dense.name!r} has {data.ndim} dimensions; "
                    f"the format allows at most {MAX_NDIM}"
                )
            code = _DTYPE_CODES[data.dtype.newbyteorder("=")]
            parts.append(_name_bytes(kind, dense.name))
            parts.append(_U8.pack(code) + _U8.pack(data.ndim))
            parts.append(struct.pack(f"<{data.ndim}Q", *data.shape))
            parts.append(_raw(data))

    if batch.meta is not None:
        if len(batch.meta) > _U32_MAX:
            raise BatchValidationError(
                f"meta of {len(batch.meta)} bytes does not fit the format's u32 length field"
            )
        parts.append(_U32.pack(len(batch.meta)))
        parts.append(batch.meta)

    total = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts) + _U32.size
    if total > max_bytes:
        raise BatchValidationError(
            f"encoded batch would be {total} bytes, over the limit of {max_bytes} bytes; "
            "split it into smaller batches"
        )
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    parts.append(_U32.pack(crc))
    return b"".join(parts)


# --------------------------------------------------------------------------------------------
# decoding


class _Reader:
    """Bounds-checked cursor over the input bytes; never slices past the end."""

    __slots__ = ("buf", "end", "pos", "share")

    def __init__(self, buf: memoryview, share: bool) -> None:
        self.buf = buf
        self.pos = 0
        self.end = len(buf)
        self.share = share  # the buffer is immutable, so arrays may point into it

    def take(self, n: int, what: str) -> int:
        """Reserve ``n`` bytes for ``what``; return their start offset."""
        remaining = self.end - self.pos
        if n > remaining:
            raise DecodeError(
                f"truncated batch bytes: needed {n} bytes for {what} at offset {self.pos}, "
                f"only {remaining} remain"
            )
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: struct.Struct, what: str) -> int:
        start = self.take(fmt.size, what)
        return int(fmt.unpack_from(self.buf, start)[0])

    def array(self, dtype: np.dtype[Any], count: int, what: str) -> np.ndarray:
        """``count`` items of little-endian ``dtype`` as a read-only native array [count]."""
        start = self.take(count * dtype.itemsize, what)
        if count == 0:
            arr = np.empty(0, dtype=dtype.newbyteorder("="))
        else:
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=start)
            if not (self.share and arr.flags.aligned and dtype.isnative):
                arr = arr.astype(dtype.newbyteorder("="))  # copies
        arr.flags.writeable = False
        return arr

    def name(self, kind: int) -> str:
        length = self.unpack(_U16, f"the name length of a {_KIND_NAMES[kind]}")
        start = self.take(length, f"the name of a {_KIND_NAMES[kind]}")
        try:
            return str(self.buf[start : start + length], "utf-8")
        except UnicodeDecodeError:
            raise DecodeError(
                f"corrupt batch bytes: the name of a {_KIND_NAMES[kind]} at offset {start} is "
                "not valid UTF-8"
            ) from None


def _as_buffer(data: object) -> tuple[memoryview, bool]:
    """A flat byte view of ``data`` and whether it is immutable."""
    if isinstance(data, bytes):
        return memoryview(data), True
    if isinstance(data, (bytearray, memoryview)):
        try:
            view = memoryview(data).cast("B")
        except (TypeError, ValueError) as e:
            raise DecodeError(f"batch bytes must be a contiguous byte buffer: {e}") from None
        return view, isinstance(view.obj, bytes)
    raise DecodeError(
        f"batch bytes must be bytes, bytearray or memoryview, got {type(data).__name__}"
    )


def _read_id_feature(r: _Reader, kind: int, batch_size: int) -> object:
    name = r.name(kind)
    if kind == KIND_SINGLE_ID:
        values = r.array(_LE_U64, batch_size, f"the values of feature {name!r}")
        return lambda: IDTypeFeatureWithSingleID(name, values)
    total = r.unpack(_U64, f"the ID count of feature {name!r}")
    lengths32 = r.array(_LE_U32, batch_size, f"the lengths of feature {name!r}")
    # Check the count against the bytes left before comparing it with the lengths, so that a
    # huge claimed count is reported as such.
    values = r.array(_LE_U64, total, f"the {total} values of feature {name!r}")
    summed = int(lengths32.sum(dtype=np.uint64))
    if summed != total:
        raise DecodeError(
            f"corrupt batch bytes: the lengths of feature {name!r} sum to {summed} but it "
            f"declares {total} IDs"
        )
    lengths = lengths32.astype(np.int64)
    lengths.flags.writeable = False
    return lambda: IDTypeFeature(name, values, lengths)


def _read_dense(r: _Reader, kind: int, batch_size: int) -> object:
    name = r.name(kind)
    what = f"{_KIND_NAMES[kind]} {name!r}"
    code_at = r.pos
    code = r.unpack(_U8, f"the dtype code of {what}")
    dtype = _CODE_DTYPES.get(code)
    if dtype is None:
        raise DecodeError(
            f"corrupt batch bytes: unknown dtype code {code} for {what} at offset {code_at}"
        )
    ndim = r.unpack(_U8, f"the number of dimensions of {what}")
    if not 1 <= ndim <= MAX_NDIM:
        raise DecodeError(
            f"corrupt batch bytes: {what} has {ndim} dimensions; expected 1 to {MAX_NDIM}"
        )
    shape = tuple(int(d) for d in r.array(_LE_U64, ndim, f"the shape of {what}").tolist())
    if shape[0] != batch_size:
        raise DecodeError(
            f"corrupt batch bytes: {what} has {shape[0]} rows but the header says batch size "
            f"{batch_size}"
        )
    count = math.prod(shape)
    flat = r.array(dtype, count, f"the data of {what} (shape {shape}, {dtype.name})")
    if dtype.kind == "b" and count and int(flat.view(np.uint8).max()) > 1:
        raise DecodeError(f"corrupt batch bytes: bool data of {what} holds bytes other than 0/1")
    try:
        data = flat.reshape(shape)
    except (ValueError, OverflowError) as e:
        raise DecodeError(f"corrupt batch bytes: invalid shape {shape} of {what}: {e}") from None
    cls = NonIDTypeFeature if kind == KIND_NON_ID else Label
    return lambda: cls(data, name)


def _expect_kind(r: _Reader, allowed: tuple[int, ...], section: str) -> int:
    at = r.pos
    kind = r.unpack(_U8, f"the kind tag of {section}")
    if kind not in _KIND_NAMES:
        raise DecodeError(f"corrupt batch bytes: unknown feature kind tag {kind} at offset {at}")
    if kind not in allowed:
        raise DecodeError(
            f"corrupt batch bytes: a {_KIND_NAMES[kind]} (kind tag {kind}) at offset {at} where "
            f"{section} was expected"
        )
    return kind


def decode_batch(
    data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_BATCH_BYTES
) -> Batch:
    """Decode bytes written by :func:`encode_batch`.

    Raises:
        DecodeError: wrong type, oversized, bad magic, unsupported version, truncated, corrupt
            structure, trailing bytes or checksum mismatch.
        BatchValidationError: well-formed bytes describing an invalid batch.
    """
    buf, share = _as_buffer(data)
    if len(buf) > max_bytes:
        raise DecodeError(
            f"batch bytes too large: {len(buf)} bytes exceeds the limit of {max_bytes} bytes"
        )
    try:
        builders, flags, meta, batch_id = _parse(buf, share)
    except (struct.error, ValueError, OverflowError, IndexError, TypeError, MemoryError) as e:
        # The parser checks everything it reads; this is a last line of defence.
        raise DecodeError(f"corrupt batch bytes: {type(e).__name__}: {e}") from None

    ids = [build() for kind, build in builders if kind in (KIND_ID, KIND_SINGLE_ID)]
    dense = [build() for kind, build in builders if kind == KIND_NON_ID]
    labels = [build() for kind, build in builders if kind == KIND_LABEL]
    return Batch(
        ids,
        dense,
        labels,
        requires_grad=bool(flags & FLAG_REQUIRES_GRAD),
        meta=meta,
        batch_id=batch_id,
    )


def _parse(
    buf: memoryview, share: bool
) -> tuple[list[tuple[int, Any]], int, bytes | None, int | None]:
    """Check structure and checksum; return feature builders, flags, meta and batch_id."""
    r = _Reader(buf, share)
    r.take(_HEADER.size, "the header")
    magic, version, flags, batch_size, n_ids, n_dense, n_labels = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise DecodeError(
            f"not recserve batch bytes: magic is {bytes(magic)!r}, expected {MAGIC!r}"
        )
    if version != FORMAT_VERSION:
        raise DecodeError(
            f"unsupported batch format version {version}; this build reads version {FORMAT_VERSION}"
        )
    if flags & ~_KNOWN_FLAGS:
        raise DecodeError(f"corrupt batch bytes: unknown flag bits {flags & ~_KNOWN_FLAGS:#x}")
    batch_id = r.unpack(_U64, "the batch id") if flags & FLAG_HAS_BATCH_ID else None
    n_features = n_ids + n_dense + n_labels
    # Fail fast on absurd counts before looping over them.
    r_left = r.end - r.pos
    if n_features * _MIN_FEATURE_BYTES > r_left:
        raise DecodeError(
            f"truncated batch bytes: needed at least {n_features * _MIN_FEATURE_BYTES} bytes for "
            f"{n_features} features at offset {r.pos}, only {r_left} remain"
        )

    builders: list[tuple[int, Any]] = []
    for _ in range(n_ids):
        kind = _expect_kind(r, (KIND_ID, KIND_SINGLE_ID), "an ID-type feature")
        builders.append((kind, _read_id_feature(r, kind, batch_size)))
    for _ in range(n_dense):
        kind = _expect_kind(r, (KIND_NON_ID,), "a non-ID feature")
        builders.append((kind, _read_dense(r, kind, batch_size)))
    for _ in range(n_labels):
        kind = _expect_kind(r, (KIND_LABEL,), "a label")
        builders.append((kind, _read_dense(r, kind, batch_size)))

    meta: bytes | None = None
    if flags & FLAG_HAS_META:
        length = r.unpack(_U32, "the meta length")
        start = r.take(length, "meta")
        meta = bytes(buf[start : start + length])

    body_end = r.pos
    stored_crc = r.unpack(_U32, "the checksum trailer")
    if r.pos != len(buf):
        raise DecodeError(
            f"corrupt batch bytes: {len(buf) - r.pos} unexpected trailing bytes after the "
            f"checksum at offset {r.pos}"
        )
    if zlib.crc32(buf[:body_end]) != stored_crc:
        raise DecodeError("corrupt batch bytes: checksum mismatch")
    return builders, flags, meta, batch_id
