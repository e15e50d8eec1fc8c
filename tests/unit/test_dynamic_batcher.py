"""serving.batcher.DynamicBatcher: the dispatcher thread merges queued requests, answers each
with its rows, and outlives callers that give up (cancelled futures, passed deadlines) and
failures of any batch."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from embedding_store.batch import Batch, IDTypeFeatureWithSingleID
from embedding_store.errors import DeadlineExceededError, InvalidArgumentError, UnavailableError
from serving.batcher import DynamicBatcher

WAIT = 5.0  # seconds a test waits for an answer it expects


def batch_of(*ids: int) -> Batch:
    return Batch(
        [IDTypeFeatureWithSingleID("user", np.asarray(ids, dtype=np.uint64))],
        requires_grad=False,
    )


class SlowModel:
    """predictions [n, 1] = the IDs; each call waits until ``release`` is set (if given)."""

    def __init__(self, release: threading.Event | None = None) -> None:
        self.release = release
        self.started = threading.Event()
        self.calls: list[list[int]] = []

    def __call__(self, merged: Batch):
        self.started.set()
        if self.release is not None:
            assert self.release.wait(WAIT)
        ids = merged.id_feature("user").values
        if int(ids[0]) == 666:
            raise InvalidArgumentError("ID 666 is refused")
        self.calls.append(ids.tolist())
        return ids.astype(np.float32).reshape(-1, 1), "v1"


def answers(futures) -> list[list[float]]:
    return [f.result(WAIT).predictions[:, 0].tolist() for f in futures]


def test_requests_queued_while_a_batch_runs_are_merged_and_answered_in_order():
    release = threading.Event()
    model = SlowModel(release)
    batcher = DynamicBatcher(model, max_batch_size=8, max_queue_delay=0.0)
    try:
        first = batcher.submit(batch_of(1))
        assert model.started.wait(WAIT)
        queued = [batcher.submit(batch_of(2, 3)), batcher.submit(batch_of(4))]
        release.set()
        assert answers([first, *queued]) == [[1.0], [2.0, 3.0], [4.0]]
        assert model.calls == [[1], [2, 3, 4]]
        assert queued[0].result().merged_batch_size == 3
        assert batcher.pending == 0
    finally:
        batcher.close()


def test_a_request_that_does_not_fit_starts_the_next_merged_batch():
    release = threading.Event()
    model = SlowModel(release)
    batcher = DynamicBatcher(model, max_batch_size=3, max_queue_delay=0.0)
    try:
        first = batcher.submit(batch_of(1))
        assert model.started.wait(WAIT)
        queued = [batcher.submit(batch_of(2, 3)), batcher.submit(batch_of(4, 5))]
        queued.append(batcher.submit(batch_of(6)))
        release.set()
        # 2 + 2 > 3: (4, 5) waits for the next batch, which (6) then fills to exactly 3.
        assert answers([first, *queued]) == [[1.0], [2.0, 3.0], [4.0, 5.0], [6.0]]
        assert model.calls == [[1], [2, 3], [4, 5, 6]]
        assert [f.result().merged_batch_size for f in queued] == [2, 3, 3]
        assert batcher.pending == 0
    finally:
        batcher.close()


def test_cancelled_and_expired_requests_are_skipped_and_the_dispatcher_goes_on():
    release = threading.Event()
    model = SlowModel(release)
    batcher = DynamicBatcher(model, max_batch_size=8, max_queue_delay=0.0)
    try:
        busy = batcher.submit(batch_of(1))
        assert model.started.wait(WAIT)
        # Both wait behind the running batch; one caller gives up (what a timed-out request
        # does), the other's deadline passes, and this one was also cancelled after expiry.
        gave_up = batcher.submit(batch_of(2))
        expired = batcher.submit(batch_of(3), deadline=time.monotonic() + 0.01)
        expired_and_cancelled = batcher.submit(batch_of(4), deadline=time.monotonic() + 0.01)
        assert gave_up.cancel() and expired_and_cancelled.cancel()
        time.sleep(0.05)
        release.set()
        assert answers([busy]) == [[1.0]]
        with pytest.raises(DeadlineExceededError, match="deadline passed while it was queued"):
            expired.result(WAIT)
        assert answers([batcher.submit(batch_of(5))]) == [[5.0]]
        assert model.calls == [[1], [5]]
        assert batcher.pending == 0
    finally:
        batcher.close()


def test_a_failed_batch_fails_its_requests_and_the_next_batch_runs():
    batcher = DynamicBatcher(SlowModel(), max_batch_size=8, max_queue_delay=0.0)
    try:
        with pytest.raises(InvalidArgumentError, match="ID 666 is refused"):
            batcher.submit(batch_of(666)).result(WAIT)
        assert answers([batcher.submit(batch_of(7))]) == [[7.0]]
    finally:
        batcher.close()


def test_a_failure_after_the_model_ran_fails_the_batch_not_the_thread():
    calls = []

    def broken_on_batch(size: int, started: float) -> None:
        calls.append(size)
        if len(calls) == 1:
            raise RuntimeError("metrics backend broke")

    batcher = DynamicBatcher(
        SlowModel(), max_batch_size=8, max_queue_delay=0.0, on_batch=broken_on_batch
    )
    try:
        with pytest.raises(RuntimeError, match="metrics backend broke"):
            batcher.submit(batch_of(1)).result(WAIT)
        assert answers([batcher.submit(batch_of(2))]) == [[2.0]]
        assert batcher.pending == 0  # nothing left counted in flight: drain can finish
        assert batcher.drain(timeout=1.0)
    finally:
        batcher.close()


def test_a_full_queue_refuses_at_once_and_drain_refuses_new_requests():
    release = threading.Event()
    model = SlowModel(release)
    batcher = DynamicBatcher(model, max_batch_size=1, max_queue_delay=0.0, max_queue_size=1)
    try:
        running = batcher.submit(batch_of(1))
        assert model.started.wait(WAIT)
        queued = batcher.submit(batch_of(2))
        with pytest.raises(UnavailableError, match="overloaded: 1 requests are already queued"):
            batcher.submit(batch_of(3))
        release.set()
        assert batcher.drain(timeout=WAIT)
        assert answers([running, queued]) == [[1.0], [2.0]]
        with pytest.raises(UnavailableError, match="shutting down"):
            batcher.submit(batch_of(4))
    finally:
        batcher.close()


@pytest.mark.parametrize(
    "limits",
    [{"max_batch_size": 0}, {"max_queue_size": 0}, {"max_queue_delay": -0.001}],
)
def test_limits_below_their_minimum_are_refused(limits: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be >= 1, delay >= 0"):
        DynamicBatcher(SlowModel(), **limits)


def test_a_batch_that_fills_max_batch_size_runs_without_waiting_for_the_delay() -> None:
    """Collecting stops at max_batch_size samples: a full batch never waits out
    max_queue_delay (here far longer than the test waits)."""
    model = SlowModel()
    batcher = DynamicBatcher(model, max_batch_size=2, max_queue_delay=60.0, max_queue_size=1)
    try:
        assert answers([batcher.submit(batch_of(1, 2))]) == [[1.0, 2.0]]
        assert model.calls == [[1, 2]]
    finally:
        batcher.close()


def test_a_failed_batch_leaves_nothing_pending_so_drain_finishes() -> None:
    batcher = DynamicBatcher(SlowModel(), max_batch_size=8, max_queue_delay=0.0)
    try:
        with pytest.raises(InvalidArgumentError, match="ID 666 is refused"):
            batcher.submit(batch_of(666)).result(WAIT)
        assert batcher.pending == 0
        assert batcher.drain(timeout=1.0)
    finally:
        batcher.close()


class _Clock:
    """Stands in for ``time`` in serving.batcher: monotonic() always returns ``now``."""

    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


def test_a_deadline_equal_to_the_batch_start_still_runs(monkeypatch) -> None:
    monkeypatch.setattr("serving.batcher.time", _Clock(100.0))
    model = SlowModel()
    batcher = DynamicBatcher(model, max_batch_size=8, max_queue_delay=0.0)
    try:
        assert answers([batcher.submit(batch_of(1), deadline=100.0)]) == [[1.0]]
        with pytest.raises(DeadlineExceededError):
            batcher.submit(batch_of(2), deadline=99.999).result(WAIT)
        assert model.calls == [[1]]
    finally:
        batcher.close()


def test_close_fails_requests_still_queued_instead_of_running_them() -> None:
    """After a drain that gave up, close() answers the queued requests with
    UnavailableError rather than running them late (the model is about to close)."""
    release = threading.Event()
    model = SlowModel(release)
    batcher = DynamicBatcher(model, max_batch_size=1, max_queue_delay=0.0)
    running = batcher.submit(batch_of(1))
    assert model.started.wait(WAIT)
    queued = batcher.submit(batch_of(2))
    batcher.close(timeout=0.05)  # the dispatcher is stuck in the running batch
    release.set()
    assert answers([running]) == [[1.0]]
    with pytest.raises(UnavailableError, match="the server stopped before this request's batch"):
        queued.result(WAIT)
    assert model.calls == [[1]]
    assert batcher.pending == 0


def test_requests_arriving_within_the_delay_are_merged() -> None:
    """The dispatcher waits up to max_queue_delay (here far longer than the test) for more
    requests after the first; the batch runs once max_batch_size samples are in."""
    model = SlowModel()
    batcher = DynamicBatcher(model, max_batch_size=3, max_queue_delay=60.0)
    try:
        first = batcher.submit(batch_of(1))
        deadline = time.monotonic() + WAIT
        while not batcher._queue.empty():  # until the dispatcher took it and waits for more
            assert time.monotonic() < deadline
            time.sleep(0.001)
        second = batcher.submit(batch_of(2, 3))
        assert answers([first, second]) == [[1.0], [2.0, 3.0]]
        assert model.calls == [[1, 2, 3]]
    finally:
        batcher.close()


def test_close_ends_a_dispatcher_that_is_collecting_a_batch() -> None:
    """close() while the dispatcher waits out max_queue_delay for more requests: the batch
    it holds fails (UnavailableError) and the dispatcher thread ends."""
    model = SlowModel()
    batcher = DynamicBatcher(model, max_batch_size=8, max_queue_delay=60.0)
    waiting = batcher.submit(batch_of(1))
    batcher.close(timeout=WAIT)
    assert not batcher._thread.is_alive()
    with pytest.raises(UnavailableError, match="the server stopped"):
        waiting.result(WAIT)
    assert model.calls == []


def test_fail_queued_answers_requests_queued_behind_a_stuck_batch_at_once() -> None:
    """A stop out of grace while a batch is stuck (a stalled embedding tier): the requests
    queued behind it are refused now, not once that batch ends; it still gets its answer."""
    release = threading.Event()
    model = SlowModel(release)
    batcher = DynamicBatcher(model, max_batch_size=1, max_queue_delay=0.0)
    try:
        running = batcher.submit(batch_of(1))
        assert model.started.wait(WAIT)
        queued = [batcher.submit(batch_of(2)), batcher.submit(batch_of(3))]
        assert batcher.pending == 3
        batcher.fail_queued()
        for future in queued:
            with pytest.raises(UnavailableError, match="stopped before this request's batch ran"):
                future.result(timeout=0)  # answered already: the stuck batch still runs
        assert batcher.pending == 1 and not running.done()
        with pytest.raises(UnavailableError, match="shutting down"):
            batcher.submit(batch_of(4))
        release.set()
        assert answers([running]) == [[1.0]]
        assert batcher.drain(WAIT)
        assert model.calls == [[1]]
    finally:
        release.set()
        batcher.close(timeout=WAIT)


def test_a_request_queued_as_a_stop_fails_it_is_answered_not_left_behind_the_sentinel() -> None:
    """A submit that passed its accepting check just before a stop's fail_queued() and
    queues after it: its request lands behind the None that ends the dispatcher, where
    nothing would answer it; it is refused (UnavailableError) at once instead, and the
    dispatcher still ends once the batch it runs is done."""
    release = threading.Event()
    model = SlowModel(release)
    batcher = DynamicBatcher(model, max_batch_size=1, max_queue_delay=0.0)
    try:
        running = batcher.submit(batch_of(1))
        assert model.started.wait(WAIT)
        put_nowait = batcher._queue.put_nowait

        def stop_first(item):  # the stop runs between submit's check and its put
            if item is not None:
                batcher.fail_queued()
            put_nowait(item)

        batcher._queue.put_nowait = stop_first  # type: ignore[method-assign]
        late = batcher.submit(batch_of(7))
        with pytest.raises(UnavailableError, match="stopped before this request's batch ran"):
            late.result(timeout=0)
        assert batcher.pending == 1
        release.set()
        assert answers([running]) == [[1.0]]
        batcher._thread.join(WAIT)
        assert not batcher._thread.is_alive()
        assert batcher.pending == 0 and model.calls == [[1]]
    finally:
        release.set()
        batcher.close(timeout=WAIT)


def test_fail_queued_twice_skips_a_request_given_up_and_still_ends_the_dispatcher() -> None:
    """Behind a stuck batch: a queued request its caller gave up (cancelled) stays
    cancelled and is counted done; a second fail_queued (the stop's close() after it)
    takes the sentinel out and queues it again, so the dispatcher ends after the batch."""
    release = threading.Event()
    model = SlowModel(release)
    batcher = DynamicBatcher(model, max_batch_size=1, max_queue_delay=0.0)
    try:
        running = batcher.submit(batch_of(1))
        assert model.started.wait(WAIT)
        gone, queued = batcher.submit(batch_of(2)), batcher.submit(batch_of(3))
        assert gone.cancel()
        batcher.fail_queued()
        assert gone.cancelled()
        with pytest.raises(UnavailableError, match="stopped before this request's batch ran"):
            queued.result(timeout=0)
        assert batcher.pending == 1
        batcher.fail_queued()
        release.set()
        assert answers([running]) == [[1.0]]
        batcher._thread.join(WAIT)
        assert not batcher._thread.is_alive()
        assert batcher.pending == 0 and model.calls == [[1]]
    finally:
        release.set()
        batcher.close(timeout=WAIT)


def test_a_request_given_up_while_queued_frees_its_place_at_once() -> None:
    """Behind a stuck batch, with room for one queued request: the queued one is cancelled
    (its gRPC call was, or its caller's wait timed out), so a live request is taken at once
    instead of refused as overload; the cancelled one is never computed nor counted in the
    merged batch, and pending counts only what is still wanted."""
    release = threading.Event()
    model = SlowModel(release)
    drops: list[str] = []
    batcher = DynamicBatcher(
        model, max_batch_size=2, max_queue_delay=0.0, max_queue_size=1, on_drop=drops.append
    )
    try:
        running = batcher.submit(batch_of(1))
        assert model.started.wait(WAIT)
        gone = batcher.submit(batch_of(2, 3))
        assert gone.cancel()
        assert batcher.pending == 1 and drops == ["cancelled"]
        live = batcher.submit(batch_of(4))  # was: UnavailableError, 1 request already queued
        with pytest.raises(UnavailableError, match="overloaded: 1 requests are already queued"):
            batcher.submit(batch_of(5))  # the live one holds the place
        release.set()
        assert answers([running, live]) == [[1.0], [4.0]]
        assert model.calls == [[1], [4]]
        assert live.result().merged_batch_size == 1
        assert drops == ["cancelled"] and batcher.pending == 0
    finally:
        release.set()
        batcher.close()


def test_requests_given_up_at_their_deadline_are_dropped_as_such_and_their_markers_swept():
    """A flood of requests given up behind a stuck batch leaves at most max_queue_size
    markers in the queue (they are swept), each counted once: at its deadline as
    ``deadline``, before it as ``cancelled``."""
    release = threading.Event()
    model = SlowModel(release)
    drops: list[str] = []
    batcher = DynamicBatcher(
        model, max_batch_size=8, max_queue_delay=0.0, max_queue_size=2, on_drop=drops.append
    )
    try:
        running = batcher.submit(batch_of(1))
        assert model.started.wait(WAIT)
        for i in range(10):
            batcher.submit(batch_of(100 + i), deadline=time.monotonic() - 1).cancel()
            assert batcher._queue.qsize() <= 3
        batcher.submit(batch_of(200)).cancel()
        assert drops == ["deadline"] * 10 + ["cancelled"]
        later = batcher.submit(batch_of(7))
        release.set()
        assert answers([running, later]) == [[1.0], [7.0]]
        assert model.calls == [[1], [7]]
        assert len(drops) == 11 and batcher.pending == 0
    finally:
        release.set()
        batcher.close()


class BreaksOn:
    """predictions [n, 1] = the IDs, unless the batch holds an ID of ``failures``: then the
    error of the first such ID (in batch order) is raised. Records every call, failed or
    not; the first call waits until ``release`` is set (if given)."""

    def __init__(
        self, failures: dict[int, BaseException], release: threading.Event | None = None
    ) -> None:
        self.failures = failures
        self.release = release
        self.started = threading.Event()
        self.calls: list[list[int]] = []

    def __call__(self, merged: Batch):
        self.started.set()
        if self.release is not None:
            assert self.release.wait(WAIT)
            self.release = None
        ids = merged.id_feature("user").values.tolist()
        self.calls.append(ids)
        for value in ids:
            if value in self.failures:
                raise self.failures[value]
        return np.asarray(ids, np.float32).reshape(-1, 1), f"alone {ids}"


def _merged_behind_a_running_batch(model: BreaksOn, batcher: DynamicBatcher, *batches: Batch):
    """Submit ``batch_of(1)``, then ``batches`` while it runs (so they merge into one batch
    once ``model.release`` is set); returns the futures of ``batches``."""
    first = batcher.submit(batch_of(1))
    assert model.started.wait(WAIT)
    queued = [batcher.submit(batch) for batch in batches]
    assert model.release is not None
    model.release.set()
    assert answers([first]) == [[1.0]]
    return queued


def test_a_merged_batch_that_fails_runs_its_requests_alone_so_only_the_bad_one_fails(caplog):
    model = BreaksOn({666: RuntimeError("ID 666 breaks the model")}, threading.Event())
    splits: list[int] = []
    sizes: list[int] = []
    batcher = DynamicBatcher(
        model,
        max_batch_size=8,
        max_queue_delay=0.0,
        on_batch=lambda size, started: sizes.append(size),
        on_split=lambda: splits.append(1),
    )
    try:
        good, bad, other = _merged_behind_a_running_batch(
            model, batcher, batch_of(2, 3), batch_of(666), batch_of(4)
        )
        assert answers([good, other]) == [[2.0, 3.0], [4.0]]
        with pytest.raises(RuntimeError, match=r"^ID 666 breaks the model$"):
            bad.result(WAIT)
        assert model.calls == [[1], [2, 3, 666, 4], [2, 3], [666], [4]]
        # Each answer is the request's own run: its context, its batch size.
        assert [good.result().context, other.result().context] == ["alone [2, 3]", "alone [4]"]
        assert [good.result().merged_batch_size, other.result().merged_batch_size] == [2, 1]
        assert splits == [1]
        assert sizes == [1, 2, 1]  # every batch the model answered
        assert [r.getMessage() for r in caplog.records if r.name == "serving.batcher"] == [
            "a merged batch of 3 requests failed (RuntimeError: ID 666 breaks the model): ran "
            "them one by one, so that one request's bad inputs fail that request only: 1 "
            "failed alone, 2 answered, 0 not answered (gone, past their deadline, the server "
            "stopping or failing)"
        ]
        # A request alone is not run again: its error is its answer.
        with pytest.raises(RuntimeError, match=r"^ID 666 breaks the model$"):
            batcher.submit(batch_of(666)).result(WAIT)
        assert model.calls[5:] == [[666]]
        assert splits == [1]
        assert batcher.pending == 0
    finally:
        batcher.close()


def test_a_merged_batch_failing_for_the_server_s_state_is_not_run_again():
    """An embedding tier that is down fails each request alone too: every request gets the
    merged batch's error, from its one call."""
    down = UnavailableError("embedding shard 0 is down")
    model = BreaksOn({666: down}, threading.Event())
    splits: list[int] = []
    batcher = DynamicBatcher(
        model, max_batch_size=8, max_queue_delay=0.0, on_split=lambda: splits.append(1)
    )
    try:
        queued = _merged_behind_a_running_batch(model, batcher, batch_of(2), batch_of(666))
        for future in queued:
            with pytest.raises(UnavailableError, match=r"^embedding shard 0 is down$"):
                future.result(WAIT)
        assert model.calls == [[1], [2, 666]]
        assert splits == []
    finally:
        batcher.close()


def test_requests_run_alone_honour_their_deadline_and_a_server_failure_ends_the_split(
    monkeypatch,
) -> None:
    """While the requests of a failed batch run alone: one whose deadline passed meanwhile
    is answered DeadlineExceededError without a call; once one fails for the server's state
    (the tier went down), the rest get that error without a call."""
    clock = _Clock(100.0)
    monkeypatch.setattr("serving.batcher.time", clock)
    down = UnavailableError("embedding shard 0 is down")

    class Slow(BreaksOn):
        def __call__(self, merged: Batch):
            try:
                return super().__call__(merged)
            finally:
                if self.calls[-1] == [666]:
                    clock.now += 10.0  # 666 alone takes 10 s

    model = Slow({666: RuntimeError("ID 666 breaks the model"), 7: down}, threading.Event())
    batcher = DynamicBatcher(model, max_batch_size=8, max_queue_delay=0.0)
    try:
        first = batcher.submit(batch_of(1))
        assert model.started.wait(WAIT)
        bad = batcher.submit(batch_of(666), deadline=200.0)
        late = batcher.submit(batch_of(5), deadline=105.0)  # past it after 666 ran alone
        failing = batcher.submit(batch_of(7), deadline=200.0)
        after = batcher.submit(batch_of(8), deadline=200.0)
        assert model.release is not None
        model.release.set()
        assert answers([first]) == [[1.0]]
        with pytest.raises(RuntimeError, match=r"^ID 666 breaks the model$"):
            bad.result(WAIT)
        with pytest.raises(DeadlineExceededError, match="run again request by request"):
            late.result(WAIT)
        for future in (failing, after):
            with pytest.raises(UnavailableError, match=r"^embedding shard 0 is down$"):
                future.result(WAIT)
        assert model.calls == [[1], [666, 5, 7, 8], [666], [7]]
    finally:
        batcher.close()
