"""ParameterServerServicer in process (no network): validation, misses, serving state, chunks,
options and the CLI's argument checks."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from embedding_store import checkpoint_dump, checkpoint_manifest
from embedding_store.cli import main as cli_main
from embedding_store.config import (
    EmbeddingConfig,
    GlobalConfig,
    JobType,
    SlotConfig,
    global_config_from_mapping,
)
from embedding_store.errors import (
    CapacityError,
    CheckpointError,
    InvalidArgumentError,
    UnavailableError,
)
from embedding_store.grpc_common import LIVENESS_SERVICE, MAX_MESSAGE_BYTES, pack_f32, pack_u64
from embedding_store.hashing import shard_of
from embedding_store.initializer import InitializationConfig
from embedding_store.optimizers import SGD, Adagrad, Adam
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.proto import embedding_tier_pb2_grpc as pb_grpc
from embedding_store.ps_client import RemoteParameterServer
from embedding_store.ps_process import ParameterServerOptions, ParameterServerProcess
from embedding_store.ps_service import ParameterServerServicer
from embedding_store.ps_wire import (
    check_message_size,
    row_block_from_chunk,
    row_chunks,
    rows_per_chunk,
)
from embedding_store.shard import EmbeddingShard, RowBlock

CONFIG = EmbeddingConfig(slots_config={"a": SlotConfig(dim=4)})


class AbortedError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class FakeContext:
    def abort(self, code, details):
        raise AbortedError(code, details)

    def is_active(self) -> bool:
        return True


def servicer(
    read_only: bool = False, health_servicer: health.HealthServicer | None = None, **kwargs
) -> ParameterServerServicer:
    shard = EmbeddingShard(100, read_only=read_only, **kwargs)
    job = JobType.INFER if read_only else JobType.TRAIN
    return ParameterServerServicer(shard, CONFIG, job_type=job, health_servicer=health_servicer)


def aborted(method, request) -> AbortedError:
    with pytest.raises(AbortedError) as failure:
        method(request, FakeContext())
    return failure.value


def test_requests_are_validated_naming_the_field():
    s = servicer(optimizer=SGD())
    cases = [
        (s.Lookup, pb.LookupRequest(ids=b"\0" * 7, dim=4), "LookupRequest.ids: 7 bytes is not"),
        (s.Lookup, pb.LookupRequest(dim=0), "LookupRequest.dim must be > 0, got 0"),
        (s.Update, pb.UpdateRequest(ids=b"\0" * 8, dim=0), "UpdateRequest.dim must be > 0"),
        (
            s.Update,
            pb.UpdateRequest(ids=b"\0" * 16, grads=b"\0" * 16, dim=4),
            "UpdateRequest.grads: got 16 bytes, expected 32 for float32 [2, 4]",
        ),
        (
            s.Configure,
            pb.ConfigureRequest(adam=pb.Adam(lr=0.1, beta1=1.5)),
            "ConfigureRequest: adam.betas",
        ),
        (
            s.Configure,
            pb.ConfigureRequest(initialization=pb.Initialization(low=1, high=0)),
            "initialization.low",
        ),
        (s.Load, pb.ShardLoadRequest(), "ShardLoadRequest.directory"),
    ]
    for method, request, expected in cases:
        error = aborted(method, request)
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert expected in error.details
    # A dim the embedding config does not have: refused before any table is made for it (a
    # 17-byte request used to reserve 1024 x 3M floats for good, or fail with INTERNAL).
    for dim in (3_000_000, MAX_MESSAGE_BYTES // 4, 5):
        made_up = pb.LookupRequest(ids=pack_u64(np.zeros(1, np.uint64)), dim=dim, train=True)
        error = aborted(s.Lookup, made_up)
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            f"LookupRequest.dim is {dim}, but this shard's embedding config has rows of dims [4]"
            in (error.details)
        )
    assert s.shard.dims() == []
    with pytest.raises(CapacityError, match="split the request"):
        check_message_size(1 << 20, 1 << 10, "LookupRequest")


def test_lookup_reports_misses_and_admission_rejections():
    s = servicer(optimizer=SGD(), initialization=InitializationConfig(admit_probability=0.5))
    ids = np.arange(200, dtype=np.uint64)
    trained = s.Lookup(pb.LookupRequest(ids=pack_u64(ids), dim=4, train=True), FakeContext())
    held = s.shard.size()
    assert 0 < held < 200 and trained.misses == 200 - held
    answer = s.Lookup(pb.LookupRequest(ids=pack_u64(ids), dim=4), FakeContext())
    assert answer.misses == 200 - held
    assert len(answer.rows) == 200 * 4 * 4


def test_configure_update_and_serving_state():
    s = servicer()
    assert not s.serving
    ids = pack_u64(np.array([3], np.uint64))
    # Not configured (a shard restarted empty, say): its zeros would pass for embeddings.
    for train in (False, True):
        refused = aborted(s.Lookup, pb.LookupRequest(ids=ids, dim=4, train=train))
        assert (refused.code, refused.details) == (
            grpc.StatusCode.UNAVAILABLE,
            "this training parameter server has no optimizer configured yet (NOT_SERVING: "
            "started or restarted empty; a trainer's Configure, `recserve embedding-tier "
            "load` or --load-checkpoint sets one), so it has no rows to answer with",
        )
    assert s.shard.size() == 0
    request = pb.ConfigureRequest(sgd=pb.Sgd(lr=0.5))
    s.Configure(request, FakeContext())
    assert s.serving and s.shard.optimizer == SGD(lr=0.5)
    s.Lookup(pb.LookupRequest(ids=ids, dim=4, train=True), FakeContext())
    before = s.shard.export_rows(4).weights.copy()
    grads = pack_f32(np.ones((1, 4), np.float32))
    assert s.Update(pb.UpdateRequest(ids=ids, grads=grads, dim=4), FakeContext()).rows_updated == 1
    np.testing.assert_allclose(s.shard.export_rows(4).weights, before - 0.5)
    status = s.Status(pb.ShardStatusRequest(), FakeContext())
    assert status.serving and status.rows == 1 and status.job_type == "Train"
    assert '"name": "sgd"' in status.optimizer_json
    s.begin_shutdown()
    assert not s.serving


def test_lookups_and_updates_meant_for_another_replica_are_refused():
    """A shard restarted with another --replica-index (or listed at another place) holds
    another part of the table: it answered every ID of the replica it was taken for as
    unknown (zeros), and a server served predictions from them."""
    s = servicer(optimizer=SGD(), replica_index=0, replica_size=2)
    ids = pack_u64(np.array([3], np.uint64))
    grads = pack_f32(np.ones((1, 4), np.float32))
    requests = {
        s.Lookup: lambda **replica: pb.LookupRequest(ids=ids, dim=4, **replica),
        s.Update: lambda **replica: pb.UpdateRequest(ids=ids, grads=grads, dim=4, **replica),
    }
    for method, request in requests.items():
        refused = aborted(method, request(replica_index=1, replica_size=2))
        assert (refused.code, refused.details) == (
            grpc.StatusCode.UNAVAILABLE,
            "this parameter server is replica 0 of 2, but its client takes it for replica 1 "
            "of 2: it holds another part of the table (check the order of the shard "
            "addresses: the worker's --ps, or serve's --embedding-ps, and each shard's "
            "--replica-index)",
        )
        assert aborted(method, request(replica_index=0, replica_size=3)).code == (
            grpc.StatusCode.UNAVAILABLE
        )
        method(request(replica_index=0, replica_size=2), FakeContext())
        method(request(), FakeContext())  # a client that does not say (replica_size 0)


def test_non_finite_gradients_and_optimizer_state_are_refused_before_any_row_changes():
    # Workers skip NaN/Inf gradient rows, but any peer can call Update and ImportRows: one NaN
    # used to make the stored row NaN for good (served as NaN predictions from then on).
    s = servicer(optimizer=Adagrad(lr=0.1))
    ids = np.array([3, 4], np.uint64)
    s.Lookup(pb.LookupRequest(ids=pack_u64(ids), dim=4, train=True), FakeContext())
    before = s.shard.export_rows(4)
    grads = np.ones((2, 4), np.float32)
    grads[1, 2] = np.nan
    update = pb.UpdateRequest(ids=pack_u64(ids), grads=pack_f32(grads), dim=4)
    error = aborted(s.Update, update)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "UpdateRequest.grads: 1 row(s) hold NaN or Inf, the first row 1 (ID 4)" in error.details
    grads[1, 2] = np.inf
    update = pb.UpdateRequest(ids=pack_u64(ids), grads=pack_f32(grads), dim=4)
    assert "NaN or Inf" in aborted(s.Update, update).details
    # Optimizer state imported over ImportRows: the next update would read it.
    state = np.full((2, 4), np.nan, np.float32)
    chunk = pb.RowChunk(
        dim=4,
        ids=pack_u64(ids),
        weights=pack_f32(np.ones((2, 4), np.float32)),
        state=pack_f32(state),
        state_width=4,
        has_state=True,
    )
    error = aborted(s.ImportRows, iter([chunk]))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "block.state has NaN values" in error.details
    state = np.full((2, 4), -np.inf, np.float32)  # a negative accumulator
    chunk.state = pack_f32(state)
    error = aborted(s.ImportRows, iter([chunk]))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "adagrad accumulators must be >= 0, but row 0 holds -inf" in error.details
    after = s.shard.export_rows(4)
    np.testing.assert_array_equal(after.weights, before.weights)
    np.testing.assert_array_equal(after.state, before.state)
    assert np.isfinite(s.shard.lookup(ids, 4, train=False)).all()


def test_inference_shard_serves_only_once_it_has_rows(tmp_path):
    s = servicer(read_only=True)
    assert not s.serving
    lookup = pb.LookupRequest(ids=pack_u64(np.arange(3, dtype=np.uint64)), dim=4)
    assert aborted(s.Lookup, lookup).code == grpc.StatusCode.UNAVAILABLE
    block = RowBlock(
        ids=np.arange(2, dtype=np.uint64), weights=np.ones((2, 4), np.float32), state=None
    )
    # Rows one by one from any peer are refused: it serves one checkpoint's rows, whole.
    refused = aborted(s.ImportRows, iter(row_chunks(block, 0)))
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "read-only: row imports are refused" in refused.details
    assert not s.serving
    source = EmbeddingShard(10)
    source.import_rows(block)
    checkpoint_dump.dump_embeddings([source], tmp_path / "ckpt", CONFIG)
    s.Load(pb.ShardLoadRequest(directory=str(tmp_path / "ckpt")), FakeContext())
    assert s.serving
    answer = s.Lookup(lookup, FakeContext())
    assert answer.misses == 1
    train = pb.LookupRequest(ids=lookup.ids, dim=4, train=True)
    assert aborted(s.Lookup, train).code == grpc.StatusCode.FAILED_PRECONDITION
    assert aborted(s.Clear, pb.ClearRequest()).code == grpc.StatusCode.FAILED_PRECONDITION
    missing = pb.ShardLoadRequest(directory="/nonexistent/checkpoint")
    assert aborted(s.Load, missing).code == grpc.StatusCode.FAILED_PRECONDITION


def test_row_chunks_round_trip_and_are_capped():
    rng = np.random.default_rng(0)
    block = RowBlock(
        ids=np.arange(10, dtype=np.uint64),
        weights=rng.standard_normal((10, 3)).astype(np.float32),
        state=rng.standard_normal((10, 7)).astype(np.float32),
    )
    chunks = list(row_chunks(block, 4))
    assert [len(row_block_from_chunk(c).ids) for c in chunks] == [4, 4, 2]
    back = [row_block_from_chunk(c) for c in chunks]
    np.testing.assert_array_equal(np.concatenate([b.weights for b in back]), block.weights)
    np.testing.assert_array_equal(np.concatenate([b.state for b in back]), block.state)
    assert all(b.weights.flags.writeable and b.ids.flags.writeable for b in back)
    assert rows_per_chunk(1 << 20, 0, 0) < 65_536  # 4 MiB rows: capped to fit one message
    assert rows_per_chunk(8, 0, 0) == 65_536
    no_state = RowBlock(ids=block.ids, weights=block.weights, state=None)
    assert all(row_block_from_chunk(c).state is None for c in row_chunks(no_state, 0))
    bad = pb.RowChunk(dim=3, ids=pack_u64(block.ids[:1]), weights=b"\0" * 12, state=b"\0" * 4)
    with pytest.raises(InvalidArgumentError, match=r"RowChunk\[2\]\.state must be empty"):
        row_block_from_chunk(bad, "RowChunk[2]")


def test_options_are_validated():
    with pytest.raises(InvalidArgumentError, match="replica_index must be in"):
        ParameterServerOptions(replica_index=2, replica_size=2)
    with pytest.raises(InvalidArgumentError, match="port must be in"):
        ParameterServerOptions(port=70000)
    with pytest.raises(InvalidArgumentError, match="grace_seconds"):
        ParameterServerOptions(grace_seconds=-1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--replica-index", "2", "--replica-size", "2", "--port", "0"],
            "must be < --replica-size",
        ),
        (["--replica-index", "0", "--replica-size", "0", "--port", "0"], "--replica-size"),
        (["--replica-index", "0", "--replica-size", "1", "--port", "99999"], "in 0..65535"),
        (["--replica-index", "0", "--replica-size", "1"], "--port"),
        (
            ["--replica-index", "0", "--replica-size", "1", "--port", "0", "--grace-seconds", "x"],
            "expected a number",
        ),
        (
            ["--replica-index", "0", "--replica-size", "1", "--port", "0", "--load-checkpoint", ""],
            "expected a non-empty value",
        ),
    ],
)
def test_cli_rejects_bad_flags(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["embedding-parameter-server", *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_process_in_process_with_adam_and_failed_infer_load(tmp_path):
    process = ParameterServerProcess(CONFIG, GlobalConfig(), ParameterServerOptions(port=0))
    process.start()
    try:
        with RemoteParameterServer(process.address, timeout=5) as client:
            client.configure(Adam(), InitializationConfig(seed=3))
            client.wait_for_serving(5)
            rows = client.lookup(np.arange(5, dtype=np.uint64), 4, train=True)
            assert rows.shape == (5, 4)
            assert client.status().optimizer["name"] == "adam"
    finally:
        process.stop(grace=0)

    infer = global_config_from_mapping(
        {
            "common_config": {
                "job_type": "Infer",
                "infer_config": {"embedding_checkpoint": str(tmp_path / "missing")},
            }
        }
    )
    failing = ParameterServerProcess(CONFIG, infer, ParameterServerOptions(port=0))
    failing.start()
    try:
        deadline = time.monotonic() + 10
        while not failing.stop_requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(failing.fatal_error, CheckpointError)
        assert not failing.servicer.serving
    finally:
        failing.stop(grace=0)


# --------------------------------------------------------------------------- progress
ADAGRAD = Adagrad(lr=0.1, initial_accumulator_value=0.2)


def trained(optimizer=ADAGRAD) -> ParameterServerServicer:
    """A training servicer with 3 rows of dim 4 and 5 rows of dim 8 (updated once)."""
    s = servicer(optimizer=optimizer, initialization=InitializationConfig(seed=5))
    for ids, dim in ((np.arange(3, dtype=np.uint64), 4), (np.arange(100, 105, dtype=np.uint64), 8)):
        s.shard.lookup(ids, dim, train=True)
        grads = np.linspace(-1, 1, ids.shape[0] * dim, dtype=np.float32).reshape(-1, dim)
        assert s.shard.update(ids, grads) == ids.shape[0]
    return s


def task_of(s: ParameterServerServicer) -> tuple[str, float]:
    status = s.Status(pb.ShardStatusRequest(), FakeContext())
    return status.task, status.task_progress


def test_dump_and_load_report_their_progress_in_status(tmp_path):
    source = trained()
    seen = []

    def hook(done: int, total: int) -> None:  # runs inside the task: Status shows it
        seen.append((done, total, *task_of(source)))

    entries = source.dump_part(str(tmp_path / "ckpt"), progress=hook)
    # one file per dim, in dim order: 3 of 8 rows after dim 4, all 8 after dim 8
    assert seen == [(3, 8, "dumping", 0.375), (8, 8, "dumping", 1.0)]
    assert task_of(source) == ("", 0.0)
    checkpoint_dump.finalize_checkpoint(tmp_path / "ckpt", CONFIG, 1, entries, ADAGRAD.to_dict())

    target = servicer(optimizer=ADAGRAD)
    seen.clear()
    source = target  # the hook reads the loading shard's Status
    assert target.load_checkpoint(str(tmp_path / "ckpt"), progress=hook) == 8
    assert seen == [(3, 8, "loading", 0.375), (8, 8, "loading", 1.0)]
    assert task_of(target) == ("", 0.0)


def test_a_second_task_is_refused_while_one_runs(tmp_path):
    s = trained()
    refused = []

    def hook(done: int, total: int) -> None:
        with pytest.raises(UnavailableError, match="busy dumping") as failure:
            s.dump_part(str(tmp_path / "other"))
        refused.append(failure.value)

    s.dump_part(str(tmp_path / "ckpt"), progress=hook)
    assert len(refused) == 2 and task_of(s) == ("", 0.0)


def test_expected_checkpoint_keeps_a_training_shard_not_serving_until_loaded(tmp_path):
    source = trained()
    entries = source.dump_part(str(tmp_path / "ckpt"))
    checkpoint_dump.finalize_checkpoint(tmp_path / "ckpt", CONFIG, 1, entries, ADAGRAD.to_dict())

    health_servicer = health.HealthServicer()
    s = servicer(health_servicer=health_servicer)  # no optimizer: a restarted shard

    def health_status() -> str:
        request = health_pb2.HealthCheckRequest(service="")
        answer = health_servicer.Check(request, FakeContext())
        return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)

    s.expect_checkpoint()
    ids = pack_u64(np.arange(3, dtype=np.uint64))
    grads = pack_f32(np.ones((3, 4), np.float32))
    for method, request in (
        (s.Lookup, pb.LookupRequest(ids=ids, dim=4, train=True)),
        (s.Lookup, pb.LookupRequest(ids=ids, dim=4)),
        (s.Update, pb.UpdateRequest(ids=ids, grads=grads, dim=4)),
        (s.Load, pb.ShardLoadRequest(directory=str(tmp_path / "ckpt"))),
        (s.Dump, pb.ShardDumpRequest(directory=str(tmp_path / "other"))),
    ):
        assert aborted(method, request).code == grpc.StatusCode.UNAVAILABLE, method
    block = RowBlock(
        ids=np.arange(2, dtype=np.uint64), weights=np.ones((2, 4), np.float32), state=None
    )
    assert aborted(s.ImportRows, iter(row_chunks(block, 0))).code == grpc.StatusCode.UNAVAILABLE
    assert not s.serving and health_status() == "NOT_SERVING"
    assert task_of(s) == ("loading", 0.0) and s.shard.size() == 0

    assert s.load_checkpoint(str(tmp_path / "ckpt"), expected=True, adopt_optimizer=True) == 8
    assert s.serving and health_status() == "SERVING" and task_of(s) == ("", 0.0)
    assert s.shard.optimizer == ADAGRAD  # adopted from the checkpoint, with its saved state
    for dim in (4, 8):
        want, got = source.shard.export_rows(dim), s.shard.export_rows(dim)
        np.testing.assert_array_equal(got.ids, want.ids)
        np.testing.assert_array_equal(got.weights.view(np.uint32), want.weights.view(np.uint32))
        np.testing.assert_array_equal(got.state.view(np.uint32), want.state.view(np.uint32))
    answer = s.Lookup(pb.LookupRequest(ids=ids, dim=4), FakeContext())
    np.testing.assert_array_equal(
        np.frombuffer(answer.rows, np.float32).reshape(3, 4), source.shard.export_rows(4).weights
    )


def test_a_configured_optimizer_is_kept_and_another_ones_state_dropped(tmp_path):
    source = trained()
    entries = source.dump_part(str(tmp_path / "ckpt"))
    checkpoint_dump.finalize_checkpoint(tmp_path / "ckpt", CONFIG, 1, entries, ADAGRAD.to_dict())
    s = servicer(optimizer=SGD(lr=0.5))
    s.expect_checkpoint()
    s.load_checkpoint(str(tmp_path / "ckpt"), expected=True, adopt_optimizer=True)
    assert s.shard.optimizer == SGD(lr=0.5) and s.serving
    np.testing.assert_array_equal(
        s.shard.export_rows(8).weights, source.shard.export_rows(8).weights
    )


# --------------------------------------------------------------------------- metrics
def test_metrics_split_lookups_by_mode_so_the_miss_ratio_can_be_computed():
    s = servicer(optimizer=SGD())

    def lookup(ids: list[int], train: bool) -> int:
        request = pb.LookupRequest(ids=pack_u64(np.array(ids, np.uint64)), dim=4, train=train)
        return s.Lookup(request, FakeContext()).misses

    assert lookup(list(range(10)), train=True) == 0
    assert lookup(list(range(5, 15)), train=False) == 5  # 10..14 unknown
    assert lookup([0, 0, 100], train=False) == 1
    assert lookup([20, 21, 22], train=True) == 0
    registry = s.metrics.registry

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"replica": "0", "replicas": "1", **labels})

    assert value("recserve_ps_lookups_total", mode="train") == 2
    assert value("recserve_ps_lookups_total", mode="eval") == 2
    assert value("recserve_ps_ids_looked_up_total", mode="train") == 13
    assert value("recserve_ps_ids_looked_up_total", mode="eval") == 13
    assert value("recserve_ps_misses_total") == 6
    assert value("recserve_ps_rows") == 13
    help_text = {m.name: m.documentation for m in registry.collect()}
    assert 'recserve_ps_ids_looked_up_total{mode="eval"}' in help_text["recserve_ps_misses"]


# --------------------------------------------------------------------------- load at start
def test_load_checkpoint_option_is_only_for_training_shards():
    with pytest.raises(InvalidArgumentError, match="load_checkpoint must be a non-empty path"):
        ParameterServerOptions(load_checkpoint=" ")
    infer = global_config_from_mapping({"common_config": {"job_type": "Infer"}})
    with pytest.raises(InvalidArgumentError, match=r"load_checkpoint \('/ckpt'\) is for job_type"):
        ParameterServerProcess(CONFIG, infer, ParameterServerOptions(load_checkpoint="/ckpt"))


def test_training_process_loads_its_checkpoint_at_start(tmp_path):
    source = trained()
    entries = source.dump_part(str(tmp_path / "ckpt"))
    checkpoint_dump.finalize_checkpoint(tmp_path / "ckpt", CONFIG, 1, entries, ADAGRAD.to_dict())
    options = ParameterServerOptions(port=0, load_checkpoint=str(tmp_path / "ckpt"))
    process = ParameterServerProcess(CONFIG, GlobalConfig(), options)
    process.start()
    try:
        with RemoteParameterServer(process.address, timeout=5) as client:
            client.wait_for_serving(10)
            status = client.status()
            assert (status.rows, status.optimizer, status.task) == (8, ADAGRAD.to_dict(), "")
            got = client.lookup(np.arange(100, 105, dtype=np.uint64), 8, train=False)
            np.testing.assert_array_equal(got, source.shard.export_rows(8).weights)
    finally:
        process.stop(grace=0)

    failing = ParameterServerProcess(
        CONFIG, GlobalConfig(), ParameterServerOptions(port=0, load_checkpoint=str(tmp_path))
    )
    failing.start()
    try:
        deadline = time.monotonic() + 10
        while not failing.stop_requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(failing.fatal_error, CheckpointError)
        assert "no DONE marker" in str(failing.fatal_error)
        assert not failing.servicer.serving
    finally:
        failing.stop(grace=0)


def test_malformed_protobufs_are_invalid_argument_not_internal():
    """gRPC answers INTERNAL when its deserializer fails; the services parse requests in
    their handlers, unary and streamed, so a peer's garbage is named as such."""
    process = ParameterServerProcess(CONFIG, GlobalConfig(), ParameterServerOptions(port=0))
    process.start()
    try:
        with grpc.insecure_channel(process.address) as channel:
            raw = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
            service = "/recserve.embedding.v1.ParameterServer"
            with pytest.raises(grpc.RpcError) as lookup:
                channel.unary_unary(f"{service}/Lookup", **raw)(b"\x0a\xff", timeout=10)
            assert lookup.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert lookup.value.details().startswith("malformed LookupRequest: ")
            with pytest.raises(grpc.RpcError) as imported:
                channel.stream_unary(f"{service}/ImportRows", **raw)(
                    iter([b"\x12\xff"]), timeout=10
                )
            assert imported.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert imported.value.details().startswith("malformed RowChunk: ")
            process.servicer.shard.configure(optimizer=SGD())  # a training shard's lookups wait
            good = pb.LookupRequest(ids=pack_u64(np.arange(3, dtype=np.uint64)), dim=4)
            answer = channel.unary_unary(f"{service}/Lookup", **raw)(
                good.SerializeToString(), timeout=10
            )
            assert len(pb.LookupResponse.FromString(answer).rows) == 3 * 4 * 4
        # Each counted once in rpc_errors_total, as the method's own failures are (the
        # unary one fails before the method, the streamed one inside it).
        value = process.servicer.metrics.registry.get_sample_value
        for method in ("Lookup", "ImportRows"):
            errors = {"method": method, "code": "INVALID_ARGUMENT"}
            assert value("recserve_ps_rpc_errors_total", errors) == 1.0, method
    finally:
        process.stop(grace=0)


def test_a_shard_dumps_only_into_a_new_directory(tmp_path):
    """A direct Dump must not rewrite a published checkpoint's files under its manifest
    (it could then not be loaded: only a whole new checkpoint replaces one), nor another
    dump's part."""
    s = trained()
    root = tmp_path / "ckpt"
    entries = s.dump_part(str(root))
    checkpoint_dump.finalize_checkpoint(root, CONFIG, 1, entries, ADAGRAD.to_dict())
    published = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    failure = aborted(s.Dump, pb.ShardDumpRequest(directory=str(root)))
    assert failure.code == grpc.StatusCode.ALREADY_EXISTS
    assert failure.details == (
        f"{root} is a published checkpoint (it has DONE): a shard writes its part only into "
        "a new directory"
    )
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == published
    checkpoint_manifest.read_manifest(root)  # still whole
    staging = tmp_path / "staging"
    s.dump_part(str(staging))
    failure = aborted(s.Dump, pb.ShardDumpRequest(directory=str(staging)))
    assert failure.details == (
        f"{staging / 'shard_00000'} already holds files: a shard writes only a new part"
    )


def test_a_shard_refuses_to_dump_rows_no_load_would_take(tmp_path):
    """The check runs in the shard, on its own rows (a Dump RPC of a distributed dump, or
    the dump on exit): FAILED_PRECONDITION naming the first bad row, and no part left."""
    s = servicer(optimizer=SGD(lr=1e30))  # a learning rate far too high
    ids = np.arange(3, dtype=np.uint64)
    s.shard.lookup(ids, 4, train=True)
    s.shard.update(ids, np.array([[0, 0, 0, 0], [0, 0, 1e10, 0], [0, 0, 0, 0]], np.float32))
    failure = aborted(s.Dump, pb.ShardDumpRequest(directory=str(tmp_path / "staging")))
    assert failure.code == grpc.StatusCode.FAILED_PRECONDITION
    assert failure.details.startswith(
        "embedding shard 0 cannot be dumped: the weights of its rows of dim 4 hold 1 "
        "non-finite value(s) (NaN or Inf), the first at [1, 2]: -inf (the row of ID 1). "
    )
    assert list((tmp_path / "staging").iterdir()) == []
    assert task_of(s) == ("", 0.0)


def test_a_failed_row_export_is_counted_and_timed_like_unary_calls():
    s = servicer(optimizer=SGD())
    s.Lookup(pb.LookupRequest(ids=pack_u64(np.arange(3, dtype=np.uint64)), dim=4, train=True),
             FakeContext())  # fmt: skip

    def export_all() -> dict[int, RowBlock]:
        raise UnavailableError("the shard is going away")

    s.shard.export_all = export_all  # type: ignore[method-assign]
    with pytest.raises(AbortedError) as failure:
        list(s.ExportRows(pb.ExportRowsRequest(), FakeContext()))
    assert failure.value.code == grpc.StatusCode.UNAVAILABLE
    value = s.metrics.registry.get_sample_value
    errors = "recserve_ps_rpc_errors_total"
    assert value(errors, {"method": "ExportRows", "code": "UNAVAILABLE"}) == 1
    assert value(errors, {"method": "Lookup", "code": "UNAVAILABLE"}) == 0
    assert value("recserve_ps_rpc_latency_seconds_count", {"method": "ExportRows"}) == 1


def test_the_client_refuses_bad_arguments_before_calling_the_shard():
    with RemoteParameterServer("127.0.0.1:1", timeout=5) as client:  # nothing listens there
        ids = np.array([1, 2, 3], dtype=np.uint64)
        with pytest.raises(InvalidArgumentError, match=r"dim must be < 2\*\*32, got 4294967296"):
            client.lookup(ids, 2**32, train=False)
        with pytest.raises(InvalidArgumentError, match="dim must be a positive integer"):
            client.lookup(ids, 0, train=False)
        with pytest.raises(
            InvalidArgumentError, match=r"grads must have shape \[3, dim >= 1\] to match ids"
        ):
            client.update(ids, np.zeros((2, 4), dtype=np.float32))


class _RecordingStub:
    """A ParameterServer stub whose Dump and Load answer at once, recording their deadline."""

    def __init__(self) -> None:
        self.timeouts: list[tuple[str, float | None]] = []

    def Dump(self, request, timeout=None):
        self.timeouts.append(("dump", timeout))
        return pb.ShardDumpResponse()

    def Load(self, request, timeout=None):
        self.timeouts.append(("load", timeout))
        return pb.ShardLoadResponse(rows_loaded=7)


def test_dump_and_load_take_the_deadline_they_are_given_else_the_checkpoint_timeout():
    with RemoteParameterServer("127.0.0.1:1", timeout=5, checkpoint_timeout=123) as client:
        client._stub = stub = _RecordingStub()
        assert client.dump("/d", timeout=2.5) == ([], None)
        client.dump("/d")
        assert client.load("/d", timeout=3.5) == 7
        client.load("/d")
    assert stub.timeouts == [("dump", 2.5), ("dump", 123.0), ("load", 3.5), ("load", 123.0)]


def test_a_lookup_whose_answer_cannot_fit_is_refused_before_any_row_is_made():
    big = EmbeddingConfig(slots_config={"wide": SlotConfig(dim=65536)})
    shard = EmbeddingShard(10_000, optimizer=SGD())
    s = ParameterServerServicer(shard, big, job_type=JobType.TRAIN)
    n = MAX_MESSAGE_BYTES // (4 * 65536) + 1  # one row more than a message carries
    request = pb.LookupRequest(ids=pack_u64(np.arange(n, dtype=np.uint64)), dim=65536, train=True)
    error = aborted(s.Lookup, request)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"LookupRequest: {n} rows x dim 65536" in error.details
    assert shard.size() == 0 and shard.dims() == []


def test_a_read_only_shard_refuses_updates_for_good_even_before_it_has_rows():
    s = servicer(read_only=True, optimizer=SGD())
    assert not s.serving  # waiting for its checkpoint: lookups are UNAVAILABLE (retry) ...
    ids = pack_u64(np.arange(2, dtype=np.uint64))
    assert aborted(s.Lookup, pb.LookupRequest(ids=ids, dim=4)).code == (grpc.StatusCode.UNAVAILABLE)
    # ... but an update never succeeds on it: FAILED_PRECONDITION, not a retryable UNAVAILABLE
    update = pb.UpdateRequest(ids=ids, grads=pack_f32(np.ones((2, 4), np.float32)), dim=4)
    error = aborted(s.Update, update)
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "read-only: updates are refused" in error.details


def test_a_chunk_without_state_must_not_claim_a_state_width():
    chunk = pb.RowChunk(
        dim=3, ids=pack_u64(np.arange(1, dtype=np.uint64)), weights=b"\0" * 12, state_width=7
    )
    with pytest.raises(InvalidArgumentError, match=r"RowChunk\.state must be empty.*state_width 7"):
        row_block_from_chunk(chunk)


def test_imported_rows_of_a_dim_the_config_lacks_are_refused():
    s = servicer(optimizer=SGD())
    block = RowBlock(
        ids=np.arange(2, dtype=np.uint64), weights=np.ones((2, 5), np.float32), state=None
    )
    error = aborted(s.ImportRows, iter(row_chunks(block, 0)))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "RowChunk[0].dim is 5, but this shard's embedding config has rows of dims [4]" in (
        error.details
    )
    assert s.shard.size() == 0 and s.shard.dims() == []


def test_non_finite_gradient_error_names_the_first_bad_row():
    s = servicer(optimizer=SGD())
    ids = np.array([3, 4, 5, 6], np.uint64)
    s.Lookup(pb.LookupRequest(ids=pack_u64(ids), dim=4, train=True), FakeContext())
    grads = np.ones((4, 4), np.float32)
    grads[1, 0] = np.inf
    grads[3, 3] = np.nan
    error = aborted(s.Update, pb.UpdateRequest(ids=pack_u64(ids), grads=pack_f32(grads), dim=4))
    assert "UpdateRequest.grads: 2 row(s) hold NaN or Inf, the first row 1 (ID 4)" in error.details


def test_health_checks_answer_while_every_rpc_thread_waits():
    """A shard whose RPC threads all wait (a long lookup, its lock held by a load) answers
    its probes from threads of their own: they queued behind those calls, and a liveness
    probe's timeout would restart the shard for being busy."""
    process = ParameterServerProcess(
        CONFIG, GlobalConfig(), ParameterServerOptions(port=0, max_workers=1)
    )
    process.start()
    entered, release = threading.Event(), threading.Event()
    stats = process.servicer.shard.stats

    def waiting_stats():
        entered.set()
        release.wait(10)
        return stats()

    process.servicer.shard.stats = waiting_stats  # what the Status RPC reads
    try:
        with grpc.insecure_channel(process.address) as channel:
            held = pb_grpc.ParameterServerStub(channel).Status.future(
                pb.ShardStatusRequest(), timeout=10
            )
            assert entered.wait(5)  # the one RPC thread waits
            checks = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest
            live = checks.Check(request(service=LIVENESS_SERVICE), timeout=2)
            assert live.status == health_pb2.HealthCheckResponse.SERVING
            ready = checks.Check(request(service=""), timeout=2)  # no optimizer yet
            assert ready.status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert not held.done()
            release.set()
            assert held.result(timeout=10).replica_size == 1
    finally:
        release.set()
        process.stop(grace=0)


def test_a_row_export_is_the_shard_at_one_instant_while_training_goes_on():
    """A full shard (5 rows of dim 4, then 5 of dim 8) exported while a train lookup of 5
    new dim-8 IDs evicts the dim-4 rows between the stream's chunks: the stream holds the
    rows as they were when it started, never more than the capacity. Dims copied one at a
    time gave 15 rows, 5 of them gone from the shard before the stream ended."""
    two_dims = EmbeddingConfig(slots_config={"a": SlotConfig(dim=4), "b": SlotConfig(dim=8)})
    s = ParameterServerServicer(
        EmbeddingShard(10, optimizer=Adam(lr=0.1)), two_dims, job_type=JobType.TRAIN
    )

    def train(ids: list[int], dim: int) -> None:
        request = pb.LookupRequest(ids=pack_u64(np.array(ids, np.uint64)), dim=dim, train=True)
        s.Lookup(request, FakeContext())

    train([3, 1, 4, 0, 2], 4)
    train([100, 101, 102, 103, 104], 8)
    before = {dim: s.shard.export_rows(dim) for dim in (4, 8)}
    stream = s.ExportRows(pb.ExportRowsRequest(max_rows_per_chunk=2), FakeContext())
    first = row_block_from_chunk(next(stream))
    train([200, 201, 202, 203, 204], 8)
    assert s.shard.stats().evictions == 5
    blocks = [first, *(row_block_from_chunk(chunk) for chunk in stream)]
    assert [(b.dim, len(b)) for b in blocks] == [(4, 2), (4, 2), (4, 1), (8, 2), (8, 2), (8, 1)]
    for dim, want in before.items():  # least recently used first, state and all
        mine = [b for b in blocks if b.dim == dim]
        assert [int(i) for b in mine for i in b.ids] == want.ids.tolist()
        np.testing.assert_array_equal(np.concatenate([b.weights for b in mine]), want.weights)
        np.testing.assert_array_equal(np.concatenate([b.state for b in mine]), want.state)
    assert before[4].ids.tolist() == [3, 1, 4, 0, 2]


def test_imported_rows_another_replica_owns_are_refused_naming_the_first():
    """Replica 1 of 2 takes only the rows the workers route to it (shard_of): another
    replica's would take room, never be looked up, and go into its checkpoint part."""
    s = ParameterServerServicer(
        EmbeddingShard(100, optimizer=SGD(), replica_index=1, replica_size=2),
        CONFIG,
        job_type=JobType.TRAIN,
    )
    ids = np.arange(10, dtype=np.uint64)
    owners = shard_of(ids, 2)
    assert owners.tolist() == [1, 1, 0, 1, 0, 0, 0, 1, 0, 0]

    def chunk(picked: np.ndarray) -> pb.RowChunk:
        weights = np.repeat(picked.astype(np.float32)[:, None], 4, axis=1)
        return next(row_chunks(RowBlock(ids=picked, weights=weights, state=None), 0))

    mine = ids[owners == 1]
    assert s.ImportRows(iter([chunk(mine)]), FakeContext()).rows_imported == 4
    error = aborted(s.ImportRows, iter([chunk(np.array([0, 2, 4, 1], np.uint64))]))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details == (
        "RowChunk[0].ids: 2 of 4 rows belong to other replicas (the first, ID 2, to replica 0 "
        "of 2); this parameter server is replica 1 of 2, which workers never ask for them: "
        "import each row into the replica that owns it (embedding_store.hashing.shard_of)"
    )
    block = s.shard.export_rows(4)
    assert block.ids.tolist() == mine.tolist()  # nothing of the refused chunk was taken
    np.testing.assert_array_equal(block.weights[:, 0], mine.astype(np.float32))
