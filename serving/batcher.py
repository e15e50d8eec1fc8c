"""Dynamic batching: concurrent requests are merged into one lookup + one model call.

Requests wait in a bounded queue; one dispatcher thread takes the oldest, keeps collecting
until ``max_batch_size`` samples or ``max_queue_delay`` seconds, drops requests whose deadline
passed, runs the merged batch and hands every request its slice. A full queue is refused at
once (UnavailableError -> 503 / UNAVAILABLE) instead of growing without bound.

A request whose caller gives up (its future is cancelled: a gRPC call cancelled or past its
deadline, a caller's wait that timed out) frees its place in the queue at once, not when the
dispatcher reaches it: under overload, requests nobody waits for would otherwise hold the
queue full and live ones would be refused. It stays in the queue as a marker the dispatcher
skips (never computed, never counted in a merged batch's samples); the markers are swept out
once there are more of them than ``max_queue_size``, so they cost O(1) amortized per request.

A merged batch of several requests that fails with an error one request's inputs can cause
(:func:`request_specific`: the model raised, or refused an input) is run again request by
request (:func:`run_one_by_one`): only the requests that fail alone get an error, the others
their answers as if each had been sent alone. A batch that succeeds costs nothing more.
"""

from __future__ import annotations

import logging
import operator
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from embedding_store.batch import (
    Batch,
    IDFeature,
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    NonIDTypeFeature,
)
from embedding_store.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    ModelInputError,
    RecserveError,
    UnavailableError,
    error_summary,
)

log = logging.getLogger(__name__)


_values_of = operator.attrgetter("values")
_lengths_of = operator.attrgetter("lengths")
_data_of = operator.attrgetter("data")


def _frozen(array: np.ndarray) -> np.ndarray:
    """``array`` (a fresh concatenation nobody else holds) marked read-only, so the merged
    features share it instead of copying it."""
    array.setflags(write=False)
    return array


def merge_batches(batches: Sequence[Batch]) -> Batch:
    """Concatenate inference batches that share one signature (same features, same order):
    the batch of all their samples, in order (``requires_grad=False``; labels, ``meta`` and
    ``batch_id`` are not carried).

    Built unchecked (Batch._trusted_inference): the batches are valid and of one signature,
    so the concatenations are too. Single-ID features of batches that record them as rows of
    one array (``Batch._single_id_rows``, what request decoding builds) are merged by one
    concatenation of those arrays, not one per feature: 20 batch-1 requests of 26 single-ID
    features are 20 arrays instead of 520.
    """
    if len(batches) == 1:
        return batches[0]
    first = batches[0]
    batch_size = sum(batch.batch_size for batch in batches)
    first_ids = first.id_type_features
    single = [type(feature) is IDTypeFeatureWithSingleID for feature in first_ids]
    matrices = [batch._single_id_rows for batch in batches]
    singles: list[IDTypeFeatureWithSingleID] = []
    merged_rows = None
    if any(single) and all(matrix is not None for matrix in matrices):
        # [n_single, batch_size]: row k is the k-th single-ID feature of the merged batch.
        # The all() above checked every matrix is not None (a check mypy cannot see through).
        merged_rows = _frozen(np.concatenate(cast("list[np.ndarray]", matrices), axis=1))
        names = [feature.name for feature, is_single in zip(first_ids, single) if is_single]
        singles = IDTypeFeatureWithSingleID.trusted_rows(names, merged_rows)
    id_features: list[IDFeature]
    if merged_rows is not None and all(single):
        id_features = singles  # type: ignore[assignment]
    else:
        id_features = []
        next_single = iter(singles)
        columns = zip(*[batch.id_type_features for batch in batches])
        for feature, is_single, column in zip(first_ids, single, columns):
            if is_single and merged_rows is not None:
                id_features.append(next(next_single))
                continue
            values = _frozen(np.concatenate(list(map(_values_of, column))))
            if is_single:
                id_features.append(IDTypeFeatureWithSingleID.trusted(feature.name, values))
            else:
                lengths = _frozen(np.concatenate(list(map(_lengths_of, column))))
                id_features.append(IDTypeFeature.trusted(feature.name, values, lengths))
    columns = zip(*[batch.non_id_type_features for batch in batches])
    # A Batch's non-ID features are all named (it names unnamed ones): name is a str here.
    non_ids = [
        NonIDTypeFeature.trusted(
            _frozen(np.concatenate(list(map(_data_of, column)))), cast(str, feature.name)
        )
        for feature, column in zip(first.non_id_type_features, columns)
    ]
    return Batch._trusted_inference(id_features, non_ids, batch_size, merged_rows)


#: A cancel within this many seconds of a request's deadline is its deadline passing, not its
#: caller leaving: gRPC ends a call at the client's deadline a hair before the server's own
#: wait for it runs out.
DEADLINE_SLACK_SECONDS = 0.005

#: Why a request was dropped before its merged batch ran (``on_drop``'s argument).
DROP_REASONS = ("cancelled", "deadline")

# States of a queued request (_Request.state), changed under DynamicBatcher._lock.
_QUEUED = 0  # in the queue, holding a place
_DROPPED = 1  # still in the queue, but given up: its place is free, the dispatcher skips it
_TAKEN = 2  # taken out by the dispatcher (or by a stop that fails it)


def drop_reason(deadline: float | None, now: float) -> str:
    """``"deadline"`` when a request given up at ``now`` gave up at its deadline, else
    ``"cancelled"`` (its caller went away)."""
    if deadline is not None and now >= deadline - DEADLINE_SLACK_SECONDS:
        return "deadline"
    return "cancelled"


class _Request(Future):
    """A queued request and the future of its :class:`BatchOutcome` in one object: cancelling
    it while it is queued frees its place (no callback, no reference cycle per request)."""

    def __init__(
        self, batcher: DynamicBatcher, batch: Batch, deadline: float | None, enqueued: float
    ) -> None:
        super().__init__()
        self.batcher: DynamicBatcher | None = batcher
        self.batch = batch
        self.deadline = deadline
        self.enqueued = enqueued
        self.state = _QUEUED

    @property
    def future(self) -> Future:
        return self

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        batcher = self.batcher
        if batcher is not None:
            batcher._dropped(self)
        return True


@dataclass(frozen=True)
class BatchOutcome:
    """What the dispatcher hands each request: its rows of the merged predictions, which
    start at row ``offset`` of the merged batch (0 for a request run alone)."""

    predictions: np.ndarray
    context: Any  # whatever ``run`` returned besides predictions (model version, counts)
    queue_seconds: float
    merged_batch_size: int
    offset: int = 0


def deliver_outcomes(
    requests: Sequence[Any],
    predictions: np.ndarray,
    context: Any,
    merged_batch_size: int,
    started: float,
) -> None:
    """Hand each request (``.batch``, ``.future``, ``.enqueued``) its rows of ``predictions``
    [merged_batch_size, k], in order, as a :class:`BatchOutcome`; a request whose future is
    already done (cancelled, given up) is skipped but keeps its rows."""
    offset = 0
    for request in requests:
        size = request.batch.batch_size
        if not request.future.done():
            request.future.set_result(
                BatchOutcome(
                    predictions=predictions[offset : offset + size],
                    context=context,
                    queue_seconds=started - request.enqueued,
                    merged_batch_size=merged_batch_size,
                    offset=offset,
                )
            )
        offset += size


def request_specific(error: BaseException) -> bool:
    """Whether ``error``, raised by a merged batch, may be the fault of some of its requests
    only, so that running them one by one answers the others (:func:`run_one_by_one`).

    Yes for an input refused (InvalidArgumentError, e.g. a ModelInputError: the dense model
    indexed out of range) and for whatever else the model or the code around it raised
    (RuntimeError, IndexError, torch.jit.Error, ...: a model that raises on some inputs).
    No for the state of the server or its peers, which running alone does not change and
    every request would fail again, one call each: the embedding tier down or slow
    (UnavailableError, DeadlineExceededError), any other recserve error (a malformed peer
    answer, a capacity, a precondition), OSError (the network, files) and what is not an
    Exception (KeyboardInterrupt, SystemExit)."""
    if isinstance(error, RecserveError):
        return isinstance(error, InvalidArgumentError)
    return isinstance(error, Exception) and not isinstance(error, OSError)


#: What :func:`run_one_by_one` gives a request: ``run``'s (predictions, context) for it
#: alone, the error it is answered with, or None when nobody waits for it any more.
AloneOutcome = tuple[np.ndarray, Any] | BaseException | None


def run_one_by_one(
    requests: Sequence[Any],
    run: Callable[[Batch], tuple[np.ndarray, Any]],
    error: BaseException,
    *,
    stopping: Callable[[], bool] | None = None,
) -> list[AloneOutcome]:
    """Run each of ``requests`` (``.batch``, ``.future``, ``.deadline`` monotonic or None)
    alone, after their merged batch failed with ``error`` (:func:`request_specific`): one
    outcome per request, in order. Bounded: at most one call of ``run`` per request, none
    for a request whose future is done (its caller gave up), whose deadline passed
    (DeadlineExceededError) or when ``stopping()`` (UnavailableError: the server stops);
    once a call fails with an error that is not request-specific (the embedding tier went
    down meanwhile), the requests left get that error without a call. Each answer is
    exactly what the request would have got alone. Logs one line: what failed and how the
    requests fared (each failed request's own error is its answer; its traceback, if any,
    is logged where it is answered)."""
    outcomes: list[AloneOutcome] = []
    shared: BaseException | None = None  # a failure of the server, not of one request
    answered = failed = 0
    for request in requests:
        outcome: AloneOutcome
        if request.future.done():
            outcome = None
        elif shared is not None:
            outcome = shared
        elif stopping is not None and stopping():
            outcome = UnavailableError("the server stopped before this request's batch ran")
        elif request.deadline is not None and time.monotonic() > request.deadline:
            outcome = DeadlineExceededError(
                "the request's deadline passed while its merged batch, which failed, was run "
                "again request by request"
            )
        else:
            try:
                outcome = run(request.batch)
                answered += 1
            except BaseException as alone:  # its answer; nothing may end the batcher
                outcome = alone
                if request_specific(alone):
                    failed += 1
                else:
                    shared = alone
        outcomes.append(outcome)
    log.warning(
        "a merged batch of %d requests failed (%s): ran them one by one, so that one "
        "request's bad inputs fail that request only: %d failed alone, %d answered, %d not "
        "answered (gone, past their deadline, the server stopping or failing)",
        len(requests),
        # A ModelInputError's message is meant for one request: the model's own line here.
        error_summary((error.__cause__ or error) if isinstance(error, ModelInputError) else error),
        failed,
        answered,
        len(requests) - failed - answered,
    )
    return outcomes


def deliver_alone(
    requests: Sequence[Any],
    outcomes: Sequence[AloneOutcome],
    started: float,
    on_batch: Callable[[int, float], None] | None,
) -> None:
    """Answer ``requests`` with their :func:`run_one_by_one` outcomes: each computed one
    its rows as a :class:`BatchOutcome` of its own batch (``on_batch`` told of it, as of
    every batch run), each failed one its error; a request already done is skipped. An
    answer that cannot be given (``on_batch`` raised) is that request's error only."""
    for request, outcome in zip(requests, outcomes, strict=True):
        if outcome is None or request.future.done():
            continue
        if isinstance(outcome, BaseException):
            request.future.set_exception(outcome)
            continue
        predictions, context = outcome
        size = request.batch.batch_size
        try:
            if on_batch is not None:
                on_batch(size, started)
            deliver_outcomes([request], predictions, context, size, started)
        except Exception as error:
            log.exception("answering a request run alone failed")
            if not request.future.done():
                request.future.set_exception(error)


class DynamicBatcher:
    """Merges concurrent requests. ``run(merged) -> (predictions [n, k], context)``;
    ``on_batch(size, started)`` is told of every batch run, ``on_drop(reason)`` of every
    request dropped before its batch ran, ``on_split()`` of every merged batch that failed
    and was run again request by request (:func:`run_one_by_one`)."""

    def __init__(
        self,
        run: Callable[[Batch], tuple[np.ndarray, Any]],
        *,
        max_batch_size: int = 256,
        max_queue_delay: float = 0.002,
        max_queue_size: int = 1024,
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
        self._on_split = on_split
        # Unbounded: the bound is _queued (requests holding a place), which a request given
        # up leaves at once while its marker stays in here until skipped or swept.
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._queued = 0  # requests in _queue that hold a place
        self._markers = 0  # requests in _queue given up (_DROPPED)
        self._on_batch = on_batch
        self._on_drop = on_drop
        self._accepting = True
        self._closing = False  # close() called: queued requests fail rather than run
        self._sentinel_sent = False  # the None that ends the dispatcher is queued
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
        request = _Request(self, batch, deadline, time.monotonic())
        with self._lock:
            if self._queued >= self.max_queue_size:
                raise UnavailableError(
                    f"overloaded: {self.max_queue_size} requests are already queued; retry later"
                )
            self._queued += 1
            self._in_flight += 1
        self._queue.put_nowait(request)
        if self._closing:
            # A stop's fail_queued() ran between the check above and the put: the request
            # may sit behind the sentinel that ended the dispatcher, where nothing would
            # answer it before its deadline. _closing is set before fail_queued() empties
            # the queue, so whichever of the two runs last finds and fails it.
            self._fail_queue_contents()
        return request.future

    def _finished(self, count: int) -> None:
        with self._lock:
            self._in_flight -= count
            if self._in_flight == 0:
                self._idle.notify_all()

    def _dropped(self, request: _Request) -> None:
        """``request`` was cancelled (its caller gave up): if it is still queued, its place is
        free now and it is done (``pending``, drain); the dispatcher will skip its marker."""
        with self._lock:
            if request.state != _QUEUED:
                return  # taken already: the dispatcher sees it cancelled and skips it
            request.state = _DROPPED
            request.batcher = None
            self._queued -= 1
            self._markers += 1
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.notify_all()
            if self._markers > self.max_queue_size:
                self._sweep_markers()
        if self._on_drop is not None:
            self._on_drop(drop_reason(request.deadline, time.monotonic()))

    def _sweep_markers(self) -> None:
        """Remove the markers of dropped requests from the queue (the caller holds _lock):
        run once they outnumber max_queue_size, so a flood of requests given up behind a
        slow batch cannot grow the queue without bound."""
        with self._queue.mutex:  # queue.Queue's own lock: no get or put meanwhile
            items = self._queue.queue
            kept = [item for item in items if item is None or item.state != _DROPPED]
            # A marker a get() just took is not in here: _take() still counts it out.
            self._markers -= len(items) - len(kept)
            items.clear()
            items.extend(kept)

    def _take(self, request: _Request) -> bool:
        """Take ``request`` out of the queue's count; False for a marker (skip it)."""
        with self._lock:
            if request.state == _DROPPED:
                self._markers -= 1
                return False
            request.state = _TAKEN
            self._queued -= 1
            return True

    def _loop(self) -> None:
        carry: _Request | None = None
        while True:
            first = carry if carry is not None else self._queue.get()
            if first is None:
                return
            if carry is None and not self._take(first):
                continue  # given up while queued: its place is free already
            carry = None
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
                if not self._take(item):
                    continue
                if samples + item.batch.batch_size > self.max_batch_size:
                    carry = item  # starts the next merged batch
                    break
                requests.append(item)
                samples += item.batch.batch_size
            self._run_batch(requests)
            if stop:
                return

    def _run_batch(self, requests: list[_Request]) -> None:
        """Run one merged batch and answer its requests. Never raises: whatever fails, the
        requests get the error and the dispatcher thread goes on with the next batch."""
        now = time.monotonic()
        live = []
        for request in requests:
            # A caller that gave up has cancelled its future: skip it. Claiming the others
            # (RUNNING) first means no later cancel() can race with the answers set below.
            if not request.future.set_running_or_notify_cancel():
                if self._on_drop is not None:
                    self._on_drop(drop_reason(request.deadline, now))
                continue
            if request.deadline is not None and now > request.deadline:
                request.future.set_exception(
                    DeadlineExceededError("the request's deadline passed while it was queued")
                )
                if self._on_drop is not None:
                    self._on_drop("deadline")
            else:
                live.append(request)
        if self._closing:  # the drain gave up on them: answer now rather than run late
            for request in live:
                request.future.set_exception(
                    UnavailableError("the server stopped before this request's batch ran")
                )
            live = []
        expired = len(requests) - len(live)
        if expired:
            self._finished(expired)
        if not live:
            return
        try:
            merged = merge_batches([r.batch for r in live])
            predictions, context = self._run(merged)
        except BaseException as error:  # each request's answer: the model's error, or its own
            try:
                if len(live) > 1 and request_specific(error):
                    self._run_one_by_one(live, error, now)
                else:
                    for request in live:
                        request.future.set_exception(error)
            finally:
                self._finished(len(live))
            return
        try:
            if self._on_batch:
                self._on_batch(merged.batch_size, now)
            deliver_outcomes(live, predictions, context, merged.batch_size, now)
        except BaseException as error:
            log.exception("dynamic batcher: answering a merged batch failed")
            for request in live:
                if not request.future.done():
                    request.future.set_exception(error)
        finally:
            self._finished(len(live))

    def _run_one_by_one(self, live: list[_Request], error: BaseException, now: float) -> None:
        """``live``'s merged batch failed with ``error``, which one of them may have caused:
        run and answer each alone (:func:`run_one_by_one`). Never raises."""
        try:
            if self._on_split is not None:
                self._on_split()
        except Exception:
            log.exception("dynamic batcher: counting a split batch failed")
        try:
            outcomes = run_one_by_one(live, self._run, error, stopping=lambda: self._closing)
            deliver_alone(live, outcomes, now, self._on_batch)
        except BaseException as failure:
            log.exception("dynamic batcher: running a failed batch's requests alone failed")
            for request in live:
                if not request.future.done():
                    request.future.set_exception(failure)

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

    def fail_queued(self) -> None:
        """Take no more requests and fail those still queued (UnavailableError) at once,
        without waiting: a stop whose drain gave up answers them before its front ends
        close, even while the dispatcher is stuck in a batch (which still finishes; the
        dispatcher then ends)."""
        self._accepting = False
        self._closing = True
        self._fail_queue_contents()

    def _fail_queue_contents(self) -> None:
        """Fail every request in the queue now (UnavailableError) and queue the sentinel
        again if it was taken out with them (it wakes or ends the dispatcher)."""
        failed = 0
        while True:
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                break
            if request is None:
                self._sentinel_sent = False  # taken out: queued again below
                continue
            if not self._take(request):
                continue  # given up while queued: counted done when it was
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(
                    UnavailableError("the server stopped before this request's batch ran")
                )
            failed += 1
        if failed:
            self._finished(failed)
        if not self._sentinel_sent:
            # Wakes the dispatcher out of its max_queue_delay wait: what it collected so far
            # fails at once (it sees _closing), rather than when the delay ends.
            self._queue.put_nowait(None)
            self._sentinel_sent = True

    def close(self, timeout: float = 10.0) -> None:
        """Stop: requests still queued (a drain that gave up) fail with UnavailableError;
        waits up to ``timeout`` s for the dispatcher (and the batch it runs) to end."""
        self.fail_queued()  # queues the sentinel (the queue has no bound to refuse it)
        self._thread.join(timeout=timeout)
