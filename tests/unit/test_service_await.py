"""serving.service._awaited: a batcher future awaited on the event loop, with a deadline."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import pytest

from embedding_store.errors import DeadlineExceededError, UnavailableError
from serving.service import _awaited


def _resolve_later(future: Future, *, result=None, error=None, after: float = 0.01) -> None:
    def run() -> None:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    threading.Timer(after, run).start()


def test_result_set_by_another_thread_is_returned() -> None:
    async def main():
        future: Future = Future()
        _resolve_later(future, result="outcome")
        return await _awaited(future, 5.0)

    assert asyncio.run(main()) == "outcome"


def test_error_of_the_batch_is_raised_unchanged() -> None:
    async def main():
        future: Future = Future()
        _resolve_later(future, error=UnavailableError("the tier is down"))
        await _awaited(future, 5.0)

    with pytest.raises(UnavailableError, match="the tier is down"):
        asyncio.run(main())


def test_no_answer_within_the_wait_is_a_deadline_error_and_cancels_the_request() -> None:
    future: Future = Future()

    async def main():
        await _awaited(future, 0.05)

    with pytest.raises(DeadlineExceededError, match=r"request deadline of 0\.050 s"):
        asyncio.run(main())
    assert future.cancelled()  # the batcher skips it instead of computing it
    future.set_running_or_notify_cancel()  # what the batcher does: no error, nothing runs


def test_a_late_answer_after_the_deadline_is_ignored() -> None:
    async def main():
        future: Future = Future()
        future.set_running_or_notify_cancel()  # the batcher already took it: cannot cancel
        with pytest.raises(DeadlineExceededError):
            await _awaited(future, 0.02)
        future.set_result("too late")  # the batcher finishes afterwards
        await asyncio.sleep(0.02)  # its hand-off to the loop must not raise
        return future.result()

    assert asyncio.run(main()) == "too late"
