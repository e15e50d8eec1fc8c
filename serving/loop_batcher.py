"""Dynamic batching on the event loop: requests decoded on a loop are merged and run there.

The HTTP front end decodes small requests on its asyncio loop. Handing each one to the
dispatcher thread of :class:`serving.batcher.DynamicBatcher` and waking the loop again costs a
thread hand-off per request, plus GIL convoys between the loop and the dispatcher. At batch 1
that was ~25% of a process's throughput. :class:`LoopBatcher` keeps everything on the loop.

- The first request of a merged batch schedules a flush after ``max_queue_delay`` seconds.
  With 0 the flush runs once the loop has run what is ready now, so every request decoded in
  the same loop iteration joins. Meanwhile the loop goes on reading and decoding requests.
- ``max_batch_size`` waiting samples flush at once.
- The flush runs ``run(merged)`` on the loop: one lookup and one model call per merged batch,
  under ``run_lock``, which the thread batcher of the same model shares. The model is never
  called from two threads at once.
- Requests whose deadline passed before the flush get DeadlineExceededError. More than
  ``max_queue_size`` waiting requests are refused at once (UnavailableError: 503 /
  UNAVAILABLE).
- A batch whose model call or answering fails gives each of its requests the error (they
  await with no timeout of their own); the flush goes on with its next batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from embedding_store.batch import Batch
from embedding_store.errors import DeadlineExceededError, UnavailableError
from serving.batcher import deliver_outcomes, merge_batches

log = logging.getLogger(__name__)


@dataclass
class _Waiting:
    batch: Batch
    future: asyncio.Future
    deadline: float
    enqueued: float


class LoopBatcher:
    """Merges requests submitted on one event loop. ``run(merged) -> (predictions [n, k],
    context)``; ``on_batch(merged_batch_size, started)`` is told of every batch run."""

    def __init__(
        self,
        run: Callable[[Batch], tuple[np.ndarray, Any]],
        *,
        max_batch_size: int,
        max_queue_delay: float,
        max_queue_size: int,
        run_lock: threading.Lock,
        on_batch: Callable[[int, float], None] | None = None,
    ) -> None:
        if max_batch_size < 1 or max_queue_size < 1 or max_queue_delay < 0:
            raise ValueError("max_batch_size, max_queue_size must be >= 1, delay >= 0")
        self._run = run
        self.max_batch_size = max_batch_size
        self.max_queue_delay = max_queue_delay
        self.max_queue_size = max_queue_size
        self._run_lock = run_lock
        self._on_batch = on_batch
        self._waiting: list[_Waiting] = []
        self._samples = 0
        self._flush_handle: asyncio.Handle | None = None
        self._running = 0  # requests of the batch being computed now

    @property
    def pending(self) -> int:
        """Requests waiting or being computed (read from any thread: a plain sum)."""
        return len(self._waiting) + self._running

    def submit(self, batch: Batch, *, deadline: float) -> asyncio.Future:
        """Queue ``batch`` (call on the running loop); the future yields a BatchOutcome."""
        if len(self._waiting) >= self.max_queue_size:
            raise UnavailableError(
                f"overloaded: {self.max_queue_size} requests are already queued; retry later"
            )
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting.append(_Waiting(batch, future, deadline, time.monotonic()))
        self._samples += batch.batch_size
        if self._samples >= self.max_batch_size:
            if self._flush_handle is not None:
                self._flush_handle.cancel()
            self._flush_handle = loop.call_soon(self._flush)
        elif self._flush_handle is None:
            if self.max_queue_delay > 0:
                self._flush_handle = loop.call_later(self.max_queue_delay, self._flush)
            else:
                self._flush_handle = loop.call_soon(self._flush)
        return future

    def fail_waiting(self, error: BaseException) -> None:
        """Answer every request still waiting for its flush with ``error`` (call on the
        loop): a stop whose drain gave up, so that they get an answer before the HTTP
        server closes their connections. A batch being computed is not interrupted."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        waiting, self._waiting, self._samples = self._waiting, [], 0
        for request in waiting:
            if not request.future.done():
                request.future.set_exception(error)

    def _flush(self) -> None:
        self._flush_handle = None
        waiting, self._waiting, self._samples = self._waiting, [], 0
        while waiting:
            # Take requests up to max_batch_size samples (always at least one).
            size, count = waiting[0].batch.batch_size, 1
            while count < len(waiting) and size + waiting[count].batch.batch_size <= (
                self.max_batch_size
            ):
                size += waiting[count].batch.batch_size
                count += 1
            self._run_batch(waiting[:count])
            waiting = waiting[count:]

    def _run_batch(self, requests: list[_Waiting]) -> None:
        now = time.monotonic()
        live = []
        for request in requests:
            if request.future.done():  # its handler gave up (client gone, cancelled)
                continue
            if now > request.deadline:
                request.future.set_exception(
                    DeadlineExceededError("the request's deadline passed while it was queued")
                )
                continue
            live.append(request)
        if not live:
            return
        self._running = len(live)
        try:
            merged = merge_batches([r.batch for r in live])
            with self._run_lock:
                predictions, context = self._run(merged)
        except Exception as error:
            for request in live:
                if not request.future.done():
                    request.future.set_exception(error)
            return
        finally:
            self._running = 0
        try:
            if self._on_batch is not None:
                self._on_batch(merged.batch_size, now)
            deliver_outcomes(live, predictions, context, merged.batch_size, now)
        except Exception as error:  # the requests await with no timeout: answer them
            log.exception("loop batcher: answering a merged batch failed")
            for request in live:
                if not request.future.done():
                    request.future.set_exception(error)
