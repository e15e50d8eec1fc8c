"""RemoteShardTier and its gRPC servicer over fake shard clients: the bounded gradient queue
(backpressure, dead shards), checkpoint progress in Status, the dump failure path, metrics.

The fakes stand in for ``RemoteParameterServer``: a real in-process :class:`EmbeddingShard`
behind the client's methods, plus hooks that run first in ``update``/``dump``/``load`` so a
test can hold a call (an Event) or fail it. Everything that waits is bounded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health, health_pb2
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from embedding_store import (
    checkpoint_dump,
    checkpoint_load,
    checkpoint_manifest,
    worker_service,
)
from embedding_store.batch import Batch, IDTypeFeature, IDTypeFeatureWithSingleID
from embedding_store.config import embedding_config_from_mapping
from embedding_store.errors import (
    CheckpointError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from embedding_store.optimizers import SGD
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.ps_client import ShardStatus
from embedding_store.remote_tier import RemoteShardTier
from embedding_store.shard import EmbeddingShard
from embedding_store.tier import TierStatus
from embedding_store.worker_command import format_status
from embedding_store.worker_service import EmbeddingWorkerServicer
from embedding_store.worker_wire import decode_unknown_per_sample, pack_grads

DIM = 4
CONFIG = embedding_config_from_mapping(
    {"slots_config": {"user": {"dim": DIM}, "items": {"dim": DIM}}}
)
WAIT = 10.0  # upper bound of every wait on an event; tests pass long before


class FakeShardClient:
    """A ``RemoteParameterServer`` stand-in: a real shard, and hooks run before update, dump
    and load (to hold or fail them). Like a parameter server, its status reports the task it
    is busy with."""

    def __init__(self, index: int, size: int) -> None:
        self.index = index
        self.address = f"fake-{index}:7000"
        self.peer = f"parameter server {self.address} (shard {index})"
        self.shard = EmbeddingShard(
            1000, optimizer=SGD(lr=1.0), replica_index=index, replica_size=size
        )
        self.on_update: Callable[[], None] | None = None
        self.on_dump: Callable[[], None] | None = None
        self.on_load: Callable[[], None] | None = None
        self.on_status: Callable[[], None] | None = None
        self.serving = True
        self.config = CONFIG  # the embedding config its status reports
        self.updates = 0
        self.clears = 0
        self.task = ""

    @property
    def last_misses(self) -> int:
        return self.shard.last_misses

    @property
    def last_missing(self) -> np.ndarray | None:
        return self.shard.last_missing

    def lookup(self, ids: np.ndarray, dim: int, *, train: bool) -> np.ndarray:
        return self.shard.lookup(ids, dim, train=train)

    def update(self, ids: np.ndarray, grads: np.ndarray) -> int:
        if self.on_update:
            self.on_update()
        self.updates += 1
        return self.shard.update(ids, grads)

    def configure(self, optimizer=None, initialization=None) -> None:
        self.shard.configure(optimizer=optimizer, initialization=initialization)

    def dump(self, directory: str):
        self.task = "dumping"
        try:
            if self.on_dump:
                self.on_dump()
            entries = checkpoint_dump.write_shard_part(self.shard, directory, self.index)
        finally:
            self.task = ""
        # As a parameter server answers: no settings when it has no optimizer.
        optimizer = self.shard.optimizer
        return entries, None if optimizer is None else optimizer.to_dict()

    def load(self, directory: str, *, caller_gone: Callable[[], bool] | None = None) -> int:
        self.task = "loading"
        try:
            if self.on_load:
                self.on_load()
            checkpoint_load.load_into_shard(
                directory,
                self.shard,
                CONFIG,
                replica_index=self.shard.replica_index,
                replica_size=self.shard.replica_size,
            )
        finally:
            self.task = ""
        return self.shard.size()

    def clear(self) -> None:
        self.clears += 1
        self.shard.clear()

    def import_rows(self, blocks) -> int:
        rows = 0
        for block in blocks:
            self.shard.import_rows(block)
            rows += len(block.ids)
        return rows

    def status(self, *, timeout: float | None = None) -> ShardStatus:
        if self.on_status:
            self.on_status()
        stats = self.shard.stats()
        return ShardStatus(
            replica_index=self.shard.replica_index,
            replica_size=self.shard.replica_size,
            rows=stats.rows,
            capacity=stats.capacity,
            read_only=False,
            job_type="Train",
            # As a parameter server reports it: its optimizer's settings, "" for none.
            optimizer_json=""
            if self.shard.optimizer is None
            else json.dumps(self.shard.optimizer.to_dict()),
            serving=self.serving,
            lookups=stats.lookups,
            ids_looked_up=stats.ids_looked_up,
            misses=stats.misses,
            evictions=stats.evictions,
            task=self.task,
            task_progress=0.0,
            embedding_config=self.config,
        )

    def close(self) -> None:
        """Nothing to release: the fake holds no shards, threads or channels."""


class AbortedRpcError(Exception):
    """What ``context.abort`` raises here (gRPC raises its own exception type)."""


class FakeContext:
    remaining: float | None = None  # seconds before the caller's deadline (None: no deadline)

    def abort(self, code: grpc.StatusCode, details: str):
        raise AbortedRpcError(code, details)

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> float | None:
        return self.remaining


@pytest.fixture
def make_tier() -> Iterator[Callable[..., tuple[RemoteShardTier, list[FakeShardClient]]]]:
    """``make_tier(num_shards, forward_buffer_size) -> (tier, fakes)``; closed at teardown."""
    tiers = []

    def make(num_shards: int = 2, forward_buffer_size: int = 1000):
        fakes = [FakeShardClient(i, num_shards) for i in range(num_shards)]
        tier = RemoteShardTier(
            CONFIG,
            [fake.address for fake in fakes],
            forward_buffer_size=forward_buffer_size,
            connect=lambda address, index: fakes[index],
        )
        tiers.append((tier, fakes))
        return tier, fakes

    yield make
    for tier, fakes in tiers:
        for fake in fakes:  # nothing may stay held, or close() would wait for the pusher
            fake.on_update = fake.on_dump = fake.on_load = None
        tier.close()


def user_batch(ids: list[int]) -> Batch:
    return Batch([IDTypeFeatureWithSingleID.from_ids("user", ids)], requires_grad=False)


def ones(n: int) -> dict[str, torch.Tensor]:
    return {"user": torch.ones(n, DIM)}


def held(entered: threading.Event, release: threading.Event) -> Callable[[], None]:
    """A hook that signals ``entered`` and then waits (bounded) for ``release``."""

    def hook() -> None:
        entered.set()
        if not release.wait(WAIT):
            raise TimeoutError("the test never released this call")

    return hook


# --------------------------------------------------------------------------- gradient queue
def test_a_full_gradient_buffer_blocks_backward_until_the_pusher_drains_it(make_tier):
    tier, (shard,) = make_tier(num_shards=1, forward_buffer_size=2)
    entered, release = threading.Event(), threading.Event()
    shard.on_update = held(entered, release)

    first = tier.lookup(user_batch([1, 2, 3]), train=True)
    tier.backward(first.ref, ones(3))
    assert entered.wait(WAIT)  # the pusher holds batch 1 inside the shard's update
    for ids in ([4, 5], [6]):
        result = tier.lookup(user_batch(ids), train=True)
        tier.backward(result.ref, ones(len(ids)))
    assert tier.pending_gradient_batches == 2  # the buffer is full
    assert tier.status().pending_gradient_batches == 2
    # The queued batches claimed their forward contexts: this lookup expires none of them.
    last = tier.lookup(user_batch([7, 8]), train=True)
    assert tier.worker.pending_backward == 1
    assert tier.worker.expired_forward_contexts == 0

    blocked = threading.Thread(target=tier.backward, args=(last.ref, ones(2)))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive(), "backward returned although the gradient buffer was full"
    assert tier.pending_gradient_batches == 2

    release.set()
    blocked.join(WAIT)
    assert not blocked.is_alive()
    tier.flush()
    assert tier.pending_gradient_batches == 0
    stats = tier.stats()
    assert (stats.gradient_batches_pushed, stats.gradient_rows_pushed) == (4, 8)
    assert stats.failed_gradient_pushes == 0
    assert shard.updates == 4
    assert shard.shard.stats().updates == 8  # every row of the 4 batches reached the shard


def test_pushes_to_a_dead_shard_fail_are_counted_and_drain_the_queue(make_tier, tmp_path):
    tier, (shard,) = make_tier(num_shards=1, forward_buffer_size=2)

    def dead() -> None:  # what RemoteParameterServer raises once the shard deadline passed
        raise UnavailableError(f"{shard.peer} did not answer within the deadline")

    shard.on_update = dead
    for ids in ([1, 2], [3], [4, 5, 6], [7]):  # more batches than the buffer holds
        result = tier.lookup(user_batch(ids), train=True)
        tier.backward(result.ref, ones(len(ids)))  # failed pushes leave the queue: no hang
    # An administrator's dump meanwhile waits for the queue but leaves the report to the
    # trainer: the trainer whose updates were lost must hear of it.
    tier.dump(tmp_path / "ckpt", overwrite=False, progress=lambda *_: None)
    with pytest.raises(UnavailableError) as failure:
        tier.flush()
    assert failure.value.message == (
        "4 gradient batch(es) could not be applied since the last flush; last error: "
        "parameter server fake-0:7000 (shard 0) did not answer within the deadline"
    )
    assert tier.pending_gradient_batches == 0
    stats = tier.stats()
    assert (stats.failed_gradient_pushes, stats.gradient_batches_pushed) == (4, 0)
    assert stats.gradient_rows_pushed == 0
    tier.flush()  # failures are reported once

    shard.on_update = None  # the shard is back: pushes go through again
    result = tier.lookup(user_batch([1, 2]), train=True)
    tier.backward(result.ref, ones(2))
    tier.flush()
    stats = tier.stats()
    assert (stats.failed_gradient_pushes, stats.gradient_batches_pushed) == (4, 1)
    assert stats.gradient_rows_pushed == 2


def test_clear_waits_for_the_gradient_push_under_way(make_tier):
    # Administration runs after the queued gradients: a clear that did not wait would be
    # undone by the update still on its way (rows trained back into the cleared shard).
    tier, (shard,) = make_tier(num_shards=1)
    entered, release = threading.Event(), threading.Event()
    shard.on_update = held(entered, release)
    result = tier.lookup(user_batch([1, 2, 3]), train=True)
    tier.backward(result.ref, ones(3))
    assert entered.wait(WAIT)

    clearing = threading.Thread(target=tier.clear)
    clearing.start()
    clearing.join(0.3)
    assert clearing.is_alive(), "clear ran while a gradient push was under way"
    assert shard.clears == 0
    release.set()
    clearing.join(WAIT)
    assert not clearing.is_alive()
    assert (shard.updates, shard.clears) == (1, 1)
    assert tier.status().rows_per_shard == (0,)
    tier.flush()


def test_backward_of_an_unknown_ref_fails_at_once(make_tier):
    tier, _ = make_tier(num_shards=1)
    with pytest.raises(NotFoundError, match="no forward context 12345"):
        tier.backward(12345, ones(1))
    assert tier.pending_gradient_batches == 0
    tier.flush()  # nothing was queued, nothing failed


# --------------------------------------------------------------------------- Status progress
def status_summary(servicer: EmbeddingWorkerServicer) -> tuple:
    """(worker task, its progress, per-shard tasks) as the Status RPC answers them."""
    status = servicer.Status(pb.WorkerStatusRequest(), FakeContext())
    return status.task, status.task_progress, tuple(s.task for s in status.shard_status)


def hold_all(fakes: list[FakeShardClient], hook: str) -> tuple[list, list]:
    """Hold ``hook`` ("on_dump"/"on_load") of every fake: (entered events, release events)."""
    entered = [threading.Event() for _ in fakes]
    release = [threading.Event() for _ in fakes]
    for fake, went_in, go in zip(fakes, entered, release):
        setattr(fake, hook, held(went_in, go))
    return entered, release


# Status is asked from within the Progress stream: the worker records each step before it
# sends it, and the fake shards are held where the test says, so every answer is exact.
def test_status_reports_a_dump_while_it_runs_and_idle_after(make_tier, tmp_path):
    tier, fakes = make_tier(num_shards=2)
    servicer = EmbeddingWorkerServicer(tier)
    tier.lookup(user_batch(list(range(20))), train=True)
    assert status_summary(servicer) == ("", 0.0, ("", ""))
    entered, release = hold_all(fakes, "on_dump")
    seen = []
    request = pb.WorkerDumpRequest(directory=str(tmp_path / "ckpt"))
    for update in servicer.Dump(request, FakeContext()):
        if (update.stage, update.done) == ("dump", 0):
            assert all(event.wait(WAIT) for event in entered)  # both shards are writing
            seen.append(status_summary(servicer))
            release[0].set()  # shard 0 finishes; shard 1 stays busy
        elif (update.stage, update.done) == ("dump", 1):
            seen.append(status_summary(servicer))
            release[1].set()
        seen.append((update.stage, update.done, update.total))
    assert seen == [
        ("dumping", 0.0, ("dumping", "dumping")),
        ("dump", 0, 2),
        ("dumping", 0.5, ("", "dumping")),
        ("dump", 1, 2),
        ("dump", 2, 2),
        ("done", 20, 20),
    ]
    assert status_summary(servicer) == ("", 0.0, ("", ""))


def test_status_reports_a_load_while_it_runs_and_idle_after(make_tier, tmp_path):
    tier, fakes = make_tier(num_shards=2)
    servicer = EmbeddingWorkerServicer(tier)
    tier.lookup(user_batch(list(range(20))), train=True)
    tier.dump(tmp_path / "ckpt")
    entered, release = hold_all(fakes, "on_load")
    seen = []
    request = pb.WorkerLoadRequest(directory=str(tmp_path / "ckpt"))
    for update in servicer.Load(request, FakeContext()):
        if (update.stage, update.done) == ("load", 0):
            assert all(event.wait(WAIT) for event in entered)  # both shards are loading
            seen.append(status_summary(servicer))
            for event in release:
                event.set()
        seen.append((update.stage, update.done, update.total))
    assert seen == [
        ("loading", 0.0, ("loading", "loading")),
        ("load", 0, 2),
        ("load", 2, 2),  # same shard count: each shard loads its own part at once
        ("done", 20, 20),
    ]
    assert status_summary(servicer) == ("", 0.0, ("", ""))


def test_a_second_checkpoint_task_is_refused_while_one_runs(make_tier, tmp_path):
    tier, fakes = make_tier(num_shards=2)
    entered, release = threading.Event(), threading.Event()
    fakes[0].on_dump = held(entered, release)
    first = threading.Thread(target=tier.dump, args=(tmp_path / "a",))
    first.start()
    try:
        assert entered.wait(WAIT)
        with pytest.raises(UnavailableError, match="busy dumping a checkpoint; retry"):
            tier.load(tmp_path / "a")
    finally:
        release.set()
        first.join(WAIT)
    assert (tmp_path / "a" / checkpoint_manifest.DONE_MARKER).exists()


def test_partial_status_reports_a_silent_shard_in_its_place(make_tier):
    tier, fakes = make_tier(num_shards=3)
    tier.lookup(user_batch(list(range(30))), train=True)
    rows = [fake.shard.size() for fake in fakes]
    assert all(rows)

    def refused() -> ShardStatus:
        raise UnavailableError(f"{fakes[1].peer}: connection refused")

    fakes[1].status = refused
    with pytest.raises(UnavailableError, match="connection refused"):
        tier.status()
    status = tier.status(partial=True)
    assert status.shard_errors == (
        "",
        "parameter server fake-1:7000 (shard 1): connection refused",
        "",
    )
    assert status.rows_per_shard == (rows[0], 0, rows[2])
    assert status.capacity_per_shard == (1000, 0, 1000)
    assert status.shard_serving == (True, False, True)
    assert status.shard_tasks == ("", "", "")


def test_status_carries_the_workers_forward_buffer_size_to_its_clients(make_tier):
    """A trainer checks its embedding_staleness x the ranks sharing the worker against the
    number of forward contexts the worker keeps (TrainCtx): its own config's, reported in
    Status, not the trainer's copy of it; 0 from a worker that predates the field."""
    from embedding_store.worker_client import RemoteEmbeddingWorker

    tier, _ = make_tier(forward_buffer_size=12)
    answer = EmbeddingWorkerServicer(tier).Status(pb.WorkerStatusRequest(), FakeContext())
    assert answer.forward_buffer_size == 12

    class Stub:
        response = answer

        def Status(self, request, timeout=None):
            return self.response

    with RemoteEmbeddingWorker("127.0.0.1:1", CONFIG) as client:
        client._stub = stub = Stub()
        assert client.status(partial=True).forward_buffer_size == 12
        # The shards' addresses too: the server's tier check names a shard by its own.
        assert client.status().shard_addresses == ("fake-0:7000", "fake-1:7000")
        stub.response = pb.WorkerStatusResponse()  # a worker that predates the field
        assert client.status().forward_buffer_size == 0


def test_abandoned_forward_contexts_go_with_the_next_lookup(make_tier):
    """A trainer's forward left without backward (its loss raised) kept its context in the
    worker's buffer until it expired. The client sends the refs to drop with its next lookup
    (no call of its own); the worker drops them first, and ignores refs it no longer has."""
    from embedding_store.worker_client import RemoteEmbeddingWorker

    tier, _ = make_tier()
    servicer = EmbeddingWorkerServicer(tier)

    class Stub:
        def __init__(self) -> None:
            self.requests: list[pb.WorkerLookupRequest] = []
            self.fail = False

        def Lookup(self, request, timeout=None):
            self.requests.append(request)
            if self.fail:
                raise UnavailableError("embedding worker 127.0.0.1:1: connection refused")
            return servicer.Lookup(request, FakeContext())

    batch = user_batch([1, 2, 3])
    with RemoteEmbeddingWorker("127.0.0.1:1", CONFIG) as client:
        client._stub = stub = Stub()
        first, second = (client.lookup(batch, train=True).ref for _ in range(2))
        client.drop_forward_contexts([first, 999])  # 999: unknown to the worker
        assert tier.worker.pending_backward == 2  # nothing sent yet
        stub.fail = True  # a lookup that fails keeps them for the next one
        with pytest.raises(UnavailableError):
            client.lookup(batch, train=False)
        stub.fail = False
        third = client.lookup(batch, train=True).ref
        client.lookup(batch, train=False)
    assert [list(r.drop_refs) for r in stub.requests] == [[], [], [first, 999], [first, 999], []]
    assert tier.worker.pending_backward == 2 and tier.worker.expired_forward_contexts == 0
    with pytest.raises(NotFoundError, match=f"no forward context {first}:"):
        tier.worker.take_forward_context(first)
    for ref in (second, third):
        tier.worker.take_forward_context(ref)


def test_status_carries_the_workers_embedding_config_to_its_clients(make_tier):
    """Servers check the config a worker routes and pools IDs by against their checkpoint's
    (serving.model.worker_config_mismatch): it travels in Status, parsed once per text."""
    from embedding_store.errors import RecserveError
    from embedding_store.worker_client import RemoteEmbeddingWorker

    tier, _ = make_tier()
    answer = EmbeddingWorkerServicer(tier).Status(pb.WorkerStatusRequest(), FakeContext())

    class Stub:
        response = answer

        def Status(self, request, timeout=None):
            return self.response

    with RemoteEmbeddingWorker("127.0.0.1:1", CONFIG) as client:
        client._stub = stub = Stub()
        reported = client.status().embedding_config
        assert reported == CONFIG
        # The slots' order gives their ID prefixes ("items" sorts before "user").
        assert reported.slot_names == CONFIG.slot_names == ("user", "items")
        assert [reported.index_prefix(name) for name in CONFIG.slot_names] == [
            CONFIG.index_prefix(name) for name in CONFIG.slot_names
        ]
        assert client.status().embedding_config is reported  # parsed once
        stub.response = pb.WorkerStatusResponse()  # a worker that predates the field
        assert client.status().embedding_config is None
        stub.response = pb.WorkerStatusResponse(embedding_config_json='{"slots_config": 3}')
        with pytest.raises(RecserveError) as malformed:
            client.status()
        assert malformed.value.message.startswith(
            "embedding worker 127.0.0.1:1 sent a malformed answer: "
        )


def test_format_status_shows_tasks_of_shards_and_worker():
    status = TierStatus(
        rows_per_shard=(5, 7),
        capacity_per_shard=(10, 10),
        pending_backward=0,
        pending_gradient_batches=1,
        nonfinite_rows_skipped=2,
        shard_tasks=("dumping", ""),
        shard_task_progress=(0.0, 0.0),
        task="dumping",
        task_progress=0.5,
        shard_checkpoint_versions=("0123456789abcdef", ""),
    )
    assert format_status(status) == [
        "shard 0: 5 rows of 10, dumping 0%, checkpoint 0123456789abcdef",
        "shard 1: 7 rows of 10, idle, checkpoint none",
        "worker: dumping 50%",
        "pending backward: 0, pending gradient batches: 1, non-finite rows skipped: 2",
    ]
    partial = dataclasses.replace(status, shard_errors=("", "parameter server a:1: refused"))
    assert format_status(partial)[:2] == [
        "shard 0: 5 rows of 10, dumping 0%, checkpoint 0123456789abcdef",
        "shard 1: NO ANSWER: parameter server a:1: refused",
    ]


# --------------------------------------------------------------------------- dump failure
def test_a_failed_shard_dump_publishes_nothing_and_names_the_shard(make_tier, tmp_path):
    tier, fakes = make_tier(num_shards=2)
    servicer = EmbeddingWorkerServicer(tier)
    tier.lookup(user_batch(list(range(20))), train=True)
    root = tmp_path / "checkpoints"
    root.mkdir()
    target = root / "ckpt"
    failed, release = threading.Event(), threading.Event()

    def refuse() -> None:
        failed.set()
        raise UnavailableError(f"{fakes[0].peer} is unavailable: Socket closed")

    fakes[0].on_dump = refuse
    fakes[1].on_dump = held(threading.Event(), release)  # still writing when shard 0 fails
    outcome: dict[str, BaseException] = {}

    def dump() -> None:
        try:
            list(servicer.Dump(pb.WorkerDumpRequest(directory=str(target)), FakeContext()))
        except AbortedRpcError as error:
            outcome["error"] = error

    thread = threading.Thread(target=dump)
    thread.start()
    assert failed.wait(WAIT)
    thread.join(0.3)
    assert thread.is_alive(), "the dump gave up before shard 1 finished writing"
    release.set()
    thread.join(WAIT)
    code, details = outcome["error"].args
    assert code == grpc.StatusCode.UNAVAILABLE
    assert details == (
        f"checkpoint {target} not written (no manifest, no done-marker): "
        "parameter server fake-0:7000 (shard 0) is unavailable: Socket closed"
    )
    # No target, no manifest, no done-marker, and no staging directory left behind (shard 1's
    # part, written after shard 0 failed, went with it).
    assert list(root.iterdir()) == []
    assert status_summary(servicer) == ("", 0.0, ("", ""))

    fakes[0].on_dump = fakes[1].on_dump = None  # the shard is back: the same dump succeeds
    manifest = tier.dump(target)
    assert manifest.num_shards == 2 and manifest.total_rows == 20
    assert (target / checkpoint_manifest.DONE_MARKER).exists()


def test_a_shard_with_non_finite_rows_fails_the_dump_and_the_last_checkpoint_stays(
    make_tier, tmp_path
):
    """In a distributed run each shard checks its own rows as it writes them: one whose rows
    diverged fails its part, so the worker never writes the manifest and never replaces
    the checkpoint already at the target (the one a server would reload)."""
    tier, fakes = make_tier(num_shards=2)
    servicer = EmbeddingWorkerServicer(tier)
    tier.lookup(user_batch(list(range(20))), train=True)
    target = tmp_path / "ckpt"
    tier.dump(target)
    published = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}
    shard = fakes[1].shard
    ids = shard.export_all()[DIM].ids[:1]  # its first row, in row order
    shard.configure(optimizer=SGD(lr=1e30))  # a learning rate far too high: -inf
    shard.update(ids, np.full((1, DIM), 1e10, np.float32))
    with pytest.raises(AbortedRpcError) as raised:
        request = pb.WorkerDumpRequest(directory=str(target), overwrite=True)
        list(servicer.Dump(request, FakeContext()))
    code, details = raised.value.args
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details.startswith(
        f"checkpoint {target} not written (no manifest, no done-marker): embedding shard 1 "
        "cannot be dumped: the weights of its rows of dim 4 hold 4 non-finite value(s) (NaN "
        f"or Inf), the first at [0, 0]: -inf (the row of ID {int(ids[0])}). "
    )
    assert {p: p.read_bytes() for p in target.rglob("*") if p.is_file()} == published
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # shard 0's part went too


def test_a_lookups_shard_calls_end_before_the_callers_deadline(make_tier):
    """A server's lookup deadline (--lookup-timeout 5 s) is shorter than the worker's shard
    deadline (10 s): a hung shard left the server only "the worker did not answer". The
    shard calls, on this thread and on the pool's, now see the caller's deadline less a
    margin (ps_client.caller_deadline, which RemoteParameterServer.lookup honours)."""
    import time

    from embedding_store import ps_client

    tier, fakes = make_tier(num_shards=2)
    seen: dict[int, float | None] = {}
    for fake in fakes:

        def lookup(ids, dim, *, train, fake=fake):
            seen[fake.index] = ps_client.caller_deadline.get()
            return fake.shard.lookup(ids, dim, train=train)

        fake.lookup = lookup
    servicer = EmbeddingWorkerServicer(tier)
    request = pb.WorkerLookupRequest(batch=user_batch(list(range(16))).to_bytes())
    context = FakeContext()
    context.remaining = 2.0
    before = time.monotonic()
    servicer.Lookup(request, context)
    after = time.monotonic()
    assert sorted(seen) == [0, 1]  # both shards were asked
    for deadline in seen.values():  # 2 s less a tenth (under the 0.25 s cap)
        assert deadline is not None and before + 1.8 <= deadline <= after + 1.8
    assert ps_client.caller_deadline.get() is None  # reset after the call
    context.remaining = 60.0
    servicer.Lookup(request, context)
    for deadline in seen.values():  # the margin is capped
        assert deadline is not None and after + 59.75 <= deadline <= time.monotonic() + 59.75
    seen.clear()
    context.remaining = None  # no deadline: the shard clients' own
    servicer.Lookup(request, context)
    assert seen == {0: None, 1: None}
    # Status too (a server's tier check), whose shard calls all run on the pool's threads.
    for fake in fakes:
        fake.on_status = lambda fake=fake: seen.__setitem__(
            fake.index, ps_client.caller_deadline.get()
        )
    seen.clear()
    context.remaining = 2.0
    before = time.monotonic()
    servicer.Status(pb.WorkerStatusRequest(), context)
    after = time.monotonic()
    assert sorted(seen) == [0, 1]
    for deadline in seen.values():
        assert deadline is not None and before + 1.8 <= deadline <= after + 1.8


# --------------------------------------------------------------------------- metrics
def test_metrics_count_lookups_ids_pushes_and_rpc_errors(make_tier):
    tier, _ = make_tier(num_shards=2)
    servicer = EmbeddingWorkerServicer(tier)
    context = FakeContext()
    batch = Batch(
        [
            IDTypeFeatureWithSingleID.from_ids("user", [1, 2, 3]),
            IDTypeFeature.from_lists("items", [[10, 11], [10], []]),
        ],
        requires_grad=False,
    )
    request = pb.WorkerLookupRequest(batch=batch.to_bytes(), train=False)
    answer = servicer.Lookup(request, context)
    # Every ID is unknown: 6 occurrences (10 twice), though the shards were asked 5 IDs.
    assert answer.unknown_ids == 6
    assert decode_unknown_per_sample(answer.unknown_per_sample, 3, 6).tolist() == [3, 2, 1]
    refs = [
        servicer.Lookup(pb.WorkerLookupRequest(batch=batch.to_bytes(), train=True), context).ref
        for _ in range(2)
    ]
    grads = {"user": torch.ones(3, DIM), "items": torch.ones(3, DIM)}
    grads["user"][0, 1] = float("nan")  # ID 1's row gets a NaN: skipped, not pushed
    for ref in refs:
        backward = pb.BackwardRequest(ref=ref)
        pack_grads(backward.grads, grads)
        servicer.Backward(backward, context)
        grads = {"user": torch.ones(3, DIM), "items": torch.ones(3, DIM)}
    servicer.Flush(pb.FlushRequest(), context)
    with pytest.raises(AbortedRpcError):
        servicer.Lookup(pb.WorkerLookupRequest(batch=b"not a batch"), context)

    text = generate_latest(servicer.metrics.registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("recserve_worker_lookups_total", mode="train") == 2
    assert value("recserve_worker_lookups_total", mode="eval") == 1
    assert value("recserve_worker_ids_looked_up_total", mode="train") == 12
    assert value("recserve_worker_ids_looked_up_total", mode="eval") == 6
    assert value("recserve_worker_unknown_ids_total") == 6
    # Its help says what it counts: occurrences (6), not distinct IDs (5) as it used to say.
    helps = {family.name: family.documentation for family in text_string_to_metric_families(text)}
    assert helps["recserve_worker_unknown_ids"] == (
        "ID occurrences answered with zeros: unknown to eval/infer lookups, or not admitted by "
        "train lookups (an ID repeated in a lookup counts each time, although its shard is "
        "asked for it once)."
    )
    assert value("recserve_worker_gradient_batches_pushed_total") == 2
    assert value("recserve_worker_gradient_rows_pushed_total") == 4 + 5
    assert value("recserve_worker_nonfinite_gradient_rows_skipped_total") == 1
    assert value("recserve_worker_failed_gradient_pushes_total") == 0
    assert value("recserve_worker_pending_gradient_batches") == 0
    assert value("recserve_worker_pending_forward_contexts") == 0
    assert value("recserve_worker_rpc_latency_seconds_count", method="Lookup") == 4
    assert value("recserve_worker_rpc_latency_seconds_count", method="Backward") == 2
    assert value("recserve_worker_rpc_errors_total", method="Lookup", code="INVALID_ARGUMENT") == 1
    if shutil.which("promtool"):
        check = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
        )
        assert check.returncode == 0, check.stdout + check.stderr


def _trained_checkpoint(make_tier, directory, ids: list[int]) -> np.ndarray:
    """Train rows for ``ids`` on a 2-shard tier, dump them; returns their eval rows."""
    tier, _ = make_tier(2)
    result = tier.lookup(user_batch(ids), train=True)
    tier.backward(result.ref, ones(len(ids)))
    tier.flush()
    tier.dump(directory)
    return tier.lookup(user_batch(ids), train=False).slots[0].embeddings.numpy()


def test_reshard_load_gives_every_shard_its_rows(make_tier, tmp_path):
    ids = list(range(40))
    expected = _trained_checkpoint(make_tier, tmp_path / "ckpt", ids)
    tier, fakes = make_tier(3)
    manifest = tier.load(tmp_path / "ckpt")
    assert checkpoint_load.count_rows_per_replica(manifest, 3) == [f.shard.size() for f in fakes]
    assert sum(f.shard.size() for f in fakes) == 40
    got = tier.lookup(user_batch(ids), train=False).slots[0].embeddings.numpy()
    np.testing.assert_array_equal(got, expected)


def test_reshard_load_over_capacity_changes_no_shard(make_tier, tmp_path):
    _trained_checkpoint(make_tier, tmp_path / "ckpt", list(range(40)))
    tier, fakes = make_tier(3)
    tier.lookup(user_batch([7]), train=True)  # rows the failed load must leave alone
    small = EmbeddingShard(5, optimizer=SGD(lr=1.0), replica_index=2, replica_size=3)
    fakes[2].shard = small  # too small for its ~13 rows of the checkpoint
    rows_before = [f.shard.size() for f in fakes]
    with pytest.raises(CheckpointError, match=r"shard 2 .* more than its capacity 5"):
        tier.load(tmp_path / "ckpt")
    assert [f.shard.size() for f in fakes] == rows_before
    assert [f.clears for f in fakes] == [0, 0, 0]


def _refused_after_load(ref: int, directory) -> str:
    return (
        f"forward context {ref} was taken before the load of embedding checkpoint "
        f"{directory} replaced the rows it looked up: its gradients were computed against "
        "the old rows and are not applied (look the batch up again)"
    )


def test_a_backward_for_a_lookup_made_before_a_clear_is_refused(make_tier):
    """As after a load: its gradients would move the fresh rows of the same IDs."""
    ids = [1, 2, 3, 4]
    tier, fakes = make_tier(2)
    stale = tier.lookup(user_batch(ids), train=True)
    tier.clear()
    assert [f.clears for f in fakes] == [1, 1]
    fresh = tier.lookup(user_batch(ids), train=False).slots[0].embeddings
    with pytest.raises(FailedPreconditionError) as refused:
        tier.backward(stale.ref, ones(len(ids)))
    assert refused.value.message == (
        f"forward context {stale.ref} was taken before a clear of the embedding tier "
        "replaced the rows it looked up: its gradients were computed against the old rows "
        "and are not applied (look the batch up again)"
    )
    tier.flush()
    after = tier.lookup(user_batch(ids), train=False).slots[0].embeddings
    torch.testing.assert_close(after, fresh, rtol=0, atol=0)
    assert tier.status().pending_backward == 0


def test_a_backward_for_a_lookup_made_before_or_during_a_load_is_refused(make_tier, tmp_path):
    """Its gradients, computed against the rows the load replaced, moved the loaded rows of
    the same IDs. A load that fails before any shard changes keeps the lookups valid."""
    ids = [1, 2, 3, 4]
    loaded = _trained_checkpoint(make_tier, tmp_path / "ckpt", ids)
    tier, fakes = make_tier(2)
    kept = tier.lookup(user_batch(ids), train=True)
    with pytest.raises(CheckpointError, match="does not exist"):
        tier.load(tmp_path / "missing")
    tier.backward(kept.ref, ones(len(ids)))  # no shard changed: the lookup kept its context
    tier.flush()
    before = tier.lookup(user_batch(ids), train=True)
    entered, release = hold_all(fakes, "on_load")
    loading = threading.Thread(target=tier.load, args=(tmp_path / "ckpt",), daemon=True)
    loading.start()
    assert all(event.wait(WAIT) for event in entered)
    during = tier.lookup(user_batch(ids), train=True)  # the old rows, while the shards read
    for event in release:
        event.set()
    loading.join(WAIT)
    assert not loading.is_alive()
    for lookup in (before, during):
        with pytest.raises(FailedPreconditionError) as refused:
            tier.backward(lookup.ref, ones(len(ids)))
        assert refused.value.message == _refused_after_load(lookup.ref, tmp_path / "ckpt")
    tier.flush()
    got = tier.lookup(user_batch(ids), train=False).slots[0].embeddings.numpy()
    np.testing.assert_array_equal(got, loaded)
    assert tier.status().pending_backward == 0
    after = tier.lookup(user_batch(ids), train=True)  # a lookup after the load trains
    tier.backward(after.ref, ones(len(ids)))
    tier.flush()
    got = tier.lookup(user_batch(ids), train=False).slots[0].embeddings.numpy()
    np.testing.assert_array_equal(got, loaded - 1.0)


def test_load_of_an_empty_directory_is_invalid_argument(make_tier):
    tier, fakes = make_tier(2)
    servicer = EmbeddingWorkerServicer(tier)
    with pytest.raises(AbortedRpcError) as refused:
        list(servicer.Load(pb.WorkerLoadRequest(directory=""), FakeContext()))
    code, details = refused.value.args
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "WorkerLoadRequest.directory must not be empty" in details
    assert [f.shard.size() for f in fakes] == [0, 0]


def test_verify_shards_checks_the_replica_count_too(make_tier):
    tier, fakes = make_tier(2)
    tier.verify_shards()  # shard i answers as replica i of 2
    fakes[1].shard = EmbeddingShard(10, replica_index=1, replica_size=3)
    with pytest.raises(InvalidArgumentError) as refused:
        tier.verify_shards()
    assert (
        "parameter server fake-1:7000 answers as replica 1 of 3, but was given as replica 1 of 2"
        in refused.value.message
    )


def test_wait_for_serving_waits_for_shards_to_answer_and_serve_and_names_them(make_tier):
    """serve --embedding-ps waits for its shards as --embedding-workers waits for its worker
    (it failed at once when started before them, and a shard still loading failed its
    warm-up); a shard at the wrong place fails at once."""
    tier, fakes = make_tier(2)
    fakes[1].serving, fakes[1].task = False, "loading"
    down = [True]

    def unreachable() -> None:
        if down[0]:
            raise UnavailableError(f"{fakes[0].peer} is unavailable: connection refused")

    fakes[0].on_status = unreachable
    with pytest.raises(UnavailableError) as waited:
        tier.wait_for_serving(0.3)
    assert waited.value.message == (
        "embedding shards not serving after 0.3 s (parameter server fake-0:7000 (shard 0) is "
        "unavailable: connection refused)"
    )
    down[0] = False
    with pytest.raises(UnavailableError) as waited:
        tier.wait_for_serving(0.3)
    assert waited.value.message == (
        "embedding shards not serving after 0.3 s (not serving yet: parameter server "
        "fake-1:7000 (shard 1) (loading))"
    )
    tier.wait_for_serving(0.3, serving=False)  # answering is enough
    threading.Timer(0.3, lambda: setattr(fakes[1], "serving", True)).start()
    started = time.monotonic()
    tier.wait_for_serving(WAIT)
    assert 0.25 < time.monotonic() - started < WAIT
    fakes[1].shard = EmbeddingShard(10, replica_index=0, replica_size=2)
    started = time.monotonic()
    with pytest.raises(InvalidArgumentError, match="answers as replica 0 of 2"):
        tier.wait_for_serving(WAIT)
    assert time.monotonic() - started < 1.0  # at once, not after WAIT


def test_verify_shards_refuses_a_shard_keyed_by_another_embedding_config(make_tier):
    """A shard started with another model's embedding_config.yml (and checkpoint) answered
    every ID with zeros, as unknown; the worker now refuses it, naming the slots."""
    tier, fakes = make_tier(2)
    fakes[1].config = embedding_config_from_mapping(
        {
            "feature_index_prefix_bit": CONFIG.feature_index_prefix_bit + 4,
            "slots_config": {"user": {"dim": DIM}, "items": {"dim": DIM + 4}},
        }
    )
    with pytest.raises(InvalidArgumentError) as refused:
        tier.verify_shards()
    assert refused.value.message == (
        "parameter server fake-1:7000 (shard 1) keys its rows by another embedding config: "
        "slot 'user' has another ID prefix at this worker (feature groups or "
        f"feature_index_prefix_bit changed); slot 'items' has dim {DIM} at this worker but "
        f"{DIM + 4} at the shard (give the shards and the workers one embedding_config.yml)"
    )
    # Until a check finds the shards right again, lookups are refused naming it (the
    # worker's readiness check runs verify_shards every 2 s: a shard restarted so).
    with pytest.raises(UnavailableError) as unserved:
        tier.lookup(user_batch([1, 2]), train=False)
    assert unserved.value.message == refused.value.message
    # A shard that lacks a slot (a config rolled out one process at a time) or does not say.
    fakes[1].config = embedding_config_from_mapping({"slots_config": {"user": {"dim": DIM}}})
    tier.verify_shards()
    assert tier.lookup(user_batch([1, 2]), train=False).unknown_ids == 2
    fakes[1].config = None
    tier.verify_shards()


def test_reshard_load_fits_a_shard_of_exactly_its_rows(make_tier, tmp_path):
    expected = _trained_checkpoint(make_tier, tmp_path / "ckpt", list(range(40)))
    counts = checkpoint_load.count_rows_per_replica(
        checkpoint_manifest.read_manifest(tmp_path / "ckpt"), 3
    )
    tier, fakes = make_tier(3)
    fakes[2].shard = EmbeddingShard(
        counts[2] - 1, optimizer=SGD(lr=1.0), replica_index=2, replica_size=3
    )
    with pytest.raises(
        CheckpointError,
        match=rf"shard 2 .* {counts[2]} rows, more than its capacity {counts[2] - 1}",
    ):
        tier.load(tmp_path / "ckpt")
    assert [f.shard.size() for f in fakes] == [0, 0, 0]
    fakes[2].shard = EmbeddingShard(
        counts[2], optimizer=SGD(lr=1.0), replica_index=2, replica_size=3
    )
    tier.load(tmp_path / "ckpt")
    assert [f.shard.size() for f in fakes] == counts
    got = tier.lookup(user_batch(list(range(40))), train=False).slots[0].embeddings.numpy()
    np.testing.assert_array_equal(got, expected)


def _shard_status(index: int, *, serving: bool, task: str = "") -> ShardStatus:
    return ShardStatus(
        replica_index=index, replica_size=2, rows=0, capacity=8, read_only=True,
        job_type="infer", optimizer_json="", serving=serving, lookups=0, ids_looked_up=0,
        misses=0, evictions=0, task=task, task_progress=0.0,
    )  # fmt: skip


def _watch(
    outcomes: list, caplog, monkeypatch, *, serving_at_start: bool = True, waiting=None
) -> list[int]:
    """Run the worker's shard watcher over ``outcomes`` (one per check: an error message
    its verify_shards raises, or the statuses it returns); the ``recserve.shards`` health
    status before each check and after the last."""
    stop = threading.Event()
    health_servicer = health.HealthServicer()
    seen: list[int] = []

    def shards_health() -> int:
        request = health_pb2.HealthCheckRequest(service=worker_service.SHARDS_SERVICE)
        return health_servicer.Check(request, None).status

    class Tier:
        clients = [SimpleNamespace(address="a:7000"), SimpleNamespace(address="a:7001")]

        def verify_shards(self, *, timeout: float) -> list[ShardStatus]:
            seen.append(shards_health())
            outcome = outcomes.pop(0)
            if not outcomes:
                stop.set()
            if isinstance(outcome, str):
                raise UnavailableError(outcome)
            return outcome

    monkeypatch.setattr(worker_service, "SHARD_CHECK_INTERVAL_SECONDS", 0.001)
    caplog.set_level(logging.INFO, logger="embedding_store.worker_service")
    readiness = worker_service._Readiness(health_servicer)
    readiness.start(**({} if serving_at_start else {"shards_serving": False}))
    more = () if waiting is None else (waiting,)
    worker_service._watch_shards(Tier(), readiness, stop, 1.0, *more)  # type: ignore[arg-type]
    assert outcomes == []
    return [*seen, shards_health()]


def test_the_shard_watcher_logs_each_new_reason_a_shard_is_away(monkeypatch, caplog):
    """A shard refused, then back but loading, then serving: three lines, and
    ``recserve.shards`` NOT_SERVING until it serves. A new reason while already away used to
    go unlogged (only reachable <-> unreachable changes were), and a shard that answered
    while it loaded counted as serving (its lookups fail: a server's
    recserve_embedding_tier_serving read 0 meanwhile)."""
    refused = "parameter server a:7001 (shard 1 of 2) is unavailable: Connection refused"
    loading = [_shard_status(0, serving=True), _shard_status(1, serving=False, task="loading")]
    serving = [_shard_status(0, serving=True), _shard_status(1, serving=True)]
    outcomes = [refused, refused, loading, loading, serving, serving]
    seen = _watch(outcomes, caplog, monkeypatch)

    SERVING, NOT_SERVING = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    assert seen == [SERVING, NOT_SERVING, NOT_SERVING, NOT_SERVING, NOT_SERVING, SERVING, SERVING]
    away = "a shard is away (lookups that need it fail until it is back): "
    cannot = "a shard answers but cannot serve (lookups that need it fail until it does): "
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", away + refused),
        ("WARNING", cannot + "shard 1 (a:7001) cannot serve yet (loading)"),
        ("INFO", "embedding worker reaches every shard, and each serves, again"),
    ]


def test_the_shard_watcher_starts_from_what_the_start_up_check_found(monkeypatch, caplog):
    """Shards that answered the start-up check but did not serve yet (unconfigured training
    shards): ``recserve.shards`` is NOT_SERVING from the start, their reason (logged at the
    start) is not logged again, and their serving is."""
    unconfigured = [_shard_status(i, serving=False) for i in range(2)]
    waiting = "shard 0 (a:7000) cannot serve yet; shard 1 (a:7001) cannot serve yet"
    serving = [_shard_status(i, serving=True) for i in range(2)]
    outcomes = [unconfigured, serving, serving]
    seen = _watch(outcomes, caplog, monkeypatch, serving_at_start=False, waiting=waiting)
    NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
    SERVING = health_pb2.HealthCheckResponse.SERVING
    assert seen == [NOT_SERVING, NOT_SERVING, SERVING, SERVING]
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "embedding worker reaches every shard, and each serves, again"),
    ]
