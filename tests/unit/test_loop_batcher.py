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


def make(model: Model, **limits) -> LoopBatcher:
    settings = {"max_batch_size": 64, "max_queue_delay": 0.0, "max_queue_size": 16}
    settings.update(limits)
    return LoopBatcher(model, run_lock=threading.Lock(), **settings)


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
