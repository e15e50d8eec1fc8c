"""embedding_store.errors: one table of statuses, read both ways. Servers answer each error
with its class's HTTP status and gRPC code; clients turn a status back into the most general
class that has it, the same way on every client path."""

from __future__ import annotations

import grpc
import pytest

from clients import codec
from embedding_store import errors
from embedding_store.errors import (
    AlreadyExistsError,
    BatchValidationError,
    CapacityError,
    CheckpointError,
    ConfigError,
    DeadlineExceededError,
    DecodeError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    RecserveError,
    UnauthenticatedError,
    UnavailableError,
)
from embedding_store.grpc_common import error_from_rpc
from tests.unit.test_rpc_errors import FailedCall

# (class, HTTP status, gRPC code, what a client raises for that status / that code)
TABLE = [
    (InvalidArgumentError, 400, "INVALID_ARGUMENT", InvalidArgumentError, InvalidArgumentError),
    (BatchValidationError, 400, "INVALID_ARGUMENT", InvalidArgumentError, InvalidArgumentError),
    (DecodeError, 400, "INVALID_ARGUMENT", InvalidArgumentError, InvalidArgumentError),
    (ConfigError, 400, "INVALID_ARGUMENT", InvalidArgumentError, InvalidArgumentError),
    (UnauthenticatedError, 401, "UNAUTHENTICATED", UnauthenticatedError, UnauthenticatedError),
    (PermissionDeniedError, 403, "PERMISSION_DENIED", PermissionDeniedError, PermissionDeniedError),
    (NotFoundError, 404, "NOT_FOUND", NotFoundError, NotFoundError),
    (FailedPreconditionError, 409, "FAILED_PRECONDITION", FailedPreconditionError, None),
    (CheckpointError, 409, "FAILED_PRECONDITION", FailedPreconditionError, None),
    (AlreadyExistsError, 409, "ALREADY_EXISTS", FailedPreconditionError, AlreadyExistsError),
    (CapacityError, 413, "RESOURCE_EXHAUSTED", CapacityError, CapacityError),
    (UnavailableError, 503, "UNAVAILABLE", UnavailableError, UnavailableError),
    (DeadlineExceededError, 504, "DEADLINE_EXCEEDED", DeadlineExceededError, DeadlineExceededError),
    (RecserveError, 500, "INTERNAL", RecserveError, RecserveError),
]


@pytest.mark.parametrize(("cls", "status", "code", "from_status", "from_code"), TABLE)
def test_each_error_has_one_status_and_code_and_clients_read_them_back(
    cls, status, code, from_status, from_code
):
    error = cls("the message")
    assert errors.http_status_of(error) == status
    assert errors.grpc_code_name_of(error) == code
    assert getattr(grpc.StatusCode, code) is not None  # a real gRPC status code
    assert type(errors.error_for_http_status(status, "m")) is from_status
    assert type(codec.http_error("s", status, b'{"error": "m"}')) is from_status
    if from_code is not None:
        assert type(errors.error_for_grpc_code(code, "m")) is from_code
        assert type(codec.grpc_error("s", code, "m")) is from_code


def test_the_most_general_class_wins_and_unknown_statuses_stay_generic():
    # 409 over gRPC: the code alone says FailedPrecondition; the peer-facing reader also
    # recognises a checkpoint problem by its message.
    assert type(codec.grpc_error("s", "FAILED_PRECONDITION", "checkpoint x")) is (
        FailedPreconditionError
    )
    assert issubclass(CheckpointError, FailedPreconditionError)
    unknown = errors.error_for_http_status(418, "teapot")
    assert type(unknown) is RecserveError and unknown.message == "teapot (HTTP 418)"
    assert type(errors.error_for_grpc_code("OUT_OF_RANGE", "m")) is InvalidArgumentError
    assert type(errors.error_for_grpc_code("DATA_LOSS", "m")) is RecserveError
    message = codec.http_error("127.0.0.1:1", 404, b'{"error": "unknown model x"}').message
    assert message == "server 127.0.0.1:1 answered HTTP 404: unknown model x"


@pytest.mark.parametrize(
    ("code", "details", "expected"),
    [
        (grpc.StatusCode.NOT_FOUND, "no forward context 3", NotFoundError),
        (grpc.StatusCode.FAILED_PRECONDITION, "checkpoint /x is corrupt", CheckpointError),
        (grpc.StatusCode.FAILED_PRECONDITION, "shard is read-only", FailedPreconditionError),
        (grpc.StatusCode.PERMISSION_DENIED, "no", PermissionDeniedError),
        (grpc.StatusCode.CANCELLED, "stopping", UnavailableError),
        (grpc.StatusCode.UNKNOWN, "?", RecserveError),
    ],
)
def test_peer_calls_map_codes_through_the_same_table(code, details, expected):
    error = error_from_rpc(FailedCall(code, details), "parameter server 127.0.0.1:7001")
    assert type(error) is expected
    assert "parameter server 127.0.0.1:7001" in error.message


def test_messages_sent_to_clients_are_cut_at_a_bound():
    short = InvalidArgumentError("x" * errors.MAX_PUBLIC_MESSAGE_CHARS)
    assert errors.public_message_of(short) == short.message
    long = InvalidArgumentError("unknown input(s) ['" + "C" * 16000 + "']")
    message = errors.public_message_of(long)
    assert message.startswith("unknown input(s) ['CCC")
    cut = len(long.message) - errors.MAX_PUBLIC_MESSAGE_CHARS
    assert message.endswith(f"... ({cut} more characters)")
    assert len(message) == errors.MAX_PUBLIC_MESSAGE_CHARS + len(f"... ({cut} more characters)")
    assert errors.public_message_of(RuntimeError("secret")) == (
        "internal error (details are in the server log)"
    )


def test_exceptions_outside_the_hierarchy_are_500_internal():
    for error in (RuntimeError("x"), ValueError("y"), KeyError("z")):
        assert errors.http_status_of(error) == 500
        assert errors.grpc_code_name_of(error) == "INTERNAL"


def test_a_500_answer_reads_back_as_a_generic_error_naming_its_status():
    """500 maps to RecserveError itself, which says nothing of the status: the message
    names it, as for any status outside the table."""
    error = errors.error_for_http_status(500, "boom")
    assert type(error) is RecserveError and error.message == "boom (HTTP 500)"
