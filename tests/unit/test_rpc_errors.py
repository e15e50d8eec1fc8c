"""embedding_store.grpc_common.error_from_rpc: each gRPC status a client sees becomes the
recserve error of that status, naming the peer."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

from embedding_store.errors import (
    CheckpointError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    RecserveError,
    UnavailableError,
)
from embedding_store.grpc_common import (
    channel_options,
    error_from_rpc,
    pack_u64,
    rpc_errors,
    server_options,
    unpack_u64,
)


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
        # CANCELLED is retryable like UNAVAILABLE; the message says who ended the call (was
        # "cancelled the call (shutting down?)" whatever the cause).
        (grpc.StatusCode.CANCELLED, "Cancelled", UnavailableError,
         "shard 0 cancelled the call (the server, or a proxy between, ended it before "
         "answering): Cancelled"),
        (grpc.StatusCode.CANCELLED, "Channel closed!", UnavailableError,
         "call to shard 0 cancelled by this process: its channel was closed while the call "
         "was in flight (Channel closed!)"),
        (grpc.StatusCode.CANCELLED, "Locally cancelled by application!", UnavailableError,
         "call to shard 0 cancelled by this process: its caller gave up (Locally cancelled by "
         "application!)"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", DeadlineExceededError,
         "shard 0 did not answer within the deadline: Deadline Exceeded"),
        (grpc.StatusCode.INVALID_ARGUMENT, "dim must be >= 1", InvalidArgumentError,
         "shard 0: dim must be >= 1"),
        (grpc.StatusCode.FAILED_PRECONDITION, "checkpoint is corrupt", CheckpointError,
         "shard 0: checkpoint is corrupt"),
        (grpc.StatusCode.INTERNAL, "boom", RecserveError, "shard 0: boom"),
        # gRPC's answer for a service the process does not run (`--worker` given a shard's
        # port): was "Method not found!" alone.
        (grpc.StatusCode.UNIMPLEMENTED, "Method not found!", RecserveError,
         "shard 0: the process at that address answers gRPC but not this call (Method not "
         "found!); is the address right? Parameter-server shards, embedding workers and "
         "prediction servers each listen on ports of their own"),
        (grpc.StatusCode.UNIMPLEMENTED, "row imports are refused", RecserveError,
         "shard 0: row imports are refused"),
    ],
)  # fmt: skip
def test_each_status_becomes_its_error(code, details, error_class, message):
    error = error_from_rpc(FailedCall(code, details), "shard 0")
    assert type(error) is error_class
    assert error.message == message


def test_a_failed_precondition_is_a_checkpoint_error_only_when_about_a_checkpoint():
    about = error_from_rpc(FailedCall(grpc.StatusCode.FAILED_PRECONDITION, "Checkpoint gone"), "s")
    assert type(about) is CheckpointError  # the word is matched whatever its case
    other = error_from_rpc(FailedCall(grpc.StatusCode.FAILED_PRECONDITION, "read-only"), "s")
    assert type(other) is FailedPreconditionError and other.message == "s: read-only"


def test_a_status_without_details_is_named_by_its_code():
    error = error_from_rpc(FailedCall(grpc.StatusCode.INTERNAL, ""), "shard 0")
    assert error.message == "shard 0: StatusCode.INTERNAL"


def test_packed_ids_must_be_whole_uint64_values():
    with pytest.raises(InvalidArgumentError) as refused:
        unpack_u64(b"\0" * 12, "LookupRequest.ids")
    assert refused.value.message == (
        "LookupRequest.ids: 12 bytes is not a whole number of uint64 values"
    )
    assert unpack_u64(pack_u64(np.array([1, 2**64 - 1], np.uint64)), "ids").tolist() == [
        1,
        2**64 - 1,
    ]


def test_message_limits_apply_to_both_directions_and_grpc_retries_are_off():
    """Each side sets both limits explicitly (gRPC's default receive limit is 4 MiB); the
    tier's clients retry themselves, so gRPC's own retries are disabled."""
    channel = dict(channel_options(1234))
    assert channel["grpc.max_send_message_length"] == 1234
    assert channel["grpc.max_receive_message_length"] == 1234
    assert channel["grpc.enable_retries"] == 0
    server = dict(server_options(1234))
    assert server["grpc.max_send_message_length"] == 1234
    assert server["grpc.max_receive_message_length"] == 1234


def test_packed_arrays_are_little_endian_on_the_wire():
    assert pack_u64(np.array([1], np.uint64)) == b"\x01" + b"\0" * 7
    assert unpack_u64(b"\x02" + b"\0" * 7, "ids").tolist() == [2]


class _AbortedError(Exception):
    """What the fake context's abort raises, as grpc's does, to end the handler."""


class _Context:
    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _AbortedError


class _Servicer:
    @rpc_errors
    def Fails(self, request, context):
        raise ValueError("/etc/secret/path is broken")

    @rpc_errors
    def Refuses(self, request, context):
        raise InvalidArgumentError("dim must be > 0, got 0")


def test_servicer_errors_answer_their_code_and_hide_unexpected_details(caplog):
    """An unexpected exception may hold anything (paths, values): INTERNAL with a generic
    line for the client, the traceback in the server log; recserve errors are public."""
    context = _Context()
    with pytest.raises(_AbortedError):
        _Servicer().Fails(None, context)
    assert context.code == grpc.StatusCode.INTERNAL
    assert context.details == "internal error (details are in the server log)"
    assert "Fails failed" in caplog.text
    with pytest.raises(_AbortedError):
        _Servicer().Refuses(None, context)
    assert (context.code, context.details) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "dim must be > 0, got 0",
    )


def test_calls_this_process_cancels_are_named_as_such_with_grpcio_s_own_details():
    """The details error_from_rpc tells apart are grpcio's: a channel closed under a call in
    flight, and a streaming call cancelled by its caller; what the server ends is the peer's."""
    started = threading.Event()
    release = threading.Event()

    def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
        if request == b"abort":
            context.abort(grpc.StatusCode.CANCELLED, "the handler gave up")
        started.set()
        release.wait(5)
        return b"late"

    def stream(request: bytes, context: grpc.ServicerContext):
        yield b"first"
        release.wait(5)

    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    messages = []
    try:
        target = f"127.0.0.1:{port}"
        with grpc.insecure_channel(target) as channel:
            with pytest.raises(grpc.RpcError) as aborted:
                channel.unary_unary("/t.S/Unary")(b"abort", timeout=5)
            messages.append(error_from_rpc(aborted.value, "shard 0").message)
            chunks = channel.unary_stream("/t.S/Stream")(b"", timeout=5)
            assert next(chunks) == b"first"
            chunks.cancel()
            with pytest.raises(grpc.RpcError) as given_up:
                next(chunks)
            messages.append(error_from_rpc(given_up.value, "shard 0").message)
        channel = grpc.insecure_channel(target)
        call = channel.unary_unary("/t.S/Unary").future(b"wait", timeout=5)
        assert started.wait(5)
        channel.close()
        with pytest.raises(grpc.RpcError) as closed:
            call.result(5)
        messages.append(error_from_rpc(closed.value, "shard 0").message)
    finally:
        release.set()
        server.stop(None)
    assert messages == [
        "shard 0 cancelled the call (the server, or a proxy between, ended it before "
        "answering): the handler gave up",
        "call to shard 0 cancelled by this process: its caller gave up (Locally cancelled by "
        "application!)",
        "call to shard 0 cancelled by this process: its channel was closed while the call was "
        "in flight (Channel closed!)",
    ]
