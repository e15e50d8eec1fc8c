"""Dynamic batching: concurrent requests are merged into one lookup + one model call.

Requests wait in a bounded queue; one dispatcher thread takes the oldest, keeps collecting
until ``max_batch_size`` samples or ``max_queue_delay`` seconds, drops requests whose deadline
passed, runs the merged batch and hands every request its slice. A full queue is refused at
once (UnavailableError -> 503 / UNAVAILABLE) instead of growing without bound.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from embedding_store.batch import Batch, IDTypeFeature, IDTypeFeatureWithSingleID, NonIDTypeFeature
from embedding_store.errors import DeadlineExceededError, UnavailableError

log = logging.getLogger(__name__)


def merge_batches(batches: Sequence[Batch]) -> Batch:
    """Concatenate batches that share one signature (same features, same order)."""
    if len(batches) == 1:
        return batches[0]
    first = batches[0]
    id_features = []
    for index, feature in enumerate(first.id_type_features):
        parts = [b.id_type_features[index] for b in batches]
        values = np.concatenate([p.values for p in parts])
        if isinstance(feature, IDTypeFeatureWithSingleID):
            id_features.append(IDTypeFeatureWithSingleID(feature.name, values))
        else:
            lengths = np.concatenate([p.lengths for p in parts])
            id_features.append(IDTypeFeature(feature.name, values, lengths))
    non_ids = [
        NonIDTypeFeature(
            np.concatenate([b.non_id_type_features[index].data for b in batches]), feature.name
        )
        for index, feature in enumerate(first.non_id_type_features)
    ]
    return Batch(id_features, non_ids, requires_grad=False)


@dataclass
class _Request:
    batch: Batch
    future: Future
    deadline: float | None
    enqueued: float


@dataclass(frozen=True)
class BatchOutcome:
    """What the dispatcher hands each request: its rows of the merged predictions."""

    predictions: np.ndarray
    context: Any  # whatever ``run`` returned besides predictions (model version, counts)
    queue_seconds: float
    merged_batch_size: int


class DynamicBatcher:
    """Merges concurrent requests. ``run(merged) -> (predictions [n, k], context)``."""

    def __init__(
        self,
        run: Callable[[Batch], tuple[np.ndarray, Any]],
        *,
        max_batch_size: int = 256,
        max_queue_delay: float = 0.002,
        max_queue_size: int = 1024,
        on_batch: Callable[[int, float], None] | None = None,
    ) -> None:
        if max_batch_size < 1 or max_queue_size < 1 or max_queue_delay < 0:
            raise ValueError("max_batch_size, max_queue_size must be >= 1, delay >= 0")
        self._run = run
        self.max_batch_size = max_batch_size
        self.max_queue_delay = max_queue_delay
        self._queue: queue.Queue[_Request | None] = queue.Queue(maxsize=max_queue_size)
        self._on_batch = on_batch
        self._accepting = True
        self._in_flight = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._loop, name="dynamic-batcher", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Requests queued or being computed."""
        with self._lock:
            return self._in_flight

    def submit(self, batch: Batch, *, deadline: float | None = None) -> Future:
        """Queue ``batch``; the future yields a :class:`BatchOutcome`."""
        if not self._accepting:
            raise UnavailableError("the server is shutting down and takes no new requests")
        request = _Request(batch, Future(), deadline, time.monotonic())
        with self._lock:
            self._in_flight += 1
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            self._finished(1)
            raise UnavailableError(
                f"overloaded: {self._queue.maxsize} requests are already queued; retry later"
            ) from None
        return request.future

    def _finished(self, count: int) -> None:
        with self._lock:
            self._in_flight -= count
            if self._in_flight == 0:
                self._idle.notify_all()

    def _loop(self) -> None:
        carry: _Request | None = None
        while True:
            first = carry if carry is not None else self._queue.get()
            carry = None
            if first is None:
                return
            requests = [first]
            samples = first.batch.batch_size
            until = time.monotonic() + self.max_queue_delay
            stop = False
            while samples < self.max_batch_size:
                remaining = until - time.monotonic()
                try:
                    if remaining > 0:
                        item = self._queue.get(timeout=remaining)
                    else:
                        item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                if samples + item.batch.batch_size > self.max_batch_size:
                    carry = item  # starts the next merged batch
                    break
                requests.append(item)
                samples += item.batch.batch_size
            self._run_batch(requests)
            if stop:
                return

    def _run_batch(self, requests: list[_Request]) -> None:
        now = time.monotonic()
        live = []
        for request in requests:
            if request.deadline is not None and now > request.deadline:
                request.future.set_exception(
                    DeadlineExceededError("the request's deadline passed while it was queued")
                )
            elif request.future.set_running_or_notify_cancel():
                live.append(request)
        expired = len(requests) - len(live)
        if expired:
            self._finished(expired)
        if not live:
            return
        try:
            merged = merge_batches([r.batch for r in live])
            predictions, context = self._run(merged)
        except BaseException as error:
            for request in live:
                request.future.set_exception(error)
            self._finished(len(live))
            return
        if self._on_batch:
            self._on_batch(merged.batch_size, now)
        offset = 0
        for request in live:
            size = request.batch.batch_size
            request.future.set_result(
                BatchOutcome(
                    predictions=predictions[offset : offset + size],
                    context=context,
                    queue_seconds=now - request.enqueued,
                    merged_batch_size=merged.batch_size,
                )
            )
            offset += size
        self._finished(len(live))

    def drain(self, timeout: float) -> bool:
        """Stop taking requests and wait up to ``timeout`` s for queued ones; True if idle."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def close(self) -> None:
        self._accepting = False
        self._queue.put(None)
        self._thread.join(timeout=10)
