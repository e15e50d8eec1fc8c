"""Failure paths of the embedding tier's checkpoint tasks, in process (fake shard clients, the
parameter-server servicer and process without a network where they can).

* A re-sharding load that fails in one shard leaves that shard its previous rows (never
  cleared and half-filled), and a load into a shard without an optimizer keeps the
  checkpoint's optimizer and every row's state.
* A dump or load whose caller gave up (deadline, disconnect) changes nothing afterwards.
* ``--dump-on-exit`` never overwrites the previous dump in place.
* Readiness: ``TierStatus.shard_serving``, and a worker stopped while it waits for its shards
  never reports SERVING; ``--startup-timeout`` refuses NaN.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
import safetensors.numpy
from grpc_health.v1 import health_pb2

from embedding_store import (
    checkpoint_dump,
    checkpoint_load,
    checkpoint_manifest,
)
from embedding_store.cli import main as cli_main
from embedding_store.config import EmbeddingConfig, GlobalConfig, JobType, SlotConfig
from embedding_store.errors import (
    AlreadyExistsError,
    CheckpointError,
    InvalidArgumentError,
    UnavailableError,
)
from embedding_store.grpc_common import http1_message
from embedding_store.hashing import shard_of
from embedding_store.initializer import InitializationConfig
from embedding_store.optimizer_wire import settings_to_configure_request
from embedding_store.optimizers import SGD, Adagrad, Adam
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.ps_client import ShardStatus
from embedding_store.ps_process import ParameterServerOptions, ParameterServerProcess
from embedding_store.ps_service import ParameterServerServicer
from embedding_store.remote_tier import RemoteShardTier
from embedding_store.shard import EmbeddingShard
from embedding_store.tier import InProcessEmbeddingTier
from embedding_store.worker_command import format_status
from embedding_store.worker_service import (
    SERVICE_NAME,
    EmbeddingWorkerServicer,
    _serve,
    serve_embedding_worker,
)
from tests.unit.test_checkpoint import _with_negative_state
from tests.unit.test_worker_service import (
    CONFIG,
    WAIT,
    AbortedRpcError,
    FakeShardClient,
    hold_all,
    ones,
    user_batch,
)

ADAM = Adam(lr=0.01)
TWO_DIMS = EmbeddingConfig(slots_config={"a": SlotConfig(dim=4), "b": SlotConfig(dim=8)})


# --------------------------------------------------------------------------- helpers
class Context:
    """A servicer context whose caller is there until :meth:`leave`."""

    def __init__(self, active: bool = True) -> None:
        self.active = active

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AbortedRpcError(code, details)

    def is_active(self) -> bool:
        return self.active

    def leave(self) -> None:
        self.active = False

    def time_remaining(self) -> float | None:
        return None  # no deadline


def rows_by_dim(blocks) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Row blocks (``.dim``, ``.ids``, ``.weights``, ``.state``; several per dim allowed) as
    per dim (ids, weight bits, state bits) sorted by ID: equal only when bit-identical."""
    out = {}
    for dim in sorted({b.dim for b in blocks}):
        mine = [b for b in blocks if b.dim == dim]
        ids = np.concatenate([b.ids for b in mine])
        order = np.argsort(ids)
        states = [
            np.zeros((len(b.ids), 0), np.float32) if b.state is None else b.state for b in mine
        ]
        weights = np.concatenate([b.weights for b in mine])[order]
        out[dim] = (
            ids[order],
            weights.view(np.uint32),
            np.concatenate(states)[order].view(np.uint32),
        )
    return out


def exact_rows(shard: EmbeddingShard) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every row of an in-process shard, as :func:`rows_by_dim` gives them."""
    return rows_by_dim([shard.export_rows(dim) for dim in shard.dims()])


def assert_same_rows(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for dim in expected:
        for name, a, b in zip(("ids", "weights", "state"), got[dim], expected[dim], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"dim {dim} {name}")


def rows_of_replica(
    directory: Path, replica_index: int, replica_size: int, optimizer: object | None
) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """What a shard holding exactly its part of the checkpoint would export (as exact_rows)."""
    manifest = checkpoint_manifest.read_manifest(directory)
    blocks = checkpoint_load.read_rows_for_replica(
        manifest, replica_index, replica_size, keep_state_of=optimizer
    )
    return rows_by_dim(blocks)


def fake_tier(fakes: list[FakeShardClient]) -> RemoteShardTier:
    return RemoteShardTier(
        CONFIG, [fake.address for fake in fakes], connect=lambda address, index: fakes[index]
    )


def trained_tier_checkpoint(directory: Path, ids: list[int], num_shards: int) -> None:
    """A ``num_shards``-shard checkpoint of trained rows for ``ids`` (SGD, like the fakes)."""
    with InProcessEmbeddingTier(CONFIG, num_shards=num_shards, optimizer=SGD(lr=1.0)) as tier:
        result = tier.lookup(user_batch(ids), train=True)
        tier.backward(result.ref, ones(len(ids)))
        tier.dump(directory)


class ShardFailingMidLoad(FakeShardClient):
    """A shard that fails part-way through receiving a checkpoint, whichever way it gets it:
    a streamed import keeps the rows that arrived (as a real shard's ImportRows does, chunk
    by chunk); a Load fails after reading its first file (before the swap, as a real shard's
    load does when a read fails or it goes away)."""

    def import_rows(self, blocks) -> int:
        for block in blocks:
            self.shard.import_rows(block)
            break
        raise UnavailableError(f"{self.peer} is unavailable: Socket closed")

    def load(self, directory: str, *, caller_gone: Callable[[], bool] | None = None) -> int:
        def fail(_done: int, _total: int) -> None:
            raise UnavailableError(f"{self.peer} is unavailable: Socket closed")

        checkpoint_load.load_into_shard(
            directory,
            self.shard,
            CONFIG,
            replica_index=self.shard.replica_index,
            replica_size=self.shard.replica_size,
            progress=fail,
        )
        return self.shard.size()


# --------------------------------------------------------------------------- re-sharding loads
def test_a_reshard_load_failing_in_one_shard_leaves_that_shard_its_previous_rows(tmp_path):
    trained_tier_checkpoint(tmp_path / "three", list(range(60)), num_shards=3)
    fakes = [FakeShardClient(0, 2), ShardFailingMidLoad(1, 2)]
    tier = fake_tier(fakes)
    try:
        ids = list(range(1000, 1040))
        result = tier.lookup(user_batch(ids), train=True)
        tier.backward(result.ref, ones(len(ids)))
        tier.flush()
        before = exact_rows(fakes[1].shard)
        assert sum(len(rows[0]) for rows in before.values()) > 0
        with pytest.raises(UnavailableError, match=r"fake-1:7000 \(shard 1\) is unavailable"):
            tier.load(tmp_path / "three")
        assert_same_rows(exact_rows(fakes[1].shard), before)  # not cleared, not half-filled
        # Shard 0 finished its own load: exactly its part of the checkpoint, nothing else.
        assert_same_rows(
            exact_rows(fakes[0].shard), rows_of_replica(tmp_path / "three", 0, 2, None)
        )
        assert fakes[0].clears == fakes[1].clears == 0
    finally:
        tier.close()


# --------------------------------------------------------------------------- callers that left
def test_a_load_whose_caller_left_changes_no_shard(tmp_path):
    trained_tier_checkpoint(tmp_path / "ckpt", list(range(30)), num_shards=1)
    fakes = [FakeShardClient(0, 2), FakeShardClient(1, 2)]
    tier = fake_tier(fakes)
    loads = []
    for fake in fakes:
        fake.on_load = lambda: loads.append("load")
    try:
        tier.lookup(user_batch(list(range(500, 520))), train=True)
        before = [exact_rows(fake.shard) for fake in fakes]
        servicer = EmbeddingWorkerServicer(tier)
        request = pb.WorkerLoadRequest(directory=str(tmp_path / "ckpt"))
        with pytest.raises(AbortedRpcError) as failure:
            list(servicer.Load(request, Context(active=False)))
        code, details = failure.value.args
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert details == (
            f"load of {tmp_path / 'ckpt'} abandoned: its caller gave up (deadline passed or "
            "cancelled); no shard changed"
        )
        assert loads == []
        for fake, rows in zip(fakes, before, strict=True):
            assert_same_rows(exact_rows(fake.shard), rows)
        assert tier.status().task == ""  # the task ended: the next load may run
    finally:
        tier.close()


def test_a_dump_whose_caller_left_while_shards_wrote_publishes_nothing(tmp_path):
    fakes = [FakeShardClient(0, 2), FakeShardClient(1, 2)]
    tier = fake_tier(fakes)
    try:
        tier.lookup(user_batch(list(range(20))), train=True)
        servicer = EmbeddingWorkerServicer(tier)
        root = tmp_path / "checkpoints"
        root.mkdir()
        target = root / "d6"
        entered, release = hold_all(fakes, "on_dump")
        context = Context()
        outcome: dict[str, BaseException] = {}

        def dump() -> None:
            try:
                list(servicer.Dump(pb.WorkerDumpRequest(directory=str(target)), context))
            except AbortedRpcError as error:
                outcome["error"] = error

        thread = threading.Thread(target=dump)
        thread.start()
        assert all(event.wait(WAIT) for event in entered)  # both shards are writing
        context.leave()  # the caller's deadline passes while they write
        for event in release:
            event.set()
        thread.join(WAIT)
        assert not thread.is_alive()
        code, details = outcome["error"].args
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert details == (
            f"dump to {target} abandoned: its caller gave up (deadline passed or cancelled); "
            "nothing was published"
        )
        assert list(root.iterdir()) == []  # no checkpoint, no staging directory left
    finally:
        for fake in fakes:
            fake.on_dump = None
        tier.close()


def adam_fakes() -> list[FakeShardClient]:
    """Two shards trained one Adam step on IDs 0..29 (each holds some)."""
    fakes = [FakeShardClient(i, 2) for i in range(2)]
    for fake in fakes:
        fake.shard.configure(optimizer=ADAM)
    tier = fake_tier(fakes)
    try:
        result = tier.lookup(user_batch(list(range(30))), train=True)
        tier.backward(result.ref, ones(30))
        tier.flush()
    finally:
        tier.close()
    return fakes


def test_a_dump_names_the_optimizer_of_the_shards_that_have_one(tmp_path):
    """Shard 0 restarted empty (no rows, no optimizer) while shard 1 kept its rows: the
    manifest names shard 1's Adam, so a load keeps its rows' moments and step counts. The
    manifest used to take shard 0's (none), and every load dropped that state silently."""
    fakes = adam_fakes()
    kept = exact_rows(fakes[1].shard)
    assert kept[4][2].shape == (len(kept[4][0]), 9) and len(kept[4][0]) > 0
    fakes[0].shard = EmbeddingShard(1000, replica_index=0, replica_size=2)
    tier = fake_tier(fakes)
    try:
        manifest = tier.dump(tmp_path / "ckpt")
    finally:
        tier.close()
    assert manifest.optimizer == ADAM.to_dict()
    with InProcessEmbeddingTier(CONFIG, num_shards=2, optimizer=ADAM) as resumed:
        resumed.load(tmp_path / "ckpt")
        assert resumed.shards[0].size() == 0
        assert_same_rows(exact_rows(resumed.shards[1]), kept)


def test_a_dump_of_shards_keeping_state_of_different_optimizers_publishes_nothing(tmp_path):
    fakes = adam_fakes()
    fakes[0].shard.configure(optimizer=Adagrad(lr=0.1))  # shard 0 keeps Adagrad's state now
    tier = fake_tier(fakes)
    try:
        with pytest.raises(CheckpointError) as failure:
            tier.dump(tmp_path / "ckpt")
    finally:
        tier.close()
    assert failure.value.message == (
        f"checkpoint {tmp_path / 'ckpt'} not written (no manifest, no done-marker): the "
        "shards keep the state of different optimizers (adagrad on shard 0; adam on shard 1), "
        "which no load could keep; configure every shard with one optimizer and dump again"
    )
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no staging directory left


def test_a_load_with_saved_state_one_shard_would_refuse_changes_no_shard(tmp_path):
    """Shard 1's file holds a negative Adagrad accumulator (checksums to match), which its
    shard's load refuses: the tier refuses the checkpoint before any shard loads, as the
    in-process tier does. Shard 0 used to take its part first, leaving a tier half loaded."""
    adagrad = Adagrad(lr=0.1)
    with InProcessEmbeddingTier(CONFIG, num_shards=2, optimizer=adagrad) as source:
        result = source.lookup(user_batch(list(range(40))), train=True)
        source.backward(result.ref, ones(40))
        source.dump(tmp_path / "ckpt")
    path = _with_negative_state(tmp_path / "ckpt", shard=1)
    fakes = [FakeShardClient(i, 2) for i in range(2)]
    for fake in fakes:
        fake.shard.configure(optimizer=adagrad)
    tier = fake_tier(fakes)
    try:
        tier.lookup(user_batch([100, 101, 102, 103, 104, 105]), train=True)
        before = [exact_rows(fake.shard) for fake in fakes]
        assert all(before)
        with pytest.raises(CheckpointError) as failure:
            tier.load(tmp_path / "ckpt")
    finally:
        tier.close()
    assert failure.value.message == (
        f"checkpoint file {path}: optimizer state: adagrad accumulators must be >= 0, but "
        "row 0 holds -1.0 (its row would become NaN on the next update)"
    )
    for fake, rows in zip(fakes, before, strict=True):
        assert_same_rows(exact_rows(fake.shard), rows)


# --------------------------------------------------------------------------- the shard's Load RPC
def shard_with_rows(optimizer: object | None, replica_index: int = 0, replica_size: int = 1):
    shard = EmbeddingShard(
        1000,
        optimizer=optimizer,
        initialization=InitializationConfig(seed=7),
        replica_index=replica_index,
        replica_size=replica_size,
    )
    return ParameterServerServicer(shard, TWO_DIMS, job_type=JobType.TRAIN)


def adam_checkpoint(directory: Path) -> None:
    """A 1-shard checkpoint written with Adam (state width 2 x dim + 1), rows trained twice."""
    source = shard_with_rows(ADAM).shard
    for dim, ids in (
        (4, np.arange(40, dtype=np.uint64)),
        (8, np.arange(100, 130, dtype=np.uint64)),
    ):
        for step in range(2):
            source.lookup(ids, dim, train=True)
            grads = np.linspace(-1, 1 + step, ids.shape[0] * dim, dtype=np.float32)
            source.update(ids, grads.reshape(-1, dim))
    checkpoint_dump.dump_embeddings([source], directory, TWO_DIMS)


@pytest.mark.parametrize("replica", [(0, 1), (1, 2)], ids=["same-layout", "re-shard"])
def test_load_rpc_into_a_shard_without_optimizer_keeps_the_optimizer_and_state(tmp_path, replica):
    adam_checkpoint(tmp_path / "adam")
    s = shard_with_rows(None, *replica)
    answer = s.Load(pb.ShardLoadRequest(directory=str(tmp_path / "adam")), Context())
    assert s.shard.optimizer == ADAM and s.serving
    expected = rows_of_replica(tmp_path / "adam", *replica, ADAM)
    assert answer.rows_loaded == sum(len(rows[0]) for rows in expected.values()) > 0
    assert [state.shape[1] for _, _, state in expected.values()] == [9, 17]
    assert_same_rows(exact_rows(s.shard), expected)


def test_load_rpc_keeps_a_configured_optimizer_and_only_state_that_fits(tmp_path):
    adam_checkpoint(tmp_path / "adam")
    other_lr = Adam(lr=0.5)  # same kind and widths: the saved state fits and is kept
    s = shard_with_rows(other_lr)
    s.Load(pb.ShardLoadRequest(directory=str(tmp_path / "adam")), Context())
    assert s.shard.optimizer == other_lr
    assert_same_rows(exact_rows(s.shard), rows_of_replica(tmp_path / "adam", 0, 1, ADAM))

    adagrad = Adagrad(lr=0.1, initial_accumulator_value=0.25)  # another kind: state dropped
    s = shard_with_rows(adagrad)
    s.Load(pb.ShardLoadRequest(directory=str(tmp_path / "adam")), Context())
    assert s.shard.optimizer == adagrad
    for dim, (_, _, state) in exact_rows(s.shard).items():
        assert state.shape[1] == dim
        np.testing.assert_array_equal(state.view(np.float32), np.float32(0.25))


@pytest.mark.parametrize(
    ("configured", "state_kept"),
    [(Adam(lr=0.5), True), (Adagrad(lr=0.1, initial_accumulator_value=0.25), False)],
    ids=["same-kind", "other-kind"],
)
def test_a_configure_while_a_load_reads_is_kept_with_the_state_only_where_it_fits(
    tmp_path, configured, state_kept
):
    """A shard without an optimizer starts loading (it would adopt the checkpoint's Adam),
    and a trainer's Configure arrives before the swap: the shard keeps the configured
    optimizer, as one configured before the load does, with the saved state where it fits
    (same kind and width) and fresh state where not. The load used to replace it by the
    checkpoint's optimizer, so one shard trained with other settings than the others."""
    adam_checkpoint(tmp_path / "adam")
    s = shard_with_rows(None)

    def configure_midway(_done: int, _total: int) -> None:
        s.Configure(settings_to_configure_request(configured, None), Context())

    s.load_checkpoint(str(tmp_path / "adam"), adopt_optimizer=True, progress=configure_midway)
    assert s.shard.optimizer == configured
    expected = rows_of_replica(tmp_path / "adam", 0, 1, ADAM if state_kept else None)
    got = exact_rows(s.shard)
    if state_kept:
        assert_same_rows(got, expected)
    else:
        for dim, (ids, weights, state) in got.items():
            np.testing.assert_array_equal(ids, expected[dim][0])
            np.testing.assert_array_equal(weights, expected[dim][1])
            assert state.shape == (len(ids), dim)
            np.testing.assert_array_equal(state.view(np.float32), np.float32(0.25))


def test_load_rpc_whose_caller_left_keeps_the_shards_rows(tmp_path):
    adam_checkpoint(tmp_path / "adam")
    s = shard_with_rows(SGD(lr=1.0))
    s.shard.lookup(np.arange(900, 910, dtype=np.uint64), 4, train=True)
    before = exact_rows(s.shard)
    with pytest.raises(AbortedRpcError) as failure:
        s.Load(pb.ShardLoadRequest(directory=str(tmp_path / "adam")), Context(active=False))
    code, details = failure.value.args
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert details == (
        f"load of {tmp_path / 'adam'} abandoned: the caller gave up; this shard keeps its rows"
    )
    assert_same_rows(exact_rows(s.shard), before)
    assert s.shard.optimizer == SGD(lr=1.0)
    assert s.Status(pb.ShardStatusRequest(), Context()).task == ""


# --------------------------------------------------------------------------- --dump-on-exit
def dump_on_exit_process(
    directory: Path, ids: np.ndarray, replica_index: int = 0, replica_size: int = 1
) -> ParameterServerProcess:
    options = ParameterServerOptions(
        replica_index=replica_index, replica_size=replica_size, dump_on_exit=str(directory)
    )
    process = ParameterServerProcess(TWO_DIMS, GlobalConfig(), options)
    process.shard.configure(optimizer=ADAM)
    for dim in (4, 8):
        process.shard.lookup(ids, dim, train=True)
    return process


def killed_at_second_file(monkeypatch, check: Callable[[], None]) -> None:
    """Make the dump's second file write run ``check`` (the state a kill -9 at that moment
    would leave) and then fail, as if the process died there."""
    real_write = checkpoint_dump.write_atomic
    writes = []

    def write(path: Path, payload: bytes) -> None:
        writes.append(path)
        if len(writes) == 2:
            check()
            raise RuntimeError("killed mid-dump")
        real_write(path, payload)

    monkeypatch.setattr(checkpoint_dump, "write_atomic", write)


def files_under(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_dump_on_exit_interrupted_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "on_exit"
    dump_on_exit_process(target, np.arange(10, dtype=np.uint64)).stop(grace=0)
    previous = checkpoint_load.verify(target)
    assert previous.total_rows == 20
    previous_files = files_under(target)

    def still_whole() -> None:
        assert files_under(target) == previous_files
        assert checkpoint_load.verify(target).total_rows == 20

    killed_at_second_file(monkeypatch, still_whole)
    process = dump_on_exit_process(target, np.arange(50, dtype=np.uint64))
    with pytest.raises(RuntimeError, match="killed mid-dump"):
        process.stop(grace=0)
    still_whole()
    assert [p.name for p in tmp_path.iterdir()] == ["on_exit"]  # no staging directory left

    monkeypatch.undo()  # an uninterrupted dump replaces it whole
    dump_on_exit_process(target, np.arange(50, dtype=np.uint64)).stop(grace=0)
    assert checkpoint_load.verify(target).total_rows == 100
    assert [p.name for p in tmp_path.iterdir()] == ["on_exit"]


@pytest.mark.parametrize("replica_size", [1, 2])
def test_dump_on_exit_of_an_unchanged_shard_keeps_the_previous_dump(tmp_path, replica_size):
    """A shard restarted empty (Kubernetes restarts it after a crash) that is stopped before
    any training must not replace the last copy of the real rows with nothing; one that only
    loaded a checkpoint has nothing to add either. Once a row changes, it dumps again."""
    target = tmp_path / "on_exit"
    ids = np.arange(30, dtype=np.uint64)
    mine = ids[shard_of(ids, replica_size) == 0]
    dump_on_exit_process(target, mine, 0, replica_size).stop(grace=0)
    previous_files = files_under(target)
    assert previous_files

    restarted = ParameterServerProcess(
        TWO_DIMS,
        GlobalConfig(),
        ParameterServerOptions(replica_size=replica_size, dump_on_exit=str(target)),
    )
    assert restarted.shard.size() == 0 and not restarted.shard.modified
    restarted.stop(grace=0)
    assert files_under(target) == previous_files

    loaded = dump_on_exit_process(tmp_path / "elsewhere", mine, 0, replica_size)
    loaded.shard.replace_rows([loaded.shard.export_rows(4)], checkpoint_version="v1")
    assert not loaded.shard.modified
    loaded.options = replace(loaded.options, dump_on_exit=str(target))
    loaded.stop(grace=0)
    assert files_under(target) == previous_files

    trained = dump_on_exit_process(target, np.arange(1, dtype=np.uint64), 0, replica_size)
    assert trained.shard.modified
    trained.stop(grace=0)
    assert files_under(target) != previous_files


def test_dump_on_exit_of_one_of_several_shards_replaces_its_part_whole(tmp_path, monkeypatch):
    target = tmp_path / "parts"
    ids = np.arange(40, dtype=np.uint64)
    mine = ids[shard_of(ids, 2) == 1]
    dump_on_exit_process(target, mine, replica_index=1, replica_size=2).stop(grace=0)
    part = target / "shard_00001"
    previous_files = files_under(part)
    assert sorted(previous_files) == ["dim_4.safetensors", "dim_8.safetensors"]

    def part_untouched() -> None:
        assert files_under(part) == previous_files

    killed_at_second_file(monkeypatch, part_untouched)
    more = np.arange(100, dtype=np.uint64)
    process = dump_on_exit_process(target, more[shard_of(more, 2) == 1], 1, 2)
    with pytest.raises(RuntimeError, match="killed mid-dump"):
        process.stop(grace=0)
    part_untouched()
    assert [p.name for p in target.iterdir()] == ["shard_00001"]  # no staging directory left

    monkeypatch.undo()
    process = dump_on_exit_process(target, more[shard_of(more, 2) == 1], 1, 2)
    process.stop(grace=0)
    assert [p.name for p in target.iterdir()] == ["shard_00001"]
    assert sorted(files_under(part)) == ["dim_4.safetensors", "dim_8.safetensors"]
    for dim in (4, 8):
        saved = safetensors.numpy.load_file(str(part / f"dim_{dim}.safetensors"))
        np.testing.assert_array_equal(np.sort(saved["ids"]), np.sort(more[shard_of(more, 2) == 1]))


def test_dump_on_exit_of_one_of_several_shards_never_changes_a_published_checkpoint(tmp_path):
    """A part renamed into a checkpoint changed files under its manifest: every load of it
    then failed its checksums, and the checkpoint was lost (`--load-checkpoint DIR
    --dump-on-exit DIR`, or DIR written whole by one shard before the tier grew). Refused
    when the shard starts, and at exit if a checkpoint appeared there meanwhile."""
    target = tmp_path / "ckpt"
    dump_on_exit_process(target, np.arange(10, dtype=np.uint64)).stop(grace=0)  # one shard
    before = files_under(target)
    message = (
        f"--dump-on-exit {target.absolute()} is a published checkpoint (it has DONE): shard 0 "
        f"of 2 would replace {target.absolute() / 'shard_00000'} under its manifest, and no "
        "load would take it any more; give --dump-on-exit a directory of its own"
    )
    ids = np.arange(40, dtype=np.uint64)
    process = dump_on_exit_process(target, ids[shard_of(ids, 2) == 0], 0, 2)
    with pytest.raises(AlreadyExistsError) as raised:
        process.start()
    assert raised.value.message == message and process.server is None
    with pytest.raises(AlreadyExistsError) as raised:
        process.stop(grace=0)
    assert raised.value.message == message
    assert files_under(target) == before
    assert checkpoint_load.verify(target).total_rows == 20


def test_dump_on_exit_of_a_single_shard_never_replaces_a_model_checkpoint(tmp_path):
    """A single shard renames a whole embedding checkpoint over DIR: over a model checkpoint
    (`--dump-on-exit runs/adult`) that deleted its dense model, optimizer and all."""
    target = tmp_path / "adult"
    target.mkdir()
    model_files = {"manifest.json": b"{}", "jit_dense.pt": b"model", "DONE": b""}
    for name, payload in model_files.items():
        (target / name).write_bytes(payload)
    message = (
        f"--dump-on-exit {target.absolute()} holds a checkpoint that is not an embedding "
        "checkpoint (it has DONE but no embedding_manifest.json: a model checkpoint?), which "
        "the dump on exit would replace whole; give --dump-on-exit a directory of its own"
    )
    process = dump_on_exit_process(target, np.arange(10, dtype=np.uint64))
    with pytest.raises(AlreadyExistsError) as raised:
        process.start()
    assert raised.value.message == message and process.server is None
    with pytest.raises(AlreadyExistsError) as raised:
        process.stop(grace=0)
    assert raised.value.message == message
    assert files_under(target) == model_files
    assert [p.name for p in tmp_path.iterdir()] == ["adult"]  # no staging directory left


# --------------------------------------------------------------------------- readiness
class NotServingShard(FakeShardClient):
    """A shard that answers but cannot serve yet (an inference shard still loading)."""

    def status(self) -> ShardStatus:
        answer = super().status()
        return ShardStatus(**{**answer.__dict__, "serving": False})


def test_tier_status_reports_which_shards_serve():
    fakes = [FakeShardClient(0, 2), NotServingShard(1, 2)]
    tier = fake_tier(fakes)
    try:
        status = tier.status()
        assert status.shard_serving == (True, False)
        # The server's tier check names the shards that cannot serve by these addresses.
        assert status.shard_addresses == (fakes[0].address, fakes[1].address)
        answer = EmbeddingWorkerServicer(tier).Status(pb.WorkerStatusRequest(), Context())
        assert [s.serving for s in answer.shard_status] == [True, False]
        assert format_status(status)[:2] == [
            "shard 0: 0 rows of 1000, idle, checkpoint none",
            "shard 1: 0 rows of 1000, idle, checkpoint none, NOT SERVING",
        ]
    finally:
        tier.close()
    with InProcessEmbeddingTier(CONFIG, num_shards=3) as in_process:
        assert in_process.status().shard_serving == (True, True, True)
        assert in_process.status().shard_addresses == ()


@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_worker_startup_timeout_must_be_finite_and_not_negative(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["embedding-worker", "--ps", "127.0.0.1:1", "--startup-timeout", value])
    assert exit_.value.code == 2
    assert "argument --startup-timeout: expected a" in capsys.readouterr().err
    with pytest.raises(InvalidArgumentError, match=r"startup_timeout must be a finite number >= 0"):
        serve_embedding_worker(CONFIG, ["127.0.0.1:1"], startup_timeout=float(value))


class RecordingHealth:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def set(self, service: str, status: int) -> None:
        self.calls.append((service, status))


class StoppedServer:
    def stop(self, grace: float) -> threading.Event:
        done = threading.Event()
        done.set()
        return done


class UnreachableShards:
    """A tier whose shards never answer; the second check brings a SIGTERM."""

    def __init__(self) -> None:
        self.checks = 0
        self.closed = False

    def verify_shards(self) -> None:
        self.checks += 1
        if self.checks == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        raise UnavailableError("parameter server 127.0.0.1:1 (shard 0) is unavailable")

    def flush(self) -> None:
        """No gradients are ever queued in this fake: nothing to wait for."""

    def close(self) -> None:
        self.closed = True


def test_a_worker_stopped_while_it_waits_for_its_shards_never_reports_serving():
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    health = RecordingHealth()
    tier = UnreachableShards()
    try:
        code = _serve(tier, StoppedServer(), health, ["127.0.0.1:1"], 60.0, 0.0)  # type: ignore[arg-type]
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert code == 0 and tier.checks == 2 and tier.closed
    assert (SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING) not in health.calls
    assert ("", health_pb2.HealthCheckResponse.SERVING) not in health.calls


def test_a_worker_that_loses_gradients_on_shutdown_exits_non_zero(caplog):
    from embedding_store.worker_service import _flush_and_close

    class Tier:
        def __init__(self, error: Exception | None) -> None:
            self.error, self.closed = error, False

        def flush(self) -> None:
            if self.error is not None:
                raise self.error

        def close(self) -> None:
            self.closed = True

    clean = Tier(None)
    assert _flush_and_close(clean) == 0 and clean.closed
    lost = Tier(UnavailableError("1 gradient batch(es) could not be applied since the last flush"))
    assert _flush_and_close(lost) == 1 and lost.closed
    assert "on shutdown: 1 gradient batch(es) could not be applied" in caplog.text


def test_dump_on_exit_waits_for_a_running_dump_and_skips_a_running_load(tmp_path):
    """SIGTERM while an admin's dump still runs (it outlasted the grace period): the exit
    dump waits for it, then writes, rather than failing as busy and writing nothing. While
    a checkpoint load runs, there is nothing worth dumping: skipped, not an error."""
    target = tmp_path / "on_exit"
    process = dump_on_exit_process(target, np.arange(10, dtype=np.uint64))
    task = process.servicer._checkpoint_task
    task.begin("dumping")  # the admin's dump, still writing
    threading.Timer(0.5, task.end).start()
    process.stop(grace=0)
    assert checkpoint_load.verify(target).total_rows == 20

    loading = dump_on_exit_process(tmp_path / "mid_load", np.arange(10, dtype=np.uint64))
    loading.servicer._checkpoint_task.begin("loading")
    loading.stop(grace=0)  # no error
    assert not (tmp_path / "mid_load").exists()
    loading.servicer._checkpoint_task.end()


class ShardsAtAnHttpPort:
    """A tier whose one shard address is an HTTP port: every check says so."""

    def __init__(self) -> None:
        self.checks = 0
        self.closed = False

    def verify_shards(self) -> None:
        self.checks += 1
        raise UnavailableError(
            f"{http1_message('parameter server 127.0.0.1:8000 (shard 0)')} (Failed parsing "
            "HTTP/2 (Expected SETTINGS frame as the first frame, got frame type 80))"
        )

    def close(self) -> None:
        self.closed = True


def test_a_worker_whose_shard_address_is_an_http_port_exits_at_once(capsys):
    """Not after --startup-timeout (60 s here): waiting would not make it speak gRPC."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    health = RecordingHealth()
    tier = ShardsAtAnHttpPort()
    try:
        code = _serve(tier, StoppedServer(), health, ["127.0.0.1:8000"], 60.0, 0.0)  # type: ignore[arg-type]
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert code == 1 and tier.checks == 1 and tier.closed
    assert health.calls == []  # never SERVING
    assert capsys.readouterr().err == (
        "embedding worker: error: parameter server 127.0.0.1:8000 (shard 0) answered in "
        "HTTP/1.x, not gRPC: is that an HTTP port (a prediction server's --http-port)? "
        "Parameter-server shards, embedding workers and prediction servers each listen on "
        "ports of their own; give the gRPC one (Failed parsing HTTP/2 (Expected SETTINGS "
        "frame as the first frame, got frame type 80))\n"
    )
