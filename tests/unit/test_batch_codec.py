"""Tests for the binary batch codec (embedding_store.batch_codec)."""

from __future__ import annotations

import struct
import tracemalloc
import zlib
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from embedding_store.batch import (
    Batch,
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    Label,
    NonIDTypeFeature,
)
from embedding_store.batch_codec import (
    FORMAT_VERSION,
    MAGIC,
    MAX_BATCH_BYTES,
    decode_batch,
    encode_batch,
)
from embedding_store.errors import BatchValidationError, DecodeError

U64 = np.uint64
DTYPES = [
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
]
FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------------------ strategies

names = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12
).filter(lambda s: not s.startswith(("non_id_feature_", "label_")))


@st.composite
def dense_arrays(draw: st.DrawFn, batch_size: int) -> np.ndarray:
    dtype = draw(st.sampled_from(DTYPES))
    tail = draw(st.lists(st.integers(0, 3), max_size=2))
    return draw(hnp.arrays(dtype, (batch_size, *tail)))


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    b = draw(st.integers(1, 6))
    n_jagged = draw(st.integers(0, 3))
    n_single = draw(st.integers(0, 2))
    n_dense = draw(st.integers(0 if n_jagged + n_single else 1, 3))
    n_labels = draw(st.integers(0, 2))
    all_names = draw(
        st.lists(
            names,
            min_size=n_jagged + n_single + n_dense + n_labels,
            max_size=n_jagged + n_single + n_dense + n_labels,
            unique=True,
        )
    )
    ids_ = st.integers(0, 2**64 - 1)
    ids: list[IDTypeFeature | IDTypeFeatureWithSingleID] = []
    for _ in range(n_jagged):
        lists = draw(st.lists(st.lists(ids_, max_size=4), min_size=b, max_size=b))
        ids.append(IDTypeFeature.from_lists(all_names.pop(), lists))
    for _ in range(n_single):
        ids.append(
            IDTypeFeatureWithSingleID.from_ids(
                all_names.pop(), draw(st.lists(ids_, min_size=b, max_size=b))
            )
        )
    ids = draw(st.permutations(ids))
    dense = [
        NonIDTypeFeature(draw(dense_arrays(b)), all_names.pop() if draw(st.booleans()) else None)
        for _ in range(n_dense)
    ]
    labels = [
        Label(draw(dense_arrays(b)), all_names.pop() if draw(st.booleans()) else None)
        for _ in range(n_labels)
    ]
    return Batch(
        ids,
        dense,
        labels,
        requires_grad=draw(st.booleans()) if labels else False,
        meta=draw(st.none() | st.binary(max_size=20)),
        batch_id=draw(st.none() | st.integers(0, 2**64 - 1)),
    )


def rich_batch() -> Batch:
    return Batch(
        [
            IDTypeFeature.from_lists("clicks", [[1, 2**64 - 1], [], [3]]),
            IDTypeFeatureWithSingleID.from_ids("user", [7, 8, 9]),
            IDTypeFeature.from_lists("empty", [[], [], []]),
        ],
        [
            NonIDTypeFeature(np.arange(6, dtype=np.float32).reshape(3, 2)),
            NonIDTypeFeature(np.array([True, False, True]), "flag"),
        ],
        [Label(np.array([1.0, 0.0, np.nan], np.float16), "ctr")],
        meta=b"meta\x00data",
        batch_id=42,
    )


def _decode_must_fail(data: bytes, *, allow_validation: bool = False) -> None:
    errors = (DecodeError, BatchValidationError) if allow_validation else DecodeError
    try:
        decode_batch(data)
    except errors:
        return
    except Exception as e:  # pragma: no cover - the failure being tested for
        pytest.fail(f"decode raised {type(e).__name__}: {e}")
    if not allow_validation:
        pytest.fail("decode accepted corrupt bytes")


# --------------------------------------------------------------------------- hand-crafted bytes

HEADER = struct.Struct("<4sHHIIII")


def header(
    *,
    batch_size: int = 1,
    n_ids: int = 0,
    n_dense: int = 0,
    n_labels: int = 0,
    flags: int = 0,
    version: int = FORMAT_VERSION,
    magic: bytes = MAGIC,
) -> bytes:
    return HEADER.pack(magic, version, flags, batch_size, n_ids, n_dense, n_labels)


def named(kind: int, name: bytes) -> bytes:
    return struct.pack("<BH", kind, len(name)) + name


def sealed(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def reseal(data: bytes | bytearray) -> bytes:
    return sealed(bytes(data[:-4]))


# ------------------------------------------------------------------------------- round trip


def test_rich_round_trip() -> None:
    b = rich_batch()
    data = b.to_bytes()
    assert isinstance(data, bytes)
    back = Batch.from_bytes(data)
    assert back.equals(b)
    assert back.non_id_feature_names == ("non_id_feature_0", "flag")
    assert back.id_feature("clicks").to_lists() == [[1, 2**64 - 1], [], [3]]
    assert isinstance(back.id_feature("user"), IDTypeFeatureWithSingleID)
    assert back.label("ctr").data.dtype == np.float16
    assert np.isnan(back.label("ctr").data[2])
    assert back.meta == b"meta\x00data" and back.batch_id == 42 and back.requires_grad
    for f in back.id_type_features:
        assert not f.values.flags.writeable and not f.lengths.flags.writeable
    assert not back.non_id_feature("flag").data.flags.writeable
    assert encode_batch(back) == data  # deterministic


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview, lambda d: memoryview(bytearray(d))])
def test_decode_accepts_buffer_types(wrap: object) -> None:
    data = rich_batch().to_bytes()
    back = decode_batch(wrap(data))  # type: ignore[operator]
    assert back.equals(rich_batch())


def test_decoded_arrays_survive_mutation_of_input() -> None:
    buf = bytearray(rich_batch().to_bytes())
    back = decode_batch(buf)
    buf[:] = bytes(len(buf))
    assert back.equals(rich_batch())


@FAST
@given(batches())
def test_round_trip_property(b: Batch) -> None:
    data = encode_batch(b)
    back = decode_batch(data)
    assert back.equals(b)
    assert back.batch_size == b.batch_size
    assert back.requires_grad == b.requires_grad
    assert back.meta == b.meta and back.batch_id == b.batch_id
    assert back.id_feature_names == b.id_feature_names
    assert back.non_id_feature_names == b.non_id_feature_names
    assert back.label_names == b.label_names
    for x, y in zip(back.non_id_type_features + back.labels, b.non_id_type_features + b.labels):
        assert x.data.dtype == y.data.dtype and x.data.shape == y.data.shape
    for x, y in zip(back.id_type_features, b.id_type_features):
        assert type(x) is type(y)
        assert x.to_lists() == y.to_lists()
    assert encode_batch(back) == data


def test_compact_encoding() -> None:
    rng = np.random.default_rng(0)
    ids = [
        IDTypeFeatureWithSingleID(f"C{i}", rng.integers(0, 2**63, 1024, dtype=np.int64).astype(U64))
        for i in range(26)
    ]
    dense = [NonIDTypeFeature(rng.standard_normal((1024, 13), dtype=np.float32), "dense")]
    b = Batch(ids, dense, requires_grad=False)
    raw = 1024 * 26 * 8 + 1024 * 13 * 4
    size = len(b.to_bytes())
    assert raw <= size <= raw * 1.05, (size, raw)


# ------------------------------------------------------------------------- corrupt input


def test_truncation_at_every_position() -> None:
    data = rich_batch().to_bytes()
    for cut in range(len(data)):
        with pytest.raises(DecodeError):
            decode_batch(data[:cut])


def test_truncation_message() -> None:
    data = rich_batch().to_bytes()
    with pytest.raises(DecodeError, match=r"^truncated batch bytes: needed 24 bytes for the head"):
        decode_batch(data[:10])
    with pytest.raises(DecodeError, match=r"needed 4 bytes for the checksum trailer at offset"):
        decode_batch(data[:-4])
    with pytest.raises(DecodeError, match=r"only \d+ remain"):
        decode_batch(data[: len(data) // 2])


@FAST
@given(batches(), st.data())
def test_truncated_random(b: Batch, data: st.DataObject) -> None:
    encoded = encode_batch(b)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    _decode_must_fail(encoded[:cut])


@FAST
@given(batches(), st.data())
def test_flipped_bytes(b: Batch, data: st.DataObject) -> None:
    encoded = bytearray(encode_batch(b))
    flips = data.draw(
        st.lists(
            st.tuples(st.integers(0, len(encoded) - 1), st.integers(1, 255)),
            min_size=1,
            max_size=4,
            unique_by=lambda t: t[0],
        )
    )
    for pos, mask in flips:
        encoded[pos] ^= mask
    _decode_must_fail(bytes(encoded))


@FAST
@given(batches(), st.data())
def test_flipped_bytes_with_matching_crc(b: Batch, data: st.DataObject) -> None:
    encoded = bytearray(encode_batch(b))
    flips = data.draw(
        st.lists(
            st.tuples(st.integers(0, len(encoded) - 5), st.integers(1, 255)),
            min_size=1,
            max_size=4,
        )
    )
    for pos, mask in flips:
        encoded[pos] ^= mask
    # May decode (a flipped ID is still a valid ID) but must fail only in the documented ways.
    _decode_must_fail(reseal(encoded), allow_validation=True)


@FAST
@given(batches(), st.binary(min_size=1, max_size=64))
def test_appended_bytes(b: Batch, extra: bytes) -> None:
    _decode_must_fail(encode_batch(b) + extra)


@FAST
@given(st.binary(max_size=300))
def test_random_bytes(data: bytes) -> None:
    _decode_must_fail(data)


@FAST
@given(st.binary(max_size=300), st.booleans())
def test_random_bytes_after_valid_header_prefix(tail: bytes, seal: bool) -> None:
    data = MAGIC + struct.pack("<H", FORMAT_VERSION) + tail
    _decode_must_fail(sealed(data) if seal else data, allow_validation=True)


def test_trailing_garbage_message() -> None:
    with pytest.raises(DecodeError, match="3 unexpected trailing bytes"):
        decode_batch(rich_batch().to_bytes() + b"abc")


def test_checksum_mismatch_message() -> None:
    data = bytearray(rich_batch().to_bytes())
    data[-10] ^= 0x01  # inside the meta bytes
    with pytest.raises(DecodeError, match=r"^corrupt batch bytes: checksum mismatch$"):
        decode_batch(bytes(data))


def test_bad_magic_and_version() -> None:
    data = rich_batch().to_bytes()
    with pytest.raises(DecodeError, match="not recserve batch bytes"):
        decode_batch(b"XXXX" + data[4:])
    bumped = data[:4] + struct.pack("<H", 7) + data[6:]
    with pytest.raises(
        DecodeError, match=r"^unsupported batch format version 7; this build reads version 1$"
    ):
        decode_batch(reseal(bumped))


def test_unknown_flags() -> None:
    with pytest.raises(DecodeError, match="unknown flag bits 0x80"):
        decode_batch(sealed(header(flags=0x80)))


def _peak_allocation(action: Callable[[], object]) -> int:
    """Bytes allocated at the peak while ``action`` runs (tracemalloc): what a declared count
    made the decoder reserve before it checked the bytes were there."""
    tracemalloc.start()
    try:
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_huge_feature_count_fails_before_allocating() -> None:
    data = sealed(header(n_ids=2**32 - 1, n_dense=2**32 - 1))

    def decode() -> None:
        with pytest.raises(DecodeError, match="truncated batch bytes"):
            decode_batch(data)

    assert _peak_allocation(decode) < 1 << 20  # nothing sized by the 2**32 - 1 declared


def test_huge_id_count_fails_before_allocating() -> None:
    body = header(batch_size=2, n_ids=1) + named(1, b"f") + struct.pack("<Q", 2**60)
    body += np.array([1, 1], "<u4").tobytes() + np.array([5, 6], "<u8").tobytes()

    def decode() -> None:
        with pytest.raises(
            DecodeError,
            match=rf"needed {2**63} bytes for the {2**60} values of feature 'f' at offset \d+",
        ):
            decode_batch(sealed(body))

    assert _peak_allocation(decode) < 1 << 20


def test_huge_batch_size_and_shape_fail_fast() -> None:
    body = header(batch_size=2**32 - 1, n_ids=1) + named(2, b"s") + b"\x00" * 16
    with pytest.raises(DecodeError, match="needed 34359738360 bytes for the values of feature"):
        decode_batch(sealed(body))
    dims = struct.pack("<3Q", 2, 2**62, 2**62)
    body = header(batch_size=2, n_dense=1, flags=0) + named(3, b"d") + bytes([11, 3]) + dims
    with pytest.raises(DecodeError, match="truncated batch bytes"):
        decode_batch(sealed(body))
    # zero-size array with an absurd dimension: no allocation, clean error
    dims = struct.pack("<3Q", 2, 0, 2**63)
    body = header(batch_size=2, n_dense=1) + named(3, b"d") + bytes([11, 3]) + dims
    with pytest.raises(DecodeError, match="invalid shape"):
        decode_batch(sealed(body))


def _single_id_batch_bytes(name: bytes = b"s", kind: int = 2) -> bytes:
    return sealed(
        header(batch_size=1, n_ids=1) + named(kind, name) + np.array([9], "<u8").tobytes()
    )


def test_single_id_crafted_ok() -> None:
    b = decode_batch(_single_id_batch_bytes())
    assert not b.requires_grad and b.id_feature("s").values.tolist() == [9]


def test_unknown_kind_tag_and_wrong_section() -> None:
    with pytest.raises(DecodeError, match="unknown feature kind tag 9 at offset 24"):
        decode_batch(_single_id_batch_bytes(kind=9))
    with pytest.raises(DecodeError, match=r"a label \(kind tag 4\) at offset 24 where an ID-type"):
        decode_batch(_single_id_batch_bytes(kind=4))


def test_invalid_utf8_name() -> None:
    with pytest.raises(DecodeError, match="not valid UTF-8"):
        decode_batch(_single_id_batch_bytes(name=b"\xff\xfe"))


def test_semantic_problems_are_validation_errors() -> None:
    with pytest.raises(BatchValidationError, match="non-empty str"):
        decode_batch(_single_id_batch_bytes(name=b""))
    with pytest.raises(BatchValidationError, match="256 UTF-8 bytes"):
        decode_batch(_single_id_batch_bytes(name=b"x" * 256))
    body = header(batch_size=1, n_ids=2) + named(2, b"s") + struct.pack("<Q", 1)
    body += named(2, b"s") + struct.pack("<Q", 2)
    with pytest.raises(BatchValidationError, match="duplicate feature name 's'"):
        decode_batch(sealed(body))
    with pytest.raises(BatchValidationError, match="empty batch"):
        decode_batch(sealed(header(batch_size=0)))


def test_unknown_dtype_code_and_bad_ndim() -> None:
    base = header(batch_size=1, n_dense=1) + named(3, b"d")
    with pytest.raises(DecodeError, match="unknown dtype code 200 for non-ID feature 'd'"):
        decode_batch(sealed(base + bytes([200, 1]) + struct.pack("<Q", 1) + b"\x00"))
    with pytest.raises(DecodeError, match="0 dimensions"):
        decode_batch(sealed(base + bytes([6, 0]) + b"\x00"))
    with pytest.raises(DecodeError, match="has 3 rows but the header says batch size 1"):
        decode_batch(sealed(base + bytes([6, 1]) + struct.pack("<Q", 3) + b"\x00" * 3))


def test_bool_bytes_must_be_0_or_1() -> None:
    base = header(batch_size=2, n_dense=1) + named(3, b"d") + bytes([1, 1]) + struct.pack("<Q", 2)
    assert decode_batch(sealed(base + b"\x01\x00")).non_id_feature("d").data.tolist() == [
        True,
        False,
    ]
    with pytest.raises(DecodeError, match="other than 0/1"):
        decode_batch(sealed(base + b"\x02\x00"))


def test_lengths_sum_mismatch() -> None:
    body = header(batch_size=2, n_ids=1) + named(1, b"f") + struct.pack("<Q", 2)
    body += np.array([1, 2], "<u4").tobytes() + np.array([5, 6], "<u8").tobytes()
    with pytest.raises(DecodeError, match="lengths of feature 'f' sum to 3 but it declares 2"):
        decode_batch(sealed(body))


def test_size_limits() -> None:
    data = rich_batch().to_bytes()
    with pytest.raises(DecodeError, match=r"too large: \d+ bytes exceeds the limit of 50 bytes"):
        decode_batch(data, max_bytes=50)
    with pytest.raises(BatchValidationError, match="over the limit of 50 bytes"):
        encode_batch(rich_batch(), max_bytes=50)
    assert MAX_BATCH_BYTES == 2 * 1024**3


@pytest.mark.parametrize("bad", ["text", None, 5, [1, 2]])
def test_decode_rejects_non_bytes(bad: object) -> None:
    with pytest.raises(DecodeError, match="must be bytes, bytearray or memoryview"):
        decode_batch(bad)  # type: ignore[arg-type]


def test_decode_rejects_non_contiguous_memoryview() -> None:
    data = rich_batch().to_bytes()
    strided = memoryview(np.frombuffer(data, np.uint8)[::2])
    with pytest.raises(DecodeError):
        decode_batch(strided)


# ------------------------------------------------------------------------------- boundaries


def test_size_limits_are_inclusive_and_count_the_checksum() -> None:
    """max_bytes bounds the whole encoded batch, checksum trailer included: a batch of exactly
    max_bytes bytes encodes and decodes, one byte less is refused both ways."""
    data = rich_batch().to_bytes()
    assert encode_batch(rich_batch(), max_bytes=len(data)) == data
    assert decode_batch(data, max_bytes=len(data)).equals(rich_batch())
    with pytest.raises(BatchValidationError, match=rf"would be {len(data)} bytes, over the limit"):
        encode_batch(rich_batch(), max_bytes=len(data) - 1)
    with pytest.raises(DecodeError, match=rf"{len(data)} bytes exceeds the limit"):
        decode_batch(data, max_bytes=len(data) - 1)


def test_truncation_by_one_byte_names_the_shortfall() -> None:
    data = rich_batch().to_bytes()
    with pytest.raises(
        DecodeError,
        match=rf"^truncated batch bytes: needed 4 bytes for the checksum trailer at offset "
        rf"{len(data) - 4}, only 3 remain$",
    ):
        decode_batch(data[:-1])


def test_many_tiny_features_pass_the_feature_count_precheck() -> None:
    """The up-front check on the feature count assumes the smallest possible feature (kind
    tag, name length, a 1-byte name, no payload: a single-ID feature of batch size 0), so
    well-formed bytes with such features reach the batch validation instead of being called
    truncated."""
    body = header(batch_size=0, n_ids=5)
    for name in (b"a", b"b", b"c", b"d", b"e"):
        body += named(2, name)
    with pytest.raises(BatchValidationError, match="empty batch"):
        decode_batch(sealed(body))


def test_ndim_over_the_limit_is_refused_both_ways() -> None:
    """At most MAX_NDIM (32) dimensions, even though numpy 2 allows 64."""
    at_limit = Batch(
        [], [NonIDTypeFeature(np.zeros((1,) * 32, np.uint8), "d")], requires_grad=False
    )
    assert decode_batch(encode_batch(at_limit)).equals(at_limit)
    over = Batch([], [NonIDTypeFeature(np.zeros((1,) * 33, np.uint8), "d")], requires_grad=False)
    with pytest.raises(
        BatchValidationError, match="'d' has 33 dimensions; the format allows at most 32"
    ):
        encode_batch(over)
    body = header(batch_size=1, n_dense=1) + named(3, b"d") + bytes([6, 33])
    body += struct.pack("<33Q", *([1] * 33)) + b"\x00"
    with pytest.raises(DecodeError, match="has 33 dimensions; expected 1 to 32"):
        decode_batch(sealed(body))


def test_sizes_beyond_the_u32_fields_are_refused_before_encoding() -> None:
    """Batch sizes, sample lengths and meta lengths are u32 on the wire: larger ones are refused
    (checked before any data is copied; the arrays here are zero-stride views)."""
    huge = 2**32
    values = np.broadcast_to(np.array([1], U64), (huge,))
    single = IDTypeFeatureWithSingleID.trusted("s", values)
    with pytest.raises(BatchValidationError, match=f"batch size {huge} does not fit"):
        encode_batch(Batch._trusted_inference([single], [], huge))
    lengths = np.array([huge], np.int64)
    lengths.flags.writeable = False
    jagged = IDTypeFeature.trusted("j", values, lengths)
    with pytest.raises(BatchValidationError, match=f"'j': a sample with {huge} IDs does not fit"):
        encode_batch(Batch._trusted_inference([jagged], [], 1))

    class HugeMeta(bytes):
        def __len__(self) -> int:
            return huge

    batch = Batch(
        [IDTypeFeatureWithSingleID.from_ids("s", [1])], requires_grad=False, meta=HugeMeta(b"m")
    )
    with pytest.raises(BatchValidationError, match=f"meta of {huge} bytes does not fit"):
        encode_batch(batch)


def test_empty_meta_stays_empty_bytes() -> None:
    """meta=b"" is not meta=None: the has-meta flag carries the difference."""
    single = [IDTypeFeatureWithSingleID.from_ids("s", [1])]
    empty = Batch(single, requires_grad=False, meta=b"")
    back = decode_batch(encode_batch(empty))
    assert back.meta == b"" and back.equals(empty)
    assert decode_batch(encode_batch(Batch(single, requires_grad=False))).meta is None


def test_unassigned_flag_bits_are_refused() -> None:
    for bit in (0x8, 0x8000):
        with pytest.raises(DecodeError, match=rf"unknown flag bits {bit:#x}$"):
            decode_batch(sealed(header(flags=bit)))


def test_lengths_whose_sum_overflows_u32_are_a_count_mismatch() -> None:
    """The lengths are summed wide: 2**32 - 1 + 1 does not wrap to the declared 0 IDs."""
    body = header(batch_size=2, n_ids=1) + named(1, b"f") + struct.pack("<Q", 0)
    body += np.array([2**32 - 1, 1], "<u4").tobytes()
    with pytest.raises(
        DecodeError, match="lengths of feature 'f' sum to 4294967296 but it declares 0"
    ):
        decode_batch(sealed(body))


def test_aligned_arrays_of_immutable_bytes_are_shared_not_copied() -> None:
    """Zero copy: decoding `bytes` lets aligned arrays point into them (read-only); a mutable
    buffer is copied."""
    single = IDTypeFeatureWithSingleID.from_ids("fiver", [1, 2, 3])  # values at offset 32
    data = encode_batch(Batch([single], requires_grad=False))
    raw = np.frombuffer(data, np.uint8)
    assert raw.ctypes.data % 8 == 0  # CPython's bytes payload is 8-aligned
    values = decode_batch(data).id_feature("fiver").values
    assert np.shares_memory(values, raw) and not values.flags.writeable
    copied = decode_batch(bytearray(data)).id_feature("fiver").values
    assert not np.shares_memory(copied, raw) and copied.tolist() == [1, 2, 3]
