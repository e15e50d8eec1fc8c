"""embedding_store.grpc_common.error_from_rpc: each gRPC status a client sees becomes the
recserve error of that status, naming the peer."""

from __future__ import annotations

import grpc
import pytest

from embedding_store.errors import (
    CheckpointError,
    DeadlineExceededError,
    InvalidArgumentError,
    RecserveError,
    UnavailableError,
)
from embedding_store.grpc_common import error_from_rpc


class FailedCall(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "details", "error_class", "message"),
    [
        (grpc.StatusCode.UNAVAILABLE, "connection refused", UnavailableError,
         "shard 0 is unavailable: connection refused"),
        # A call the server cancelled while it stopped: retryable like UNAVAILABLE.
        (grpc.StatusCode.CANCELLED, "Cancelled", UnavailableError,
         "shard 0 cancelled the call (shutting down?): Cancelled"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", DeadlineExceededError,
         "shard 0 did not answer within the deadline: Deadline Exceeded"),
        (grpc.StatusCode.INVALID_ARGUMENT, "dim must be >= 1", InvalidArgumentError,
         "shard 0: dim must be >= 1"),
        (grpc.StatusCode.FAILED_PRECONDITION, "checkpoint is corrupt", CheckpointError,
         "shard 0: checkpoint is corrupt"),
        (grpc.StatusCode.INTERNAL, "boom", RecserveError, "shard 0: boom"),
    ],
)  # fmt: skip
def test_each_status_becomes_its_error(code, details, error_class, message):
    error = error_from_rpc(FailedCall(code, details), "shard 0")
    assert type(error) is error_class
    assert error.message == message
