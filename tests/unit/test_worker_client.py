"""RemoteEmbeddingWorker (the gRPC client of an embedding worker) against fake stubs: what a
lookup sends and returns, gradient stats, deadlines of admin calls, progress reports, partial
status, readiness polling, and the retries of training's calls."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2

from embedding_store import grpc_common
from embedding_store.batch import (
    Batch,
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    Label,
    NonIDTypeFeature,
)
from embedding_store.config import embedding_config_from_mapping
from embedding_store.errors import (
    CheckpointError,
    DeadlineExceededError,
    RecserveError,
    UnavailableError,
)
from embedding_store.grpc_common import pack_u64
from embedding_store.optimizers import SGD
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.remote_tier import RemoteShardTier
from embedding_store.tier import InProcessEmbeddingTier
from embedding_store.worker import SlotOutput
from embedding_store.worker_client import RemoteEmbeddingWorker
from embedding_store.worker_wire import pack_slots, unpack_grads
from tests.unit.health_stub import HealthStub
from tests.unit.test_rpc_errors import FailedCall

#: Nothing listens on port 1; the fake stubs answer instead.
NOWHERE = "127.0.0.1:1"
CONFIG = embedding_config_from_mapping(
    {
        "slots_config": {
            "user": {"dim": 4},
            "history": {"dim": 4, "embedding_summation": False, "sample_fixed_size": 3},
        }
    }
)


class FakeWorkerStub:
    """An EmbeddingWorker stub: records requests and deadlines, answers what it is given."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, object, float | None]] = []
        self.slots: list[SlotOutput] = []
        self.status = pb.WorkerStatusResponse()
        self.failure: grpc.RpcError | None = None
        self.progress: list[pb.Progress] = []
        self.unknown_per_sample = b""  # what a worker that predates the field sends

    def _record(self, name: str, request: object, timeout: float | None) -> None:
        self.requests.append((name, request, timeout))
        if self.failure is not None:
            raise self.failure

    def Lookup(self, request, timeout=None):
        self._record("Lookup", request, timeout)
        response = pb.WorkerLookupResponse(
            ref=7, unknown_ids=2, unknown_per_sample=self.unknown_per_sample
        )
        pack_slots(response.slots, self.slots)
        return response

    def Backward(self, request, timeout=None):
        self._record("Backward", request, timeout)
        return pb.BackwardResponse(rows_queued=5, nonfinite_rows_skipped=2)

    def Flush(self, request, timeout=None):
        self._record("Flush", request, timeout)
        return pb.FlushResponse()

    def Clear(self, request, timeout=None):
        self._record("Clear", request, timeout)
        return pb.ClearResponse()

    def Status(self, request, timeout=None):
        self._record("Status", request, timeout)
        return self.status

    def Load(self, request, timeout=None) -> Iterator[pb.Progress]:
        self._record("Load", request, timeout)
        yield from self.progress

    Dump = Load


@pytest.fixture
def client() -> Iterator[tuple[RemoteEmbeddingWorker, FakeWorkerStub]]:
    with RemoteEmbeddingWorker(NOWHERE, CONFIG, timeout=3, admin_timeout=40) as worker:
        worker._stub = stub = FakeWorkerStub()
        yield worker, stub


def _batch(**extra) -> Batch:
    return Batch(
        [
            IDTypeFeatureWithSingleID.from_ids("user", [1, 2]),
            IDTypeFeature.from_lists("history", [[3, 4], []]),
        ],
        **extra,
    )


def _answer() -> list[SlotOutput]:
    mask = torch.tensor([[True, True, False], [False, False, False]])
    return [SlotOutput("user", torch.ones(2, 4)), SlotOutput("history", torch.ones(2, 3, 4), mask)]


def test_a_lookup_reads_the_unknown_ids_of_each_sample_when_the_worker_sends_them(
    client,
) -> None:
    worker, stub = client
    stub.slots = _answer()
    batch = _batch(requires_grad=False)
    old = worker.lookup(batch, train=False)  # a worker that predates the field
    assert (old.unknown_ids, old.unknown_per_sample) == (2, None)
    stub.unknown_per_sample = pack_u64(np.array([0, 2], np.uint64))
    split = worker.lookup(batch, train=False)
    assert split.unknown_per_sample is not None
    assert (split.unknown_ids, split.unknown_per_sample.tolist()) == (2, [0, 2])
    for wrong in ([1, 2], [2]):  # summing to 3, or one sample short
        stub.unknown_per_sample = pack_u64(np.array(wrong, np.uint64))
        with pytest.raises(RecserveError, match="sent a malformed answer: unknown_per_sample"):
            worker.lookup(batch, train=False)


def test_a_lookup_sends_only_id_features_and_gives_a_ref_only_when_training(client) -> None:
    worker, stub = client
    stub.slots = _answer()
    batch = _batch(
        non_id_type_features=[NonIDTypeFeature(np.ones((2, 3), np.float32), name="dense")],
        labels=[Label(np.ones((2, 1), np.float32), name="y")],
        requires_grad=True,
    )
    trained = worker.lookup(batch, train=True)
    assert (trained.ref, trained.unknown_ids) == (7, 2)
    assert worker.lookup(batch, train=False).ref is None  # an eval lookup has no context
    _, request, timeout = stub.requests[0]
    assert timeout == 3
    sent = Batch.from_bytes(request.batch)
    assert [f.name for f in sent.id_type_features] == ["user", "history"]
    assert (list(sent.non_id_type_features), list(sent.labels), sent.requires_grad) == (
        [],
        [],
        False,
    )


def test_a_raw_slot_must_come_back_as_batch_by_sample_fixed_size_by_dim(client) -> None:
    worker, stub = client
    stub.slots = [SlotOutput("user", torch.ones(2, 4)), SlotOutput("history", torch.ones(2, 4))]
    with pytest.raises(RecserveError) as refused:
        worker.lookup(_batch(requires_grad=False), train=False)
    assert refused.value.message == (
        "embedding worker 127.0.0.1:1 sent a malformed answer: slot 'history' has shape "
        "[2, 4], expected [2, 3, 4] for a batch of 2"
    )
    stub.slots = _answer()
    (_, history) = worker.lookup(_batch(requires_grad=False), train=False).slots
    assert history.mask.tolist() == [[True, True, False], [False, False, False]]


def test_backward_sends_the_gradients_and_returns_the_workers_counts(client) -> None:
    worker, stub = client
    grads = {"user": torch.full((2, 4), 0.5)}
    stats = worker.backward(9, grads)
    assert (stats.rows_pushed, stats.nonfinite_rows_skipped) == (5, 2)
    _, request, timeout = stub.requests[0]
    assert (request.ref, timeout) == (9, 3)
    np.testing.assert_array_equal(unpack_grads(request.grads)["user"], np.full((2, 4), 0.5))


def test_flush_and_admin_calls_take_the_admin_deadline(client) -> None:
    """A flush waits for every queued gradient to reach its shard: the admin deadline, not
    the lookup one."""
    worker, stub = client
    worker.flush()
    worker.clear()
    assert [(name, timeout) for name, _, timeout in stub.requests] == [
        ("Flush", 40),
        ("Clear", 40),
    ]


def test_a_dump_sends_an_absolute_path_and_overwrite(client, tmp_path, monkeypatch) -> None:
    """The worker resolves paths in its own working directory: a relative one must be made
    absolute here, where the caller meant it."""
    worker, stub = client
    with InProcessEmbeddingTier(CONFIG, optimizer=SGD()) as tier:
        tier.dump(tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    worker.dump("ckpt", overwrite=True)
    _, request, timeout = stub.requests[0]
    assert (request.directory, request.overwrite, timeout) == (str(tmp_path / "ckpt"), True, 40)


def test_a_dump_past_its_deadline_says_it_may_still_complete(client, tmp_path: Path) -> None:
    worker, stub = client
    stub.failure = FailedCall(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    with pytest.raises(DeadlineExceededError) as late:
        worker.dump(tmp_path / "ckpt")
    assert late.value.message.startswith(
        f"embedding worker 127.0.0.1:1 did not finish the dump to {tmp_path / 'ckpt'} within "
        "the deadline (40 s); it may still complete on the worker"
    )
    stub.failure = FailedCall(grpc.StatusCode.FAILED_PRECONDITION, "checkpoint is corrupt")
    with pytest.raises(CheckpointError) as corrupt:
        worker.load(tmp_path / "ckpt")
    assert corrupt.value.message == "embedding worker 127.0.0.1:1: checkpoint is corrupt"


def test_progress_reports_every_stage_but_the_final_done(client, tmp_path: Path) -> None:
    worker, stub = client
    with InProcessEmbeddingTier(CONFIG, optimizer=SGD()) as tier:
        tier.lookup(_batch(requires_grad=False), train=True)
        tier.dump(tmp_path / "ckpt")
    stub.progress = [
        pb.Progress(stage="load", done=1, total=2),
        pb.Progress(stage="load", done=2, total=2),
        pb.Progress(stage="done", done=2, total=2),
    ]
    seen = []
    manifest = worker.load(tmp_path / "ckpt", progress=lambda *step: seen.append(step))
    assert seen == [("load", 1, 2), ("load", 2, 2)]
    assert manifest.total_rows == 4
    _, request, timeout = stub.requests[0]
    assert (request.directory, timeout) == (str(tmp_path / "ckpt"), 40)


def test_a_shard_that_did_not_answer_fails_the_status_unless_partial(client) -> None:
    worker, stub = client
    stub.status = pb.WorkerStatusResponse(
        shard_status=[pb.ShardStatusResponse(rows=3, capacity=10), pb.ShardStatusResponse()],
        shard_errors=["", "connection refused"],
        pending_backward=1,
    )
    with pytest.raises(UnavailableError) as failed:
        worker.status()
    assert failed.value.message == (
        "embedding worker 127.0.0.1:1: 1 shard(s) did not answer: shard 1: connection refused"
    )
    status = worker.status(partial=True)
    assert status.shard_errors == ("", "connection refused")
    assert (status.rows_per_shard, status.capacity_per_shard) == ((3, 0), (10, 0))
    stub.status.shard_errors[:] = ["", ""]
    assert worker.status().shard_errors == ()  # only a partial status reports them


def test_wait_for_serving_waits_for_serving_not_for_any_answer(client) -> None:
    worker, _ = client
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    worker._health = health = HealthStub(not_serving, serving)
    worker.wait_for_serving(30)
    assert health.calls == 2
    worker._health = HealthStub(not_serving)
    with pytest.raises(
        UnavailableError, match=r"127\.0\.0\.1:1 is not serving after 0\.2 s \(NOT_SERVING\)"
    ):
        worker.wait_for_serving(0.2)


class _UnknownServiceHealth:
    """A health service that does not know the worker's service (another process's port)."""

    def __init__(self) -> None:
        self.calls = 0

    def Check(self, request, timeout=None):
        self.calls += 1
        raise FailedCall(grpc.StatusCode.NOT_FOUND, "unknown service")


def test_wait_for_serving_fails_at_once_on_a_port_that_is_no_worker(client) -> None:
    worker, _ = client
    worker._health = health = _UnknownServiceHealth()
    with pytest.raises(UnavailableError) as refused:
        worker.wait_for_serving(30)  # would wait 30 s for an answer that cannot change
    assert health.calls == 1
    assert refused.value.message.startswith(
        "embedding worker 127.0.0.1:1 is not an embedding worker: its health service does not "
        "know recserve.embedding.v1.EmbeddingWorker (is it a parameter-server shard's or a "
        "prediction server's port?"
    )


# ------------------------------------------------------------------ retries (training)
#: What gRPC answers for a call it had no connection to send on (the call never left).
NOT_CONNECTED = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
    "Failed to connect to remote host: Connection refused"
)


class FakeClock:
    """grpc_common's ``time`` module: sleeping advances ``now`` (no real waiting)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class FlakyStub(FakeWorkerStub):
    """Fails each call with the next of ``failures`` (code, details), then answers."""

    def __init__(self, *failures: tuple[grpc.StatusCode, str]) -> None:
        super().__init__()
        self.failures = list(failures)

    def _record(self, name: str, request: object, timeout: float | None) -> None:
        self.requests.append((name, request, timeout))
        if self.failures:
            raise FailedCall(*self.failures.pop(0))


@pytest.fixture
def retrying(monkeypatch) -> Iterator[tuple[RemoteEmbeddingWorker, FakeClock]]:
    """A worker client as training makes it (calls retried for 2 s), on a fake clock."""
    clock = FakeClock()
    monkeypatch.setattr(grpc_common, "time", clock)
    with RemoteEmbeddingWorker(NOWHERE, CONFIG, timeout=3, retry_seconds=2) as worker:
        yield worker, clock


def test_a_training_lookup_rides_out_a_worker_or_shard_that_comes_back(retrying) -> None:
    """A restarting shard (the worker answers UNAVAILABLE naming it), then the worker's
    connection dropped mid-call: both resent, and the lookup answers."""
    worker, clock = retrying
    worker._stub = stub = FlakyStub(
        (grpc.StatusCode.UNAVAILABLE, "parameter server 127.0.0.1:2 (shard 1) is unavailable"),
        (grpc.StatusCode.UNAVAILABLE, "Socket closed"),
    )
    stub.slots = _answer()
    assert worker.lookup(_batch(requires_grad=False), train=True).ref == 7
    assert [name for name, _, _ in stub.requests] == ["Lookup"] * 3
    assert clock.sleeps == [0.1, 0.2]


def test_a_training_lookup_gives_up_after_the_retry_window_naming_the_peer(retrying) -> None:
    worker, clock = retrying
    worker._stub = FlakyStub(*[(grpc.StatusCode.UNAVAILABLE, NOT_CONNECTED)] * 10)
    with pytest.raises(UnavailableError) as failed:
        worker.lookup(_batch(requires_grad=False), train=True)
    # Pauses 0.1, 0.2, 0.4, 0.8: the next (1 s) would end past the 2 s window.
    assert clock.sleeps == [0.1, 0.2, 0.4, 0.8]
    assert failed.value.message == (
        f"embedding worker 127.0.0.1:1 is unavailable: {NOT_CONNECTED} (gave up after 5 "
        "attempts over 1.5 s)"
    )


def test_a_backward_or_flush_is_resent_only_when_it_never_left(retrying) -> None:
    """Gradients that reached the worker may have been applied: a call that failed in flight
    is not sent twice. A flush's UNAVAILABLE is the worker's report of lost pushes: resent,
    the next flush would answer OK and the loss would go unreported."""
    worker, _ = retrying
    grads = {"user": torch.ones(2, 4)}
    worker._stub = stub = FlakyStub((grpc.StatusCode.UNAVAILABLE, NOT_CONNECTED))
    assert worker.backward(9, grads).rows_pushed == 5
    assert [name for name, _, _ in stub.requests] == ["Backward", "Backward"]
    worker._stub = stub = FlakyStub((grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    with pytest.raises(UnavailableError) as failed:
        worker.backward(9, grads)
    assert failed.value.message.startswith(
        "embedding worker 127.0.0.1:1 is unavailable: Socket closed ("  # (a TLS hint)
    )
    assert len(stub.requests) == 1
    lost = (
        "1 gradient batch(es) could not be applied since the last flush; last error: "
        f"parameter server 127.0.0.1:2 (shard 1) is unavailable: {NOT_CONNECTED}"
    )  # the worker quotes its shard's connection failure: its own answer was sent
    worker._stub = stub = FlakyStub((grpc.StatusCode.UNAVAILABLE, lost))
    with pytest.raises(UnavailableError) as failed:
        worker.flush()
    assert failed.value.message == f"embedding worker 127.0.0.1:1 is unavailable: {lost}"
    assert len(stub.requests) == 1


def test_without_a_retry_window_nothing_is_resent(client) -> None:
    """Serving and administration keep failing at once (their callers have their own
    deadlines and fallbacks)."""
    worker, _ = client
    worker._stub = stub = FlakyStub((grpc.StatusCode.UNAVAILABLE, NOT_CONNECTED))
    with pytest.raises(UnavailableError):
        worker.lookup(_batch(requires_grad=False), train=False)
    assert len(stub.requests) == 1


class _QuietHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:  # no lines on stderr
        pass


@pytest.fixture
def http_port() -> Iterator[str]:
    """An HTTP/1.1 server on 127.0.0.1 (what a prediction server's --http-port is to gRPC)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _QuietHandler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_waiting_for_a_worker_at_an_http_port_fails_at_once_saying_so(http_port):
    """serve --embedding-workers given an HTTP port waited all of --startup-timeout."""
    worker = RemoteEmbeddingWorker(http_port, CONFIG, timeout=2.0)
    try:
        started = time.monotonic()
        with pytest.raises(UnavailableError) as raised:
            worker.wait_for_serving(timeout=20.0)
        assert time.monotonic() - started < 10.0
    finally:
        worker.close()
    assert raised.value.message.startswith(
        f"embedding worker {http_port} answered in HTTP/1.x, not gRPC: is that an HTTP port "
        "(a prediction server's --http-port)? Parameter-server shards, embedding workers and "
        "prediction servers each listen on ports of their own; give the gRPC one ("
    )


def test_waiting_for_shards_at_an_http_port_fails_at_once_saying_so(http_port):
    """serve --embedding-ps (and a worker's --ps) given an HTTP port: the same."""
    tier = RemoteShardTier(CONFIG, [http_port], shard_timeout=2.0)
    try:
        started = time.monotonic()
        with pytest.raises(UnavailableError, match=r"answered in HTTP/1\.x, not gRPC") as raised:
            tier.wait_for_serving(20.0)
        assert time.monotonic() - started < 10.0
    finally:
        tier.close()
    assert http_port in raised.value.message
