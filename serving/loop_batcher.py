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
- A flush runs one merged batch (the oldest requests, up to ``max_batch_size`` samples) and,
  if requests are left, the next flush runs once the loop has had its turn: answers go out
  batch by batch, and disconnects and new requests are seen between batches.
- A request whose handler gives up (its future is cancelled: the client went away) frees its
  place in the queue at once and is skipped when its batch is formed (never computed). It is
  left in the queue as a marker; the markers are swept out once they outnumber
  ``max_queue_size`` (O(1) amortized per request).
- A request whose deadline passes while it waits is answered DeadlineExceededError then (one
  timer per loop, armed for the earliest deadline: a comparison per request), not when its
  batch would have started, and frees its place. More than ``max_queue_size`` waiting
  requests are refused at once (UnavailableError: 503 / UNAVAILABLE).
- ``on_drop(reason)`` is told of each request dropped before its batch ran: ``"cancelled"`` or
  ``"deadline"``.
- A merged batch of several requests that fails with an error one request may have caused
  (:func:`serving.batcher.request_specific`) runs its requests again one by one
  (:func:`serving.batcher.run_one_by_one`, still under ``run_lock``): only those that fail
  alone get an error; ``on_split()`` is told. Otherwise a batch whose model call or
  answering fails gives each of its requests the error (they await with no timeout of their
  own); the next batch still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from embedding_store.batch import Batch
from embedding_store.errors import DeadlineExceededError, UnavailableError
from serving.batcher import (
    AloneOutcome,
    deliver_alone,
    deliver_outcomes,
    merge_batches,
    request_specific,
    run_one_by_one,
)

log = logging.getLogger(__name__)


#: What _compute returns: (merged batch size, predictions, context), the exception, or each
#: request's outcome when the merged batch failed and its requests ran one by one.
_Computed = tuple[int, np.ndarray, Any] | Exception | list[AloneOutcome]

#: How long a helper holding the run lock waits for the loop to form its batch before it lets
#: the lock go (the requests stay queued): a loop that has stopped must not keep the model.
HAND_OVER_SECONDS = 1.0

# States of a waiting request (_Waiting.state); they change on the loop only.
_QUEUED = 0  # in the queue, holding a place
_GONE = 1  # still in the queue but answered or given up: its place is free, flushes skip it
_TAKEN = 2  # taken out by a flush


class _Waiting(asyncio.Future):
    """A queued request and the future of its BatchOutcome in one object: cancelling it (its
    handler's task was cancelled) frees its place at once, with no callback per request.
    Made by :meth:`LoopBatcher.submit` (asyncio's own constructor, then the fields: a Python
    ``__init__`` would cost more than the rest of the queueing)."""

    __slots__ = ("batch", "batcher", "deadline", "enqueued", "state")
    batch: Batch
    batcher: LoopBatcher | None
    deadline: float
    enqueued: float
    state: int

    @property
    def future(self) -> asyncio.Future:
        return self

    def cancel(self, msg: Any = None) -> bool:
        if not super().cancel(msg):
            return False
        batcher = self.batcher
        if batcher is not None:
            batcher._gone(self, "cancelled")
        return True


class LoopBatcher:
    """Merges requests submitted on one event loop. ``run(merged) -> (predictions [n, k],
    context)``; ``on_batch(merged_batch_size, started)`` is told of every batch run;
    ``on_drop(reason)`` of every request dropped before its batch ran; ``on_split()`` of
    every merged batch that failed and was run again request by request."""

    def __init__(
        self,
        run: Callable[[Batch], tuple[np.ndarray, Any]],
        *,
        max_batch_size: int,
        max_queue_delay: float,
        max_queue_size: int,
        run_lock: threading.Lock,
        on_batch: Callable[[int, float], None] | None = None,
        on_drop: Callable[[str], None] | None = None,
        on_split: Callable[[], None] | None = None,
    ) -> None:
        if max_batch_size < 1 or max_queue_size < 1 or max_queue_delay < 0:
            raise ValueError("max_batch_size, max_queue_size must be >= 1, delay >= 0")
        self._run = run
        self.max_batch_size = max_batch_size
        self.max_queue_delay = max_queue_delay
        self.max_queue_size = max_queue_size
        self._run_lock = run_lock
        self._on_batch = on_batch
        self._on_drop = on_drop
        self._on_split = on_split
        self._queue: deque[_Waiting] = deque()
        self._queued = 0  # requests in _queue that hold a place (_QUEUED)
        self._markers = 0  # requests in _queue that no longer do (_GONE)
        self._samples = 0  # samples of the _QUEUED requests
        self._flush_handle: asyncio.Handle | None = None
        self._expiry_handle: asyncio.TimerHandle | None = None
        self._expiry_at = math.inf  # when _expiry_handle fires (inf: no timer)
        self._running = 0  # requests of the batch being computed now
        self._helper_waits = False  # a helper thread waits for the run lock (_run_when_free)

    @property
    def pending(self) -> int:
        """Requests waiting or being computed (read from any thread: a plain sum)."""
        return self._queued + self._running

    def submit(self, batch: Batch, *, deadline: float) -> asyncio.Future:
        """Queue ``batch`` (call on the running loop); the future yields a BatchOutcome."""
        if self._queued >= self.max_queue_size:
            raise UnavailableError(
                f"overloaded: {self.max_queue_size} requests are already queued; retry later"
            )
        loop = asyncio.get_running_loop()
        request = _Waiting(loop=loop)
        request.batcher = self
        request.batch = batch
        request.deadline = deadline
        request.enqueued = time.monotonic()
        request.state = _QUEUED
        self._queue.append(request)
        self._queued += 1
        self._samples += batch.batch_size
        if deadline < self._expiry_at:
            # Most requests come with the same timeout, so later ones expire later: the
            # timer is armed again only for a request that expires before the others.
            self._arm_expiry(loop, deadline)
        if self._samples >= self.max_batch_size:
            if self._flush_handle is not None:
                self._flush_handle.cancel()
            self._flush_handle = loop.call_soon(self._flush)
        elif self._flush_handle is None:
            if self.max_queue_delay > 0:
                self._flush_handle = loop.call_later(self.max_queue_delay, self._flush)
            else:
                self._flush_handle = loop.call_soon(self._flush)
        return request

    def fail_waiting(self, error: BaseException) -> None:
        """Answer every request still waiting for its flush with ``error`` (call on the
        loop): a stop whose drain gave up, so that they get an answer before the HTTP
        server closes their connections. A batch being computed is not interrupted."""
        for handle in (self._flush_handle, self._expiry_handle):
            if handle is not None:
                handle.cancel()
        self._flush_handle = self._expiry_handle = None
        self._expiry_at = math.inf
        waiting, self._queue = self._queue, deque()
        self._queued = self._markers = self._samples = 0
        for request in waiting:
            request.batcher = None
            if request.state == _QUEUED:
                request.state = _TAKEN
                request.set_exception(error)

    def _gone(self, request: _Waiting, reason: str) -> None:
        """``request`` left the queue's count (cancelled, or answered past its deadline): its
        place is free now; a flush skips its marker."""
        if request.state != _QUEUED:
            return
        request.state = _GONE
        request.batcher = None
        self._queued -= 1
        self._samples -= request.batch.batch_size
        self._markers += 1
        if self._markers > self.max_queue_size:
            self._queue = deque(r for r in self._queue if r.state == _QUEUED)
            self._markers = 0
        if self._on_drop is not None:
            self._on_drop(reason)

    def _arm_expiry(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._expiry_handle is not None:
            self._expiry_handle.cancel()
        self._expiry_at = at
        self._expiry_handle = loop.call_later(max(0.0, at - time.monotonic()), self._expire)

    def _expire(self) -> None:
        """Answer the waiting requests whose deadline passed (DeadlineExceededError) and arm
        the timer for the earliest deadline left."""
        self._expiry_handle = None
        self._expiry_at = math.inf
        now = time.monotonic()
        earliest = math.inf
        for request in list(self._queue):
            if request.state != _QUEUED:
                continue
            if now >= request.deadline:
                self._gone(request, "deadline")
                request.set_exception(
                    DeadlineExceededError("the request's deadline passed while it was queued")
                )
            elif request.deadline < earliest:
                earliest = request.deadline
        if earliest < math.inf:
            self._arm_expiry(asyncio.get_running_loop(), earliest)

    def _flush(self) -> None:
        """Run one merged batch of the oldest requests (up to max_batch_size samples, at
        least one request); the rest wait for the next flush, once the loop had its turn.

        When the model is busy (the thread batcher's batch, a reload's swap hold the run
        lock) the loop does not wait for it: a helper thread does (:meth:`_run_when_free`),
        and the loop meanwhile answers deadlines, frees the places of requests given up and
        serves everything else; the batch is formed once the lock is taken."""
        self._flush_handle = None
        if self._helper_waits or not self._queue:
            return  # the helper has the loop form the next batch once it holds the lock
        if not self._run_lock.acquire(blocking=False):
            loop = asyncio.get_running_loop()
            try:
                loop.run_in_executor(None, self._run_when_free, loop)
            except RuntimeError:  # the loop's executor is shut down: its loop is ending
                self._run_lock.acquire()
            else:
                self._helper_waits = True
                return
        try:
            requests, now = self._take_batch()
            outcome = self._compute(requests) if requests else None
        finally:
            self._run_lock.release()
        if requests:
            self._answer(requests, now, outcome)
        self._flush_again()

    def _flush_again(self) -> None:
        if self._queue and self._flush_handle is None:
            # Requests left from before this flush are due: next, after what the loop has
            # ready (answers to write, disconnects, new requests, which join at the back).
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    def _take_batch(self) -> tuple[list[_Waiting], float]:
        """Take the next merged batch's requests out of the queue (on the loop): the oldest
        live ones up to max_batch_size samples; markers are dropped and requests past their
        deadline answered DeadlineExceededError. Returns (requests, now)."""
        queue = self._queue
        now = time.monotonic()
        live: list[_Waiting] = []
        size = 0
        while queue:
            request = queue[0]
            if request.state != _QUEUED:  # its place was freed when it went
                queue.popleft()
                self._markers -= 1
                continue
            samples = request.batch.batch_size
            if live and size + samples > self.max_batch_size:
                break
            queue.popleft()
            request.state = _TAKEN
            request.batcher = None
            self._queued -= 1
            self._samples -= samples
            if now > request.deadline:
                request.set_exception(
                    DeadlineExceededError("the request's deadline passed while it was queued")
                )
                if self._on_drop is not None:
                    self._on_drop("deadline")
                continue
            live.append(request)
            size += samples
        self._running = len(live)
        return live, now

    def _compute(self, requests: list[_Waiting]) -> _Computed:
        """Merge and run ``requests`` (the caller holds the run lock; on the loop or its
        helper thread): (merged batch size, predictions [n, k], context), the exception that
        stopped it, or, when it may be one request's fault, each request's outcome alone."""
        try:
            merged = merge_batches([r.batch for r in requests])
            predictions, context = self._run(merged)
        except Exception as error:
            if len(requests) < 2 or not request_specific(error):
                return error
            try:
                return run_one_by_one(requests, self._run, error)
            except Exception as failure:  # run_one_by_one's own fault: answer them all
                log.exception("loop batcher: running a failed batch's requests alone failed")
                return failure
        return merged.batch_size, predictions, context

    def _answer(self, requests: list[_Waiting], now: float, outcome: _Computed | None) -> None:
        """Answer a computed batch's requests (on the loop): their rows, or its error."""
        self._running = 0
        if isinstance(outcome, list):  # the merged batch failed: each ran alone
            if self._on_split is not None:
                try:
                    self._on_split()
                except Exception:
                    log.exception("loop batcher: counting a split batch failed")
            deliver_alone(requests, outcome, now, self._on_batch)
            return
        if outcome is None or isinstance(outcome, Exception):
            error = outcome if outcome is not None else RuntimeError("batch not computed")
            for request in requests:
                if not request.done():
                    request.set_exception(error)
            return
        size, predictions, context = outcome
        try:
            if self._on_batch is not None:
                self._on_batch(size, now)
            deliver_outcomes(requests, predictions, context, size, now)
        except Exception as error:  # the requests await with no timeout: answer them
            log.exception("loop batcher: answering a merged batch failed")
            for request in requests:
                if not request.done():
                    request.set_exception(error)

    def _run_when_free(self, loop: asyncio.AbstractEventLoop) -> None:
        """In a helper thread: take the run lock (waiting for the batch that holds it), have
        the loop form the next merged batch, compute it here and have the loop answer it.
        The lock is taken and released in this thread; if the loop does not take its turn
        within :data:`HAND_OVER_SECONDS` the requests stay queued for a later flush."""
        requests: list[_Waiting] = []
        now = 0.0
        outcome: _Computed | None = None
        try:
            with self._run_lock:
                formed: Future[tuple[list[_Waiting], float]] = Future()
                loop.call_soon_threadsafe(self._form_for_helper, formed)
                try:
                    requests, now = formed.result(timeout=HAND_OVER_SECONDS)
                except TimeoutError:
                    if not formed.cancel():  # the loop is forming it right now
                        requests, now = formed.result()
                if requests:
                    outcome = self._compute(requests)  # never raises
        except Exception:  # the loop is closed, or forming the batch failed (the loop logs it)
            requests = []
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to answer
            loop.call_soon_threadsafe(self._computed_by_helper, requests, now, outcome)

    def _form_for_helper(self, formed: Future[tuple[list[_Waiting], float]]) -> None:
        if not formed.set_running_or_notify_cancel():  # given up by the helper
            return
        try:
            formed.set_result(self._take_batch())
        except BaseException as error:  # the helper, holding the model's lock, must hear
            formed.set_exception(error)
            raise

    def _computed_by_helper(
        self, requests: list[_Waiting], now: float, outcome: _Computed | None
    ) -> None:
        self._helper_waits = False
        if requests:
            self._answer(requests, now, outcome)
        self._flush_again()
