"""Data loaders stream batches to NN workers over gRPC on loopback: routing, order, backpressure,
end of stream, and the ``recserve data-loader`` command."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from embedding_store.batch import Batch, IDTypeFeatureWithSingleID
from embedding_store.errors import InvalidArgumentError, UnavailableError
from training.data import DataCtx, DataLoader, IterableDataset, StreamingDataset


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def numbered_batch(number: int) -> Batch:
    """A batch whose single ID is its number, so the receiver can tell batches apart."""
    ids = np.array([number], dtype=np.uint64)
    return Batch([IDTypeFeatureWithSingleID("n", ids)], requires_grad=False)


def number_of(batch: Batch) -> int:
    return int(batch.id_feature("n").values[0])


def run_loader(addresses, index, size, count, delay=0.0):
    with DataCtx(addresses, replica_index=index, replica_size=size, timeout=30) as ctx:
        for sequence in range(count):
            if delay:
                time.sleep(delay * ((sequence + index) % 3))
            ctx.send_data(numbered_batch(sequence * size + index))


def test_two_loaders_two_workers_route_deterministically():
    ports = [free_port(), free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    datasets = [StreamingDataset(4, port=p, num_loaders=2).start() for p in ports]
    received: list[list[int]] = [[], []]

    def consume(w):
        received[w] = [number_of(b) for b in datasets[w]]

    consumers = [threading.Thread(target=consume, args=(w,)) for w in range(2)]
    loaders = [threading.Thread(target=run_loader, args=(addresses, i, 2, 10)) for i in range(2)]
    for thread in consumers + loaders:
        thread.start()
    for thread in consumers + loaders:
        thread.join(timeout=60)
    # Global batch g goes to NN worker g % 2; every batch arrives exactly once.
    assert sorted(received[0]) == list(range(0, 20, 2))
    assert sorted(received[1]) == list(range(1, 20, 2))


def test_reproducible_mode_yields_global_order_whatever_the_timing():
    port = free_port()
    dataset = StreamingDataset(3, port=port, num_loaders=3, reproducible=True).start()
    loaders = [
        threading.Thread(target=run_loader, args=([f"127.0.0.1:{port}"], i, 3, 5, 0.01))
        for i in range(3)
    ]
    for thread in loaders:
        thread.start()
    order = [number_of(b) for b in dataset]
    for thread in loaders:
        thread.join(timeout=30)
    assert order == list(range(15))


def test_reproducible_mode_goes_on_past_a_loader_that_ended_early():
    # Loader 0 sends one batch and ends before loader 1 sends anything. Global batch 2 would
    # be loader 0's second: it never comes, so loader 1's batches 3, 5, 7 must not wait for it.
    port = free_port()
    dataset = StreamingDataset(8, port=port, num_loaders=2, reproducible=True, idle_timeout=30)
    dataset.start()
    address = [f"127.0.0.1:{port}"]
    run_loader(address, 0, 2, 1)
    late = threading.Thread(target=run_loader, args=(address, 1, 2, 4))
    late.start()
    order = [number_of(b) for b in dataset]
    late.join(timeout=30)
    assert order == [0, 1, 3, 5, 7]


def test_backpressure_blocks_the_loader_until_the_worker_reads():
    port = free_port()
    dataset = StreamingDataset(2, port=port, num_loaders=1).start()
    progress = []

    def loader():
        with DataCtx([f"127.0.0.1:{port}"], timeout=30) as ctx:
            for number in range(20):
                ctx.send_data(numbered_batch(number))
                progress.append(number)

    thread = threading.Thread(target=loader)
    thread.start()
    time.sleep(1.0)
    assert len(progress) <= 4  # buffer of 2 + at most a couple of calls in the handler
    numbers = [number_of(b) for b in dataset]
    thread.join(timeout=30)
    assert numbers == list(range(20))


def test_bad_loader_index_and_count_mismatch_are_rejected():
    port = free_port()
    dataset = StreamingDataset(2, port=port, num_loaders=1).start()
    try:
        with pytest.raises(InvalidArgumentError, match="loader_index 3 is not below"):
            DataCtx([f"127.0.0.1:{port}"], replica_index=3, replica_size=4).send_data(
                numbered_batch(0)
            )
        with pytest.raises(InvalidArgumentError, match="replica index 2 is not within"):
            DataCtx([f"127.0.0.1:{port}"], replica_index=2, replica_size=2)
    finally:
        dataset.close()


def test_data_loader_command_streams_into_a_worker(tmp_path):
    port = free_port()
    script = tmp_path / "loader.py"
    script.write_text(
        "import numpy as np\n"
        "from embedding_store.batch import Batch, IDTypeFeatureWithSingleID\n"
        "from training.data import DataCtx\n"
        "with DataCtx() as ctx:\n"
        "    for i in range(6):\n"
        "        ids = np.array([i * ctx.replica_size + ctx.replica_index], dtype=np.uint64)\n"
        "        ctx.send_data(Batch([IDTypeFeatureWithSingleID('n', ids)],"
        " requires_grad=False))\n"
    )
    dataset = StreamingDataset(4, port=port, num_loaders=2).start()
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "embedding_store.cli",
                "data-loader",
                "--entry",
                str(script),
                "--replica-index",
                str(index),
                "--replica-size",
                "2",
                "--nn-worker-addresses",
                f"127.0.0.1:{port}",
            ],
            env=dict(os.environ),
        )
        for index in range(2)
    ]
    try:
        numbers = sorted(number_of(b) for b in dataset)
        assert [p.wait(timeout=60) for p in processes] == [0, 0]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert numbers == list(range(12))


def test_data_loader_prefetches_in_order_and_reraises():
    loader = DataLoader(IterableDataset(lambda: (numbered_batch(i) for i in range(50))), prefetch=3)
    assert [number_of(b) for b in loader] == list(range(50))
    assert [number_of(b) for b in loader] == list(range(50))  # a callable source re-iterates

    def broken():
        yield numbered_batch(0)
        raise RuntimeError("reader failed")

    with pytest.raises(RuntimeError, match="reader failed"):
        list(DataLoader(IterableDataset(broken), prefetch=2))


def test_breaking_out_does_not_wait_for_a_source_that_is_blocked():
    # The producer thread is inside the source (a slow reader, a StreamingDataset waiting
    # for loaders): a break used to wait until the source yielded again.
    release, outcome = threading.Event(), []

    def slow():
        yield numbered_batch(0)
        outcome.append("released" if release.wait(timeout=5) else "waited out")
        yield numbered_batch(1)

    for batch in DataLoader(IterableDataset(slow), prefetch=1):
        assert number_of(batch) == 0
        break
    assert outcome == []  # back from the break while the source still blocks
    release.set()

    def producer_alive() -> bool:
        return any(t.name == "data-prefetch" for t in threading.enumerate())

    deadline = time.monotonic() + 5
    while (not outcome or producer_alive()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert outcome == ["released"]
    assert not producer_alive()  # it saw the stop and ended by itself


def test_a_pass_after_a_break_reads_a_shared_source_on_from_one_thread():
    # The producer left behind by a break may still be inside next(source): the next pass
    # waits for it rather than read the same generator from a second thread.
    def slow():  # slower than the 0.2 s a stopped pass waits for its producer
        for number in range(5):
            time.sleep(0.4)
            yield numbered_batch(number)

    loader = DataLoader(IterableDataset(slow()), prefetch=2)  # one generator for both passes
    first = []
    for batch in loader:
        first.append(number_of(batch))
        if len(first) == 2:
            break
    rest = [number_of(batch) for batch in loader]
    assert first == [0, 1]
    # What the abandoned producer had queued or was reading is dropped; the rest follows.
    assert rest and rest == list(range(rest[0], 5)) and rest[0] >= 2


def test_a_loader_that_stops_without_ending_fails_the_iteration_naming_it():
    # A killed loader never sends EndOfStream: without the idle bound the NN worker waited
    # for it forever.
    port = free_port()
    dataset = StreamingDataset(8, port=port, num_loaders=2, idle_timeout=0.5).start()
    addresses = [f"127.0.0.1:{port}"]
    run_loader(addresses, 0, 2, 3)  # loader 0: batches 0, 2, 4, then EndOfStream

    ctx = DataCtx(addresses, replica_index=1, replica_size=2)
    ctx.send_data(numbered_batch(1))  # loader 1: one batch, then it is killed: it says nothing
    for channel in ctx._channels:
        channel.close()
    received = []
    started = time.monotonic()
    with pytest.raises(UnavailableError) as stalled:
        for batch in dataset:
            received.append(number_of(batch))
    waited = time.monotonic() - started
    assert sorted(received) == [0, 1, 2, 4]
    message = str(stalled.value)
    assert "no batch from the data loaders for 0.5 s" in message
    assert "loader(s) [1] have not ended their stream" in message
    assert re.search(
        r"\(batches received from each: \{1: 1\}; last seen from: \{1: 'ipv4:127\.0\.0\.1:\d+'\}\)",
        message,
    ), message
    assert 0.5 <= waited < 10
    with pytest.raises(InvalidArgumentError, match="idle_timeout must be a number > 0, got 0"):
        StreamingDataset(4, port=port, idle_timeout=0)


def test_a_loader_that_fails_ends_the_iteration_at_once_naming_it_and_its_error():
    """A loader whose script raised used to say nothing, like a killed one: the NN worker
    waited out its idle timeout (300 s) and then could only guess. Its error now travels with
    its end of stream, and is not taken for the end of its data."""
    port = free_port()
    dataset = StreamingDataset(8, port=port, num_loaders=2, idle_timeout=60).start()
    addresses = [f"127.0.0.1:{port}"]
    run_loader(addresses, 0, 2, 2)  # loader 0: batches 0, 2, then its end of stream

    with pytest.raises(OSError), DataCtx(addresses, replica_index=1, replica_size=2) as ctx:
        ctx.send_data(numbered_batch(1))
        raise OSError("data/part-3.csv: No such file or directory")
    received = []
    started = time.monotonic()
    with pytest.raises(UnavailableError) as failed:
        for batch in dataset:
            received.append(number_of(batch))
    assert time.monotonic() - started < 5  # not the 60 s idle timeout
    assert sorted(received) == [0, 1, 2]  # what it sent before failing is still trained on
    assert re.fullmatch(
        r"data loader 1 \(ipv4:127\.0\.0\.1:\d+\) failed after sending 1 batch\(es\) to this "
        rf"NN worker \(127\.0\.0\.1:{port}, 1 arrived\): OSError: data/part-3\.csv: No such "
        r"file or directory",
        failed.value.message,
    ), failed.value.message


def test_a_loader_that_never_connects_is_named_as_such():
    port = free_port()
    dataset = StreamingDataset(2, port=port, num_loaders=2, idle_timeout=0.3).start()
    run_loader([f"127.0.0.1:{port}"], 1, 2, 1)  # loader 1 sends and ends; loader 0 never comes
    with pytest.raises(UnavailableError) as stalled:
        list(dataset)
    assert stalled.value.message == (
        "no batch from the data loaders for 0.3 s, and loader(s) [0] have not ended their "
        "stream (batches received from each: {0: 0}; never connected: [0]): a loader stopped "
        f"or cannot reach this NN worker (127.0.0.1:{port})"
    )


def test_leaving_a_stream_early_frees_the_receiver_waiting_for_room():
    """A training loop that stops reading (a break, an error) while a loader waits for room:
    the receiver's handler stayed blocked in its put after the server closed, and the
    interpreter, which joins the server's threads at exit, never ended (the NN worker hung)."""
    port = free_port()
    dataset = StreamingDataset(1, port=port, num_loaders=1).start()
    handlers = dataset._executor
    failures: list[BaseException] = []

    def loader() -> None:
        try:
            run_loader([f"127.0.0.1:{port}"], 0, 1, 10)
        except UnavailableError as error:
            failures.append(error)

    sending = threading.Thread(target=loader, daemon=True)
    sending.start()
    for _ in dataset:
        time.sleep(0.3)  # the buffer fills, a handler waits for room
        break
    sending.join(10)
    assert len(failures) == 1 and "has its training stopped?" in failures[0].message
    # Every handler ends: what the interpreter's exit waits for.
    shutdown = threading.Thread(target=handlers.shutdown, daemon=True)
    shutdown.start()
    shutdown.join(5)
    assert not shutdown.is_alive()


def test_a_loader_whose_worker_has_gone_fails_at_once_not_after_its_timeout():
    """The NN worker took batches, then its training ended (Ctrl-C): the next send fails in
    seconds naming it. It used to wait for the worker's return for the whole timeout."""
    port = free_port()
    dataset = StreamingDataset(2, port=port, num_loaders=1).start()
    ctx = DataCtx([f"127.0.0.1:{port}"], timeout=600)
    try:
        ctx.send_data(numbered_batch(0))
        dataset.close()
        started = time.monotonic()
        with pytest.raises(UnavailableError, match=rf"NN worker 127.0.0.1:{port} .*stopped"):
            for number in range(1, 10):  # the first may still land in a closing server
                ctx.send_data(numbered_batch(number))
        assert time.monotonic() - started < 30
    finally:
        ctx.__exit__(UnavailableError, None, None)  # closes the channels, sends no end


def test_a_loader_index_equal_to_num_loaders_is_refused():
    port = free_port()
    dataset = StreamingDataset(2, port=port, num_loaders=2).start()
    try:
        with pytest.raises(InvalidArgumentError, match="loader_index 2 is not below num_loaders 2"):
            DataCtx([f"127.0.0.1:{port}"], replica_index=2, replica_size=3).send_data(
                numbered_batch(0)
            )
    finally:
        dataset.close()


@pytest.mark.parametrize("said", [0, 2])
def test_an_end_of_stream_must_count_exactly_the_batches_that_arrived(said):
    from embedding_store.grpc_common import call
    from training.data import pb

    port = free_port()
    dataset = StreamingDataset(4, port=port, num_loaders=1).start()
    try:
        ctx = DataCtx([f"127.0.0.1:{port}"], timeout=30)
        ctx.send_data(numbered_batch(0))
        request = pb.EndOfStreamRequest(loader_index=0, batches_sent=said)
        with pytest.raises(
            InvalidArgumentError, match=f"data loader 0 says it sent {said} batches, 1 arrived"
        ):
            call("NN worker", ctx._stubs[0].EndOfStream, request, timeout=30)
    finally:
        dataset.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"buffer_size": 0}, "buffer_size must be >= 1, got 0"),
        ({"idle_timeout": float("inf")}, "idle_timeout must be a number > 0, got inf"),
        ({"idle_timeout": float("nan")}, "idle_timeout must be a number > 0, got nan"),
        ({"num_loaders": True}, "num_loaders must be an integer >= 1, got True"),
    ],
)
def test_streaming_dataset_arguments_are_checked(kwargs, message):
    with pytest.raises(InvalidArgumentError) as refused:
        StreamingDataset(port=0, **kwargs)
    assert refused.value.message == message


def test_reproducible_mode_frees_a_batch_waiting_on_a_loader_that_then_ends():
    # Loader 1's second batch (global 3) waits for global 2, loader 0's second, which never
    # comes: loader 0 ends after one batch. Its end must let batch 3 through.
    port = free_port()
    address = [f"127.0.0.1:{port}"]
    dataset = StreamingDataset(8, port=port, num_loaders=2, reproducible=True, idle_timeout=10)
    dataset.start()
    first = DataCtx(address, replica_index=0, replica_size=2, timeout=10)
    first.send_data(numbered_batch(0))
    late = threading.Thread(target=run_loader, args=(address, 1, 2, 2))
    late.start()
    deadline = time.monotonic() + 10
    while dataset._received.get(1, 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # loader 1's batch 3 is now waiting in the receiver
    first.__exit__(None, None, None)  # EndOfStream from loader 0
    order = [number_of(b) for b in dataset]
    late.join(timeout=30)
    assert order == [0, 1, 3]


def test_data_loader_prefetch_must_not_be_negative_and_zero_reads_in_the_consumer():
    with pytest.raises(InvalidArgumentError) as refused:
        DataLoader(IterableDataset([]), prefetch=-1)
    assert refused.value.message == "prefetch must be >= 0, got -1"
    readers = []

    def source():
        for number in range(3):
            readers.append(threading.current_thread().name)
            yield numbered_batch(number)

    loader = DataLoader(IterableDataset(source), prefetch=0)
    assert [number_of(b) for b in loader] == [0, 1, 2]
    assert readers == [threading.current_thread().name] * 3  # no prefetch thread


def test_each_rank_listens_on_its_own_address_and_takes_its_own_global_batches(monkeypatch):
    from training.env import NN_WORKERS_ENV

    monkeypatch.setenv(NN_WORKERS_ENV, "10.0.0.5:7001, 10.0.0.6:7002")
    monkeypatch.setenv("RANK", "1")
    remote = StreamingDataset()  # not started: nothing to close
    assert (remote.host, remote.port, remote._rank, remote._world) == ("0.0.0.0", 7002, 1, 2)

    ports = [free_port(), free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    monkeypatch.setenv(NN_WORKERS_ENV, ",".join(addresses))
    datasets = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        dataset = StreamingDataset(4, num_loaders=1, reproducible=True, idle_timeout=10)
        assert (dataset.host, dataset.port) == ("127.0.0.1", ports[rank])
        datasets.append(dataset.start())
    received: list[list[int]] = [[], []]

    def consume(rank):
        received[rank] = [number_of(b) for b in datasets[rank]]

    threads = [threading.Thread(target=consume, args=(r,)) for r in (0, 1)]
    threads.append(threading.Thread(target=run_loader, args=(addresses, 0, 1, 6)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert received == [[0, 2, 4], [1, 3, 5]]


def test_data_ctx_reads_its_peers_and_replica_from_the_environment(monkeypatch):
    # The names the launcher sets and a hand-written Job would set: spelled out here.
    for name in ("RECSERVE_NN_WORKER_ADDRESSES", "RECSERVE_REPLICA_INDEX", "RECSERVE_REPLICA_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InvalidArgumentError) as refused:
        DataCtx()
    assert refused.value.message == (
        "no NN worker addresses: pass nn_worker_addresses or set RECSERVE_NN_WORKER_ADDRESSES"
    )
    monkeypatch.setenv("RECSERVE_NN_WORKER_ADDRESSES", "127.0.0.1:1, ,127.0.0.1:2,127.0.0.1:3")
    monkeypatch.setenv("RECSERVE_REPLICA_INDEX", "1")
    monkeypatch.setenv("RECSERVE_REPLICA_SIZE", "2")
    ctx = DataCtx()
    try:
        assert ctx.addresses == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
        assert (ctx.replica_index, ctx.replica_size) == (1, 2)
        # Global batch sequence * 2 + 1 goes to NN worker (that number) % 3.
        assert [ctx.target_of(s) for s in range(6)] == [1, 0, 2, 1, 0, 2]
    finally:
        ctx.__exit__(RuntimeError, None, None)  # closes the channels, sends no end
    monkeypatch.setenv("RECSERVE_REPLICA_INDEX", "2")
    with pytest.raises(
        InvalidArgumentError, match=r"^replica index 2 is not within replica size 2$"
    ):
        DataCtx()


def test_the_number_of_data_loaders_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("RECSERVE_NUM_DATA_LOADERS", "2")
    assert StreamingDataset(port=0).num_loaders == 2  # not started: nothing to close
