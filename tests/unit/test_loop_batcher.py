"""serving.loop_batcher.LoopBatcher: requests submitted on one event loop are merged and run
there, split at max_batch_size, with deadlines, a bounded queue and errors for every request
of a failed batch."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from embedding_store.batch import Batch, IDTypeFeatureWithSingleID
from embedding_store.errors import DeadlineExceededError, UnavailableError
from serving.loop_batcher import LoopBatcher

FAR = 1e9  # a deadline that never passes in these tests


def batch_of(*ids: int) -> Batch:
    return Batch(
        [IDTypeFeatureWithSingleID("user", np.asarray(ids, dtype=np.uint64))],
        requires_grad=False,
    )


class Model:
    """run(merged) -> predictions [n, 1] = the IDs as float32; records every merged batch."""

    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[list[int]] = []
        self.error = error
        self.thread_ids: set[int] = set()

    def __call__(self, merged: Batch):
        self.thread_ids.add(threading.get_ident())
        if self.error is not None:
            raise self.error
        ids = merged.id_feature("user").values
        self.calls.append(ids.tolist())
        return ids.astype(np.float32).reshape(-1, 1), "context"


def make(run, **options) -> LoopBatcher:
    """A batcher of ``run`` (a Model or any function of a merged batch): 64 samples, no delay,
    16 queued, unless ``options`` (those of LoopBatcher, ``on_batch`` say) say otherwise."""
    settings = {"max_batch_size": 64, "max_queue_delay": 0.0, "max_queue_size": 16}
    settings.update(options)
    return LoopBatcher(run, run_lock=threading.Lock(), **settings)


def test_requests_of_one_loop_iteration_run_as_one_batch_on_the_loop() -> None:
    model = Model()
    batcher = make(model)

    async def main():
        futures = [batcher.submit(batch_of(i, i + 10), deadline=FAR) for i in range(3)]
        assert batcher.pending == 3
        return await asyncio.gather(*futures)

    outcomes = asyncio.run(main())
    assert model.calls == [[0, 10, 1, 11, 2, 12]]
    assert [o.predictions.ravel().tolist() for o in outcomes] == [[0, 10], [1, 11], [2, 12]]
    assert {o.merged_batch_size for o in outcomes} == {6}
    assert {o.context for o in outcomes} == {"context"}
    assert model.thread_ids == {threading.get_ident()}  # no other thread involved
    assert batcher.pending == 0


def test_a_delay_merges_requests_that_arrive_within_it() -> None:
    model = Model()
    batcher = make(model, max_queue_delay=0.05)

    async def main():
        first = batcher.submit(batch_of(1), deadline=FAR)
        await asyncio.sleep(0.01)  # the loop runs meanwhile
        second = batcher.submit(batch_of(2), deadline=FAR)
        return await asyncio.gather(first, second)

    asyncio.run(main())
    assert model.calls == [[1, 2]]


def test_max_batch_size_splits_and_flushes_at_once() -> None:
    model = Model()
    batcher = make(model, max_batch_size=4, max_queue_delay=10.0)  # only the size flushes

    async def main():
        futures = [batcher.submit(batch_of(i, i, i), deadline=FAR) for i in range(3)]
        return await asyncio.wait_for(asyncio.gather(*futures), timeout=5)

    outcomes = asyncio.run(main())
    # 3 + 3 > 4: every merged batch holds at most 4 samples, in arrival order.
    assert model.calls == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    assert [o.predictions.ravel().tolist() for o in outcomes] == [[0] * 3, [1] * 3, [2] * 3]


def test_requests_that_fill_max_batch_size_exactly_run_at_once_as_one_batch() -> None:
    model = Model()
    batcher = make(model, max_batch_size=4, max_queue_delay=10.0)  # only the size flushes

    async def main():
        futures = [batcher.submit(batch_of(i, i), deadline=FAR) for i in range(2)]
        return await asyncio.wait_for(asyncio.gather(*futures), timeout=2)

    outcomes = asyncio.run(main())
    assert model.calls == [[0, 0, 1, 1]]
    assert [o.predictions.ravel().tolist() for o in outcomes] == [[0, 0], [1, 1]]
    assert {o.merged_batch_size for o in outcomes} == {4}


def test_a_request_given_up_before_its_batch_runs_is_not_computed() -> None:
    model = Model()
    batcher = make(model)

    async def main():
        gave_up = batcher.submit(batch_of(7), deadline=FAR)
        fine = batcher.submit(batch_of(8), deadline=FAR)
        gave_up.cancel()  # its handler went away (client gone) before the flush
        return await fine

    outcome = asyncio.run(main())
    assert outcome.predictions.ravel().tolist() == [8.0]
    assert model.calls == [[8]]


def test_expired_requests_get_deadline_exceeded_and_are_not_computed() -> None:
    model = Model()
    batcher = make(model)

    async def main():
        late = batcher.submit(batch_of(7), deadline=time.monotonic() - 1)
        fine = batcher.submit(batch_of(8), deadline=FAR)
        results = await asyncio.gather(late, fine, return_exceptions=True)
        return results

    late, fine = asyncio.run(main())
    assert isinstance(late, DeadlineExceededError)
    assert fine.predictions.ravel().tolist() == [8.0]
    assert model.calls == [[8]]


def test_a_full_queue_refuses_at_once() -> None:
    batcher = make(Model(), max_queue_size=2)

    async def main():
        futures = [batcher.submit(batch_of(i), deadline=FAR) for i in range(2)]
        with pytest.raises(UnavailableError, match="overloaded: 2 requests are already queued"):
            batcher.submit(batch_of(9), deadline=FAR)
        await asyncio.gather(*futures)

    asyncio.run(main())


def test_a_failed_batch_fails_every_request_in_it() -> None:
    batcher = make(Model(error=UnavailableError("embedding tier down")))

    async def main():
        futures = [batcher.submit(batch_of(i), deadline=FAR) for i in range(2)]
        return await asyncio.gather(*futures, return_exceptions=True)

    errors = asyncio.run(main())
    assert [e.message for e in errors] == ["embedding tier down"] * 2
    assert batcher.pending == 0


def test_the_model_lock_is_held_while_the_batch_runs() -> None:
    lock = threading.Lock()
    held: list[bool] = []

    def run(merged: Batch):
        held.append(lock.locked())
        return np.zeros((merged.batch_size, 1), np.float32), None

    batcher = LoopBatcher(run, max_batch_size=8, max_queue_delay=0, max_queue_size=8, run_lock=lock)

    async def main():
        await batcher.submit(batch_of(1), deadline=FAR)

    asyncio.run(main())
    assert held == [True] and not lock.locked()


@pytest.mark.parametrize(
    "limits",
    [
        {"max_batch_size": 0},
        {"max_queue_size": 0},
        {"max_queue_delay": -0.001},
    ],
)
def test_limits_below_their_minimum_are_refused(limits: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be >= 1, delay >= 0"):
        make(Model(), **limits)


def test_the_smallest_limits_are_accepted() -> None:
    batcher = make(Model(), max_batch_size=1, max_queue_size=1, max_queue_delay=0.0)

    async def main():
        return await batcher.submit(batch_of(3), deadline=FAR)

    assert asyncio.run(main()).predictions.ravel().tolist() == [3.0]


class _Clock:
    """Stands in for ``time`` in serving.loop_batcher: monotonic() returns ``now``."""

    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


def test_deadlines_and_queue_time_are_measured_at_the_flush(monkeypatch) -> None:
    """A request is refused only once the flush comes after its deadline (a deadline equal
    to the flush time still runs), and each answer's queue_seconds is flush time minus its
    own arrival time."""
    clock = _Clock(100.0)
    monkeypatch.setattr("serving.loop_batcher.time", clock)
    model = Model()
    batcher = make(model)

    async def main():
        early = batcher.submit(batch_of(1), deadline=100.2)
        clock.now = 100.1
        exact = batcher.submit(batch_of(2), deadline=100.25)
        late = batcher.submit(batch_of(3), deadline=100.2499)
        clock.now = 100.25  # the flush runs now
        return await asyncio.gather(early, exact, late, return_exceptions=True)

    early, exact, late = asyncio.run(main())
    assert isinstance(early, DeadlineExceededError)
    assert isinstance(late, DeadlineExceededError)
    assert exact.predictions.ravel().tolist() == [2.0]
    assert exact.queue_seconds == pytest.approx(0.15, abs=1e-9)
    assert model.calls == [[2]]


def test_the_batch_size_reported_is_samples_not_requests() -> None:
    seen: list[tuple[int, float]] = []
    batcher = make(Model(), on_batch=lambda size, started: seen.append((size, started)))

    async def main():
        futures = [batcher.submit(batch_of(1, 2), deadline=FAR)]
        futures.append(batcher.submit(batch_of(3, 4, 5), deadline=FAR))
        return await asyncio.gather(*futures)

    outcomes = asyncio.run(main())
    assert [size for size, _ in seen] == [5]
    assert {o.merged_batch_size for o in outcomes} == {5}


def test_pending_counts_only_the_requests_being_computed() -> None:
    """While a merged batch runs, ``pending`` (what drain waits for) counts its live
    requests, not the cancelled or expired ones dropped from it."""
    seen: list[int] = []

    def run(merged: Batch):
        seen.append(batcher.pending)
        return np.zeros((merged.batch_size, 1), np.float32), None

    batcher = make(run)

    async def main():
        gone = batcher.submit(batch_of(1), deadline=FAR)
        expired = batcher.submit(batch_of(2), deadline=time.monotonic() - 1)
        live = [batcher.submit(batch_of(i), deadline=FAR) for i in (3, 4)]
        gone.cancel()
        await asyncio.gather(expired, *live, return_exceptions=True)

    asyncio.run(main())
    assert seen == [2]
    assert batcher.pending == 0


def test_a_failed_batch_does_not_stop_the_other_batches_of_its_flush() -> None:
    """The flush splits its requests into merged batches; one that fails answers its own
    requests with the error and the next ones still run (and only they are reported)."""
    sizes: list[int] = []

    def run(merged: Batch):
        ids = merged.id_feature("user").values
        if int(ids[0]) == 666:
            raise UnavailableError("ID 666 is refused")
        return ids.astype(np.float32).reshape(-1, 1), None

    batcher = make(run, max_batch_size=1, on_batch=lambda size, started: sizes.append(size))

    async def main():
        futures = [batcher.submit(batch_of(i), deadline=FAR) for i in (666, 1, 2)]
        return await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 5)

    refused, first, second = asyncio.run(main())
    assert isinstance(refused, UnavailableError) and refused.message == "ID 666 is refused"
    assert first.predictions.ravel().tolist() == [1.0]
    assert second.predictions.ravel().tolist() == [2.0]
    assert sizes == [1, 1]


def test_the_batcher_flushes_again_after_its_first_batch() -> None:
    model = Model()
    batcher = make(model, max_queue_delay=0.001)

    async def main():
        first = await batcher.submit(batch_of(1), deadline=FAR)
        second = await asyncio.wait_for(batcher.submit(batch_of(2), deadline=FAR), 5)
        return first, second

    first, second = asyncio.run(main())
    assert first.predictions.ravel().tolist() == [1.0]
    assert model.calls == [[1], [2]]
    assert second.predictions.ravel().tolist() == [2.0]


def test_one_delay_timer_per_merged_batch_cancelled_by_a_size_flush() -> None:
    """The first request of a batch starts the delay timer; later ones do not start another,
    and a flush because max_batch_size samples wait cancels it: a timer left behind would
    flush the next batch's requests before their delay."""
    model = Model()
    batcher = make(model, max_batch_size=3, max_queue_delay=10.0)
    timers: list[asyncio.TimerHandle] = []

    async def main():
        loop = asyncio.get_running_loop()
        call_later = loop.call_later

        def recording_call_later(delay, callback, *args, **kwargs):
            handle = call_later(delay, callback, *args, **kwargs)
            if callback == batcher._flush:  # not the deadline timer
                timers.append(handle)
            return handle

        loop.call_later = recording_call_later  # type: ignore[method-assign]
        futures = [batcher.submit(batch_of(i), deadline=FAR) for i in range(3)]
        loop.call_later = call_later  # type: ignore[method-assign]
        return await asyncio.wait_for(asyncio.gather(*futures), 5)

    asyncio.run(main())
    assert model.calls == [[0, 1, 2]]
    assert len(timers) == 1 and timers[0].cancelled()


def test_a_failure_after_the_model_ran_fails_its_batch_not_the_others() -> None:
    """What DynamicBatcher guarantees, on the loop too: if telling ``on_batch`` or
    answering fails, that batch's requests get the error (the loop path awaits them with no
    timeout of its own: they must not wait forever) and the flush's next batches still run."""
    sizes: list[int] = []

    def broken_on_batch(size: int, started: float) -> None:
        sizes.append(size)
        if len(sizes) == 1:
            raise RuntimeError("metrics backend broke")

    model = Model()
    batcher = make(model, max_batch_size=1, on_batch=broken_on_batch)

    async def main():
        futures = [batcher.submit(batch_of(i), deadline=FAR) for i in (1, 2)]
        return await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 5)

    broken, fine = asyncio.run(main())
    assert isinstance(broken, RuntimeError) and str(broken) == "metrics backend broke"
    assert fine.predictions.ravel().tolist() == [2.0]
    assert model.calls == [[1], [2]]
    assert batcher.pending == 0


def test_fail_waiting_answers_the_waiting_requests_and_computes_none_of_them() -> None:
    """A stop out of grace: requests waiting for their flush get the error now (one its
    caller gave up stays cancelled), none is computed, none is left pending; a request
    queued later is counted from zero samples (waits its own delay, is computed)."""
    model = Model()
    batcher = make(model, max_batch_size=8, max_queue_delay=0.05)
    error = UnavailableError("the server stopped before this request's batch ran")

    async def main():
        waiting = [batcher.submit(batch_of(1, 2), deadline=FAR)]
        waiting.append(batcher.submit(batch_of(3), deadline=FAR))
        gone = batcher.submit(batch_of(4), deadline=FAR)
        gone.cancel()
        batcher.fail_waiting(error)
        assert batcher.pending == 0 and gone.cancelled()
        assert [f.exception() for f in waiting] == [error, error]
        later = batcher.submit(batch_of(5, 6, 7, 8), deadline=FAR)  # 4 of 8 samples
        await asyncio.sleep(0.01)
        assert not later.done()  # its own delay: 4 samples do not fill a batch
        return (await later).predictions.ravel().tolist()

    assert asyncio.run(main()) == [5.0, 6.0, 7.0, 8.0]
    assert model.calls == [[5, 6, 7, 8]]


def test_a_request_given_up_while_waiting_frees_its_place_at_once() -> None:
    """A handler that gives up (its client went away) frees its place in the queue when it
    does, not at the flush: with room for one request, the next one is taken instead of
    refused as overload; the one given up is counted once and never computed."""
    model = Model()
    drops: list[str] = []
    batcher = make(model, max_queue_size=1, max_queue_delay=0.05, on_drop=drops.append)

    async def main():
        gone = batcher.submit(batch_of(7), deadline=FAR)
        gone.cancel()
        assert batcher.pending == 0 and drops == ["cancelled"]
        live = batcher.submit(batch_of(8), deadline=FAR)  # was: 1 request already queued
        with pytest.raises(UnavailableError, match="overloaded: 1 requests are already queued"):
            batcher.submit(batch_of(9), deadline=FAR)
        return await asyncio.wait_for(live, 5)

    assert asyncio.run(main()).predictions.ravel().tolist() == [8.0]
    assert model.calls == [[8]]
    assert drops == ["cancelled"]


def test_markers_of_requests_given_up_are_swept_out_of_the_queue() -> None:
    """A flood of requests given up within one delay leaves at most max_queue_size markers
    behind (the queue does not grow with them)."""
    model = Model()
    batcher = make(model, max_queue_size=2, max_queue_delay=10.0)

    async def main():
        for i in range(10):
            batcher.submit(batch_of(i), deadline=FAR).cancel()
            assert len(batcher._queue) <= 3
        batcher.max_batch_size = 1  # the next request flushes at once
        return await asyncio.wait_for(batcher.submit(batch_of(42), deadline=FAR), 5)

    assert asyncio.run(main()).predictions.ravel().tolist() == [42.0]
    assert model.calls == [[42]]
    assert batcher.pending == 0 and len(batcher._queue) == 0


def test_a_request_is_answered_at_its_deadline_not_at_the_flush() -> None:
    """With a flush far away (a 10 s delay), a request with a 50 ms deadline gets
    DeadlineExceededError at its deadline and frees its place; the others keep waiting, and
    a later, earlier deadline is kept too."""
    model = Model()
    drops: list[str] = []
    batcher = make(model, max_queue_size=3, max_queue_delay=10.0, on_drop=drops.append)

    async def main():
        start = time.monotonic()
        waiting = batcher.submit(batch_of(1), deadline=FAR)
        slow = batcher.submit(batch_of(2), deadline=start + 0.2)
        fast = batcher.submit(batch_of(3), deadline=start + 0.05)
        with pytest.raises(DeadlineExceededError, match="deadline passed while it was queued"):
            await asyncio.wait_for(fast, 5)
        fast_at = time.monotonic() - start
        assert batcher.pending == 2 and not slow.done()
        with pytest.raises(DeadlineExceededError):
            await asyncio.wait_for(slow, 5)
        slow_at = time.monotonic() - start
        assert batcher.pending == 1 and not waiting.done()
        batcher.max_batch_size = 1
        rest = batcher.submit(batch_of(4), deadline=FAR)  # flushes the one left, then this
        return fast_at, slow_at, await asyncio.wait_for(asyncio.gather(waiting, rest), 5)

    fast_at, slow_at, outcomes = asyncio.run(main())
    assert 0.05 <= fast_at < 1.0  # at its deadline (bounded for a loaded machine), not 10 s
    assert 0.2 <= slow_at < 1.2
    assert [o.predictions.ravel().tolist() for o in outcomes] == [[1.0], [4.0]]
    assert model.calls == [[1], [4]]
    assert drops == ["deadline", "deadline"]


def test_a_flush_runs_one_batch_per_loop_turn_so_requests_gone_meanwhile_are_skipped() -> None:
    """The flush runs the oldest merged batch, then lets the loop run before the next: a
    client that went away while the first batch ran (its cancel is a callback the loop runs
    after the batch) is skipped, never computed."""
    model = Model()
    queued: list[asyncio.Future] = []

    def run(merged: Batch):
        if not model.calls:  # first batch: the third request's client disconnects now
            asyncio.get_running_loop().call_soon(queued[2].cancel)
        return model(merged)

    batcher = make(run, max_batch_size=1)

    async def main():
        queued.extend(batcher.submit(batch_of(i), deadline=FAR) for i in (1, 2, 3))
        return await asyncio.wait_for(asyncio.gather(*queued, return_exceptions=True), 5)

    first, second, third = asyncio.run(main())
    assert first.predictions.ravel().tolist() == [1.0]
    assert second.predictions.ravel().tolist() == [2.0]
    assert isinstance(third, asyncio.CancelledError)
    assert model.calls == [[1], [2]]


def test_while_the_model_is_busy_elsewhere_the_loop_answers_deadlines_and_keeps_serving():
    """The run lock is held (the thread batcher's slow batch): the loop does not block on
    it. A request with a 50 ms deadline is answered DeadlineExceededError at its deadline,
    one whose client went away meanwhile is dropped, the loop runs other work, and the
    request still wanted runs once the lock is free (in a helper thread), never the others."""
    model = Model()
    lock = threading.Lock()
    drops: list[str] = []
    batcher = LoopBatcher(
        model,
        max_batch_size=8,
        max_queue_delay=0.0,
        max_queue_size=8,
        run_lock=lock,
        on_drop=drops.append,
    )
    assert lock.acquire()
    release = threading.Timer(0.4, lock.release)

    async def main():
        start = time.monotonic()
        release.start()
        wanted = batcher.submit(batch_of(1), deadline=FAR)
        late = batcher.submit(batch_of(2), deadline=start + 0.05)
        gone = batcher.submit(batch_of(3), deadline=FAR)
        await asyncio.sleep(0.01)  # the loop is not blocked: this returns
        ticked = time.monotonic() - start
        gone.cancel()
        with pytest.raises(DeadlineExceededError, match="deadline passed while it was queued"):
            await asyncio.wait_for(late, 5)
        late_at = time.monotonic() - start
        outcome = await asyncio.wait_for(wanted, 5)
        return ticked, late_at, time.monotonic() - start, outcome

    try:
        ticked, late_at, wanted_at, outcome = asyncio.run(main())
    finally:
        release.join(5)
    assert ticked < 0.35 and 0.05 <= late_at < 0.35  # not after the 0.4 s the lock is held
    assert wanted_at >= 0.4
    assert outcome.predictions.ravel().tolist() == [1.0]
    assert model.calls == [[1]] and model.thread_ids != {threading.get_ident()}
    assert drops == ["cancelled", "deadline"]
    assert batcher.pending == 0 and not lock.locked()


def test_a_helper_whose_loop_does_not_take_its_turn_lets_the_model_lock_go(monkeypatch):
    """The helper holds the model's lock while the loop forms its batch; a loop that does
    not take its turn within HAND_OVER_SECONDS (busy, or stopped) must not keep the model
    from the thread batcher: the helper lets the lock go, and the requests run at a later
    flush, once, on the loop."""
    monkeypatch.setattr("serving.loop_batcher.HAND_OVER_SECONDS", 0.05)
    model = Model()
    lock = threading.Lock()
    batcher = LoopBatcher(
        model, max_batch_size=8, max_queue_delay=0.0, max_queue_size=8, run_lock=lock
    )
    free_again: list[bool] = []
    assert lock.acquire()

    async def main():
        waiting = batcher.submit(batch_of(5), deadline=FAR)
        await asyncio.sleep(0.02)  # the flush found the lock held: a helper waits for it
        lock.release()
        time.sleep(0.3)  # the loop is busy: the helper takes the lock, then lets it go
        free_again.append(lock.acquire(blocking=False))
        if free_again[-1]:
            lock.release()
        return await asyncio.wait_for(waiting, 5)

    outcome = asyncio.run(main())
    assert free_again == [True]
    assert outcome.predictions.ravel().tolist() == [5.0]
    assert model.calls == [[5]] and model.thread_ids == {threading.get_ident()}
    assert batcher.pending == 0 and not lock.locked()


def test_a_merged_batch_that_fails_runs_its_requests_alone_so_only_the_bad_one_fails() -> None:
    """The model raises when a batch holds ID 666: the merged batch fails, each request runs
    again alone (under the model's lock), and only 666's request gets the error; a request
    alone is not run again. ``on_split`` is told once, ``on_batch`` of every batch answered."""
    calls: list[list[int]] = []
    held: list[bool] = []
    lock = threading.Lock()

    def run(merged: Batch):
        held.append(lock.locked())
        ids = merged.id_feature("user").values.tolist()
        calls.append(ids)
        if 666 in ids:
            raise RuntimeError("ID 666 breaks the model")
        return np.asarray(ids, np.float32).reshape(-1, 1), f"alone {ids}"

    splits: list[int] = []
    sizes: list[int] = []
    batcher = LoopBatcher(
        run,
        max_batch_size=64,
        max_queue_delay=0.0,
        max_queue_size=16,
        run_lock=lock,
        on_batch=lambda size, started: sizes.append(size),
        on_split=lambda: splits.append(1),
    )

    async def main():
        futures = [batcher.submit(b, deadline=FAR) for b in (batch_of(1, 2), batch_of(666))]
        futures.append(batcher.submit(batch_of(3), deadline=FAR))
        merged = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 5)
        alone = batcher.submit(batch_of(666), deadline=FAR)
        return merged, await asyncio.wait_for(asyncio.gather(alone, return_exceptions=True), 5)

    (good, bad, other), (bad_alone,) = asyncio.run(main())
    assert good.predictions.ravel().tolist() == [1.0, 2.0]
    assert other.predictions.ravel().tolist() == [3.0]
    assert (good.context, good.merged_batch_size) == ("alone [1, 2]", 2)
    assert (other.context, other.merged_batch_size) == ("alone [3]", 1)
    for error in (bad, bad_alone):
        assert isinstance(error, RuntimeError) and str(error) == "ID 666 breaks the model"
    assert calls == [[1, 2, 666, 3], [1, 2], [666], [3], [666]]
    assert held == [True] * 5
    assert splits == [1]
    assert sizes == [2, 1]
    assert batcher.pending == 0


def test_a_merged_batch_failing_for_the_server_s_state_is_not_run_again() -> None:
    """An embedding tier that is down fails each request alone too: every request gets the
    merged batch's error, from its one call."""
    calls: list[list[int]] = []

    def run(merged: Batch):
        calls.append(merged.id_feature("user").values.tolist())
        raise UnavailableError("embedding tier down")

    splits: list[int] = []
    batcher = make(run, on_split=lambda: splits.append(1))

    async def main():
        futures = [batcher.submit(batch_of(i), deadline=FAR) for i in range(3)]
        return await asyncio.gather(*futures, return_exceptions=True)

    errors = asyncio.run(main())
    assert [e.message for e in errors] == ["embedding tier down"] * 3
    assert calls == [[0, 1, 2]]
    assert splits == []
