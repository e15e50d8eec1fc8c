"""RemoteParameterServer (the gRPC client of one shard) without a shard process: argument
checks before any call, deadlines, malformed answers, a load whose caller gave up, errors
raised while streaming rows in, readiness polling, and closing its channel once."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from embedding_store.config import (
    EmbeddingConfig,
    JobType,
    SlotConfig,
    embedding_config_from_mapping,
)
from embedding_store.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    RecserveError,
    UnavailableError,
)
from embedding_store.grpc_common import add_servicer, pack_f32, pack_u64, server_options
from embedding_store.optimizers import SGD
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.ps_client import RemoteParameterServer
from embedding_store.ps_service import ParameterServerServicer
from embedding_store.shard import EmbeddingShard, RowBlock
from tests.unit.health_stub import HealthStub
from tests.unit.test_rpc_errors import FailedCall

#: Nothing listens on port 1: a client of it fails fast if it ever calls.
NOWHERE = "127.0.0.1:1"


def test_bad_ids_dims_and_timeouts_are_refused_before_any_call() -> None:
    with pytest.raises(InvalidArgumentError, match=r"timeouts must be > 0, got timeout=0"):
        RemoteParameterServer(NOWHERE, timeout=0)
    with pytest.raises(InvalidArgumentError, match=r"checkpoint_timeout=-1"):
        RemoteParameterServer(NOWHERE, checkpoint_timeout=-1)
    with RemoteParameterServer(NOWHERE, timeout=5) as client:
        two_d = np.zeros((2, 1), dtype=np.uint64)
        with pytest.raises(InvalidArgumentError) as refused:
            client.lookup(two_d, 4, train=False)
        assert refused.value.message == "ids must be a uint64 [n] array, got uint64[2, 1]"
        ids = np.arange(2, dtype=np.uint64)
        with pytest.raises(InvalidArgumentError) as refused:
            client.lookup(ids, True, train=False)  # a bool is not a dim, though int(True) is 1
        assert refused.value.message == "dim must be a positive integer, got True"
        with pytest.raises(InvalidArgumentError, match="max_rows_per_chunk must be a positive"):
            client.export_rows(0)


def test_an_unreachable_shard_is_named_with_its_index() -> None:
    with (
        RemoteParameterServer(NOWHERE, replica_index=3, timeout=5) as client,
        pytest.raises(UnavailableError) as failed,
    ):
        client.clear()
    assert failed.value.message.startswith("parameter server 127.0.0.1:1 (shard 3) is unavailable")


class _MalformedStub:
    """A ParameterServer stub whose answers do not fit their requests."""

    def __init__(self) -> None:
        self.timeouts: list[float | None] = []
        self.stream = _Stream(
            [
                pb.RowChunk(dim=2, ids=pack_u64(np.arange(1, dtype=np.uint64)), weights=b"\0" * 8),
                pb.RowChunk(dim=2, ids=pack_u64(np.arange(2, dtype=np.uint64)), weights=b"\0" * 8),
            ]
        )

    def Lookup(self, request, timeout=None):
        return pb.LookupResponse(rows=b"\0" * 4)  # one float for 2 rows of dim 4

    def Status(self, request, timeout=None):
        self.timeouts.append(timeout)
        return pb.ShardStatusResponse(rows=5)

    def ExportRows(self, request, timeout=None):
        self.timeouts.append(timeout)
        return self.stream

    def Dump(self, request, timeout=None):
        self.timeouts.append(timeout)
        file = pb.CheckpointFile(
            shard=1,
            dim=8,
            path="shard_00001/dim_8.safetensors",
            rows=3,
            state_width=0,
            bytes=100,
            sha256="ab" * 32,
        )
        return pb.ShardDumpResponse(files=[file], optimizer_json='{"type": "sgd", "lr": 0.5}')


class _Stream:
    """A server stream of ``chunks`` that records whether it was cancelled."""

    def __init__(self, chunks: list[pb.RowChunk]) -> None:
        self._chunks = iter(chunks)
        self.cancelled = False

    def __iter__(self) -> Iterator[pb.RowChunk]:
        return self

    def __next__(self) -> pb.RowChunk:
        return next(self._chunks)

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_a_malformed_answer_is_the_shards_fault_not_an_invalid_argument() -> None:
    """A wrong-sized answer is an error of the peer (RecserveError naming it and the chunk),
    not INVALID_ARGUMENT, which would blame the caller's request."""
    with RemoteParameterServer(NOWHERE, replica_index=0, timeout=5) as client:
        client._stub = stub = _MalformedStub()
        with pytest.raises(RecserveError) as refused:
            client.lookup(np.arange(2, dtype=np.uint64), 4, train=False)
        assert type(refused.value) is RecserveError
        assert refused.value.message == (
            "parameter server 127.0.0.1:1 (shard 0) sent a malformed answer: "
            "LookupResponse.rows: got 4 bytes, expected 32 for float32 [2, 4]"
        )
        blocks = client.export_rows(10)
        assert len(next(blocks)) == 1
        with pytest.raises(RecserveError) as refused:
            next(blocks)
        assert type(refused.value) is RecserveError
        assert "sent a malformed row chunk: RowChunk[1]" in refused.value.message
        assert stub.stream.cancelled  # the call is freed, not left open


def test_calls_take_the_deadline_they_are_given_else_their_default() -> None:
    with RemoteParameterServer(NOWHERE, timeout=7, checkpoint_timeout=90) as client:
        client._stub = stub = _MalformedStub()
        assert client.status(timeout=0.5).rows == 5
        assert client.status().rows == 5
        client.export_rows(10, timeout=2.5)
        client.export_rows(10)
    assert stub.timeouts == [0.5, 7.0, 2.5, 90.0]


def test_lookups_and_updates_say_which_replica_they_are_for() -> None:
    """So that a shard at another replica refuses them (ParameterServerServicer); the
    worker's clients know both the index and the count."""
    from embedding_store.remote_tier import RemoteShardTier

    class Stub:
        def __init__(self) -> None:
            self.requests: list = []

        def Lookup(self, request, timeout=None):
            self.requests.append(request)
            return pb.LookupResponse(rows=pack_f32(np.zeros((1, 4), np.float32)))

        def Update(self, request, timeout=None):
            self.requests.append(request)
            return pb.UpdateResponse(rows_updated=1)

    ids = np.arange(1, dtype=np.uint64)
    grads = np.ones((1, 4), np.float32)
    with (
        RemoteParameterServer(NOWHERE, replica_index=1, replica_size=3) as told,
        RemoteParameterServer(NOWHERE, replica_index=1) as untold,
    ):
        for client in (told, untold):
            client._stub = stub = Stub()
            client.lookup(ids, 4, train=False)
            client.update(ids, grads)
            assert [(r.replica_index, r.replica_size) for r in stub.requests] == (
                [(1, 3)] * 2 if client is told else [(0, 0)] * 2
            )
            stub.requests.clear()
    tier = RemoteShardTier(
        embedding_config_from_mapping({"slots_config": {"a": {"dim": 4}}}), [NOWHERE] * 2
    )
    try:
        assert [(c.replica_index, c.replica_size) for c in tier.clients] == [(0, 2), (1, 2)]
    finally:
        tier.close()


def test_a_lookup_takes_at_most_the_time_its_caller_has_left() -> None:
    """An embedding worker serving a lookup sets its caller's deadline (ps_client.
    caller_deadline): the shard call must end first, so a hung shard is named to the caller."""
    import time

    from embedding_store import ps_client

    class Stub:
        def __init__(self) -> None:
            self.timeouts: list[float] = []

        def Lookup(self, request, timeout=None):
            self.timeouts.append(timeout)
            return pb.LookupResponse(rows=pack_f32(np.zeros((1, 4), np.float32)))

        def Status(self, request, timeout=None):
            self.timeouts.append(timeout)
            return pb.ShardStatusResponse()

    ids = np.arange(1, dtype=np.uint64)
    with RemoteParameterServer(NOWHERE, timeout=7) as client:
        client._stub = stub = Stub()
        client.lookup(ids, 4, train=False)
        token = ps_client.caller_deadline.set(time.monotonic() + 2.0)
        try:
            client.lookup(ids, 4, train=False)
            client.status()
            client.status(timeout=0.5)  # its own deadline is the shorter
        finally:
            ps_client.caller_deadline.reset(token)
        token = ps_client.caller_deadline.set(time.monotonic() - 1.0)  # already past
        try:
            client.lookup(ids, 4, train=False)
        finally:
            ps_client.caller_deadline.reset(token)
        token = ps_client.caller_deadline.set(time.monotonic() + 60.0)  # later than its own
        try:
            client.lookup(ids, 4, train=False)
        finally:
            ps_client.caller_deadline.reset(token)
    default, left, status_left, status_own, past, later = stub.timeouts
    assert default == 7.0 and 1.5 < left <= 2.0 and 1.5 < status_left <= 2.0
    assert status_own == 0.5
    assert past == ps_client.MIN_LOOKUP_SECONDS and later == 7.0


def test_a_dump_returns_the_shards_file_entries_and_optimizer() -> None:
    with RemoteParameterServer(NOWHERE, timeout=7) as client:
        client._stub = _MalformedStub()
        (entry,), optimizer = client.dump("/ckpt")
    assert (entry.shard, entry.dim, entry.path, entry.rows) == (
        1,
        8,
        "shard_00001/dim_8.safetensors",
        3,
    )
    assert optimizer == {"type": "sgd", "lr": 0.5}


class _PendingLoad:
    """A Load call's future that never completes (or fails with ``failure``); records
    whether it was cancelled."""

    def __init__(self) -> None:
        self.cancelled = False
        self.failure: grpc.RpcError | None = None

    def result(self, timeout=None):
        if self.failure is not None:
            raise self.failure
        raise grpc.FutureTimeoutError()

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class _LoadStub:
    def __init__(self) -> None:
        self.Load = self  # ``stub.Load.future(...)``
        self.pending = _PendingLoad()
        self.timeouts: list[float | None] = []

    def future(self, request, timeout=None):
        self.timeouts.append(timeout)
        return self.pending


def test_a_load_whose_caller_gave_up_is_cancelled_and_raises_deadline_exceeded() -> None:
    asked = []

    def caller_gone() -> bool:
        asked.append(True)
        return len(asked) >= 2  # still there at the first check, gone at the second

    with RemoteParameterServer(NOWHERE, replica_index=1, timeout=5) as client:
        client._stub = stub = _LoadStub()
        with pytest.raises(DeadlineExceededError) as gave_up:
            client.load("/ckpt", timeout=30, caller_gone=caller_gone)
    assert stub.pending.cancelled  # the shard is told to abandon the load
    assert len(asked) == 2 and stub.timeouts == [30]
    assert gave_up.value.message == (
        "parameter server 127.0.0.1:1 (shard 1): load of /ckpt cancelled: its caller gave up"
    )


def test_a_watched_load_that_fails_raises_the_error_of_its_status() -> None:
    with RemoteParameterServer(NOWHERE, replica_index=1, checkpoint_timeout=90) as client:
        client._stub = stub = _LoadStub()
        stub.pending.failure = FailedCall(grpc.StatusCode.UNAVAILABLE, "connection reset")
        with pytest.raises(UnavailableError) as failed:
            client.load("/ckpt", caller_gone=lambda: False)
    assert failed.value.message == (
        "parameter server 127.0.0.1:1 (shard 1) is unavailable: connection reset"
    )
    assert stub.timeouts == [90]


def test_wait_for_serving_polls_until_serving_and_names_the_last_status() -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    with RemoteParameterServer(NOWHERE, replica_index=2, timeout=5) as client:
        client._health = health = HealthStub(not_serving, not_serving, serving)
        client.wait_for_serving(30)
        assert health.calls == 3
        client._health = health = HealthStub(not_serving)
        with pytest.raises(UnavailableError) as never:
            client.wait_for_serving(0)  # no time left: it fails without asking
        assert health.calls == 0
        assert never.value.message == (
            "parameter server 127.0.0.1:1 (shard 2) did not become SERVING within 0 s "
            "(last: no answer)"
        )


class _Channel:
    def __init__(self) -> None:
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


def test_close_closes_the_channel_once() -> None:
    client = RemoteParameterServer(NOWHERE)
    client._channel.close()
    client._channel = channel = _Channel()
    with client:
        pass  # entered and left: leaving closes it
    client.close()
    assert channel.closes == 1


@pytest.fixture
def shard_server() -> Iterator[tuple[str, EmbeddingShard]]:
    """A real ParameterServerServicer (dim 4, SGD) behind gRPC in this process."""
    shard = EmbeddingShard(100, optimizer=SGD())
    servicer = ParameterServerServicer(
        shard, EmbeddingConfig(slots_config={"a": SlotConfig(dim=4)}), job_type=JobType.TRAIN
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=server_options())
    add_servicer(server, servicer, "ParameterServer")
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", shard
    finally:
        server.stop(None)


def _block(first: int, rows: int) -> RowBlock:
    ids = np.arange(first, first + rows, dtype=np.uint64)
    return RowBlock(ids=ids, weights=np.full((rows, 4), 0.5, np.float32), state=None)


def test_import_rows_counts_rows_and_reraises_the_callers_own_error(shard_server) -> None:
    """An error raised by the caller's blocks is raised as is: gRPC only sees a cancelled
    call, which must not be reported as the shard being unavailable."""
    address, shard = shard_server
    with RemoteParameterServer(address, timeout=10) as client:
        assert client.import_rows([_block(0, 3), _block(10, 2)]) == 5
        assert shard.size() == 5

        def failing_blocks() -> Iterator[RowBlock]:
            yield _block(20, 1)
            raise OSError("the dump file went away")

        with pytest.raises(OSError, match="the dump file went away"):
            client.import_rows(failing_blocks())
        with pytest.raises(InvalidArgumentError) as refused:
            client.import_rows([_block(30, 1), "not a block"])  # type: ignore[list-item]
        assert refused.value.message == "import_rows needs RowBlock items, got str"
        rows = client.lookup(np.array([0, 11], dtype=np.uint64), 4, train=False)
        np.testing.assert_array_equal(rows, np.full((2, 4), 0.5, np.float32))
        rows[0, 0] = 1.0  # the answer is the caller's to change
        assert client.last_misses == 0


def test_status_reports_the_shards_embedding_config_in_its_order(shard_server) -> None:
    """Workers check it against theirs (RemoteShardTier.verify_shards)."""
    address, _ = shard_server
    with RemoteParameterServer(address, timeout=10) as client:
        reported = client.status().embedding_config
        assert reported == EmbeddingConfig(slots_config={"a": SlotConfig(dim=4)})
        client._stub = _ConfigStub('{"slots_config": [1]}')
        with pytest.raises(RecserveError) as malformed:
            client.status()
        assert malformed.value.message.startswith(
            f"parameter server {address} sent a malformed answer: "
        )
        client._stub = _ConfigStub("")  # a shard that predates the field
        assert client.status().embedding_config is None


class _ConfigStub:
    def __init__(self, text: str) -> None:
        self.text = text

    def Status(self, request, timeout=None):
        return pb.ShardStatusResponse(embedding_config_json=self.text)


def test_row_chunks_round_trip_through_a_real_shard(shard_server) -> None:
    address, _ = shard_server
    with RemoteParameterServer(address, timeout=10) as client:
        assert client.import_rows([_block(0, 5)]) == 5
        blocks = list(client.export_rows(2))
        assert [len(b) for b in blocks] == [2, 2, 1]
        assert sorted(int(i) for b in blocks for i in b.ids) == [0, 1, 2, 3, 4]
        update = client.update(np.array([0, 1], dtype=np.uint64), np.ones((2, 4), dtype=np.float32))
        assert update == 2
        assert pack_f32(client.lookup(np.array([0], np.uint64), 4, train=False)) == pack_f32(
            np.full((1, 4), 0.5 - 0.01, np.float32)
        )


def test_eval_lookups_of_unknown_ids_answer_zeros_and_count_misses(shard_server) -> None:
    address, shard = shard_server
    with RemoteParameterServer(address, timeout=10) as client:
        unknown = np.array([50, 51, 52], dtype=np.uint64)
        rows, misses = client.lookup_with_misses(unknown, 4, train=False)
        assert misses == 3 and client.last_misses == 3
        np.testing.assert_array_equal(rows, np.zeros((3, 4), np.float32))
        assert shard.size() == 0  # an eval lookup makes no row
        client.lookup(unknown[:2], 4, train=True)
        assert shard.size() == 2 and client.last_misses == 0
        status = client.status()
        assert (status.rows, status.lookups, status.ids_looked_up) == (2, 2, 5)


def test_an_eval_lookup_says_which_positions_were_unknown(shard_server) -> None:
    """LookupResponse.missing: per position of the IDs asked, duplicates included; from a
    shard that predates the field only the count is known."""
    address, _ = shard_server
    with RemoteParameterServer(address, timeout=10) as client:
        client.lookup(np.array([1, 2], np.uint64), 4, train=True)
        asked = np.array([1, 7, 2, 7, 9], np.uint64)
        assert client.lookup_with_misses(asked, 4, train=False)[1] == 3
        assert client.last_missing is not None
        assert client.last_missing.tolist() == [False, True, False, True, True]
        client.lookup(asked[[0, 2]], 4, train=False)
        assert (client.last_misses, client.last_missing) == (0, None)
        client._stub = _LookupStub(misses=2, missing=b"")  # an older shard: a count only
        client.lookup(asked[:4], 4, train=False)
        assert (client.last_misses, client.last_missing) == (2, None)
        client._stub = _LookupStub(misses=2, missing=bytes([0b0100_0000]))  # 1 flag, not 2
        with pytest.raises(RecserveError, match=r"LookupResponse\.missing marks 1 of 4 IDs"):
            client.lookup(asked[:4], 4, train=False)


class _LookupStub:
    def __init__(self, misses: int, missing: bytes) -> None:
        self.misses, self.missing = misses, missing

    def Lookup(self, request, timeout=None):
        rows = np.zeros((len(request.ids) // 8, request.dim), np.float32)
        return pb.LookupResponse(rows=pack_f32(rows), misses=self.misses, missing=self.missing)


class _FlakyUpdateStub:
    """Fails Update with each of ``failures`` (code, details) in turn, then applies it."""

    def __init__(self, *failures: tuple[grpc.StatusCode, str]) -> None:
        self.failures = list(failures)
        self.updates = 0

    def Update(self, request, timeout=None):
        self.updates += 1
        if self.failures:
            raise FailedCall(*self.failures.pop(0))
        return pb.UpdateResponse(rows_updated=len(request.ids) // 8)


def test_an_update_is_resent_while_the_shard_cannot_be_reached_never_once_it_may_have_landed(
    monkeypatch,
) -> None:
    """The embedding worker's pushes ride out a shard restart: an update that found no
    connection never left and is sent again (within ``update_retry_seconds``); one that failed
    in flight may have been applied, and applying it twice would be wrong. A shard restarted
    with --load-checkpoint refuses updates until loaded, before applying them: resent too."""
    monkeypatch.setattr("embedding_store.grpc_common.RETRY_FIRST_PAUSE_SECONDS", 0.001)
    refused = "failed to connect to all addresses; last error: Connection refused"
    loading = "this training parameter server has not loaded its embedding checkpoint yet"
    ids, grads = np.arange(3, dtype=np.uint64), np.ones((3, 2), np.float32)
    with RemoteParameterServer(NOWHERE, replica_index=1, update_retry_seconds=5) as client:
        client._stub = stub = _FlakyUpdateStub(
            (grpc.StatusCode.UNAVAILABLE, refused), (grpc.StatusCode.UNAVAILABLE, loading)
        )
        assert client.update(ids, grads) == 3
        assert stub.updates == 3
        client._stub = stub = _FlakyUpdateStub((grpc.StatusCode.UNAVAILABLE, "Socket closed"))
        with pytest.raises(UnavailableError, match=r"^parameter server 127\.0\.0\.1:1 \(shard 1\)"):
            client.update(ids, grads)
        assert stub.updates == 1
