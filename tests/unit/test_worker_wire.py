"""PackedSlots: lookup answers and gradients in one buffer, round trips and malformed input;
answers that do not fit the batch looked up."""

from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np
import pytest
import torch

from embedding_store.batch import Batch, IDTypeFeature, IDTypeFeatureWithSingleID
from embedding_store.config import embedding_config_from_mapping
from embedding_store.errors import CapacityError, InvalidArgumentError, RecserveError
from embedding_store.grpc_common import MAX_MESSAGE_BYTES
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.proto import embedding_tier_pb2_grpc as pb_grpc
from embedding_store.remote_tier import RemoteShardTier
from embedding_store.worker import SlotOutput
from embedding_store.worker_client import RemoteEmbeddingWorker
from embedding_store.worker_service import EmbeddingWorkerServicer
from embedding_store.worker_wire import (
    check_answer_fits,
    pack_grads,
    pack_slots,
    unpack_grads,
    unpack_slots,
)


def _outputs() -> list[SlotOutput]:
    rng = np.random.default_rng(0)
    summed = torch.from_numpy(rng.standard_normal((4, 3)).astype(np.float32))
    raw = torch.from_numpy(rng.standard_normal((4, 2, 5)).astype(np.float32))
    mask = torch.tensor([[True, False], [True, True], [False, False], [True, False]])
    empty = torch.zeros((0, 3), dtype=torch.float32)
    return [
        SlotOutput("user", summed),
        SlotOutput("history", raw, mask),
        SlotOutput("none", empty),
    ]


def _wire(message: pb.PackedSlots) -> pb.PackedSlots:
    return pb.PackedSlots.FromString(message.SerializeToString())


def test_slots_round_trip_bit_for_bit_with_masks() -> None:
    outputs = _outputs()
    message = pb.PackedSlots()
    pack_slots(message, outputs)
    assert len(message.data) == 4 * (4 * 3 + 4 * 2 * 5 + 0)
    assert [h.name for h in message.slots] == ["user", "history", "none"]
    assert [list(h.shape) for h in message.slots] == [[4, 3], [4, 2, 5], [0, 3]]
    assert message.slots[1].mask == bytes([1, 0, 1, 1, 0, 0, 1, 0])

    decoded = unpack_slots(_wire(message))
    assert [d.name for d in decoded] == ["user", "history", "none"]
    for got, want in zip(decoded, outputs, strict=True):
        assert got.embeddings.dtype == torch.float32
        assert torch.equal(got.embeddings, want.embeddings)
    assert decoded[0].mask is None
    assert torch.equal(decoded[1].mask, outputs[1].mask)


def test_unpacked_slots_are_writable_and_do_not_alias_the_message() -> None:
    message = pb.PackedSlots()
    pack_slots(message, _outputs())
    wire = _wire(message)
    decoded = unpack_slots(wire)
    decoded[0].embeddings.add_(1.0)  # a caller may update its copy in place
    again = unpack_slots(wire)
    assert torch.equal(again[0].embeddings + 1.0, decoded[0].embeddings)
    assert torch.equal(again[1].embeddings, decoded[1].embeddings)  # neighbours untouched


def test_non_float32_and_non_contiguous_inputs_are_packed_as_float32() -> None:
    doubled = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()  # [4, 3], strided
    message = pb.PackedSlots()
    pack_slots(message, [SlotOutput("user", doubled)])
    (decoded,) = unpack_slots(_wire(message))
    assert decoded.embeddings.dtype == torch.float32
    assert torch.equal(decoded.embeddings, doubled.to(torch.float32))


def test_grads_round_trip_tensors_and_arrays() -> None:
    grads = {
        "user": torch.full((4, 3), 0.5),
        "history": np.arange(40, dtype=np.float32).reshape(4, 2, 5),
    }
    message = pb.PackedSlots()
    pack_grads(message, grads)
    decoded = unpack_grads(_wire(message))
    assert list(decoded) == ["user", "history"]
    np.testing.assert_array_equal(decoded["user"], np.full((4, 3), 0.5, dtype=np.float32))
    np.testing.assert_array_equal(decoded["history"], grads["history"])
    assert all(g.dtype == np.float32 for g in decoded.values())


@pytest.mark.parametrize(
    ("headers", "data", "message"),
    [
        ([pb.SlotHeader(name="user", shape=[4, 3])], b"\0" * 47, "slots.data: got 47 bytes"),
        ([pb.SlotHeader(name="user", shape=[4])], b"\0" * 16, "slots['user'].shape must"),
        (
            [pb.SlotHeader(name="user", shape=[4, 3]), pb.SlotHeader(name="user", shape=[4, 3])],
            b"\0" * 96,
            "slots: slot 'user' appears twice",
        ),
        (
            [pb.SlotHeader(name="seq", shape=[2, 2, 1], mask=b"\1")],
            b"\0" * 16,
            "slots['seq'].mask: got 1 bytes, expected 4",
        ),
        (
            [pb.SlotHeader(name="user", shape=[1, 1], mask=b"\1")],
            b"\0" * 4,
            "slots['user'].mask: got 1 bytes, expected 0",
        ),
        # Dims whose product overflows 64 bits must still be refused, not wrapped around.
        (
            [pb.SlotHeader(name="user", shape=[2**31 - 1, 2**31 - 1])],
            b"",
            "slots.data: got 0 bytes",
        ),
        # A zero dim matches 0 bytes whatever the others: numpy would refuse the reshape.
        (
            [pb.SlotHeader(name="user", shape=[0, 2**32 - 1, 2**32 - 1])],
            b"",
            "slots['user'].shape has a size outside 0..2147483647",
        ),
    ],
)
def test_malformed_slots_name_the_field(headers, data, message) -> None:
    with pytest.raises(InvalidArgumentError, match=message.replace("[", r"\[")):
        unpack_slots(pb.PackedSlots(slots=headers, data=data))


def test_gradients_may_not_carry_masks() -> None:
    packed = pb.PackedSlots(slots=[pb.SlotHeader(name="seq", shape=[1, 2, 1], mask=b"\1\1")])
    packed.data = b"\0" * 8
    with pytest.raises(InvalidArgumentError, match=r"grads\['seq'\].mask: got 2 bytes"):
        unpack_grads(packed)


class _AnsweringWorker(pb_grpc.EmbeddingWorkerServicer):
    """An embedding worker (gRPC, in process) that answers every lookup with ``answer(batch)``."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_EmbeddingWorkerServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Lookup(self, request, context):
        response = pb.WorkerLookupResponse()
        pack_slots(response.slots, self.answer(Batch.from_bytes(request.batch)))
        return response


def _ones(batch: Batch, rows: int, dim: int = 4) -> list[SlotOutput]:
    return [SlotOutput(f.name, torch.ones(rows, dim)) for f in batch.id_type_features]


@pytest.mark.parametrize(
    "answer, message",
    [
        # Twice the batch's rows: the dense model made 2 predictions per sample of them.
        (lambda b: _ones(b, 2 * b.batch_size), "slot 'user' has shape [4, 4], expected [2, 4]"),
        (lambda b: _ones(b, b.batch_size, dim=3), "slot 'user' has shape [2, 3], expected [2, 4]"),
        (lambda b: _ones(b, b.batch_size)[:1], "slots ['user'] for features ['user', 'tags']"),
        (lambda b: _ones(b, b.batch_size)[::-1], "slots ['tags', 'user'] for features"),
        (
            lambda b: [
                SlotOutput("user", torch.ones(2, 4)),
                SlotOutput("tags", torch.ones(2, 1, 4), torch.ones(2, 1, dtype=torch.bool)),
            ],
            "slot 'tags' has shape [2, 1, 4], expected [2, 4]",
        ),
    ],
)
def test_a_workers_answer_that_does_not_fit_the_batch_is_refused(answer, message) -> None:
    config = embedding_config_from_mapping(
        {"slots_config": {"user": {"dim": 4}, "tags": {"dim": 4}}}
    )
    batch = Batch(
        [
            IDTypeFeatureWithSingleID.from_ids("user", [1, 2]),
            IDTypeFeature.from_lists("tags", [[3], []]),
        ],
        requires_grad=False,
    )
    worker = _AnsweringWorker(answer)
    try:
        with RemoteEmbeddingWorker(f"127.0.0.1:{worker.port}", config, timeout=10) as client:
            with pytest.raises(RecserveError, match="sent a malformed answer") as refused:
                client.lookup(batch, train=False)
            assert message in refused.value.message
            worker.answer = lambda b: _ones(b, b.batch_size)
            assert [tuple(s.embeddings.shape) for s in client.lookup(batch, train=False).slots] == [
                (2, 4),
                (2, 4),
            ]
    finally:
        worker.server.stop(None)


RAW_CONFIG = embedding_config_from_mapping(
    {
        "slots_config": {
            "user": {"dim": 4},
            # 1000 positions x (64 floats + a mask byte) = 257,000 bytes of answer per sample
            "history": {"dim": 64, "embedding_summation": False, "sample_fixed_size": 1000},
        }
    }
)


def _raw_batch(samples: int) -> Batch:
    return Batch(
        [
            IDTypeFeatureWithSingleID.from_ids("user", list(range(samples))),
            IDTypeFeature.from_lists("history", [[] for _ in range(samples)]),
        ],
        requires_grad=False,
    )


def test_the_answer_size_counts_every_slot_and_refuses_past_one_message() -> None:
    per_sample = 4 * 4 + 1000 * (4 * 64 + 1)
    fits = (MAX_MESSAGE_BYTES - 64 * 1024) // per_sample
    check_answer_fits(_raw_batch(fits), RAW_CONFIG)
    with pytest.raises(
        CapacityError, match=rf"would be {(fits + 1) * per_sample} bytes"
    ) as refused:
        check_answer_fits(_raw_batch(fits + 1), RAW_CONFIG)
    assert "split the batch" in refused.value.message
    unknown = Batch([IDTypeFeatureWithSingleID.from_ids("nope", [1])], requires_grad=False)
    check_answer_fits(unknown, RAW_CONFIG)  # the lookup names it


class _RecordingTier(RemoteShardTier):
    """A worker core whose lookups are only counted (no shard is ever called)."""

    def __init__(self) -> None:
        super().__init__(RAW_CONFIG, ["127.0.0.1:1"])  # a channel never used
        self.lookups = 0

    def lookup(self, batch, *, train):
        self.lookups += 1
        raise AssertionError("a lookup too large to answer must not run")


def test_a_worker_refuses_a_lookup_whose_answer_cannot_fit_before_computing_it() -> None:
    # A few bytes per sample in the request, 257 KB per sample in the answer: 1100 samples
    # would make the worker compute ~283 MB only to fail sending it.
    tier = _RecordingTier()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_EmbeddingWorkerServicer_to_server(EmbeddingWorkerServicer(tier), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.EmbeddingWorkerStub(channel)
            request = pb.WorkerLookupRequest(batch=_raw_batch(1100).to_bytes(), train=True)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Lookup(request, timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "split the batch" in refused.value.details()
        assert tier.lookups == 0
    finally:
        server.stop(None)
        tier.close()


def test_an_answer_of_exactly_one_messages_room_fits() -> None:
    # A summed slot of dim 4096: 16 KiB per sample; 16380 samples fill the room exactly.
    config = embedding_config_from_mapping({"slots_config": {"user": {"dim": 4096}}})
    room = MAX_MESSAGE_BYTES - 64 * 1024
    assert room == 16380 * 4 * 4096

    def batch(samples: int) -> Batch:
        ids = np.arange(samples, dtype=np.uint64)
        return Batch([IDTypeFeatureWithSingleID("user", ids)], requires_grad=False)

    check_answer_fits(batch(16380), config)
    with pytest.raises(CapacityError, match=f"would be {room + 4 * 4096} bytes"):
        check_answer_fits(batch(16381), config)


class _FixedMessage:
    """A PackedSlots look-alike whose ``data`` is always the same bytes object."""

    def __init__(self, message: pb.PackedSlots) -> None:
        self.slots = message.slots
        self.data = message.data


def test_unpacked_slots_never_write_into_the_message_bytes() -> None:
    message = pb.PackedSlots()
    pack_slots(message, _outputs())
    fixed = _FixedMessage(_wire(message))
    before = bytes(bytearray(fixed.data))
    decoded = unpack_slots(fixed)
    decoded[0].embeddings.add_(1.0)
    decoded[1].embeddings.zero_()
    assert fixed.data == before


def test_an_answer_of_another_batch_size_is_refused_without_an_embedding_config() -> None:
    batch = Batch([IDTypeFeatureWithSingleID.from_ids("user", [1, 2])], requires_grad=False)
    worker = _AnsweringWorker(lambda b: _ones(b, 2 * b.batch_size))
    try:
        with RemoteEmbeddingWorker(f"127.0.0.1:{worker.port}", None, timeout=10) as client:
            with pytest.raises(RecserveError, match="sent a malformed answer") as refused:
                client.lookup(batch, train=False)
            assert "slot 'user' has shape [4, 4], expected [2, ...]" in refused.value.message
            worker.answer = lambda b: _ones(b, b.batch_size, dim=3)
            (slot,) = client.lookup(batch, train=False).slots
            assert tuple(slot.embeddings.shape) == (2, 3)
    finally:
        worker.server.stop(None)


def test_unpacked_grads_are_read_only_views_of_the_message() -> None:
    """Gradients are only read (applied to rows): no copy of the message is made, and
    nothing may write into it."""
    message = pb.PackedSlots()
    pack_grads(message, {"user": np.ones((2, 3), np.float32)})
    grads = unpack_grads(_wire(message))
    assert not grads["user"].flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        grads["user"][0, 0] = 2.0
