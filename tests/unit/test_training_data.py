"""training.data without a stream: argument checks, routing arithmetic, context exit, the
equal-steps rule and its defaults (the stream itself: tests/integration/test_data_stream.py)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from embedding_store.batch import Batch, IDTypeFeatureWithSingleID
from embedding_store.errors import FailedPreconditionError, InvalidArgumentError
from training import data
from training.data import DataCtx, DataLoader, IterableDataset, StreamingDataset

# Nothing listens here: gRPC channels connect lazily, and these tests send nothing.
ADDRESSES = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]


def test_a_loader_routes_global_batch_numbers_round_robin_over_the_workers():
    """Loader batch s of replica i is global batch g = s * size + i, sent to worker g % 3."""
    with DataCtx(ADDRESSES, replica_index=1, replica_size=2) as ctx:
        ctx.finish = lambda: None  # type: ignore[method-assign]
        assert [ctx.target_of(s) for s in range(6)] == [1, 0, 2, 1, 0, 2]


@pytest.mark.parametrize(("index", "size"), [(2, 2), (-1, 2), (0, 0)])
def test_a_replica_index_outside_the_replica_size_is_refused(index: int, size: int):
    with pytest.raises(InvalidArgumentError) as refused:
        DataCtx(ADDRESSES, replica_index=index, replica_size=size)
    assert refused.value.message == f"replica index {index} is not within replica size {size}"


def test_a_loader_ends_its_stream_on_a_clean_exit_only():
    """EndOfStream tells the worker all batches were sent: never after a failure (the worker
    would then end the epoch early instead of noticing the loader stopped)."""
    finished: list[bool] = []
    with DataCtx(ADDRESSES) as ctx:
        ctx.finish = lambda: finished.append(True)  # type: ignore[method-assign]
    assert finished == [True]
    with pytest.raises(RuntimeError), DataCtx(ADDRESSES) as ctx:
        ctx.finish = lambda: finished.append(True)  # type: ignore[method-assign]
        raise RuntimeError("the loader failed")
    assert finished == [True]


@pytest.mark.parametrize(
    ("num_loaders", "message"),
    [
        (0, "num_loaders must be >= 1 (the data loaders streaming batches), got 0"),
        (1.5, "num_loaders must be an integer >= 1, got 1.5"),
        ("2", "num_loaders must be an integer >= 1, got '2'"),
    ],
)
def test_num_loaders_must_be_an_integer_of_at_least_one(num_loaders: object, message: str):
    with pytest.raises(InvalidArgumentError) as refused:
        StreamingDataset(port=0, num_loaders=num_loaders)  # type: ignore[arg-type]
    assert refused.value.message == message


def test_num_loaders_takes_numpy_integers_and_a_buffer_of_one():
    dataset = StreamingDataset(1, port=0, num_loaders=np.int64(3))
    assert dataset.num_loaders == 3
    assert type(dataset.num_loaders) is int


def test_equal_steps_is_on_by_default_only_for_a_distributed_stream(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert DataLoader(StreamingDataset(port=0)).equal_steps is False
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert DataLoader(StreamingDataset(port=0)).equal_steps is True
    assert DataLoader(IterableDataset([])).equal_steps is False
    assert DataLoader(IterableDataset([]), equal_steps=True).equal_steps is True


class _OtherRank:
    """all_agree as seen with one other rank holding ``batches`` batches: the answer is False
    once that rank has none left (its call then says False)."""

    def __init__(self, batches: int) -> None:
        self.batches = batches
        self.calls: list[bool] = []

    def __call__(self, ok: bool) -> bool:
        other_ok = len(self.calls) < self.batches
        self.calls.append(ok)
        return ok and other_ok


def _counted(count: int, read: list[int]) -> Iterator[int]:
    for number in range(count):
        read.append(number)
        yield number


@pytest.mark.parametrize(("mine", "theirs"), [(2, 3), (2, 2), (0, 1)])
def test_a_rank_that_runs_out_first_still_answers_the_last_vote(monkeypatch, mine, theirs):
    """Every rank calls all_agree the same number of times: the rank out of batches says
    False once more, or the other rank's last all-reduce would wait for it forever."""
    other = _OtherRank(theirs)
    monkeypatch.setattr(data.distributed, "all_agree", other)
    assert list(data._equal_steps(iter(range(mine)))) == list(range(mine))
    assert other.calls == [True] * mine + [False]


def test_a_rank_with_more_batches_drops_them_after_reading_them_all(monkeypatch, caplog):
    other = _OtherRank(2)
    monkeypatch.setattr(data.distributed, "all_agree", other)
    read: list[int] = []
    with caplog.at_level(logging.WARNING, logger="training.data"):
        assert list(data._equal_steps(_counted(5, read))) == [0, 1]
    assert other.calls == [True, True, True]
    assert read == [0, 1, 2, 3, 4]  # read to the end, so that its data loaders finish
    assert "dropped its last 3 batch(es)" in caplog.text


class _Call:
    """The gRPC handler context _accept reads: a live call from one peer."""

    def is_active(self) -> bool:
        return True

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5"


def _numbered(number: int) -> Batch:
    return Batch(
        [IDTypeFeatureWithSingleID("n", np.array([number], dtype=np.uint64))],
        requires_grad=False,
    )


@pytest.mark.parametrize("first_to_end", [0, 1])
def test_reproducible_stream_ends_when_only_some_loaders_feed_this_rank(first_to_end: int):
    """2 loaders, 2 ranks, reproducible: loader i's batches (g = 2 s + i) all go to rank i.
    On rank 0, loader 0's end with loader 1 still open (or the reverse order) must not spin:
    the skip over ended loaders looped for good under the lock when no loader feeding this
    rank was left, and the stream never ended."""
    dataset = StreamingDataset(8, port=0, num_loaders=2, reproducible=True)
    dataset._rank, dataset._world, dataset._next_global = 0, 2, 0

    def stream() -> None:
        for sequence in range(3):
            dataset._accept(0, sequence, _numbered(2 * sequence), _Call())  # type: ignore[arg-type]
        for loader in (first_to_end, 1 - first_to_end):
            dataset._end(loader, 3 if loader == 0 else 0)

    worker = threading.Thread(target=stream, daemon=True)
    worker.start()
    worker.join(timeout=5)
    assert not worker.is_alive(), "the receiver hung on an ended loader"
    items = [dataset._buffer.get_nowait() for _ in range(dataset._buffer.qsize())]
    numbers = [int(b.id_feature("n").values[0]) for b in items if isinstance(b, Batch)]
    assert numbers == [0, 2, 4]
    assert sum(item is data._END for item in items) == 2


def test_a_loaders_end_counts_once_and_only_for_a_loader_of_this_stream():
    """Two loaders: loader 0's end sent twice (DataCtx.finish() by hand, then again on exit)
    or an end from a loader index the stream does not have ended the stream while loader 1
    still sent: each _END counted as one more loader done."""
    dataset = StreamingDataset(8, port=0, num_loaders=2)
    dataset._end(0, 0)
    dataset._end(0, 0)
    with pytest.raises(InvalidArgumentError) as refused:
        dataset._end(2, 0)
    assert refused.value.message == "EndOfStreamRequest.loader_index 2 is not below num_loaders 2"
    assert dataset._ended == {0: 0}
    assert dataset._buffer.qsize() == 1  # one end: the stream waits for loader 1's


class _Stub:
    """A DataReceiver stub that records the EndOfStream calls it gets."""

    def __init__(self) -> None:
        self.ends: list[int] = []

    def EndOfStream(self, request, timeout):
        self.ends.append(request.loader_index)


def test_a_loader_ends_its_stream_once_and_sends_nothing_after():
    stubs = [_Stub(), _Stub()]
    with DataCtx(ADDRESSES[:2], replica_index=1, replica_size=2) as ctx:
        ctx._stubs = stubs  # type: ignore[assignment]
        ctx.finish()
        with pytest.raises(FailedPreconditionError) as refused:
            ctx.send_data(_numbered(0))
        assert refused.value.message == "send_data() after finish(): this loader has ended"
    assert [stub.ends for stub in stubs] == [[1], [1]]  # the exit sent no second end


def test_a_pass_begun_while_another_is_open_reads_everything_and_ends_the_old_one():
    """A peek (next(iter(loader))) left a pass open whose producer waited for room in its
    full buffer for good: the next pass joined it, and hung forever."""
    loader = DataLoader(IterableDataset(lambda: (_numbered(n) for n in range(20))), prefetch=2)
    peek = iter(loader)
    assert int(next(peek).id_feature("n").values[0]) == 0
    numbers: list[int] = []

    def read_all() -> None:
        numbers.extend(int(b.id_feature("n").values[0]) for b in loader)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "the new pass hung on the open one"
    assert numbers == list(range(20))
    with pytest.raises(FailedPreconditionError) as refused:
        list(peek)  # what it had prefetched, then the end of a superseded pass
    assert refused.value.message == (
        "a new pass over this DataLoader began before this one ended: this one stopped "
        "(one pass at a time)"
    )


def test_a_second_pass_over_a_used_up_generator_is_refused_not_empty():
    """IterableDataset(generator) gave its batches once: a second epoch over it trained on
    nothing, silently. A list is read again; a pass left early goes on where it stopped."""
    listed = IterableDataset([_numbered(0), _numbered(1)])
    assert [len(list(listed)), len(list(listed))] == [2, 2]
    generated = IterableDataset(_numbered(n) for n in range(3))
    first = iter(generated)
    next(first)
    del first  # left early: the rest is still there
    assert [int(b.id_feature("n").values[0]) for b in generated] == [1, 2]
    with pytest.raises(FailedPreconditionError) as refused:
        list(DataLoader(generated, prefetch=1))
    assert refused.value.message == (
        "IterableDataset: its source is an iterator (a generator?) that an earlier pass read "
        "to its end, so it has no batch left; pass a function returning a fresh iterator "
        "(IterableDataset(lambda: make_batches())) to read it once per epoch"
    )
