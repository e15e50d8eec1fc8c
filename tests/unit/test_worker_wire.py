"""PackedSlots: lookup answers and gradients in one buffer, round trips and malformed input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedding_store.errors import InvalidArgumentError
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.worker import SlotOutput
from embedding_store.worker_wire import pack_grads, pack_slots, unpack_grads, unpack_slots


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
