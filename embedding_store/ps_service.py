"""The ``ParameterServer`` gRPC servicer: one :class:`EmbeddingShard` behind the service.

The servicer is thin: it decodes a request (packed arrays, checked against the field sizes;
see :mod:`embedding_store.ps_wire`), calls the one shard, and encodes the answer. Errors are
raised as :mod:`embedding_store.errors` classes and become status codes in
:func:`embedding_store.grpc_common.rpc_errors`; messages name the request field at fault
(``"LookupRequest.dim must be > 0, got 0"``).

Serving state. The health service (overall ``""`` and ``recserve.embedding.v1.ParameterServer``)
reports ``NOT_SERVING`` until the shard can answer: a training shard once an optimizer is
configured, an inference shard (``job_type: Infer``, read-only) once its checkpoint is loaded.
A training shard expecting a checkpoint (:meth:`ParameterServerServicer.expect_checkpoint`)
serves only once the load finished. While a shard waits for its checkpoint, its lookups are
answered ``UNAVAILABLE`` rather than with zeros (a training shard's updates too), and so are
a training shard's lookups until it has an optimizer (one restarted empty). Status
reports a running dump or load and its progress (fraction of rows written or read, per
file). The process around it (gRPC server, metrics, signals, dump on exit) is
:mod:`embedding_store.ps_process`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2

from embedding_store import checkpoint_dump, checkpoint_load, checkpoint_manifest
from embedding_store.checkpoint_task import CheckpointTask
from embedding_store.config import EmbeddingConfig, JobType, embedding_config_to_mapping
from embedding_store.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    PermissionDeniedError,
    UnavailableError,
)
from embedding_store.grpc_common import (
    pack_f32,
    rpc_errors,
    rpc_stream_errors,
)
from embedding_store.hashing import shard_of
from embedding_store.optimizer_wire import configure_request_to_settings
from embedding_store.proto import embedding_tier_pb2 as pb
from embedding_store.proto import embedding_tier_pb2_grpc as pb_grpc
from embedding_store.ps_metrics import ParameterServerMetrics
from embedding_store.ps_wire import (
    check_message_size,
    decode_ids,
    decode_rows,
    encode_missing,
    positive_dim,
    require_finite_rows,
    row_block_from_chunk,
    row_chunks,
)
from embedding_store.rpc_metrics import observed, observed_stream
from embedding_store.shard import EmbeddingShard, RowBlock

log = logging.getLogger(__name__)

#: Full name of the gRPC service (health checks and reflection use it).
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
#: How a shard that has yet to load its --load-checkpoint answers (UNAVAILABLE) a lookup or an
#: update, before it applies anything: clients may send an update again once it is loaded.
NOT_LOADED_YET = "has not loaded its embedding checkpoint yet"


def directory_under_root(
    directory: str, root: Path | None, *, field: str, flag: str, verb: str
) -> str:
    """The directory a Dump or Load RPC named, resolved (symlinks and ``..`` followed), if
    it lies under ``root`` (the root itself included); PermissionDeniedError naming the root
    otherwise. ``root`` None: any directory (the shard was started without that flag).

    The resolved path is the one to use: a symlink in the request's path, swapped to point
    elsewhere between this check and the files' writes or reads, is not followed again.
    """
    if root is None:
        return directory
    resolved = Path(directory).resolve()
    if not resolved.is_relative_to(root):
        raise PermissionDeniedError(
            f"{field} {directory} is outside {flag} {root}; this parameter server {verb} "
            f"only directories under it (name one under {root}, or start the parameter "
            f"servers with a {flag} that holds this one)"
        )
    return str(resolved)


def resolve_root(root: str | os.PathLike[str] | None) -> Path | None:
    """A ``--dump-root`` / ``--load-root`` as compared with requests' paths: resolved once,
    at start (None stays None: unrestricted)."""
    return None if root is None else Path(root).resolve()


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    """The ``ParameterServer`` service over one :class:`EmbeddingShard`.

    ``health`` (optional) is kept in step with :attr:`serving`. ``dump_root`` / ``load_root``
    (optional): the Dump / Load RPCs take only directories under them (symlinks resolved,
    PERMISSION_DENIED otherwise); the process's own dump on exit and load at start, which the
    operator named, are not restricted. Dump and Load run one at a time;
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
        dump_root: str | os.PathLike[str] | None = None,
        load_root: str | os.PathLike[str] | None = None,
    ) -> None:
        self.shard = shard
        # Where Dump writes and Load reads (None: anywhere): the directories come from the
        # network, and a shard's user may be able to write (or read) far more than the
        # checkpoint volume.
        self.dump_root = resolve_root(dump_root)
        self.load_root = resolve_root(load_root)
        self.embedding_config = embedding_config
        # The row widths peers may use: a made-up dim would make the shard allocate a table
        # for it (1024 rows at least, kept for good), or fail to allocate one at all.
        self._dims = frozenset(slot.dim for slot in embedding_config.slots_config.values())
        # Sent with every Status: workers check it against theirs. In the config's order,
        # never sorted: the slots' order gives their ID prefixes.
        self._config_json = json.dumps(embedding_config_to_mapping(embedding_config))
        self.job_type = job_type
        self.metrics = metrics or ParameterServerMetrics(shard.replica_index, shard.replica_size)
        self._health = health_servicer
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
            raise UnavailableError(f"this {kind} parameter server {NOT_LOADED_YET}")

    def _require_replica(self, index: int, size: int) -> None:
        """Refuse a lookup or update meant for another replica (``size`` 0: the client did
        not say). A shard restarted with another --replica-index, or listed at another place
        in the worker's --ps, holds another part of the table: it would answer every ID as
        unknown, with zeros, and train rows that are not its own."""
        ours = (self.shard.replica_index, self.shard.replica_size)
        if size and (index, size) != ours:
            raise UnavailableError(
                f"this parameter server is replica {ours[0]} of {ours[1]}, but its client "
                f"takes it for replica {index} of {size}: it holds another part of the table "
                "(check the order of the shard addresses: the worker's --ps, or serve's "
                "--embedding-ps, and each shard's --replica-index)"
            )

    def _require_owned(self, ids: np.ndarray, field: str) -> None:
        """Refuse imported rows (``ids`` uint64 [n]) that another replica owns
        (:func:`embedding_store.hashing.shard_of`): workers never ask this shard for them,
        so they would only take room (evicting rows that are asked for) and go into its
        checkpoint part, beside the owner's copy."""
        size = self.shard.replica_size
        if size == 1:
            return
        owners = shard_of(ids, size)
        foreign = np.flatnonzero(owners != self.shard.replica_index)
        if foreign.shape[0]:
            first = int(foreign[0])
            raise InvalidArgumentError(
                f"{field}: {foreign.shape[0]} of {ids.shape[0]} rows belong to other "
                f"replicas (the first, ID {int(ids[first])}, to replica {int(owners[first])} "
                f"of {size}); this parameter server is replica {self.shard.replica_index} of "
                f"{size}, which workers never ask for them: import each row into the replica "
                "that owns it (embedding_store.hashing.shard_of)"
            )

    def _require_configured(self) -> None:
        """Lookups of a training shard wait for its optimizer (NOT_SERVING until then). A
        shard restarted empty in place of one that held rows would answer every ID with
        zeros, as unknown: a server would serve predictions from them, reporting nothing
        but unknown IDs. Updates without an optimizer fail on their own."""
        if not self.shard.read_only and self.shard.optimizer is None:
            raise UnavailableError(
                "this training parameter server has no optimizer configured yet "
                "(NOT_SERVING: started or restarted empty; a trainer's Configure, "
                "`recserve embedding-tier load` or --load-checkpoint sets one), so it has "
                "no rows to answer with"
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

    def _progress(
        self, hook: checkpoint_manifest.ProgressHook | None
    ) -> checkpoint_manifest.ProgressHook:
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
        progress: checkpoint_manifest.ProgressHook | None = None,
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
            checkpoint_load.load_into_shard(
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
        progress: checkpoint_manifest.ProgressHook | None = None,
        wait: float = 0.0,
    ) -> list[checkpoint_manifest.FileEntry]:
        """Write this shard's part of a checkpoint into ``directory/shard_{index:05d}/``.

        ``progress(rows_written, rows_total)`` is called after each file (one per dim), once
        Status shows the new progress. ``wait``: seconds to wait for a running dump or load
        to end first (0: refuse at once, as busy).
        """
        self._checkpoint_task.begin("dumping", wait=wait)
        try:
            entries = checkpoint_dump.write_shard_part(
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
        dim = positive_dim(value, field)
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
        self._require_replica(request.replica_index, request.replica_size)
        self._require_loaded()
        self._require_configured()
        rows = self.shard.lookup(ids, dim, train=request.train)
        # What this thread's lookup missed (the shard keeps it per thread): unknown IDs of an
        # eval lookup, IDs refused admission by a train lookup; and which positions they are,
        # so that a worker that deduplicated its IDs counts every occurrence.
        misses = self.shard.last_misses
        return pb.LookupResponse(
            rows=pack_f32(rows),
            misses=misses,
            missing=encode_missing(self.shard.last_missing),
            # A train lookup's: its gradients come back with it (UpdateRequest.generation).
            generation=(self.shard.last_generation or 0) if request.train else 0,
        )

    @rpc_errors
    @observed
    def Update(self, request: pb.UpdateRequest, context: grpc.ServicerContext) -> pb.UpdateResponse:
        dim = self._configured_dim(request.dim, "UpdateRequest.dim")
        ids = decode_ids(request.ids, "UpdateRequest.ids")
        grads = decode_rows(request.grads, ids.shape[0], dim, "UpdateRequest.grads")
        require_finite_rows(grads, ids, "UpdateRequest.grads")
        self._require_replica(request.replica_index, request.replica_size)
        if not self.shard.read_only:  # a read-only shard refuses updates for good, not for now
            self._require_loaded()
        # Refused (FAILED_PRECONDITION) when a load or clear replaced the rows since the
        # lookup whose generation it names (through any worker); 0: not said.
        rows = self.shard.update(ids, grads, generation=request.generation or None)
        return pb.UpdateResponse(rows_updated=rows)

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
        directory = directory_under_root(
            request.directory,
            self.dump_root,
            field="ShardDumpRequest.directory",
            flag="--dump-root",
            verb="dumps into",
        )
        entries = self.dump_part(directory)
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
        directory = directory_under_root(
            request.directory,
            self.load_root,
            field="ShardLoadRequest.directory",
            flag="--load-root",
            verb="loads from",
        )

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
        # lose its optimizer state); a configured one keeps its optimizer
        # (checkpoint_load.state_fits).
        rows = self.load_checkpoint(
            directory,
            adopt_optimizer=not self.shard.read_only,
            progress=stop_if_caller_gone,
        )
        return pb.ShardLoadResponse(rows_loaded=rows)

    @rpc_stream_errors
    @observed_stream
    def ExportRows(
        self, request: pb.ExportRowsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.RowChunk]:
        # Every dim copied at one instant, as a dump copies them: dims copied one at a time
        # while training goes on could hold, together, more rows than the capacity (rows of
        # a dim already sent evicted for rows of one not yet sent), which no shard of that
        # capacity takes back whole. Each dim's rows least recently used first, as
        # export_rows gives them, so an importer that takes them in order keeps their recency.
        for block in self.shard.export_all().values():
            if len(block) and context.is_active():
                assert block.state is not None and block.recency is not None  # export_all's
                order = np.argsort(block.recency)
                ordered = RowBlock(block.ids[order], block.weights[order], block.state[order])
                yield from row_chunks(ordered, request.max_rows_per_chunk)

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
            self._require_owned(block.ids, f"RowChunk[{index}].ids")
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
            embedding_config_json=self._config_json,
        )
