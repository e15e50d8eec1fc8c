"""The asyncio client: :class:`AsyncRecserveClient`, the same interface as
:class:`~clients.client.RecserveClient` with ``async`` methods.

gRPC uses ``grpc.aio`` (one channel, opened inside the running loop on first use, and
reopened when a call comes from another loop after that one stopped, e.g. a second
``asyncio.run()``). HTTP runs the blocking urllib3 backend in a small thread pool of its own
(one attempt per hop to a thread; at most ``max_connections`` at a time, and an attempt's
``timeout`` counts its wait for a thread), while retries wait with ``asyncio.sleep``, so the
event loop never blocks. Use a client from one event loop at a time (gRPC raises
FailedPreconditionError for a call from a second loop while the first still runs)::

    async with AsyncRecserveClient("grpc://127.0.0.1:8001", model_name="adult") as client:
        result = await client.predict(batch)
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from clients import codec
from clients._grpc import AsyncGrpcBackend, reconnect_backoff_ms
from clients._http import HttpBackend, attempt_started
from clients._tls import ClientTls
from clients.client import _checked_wait, _ClientBase, check_input, rows_need_http
from clients.retry import RetryableError, exhausted
from clients.types import ModelInfo, PredictResult
from embedding_store.batch import Batch
from embedding_store.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    UnavailableError,
)

T = TypeVar("T")


def _run_attempt(started: float, function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` on a worker thread, its timeout counted from ``started``."""
    with attempt_started(started):
        return function(*args)


class _AsyncHttpBackend:
    """The blocking HTTP backend, each call on a worker thread; ``client`` names the client
    in the error of a call that :meth:`close` stopped."""

    def __init__(
        self,
        base_url: str,
        max_connections: int,
        tls: ClientTls | None,
        client: str = "AsyncRecserveClient",
    ) -> None:
        self.sync = HttpBackend(base_url, max_connections=max_connections, tls=tls)
        self._executor = ThreadPoolExecutor(
            max_workers=max_connections, thread_name_prefix="recserve-http"
        )
        self._client = client
        self._closed = False

    def _closed_error(self, what: str) -> FailedPreconditionError:
        return FailedPreconditionError(f"{self._client} {what}; create a new client")

    async def _run(self, function: Callable[..., T], *args: Any) -> T:
        if self._closed:  # an attempt after close(): a retry that was waiting out its delay
            raise self._closed_error("is closed")
        # The attempt's timeout runs from now: with more calls than worker threads, a call
        # waits for one, and its timeout used to start only then (a 1.5 s call, queued behind
        # slow ones, answered after 3 s).
        started = time.monotonic()
        future = self._executor.submit(functools.partial(_run_attempt, started, function, *args))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # close() cancels the calls still waiting for a worker thread (they used to be
            # sent once a thread was free, after the client was closed): each fails now,
            # unsent. A cancellation of the caller's own task stays one (Python 3.10 cannot
            # tell them apart: there, one that raced close() gets this error).
            task = asyncio.current_task()
            cancelling = getattr(task, "cancelling", None)
            by_caller = cancelling is not None and cancelling() > 0
            if self._closed and future.cancelled() and not by_caller:
                raise self._closed_error(
                    "was closed while this call waited for one of its connections "
                    "(max_connections): it was not sent"
                ) from None
            raise

    async def live(self, timeout: float | None) -> bool:
        return await self._run(self.sync.live, timeout)

    async def ready(self, timeout: float | None) -> bool:
        return await self._run(self.sync.ready, timeout)

    async def model_ready(self, model: str, timeout: float | None) -> bool:
        return await self._run(self.sync.model_ready, model, timeout)

    async def metadata(self, model: str, timeout: float | None) -> ModelInfo:
        return await self._run(self.sync.metadata, model, timeout)

    async def infer(
        self, model: str, tensors: Mapping[str, np.ndarray], timeout: float | None
    ) -> PredictResult:
        return await self._run(self.sync.infer, model, tensors, timeout)

    async def predict_rows(
        self, model: str, rows: Sequence[Mapping[str, Any]], timeout: float | None
    ) -> PredictResult:
        return await self._run(self.sync.predict_rows, model, rows, timeout)

    async def close(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.sync.close()


class AsyncRecserveClient(_ClientBase):
    """Asyncio client of a recserve server; arguments as for
    :class:`~clients.client.RecserveClient`."""

    _backend: _AsyncHttpBackend | AsyncGrpcBackend

    def _make_backend(self) -> _AsyncHttpBackend | AsyncGrpcBackend:
        if self.protocol == "http":
            return _AsyncHttpBackend(
                self.endpoint.base, self._max_connections, self._tls, client=repr(self)
            )
        return AsyncGrpcBackend(
            self.endpoint.base,
            self.url,
            max_message_bytes=self._max_message_bytes,
            tls=self._tls,
            max_reconnect_backoff_ms=reconnect_backoff_ms(self.policy),
        )

    async def _retrying(self, call: Callable[..., Awaitable[T]], *args: Any) -> T:
        attempt = 0
        while True:
            try:
                return await call(*args)
            except RetryableError as retry:
                if attempt >= self.policy.retries:
                    raise exhausted(retry, attempt + 1) from None
                await asyncio.sleep(self.policy.delay(attempt))
                self._check_open()
                attempt += 1

    async def _health(self, call: Callable[..., Awaitable[bool]], *args: Any) -> bool:
        try:
            return bool(await call(*args))
        except (RetryableError, UnavailableError, DeadlineExceededError):
            return False

    async def live(self, *, timeout: float | None = None) -> bool:
        return await self._health(self._backend.live, self._timeout(timeout))

    async def ready(self, *, timeout: float | None = None) -> bool:
        return await self._health(self._backend.ready, self._timeout(timeout))

    async def model_ready(self, *, timeout: float | None = None) -> bool:
        return await self._health(
            self._backend.model_ready, self.model_name, self._timeout(timeout)
        )

    async def wait_until_ready(self, timeout: float = 30.0, *, interval: float = 0.05) -> bool:
        """As :meth:`RecserveClient.wait_until_ready`."""
        timeout, interval = _checked_wait(timeout, interval)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if await self.ready(timeout=max(min(left, 1.0), 0.01)):
                return True
            if time.monotonic() + interval > deadline:
                return False
            await asyncio.sleep(interval)

    async def metadata(self, *, timeout: float | None = None) -> ModelInfo:
        return await self._retrying(self._backend.metadata, self.model_name, self._timeout(timeout))

    async def infer(
        self, tensors: Mapping[str, np.ndarray], *, timeout: float | None = None
    ) -> PredictResult:
        started = time.perf_counter()
        checked = codec.check_tensors(tensors)
        result = await self._retrying(
            self._backend.infer, self.model_name, checked, self._timeout(timeout)
        )
        return codec.with_latency(result, time.perf_counter() - started)

    async def predict(
        self, data: Batch | Sequence[Mapping[str, Any]], *, timeout: float | None = None
    ) -> PredictResult:
        check_input(data)
        started = time.perf_counter()
        if isinstance(data, Batch):
            result = await self._retrying(
                self._backend.infer,
                self.model_name,
                codec.batch_to_tensors(data),
                self._timeout(timeout),
            )
        else:
            if not isinstance(self._backend, _AsyncHttpBackend):
                raise rows_need_http(self.url)
            result = await self._retrying(
                self._backend.predict_rows, self.model_name, list(data), self._timeout(timeout)
            )
        return codec.with_latency(result, time.perf_counter() - started)

    async def close(self) -> None:
        """Release the connections; later calls raise FailedPreconditionError, and so do the
        HTTP calls still waiting for a connection (at once, unsent). Idempotent."""
        transport = self._close_transport()
        if transport is not None:
            await transport.close()

    async def __aenter__(self) -> AsyncRecserveClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
