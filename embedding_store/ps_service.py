"""The parameter-server process: one :class:`EmbeddingShard` behind the ``ParameterServer`` gRPC
service, with health checking, server reflection, Prometheus metrics and graceful shutdown.

The servicer is thin: it decodes a request (packed arrays, checked against the field sizes),
calls the one shard, and encodes the answer. Errors are raised as :mod:`embedding_store.errors`
classes and become status codes in :func:`embedding_store.grpc_common.rpc_errors`; messages
name the request field at fault (``"LookupRequest.dim must be > 0, got 0"``).

Serving state. The health service (overall ``""`` and ``recserve.embedding.v1.ParameterServer``)
reports ``NOT_SERVING`` until the shard can answer: a training shard once an optimizer is
configured, an inference shard (``job_type: Infer``, read-only) once its checkpoint is loaded.
A training shard started with ``--load-checkpoint DIR`` loads its replica's part of that tier
checkpoint in the background, taking the checkpoint's optimizer and saved optimizer state
when none is configured, and serves only once the load finished. While a shard waits for its
checkpoint, its lookups are answered ``UNAVAILABLE`` rather than with zeros (a training shard's
updates too). Status reports a running dump or load and its progress (fraction of rows written
or read, per file). On SIGTERM/SIGINT the health service turns ``NOT_SERVING``, the server stops
accepting RPCs (new ones fail ``UNAVAILABLE``), in-flight RPCs get ``grace`` seconds to finish,
the shard part is optionally dumped, and the process exits 0.

The row-chunk conversions live here too and are shared with :mod:`embedding_store.ps_client`;
optimizer settings travel via :mod:`embedding_store.optimizer_wire`.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from embedding_store import checkpoint
from embedding_store.checkpoint_task import CheckpointTask
from embedding_store.config import EmbeddingConfig, GlobalConfig, JobType
from embedding_store.errors import (
    CapacityError,
    CheckpointError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)
from embedding_store.gc_tuning import freeze_long_lived_objects, space_out_young_collections
from embedding_store.grpc_common import (
    LIVENESS_SERVICE,
    MAX_MESSAGE_BYTES,
    MESSAGE_SLACK_BYTES,
    add_servicer,
    pack_f32,
    pack_u64,
    rpc_errors,
    rpc_stream_errors,
    server_interceptors,
    server_options,
    unpack_f32,
    unpack_u64,
)
from embedding_store.optimizer_wire import configure_request_to_settings
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.proto import embedding_tier_pb2_grpc as pb_grpc
from embedding_store.rpc_metrics import observed, observed_stream, rpc_metrics
from embedding_store.shard import EmbeddingShard, RowBlock

log = logging.getLogger(__name__)

#: Full name of the gRPC service (health checks and reflection use it).
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
#: Rows per ExportRows chunk when the request says 0.
DEFAULT_ROWS_PER_CHUNK = 65_536


# --------------------------------------------------------------------------- wire conversions
def _positive_dim(value: int, field: str) -> int:
    if value < 1:
        raise InvalidArgumentError(f"{field} must be > 0, got {value}")
    return int(value)


def _writable(array: np.ndarray) -> np.ndarray:
    """A writable copy of an array decoded from message bytes (those are read-only views)."""
    return array if array.flags.writeable else array.copy()


def decode_ids(payload: bytes, field: str) -> np.ndarray:
    """Packed uint64 IDs -> a writable uint64 [n] array; errors name ``field``."""
    return _writable(unpack_u64(payload, field))


def decode_rows(payload: bytes, n: int, width: int, field: str) -> np.ndarray:
    """Packed float32 [n, width] -> a writable array; errors name ``field``."""
    return _writable(unpack_f32(payload, (n, width), field))


def require_finite_rows(rows: np.ndarray, ids: np.ndarray, field: str) -> None:
    """InvalidArgumentError unless every value of ``rows`` (float32 [n, width], the rows of
    ``ids``) is finite, naming ``field``, the first bad row and its ID. One NaN or Inf in a
    gradient makes its row NaN for good (workers skip such rows; a peer must not send them)."""
    if np.isfinite(rows).all():
        return
    bad = np.flatnonzero(~np.isfinite(rows).all(axis=1))
    first = int(bad[0])
    raise InvalidArgumentError(
        f"{field}: {len(bad)} row(s) hold NaN or Inf, the first row {first} (ID "
        f"{int(ids[first])}); non-finite values would make the rows NaN for good"
    )


def check_message_size(n: int, width: int, what: str) -> None:
    """Refuse answers that would not fit in one gRPC message (before computing them)."""
    size = 4 * n * width
    if size > MAX_MESSAGE_BYTES - MESSAGE_SLACK_BYTES:
        raise CapacityError(
            f"{what}: {n} rows x dim {width} is {size} bytes of float32, more than one message "
            f"may carry ({MAX_MESSAGE_BYTES} bytes); split the request"
        )


def rows_per_chunk(dim: int, state_width: int, requested: int) -> int:
    """Rows per RowChunk: the requested number (0: default), capped to fit one message."""
    per_row = 8 + 4 * dim + 4 * state_width
    fit = max(1, (MAX_MESSAGE_BYTES - MESSAGE_SLACK_BYTES) // per_row)
    return min(requested or DEFAULT_ROWS_PER_CHUNK, fit)


def row_chunks(block: RowBlock, max_rows: int) -> Iterator[pb.RowChunk]:
    """Split one dim's rows into RowChunks of at most ``max_rows`` rows (requested; capped)."""
    dim = block.dim
    width = 0 if block.state is None else int(block.state.shape[1])
    step = rows_per_chunk(dim, width, max_rows)
    for start in range(0, len(block), step):
        stop = start + step
        yield pb.RowChunk(
            dim=dim,
            ids=pack_u64(block.ids[start:stop]),
            weights=pack_f32(block.weights[start:stop]),
            state=b"" if block.state is None else pack_f32(block.state[start:stop]),
            state_width=width,
            has_state=block.state is not None,
        )


def row_block_from_chunk(chunk: pb.RowChunk, field: str = "RowChunk") -> RowBlock:
    """Decode and check one RowChunk; errors name ``field`` (e.g. ``"RowChunk[3]"``)."""
    dim = _positive_dim(chunk.dim, f"{field}.dim")
    ids = decode_ids(chunk.ids, f"{field}.ids")
    n = ids.shape[0]
    weights = decode_rows(chunk.weights, n, dim, f"{field}.weights")
    if chunk.has_state:
        state = decode_rows(chunk.state, n, chunk.state_width, f"{field}.state")
    else:
        if chunk.state or chunk.state_width:
            raise InvalidArgumentError(
                f"{field}.state must be empty and {field}.state_width 0 when has_state is false, "
                f"got {len(chunk.state)} bytes and state_width {chunk.state_width}"
            )
        state = None
    return RowBlock(ids=ids, weights=weights, state=state)


# --------------------------------------------------------------------------- metrics
class _ShardCollector(Collector):
    """Shard counters read from :meth:`EmbeddingShard.stats` at scrape time (exact, no drift)."""

    def __init__(self, shard: EmbeddingShard, serving: Callable[[], bool], labels: dict) -> None:
        self._shard = shard
        self._serving = serving
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        stats = self._shard.stats()
        names, values = list(self._labels), list(self._labels.values())

        def counter(name: str, doc: str, value: int) -> CounterMetricFamily:
            family = CounterMetricFamily(f"recserve_ps_{name}", doc, labels=names)
            family.add_metric(values, value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"recserve_ps_{name}", doc, labels=names)
            family.add_metric(values, value)
            return family

        def by_mode(name: str, doc: str, train: int, eval_: int) -> CounterMetricFamily:
            family = CounterMetricFamily(f"recserve_ps_{name}", doc, labels=[*names, "mode"])
            family.add_metric([*values, "train"], train)
            family.add_metric([*values, "eval"], eval_)
            return family

        yield by_mode(
            "lookups",
            "Lookup calls by mode: train (may insert) or eval (eval and inference, never inserts).",
            stats.lookups - stats.eval_lookups,
            stats.eval_lookups,
        )
        yield by_mode(
            "ids_looked_up",
            "IDs looked up (per occurrence) by mode: train or eval (eval and inference).",
            stats.ids_looked_up - stats.eval_ids_looked_up,
            stats.eval_ids_looked_up,
        )
        yield counter(
            "misses",
            "Unknown IDs of eval/infer lookups, answered with zeros (miss ratio: "
            'recserve_ps_misses_total / recserve_ps_ids_looked_up_total{mode="eval"}).',
            stats.misses,
        )
        yield counter(
            "inserts",
            "Rows created by train lookups and row imports (not checkpoint loads: "
            "recserve_ps_rows_loaded_total).",
            stats.inserts,
        )
        yield counter(
            "rows_loaded", "Rows put in whole from embedding checkpoints.", stats.rows_loaded
        )
        yield counter("evictions", "Rows evicted by the LRU policy.", stats.evictions)
        yield counter(
            "rejected_admissions",
            "Unknown IDs of train lookups not admitted, answered with zeros (rejection ratio: "
            "recserve_ps_rejected_admissions_total / "
            'recserve_ps_ids_looked_up_total{mode="train"}).',
            stats.rejected_admissions,
        )
        yield counter("rows_updated", "Rows updated by the optimizer.", stats.updates)
        yield counter(
            "skipped_updates", "Update IDs the shard no longer held.", stats.skipped_updates
        )
        yield gauge("rows", "Rows held, all dims together.", stats.rows)
        yield gauge("capacity", "Row capacity of the shard.", stats.capacity)
        yield gauge(
            "serving", "1 when the shard is loaded/configured and serving.", self._serving()
        )


class ParameterServerMetrics:
    """The Prometheus metrics of one parameter server, in their own registry."""

    def __init__(self, replica_index: int, replica_size: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"replica": str(replica_index), "replicas": str(replica_size)}
        self.latency, self.errors = rpc_metrics(self.registry, "recserve_ps", "ParameterServer")

    def watch_shard(self, shard: EmbeddingShard, serving: Callable[[], bool]) -> None:
        self.registry.register(_ShardCollector(shard, serving, self.labels))


# --------------------------------------------------------------------------- servicer
class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    """The ``ParameterServer`` service over one :class:`EmbeddingShard`.

    ``health`` (optional) is kept in step with :attr:`serving`. Dump and Load run one at a time;
    a second one while one runs is refused with UNAVAILABLE (retry later). While one runs,
    Status reports its task (``"dumping"`` / ``"loading"``) and its progress: the fraction of
    the rows written / read so far, advanced after each file.
    """

    def __init__(
        self,
        shard: EmbeddingShard,
        embedding_config: EmbeddingConfig,
        *,
        job_type: JobType = JobType.TRAIN,
        metrics: ParameterServerMetrics | None = None,
        health_servicer: health.HealthServicer | None = None,
    ) -> None:
        self.shard = shard
        self.embedding_config = embedding_config
        # The row widths peers may use: a made-up dim would make the shard allocate a table
        # for it (1024 rows at least, kept for good), or fail to allocate one at all.
        self._dims = frozenset(slot.dim for slot in embedding_config.slots_config.values())
        self.job_type = job_type
        self.metrics = metrics or ParameterServerMetrics(shard.replica_index, shard.replica_size)
        self._health = health_servicer
        # Only lookups change the shard's miss/rejection counters: serializing lookups around
        # two stats() reads makes the per-call delta exact (the shard's own lock serializes
        # lookups anyway).
        self._lookup_lock = threading.Lock()
        self._checkpoint_task = CheckpointTask("parameter server")
        self._loaded = False
        # Set by expect_checkpoint(): a training shard started with a checkpoint to load serves
        # (and answers lookups and updates) only once that load finished.
        self._checkpoint_expected = False
        self._shutting_down = False
        self.metrics.watch_shard(shard, lambda: self.serving)
        self._refresh_health()

    # ------------------------------------------------------------------ state
    @property
    def needs_checkpoint(self) -> bool:
        """Inference shards, and training shards started with a checkpoint to load
        (:meth:`expect_checkpoint`), serve only once a checkpoint is loaded."""
        return self.shard.read_only or self._checkpoint_expected

    @property
    def serving(self) -> bool:
        if self._shutting_down:
            return False
        if self.needs_checkpoint and not self._loaded:
            return False
        return self.shard.read_only or self.shard.optimizer is not None

    def _require_loaded(self) -> None:
        if self.needs_checkpoint and not self._loaded:
            kind = "inference" if self.shard.read_only else "training"
            raise UnavailableError(
                f"this {kind} parameter server has not loaded its embedding checkpoint yet"
            )

    def _refresh_health(self) -> None:
        if self._health is None or self._shutting_down:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self._health.set("", status)
        self._health.set(SERVICE_NAME, status)

    def begin_shutdown(self) -> None:
        """Health NOT_SERVING from now on (in-flight and new RPCs are still answered)."""
        self._shutting_down = True
        if self._health is not None:
            self._health.enter_graceful_shutdown()

    def _progress(self, hook: checkpoint.ProgressHook | None) -> checkpoint.ProgressHook:
        """A checkpoint progress hook that stores ``done / total`` (capped to [0, 1]) as the
        running task's progress for Status, then calls ``hook`` (if any)."""

        def report(done: int, total: int) -> None:
            self._checkpoint_task.set_progress(done, total)
            if hook is not None:
                hook(done, total)

        return report

    def expect_checkpoint(self) -> None:
        """Announce a checkpoint load that :meth:`load_checkpoint` (``expected=True``) will run,
        typically on another thread, before the server starts: from now until it succeeds the
        shard is NOT_SERVING, lookups and updates are UNAVAILABLE, Status reports the task
        ``"loading"``, and Load/Dump RPCs are refused as busy."""
        self._checkpoint_task.begin("loading")
        self._checkpoint_expected = True
        self._refresh_health()

    def load_checkpoint(
        self,
        directory: str,
        *,
        expected: bool = False,
        adopt_optimizer: bool = False,
        progress: checkpoint.ProgressHook | None = None,
    ) -> int:
        """Replace the shard's rows by its part of checkpoint ``directory``; rows loaded.

        ``expected``: the load announced by :meth:`expect_checkpoint` (its task is running).
        ``adopt_optimizer``: a shard without an optimizer takes the checkpoint's, with the
        saved optimizer state (a restarted training shard). ``progress(rows_read,
        rows_total)`` is called after each file, once Status shows the new progress.
        """
        if not expected:
            self._checkpoint_task.begin("loading")
        try:
            checkpoint.load_into_shard(
                directory,
                self.shard,
                self.embedding_config,
                replica_index=self.shard.replica_index,
                replica_size=self.shard.replica_size,
                adopt_optimizer=adopt_optimizer,
                progress=self._progress(progress),
            )
            self._loaded = True
        finally:
            self._checkpoint_task.end()
        self._refresh_health()
        rows = self.shard.size()
        log.info(
            "loaded %d rows from embedding checkpoint %s (version %s)",
            rows,
            directory,
            self.shard.checkpoint_version,
        )
        return rows

    def checkpoint_task_state(self) -> tuple[str, float]:
        """The running checkpoint task ("dumping", "loading" or "") and its progress."""
        return self._checkpoint_task.state()

    def dump_part(
        self,
        directory: str,
        *,
        progress: checkpoint.ProgressHook | None = None,
        wait: float = 0.0,
    ) -> list[checkpoint.FileEntry]:
        """Write this shard's part of a checkpoint into ``directory/shard_{index:05d}/``.

        ``progress(rows_written, rows_total)`` is called after each file (one per dim), once
        Status shows the new progress. ``wait``: seconds to wait for a running dump or load
        to end first (0: refuse at once, as busy).
        """
        self._checkpoint_task.begin("dumping", wait=wait)
        try:
            entries = checkpoint.write_shard_part(
                self.shard,
                directory,
                self.shard.replica_index,
                progress=self._progress(progress),
            )
        finally:
            self._checkpoint_task.end()
        log.info(
            "dumped %d rows in %d files into %s",
            sum(e.rows for e in entries),
            len(entries),
            directory,
        )
        return entries

    def _configured_dim(self, value: int, field: str) -> int:
        """``value`` if it is a row width of the shard's embedding config (or of rows it
        holds, loaded from a checkpoint), else InvalidArgumentError naming ``field``."""
        dim = _positive_dim(value, field)
        if dim not in self._dims and dim not in self.shard.dims():  # or a checkpoint's
            raise InvalidArgumentError(
                f"{field} is {dim}, but this shard's embedding config has rows of dims "
                f"{sorted(self._dims)}: is the peer using another embedding_config.yml?"
            )
        return dim

    def _optimizer_json(self) -> str:
        optimizer = self.shard.optimizer
        return "" if optimizer is None else json.dumps(optimizer.to_dict(), sort_keys=True)

    # ------------------------------------------------------------------ RPCs
    @rpc_errors
    @observed
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        dim = self._configured_dim(request.dim, "LookupRequest.dim")
        ids = decode_ids(request.ids, "LookupRequest.ids")
        check_message_size(ids.shape[0], dim, "LookupRequest")
        self._require_loaded()
        with self._lookup_lock:
            before = self.shard.stats()
            rows = self.shard.lookup(ids, dim, train=request.train)
            after = self.shard.stats()
        misses = (after.misses - before.misses) + (
            after.rejected_admissions - before.rejected_admissions
        )
        return pb.LookupResponse(rows=pack_f32(rows), misses=misses)

    @rpc_errors
    @observed
    def Update(self, request: pb.UpdateRequest, context: grpc.ServicerContext) -> pb.UpdateResponse:
        dim = self._configured_dim(request.dim, "UpdateRequest.dim")
        ids = decode_ids(request.ids, "UpdateRequest.ids")
        grads = decode_rows(request.grads, ids.shape[0], dim, "UpdateRequest.grads")
        require_finite_rows(grads, ids, "UpdateRequest.grads")
        if not self.shard.read_only:  # a read-only shard refuses updates for good, not for now
            self._require_loaded()
        return pb.UpdateResponse(rows_updated=self.shard.update(ids, grads))

    @rpc_errors
    @observed
    def Configure(
        self, request: pb.ConfigureRequest, context: grpc.ServicerContext
    ) -> pb.ConfigureResponse:
        optimizer, initialization = configure_request_to_settings(request)
        self.shard.configure(optimizer=optimizer, initialization=initialization)
        if optimizer is not None:
            log.info("optimizer configured: %s", self._optimizer_json())
        if initialization is not None:
            log.info("initialization configured: %s", initialization.to_dict())
        self._refresh_health()
        return pb.ConfigureResponse()

    @rpc_errors
    @observed
    def Dump(
        self, request: pb.ShardDumpRequest, context: grpc.ServicerContext
    ) -> pb.ShardDumpResponse:
        if not request.directory:
            raise InvalidArgumentError("ShardDumpRequest.directory must be a non-empty path")
        entries = self.dump_part(request.directory)
        return pb.ShardDumpResponse(
            files=[pb.CheckpointFile(**entry.to_dict()) for entry in entries],
            optimizer_json=self._optimizer_json(),
        )

    @rpc_errors
    @observed
    def Load(
        self, request: pb.ShardLoadRequest, context: grpc.ServicerContext
    ) -> pb.ShardLoadResponse:
        if not request.directory:
            raise InvalidArgumentError("ShardLoadRequest.directory must be a non-empty path")

        def stop_if_caller_gone(_done: int, _total: int) -> None:
            # Called after each file read, so also after the last one, just before the rows
            # are swapped in: a caller that gave up (a worker whose own caller's deadline
            # passed, or that was killed) must not see the shard change afterwards.
            if not context.is_active():
                raise DeadlineExceededError(
                    f"load of {request.directory} abandoned: the caller gave up; this shard "
                    "keeps its rows"
                )

        # A training shard that no trainer configured yet takes the checkpoint's optimizer and
        # saved state, as --load-checkpoint does at start (re-sharding a training tier must not
        # lose its optimizer state); a configured one keeps its optimizer (checkpoint.state_fits).
        rows = self.load_checkpoint(
            request.directory,
            adopt_optimizer=not self.shard.read_only,
            progress=stop_if_caller_gone,
        )
        return pb.ShardLoadResponse(rows_loaded=rows)

    @rpc_stream_errors
    @observed_stream
    def ExportRows(
        self, request: pb.ExportRowsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.RowChunk]:
        for dim in self.shard.dims():
            block = self.shard.export_rows(dim)
            if len(block) and context.is_active():
                yield from row_chunks(block, request.max_rows_per_chunk)

    @rpc_errors
    @observed
    def ImportRows(
        self, request_iterator: Iterable[pb.RowChunk], context: grpc.ServicerContext
    ) -> pb.ImportRowsResponse:
        loading = self._checkpoint_task.state()[0] == "loading"
        if loading:  # the load replaces every row: imported ones would be lost
            raise UnavailableError(
                "the parameter server is busy loading a checkpoint; retry when it is done"
            )
        imported = 0
        for index, chunk in enumerate(request_iterator):
            block = row_block_from_chunk(chunk, f"RowChunk[{index}]")
            self._configured_dim(block.dim, f"RowChunk[{index}].dim")
            self.shard.import_rows(block)  # refused by inference (read-only) shards
            imported += len(block)
        return pb.ImportRowsResponse(rows_imported=imported)

    @rpc_errors
    @observed
    def Clear(self, request: pb.ClearRequest, context: grpc.ServicerContext) -> pb.ClearResponse:
        self.shard.clear()
        return pb.ClearResponse()

    @rpc_errors
    @observed
    def Status(
        self, request: pb.ShardStatusRequest, context: grpc.ServicerContext
    ) -> pb.ShardStatusResponse:
        stats = self.shard.stats()
        task, progress = self._checkpoint_task.state()
        return pb.ShardStatusResponse(
            replica_index=self.shard.replica_index,
            replica_size=self.shard.replica_size,
            rows=stats.rows,
            capacity=stats.capacity,
            read_only=self.shard.read_only,
            job_type=self.job_type.value,
            optimizer_json=self._optimizer_json(),
            serving=self.serving,
            lookups=stats.lookups,
            ids_looked_up=stats.ids_looked_up,
            misses=stats.misses,
            evictions=stats.evictions,
            task=task,
            task_progress=progress,
            checkpoint_version=self.shard.checkpoint_version,
        )


# --------------------------------------------------------------------------- process
def format_address(host: str, port: int) -> str:
    """``host:port``, with IPv6 hosts in brackets."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


@dataclass(frozen=True)
class ParameterServerOptions:
    """How to run one parameter-server replica (the CLI flags)."""

    replica_index: int = 0
    replica_size: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None
    dump_on_exit: str | None = None
    #: Training shards: at start, load this replica's part of this embedding checkpoint.
    load_checkpoint: str | None = None
    grace_seconds: float = 5.0
    max_workers: int = 16

    def __post_init__(self) -> None:
        if not (isinstance(self.replica_size, int) and self.replica_size >= 1):
            raise InvalidArgumentError(f"replica_size must be >= 1, got {self.replica_size!r}")
        if not (
            isinstance(self.replica_index, int) and 0 <= self.replica_index < self.replica_size
        ):
            raise InvalidArgumentError(
                f"replica_index must be in [0, {self.replica_size}), got {self.replica_index!r}"
            )
        if not self.host:
            raise InvalidArgumentError("host must be non-empty")
        if self.load_checkpoint is not None and not (
            isinstance(self.load_checkpoint, str) and self.load_checkpoint.strip()
        ):
            raise InvalidArgumentError(
                f"load_checkpoint must be a non-empty path, got {self.load_checkpoint!r}"
            )
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= 65535):
                raise InvalidArgumentError(f"{name} must be in 0..65535, got {value!r}")
        if not (math.isfinite(self.grace_seconds) and self.grace_seconds >= 0):
            raise InvalidArgumentError(f"grace_seconds must be >= 0, got {self.grace_seconds!r}")
        if self.max_workers < 1:
            raise InvalidArgumentError(f"max_workers must be >= 1, got {self.max_workers!r}")


def build_shard(global_config: GlobalConfig, options: ParameterServerOptions) -> EmbeddingShard:
    """The shard of a replica: capacity from the global config, read-only for Infer jobs, no
    optimizer until Configure."""
    ps_config = global_config.embedding_parameter_server_config
    return EmbeddingShard(
        ps_config.capacity,
        read_only=global_config.common_config.job_type is JobType.INFER,
        replica_index=options.replica_index,
        replica_size=options.replica_size,
        num_hashmap_internal_shards=ps_config.num_hashmap_internal_shards,
    )


class ParameterServerProcess:
    """One parameter-server replica in this process: gRPC server, health, reflection, metrics.

    :meth:`start` binds and returns at once. A checkpoint to load at start (an inference
    shard's ``infer_config.embedding_checkpoint``, or a training shard's
    ``options.load_checkpoint``) loads in the background while the shard is NOT_SERVING; a
    failed load is kept in :attr:`fatal_error` and requests shutdown. :meth:`stop` shuts down
    gracefully. Use :func:`serve_parameter_server` to run one until SIGTERM/SIGINT.
    """

    def __init__(
        self,
        embedding_config: EmbeddingConfig,
        global_config: GlobalConfig,
        options: ParameterServerOptions | None = None,
    ) -> None:
        self.embedding_config = embedding_config
        self.global_config = global_config
        self.options = options or ParameterServerOptions()
        self.job_type = global_config.common_config.job_type
        if self.options.load_checkpoint is not None and self.job_type is JobType.INFER:
            raise InvalidArgumentError(
                f"load_checkpoint ({self.options.load_checkpoint!r}) is for job_type Train; "
                "a job_type Infer shard loads common_config.infer_config.embedding_checkpoint"
            )
        self.shard = build_shard(global_config, self.options)
        self.metrics = ParameterServerMetrics(self.options.replica_index, self.options.replica_size)
        self.health = health.HealthServicer()
        self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self.servicer = ParameterServerServicer(
            self.shard,
            embedding_config,
            job_type=self.job_type,
            metrics=self.metrics,
            health_servicer=self.health,
        )
        self.server: grpc.Server | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.fatal_error: BaseException | None = None
        self.stop_requested = False  # set by signal handlers and fatal errors; no locks there
        self._metrics_httpd = None
        self._stopped = False

    @property
    def name(self) -> str:
        return f"replica {self.options.replica_index}/{self.options.replica_size}"

    @property
    def address(self) -> str:
        if self.port is None:
            raise FailedPreconditionError("the parameter server is not started")
        return format_address(self.options.host, self.port)

    def start(self) -> None:
        opts = self.options
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=opts.max_workers, thread_name_prefix="ps-rpc"),
            options=server_options(),
            interceptors=server_interceptors(),
        )
        add_servicer(server, self.servicer, "ParameterServer")
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        requested = format_address(opts.host, opts.port)
        try:
            port = server.add_insecure_port(requested)
        except RuntimeError as error:
            raise UnavailableError(f"cannot listen on {requested}: {error}") from None
        if not port:
            raise UnavailableError(f"cannot listen on {requested} (address in use?)")
        self.port = port
        self._start_metrics()
        directory, adopt_optimizer = self._checkpoint_at_start()
        if directory is not None:
            # Before the server answers anything: from its first RPC on, the shard reports
            # the load (NOT_SERVING, task "loading") and refuses lookups until it finished.
            self.servicer.expect_checkpoint()
        server.start()
        self.server = server
        log.info(
            "parameter server %s (%s, capacity %d rows) serving gRPC on %s",
            self.name,
            self.job_type.value,
            self.shard.capacity,
            self.address,
        )
        if directory is not None:
            self._start_load(directory, adopt_optimizer=adopt_optimizer)

    def _start_metrics(self) -> None:
        opts = self.options
        if opts.metrics_port is None:
            return
        if not self.global_config.common_config.metrics_config.enable_metrics:
            log.warning(
                "--metrics-port %d ignored: metrics_config.enable_metrics is false",
                opts.metrics_port,
            )
            return
        host = opts.host.strip("[]")
        try:
            httpd, _thread = start_http_server(
                opts.metrics_port, addr=host, registry=self.metrics.registry
            )
        except OSError as error:
            raise UnavailableError(
                f"cannot serve metrics on {format_address(opts.host, opts.metrics_port)}: {error}"
            ) from None
        self._metrics_httpd = httpd
        self.metrics_port = int(httpd.server_port)
        log.info("metrics on http://%s/metrics", format_address(opts.host, self.metrics_port))

    def _checkpoint_at_start(self) -> tuple[str | None, bool]:
        """The checkpoint to load at start (None: none) and whether to adopt its optimizer.

        Infer: ``infer_config.embedding_checkpoint`` (read-only rows, no optimizer state).
        Train: ``options.load_checkpoint``, with the checkpoint's optimizer and its saved state
        when none is configured yet (a restarted shard resumes where its dump left off).
        """
        if self.job_type is JobType.INFER:
            directory = self.global_config.common_config.infer_config.embedding_checkpoint
            if directory is None:
                log.warning(
                    "job_type Infer without infer_config.embedding_checkpoint: NOT_SERVING "
                    "until a Load RPC provides rows"
                )
            return directory, False
        return self.options.load_checkpoint, True

    def _start_load(self, directory: str, *, adopt_optimizer: bool) -> None:
        """Run the load announced by ``expect_checkpoint`` on a thread; failure is fatal."""

        def load() -> None:
            try:
                self.servicer.load_checkpoint(
                    directory, expected=True, adopt_optimizer=adopt_optimizer
                )
            except BaseException as error:
                if isinstance(error, CheckpointError) and self.job_type is JobType.INFER:
                    # The directory came from the global config: name the key too.
                    error = CheckpointError(
                        f"common_config.infer_config.embedding_checkpoint: {error.message}"
                    )
                log.error("loading embedding checkpoint %s failed: %s", directory, error)
                self.fatal_error = error
                self.stop_requested = True

        threading.Thread(target=load, name="ps-checkpoint-load", daemon=True).start()

    def stop(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, let in-flight RPCs finish (``grace`` s), dump if asked, close."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.options.grace_seconds if grace is None else grace
        self.servicer.begin_shutdown()
        if self.server is not None:
            self.server.stop(grace).wait()
        try:
            if self.options.dump_on_exit:
                self._dump_on_exit(self.options.dump_on_exit)
        finally:
            if self._metrics_httpd is not None:
                self._metrics_httpd.shutdown()
                self._metrics_httpd.server_close()
            log.info("parameter server %s stopped", self.name)

    def _dump_on_exit(self, directory: str) -> None:
        """Write this shard's part; a single replica's part is the whole checkpoint, so it also
        gets the manifest and done-marker and can be loaded as is.

        Nothing is written in place: a process killed mid-dump (its grace period over) must
        leave the previous dump whole. One replica: the checkpoint is written into a staging
        directory next to ``directory`` and renamed over it. Several: this replica's part is
        written into a staging directory and renamed over ``directory/shard_{index:05d}``.
        """
        target = Path(directory).absolute()
        running, _ = self.servicer.checkpoint_task_state()
        if running == "loading":
            # Stopped mid-load: the rows are (being) read from that checkpoint; a dump of a
            # half-loaded shard would be worth nothing.
            log.info("dump on exit skipped: a checkpoint load was still running")
            return
        if running:
            log.info(
                "waiting up to %.0f s for the running checkpoint dump to end before the "
                "dump on exit",
                EXIT_DUMP_WAIT_SECONDS,
            )
        if not self.shard.modified:
            # A shard restarted empty (or holding a checkpoint's rows as loaded) has nothing
            # to add, and writing it would replace the last copy of real rows with nothing.
            log.info(
                "dump on exit skipped: no row changed since this shard started or loaded a "
                "checkpoint (%d rows); %s is left as it is",
                self.shard.size(),
                target,
            )
            return
        if self.options.replica_size == 1:
            staging = checkpoint.staging_directory_for(target)
            try:
                entries = self.servicer.dump_part(str(staging), wait=EXIT_DUMP_WAIT_SECONDS)
                optimizer = self.shard.optimizer.to_dict() if self.shard.optimizer else None
                checkpoint.finalize_checkpoint(
                    staging, self.embedding_config, 1, entries, optimizer
                )
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            checkpoint.publish_directory(staging, target, overwrite=True)
            log.info("dump on exit published as %s", target)
            return
        part = target / checkpoint.shard_part_name(self.options.replica_index)
        staging = checkpoint.staging_directory_for(part)
        try:
            # Written as staging/shard_XXXXX, so only the rename below changes the name.
            self.servicer.dump_part(str(staging), wait=EXIT_DUMP_WAIT_SECONDS)
            checkpoint.publish_directory(
                staging / part.name, part, overwrite=True, only_checkpoints=False
            )
            log.info("dump on exit published as %s", part)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


#: How long a stopping shard waits for a checkpoint dump still running (an admin's
#: ``embedding-tier dump`` that outlasted the grace period) before its own dump on exit.
EXIT_DUMP_WAIT_SECONDS = 120.0


def serve_parameter_server(
    embedding_config: EmbeddingConfig,
    global_config: GlobalConfig,
    options: ParameterServerOptions | None = None,
    *,
    install_signal_handlers: bool = True,
    on_started: Callable[[ParameterServerProcess], Any] | None = None,
) -> int:
    """Run one replica until SIGTERM/SIGINT (or a fatal startup error); returns the exit code.

    Prints ``parameter server replica I/N listening on HOST:PORT`` (flushed) once bound.
    A failed inference checkpoint load is re-raised after shutdown (the CLI exits 1).
    """
    process = ParameterServerProcess(embedding_config, global_config, options)

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        if process.stop_requested:
            return
        process.stop_requested = True
        log.info("received %s: shutting down", signal.Signals(signum).name)

    if install_signal_handlers:
        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)
    process.start()
    freeze_long_lived_objects()  # see embedding_store.gc_tuning: no ~100 ms full collections
    space_out_young_collections()
    try:
        if process.metrics_port is not None:
            print(
                f"parameter server {process.name} metrics on "
                f"http://{format_address(process.options.host, process.metrics_port)}/metrics",
                flush=True,
            )
        print(f"parameter server {process.name} listening on {process.address}", flush=True)
        if on_started is not None:
            on_started(process)
        while not process.stop_requested:
            time.sleep(0.1)
    finally:
        process.stop()
    if process.fatal_error is not None:
        raise process.fatal_error
    return 0
