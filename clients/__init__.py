"""recserve clients: talk to ``recserve serve`` over the wire protocol only.

:class:`RecserveClient` (blocking) and :class:`AsyncRecserveClient` (asyncio) speak KServe v2
over HTTP (``http://host:port``) or gRPC (``grpc://host:port``) with one interface; results are
:class:`PredictResult` / :class:`ModelInfo`, errors :mod:`embedding_store.errors` classes. This
package never imports ``training``, and ``serving`` only in one place: ``recserve eval
--checkpoint`` scores in-process through ``serving.infer_ctx`` (imported lazily, so that the
offline numbers come from the very code the server runs). ``recserve predict``
(clients/commands.py) scores a JSON-lines or CSV file of rows.

Names are imported lazily, so ``recserve --help`` (which imports clients.commands) stays fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clients.aio import AsyncRecserveClient  # noqa: F401
    from clients.client import RecserveClient, parse_url  # noqa: F401
    from clients.retry import RetryPolicy  # noqa: F401
    from clients.types import ModelInfo, PredictResult, TensorInfo  # noqa: F401

_EXPORTS = {
    "AsyncRecserveClient": "clients.aio",
    "RecserveClient": "clients.client",
    "parse_url": "clients.client",
    "RetryPolicy": "clients.retry",
    "ModelInfo": "clients.types",
    "PredictResult": "clients.types",
    "TensorInfo": "clients.types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'clients' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
