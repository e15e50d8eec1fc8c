"""JSON answers of the HTTP front end, and the request each error's log line names.

Every error is ``{"error": "<message>"}`` with the status of :func:`http_status_of`; unexpected
exceptions are logged with their traceback and answered 500 with a generic message.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any

import orjson
from starlette.responses import Response

from embedding_store.errors import RecserveError, http_status_of, public_message_of

log = logging.getLogger(__name__)

JSON = "application/json"


def json_response(content: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type=JSON)


#: ``(method, path)`` of the HTTP request this task answers, for the log line of an
#: unexpected error (set per request: every request runs in a task, with a context, of its own).
_CURRENT_REQUEST: ContextVar[tuple[str, str]] = ContextVar("recserve_http_request")


def note_request(method: str, path: str) -> None:
    """Note the request the current task answers, for :func:`error_response`'s log line
    (each request runs in a task, with a context, of its own)."""
    _CURRENT_REQUEST.set((method, path))


def error_response(error: BaseException) -> Response:
    """``{"error": message}`` with the error's HTTP status; tracebacks only go to the log,
    whose line names the request this task answers (:func:`note_request`)."""
    status = http_status_of(error)
    if not isinstance(error, RecserveError):
        method, path = _CURRENT_REQUEST.get(("?", "?"))
        log.error("%s %r failed", method, path, exc_info=error)
    return json_response({"error": public_message_of(error)}, status)
