"""The one error hierarchy of recserve.

Every error a user can see derives from :class:`RecserveError`. Each class carries the HTTP
status and the gRPC status code it maps to, so front ends translate errors in exactly one place
(:func:`http_status_of`, :func:`grpc_code_name_of`) and never invent their own mapping.
Messages are written for the person who sent the bad input: they name the field, the file or
the peer at fault. Tracebacks go to logs only.
"""

from __future__ import annotations

import traceback


class RecserveError(Exception):
    """Base of all recserve errors. Unexpected failures map to 500 / INTERNAL."""

    http_status: int = 500
    grpc_code: str = "INTERNAL"  # a grpc.StatusCode member name

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgumentError(RecserveError):
    """The caller sent something malformed: bad request, bad batch, bad bytes."""

    http_status = 400
    grpc_code = "INVALID_ARGUMENT"


class BatchValidationError(InvalidArgumentError):
    """A batch violates the data model (dtype, shape, names, batch size)."""


class ModelInputError(InvalidArgumentError):
    """The dense model failed on a request's inputs in a way that names them at fault (an
    index out of range: an integer input beyond what the model indexes). The model's own
    error is its ``__cause__``, for the log; the message names the request's integer inputs."""


class DecodeError(InvalidArgumentError):
    """Bytes could not be decoded (truncated, oversized, corrupt, wrong version)."""


class ConfigError(InvalidArgumentError):
    """A configuration file or value is invalid; the message names file, key path and value."""


class NotFoundError(RecserveError):
    """A named thing (model, version, feature, checkpoint) does not exist."""

    http_status = 404
    grpc_code = "NOT_FOUND"


class FailedPreconditionError(RecserveError):
    """The operation is not allowed in the current state (e.g. writes to a read-only store)."""

    http_status = 409
    grpc_code = "FAILED_PRECONDITION"


class CheckpointError(FailedPreconditionError):
    """A checkpoint is incomplete, corrupt, or does not match the running configuration."""


class AlreadyExistsError(RecserveError):
    """Refusing to overwrite something that exists (e.g. a checkpoint directory)."""

    http_status = 409
    grpc_code = "ALREADY_EXISTS"


class PermissionDeniedError(RecserveError):
    """The caller may not do this (e.g. an admin route from off-host without the token)."""

    http_status = 403
    grpc_code = "PERMISSION_DENIED"


class UnauthenticatedError(RecserveError):
    """The caller did not prove who it is (e.g. the embedding tier's token is missing or
    wrong)."""

    http_status = 401
    grpc_code = "UNAUTHENTICATED"


class CapacityError(RecserveError):
    """A request needs more resources than configured (rows, batch size, body size)."""

    http_status = 413
    grpc_code = "RESOURCE_EXHAUSTED"


class UnavailableError(RecserveError):
    """A peer or the server itself cannot answer now (not ready, overloaded, shard down)."""

    http_status = 503
    grpc_code = "UNAVAILABLE"


class DeadlineExceededError(RecserveError):
    """The operation did not finish within its deadline."""

    http_status = 504
    grpc_code = "DEADLINE_EXCEEDED"


#: What a user's preprocessor (``recserve serve --preprocessor``, the preprocessor of
#: ``recserve eval``'s mapping) raises when the rows it was given do not fit it: a missing
#: field (KeyError), a list too short (IndexError), a value of the wrong type or form
#: (TypeError, ValueError), a number out of range (OverflowError and the other
#: ArithmeticErrors). Taken for the rows' fault, alike in both: ``serve`` answers 400
#: (:class:`InvalidArgumentError`), ``eval`` reports bad rows. Any other exception is the
#: preprocessor's own failure: a 500 from ``serve``, fatal to ``eval``.
PREPROCESSOR_INPUT_ERRORS: tuple[type[Exception], ...] = (
    KeyError,
    IndexError,
    TypeError,
    ValueError,
    ArithmeticError,
)


def error_summary(error: BaseException) -> str:
    """``"Type: last line"`` of an error: TorchScript errors carry the script's traceback,
    which is for the log, not for a client or a one-line CLI error."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    reason = lines[-1].strip()[:300] if lines else ""
    kind = f"{type(error).__name__}: "
    return f"{kind}{reason.removeprefix(kind)}"


def summary_with_origin(error: BaseException) -> str:
    """:func:`error_summary` and where it was raised, ``(FILE, line N)`` (its innermost
    frame, as a traceback's last line says): e.g. for a user's module that raised on import.
    A SyntaxError names its file and line already."""
    text = error_summary(error)
    if isinstance(error, SyntaxError):
        return text
    frames = traceback.extract_tb(error.__traceback__)
    return f"{text} ({frames[-1].filename}, line {frames[-1].lineno})" if frames else text


def http_status_of(error: BaseException) -> int:
    """HTTP status for any exception: recserve errors map by class, everything else is 500."""
    return error.http_status if isinstance(error, RecserveError) else 500


def _most_general_by(attribute: str) -> dict[object, type[RecserveError]]:
    """Status (or code) -> the most general class of this module that maps to it. Classes are
    met in declaration order, parents before children, so the first one found is it: 409 is
    FailedPreconditionError (not its CheckpointError), 400 InvalidArgumentError."""
    found: dict[object, type[RecserveError]] = {}
    for value in list(globals().values()):
        if isinstance(value, type) and issubclass(value, RecserveError):
            found.setdefault(getattr(value, attribute), value)
    return found


def error_for_http_status(status: int, message: str) -> RecserveError:
    """What a client raises for an HTTP error answer: the error this hierarchy maps to that
    status (the most general class, since the status cannot tell subclasses apart), or a
    RecserveError naming a status outside it."""
    error_class = _CLASS_OF_HTTP_STATUS.get(status)
    if error_class is None or error_class is RecserveError:
        return RecserveError(f"{message} (HTTP {status})")
    return error_class(message)


def error_for_grpc_code(code_name: str, message: str) -> RecserveError:
    """:func:`error_for_http_status` for a gRPC status code name (``"NOT_FOUND"``).
    OUT_OF_RANGE reads as INVALID_ARGUMENT; codes outside the hierarchy give RecserveError."""
    error_class = _CLASS_OF_GRPC_CODE.get(_GRPC_ALIASES.get(code_name, code_name), RecserveError)
    return error_class(message)


def grpc_code_name_of(error: BaseException) -> str:
    """gRPC status code name (a ``grpc.StatusCode`` member) for any exception."""
    return error.grpc_code if isinstance(error, RecserveError) else "INTERNAL"


#: The longest message a client is sent. Messages quote what the client sent (names,
#: values): a 16 KB input name must not make a 16 KB answer, nor overflow gRPC's metadata
#: limit (16 KiB), which would turn INVALID_ARGUMENT into RESOURCE_EXHAUSTED.
MAX_PUBLIC_MESSAGE_CHARS = 2048


def public_message_of(error: BaseException) -> str:
    """The message a client may see: recserve errors verbatim (cut to
    :data:`MAX_PUBLIC_MESSAGE_CHARS`), anything else a generic line."""
    if not isinstance(error, RecserveError):
        return "internal error (details are in the server log)"
    message = error.message
    if len(message) <= MAX_PUBLIC_MESSAGE_CHARS:
        return message
    cut = len(message) - MAX_PUBLIC_MESSAGE_CHARS
    return f"{message[:MAX_PUBLIC_MESSAGE_CHARS]}... ({cut} more characters)"


_GRPC_ALIASES = {"OUT_OF_RANGE": "INVALID_ARGUMENT"}
_CLASS_OF_HTTP_STATUS = _most_general_by("http_status")
_CLASS_OF_GRPC_CODE = _most_general_by("grpc_code")
