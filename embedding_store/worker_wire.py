"""Wire encoding of worker lookups and gradients (SlotTensor messages), both directions."""

from __future__ import annotations

import numpy as np
import torch

from embedding_store.errors import InvalidArgumentError
from embedding_store.grpc_common import pack_f32, unpack_f32
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.worker import SlotOutput


def _slot_fields(output: SlotOutput) -> dict:
    tensor = output.embeddings.detach().to(torch.float32).contiguous()
    mask = b""
    if output.mask is not None:
        mask = output.mask.to(torch.uint8).contiguous().numpy().tobytes()
    return {
        "name": output.name,
        "shape": list(tensor.shape),
        "data": pack_f32(tensor.numpy()),
        "mask": mask,
    }


def slot_to_proto(output: SlotOutput) -> pb.SlotTensor:
    """A slot's embeddings (float32) and optional mask (bool -> uint8) as a SlotTensor."""
    return pb.SlotTensor(**_slot_fields(output))


def add_slots(messages, outputs) -> None:
    """Append :func:`slot_to_proto` of each output to a repeated SlotTensor field.

    Filling the field in place is cheaper than assigning a list of built messages, which
    copies each message, data included, into the parent (~0.35 ms per batch-1024 answer of
    26 slots x dim 16 here).
    """
    for output in outputs:
        messages.add(**_slot_fields(output))


def slot_from_proto(message: pb.SlotTensor, field: str = "slots") -> SlotOutput:
    """Inverse of :func:`slot_to_proto`; sizes are checked and errors name the slot."""
    shape = tuple(int(d) for d in message.shape)
    if len(shape) not in (2, 3):
        raise InvalidArgumentError(
            f"{field}[{message.name!r}]: shape must have 2 or 3 dims, got {list(shape)}"
        )
    data = unpack_f32(message.data, shape, f"{field}[{message.name!r}].data")
    mask = None
    if len(shape) == 3:
        expected = shape[0] * shape[1]
        if len(message.mask) != expected:
            raise InvalidArgumentError(
                f"{field}[{message.name!r}].mask: got {len(message.mask)} bytes, "
                f"expected {expected}"
            )
        mask_array = np.frombuffer(message.mask, dtype=np.uint8).reshape(shape[:2])
        mask = torch.from_numpy(mask_array.astype(bool))
    return SlotOutput(message.name, torch.from_numpy(data.copy()), mask)


def _grad_fields(name: str, grad: torch.Tensor | np.ndarray) -> dict:
    array = torch.as_tensor(grad).detach().to(torch.float32).contiguous().numpy()
    return {"name": name, "shape": list(array.shape), "data": pack_f32(array)}


def grads_to_proto(grads: dict[str, torch.Tensor | np.ndarray]) -> list[pb.SlotTensor]:
    """Gradients per slot -> SlotTensor messages (no masks)."""
    return [pb.SlotTensor(**_grad_fields(name, grad)) for name, grad in grads.items()]


def add_grads(messages, grads: dict[str, torch.Tensor | np.ndarray]) -> None:
    """Append :func:`grads_to_proto` of ``grads`` to a repeated SlotTensor field, in place
    (see :func:`add_slots`)."""
    for name, grad in grads.items():
        messages.add(**_grad_fields(name, grad))


def grads_from_proto(messages) -> dict[str, np.ndarray]:
    """SlotTensor messages -> gradients per slot; duplicate names are rejected."""
    grads: dict[str, np.ndarray] = {}
    for message in messages:
        if message.name in grads:
            raise InvalidArgumentError(f"grads: slot {message.name!r} appears twice")
        shape = tuple(int(d) for d in message.shape)
        grads[message.name] = unpack_f32(message.data, shape, f"grads[{message.name!r}].data")
    return grads
